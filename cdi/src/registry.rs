//! Loading CDI spec directories and resolving device names to their edits.

use std::collections::{BTreeMap, HashSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tracing::{debug, warn};

use crate::error::{Error, Result};
use crate::model::{CdiSpecFile, ContainerEdits};

/// Where CDI specs live unless told otherwise; later directories override earlier ones.
pub const DEFAULT_SPEC_DIRS: [&str; 2] = ["/etc/cdi", "/var/run/cdi"];

/// One CDI device that a name resolved to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedDevice {
    /// Fully qualified name, `vendor/class=name`.
    pub name: String,
    /// The spec file that defines it.
    pub spec_path: PathBuf,
    pub annotations: BTreeMap<String, String>,
    /// The GPU UUID this device stands for, when its name, annotations or env carry exactly one.
    pub gpu_uuid: Option<String>,
    /// The device's own edits (without its spec's spec-level edits).
    pub edits: ContainerEdits,
}

/// The result of resolving a list of names: the devices in request order and the edits to inject.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resolved {
    pub devices: Vec<ResolvedDevice>,
    /// Spec-level edits (once per spec file) followed by device edits, in request order:
    /// exactly what CDI injects for these devices.
    pub edits: ContainerEdits,
}

#[derive(Debug)]
struct LoadedSpec {
    path: PathBuf,
    priority: usize,
    spec: CdiSpecFile,
}

#[derive(Debug, Clone)]
struct DeviceEntry {
    spec: Arc<LoadedSpec>,
    index: usize,
}

impl DeviceEntry {
    fn device(&self) -> &crate::model::CdiDeviceEntry {
        &self.spec.spec.devices[self.index]
    }
}

/// The CDI devices of a host, loaded from its spec directories.
///
/// A broken spec file does not hide the others (as in CDI's own cache): its error is kept in
/// [`CdiRegistry::errors`] and quoted when a device cannot be found.
#[derive(Debug, Default)]
pub struct CdiRegistry {
    devices: BTreeMap<String, DeviceEntry>,
    errors: Vec<Error>,
}

impl CdiRegistry {
    /// Loads `/etc/cdi` and `/var/run/cdi`.
    pub fn load_default() -> Self {
        Self::load(&DEFAULT_SPEC_DIRS)
    }

    /// Loads every `*.json` / `*.yaml` file directly inside `dirs`. A missing directory is
    /// skipped; a device defined in a later directory overrides one in an earlier directory.
    pub fn load<P: AsRef<Path>>(dirs: &[P]) -> Self {
        let mut reg = CdiRegistry::default();
        let mut conflicts = HashSet::new();
        for (priority, dir) in dirs.iter().enumerate() {
            for path in reg.spec_files(dir.as_ref()) {
                match read_spec_file(&path) {
                    Ok(spec) => {
                        let spec = Arc::new(LoadedSpec {
                            path,
                            priority,
                            spec,
                        });
                        reg.add_spec(spec, &mut conflicts);
                    }
                    Err(e) => {
                        warn!(error = %e, "skipping CDI spec");
                        reg.errors.push(e);
                    }
                }
            }
        }
        for name in conflicts {
            reg.devices.remove(&name);
        }
        reg
    }

