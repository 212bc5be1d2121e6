//! Runtime and checkpoint options, decoded from whichever type a containerd client sends.
//!
//! - `containerd.runc.v1.Options` / `CheckpointOptions`: containerd's own runc types.
//! - `containerd.linux.runc.CreateOptions` / `CheckpointOptions`: what containerd 1.7's Go
//!   client sends to a runtime whose name is not `io.containerd.runc.*`.
//! - `runtimeoptions.v1.Options`: what CRI sends to a non-runc runtime; its `config_body` is
//!   the TOML of the runtime's `options` table (Go field names: `BinaryName`, `SystemdCgroup`…,
//!   and gpucr's own store keys, `StoreMode`…: a RuntimeClass's store, `store_config`).

use std::path::{Path, PathBuf};

use containerd_shim_protos::{
    protobuf::{well_known_types::any::Any, CodedInputStream, Message},
    shim::oci,
};
use serde::{Deserialize, Serialize};

use crate::error::{Error, IoContext, Result};
use crate::store_config::StoreOptions;

/// Written at Create so that `delete` (run when the shim is gone) uses the same runc.
const OPTIONS_FILE: &str = "gpucr-options.json";

/// The runc options that the shim honours, whatever type they came in.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RuntimeOptions {
    pub binary_name: String,
    pub root: String,
    pub systemd_cgroup: bool,
    pub no_pivot_root: bool,
    pub no_new_keyring: bool,
    pub io_uid: u32,
    pub io_gid: u32,
    pub criu_image_path: String,
    pub criu_work_path: String,
    pub shim_cgroup: String,
    /// The RuntimeClass's store (CRI's TOML only).
    pub store: StoreOptions,
}

impl RuntimeOptions {
    /// Keeps the options in the bundle for `shim delete`, which runs without them.
    pub fn write_to_bundle(&self, bundle: &Path) -> Result<()> {
        let path = bundle.join(OPTIONS_FILE);
        let text = serde_json::to_vec(self).expect("options serialize");
        std::fs::write(&path, text).ctx(|| format!("writing {}", path.display()))
    }

    /// What [`RuntimeOptions::write_to_bundle`] kept; the defaults when nothing was.
    pub fn read_from_bundle(bundle: &Path) -> RuntimeOptions {
        std::fs::read(bundle.join(OPTIONS_FILE))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    }
}

/// What one checkpoint asked for.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CheckpointRequest {
    pub exit: bool,
    pub open_tcp: bool,
    pub external_unix_sockets: bool,
    pub terminal: bool,
    pub file_locks: bool,
    pub empty_namespaces: Vec<String>,
    pub cgroups_mode: String,
    pub image_path: String,
    pub work_path: String,
}

/// The runtime options types, by the last segment of their type URL.
const RUNC_OPTIONS: [&str; 2] = [
    "containerd.runc.v1.Options",
    "containerd.runc.v1.options.Options",
];
const LEGACY_CREATE_OPTIONS: &str = "containerd.linux.runc.CreateOptions";
const CRI_OPTIONS: &str = "runtimeoptions.v1.Options";
const LEGACY_CHECKPOINT_OPTIONS: &str = "containerd.linux.runc.CheckpointOptions";

/// The keys of a runtime options TOML that gpucr honours (runc's Go field names, then
/// gpucr's own).
const TOML_KEYS: [&str; 14] = [
    "BinaryName",
    "Root",
    "SystemdCgroup",
    "NoPivotRoot",
    "NoNewKeyring",
    "IoUid",
    "IoGid",
    "CriuImagePath",
    "CriuWorkPath",
    "ShimCgroup",
    crate::store_config::MODE_OPTION,
    crate::store_config::STORE_OPTION,
    crate::store_config::SHARED_OPTION,
    crate::store_config::MIN_BYTES_OPTION,
];
/// `runtimeoptions.v1.Options`' own fields: CRI reads them from the same table (and then
/// sends the table as it is), so they may appear and mean nothing to the shim.
const CRI_KEYS: [&str; 2] = ["TypeUrl", "ConfigPath"];

