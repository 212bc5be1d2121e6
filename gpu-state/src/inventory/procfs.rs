//! GPUs from `/proc/driver/nvidia`: model, UUID, bus and driver version, no memory.

use std::path::Path;

use super::{GpuInfo, Inventory, InventorySource};

/// Reads `<root>/version` and `<root>/gpus/*/information`; `None` when `root` is
/// missing (no NVIDIA kernel module).
pub fn read(root: &Path) -> Option<Inventory> {
    if !root.is_dir() {
        return None;
    }
    let driver_version = std::fs::read_to_string(root.join("version"))
        .ok()
        .and_then(|t| parse_driver_version(&t));
    let mut gpus: Vec<(u32, GpuInfo)> = Vec::new();
    if let Ok(entries) = std::fs::read_dir(root.join("gpus")) {
        for entry in entries.flatten() {
            let Ok(text) = std::fs::read_to_string(entry.path().join("information")) else {
                continue;
            };
            let bus = entry.file_name().to_string_lossy().into_owned();
            gpus.push(parse_information(&text, &bus));
        }
    }
    gpus.sort_by_key(|(minor, _)| *minor);
    let gpus = gpus
        .into_iter()
        .enumerate()
        .map(|(i, (_, mut g))| {
            g.index = u32::try_from(i).unwrap_or(u32::MAX);
            g
        })
        .collect();
    Some(Inventory {
        driver_version,
        source: InventorySource::Procfs,
        gpus,
    })
}

/// Finds the dotted version in `NVRM version: NVIDIA UNIX ... Kernel Module ...  580.159.04  Release Build ...`.
pub fn parse_driver_version(text: &str) -> Option<String> {
    let line = text.lines().find(|l| l.starts_with("NVRM version:"))?;
    line.split_whitespace()
        .find(|tok| {
            let parts: Vec<&str> = tok.split('.').collect();
            parts.len() >= 2
                && parts
                    .iter()
                    .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(str::to_string)
}

/// Parses one `information` file into (device minor, GPU).
pub fn parse_information(text: &str, bus_dir: &str) -> (u32, GpuInfo) {
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim_start().strip_prefix(':'))
            .map(|v| v.trim().to_string())
    };
    let minor = field("Device Minor")
        .and_then(|m| m.parse().ok())
        .unwrap_or(u32::MAX);
    let gpu = GpuInfo {
        index: 0,
        model: field("Model").unwrap_or_default(),
        uuid: field("GPU UUID").unwrap_or_default(),
        bus_id: Some(field("Bus Location").unwrap_or_else(|| bus_dir.to_string())),
        memory_total_bytes: None,
        memory_free_bytes: None,
    };
    (minor, gpu)
}

#[cfg(test)]
mod tests {
    use super::*;

    const INFO: &str = "Model: \t\t NVIDIA H200\nIRQ:   \t\t 130\nGPU UUID: \t GPU-5b1d3e7a-0c2f-4a8e-9d61-3f2b7c8e9a01\nVideo BIOS: \t 96.00.af.00.01\nBus Type: \t PCIe\nDMA Size: \t 52 bits\nDMA Mask: \t 0xfffffffffffff\nBus Location: \t 0000:19:00.0\nDevice Minor: \t 1\nGPU Excluded:\t No\n";

    #[test]
    fn parses_files() {
        let v = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U22)  Thu Oct  2 2025\nGCC version:  gcc version 12.3.0\n";
        assert_eq!(parse_driver_version(v).as_deref(), Some("580.159.04"));
        let (minor, g) = parse_information(INFO, "0000:19:00.0");
        assert_eq!(minor, 1);
        assert_eq!(g.model, "NVIDIA H200");
        assert_eq!(g.uuid, "GPU-5b1d3e7a-0c2f-4a8e-9d61-3f2b7c8e9a01");
        assert_eq!(g.bus_id.as_deref(), Some("0000:19:00.0"));
    }

    #[test]
    fn reads_a_tree() {
        let root = tempfile::tempdir().unwrap();
        std::fs::write(
            root.path().join("version"),
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Wed\n",
        )
        .unwrap();
        for (bus, minor) in [("0000:a0:00.0", 1), ("0000:19:00.0", 0)] {
            let d = root.path().join("gpus").join(bus);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(
                d.join("information"),
                INFO.replace("Minor: \t 1", &format!("Minor: \t {minor}")),
            )
            .unwrap();
        }
        let inv = read(root.path()).unwrap();
        assert_eq!(inv.driver_version.as_deref(), Some("570.86.15"));
        assert_eq!(inv.gpus.len(), 2);
        assert_eq!(inv.gpus[0].index, 0);
        assert!(read(&root.path().join("absent")).is_none());
    }
}