    fn spec_files(&mut self, dir: &Path) -> Vec<PathBuf> {
        let entries = match std::fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
            Err(source) => {
                self.errors.push(Error::ReadSpecDir {
                    dir: dir.to_path_buf(),
                    source,
                });
                return Vec::new();
            }
        };
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && is_spec_file(p))
            .collect();
        // Sorted so that which of two conflicting files is named first does not depend on readdir.
        files.sort();
        files
    }

    fn add_spec(&mut self, spec: Arc<LoadedSpec>, conflicts: &mut HashSet<String>) {
        for (index, dev) in spec.spec.devices.iter().enumerate() {
            let name = format!("{}={}", spec.spec.kind, dev.name);
            let entry = DeviceEntry {
                spec: Arc::clone(&spec),
                index,
            };
            match self.devices.get(&name) {
                Some(old) if old.spec.priority == spec.priority => {
                    self.errors.push(Error::ConflictingDevice {
                        name: name.clone(),
                        first: old.spec.path.clone(),
                        second: spec.path.clone(),
                    });
                    conflicts.insert(name);
                }
                _ => {
                    // Same name in a later directory: it wins, as in CDI.
                    self.devices.insert(name, entry);
                }
            }
        }
    }

    /// Spec files that could not be loaded, and device name conflicts.
    pub fn errors(&self) -> &[Error] {
        &self.errors
    }

    /// All fully qualified device names, sorted.
    pub fn device_names(&self) -> Vec<String> {
        self.devices.keys().cloned().collect()
    }

    /// Resolves names in order. Accepted forms: `vendor/class=name`; `vendor/class=all`
    /// (the spec's own `all` device if it has one, else every device of that kind); and a
    /// bare GPU UUID `GPU-…` / `MIG-…`, matched against what each device carries.
    pub fn resolve<S: AsRef<str>>(&self, names: &[S]) -> Result<Resolved> {
        let mut entries = Vec::new();
        for name in names {
            entries.extend(self.lookup(name.as_ref())?);
        }
        let mut resolved = Resolved::default();
        let mut seen_specs = HashSet::new();
        let mut seen_devices = HashSet::new();
        for (name, entry) in entries {
            if !seen_devices.insert(name.clone()) {
                continue;
            }
            if seen_specs.insert(entry.spec.path.clone()) {
                if let Some(spec_edits) = &entry.spec.spec.container_edits {
                    resolved.edits.append(spec_edits);
                }
            }
            let dev = entry.device();
            resolved.edits.append(&dev.container_edits);
            resolved.devices.push(ResolvedDevice {
                gpu_uuid: carried_uuid(dev),
                name,
                spec_path: entry.spec.path.clone(),
                annotations: dev.annotations.clone(),
                edits: dev.container_edits.clone(),
            });
        }
        debug!(devices = ?resolved.devices.iter().map(|d| &d.name).collect::<Vec<_>>(), "resolved CDI devices");
        Ok(resolved)
    }

    /// The qualified name of the device that stands for GPU `uuid`, if any.
    pub fn find_by_uuid(&self, uuid: &str) -> Option<String> {
        // A device named by the UUID is the most direct answer; then one that carries it.
        self.devices
            .iter()
            .find(|(_, e)| e.device().name == uuid)
            .or_else(|| {
                self.devices
                    .iter()
                    .find(|(_, e)| carried_uuid(e.device()).as_deref() == Some(uuid))
            })
            .map(|(name, _)| name.clone())
    }

    fn lookup(&self, name: &str) -> Result<Vec<(String, DeviceEntry)>> {
        if is_gpu_uuid(name) {
            let qualified = self.find_by_uuid(name).ok_or_else(|| self.unknown(name))?;
            let entry = self.devices[&qualified].clone();
            return Ok(vec![(qualified, entry)]);
        }
        let (kind, dev) = parse_qualified_name(name)?;
        if let Some(entry) = self.devices.get(name) {
            return Ok(vec![(name.to_string(), entry.clone())]);
        }
        if dev == "all" {
            let mut all: Vec<(String, DeviceEntry)> = self
                .devices
                .iter()
                .filter(|(_, e)| e.spec.spec.kind == kind)
                .map(|(n, e)| (n.clone(), e.clone()))
                .collect();
            // Spec file order, not name order: "10" must not come before "2".
            all.sort_by(|a, b| (&a.1.spec.path, a.1.index).cmp(&(&b.1.spec.path, b.1.index)));
            if !all.is_empty() {
                return Ok(all);
            }
        }
        Err(self.unknown(name))
    }

    fn unknown(&self, name: &str) -> Error {
        Error::UnknownDevice {
            name: name.to_string(),
            broken_specs: self.errors.iter().map(ToString::to_string).collect(),
        }
    }
}

