//! Injection of the hook library (`libgpucr_hook.so`) into GPU containers: the bundle's
//! config.json gets, before `runc create`, a read-only bind mount of the library, a
//! read-write bind mount of the container's socket directory, and `LD_PRELOAD` plus
//! `GPUCR_HOOK_SOCKET_DIR` in the init process's environment.
//!
//! A restore must carry the same two mounts (CRIU dumped them as external bind mounts
//! and maps them by destination), with this host's sources: [`inject`] is idempotent and
//! is run again on the restoring bundle when the image says the hook was injected.

use std::path::{Path, PathBuf};
use std::sync::Once;

use serde_json::{json, Value};

use crate::error::{Error, Result};

/// Annotation: `on` forces the hook into a container, `off` keeps it out; default: GPU
/// containers only.
pub const HOOK_ANNOTATION: &str = "io.gpucr.hook";
/// Shim environment: where the hook library is on this host.
pub const HOOK_LIB_ENV: &str = "GPUCR_HOOK_LIB";
pub const DEFAULT_HOOK_LIB: &str = "/usr/lib/gpucr/libgpucr_hook.so";
/// Where the container sees the library and the socket directory.
pub const CONTAINER_LIB: &str = "/.gpucr/lib/libgpucr_hook.so";
pub const CONTAINER_SOCKET_DIR: &str = "/.gpucr/run";
/// The host socket directory's name inside the bundle (made again by a restore's Create).
const BUNDLE_SOCKET_DIR: &str = "gpucr-hook";

/// The hook library's path on this host.
pub fn hook_lib() -> PathBuf {
    std::env::var_os(HOOK_LIB_ENV)
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_HOOK_LIB))
}

/// The host directory holding a container's `hook-<pid>.sock` files.
pub fn socket_dir(bundle: &Path) -> PathBuf {
    bundle.join(BUNDLE_SOCKET_DIR)
}

/// Whether a container gets the hook, and why not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Inject,
    /// Not a GPU container (no `/dev/nvidia*` device, no `nvidia.com/gpu` CDI device).
    NotGpu,
    /// `io.gpucr.hook=off`.
    Off,
    /// The library is not installed on this host.
    NoLibrary(PathBuf),
}

/// Decides from the spec (`annotations`, `linux.devices`) and whether `lib` exists.
pub fn decide(spec: &Value, lib: &Path, lib_exists: bool) -> Result<Decision> {
    let annotation = spec
        .pointer("/annotations")
        .and_then(|a| a.get(HOOK_ANNOTATION))
        .and_then(Value::as_str);
    let wanted = match annotation {
        Some("off") => return Ok(Decision::Off),
        Some("on") => true,
        None | Some("") | Some("auto") => is_gpu(spec),
        Some(other) => {
            return Err(Error::invalid(format!(
                "{HOOK_ANNOTATION}={other:?}: use on, off or auto"
            )))
        }
    };
    Ok(match (wanted, lib_exists) {
        (false, _) => Decision::NotGpu,
        (true, false) => Decision::NoLibrary(lib.to_path_buf()),
        (true, true) => Decision::Inject,
    })
}

/// A GPU container: an NVIDIA device node in the spec, or a CDI `nvidia.com/gpu` device
/// named by an annotation (before or instead of its edits).
fn is_gpu(spec: &Value) -> bool {
    let nodes = spec
        .pointer("/linux/devices")
        .and_then(Value::as_array)
        .is_some_and(|d| {
            d.iter().any(|d| {
                d.get("path")
                    .and_then(Value::as_str)
                    .is_some_and(|p| p.starts_with("/dev/nvidia"))
            })
        });
    let cdi = spec
        .pointer("/annotations")
        .and_then(Value::as_object)
        .is_some_and(|a| {
            a.iter().any(|(k, v)| {
                k.starts_with("cdi.k8s.io/")
                    && v.as_str().is_some_and(|v| v.contains("nvidia.com/gpu"))
            })
        });
    nodes || cdi
}

