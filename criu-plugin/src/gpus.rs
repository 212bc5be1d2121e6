//! Restore anywhere, for plain runc/podman restores: the GPUs of the dump are recorded in the
//! image directory (`gpucr-plugin-gpus.json`), and a restore pairs them with this host's GPUs
//! before anything is restored, refusing when this host cannot take them; the pairs go to
//! the driver's restore (CUDA 13.0+ `CUcheckpointGpuPair`).
//!
//! Pairing: `GPUCR_GPU_MAP=old=new,...` (UUIDs or indexes) when given; else every recorded
//! GPU that this host has keeps its UUID; else the i-th recorded GPU goes to the i-th GPU here.
//! Pairs reach the driver only when a GPU changes (or `GPUCR_GPU_PAIRS=always`). The mounts
//! and device nodes are the container runtime's part: runc passes CRIU an external mount for
//! every bind mount of the (target's) config.json.

use std::path::{Path, PathBuf};

use gpu_state::inventory::{check_compatibility, GpuInfo, Inventory};
use gpu_state::GpuPair;
use serde::{Deserialize, Serialize};

/// The file in CRIU's image directory.
pub const FILE: &str = "gpucr-plugin-gpus.json";
/// Environment: explicit old=new GPU pairs, comma-separated, by UUID or index.
pub const MAP_ENV: &str = "GPUCR_GPU_MAP";
/// Environment: `always` gives the driver the pairs even when no GPU changes.
pub const PAIRS_ENV: &str = "GPUCR_GPU_PAIRS";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub version: u32,
    pub inventory: Inventory,
}

pub fn save(dir: &Path, inventory: &Inventory) -> Result<(), String> {
    let record = Record {
        version: 1,
        inventory: inventory.clone(),
    };
    let text = serde_json::to_vec_pretty(&record).map_err(|e| e.to_string())?;
    let tmp = dir.join(format!("{FILE}.tmp"));
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, dir.join(FILE)))
        .map_err(|e| format!("writing {FILE}: {e}"))
}

/// `None`: the image has no record (dumped without this plugin's record).
pub fn load(dir: &Path) -> Result<Option<Record>, String> {
    let path = dir.join(FILE);
    let text = match std::fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("reading {FILE}: {e}")),
    };
    serde_json::from_slice(&text)
        .map(Some)
        .map_err(|e| format!("{FILE} is damaged ({e}); restore with the image it was dumped with"))
}

/// The image directory as a path this process can open (`/proc/self/fd/<n>`).
pub fn image_dir() -> Option<PathBuf> {
    crate::criu::image_dir_fd().map(|fd| PathBuf::from(format!("/proc/self/fd/{fd}")))
}

/// Pairs the recorded GPUs with `current`'s (see the module docs) and checks that this host
/// can take them. `Err` names every difference.
pub fn plan(
    recorded: &Inventory,
    current: &Inventory,
    map: Option<&str>,
    always: bool,
) -> Result<Vec<GpuPair>, String> {
    if recorded.gpus.is_empty() {
        return Ok(Vec::new());
    }
    let targets: Vec<GpuInfo> = match map.filter(|m| !m.trim().is_empty()) {
        Some(m) => explicit(recorded, current, m)?,
        None if recorded
            .gpus
            .iter()
            .all(|g| current.gpus.iter().any(|c| c.uuid == g.uuid)) =>
        {
            recorded
                .gpus
                .iter()
                .filter_map(|g| current.gpus.iter().find(|c| c.uuid == g.uuid).cloned())
                .collect()
        }
        None => current.gpus.clone(),
    };
    // Compare each recorded GPU with the one it goes to.
    let paired = Inventory {
        gpus: targets.clone(),
        ..current.clone()
    };
    check_compatibility(recorded, &paired, None).map_err(|e| e.to_string())?;
    GpuPair::for_restore(
        recorded
            .gpus
            .iter()
            .zip(&targets)
            .map(|(o, n)| (o.uuid.as_str(), n.uuid.as_str())),
        always,
    )
}

