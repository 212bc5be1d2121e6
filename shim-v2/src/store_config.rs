//! A container's store settings for checkpoints by reference (`by_reference`), resolved once
//! at Create and kept on the container, so its checkpoints and its restore use the same store.
//!
//! Each setting comes from the first of: the container's annotation (the mode only), its
//! RuntimeClass's options (gpucr's keys in the runtime's `options` table of containerd's
//! config, which CRI sends as `runtimeoptions.v1.Options`), the shim's environment
//! (containerd's), the default. Each keeps where it came from, so that an error names what
//! to change.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::by_reference::{
    Mode, DEFAULT_STORE, MIN_BYTES_ENV, MODE_ANNOTATION, MODE_ENV, SHARED_ENV, STORE_ENV,
};
use crate::error::{Error, Result};

/// The runtime options' keys (Go-style names, as the rest of the table).
pub const MODE_OPTION: &str = "StoreMode";
pub const STORE_OPTION: &str = "Store";
pub const SHARED_OPTION: &str = "StoreShared";
pub const MIN_BYTES_OPTION: &str = "StoreMinBytes";
/// Files below this many bytes stay in the image.
const DEFAULT_MIN_BYTES: u64 = 1 << 20;

/// A RuntimeClass's store settings, checked when its options are decoded (so that a bad
/// value fails the shim's start, naming the key).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StoreOptions {
    pub mode: Option<Mode>,
    pub store: Option<PathBuf>,
    pub shared: Option<String>,
    pub min_bytes: Option<u64>,
}

impl StoreOptions {
    /// From the options table's values; an empty string leaves a setting unset, as in the
    /// environment.
    pub fn from_values(
        mode: &str,
        store: &str,
        shared: &str,
        min_bytes: Option<i64>,
    ) -> Result<StoreOptions> {
        let set = |v: &str| Some(v.trim().to_string()).filter(|v| !v.is_empty());
        let min_bytes = min_bytes
            .map(|n| {
                u64::try_from(n).map_err(|_| {
                    Error::invalid(format!(
                        "runtime option {MIN_BYTES_OPTION}={n}: a number of bytes, 0 or more"
                    ))
                })
            })
            .transpose()?;
        Ok(StoreOptions {
            mode: set(mode)
                .map(|v| parse_mode(&v, Source::Option(MODE_OPTION)))
                .transpose()?,
            store: set(store)
                .map(|v| store_dir(&v, Source::Option(STORE_OPTION)))
                .transpose()?,
            shared: set(shared)
                .map(|v| shared_store(v, Source::Option(SHARED_OPTION)))
                .transpose()?,
            min_bytes,
        })
    }
}

/// Where a setting came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The container's [`MODE_ANNOTATION`].
    Annotation,
    /// A key of the runtime's options table.
    Option(&'static str),
    /// A variable of the shim's environment.
    Env(&'static str),
    Default,
}

impl Source {
    /// `KEY="value"`, the way an error names a value.
    pub fn named(self, value: &str) -> String {
        match self {
            Source::Annotation => format!("{MODE_ANNOTATION}={value:?}"),
            Source::Option(key) => format!("runtime option {key}={value:?}"),
            Source::Env(var) => format!("{var}={value:?}"),
            Source::Default => format!("the default {value:?}"),
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Annotation => write!(f, "annotation {MODE_ANNOTATION}"),
            Source::Option(key) => write!(f, "runtime option {key}"),
            Source::Env(var) => write!(f, "{var} in containerd's environment"),
            Source::Default => f.write_str("the default"),
        }
    }
}

/// One container's store settings.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreConfig {
    pub mode: Mode,
    pub mode_from: Source,
    /// This node's store.
    pub dir: PathBuf,
    pub dir_from: Source,
    /// The shared store: a path or `s3://BUCKET[/PREFIX]`.
    pub shared: Option<(String, Source)>,
    pub min_bytes: u64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            mode: Mode::Inline,
            mode_from: Source::Default,
            dir: PathBuf::from(DEFAULT_STORE),
            dir_from: Source::Default,
            shared: None,
            min_bytes: DEFAULT_MIN_BYTES,
        }
    }
}

