//! CDI edits applied to, and taken back out of, an OCI runtime spec held as `serde_json::Value`.
//!
//! Working on JSON rather than `oci_spec` types keeps fields no typed crate knows (and the
//! shim's oci-spec version) out of the picture: whatever containerd wrote survives the rewrite.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use serde_json::{json, Map, Value};
use tracing::debug;

use crate::error::{Error, Result};
use crate::model::{ContainerEdits, DeviceNode, Hook, Mount};

/// Hook lists of the OCI spec that CDI may add to.
const HOOK_NAMES: [&str; 6] = [
    "prestart",
    "createRuntime",
    "createContainer",
    "startContainer",
    "poststart",
    "poststop",
];

/// Reads a bundle's `config.json`.
pub fn read_oci_spec(path: &Path) -> Result<Value> {
    let data = std::fs::read(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let spec: Value = serde_json::from_slice(&data).map_err(|source| Error::Json {
        path: path.to_path_buf(),
        source,
    })?;
    if !spec.is_object() {
        return Err(Error::InvalidOciSpec(format!(
            "{}: top level is not an object",
            path.display()
        )));
    }
    Ok(spec)
}

/// Writes `value` to `path` through a temporary file and a rename, so readers never see half.
pub fn write_json_atomic(path: &Path, value: &Value) -> Result<()> {
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let data = serde_json::to_vec_pretty(value).map_err(|source| Error::Json {
        path: path.to_path_buf(),
        source,
    })?;
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, data).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

/// A bind mount of an OCI spec, as runc sees one: `options` has `bind` or `rbind`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BindMount {
    pub destination: String,
    pub source: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

/// The spec's bind mounts in order. runc 1.1 (`specconv.createLibcontainerMount`) treats a
/// mount as bind when its options hold `bind`/`rbind`, whatever its `type`; so do we.
pub fn bind_mounts(spec: &Value) -> Vec<BindMount> {
    let Some(mounts) = spec.get("mounts").and_then(Value::as_array) else {
        return Vec::new();
    };
    mounts
        .iter()
        .filter_map(|m| {
            let options = string_list(m.get("options"));
            options
                .iter()
                .any(|o| o == "bind" || o == "rbind")
                .then(|| BindMount {
                    destination: str_field(m, "destination").to_string(),
                    source: str_field(m, "source").to_string(),
                    options,
                })
        })
        .collect()
}

/// Sets the source of the mount at `destination`; false when there is none.
pub(crate) fn set_mount_source(spec: &mut Value, destination: &str, source: &str) -> bool {
    let Some(mounts) = spec.get_mut("mounts").and_then(Value::as_array_mut) else {
        return false;
    };
    match mounts
        .iter_mut()
        .find(|m| str_field(m, "destination") == destination)
    {
        Some(m) => {
            m["source"] = Value::String(source.to_string());
            true
        }
        None => false,
    }
}

/// Injects `edits` the way CDI does: env replaces same-named variables, device nodes and
/// mounts replace entries at the same container path, hooks and gids are appended.
pub fn apply_edits(spec: &mut Value, edits: &ContainerEdits) -> Result<()> {
    for env in &edits.env {
        let key = env_key(env);
        let list = array_at(spec, &["process", "env"])?;
        list.retain(|v| v.as_str().map(env_key) != Some(key));
        list.push(Value::String(env.clone()));
    }
    for node in &edits.device_nodes {
        add_device_node(spec, node)?;
    }
    if !edits.mounts.is_empty() {
        for m in &edits.mounts {
            add_mount(spec, m)?;
        }
        sort_mounts(spec);
    }
    for hook in &edits.hooks {
        add_hook(spec, hook)?;
    }
    for gid in edits.additional_gids.iter().filter(|g| **g > 0) {
        let gids = array_at(spec, &["process", "user", "additionalGids"])?;
        if !gids.iter().any(|v| v.as_u64() == Some(u64::from(*gid))) {
            gids.push(json!(gid));
        }
    }
    if let Some(rdt) = &edits.intel_rdt {
        object_at(spec, &["linux"])?.insert("intelRdt".into(), rdt.clone());
    }
    for nd in &edits.net_devices {
        object_at(spec, &["linux", "netDevices"])?
            .insert(nd.host_interface_name.clone(), json!({ "name": nd.name }));
    }
    Ok(())
}

/// Takes out what `edits` injected, matched by container-side keys (env entry, device path,
/// mount destination, hook path+args), which do not depend on the host. Additional gids are
/// left: the spec may have had them before CDI.
pub fn remove_edits(spec: &mut Value, edits: &ContainerEdits) {
    if let Some(env) = get_array_mut(spec, &["process", "env"]) {
        env.retain(|v| !edits.env.iter().any(|e| v.as_str() == Some(e)));
    }
    for node in &edits.device_nodes {
        remove_device_node(spec, &node.path);
    }
    if let Some(mounts) = get_array_mut(spec, &["mounts"]) {
        mounts.retain(|m| {
            !edits
                .mounts
                .iter()
                .any(|cm| cm.container_path == str_field(m, "destination"))
        });
    }
    for hook in &edits.hooks {
        if let Some(list) = get_array_mut(spec, &["hooks", hook.hook_name.as_str()]) {
            list.retain(|h| {
                !(str_field(h, "path") == hook.path && string_list(h.get("args")) == hook.args)
            });
        }
    }
    if edits.intel_rdt.is_some() {
        if let Some(linux) = spec.get_mut("linux").and_then(Value::as_object_mut) {
            linux.remove("intelRdt");
        }
    }
    if let Some(nds) = spec
        .pointer_mut("/linux/netDevices")
        .and_then(Value::as_object_mut)
    {
        for nd in &edits.net_devices {
            nds.remove(&nd.host_interface_name);
        }
    }
}

fn add_device_node(spec: &mut Value, node: &DeviceNode) -> Result<()> {
    let node = fill_device_info(node)?;
    let kind = node.kind.clone().unwrap_or_default();
    let mut dev = Map::new();
    dev.insert("path".into(), json!(node.path));
    dev.insert("type".into(), json!(kind));
    if kind != "p" {
        dev.insert("major".into(), json!(node.major.unwrap_or(0)));
        dev.insert("minor".into(), json!(node.minor.unwrap_or(0)));
    }
    if let Some(mode) = node.file_mode {
        dev.insert("fileMode".into(), json!(mode));
    }
    // CDI gives the node to the container's user unless the spec names an owner.
    let uid = node.uid.or_else(|| process_id(spec, "uid"));
    let gid = node.gid.or_else(|| process_id(spec, "gid"));
    if let Some(uid) = uid {
        dev.insert("uid".into(), json!(uid));
    }
    if let Some(gid) = gid {
        dev.insert("gid".into(), json!(gid));
    }
    remove_device_node(spec, &node.path);
    array_at(spec, &["linux", "devices"])?.push(Value::Object(dev));
    if kind == "c" || kind == "b" {
        let access = match node.permissions.as_deref() {
            None | Some("") => "rwm",
            Some("none") => "",
            Some(p) => p,
        };
        array_at(spec, &["linux", "resources", "devices"])?.push(json!({
            "allow": true,
            "type": kind,
            "major": node.major,
            "minor": node.minor,
            "access": access,
        }));
    }
    Ok(())
}

/// Removes the device at container path `path` and the cgroup rule that allowed exactly it.
fn remove_device_node(spec: &mut Value, path: &str) {
    let Some(devices) = get_array_mut(spec, &["linux", "devices"]) else {
        return;
    };
    let Some(pos) = devices.iter().position(|d| str_field(d, "path") == path) else {
        return;
    };
    let old = devices.remove(pos);
    let key = (
        old.get("type").cloned(),
        old.get("major").cloned(),
        old.get("minor").cloned(),
    );
    if let Some(rules) = get_array_mut(spec, &["linux", "resources", "devices"]) {
        if let Some(i) = rules.iter().position(|r| {
            r.get("allow") == Some(&Value::Bool(true))
                && (
                    r.get("type").cloned(),
                    r.get("major").cloned(),
                    r.get("minor").cloned(),
                ) == key
        }) {
            rules.remove(i);
        }
    }
    debug!(path, "removed device node");
}

/// Completes type/major/minor from the host node, as CDI does when the spec leaves them out.
fn fill_device_info(node: &DeviceNode) -> Result<DeviceNode> {
    let mut node = node.clone();
    if node.kind.as_deref() == Some("") {
        node.kind = None;
    }
    if matches!(node.kind.as_deref(), Some("p")) || (node.kind.is_some() && node.major.is_some()) {
        return Ok(node);
    }
    let host_path = node.host_path().to_string();
    let meta = std::fs::metadata(&host_path).map_err(|source| Error::DeviceNodeStat {
        path: node.path.clone(),
        host_path: host_path.clone(),
        source,
    })?;
    let ft = meta.file_type();
    let host_kind = if ft.is_char_device() {
        "c"
    } else if ft.is_block_device() {
        "b"
    } else if ft.is_fifo() {
        "p"
    } else {
        return Err(Error::NotADeviceNode {
            path: node.path.clone(),
            host_path,
        });
    };
    match node.kind.as_deref() {
        None => node.kind = Some(host_kind.to_string()),
        Some(k) if k != host_kind => {
            return Err(Error::InvalidOciSpec(format!(
            "CDI device node {}: declared type {k} but host path {host_path} is type {host_kind}",
            node.path
        )))
        }
        Some(_) => {}
    }
    if node.major.is_none() && host_kind != "p" {
        let rdev = meta.rdev();
        node.major = Some(i64::from(libc::major(rdev)));
        node.minor = Some(i64::from(libc::minor(rdev)));
    }
    Ok(node)
}

fn add_mount(spec: &mut Value, m: &Mount) -> Result<()> {
    let mounts = array_at(spec, &["mounts"])?;
    mounts.retain(|x| str_field(x, "destination") != m.container_path);
    let mut obj = Map::new();
    obj.insert("destination".into(), json!(m.container_path));
    if let Some(kind) = &m.kind {
        obj.insert("type".into(), json!(kind));
    }
    obj.insert("source".into(), json!(m.host_path));
    if !m.options.is_empty() {
        obj.insert("options".into(), json!(m.options));
    }
    mounts.push(Value::Object(obj));
    Ok(())
}

/// Orders mounts parents-first (stable, by path depth), as CDI does after adding mounts.
fn sort_mounts(spec: &mut Value) {
    if let Some(mounts) = get_array_mut(spec, &["mounts"]) {
        mounts.sort_by_key(|m| Path::new(str_field(m, "destination")).components().count());
    }
}

fn add_hook(spec: &mut Value, hook: &Hook) -> Result<()> {
    if !HOOK_NAMES.contains(&hook.hook_name.as_str()) {
        return Err(Error::InvalidHookName(hook.hook_name.clone()));
    }
    let mut obj = Map::new();
    obj.insert("path".into(), json!(hook.path));
    if !hook.args.is_empty() {
        obj.insert("args".into(), json!(hook.args));
    }
    if !hook.env.is_empty() {
        obj.insert("env".into(), json!(hook.env));
    }
    if let Some(t) = hook.timeout {
        obj.insert("timeout".into(), json!(t));
    }
    array_at(spec, &["hooks", hook.hook_name.as_str()])?.push(Value::Object(obj));
    Ok(())
}

fn process_id(spec: &Value, which: &str) -> Option<u32> {
    spec.get("process")?
        .get("user")?
        .get(which)?
        .as_u64()
        .and_then(|v| u32::try_from(v).ok())
        .filter(|v| *v > 0)
}

fn env_key(entry: &str) -> &str {
    entry.split_once('=').map_or(entry, |(k, _)| k)
}

pub(crate) fn str_field<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or_default()
}

