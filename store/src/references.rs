//! Which store manifests checkpoints elsewhere on the node still reference: a by-reference
//! checkpoint carries only `gpucr-store.json`, inside containerd's content store (the
//! checkpoint's CRIU layer, an uncompressed tar), a kubelet archive (a tar), or an
//! `--image-path` directory. `gpucr gc` pins what they name, so a checkpoint containerd or
//! kubelet still holds keeps its chunks whatever its age.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::dir::{DirRef, REF_FILE};
use crate::error::{io, Result};

/// Where containerd and kubelet keep checkpoints on a default node.
pub const DEFAULT_PLACES: [&str; 2] = [
    "/var/lib/containerd/io.containerd.content.v1.content/blobs",
    "/var/lib/kubelet/checkpoints",
];

/// What [`referenced_manifests`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct References {
    pub manifests: BTreeSet<String>,
    /// Files (or tar entries, `archive!entry`) that named them.
    pub holders: Vec<PathBuf>,
    /// Unreadable references (a damaged `gpucr-store.json`): reported, never pinned.
    pub unreadable: Vec<PathBuf>,
}

/// Every manifest named by a `gpucr-store.json` in `places` (files or directories, walked;
/// a missing place is skipped): as a file, or as an entry of an uncompressed tar.
pub fn referenced_manifests(places: &[PathBuf]) -> Result<References> {
    let mut found = References::default();
    for place in places {
        walk(place, &mut found)?;
    }
    Ok(found)
}

fn walk(path: &Path, found: &mut References) -> Result<()> {
    let md = match std::fs::symlink_metadata(path) {
        Ok(md) => md,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io("cannot stat", path)(e)),
    };
    if md.is_dir() {
        for entry in std::fs::read_dir(path).map_err(io("cannot list", path))? {
            let entry = entry.map_err(io("cannot list", path))?;
            walk(&entry.path(), found)?;
        }
    } else if md.is_file() {
        if path.file_name().is_some_and(|n| n == REF_FILE) {
            note(std::fs::read(path).ok(), path.to_path_buf(), found);
        } else if is_tar(path) {
            scan_tar(path, found);
        }
    }
    Ok(())
}

fn note(bytes: Option<Vec<u8>>, holder: PathBuf, found: &mut References) {
    match bytes.and_then(|b| serde_json::from_slice::<DirRef>(&b).ok()) {
        Some(r) => {
            found.manifests.insert(r.manifest);
            found.holders.push(holder);
        }
        None => found.unreadable.push(holder),
    }
}

/// A POSIX tar header's magic (`ustar` at byte 257).
fn is_tar(path: &Path) -> bool {
    let mut head = [0u8; 262];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut head))
        .is_ok_and(|()| &head[257..262] == b"ustar")
}

/// Entries are skipped by seeking, so a large inline checkpoint costs its headers only.
fn scan_tar(path: &Path, found: &mut References) {
    let Ok(mut f) = File::open(path) else {
        return;
    };
    if f.seek(SeekFrom::Start(0)).is_err() {
        return;
    }
    let mut archive = tar::Archive::new(f);
    let Ok(entries) = archive.entries_with_seek() else {
        return;
    };
    for entry in entries {
        let Ok(mut entry) = entry else {
            return;
        };
        let is_ref = entry
            .path()
            .ok()
            .is_some_and(|p| p.file_name().is_some_and(|n| n == REF_FILE));
        if is_ref && entry.size() < (64 << 20) {
            let mut bytes = Vec::new();
            let read = entry.read_to_end(&mut bytes).ok().map(|_| bytes);
            let holder = PathBuf::from(format!(
                "{}!{}",
                path.display(),
                entry
                    .path()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default()
            ));
            note(read, holder, found);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(manifest: &str) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "format": "gpucr-store-ref", "version": 1, "mode": "local", "store_id": "s",
            "node": "n", "manifest": manifest, "files": []
        }))
        .unwrap()
    }

    #[test]
    fn references_in_directories_and_tars_are_found() {
        let places = tempfile::tempdir().unwrap();
        let ckpt = places.path().join("image-path");
        std::fs::create_dir(&ckpt).unwrap();
        std::fs::write(ckpt.join(REF_FILE), reference("a/1")).unwrap();
        // A kubelet-style archive: a tar with the reference beside a large file.
        let archive = places.path().join("checkpoint-pod_ns-c-2026.tar");
        let mut b = tar::Builder::new(File::create(&archive).unwrap());
        let big = vec![7u8; 3 << 20];
        let mut h = tar::Header::new_gnu();
        h.set_size(big.len() as u64);
        h.set_mode(0o644);
        b.append_data(&mut h, "checkpoint/pages-1.img", &big[..])
            .unwrap();
        let r = reference("b/2");
        let mut h = tar::Header::new_ustar();
        h.set_size(r.len() as u64);
        h.set_mode(0o644);
        b.append_data(&mut h, "checkpoint/gpucr-store.json", &r[..])
            .unwrap();
        b.finish().unwrap();
        drop(b);
        std::fs::write(places.path().join("other.bin"), b"not a tar").unwrap();
        let found =
            referenced_manifests(&[places.path().to_path_buf(), "/nonexistent/x".into()]).unwrap();
        assert_eq!(
            found.manifests.iter().cloned().collect::<Vec<_>>(),
            vec!["a/1".to_string(), "b/2".to_string()]
        );
        assert_eq!(found.holders.len(), 2);
    }
}