/// The last segment of a type URL (containerd writes bare names such as
/// `containerd.runc.v1.Options`, others prefix `type.googleapis.com/`).
fn type_name(any: &Any) -> &str {
    any.type_url.rsplit('/').next().unwrap_or("")
}

impl RuntimeOptions {
    pub fn default_binary() -> &'static str {
        "runc"
    }

    pub fn binary(&self) -> &str {
        if self.binary_name.is_empty() {
            Self::default_binary()
        } else {
            &self.binary_name
        }
    }

    pub fn decode(any: Option<&Any>) -> Result<RuntimeOptions> {
        let Some(any) = any.filter(|a| !a.type_url.is_empty()) else {
            return Ok(RuntimeOptions::default());
        };
        match type_name(any) {
            t if RUNC_OPTIONS.contains(&t) => {
                let o = oci::Options::parse_from_bytes(&any.value)?;
                Ok(RuntimeOptions {
                    binary_name: o.binary_name,
                    root: o.root,
                    systemd_cgroup: o.systemd_cgroup,
                    no_pivot_root: o.no_pivot_root,
                    no_new_keyring: o.no_new_keyring,
                    io_uid: o.io_uid,
                    io_gid: o.io_gid,
                    criu_image_path: o.criu_image_path,
                    criu_work_path: o.criu_work_path,
                    shim_cgroup: o.shim_cgroup,
                    ..Default::default()
                })
            }
            LEGACY_CREATE_OPTIONS => {
                let f = Fields::decode(&any.value)?;
                Ok(RuntimeOptions {
                    no_pivot_root: f.bool(1),
                    no_new_keyring: f.bool(8),
                    shim_cgroup: f.string(9),
                    io_uid: f.varint(10) as u32,
                    io_gid: f.varint(11) as u32,
                    criu_work_path: f.string(12),
                    criu_image_path: f.string(13),
                    ..Default::default()
                })
            }
            CRI_OPTIONS => {
                let f = Fields::decode(&any.value)?;
                let body = f.string(3);
                let path = f.string(2);
                let toml_text = if body.is_empty() && !path.is_empty() {
                    std::fs::read_to_string(&path)
                        .map_err(|e| Error::io(format!("reading runtime options file {path}"), e))?
                } else {
                    body
                };
                Self::from_toml(&toml_text)
            }
            other => Err(Error::invalid(format!(
                "runtime options of type {other:?} are not understood by gpucr \
                 (use containerd.runc.v1.Options)"
            ))),
        }
    }

    /// The TOML of CRI's `runtimeoptions.v1.Options`: the runtime's `options` table, under
    /// the Go names of runc's options. A key gpucr does not know is an error that names it,
    /// so a typo (or a runc option gpucr does not honour) never passes silently.
    fn from_toml(text: &str) -> Result<RuntimeOptions> {
        #[derive(Deserialize, Default)]
        #[serde(default, rename_all = "PascalCase")]
        struct GoNames {
            binary_name: String,
            root: String,
            systemd_cgroup: bool,
            no_pivot_root: bool,
            no_new_keyring: bool,
            io_uid: u32,
            io_gid: u32,
            criu_image_path: String,
            criu_work_path: String,
            shim_cgroup: String,
            store_mode: String,
            store: String,
            store_shared: String,
            store_min_bytes: Option<i64>,
        }
        let table: toml::Table = toml::from_str(text).map_err(|e| Error::Decode {
            what: "runtime options TOML",
            msg: e.to_string(),
        })?;
        if let Some(key) = table
            .keys()
            .find(|k| !TOML_KEYS.contains(&k.as_str()) && !CRI_KEYS.contains(&k.as_str()))
        {
            return Err(Error::invalid(format!(
                "runtime option {key:?} is not understood by gpucr; remove it from the \
                 runtime's options table in containerd's config (gpucr understands {})",
                TOML_KEYS.join(", ")
            )));
        }
        let g: GoNames = table.try_into().map_err(|e| Error::Decode {
            what: "runtime options TOML",
            msg: e.to_string(),
        })?;
        Ok(RuntimeOptions {
            binary_name: g.binary_name,
            root: g.root,
            systemd_cgroup: g.systemd_cgroup,
            no_pivot_root: g.no_pivot_root,
            no_new_keyring: g.no_new_keyring,
            io_uid: g.io_uid,
            io_gid: g.io_gid,
            criu_image_path: g.criu_image_path,
            criu_work_path: g.criu_work_path,
            shim_cgroup: g.shim_cgroup,
            store: StoreOptions::from_values(
                &g.store_mode,
                &g.store,
                &g.store_shared,
                g.store_min_bytes,
            )?,
        })
    }

    /// runc's state root: the option, else containerd's default per namespace.
    pub fn runc_root(&self, namespace: &str) -> PathBuf {
        if self.root.is_empty() {
            PathBuf::from("/run/containerd/runc").join(namespace)
        } else {
            PathBuf::from(&self.root).join(namespace)
        }
    }
}