/// Adds the two bind mounts and the environment to `spec` (idempotent: a mount at the
/// same destination is replaced, `LD_PRELOAD` gets the library once).
pub fn inject(spec: &mut Value, lib: &Path, socket_dir: &Path) {
    let mounts = [
        json!({
            "destination": CONTAINER_LIB,
            "type": "bind",
            "source": lib,
            "options": ["rbind", "ro", "nosuid", "nodev"],
        }),
        json!({
            "destination": CONTAINER_SOCKET_DIR,
            "type": "bind",
            "source": socket_dir,
            "options": ["rbind", "rw", "nosuid", "nodev", "noexec"],
        }),
    ];
    let obj = spec.as_object_mut().expect("an OCI spec is an object");
    let list = obj.entry("mounts").or_insert_with(|| json!([]));
    if !list.is_array() {
        *list = json!([]);
    }
    let list = list.as_array_mut().expect("just made an array");
    for m in mounts {
        list.retain(|old| old.get("destination") != m.get("destination"));
        list.push(m);
    }
    let process = obj.entry("process").or_insert_with(|| json!({}));
    let env = process
        .as_object_mut()
        .map(|p| p.entry("env").or_insert_with(|| json!([])));
    if let Some(Value::Array(env)) = env {
        set_env(env, "GPUCR_HOOK_SOCKET_DIR", CONTAINER_SOCKET_DIR);
        let preload = env
            .iter()
            .filter_map(Value::as_str)
            .find_map(|e| e.strip_prefix("LD_PRELOAD="))
            .map(str::to_string);
        let preload = match preload {
            Some(p) if p.split([':', ' ']).any(|l| l == CONTAINER_LIB) => p,
            Some(p) if !p.is_empty() => format!("{p}:{CONTAINER_LIB}"),
            _ => CONTAINER_LIB.to_string(),
        };
        set_env(env, "LD_PRELOAD", &preload);
    }
}

fn set_env(env: &mut Vec<Value>, key: &str, value: &str) {
    let prefix = format!("{key}=");
    env.retain(|e| !e.as_str().is_some_and(|e| e.starts_with(&prefix)));
    env.push(Value::String(format!("{prefix}{value}")));
}

/// Whether `spec` carries the hook (its socket directory mount).
pub fn injected(spec: &Value) -> bool {
    spec.pointer("/mounts")
        .and_then(Value::as_array)
        .is_some_and(|m| {
            m.iter()
                .any(|m| m.get("destination").and_then(Value::as_str) == Some(CONTAINER_SOCKET_DIR))
        })
}

/// The host uid and gid of the init process's user (through the user namespace's
/// mappings, when it has them), who must be able to bind sockets in the directory.
fn host_owner(spec: &Value) -> (u32, u32) {
    let id = |field: &str| {
        spec.pointer(&format!("/process/user/{field}"))
            .and_then(Value::as_u64)
            .unwrap_or(0) as u32
    };
    let map = |kind: &str, id: u32| {
        let Some(maps) = spec
            .pointer(&format!("/linux/{kind}"))
            .and_then(Value::as_array)
        else {
            return id;
        };
        maps.iter()
            .find_map(|m| {
                let (c, h, n) = (
                    m.get("containerID")?.as_u64()? as u32,
                    m.get("hostID")?.as_u64()? as u32,
                    m.get("size")?.as_u64()? as u32,
                );
                (id >= c && id - c < n).then_some(h + (id - c))
            })
            .unwrap_or(id)
    };
    (map("uidMappings", id("uid")), map("gidMappings", id("gid")))
}

/// Creates the host socket directory, owned by the container's user.
fn make_socket_dir(dir: &Path, spec: &Value) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    let (uid, gid) = host_owner(spec);
    nix::unistd::chown(
        dir,
        Some(nix::unistd::Uid::from_raw(uid)),
        Some(nix::unistd::Gid::from_raw(gid)),
    )
    .map_err(|e| Error::io(format!("chown of {}", dir.display()), e.into()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o770))
        .map_err(|e| Error::io(format!("chmod of {}", dir.display()), e))
}

static NO_LIBRARY_LOGGED: Once = Once::new();