/// `GPUCR_GPU_MAP`: every recorded GPU must be named once.
fn explicit(recorded: &Inventory, current: &Inventory, map: &str) -> Result<Vec<GpuInfo>, String> {
    let find = |inv: &Inventory, key: &str| -> Option<GpuInfo> {
        let key = key.trim();
        match key.parse::<u32>() {
            Ok(i) => inv.gpus.iter().find(|g| g.index == i).cloned(),
            Err(_) => inv.gpus.iter().find(|g| g.uuid == key).cloned(),
        }
    };
    let mut out: Vec<Option<GpuInfo>> = vec![None; recorded.gpus.len()];
    for entry in map.split(',').filter(|e| !e.trim().is_empty()) {
        let (old, new) = entry
            .split_once('=')
            .ok_or_else(|| format!("{MAP_ENV}: {entry:?} is not old=new"))?;
        let o = find(recorded, old)
            .ok_or_else(|| format!("{MAP_ENV}: the checkpoint has no GPU {old:?}"))?;
        let n =
            find(current, new).ok_or_else(|| format!("{MAP_ENV}: this host has no GPU {new:?}"))?;
        let slot = recorded
            .gpus
            .iter()
            .position(|g| g.uuid == o.uuid)
            .unwrap_or(0);
        out[slot] = Some(n);
    }
    out.into_iter()
        .zip(&recorded.gpus)
        .map(|(n, o)| {
            n.ok_or_else(|| {
                format!(
                    "{MAP_ENV} does not say where GPU {} ({}) goes",
                    o.index, o.uuid
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_state::inventory::InventorySource;

    fn gpu(index: u32, model: &str, uuid_tail: char) -> GpuInfo {
        GpuInfo {
            index,
            model: model.into(),
            uuid: format!(
                "GPU-{0}{0}{0}{0}{0}{0}{0}{0}-1111-2222-3333-444444444444",
                uuid_tail
            ),
            bus_id: None,
            memory_total_bytes: None,
            memory_free_bytes: None,
        }
    }

    fn inv(gpus: Vec<GpuInfo>) -> Inventory {
        Inventory {
            driver_version: Some("580.159.04".into()),
            source: InventorySource::Procfs,
            gpus,
        }
    }

    #[test]
    fn same_gpus_need_no_pairs_unless_asked() {
        let a = inv(vec![gpu(0, "NVIDIA H200", 'a')]);
        assert!(plan(&a, &a, None, false).unwrap().is_empty());
        let p = plan(&a, &a, None, true).unwrap();
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].old, p[0].new);
    }

    #[test]
    fn another_gpu_is_paired_by_position_or_map() {
        let old = inv(vec![gpu(0, "NVIDIA H200", 'a'), gpu(1, "NVIDIA H200", 'b')]);
        let new = inv(vec![gpu(0, "NVIDIA H200", 'c'), gpu(1, "NVIDIA H200", 'd')]);
        let p = plan(&old, &new, None, false).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].new.to_string(), new.gpus[0].uuid);
        let p = plan(&old, &new, Some("0=1,1=0"), false).unwrap();
        assert_eq!(p[0].new.to_string(), new.gpus[1].uuid);
        assert_eq!(p[1].new.to_string(), new.gpus[0].uuid);
        let e = plan(
            &old,
            &new,
            Some(&format!("{}={}", old.gpus[0].uuid, new.gpus[1].uuid)),
            false,
        )
        .unwrap_err();
        assert!(e.contains("does not say where GPU 1"), "{e}");
        // Swapped on the same host is a change: pairs.
        let p = plan(&old, &old, Some("0=1,1=0"), false).unwrap();
        assert_eq!(p.len(), 2);
    }

    #[test]
    fn refusals_name_what_differs() {
        let old = inv(vec![gpu(0, "NVIDIA H200", 'a')]);
        let other = inv(vec![gpu(0, "NVIDIA A100", 'c')]);
        let e = plan(&old, &other, None, false).unwrap_err();
        assert!(e.contains("A100") && e.contains("H200"), "{e}");
        let none = inv(vec![]);
        assert!(plan(&old, &none, None, false)
            .unwrap_err()
            .contains("no NVIDIA GPU"));
        let e = plan(&old, &old, Some("7=0"), false).unwrap_err();
        assert!(e.contains("no GPU \"7\""), "{e}");
        let mut branch = old.clone();
        branch.driver_version = Some("570.1".into());
        assert!(plan(&old, &branch, None, false)
            .unwrap_err()
            .contains("branch"));
    }

    #[test]
    fn record_round_trip() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(load(d.path()).unwrap(), None);
        let a = inv(vec![gpu(0, "NVIDIA H200", 'a')]);
        save(d.path(), &a).unwrap();
        assert_eq!(load(d.path()).unwrap().unwrap().inventory, a);
        std::fs::write(d.path().join(FILE), "{").unwrap();
        assert!(load(d.path()).unwrap_err().contains("damaged"));
    }
}