impl StoreConfig {
    /// The container's settings from its annotations, its runtime options and the shim's
    /// environment.
    pub fn resolve(
        annotations: &HashMap<String, String>,
        options: &StoreOptions,
    ) -> Result<StoreConfig> {
        Self::resolve_with(annotations, options, |var| std::env::var(var).ok())
    }

    fn resolve_with(
        annotations: &HashMap<String, String>,
        options: &StoreOptions,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<StoreConfig> {
        let env = |var: &'static str| {
            env(var)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
                .map(|v| (v, Source::Env(var)))
        };
        let d = StoreConfig::default();
        let (mode, mode_from) = match (annotations.get(MODE_ANNOTATION), options.mode) {
            (Some(v), _) => (parse_mode(v, Source::Annotation)?, Source::Annotation),
            (None, Some(m)) => (m, Source::Option(MODE_OPTION)),
            (None, None) => match env(MODE_ENV) {
                Some((v, from)) => (parse_mode(&v, from)?, from),
                None => (d.mode, d.mode_from),
            },
        };
        let (dir, dir_from) = match (&options.store, env(STORE_ENV)) {
            (Some(p), _) => (p.clone(), Source::Option(STORE_OPTION)),
            (None, Some((v, from))) => (PathBuf::from(v), from),
            (None, None) => (d.dir, d.dir_from),
        };
        let shared = match (&options.shared, env(SHARED_ENV)) {
            (Some(s), _) => Some((s.clone(), Source::Option(SHARED_OPTION))),
            (None, Some((v, from))) => Some((shared_store(v, from)?, from)),
            (None, None) => None,
        };
        let min_bytes = match (options.min_bytes, env(MIN_BYTES_ENV)) {
            (Some(n), _) => n,
            (None, Some((v, from))) => v.parse().map_err(|_| {
                Error::invalid(format!("{}: a number of bytes, 0 or more", from.named(&v)))
            })?,
            (None, None) => d.min_bytes,
        };
        Ok(StoreConfig {
            mode,
            mode_from,
            dir,
            dir_from,
            shared,
            min_bytes,
        })
    }

    pub fn shared(&self) -> Option<&str> {
        self.shared.as_ref().map(|(s, _)| s.as_str())
    }

    /// This node's store and where it was set, for messages.
    pub fn dir_label(&self) -> String {
        format!("{} ({})", self.dir.display(), self.dir_from)
    }
}

fn parse_mode(value: &str, from: Source) -> Result<Mode> {
    match value.trim() {
        "inline" => Ok(Mode::Inline),
        "local" => Ok(Mode::Local),
        "shared" => Ok(Mode::Shared),
        other => Err(Error::invalid(format!(
            "{}: the store mode is inline, local or shared",
            from.named(other)
        ))),
    }
}

/// The shim runs in the bundle: a relative store would be one per container.
fn store_dir(value: &str, from: Source) -> Result<PathBuf> {
    let path = Path::new(value);
    if path.is_absolute() {
        Ok(path.to_path_buf())
    } else {
        Err(Error::invalid(format!(
            "{}: the store is a directory's absolute path",
            from.named(value)
        )))
    }
}