/// Create: injects the hook into the bundle's spec (the caller writes it) when [`decide`]
/// says so. Returns whether it did. `align` (bytes, 0 for none): where the hook starts each
/// stored chunk of its images, the store's slice for a container checkpointed by
/// reference, so unchanged memory dedups whatever order the hook wrote it in.
pub fn inject_at_create(id: &str, bundle: &Path, spec: &mut Value, align: u64) -> Result<bool> {
    let lib = hook_lib();
    match decide(spec, &lib, lib.is_file())? {
        Decision::Inject => {}
        Decision::NoLibrary(lib) => {
            NO_LIBRARY_LOGGED.call_once(|| {
                tracing::info!(id, lib = %lib.display(), "GPU containers run without the \
                    hook (driver checkpoints only): the hook library is not installed; \
                    install it or set {HOOK_LIB_ENV}");
            });
            return Ok(false);
        }
        other => {
            tracing::debug!(id, decision = ?other, "no hook");
            return Ok(false);
        }
    }
    make_socket_dir(&socket_dir(bundle), spec)?;
    inject(spec, &lib, &socket_dir(bundle));
    if align > 0 {
        if let Some(Value::Array(env)) = spec.pointer_mut("/process/env") {
            set_env(
                env,
                gpucr_hook::fastpath::ENV_ALIGN_MIB,
                &(align >> 20).max(1).to_string(),
            );
        }
    }
    tracing::info!(id, lib = %lib.display(), align, "hook injected");
    Ok(true)
}

/// Whether the checkpointed container had the hook: its record says so, or (an image
/// without one) the host manifest recorded the hook's bind mounts.
pub fn was_injected(image: &Path, record: Option<&crate::gpu::hook::HookRecord>) -> bool {
    if let Some(r) = record {
        return r.injected;
    }
    gpucr_cdi::HostManifest::file_path(image).exists()
        && gpucr_cdi::HostManifest::load(image).is_ok_and(|m| {
            m.bind_mounts
                .iter()
                .any(|b| b.destination == CONTAINER_LIB || b.destination == CONTAINER_SOCKET_DIR)
        })
}

/// Restore of an image whose container had the hook: the same mounts, this host's
/// sources. Refuses when the library is missing (CRIU could not restore the mounts).
pub fn inject_at_restore(bundle: &Path) -> Result<()> {
    let lib = hook_lib();
    if !lib.is_file() {
        return Err(Error::invalid(format!(
            "the checkpoint was taken with the gpucr hook, and the hook library is not at {} \
             on this host: install it (install/install.sh) or set {HOOK_LIB_ENV}",
            lib.display()
        )));
    }
    let config = bundle.join("config.json");
    let mut spec = gpucr_cdi::read_oci_spec(&config).map_err(spec_error)?;
    make_socket_dir(&socket_dir(bundle), &spec)?;
    inject(&mut spec, &lib, &socket_dir(bundle));
    gpucr_cdi::write_json_atomic(&config, &spec).map_err(spec_error)
}