fn is_runtime_options(any: &Any) -> bool {
    let t = type_name(any);
    RUNC_OPTIONS.contains(&t) || t == LEGACY_CREATE_OPTIONS || t == CRI_OPTIONS
}

/// The runtime options on the `start` action's stdin. containerd 1.7–2.2 write the options
/// `Any` (or nothing); containerd 2.3 writes `BootstrapParams`, whose `extensions` carry
/// them. Both parse as either message, so, like containerd's own shims, a payload counts as
/// `BootstrapParams` only when its `instance_id` and `namespace` are the shim's `-id` and
/// `-namespace`.
pub fn start_options(stdin: &[u8], id: &str, namespace: &str) -> Result<Option<Any>> {
    if let Ok(f) = Fields::decode(stdin) {
        if !id.is_empty() && f.string(1) == id && f.string(2) == namespace {
            // BootstrapParams.extensions = 8, Extension.value = 1; other extensions (sandbox
            // or CRI configuration) are not runtime options.
            for ext in f.all_bytes(8) {
                let value = Fields::decode(ext)?;
                let Some(any) = value.all_bytes(1).last() else {
                    continue;
                };
                let any = Any::parse_from_bytes(any)?;
                if is_runtime_options(&any) {
                    return Ok(Some(any));
                }
            }
            return Ok(None);
        }
    }
    options_any(stdin)
}

/// The options `Any` that containerd writes on stdin (`-info`, and `start` before 2.3):
/// empty when containerd has none.
pub fn options_any(stdin: &[u8]) -> Result<Option<Any>> {
    if stdin.is_empty() {
        return Ok(None);
    }
    let any = Any::parse_from_bytes(stdin).map_err(|e| Error::Decode {
        what: "the runtime options on stdin",
        msg: e.to_string(),
    })?;
    Ok(Some(any).filter(|a| !a.type_url.is_empty()))
}