pub(crate) fn string_list(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

fn get_array_mut<'a>(spec: &'a mut Value, path: &[&str]) -> Option<&'a mut Vec<Value>> {
    let mut cur = spec;
    for key in path {
        cur = cur.get_mut(*key)?;
    }
    cur.as_array_mut()
}

/// The object at `path`, created (with its parents) when absent.
fn object_at<'a>(spec: &'a mut Value, path: &[&str]) -> Result<&'a mut Map<String, Value>> {
    let mut cur = spec;
    for (i, key) in path.iter().enumerate() {
        let obj = cur.as_object_mut().ok_or_else(|| not_object(&path[..i]))?;
        cur = obj
            .entry(key.to_string())
            .or_insert_with(|| Value::Object(Map::new()));
    }
    cur.as_object_mut().ok_or_else(|| not_object(path))
}

/// The array at `path`, created (with its parents) when absent or null.
fn array_at<'a>(spec: &'a mut Value, path: &[&str]) -> Result<&'a mut Vec<Value>> {
    let Some((last, parents)) = path.split_last() else {
        return Err(Error::InvalidOciSpec("empty spec path".into()));
    };
    let parent = object_at(spec, parents)?;
    let slot = parent
        .entry(last.to_string())
        .or_insert_with(|| Value::Array(Vec::new()));
    if slot.is_null() {
        *slot = Value::Array(Vec::new());
    }
    slot.as_array_mut()
        .ok_or_else(|| Error::InvalidOciSpec(format!("{} is not an array", path.join("."))))
}

fn not_object(path: &[&str]) -> Error {
    let at = if path.is_empty() {
        "top level".to_string()
    } else {
        path.join(".")
    };
    Error::InvalidOciSpec(format!("{at} is not an object"))
}