fn is_spec_file(path: &Path) -> bool {
    matches!(
        path.extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
            .as_deref(),
        Some("json" | "yaml")
    )
}

/// Parses and validates one file with the CDI crate, then reads it into our types.
fn read_spec_file(path: &Path) -> Result<CdiSpecFile> {
    let invalid = |reason: String| Error::InvalidSpec {
        path: path.to_path_buf(),
        reason,
    };
    let owned = path.to_path_buf();
    // The crate unwraps in a few version checks; a bad file on the host must not abort the shim.
    let checked = catch_unwind(AssertUnwindSafe(|| {
        container_device_interface::spec::read_spec(&owned, 0)
    }))
    .map_err(|_| invalid("the CDI parser panicked on this file".into()))?
    .map_err(|e| invalid(format!("{e:#}")))?;
    let value = serde_json::to_value(&checked.cdi_spec).map_err(|e| invalid(e.to_string()))?;
    serde_json::from_value(value).map_err(|e| invalid(e.to_string()))
}

/// Splits `vendor/class=name` into (`vendor/class`, `name`), checking CDI's character rules.
pub fn parse_qualified_name(name: &str) -> Result<(&str, &str)> {
    let bad = |reason: &str| Error::InvalidDeviceName {
        name: name.to_string(),
        reason: reason.to_string(),
    };
    let (kind, dev) = name
        .split_once('=')
        .ok_or_else(|| bad("expected vendor/class=name"))?;
    let (vendor, class) = kind
        .split_once('/')
        .ok_or_else(|| bad("expected vendor/class=name"))?;
    check_part(vendor, &['-', '_', '.']).map_err(|r| bad(&format!("vendor: {r}")))?;
    check_part(class, &['-', '_']).map_err(|r| bad(&format!("class: {r}")))?;
    check_part(dev, &['-', '_', '.', ':']).map_err(|r| bad(&format!("device: {r}")))?;
    Ok((kind, dev))
}

fn check_part(part: &str, inner: &[char]) -> std::result::Result<(), String> {
    let first = part.chars().next().ok_or("empty")?;
    let last = part.chars().last().unwrap_or(first);
    if !first.is_ascii_alphanumeric() || !last.is_ascii_alphanumeric() {
        return Err(format!(
            "{part:?} must start and end with a letter or digit"
        ));
    }
    match part
        .chars()
        .find(|c| !c.is_ascii_alphanumeric() && !inner.contains(c))
    {
        Some(c) => Err(format!("{part:?} contains {c:?}")),
        None => Ok(()),
    }
}

/// NVIDIA's UUID forms, as nvidia-ctk's `uuid` naming strategy uses them for device names.
pub fn is_gpu_uuid(s: &str) -> bool {
    (s.starts_with("GPU-") || s.starts_with("MIG-")) && s.len() > 4 && !s.contains(['=', ',', '/'])
}

/// The single GPU UUID a device stands for: its name, else one annotation value, else one
/// UUID in its env values. A device carrying several (an `all` device) stands for none.
fn carried_uuid(dev: &crate::model::CdiDeviceEntry) -> Option<String> {
    if is_gpu_uuid(&dev.name) {
        return Some(dev.name.clone());
    }
    let single = |found: Vec<&str>| {
        let set: std::collections::BTreeSet<&str> = found.into_iter().collect();
        (set.len() == 1).then(|| set.into_iter().next().unwrap_or_default().to_string())
    };
    let from_annotations: Vec<&str> = dev
        .annotations
        .values()
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|v| is_gpu_uuid(v))
        .collect();
    if !from_annotations.is_empty() {
        return single(from_annotations);
    }
    let from_env: Vec<&str> = dev
        .container_edits
        .env
        .iter()
        .filter_map(|e| e.split_once('=').map(|(_, v)| v))
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|v| is_gpu_uuid(v))
        .collect();
    single(from_env)
}