pub(crate) fn spec_error(e: gpucr_cdi::Error) -> Error {
    Error::invalid(format!("bundle config.json: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu_spec() -> Value {
        json!({
            "process": {"env": ["PATH=/bin"], "user": {"uid": 0, "gid": 0}},
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
            "linux": {"devices": [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}]},
        })
    }

    fn env(spec: &Value) -> Vec<String> {
        spec["process"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e.as_str().unwrap().to_string())
            .collect()
    }

    #[test]
    fn gpu_containers_get_it_unless_turned_off_or_missing() {
        let lib = Path::new("/usr/lib/gpucr/libgpucr_hook.so");
        assert_eq!(decide(&gpu_spec(), lib, true).unwrap(), Decision::Inject);
        assert_eq!(
            decide(&gpu_spec(), lib, false).unwrap(),
            Decision::NoLibrary(lib.into())
        );
        let cpu = json!({"process": {"env": []}});
        assert_eq!(decide(&cpu, lib, true).unwrap(), Decision::NotGpu);
        let cdi = json!({"annotations": {"cdi.k8s.io/gpu": "nvidia.com/gpu=0"}});
        assert_eq!(decide(&cdi, lib, true).unwrap(), Decision::Inject);
        let forced = json!({"annotations": {HOOK_ANNOTATION: "on"}});
        assert_eq!(decide(&forced, lib, true).unwrap(), Decision::Inject);
        let mut off = gpu_spec();
        off["annotations"] = json!({HOOK_ANNOTATION: "off"});
        assert_eq!(decide(&off, lib, true).unwrap(), Decision::Off);
        let bad = json!({"annotations": {HOOK_ANNOTATION: "maybe"}});
        assert!(decide(&bad, lib, true).is_err());
    }

    #[test]
    fn injection_adds_mounts_and_env_once() {
        let mut spec = gpu_spec();
        let lib = Path::new("/opt/gpucr/libgpucr_hook.so");
        inject(&mut spec, lib, Path::new("/run/b/gpucr-hook"));
        inject(&mut spec, lib, Path::new("/run/b/gpucr-hook"));
        let mounts = spec["mounts"].as_array().unwrap();
        assert_eq!(mounts.len(), 3);
        let lib_mount = mounts
            .iter()
            .find(|m| m["destination"] == CONTAINER_LIB)
            .unwrap();
        assert_eq!(lib_mount["source"], "/opt/gpucr/libgpucr_hook.so");
        assert!(lib_mount["options"]
            .as_array()
            .unwrap()
            .contains(&json!("ro")));
        let run = mounts
            .iter()
            .find(|m| m["destination"] == CONTAINER_SOCKET_DIR)
            .unwrap();
        assert_eq!(run["source"], "/run/b/gpucr-hook");
        assert!(run["options"].as_array().unwrap().contains(&json!("rw")));
        let env = env(&spec);
        assert!(env.contains(&format!("LD_PRELOAD={CONTAINER_LIB}")));
        assert!(env.contains(&format!("GPUCR_HOOK_SOCKET_DIR={CONTAINER_SOCKET_DIR}")));
        assert_eq!(env.len(), 3, "{env:?}");
        assert!(injected(&spec));
        assert!(!injected(&gpu_spec()));
    }

    #[test]
    fn an_existing_ld_preload_is_appended_to() {
        let mut spec = gpu_spec();
        spec["process"]["env"] = json!(["LD_PRELOAD=/lib/libjemalloc.so", "A=1"]);
        inject(&mut spec, Path::new("/l.so"), Path::new("/s"));
        let env = env(&spec);
        assert!(env.contains(&format!("LD_PRELOAD=/lib/libjemalloc.so:{CONTAINER_LIB}")));
        assert_eq!(
            env.iter().filter(|e| e.starts_with("LD_PRELOAD=")).count(),
            1
        );
        inject(&mut spec, Path::new("/l.so"), Path::new("/s"));
        assert!(env.contains(&format!("LD_PRELOAD=/lib/libjemalloc.so:{CONTAINER_LIB}")));
    }

    #[test]
    fn a_restore_moves_the_sources_to_this_host() {
        let mut spec = gpu_spec();
        inject(
            &mut spec,
            Path::new("/old/lib.so"),
            Path::new("/old/bundle/gpucr-hook"),
        );
        inject(
            &mut spec,
            Path::new("/new/lib.so"),
            Path::new("/new/bundle/gpucr-hook"),
        );
        let sources: Vec<&str> = spec["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|m| m["source"].as_str())
            .collect();
        assert_eq!(sources, ["proc", "/new/lib.so", "/new/bundle/gpucr-hook"]);
    }

    #[test]
    fn the_socket_dir_belongs_to_the_mapped_user() {
        let spec = json!({
            "process": {"user": {"uid": 1000, "gid": 100}},
            "linux": {
                "uidMappings": [{"containerID": 0, "hostID": 200000, "size": 65536}],
                "gidMappings": [{"containerID": 0, "hostID": 300000, "size": 65536}],
            },
        });
        assert_eq!(host_owner(&spec), (201000, 300100));
        assert_eq!(host_owner(&json!({})), (0, 0));
    }

    #[test]
    fn create_skips_a_gpu_container_without_the_library_and_edits_with_it() {
        let bundle = tempfile::tempdir().unwrap();
        let config = bundle.path().join("config.json");
        std::fs::write(&config, serde_json::to_vec(&gpu_spec()).unwrap()).unwrap();
        // SAFETY (test): only this test reads HOOK_LIB_ENV.
        std::env::set_var(HOOK_LIB_ENV, bundle.path().join("absent.so"));
        let mut spec = gpucr_cdi::read_oci_spec(&config).unwrap();
        assert!(!inject_at_create("c", bundle.path(), &mut spec, 0).unwrap());
        assert!(!injected(&spec));
        assert!(inject_at_restore(bundle.path()).is_err());
        let lib = bundle.path().join("libgpucr_hook.so");
        std::fs::write(&lib, b"\x7fELF").unwrap();
        std::env::set_var(HOOK_LIB_ENV, &lib);
        if nix::unistd::geteuid().is_root() {
            assert!(inject_at_create("c", bundle.path(), &mut spec, 8 << 20).unwrap());
            assert!(injected(&spec));
            let env = spec.pointer("/process/env").unwrap().to_string();
            assert!(env.contains("GPUCR_HOOK_ALIGN_MIB=8"), "{env}");
            assert!(socket_dir(bundle.path()).is_dir());
        }
        std::env::remove_var(HOOK_LIB_ENV);
    }
}