impl CheckpointRequest {
    pub fn decode(any: Option<&Any>) -> Result<CheckpointRequest> {
        let Some(any) = any.filter(|a| !a.type_url.is_empty()) else {
            return Ok(CheckpointRequest::default());
        };
        match type_name(any) {
            "containerd.runc.v1.CheckpointOptions"
            | "containerd.runc.v1.options.CheckpointOptions" => {
                let o = oci::CheckpointOptions::parse_from_bytes(&any.value)?;
                Ok(CheckpointRequest {
                    exit: o.exit,
                    open_tcp: o.open_tcp,
                    external_unix_sockets: o.external_unix_sockets,
                    terminal: o.terminal,
                    file_locks: o.file_locks,
                    empty_namespaces: o.empty_namespaces,
                    cgroups_mode: o.cgroups_mode,
                    image_path: o.image_path,
                    work_path: o.work_path,
                })
            }
            // containerd 1.7's Go client (`WithCheckpointImagePath`, `WithCheckpointExit`)
            // for a runtime not named io.containerd.runc.*. Same fields as runc's type but
            // work_path = 8 and image_path = 9 swapped; unset fields mean what runc's shim
            // takes them to mean (no exit: the task keeps running).
            LEGACY_CHECKPOINT_OPTIONS => {
                let f = Fields::decode(&any.value)?;
                Ok(CheckpointRequest {
                    exit: f.bool(1),
                    open_tcp: f.bool(2),
                    external_unix_sockets: f.bool(3),
                    terminal: f.bool(4),
                    file_locks: f.bool(5),
                    empty_namespaces: f.all_bytes(6).map(lossy).collect(),
                    cgroups_mode: f.string(7),
                    work_path: f.string(8),
                    image_path: f.string(9),
                })
            }
            other => Err(Error::invalid(format!(
                "checkpoint options of type {other:?} are not understood by gpucr \
                 (use containerd.runc.v1.CheckpointOptions)"
            ))),
        }
    }
}

/// A minimal protobuf field reader for option types that shim-protos does not vendor.
struct Fields(Vec<(u32, FieldValue)>);

enum FieldValue {
    Varint(u64),
    Bytes(Vec<u8>),
}

impl Fields {
    fn decode(bytes: &[u8]) -> Result<Fields> {
        let mut out = Vec::new();
        let mut is = CodedInputStream::from_bytes(bytes);
        while !is.eof()? {
            let tag = is.read_raw_varint32()?;
            let (field, wire) = (tag >> 3, tag & 7);
            match wire {
                0 => out.push((field, FieldValue::Varint(is.read_raw_varint64()?))),
                2 => out.push((field, FieldValue::Bytes(is.read_bytes()?))),
                1 => {
                    is.read_raw_little_endian64()?;
                }
                5 => {
                    is.read_raw_little_endian32()?;
                }
                w => {
                    return Err(Error::Decode {
                        what: "runtime options",
                        msg: format!("unsupported wire type {w} for field {field}"),
                    })
                }
            }
        }
        Ok(Fields(out))
    }

    fn varint(&self, n: u32) -> u64 {
        self.0
            .iter()
            .rev()
            .find_map(|(f, v)| match v {
                FieldValue::Varint(x) if *f == n => Some(*x),
                _ => None,
            })
            .unwrap_or(0)
    }

    fn all_bytes(&self, n: u32) -> impl Iterator<Item = &[u8]> {
        self.0.iter().filter_map(move |(f, v)| match v {
            FieldValue::Bytes(b) if *f == n => Some(b.as_slice()),
            _ => None,
        })
    }

    fn bool(&self, n: u32) -> bool {
        self.varint(n) != 0
    }

    fn string(&self, n: u32) -> String {
        self.all_bytes(n).last().map(lossy).unwrap_or_default()
    }
}