fn shared_store(value: String, from: Source) -> Result<String> {
    if value.starts_with("s3://") || Path::new(&value).is_absolute() {
        Ok(value)
    } else {
        Err(Error::invalid(format!(
            "{}: the shared store is a directory's absolute path or s3://BUCKET[/PREFIX]",
            from.named(&value)
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn annotated(mode: &str) -> HashMap<String, String> {
        HashMap::from([(MODE_ANNOTATION.to_string(), mode.to_string())])
    }

    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| vars.get(k).cloned()
    }

    fn class(mode: &str, store: &str) -> StoreOptions {
        StoreOptions::from_values(mode, store, "", None).unwrap()
    }

    #[test]
    fn the_mode_comes_from_the_annotation() {
        let none = StoreOptions::default();
        let resolve = |a: &HashMap<String, String>| {
            StoreConfig::resolve_with(a, &none, env_of(&[])).map(|c| c.mode)
        };
        assert_eq!(resolve(&annotated("local")).unwrap(), Mode::Local);
        assert_eq!(resolve(&annotated("shared")).unwrap(), Mode::Shared);
        assert_eq!(resolve(&annotated("inline")).unwrap(), Mode::Inline);
        let e = resolve(&annotated("nfs")).unwrap_err().to_string();
        assert!(e.contains("io.gpucr.store=\"nfs\""), "{e}");
        assert!(e.contains("inline, local or shared"), "{e}");
    }

    #[test]
    fn nothing_set_is_inline_in_the_default_store() {
        let c = StoreConfig::resolve_with(&HashMap::new(), &StoreOptions::default(), env_of(&[]))
            .unwrap();
        assert_eq!(c, StoreConfig::default());
        assert_eq!(c.dir_label(), "/var/lib/gpucr/store (the default)");
    }

    #[test]
    fn annotation_before_class_before_environment() {
        let env = env_of(&[
            (MODE_ENV, "shared"),
            (STORE_ENV, "/env/store"),
            (SHARED_ENV, "s3://bucket/env"),
            (MIN_BYTES_ENV, "4096"),
        ]);
        // The environment alone.
        let c = StoreConfig::resolve_with(&HashMap::new(), &StoreOptions::default(), &env).unwrap();
        assert_eq!(c.mode, Mode::Shared);
        assert_eq!(c.mode_from, Source::Env(MODE_ENV));
        assert_eq!(c.dir, Path::new("/env/store"));
        assert_eq!(c.shared(), Some("s3://bucket/env"));
        assert_eq!(c.min_bytes, 4096);
        // The class over the environment, setting by setting.
        let local = class("local", "/mnt/tmpfs/store");
        let c = StoreConfig::resolve_with(&HashMap::new(), &local, &env).unwrap();
        assert_eq!(
            (c.mode, c.mode_from),
            (Mode::Local, Source::Option(MODE_OPTION))
        );
        assert_eq!(c.dir, Path::new("/mnt/tmpfs/store"));
        assert_eq!(c.dir_label(), "/mnt/tmpfs/store (runtime option Store)");
        assert_eq!(
            c.shared,
            Some(("s3://bucket/env".into(), Source::Env(SHARED_ENV)))
        );
        assert_eq!(c.min_bytes, 4096);
        // The annotation over both, for the mode only.
        let c = StoreConfig::resolve_with(&annotated("inline"), &local, &env).unwrap();
        assert_eq!((c.mode, c.mode_from), (Mode::Inline, Source::Annotation));
        assert_eq!(c.dir, Path::new("/mnt/tmpfs/store"));
    }

    #[test]
    fn bad_values_name_where_they_came_from() {
        let e = StoreOptions::from_values("nfs", "", "", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("runtime option StoreMode=\"nfs\""), "{e}");
        let e = StoreOptions::from_values("", "store", "", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("runtime option Store=\"store\""), "{e}");
        let e = StoreOptions::from_values("", "", "bucket", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("runtime option StoreShared=\"bucket\""), "{e}");
        let e = StoreOptions::from_values("", "", "", Some(-1))
            .unwrap_err()
            .to_string();
        assert!(e.contains("runtime option StoreMinBytes=-1"), "{e}");

        let none = StoreOptions::default();
        let e = StoreConfig::resolve_with(&HashMap::new(), &none, env_of(&[(MODE_ENV, "x")]));
        assert!(e
            .unwrap_err()
            .to_string()
            .contains("GPUCR_STORE_MODE=\"x\""));
        let e = StoreConfig::resolve_with(&HashMap::new(), &none, env_of(&[(MIN_BYTES_ENV, "1M")]));
        assert!(e
            .unwrap_err()
            .to_string()
            .contains("GPUCR_STORE_MIN_BYTES=\"1M\""));
        // The class's valid mode stands over a bad one in the environment, which it hides.
        let c = StoreConfig::resolve_with(
            &HashMap::new(),
            &class("local", ""),
            env_of(&[(MODE_ENV, "x")]),
        );
        assert_eq!(c.unwrap().mode, Mode::Local);
    }

    #[test]
    fn empty_values_are_unset() {
        assert_eq!(
            StoreOptions::from_values("", " ", "", None).unwrap(),
            StoreOptions::default()
        );
        let c = StoreConfig::resolve_with(
            &HashMap::new(),
            &StoreOptions::default(),
            env_of(&[(MODE_ENV, ""), (STORE_ENV, "")]),
        )
        .unwrap();
        assert_eq!(c, StoreConfig::default());
    }
}