fn lossy(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_survive_for_delete() {
        let dir = tempfile::tempdir().unwrap();
        let o = RuntimeOptions {
            binary_name: "crun".into(),
            ..Default::default()
        };
        o.write_to_bundle(dir.path()).unwrap();
        assert_eq!(RuntimeOptions::read_from_bundle(dir.path()), o);
    }
    use containerd_shim_protos::protobuf::CodedOutputStream;

    fn any(type_url: &str, value: Vec<u8>) -> Any {
        Any {
            type_url: type_url.into(),
            value,
            ..Default::default()
        }
    }

    #[test]
    fn runc_options() {
        let o = oci::Options {
            binary_name: "crun".into(),
            systemd_cgroup: true,
            criu_work_path: "/w".into(),
            ..Default::default()
        };
        let r = RuntimeOptions::decode(Some(&any(
            "containerd.runc.v1.Options",
            o.write_to_bytes().unwrap(),
        )))
        .unwrap();
        assert_eq!(r.binary(), "crun");
        assert!(r.systemd_cgroup);
        assert_eq!(r.criu_work_path, "/w");
        assert_eq!(RuntimeOptions::decode(None).unwrap().binary(), "runc");
    }

    #[test]
    fn legacy_linux_create_options() {
        let mut buf = Vec::new();
        {
            let mut os = CodedOutputStream::vec(&mut buf);
            os.write_bool(1, true).unwrap();
            os.write_string(9, "/shim-cg").unwrap();
            os.write_uint32(10, 1000).unwrap();
            os.write_string(13, "/img").unwrap();
            os.flush().unwrap();
        }
        let r = RuntimeOptions::decode(Some(&any(
            "type.googleapis.com/containerd.linux.runc.CreateOptions",
            buf,
        )))
        .unwrap();
        assert!(r.no_pivot_root);
        assert_eq!(r.shim_cgroup, "/shim-cg");
        assert_eq!(r.io_uid, 1000);
        assert_eq!(r.criu_image_path, "/img");
    }

    #[test]
    fn cri_runtimeoptions_toml() {
        let mut buf = Vec::new();
        {
            let mut os = CodedOutputStream::vec(&mut buf);
            os.write_string(1, "").unwrap();
            os.write_string(3, "BinaryName = \"/usr/bin/crun\"\nSystemdCgroup = true\n")
                .unwrap();
            os.flush().unwrap();
        }
        let r = RuntimeOptions::decode(Some(&any("runtimeoptions.v1.Options", buf))).unwrap();
        assert_eq!(r.binary(), "/usr/bin/crun");
        assert!(r.systemd_cgroup);
    }

    #[test]
    fn checkpoint_options_any_type() {
        let o = oci::CheckpointOptions {
            exit: true,
            image_path: "/i".into(),
            work_path: "/w".into(),
            ..Default::default()
        };
        let c = CheckpointRequest::decode(Some(&any(
            "containerd.runc.v1.CheckpointOptions",
            o.write_to_bytes().unwrap(),
        )))
        .unwrap();
        assert!(c.exit);
        assert_eq!(c.image_path, "/i");
        assert_eq!(c.work_path, "/w");
        assert_eq!(
            CheckpointRequest::decode(None).unwrap(),
            CheckpointRequest::default()
        );
        let e = CheckpointRequest::decode(Some(&any("x.Unknown", vec![]))).unwrap_err();
        assert!(e.to_string().contains("not understood"));
    }

    /// What containerd 1.7's Go client sends for `WithCheckpointImagePath(dir)` to a runtime
    /// not named io.containerd.runc.* (issue 23.3): only field 9 is set.
    #[test]
    fn legacy_linux_checkpoint_options_keep_the_task_running() {
        let mut buf = Vec::new();
        {
            let mut os = CodedOutputStream::vec(&mut buf);
            os.write_string(9, "/ckpt").unwrap();
            os.flush().unwrap();
        }
        let t = "type.googleapis.com/containerd.linux.runc.CheckpointOptions";
        let c = CheckpointRequest::decode(Some(&any(t, buf))).unwrap();
        assert_eq!(
            c,
            CheckpointRequest {
                image_path: "/ckpt".into(),
                ..Default::default()
            }
        );
        let mut buf = Vec::new();
        {
            let mut os = CodedOutputStream::vec(&mut buf);
            os.write_bool(1, true).unwrap();
            os.write_bool(5, true).unwrap();
            os.write_string(6, "network").unwrap();
            os.write_string(8, "/work").unwrap();
            os.flush().unwrap();
        }
        let c = CheckpointRequest::decode(Some(&any(t, buf))).unwrap();
        assert!(c.exit && c.file_locks);
        assert_eq!(c.empty_namespaces, vec!["network".to_string()]);
        assert_eq!((c.work_path.as_str(), c.image_path.as_str()), ("/work", ""));
    }

    fn cri_options(toml_body: &str) -> Any {
        let mut buf = Vec::new();
        {
            let mut os = CodedOutputStream::vec(&mut buf);
            os.write_bytes(3, toml_body.as_bytes()).unwrap();
            os.flush().unwrap();
        }
        any("runtimeoptions.v1.Options", buf)
    }

    fn start_decode(stdin: &[u8]) -> Result<RuntimeOptions> {
        RuntimeOptions::decode(start_options(stdin, "c1", "k8s.io")?.as_ref())
    }

    #[test]
    fn start_reads_the_cri_toml_of_issue_21() {
        // containerd 2.1.9's CRI, for `BinaryName = "runc"` / `SystemdCgroup = false`.
        let body = "BinaryName = 'runc'\nSystemdCgroup = false\n";
        let stdin = cri_options(body).write_to_bytes().unwrap();
        let r = start_decode(&stdin).unwrap();
        assert_eq!(r.binary(), "runc");
        assert!(!r.systemd_cgroup);
        assert_eq!(r.shim_cgroup, "");

        let with_cg = cri_options("ShimCgroup = '/gpucr-shims'\n");
        let r = start_decode(&with_cg.write_to_bytes().unwrap()).unwrap();
        assert_eq!(r.shim_cgroup, "/gpucr-shims");
    }

    #[test]
    fn an_unknown_toml_key_is_an_error_naming_it() {
        let stdin = cri_options("BinaryName = 'runc'\nSystemdCgroups = true\n")
            .write_to_bytes()
            .unwrap();
        let e = start_decode(&stdin).unwrap_err().to_string();
        assert!(e.contains("\"SystemdCgroups\""), "{e}");
        assert!(e.contains("SystemdCgroup,"), "{e}");
        // runc options gpucr does not honour are refused the same way.
        let e = start_decode(
            &cri_options("TaskApiAddress = 'x'")
                .write_to_bytes()
                .unwrap(),
        );
        assert!(e.unwrap_err().to_string().contains("TaskApiAddress"));
        // CRI's own keys are consumed by containerd and mean nothing here.
        start_decode(&cri_options("ConfigPath = ''").write_to_bytes().unwrap()).unwrap();
    }

    #[test]
    fn a_runtime_class_names_its_store() {
        use crate::by_reference::Mode;
        let body = "BinaryName = 'runc'\nStoreMode = 'local'\nStore = '/mnt/tmpfs/store'\n\
                    StoreShared = 's3://bucket/gpucr'\nStoreMinBytes = 65536\n";
        let r = start_decode(&cri_options(body).write_to_bytes().unwrap()).unwrap();
        assert_eq!(r.binary(), "runc");
        assert_eq!(
            r.store,
            StoreOptions {
                mode: Some(Mode::Local),
                store: Some("/mnt/tmpfs/store".into()),
                shared: Some("s3://bucket/gpucr".into()),
                min_bytes: Some(65536),
            }
        );
        // Kept in the bundle with the rest; a bundle written before these keys still reads.
        let dir = tempfile::tempdir().unwrap();
        r.write_to_bundle(dir.path()).unwrap();
        assert_eq!(RuntimeOptions::read_from_bundle(dir.path()), r);
        std::fs::write(dir.path().join(OPTIONS_FILE), r#"{"binary_name":"crun"}"#).unwrap();
        let old = RuntimeOptions::read_from_bundle(dir.path());
        assert_eq!(
            (old.binary(), &old.store),
            ("crun", &StoreOptions::default())
        );

        let e = start_decode(&cri_options("StoreMode = 'nfs'").write_to_bytes().unwrap());
        let e = e.unwrap_err().to_string();
        assert!(e.contains("runtime option StoreMode=\"nfs\""), "{e}");
        let e = start_decode(&cri_options("Store = 'rel'").write_to_bytes().unwrap());
        assert!(e
            .unwrap_err()
            .to_string()
            .contains("runtime option Store=\"rel\""));
        let e = start_decode(&cri_options("StoreMinBytes = -1").write_to_bytes().unwrap());
        assert!(e.unwrap_err().to_string().contains("StoreMinBytes=-1"));
        let e = start_decode(&cri_options("StoreMode = 1").write_to_bytes().unwrap());
        assert!(e.unwrap_err().to_string().contains("StoreMode"));
    }

    /// The example drop-in's options table is one gpucr accepts.
    #[test]
    fn the_local_store_example_decodes() {
        let text = include_str!("../../install/containerd/gpucr-local-store-v3.toml");
        let config = toml::Value::Table(toml::from_str(text).unwrap());
        let options = &config["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]
            ["gpucr-local"]["options"];
        let r = RuntimeOptions::from_toml(&toml::to_string(options).unwrap()).unwrap();
        assert_eq!(r.store.mode, Some(crate::by_reference::Mode::Local));
        assert!(r.store.store.is_some());
    }

    #[test]
    fn start_reads_every_options_shape() {
        assert_eq!(start_decode(b"").unwrap(), RuntimeOptions::default());

        let runc = oci::Options {
            binary_name: "crun".into(),
            shim_cgroup: "/shims".into(),
            ..Default::default()
        };
        let runc = any("containerd.runc.v1.Options", runc.write_to_bytes().unwrap());
        let r = start_decode(&runc.write_to_bytes().unwrap()).unwrap();
        assert_eq!((r.binary(), r.shim_cgroup.as_str()), ("crun", "/shims"));

        // containerd 1.7's Go client: CreateOptions, whose field 3 is a bool (the crate's
        // reading of it as runc's Options, field 3 a string, failed on it).
        let mut buf = Vec::new();
        {
            let mut os = CodedOutputStream::vec(&mut buf);
            os.write_bool(3, true).unwrap();
            os.write_string(9, "/legacy").unwrap();
            os.flush().unwrap();
        }
        let legacy = any("containerd.linux.runc.CreateOptions", buf);
        let r = start_decode(&legacy.write_to_bytes().unwrap()).unwrap();
        assert_eq!(r.shim_cgroup, "/legacy");

        let e = start_decode(&any("x.y.Unknown", vec![]).write_to_bytes().unwrap());
        assert!(e.unwrap_err().to_string().contains("x.y.Unknown"));
        assert!(start_decode(b"\xff\xff").is_err());
    }

    #[test]
    fn start_reads_options_inside_containerd_2_3_bootstrap_params() {
        let opts = oci::Options {
            binary_name: "crun".into(),
            ..Default::default()
        };
        let opts = any("containerd.runc.v1.Options", opts.write_to_bytes().unwrap());
        let other = any("containerd.io/cri.v1.PodSandboxConfig", vec![1, 2]);
        let mut buf = Vec::new();
        {
            let mut os = CodedOutputStream::vec(&mut buf);
            os.write_string(1, "c1").unwrap();
            os.write_string(2, "k8s.io").unwrap();
            for a in [&other, &opts] {
                let mut ext = Vec::new();
                {
                    let mut e = CodedOutputStream::vec(&mut ext);
                    e.write_bytes(1, &a.write_to_bytes().unwrap()).unwrap();
                    e.flush().unwrap();
                }
                os.write_bytes(8, &ext).unwrap();
            }
            os.flush().unwrap();
        }
        assert_eq!(start_decode(&buf).unwrap().binary(), "crun");
        // The same bytes from another container are not its BootstrapParams.
        let e = RuntimeOptions::decode(start_options(&buf, "c2", "k8s.io").unwrap().as_ref());
        assert!(e.unwrap_err().to_string().contains("not understood"));
    }
}
