//! The checkpoint image laid out so that containerd's CRI can carry it.
//!
//! CRI (containerd 1.7 and 2.x) copies a checkpoint's files into kubelet's archive and back
//! one tar entry at a time into a single directory (`writeCriuCheckpointData`): a directory
//! inside the image becomes an empty file there, and the files under it are lost. The hook's
//! GPU state images are directories (`gpu-hook/<ns pid>/`, see gpu-state's FORMAT.md), so a
//! finished checkpoint folds them into top-level files `gpu-hook.<ns pid>.<file>`, and a
//! restore unfolds them again before anything reads them. Renames only: no byte is copied.

use std::path::{Path, PathBuf};

use crate::{
    error::{IoContext, Result},
    gpu::hook::IMAGE_DIR,
};

/// The folded name of `gpu-hook/<ns_pid>/<file>`.
pub fn folded_name(ns_pid: &str, file: &str) -> String {
    format!("{IMAGE_DIR}.{ns_pid}.{file}")
}

/// `(ns pid, file)` of a folded name; `None` for any other name.
pub fn unfolded_name(name: &str) -> Option<(&str, &str)> {
    let rest = name.strip_prefix(IMAGE_DIR)?.strip_prefix('.')?;
    let (pid, file) = rest.split_once('.')?;
    let pid_ok = !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit());
    (pid_ok && !file.is_empty()).then_some((pid, file))
}

/// The name the image's manifest uses for a file found at `relative` (folded or not), so
/// that a manifest written before the fold, or an image unfolded since, still matches.
pub fn manifest_name(relative: &str) -> String {
    match relative
        .strip_prefix(IMAGE_DIR)
        .and_then(|r| r.strip_prefix('/'))
        .and_then(|r| r.split_once('/'))
    {
        Some((pid, file)) if !file.contains('/') => folded_name(pid, file),
        _ => relative.to_string(),
    }
}

/// Whether `path` is a symbolic link (`gpu-hook` linked to a store's stage).
fn is_link(path: &Path) -> bool {
    path.symlink_metadata()
        .is_ok_and(|m| m.file_type().is_symlink())
}

fn entries(dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).ctx(|| format!("reading {}", dir.display()))? {
        let e = e.ctx(|| format!("reading {}", dir.display()))?;
        out.push((e.file_name().to_string_lossy().into_owned(), e.path()));
    }
    Ok(out)
}

/// Moves every `gpu-hook/<ns pid>/<file>` to the image's top level under its folded name
/// and removes the emptied directories. Returns how many files moved.
///
/// When `gpu-hook` is a link to a store's stage (a checkpoint by reference, see
/// `by_reference::stage_for_hook`), the files stay there and the folded names are links to
/// them: the store takes them in place, and its ingest replaces the links.
pub fn fold(image: &Path) -> Result<usize> {
    let root = image.join(IMAGE_DIR);
    let staged = is_link(&root);
    if !root.is_dir() {
        if staged {
            std::fs::remove_file(&root).ctx(|| format!("removing {}", root.display()))?;
        }
        return Ok(0);
    }
    let real = std::fs::canonicalize(&root).ctx(|| format!("following {}", root.display()))?;
    let mut moved = 0;
    for (pid, dir) in entries(&real)? {
        if !dir.is_dir() {
            continue;
        }
        for (file, path) in entries(&dir)? {
            let to = image.join(folded_name(&pid, &file));
            if staged {
                std::os::unix::fs::symlink(&path, &to)
            } else {
                std::fs::rename(&path, &to)
            }
            .ctx(|| format!("moving {} to {}", path.display(), to.display()))?;
            moved += 1;
        }
        if !staged {
            std::fs::remove_dir(&dir).ctx(|| format!("removing {}", dir.display()))?;
        }
    }
    if staged {
        std::fs::remove_file(&root).ctx(|| format!("removing {}", root.display()))?;
    } else {
        std::fs::remove_dir(&root).ctx(|| format!("removing {}", root.display()))?;
    }
    Ok(moved)
}

/// The reverse of [`fold`]: the hook's images back in `gpu-hook/<ns pid>/`, where the
/// restore reads them. An image that was never folded is left as it is. Returns how many
/// files moved.
pub fn unfold(image: &Path) -> Result<usize> {
    // Linked to a store's stage that holds them already (`by_reference::resolve`).
    if is_link(&image.join(IMAGE_DIR)) {
        return Ok(0);
    }
    let mut moved = 0;
    for (name, path) in entries(image)? {
        let Some((pid, file)) = unfolded_name(&name) else {
            continue;
        };
        if !path.is_file() {
            continue;
        }
        let dir = image.join(IMAGE_DIR).join(pid);
        std::fs::create_dir_all(&dir).ctx(|| format!("creating {}", dir.display()))?;
        let to = dir.join(file);
        std::fs::rename(&path, &to)
            .ctx(|| format!("moving {} to {}", path.display(), to.display()))?;
        moved += 1;
    }
    Ok(moved)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_fold_and_unfold() {
        assert_eq!(
            folded_name("7", "manifest.json"),
            "gpu-hook.7.manifest.json"
        );
        assert_eq!(
            unfolded_name("gpu-hook.7.data-000.bin"),
            Some(("7", "data-000.bin"))
        );
        for other in [
            "gpu-hook.json",
            "gpu-hook.x.a",
            "gpu-hook.7.",
            "pages-1.img",
            "gpu-hook",
        ] {
            assert_eq!(unfolded_name(other), None, "{other}");
        }
        assert_eq!(
            manifest_name("gpu-hook/7/data-0.bin"),
            "gpu-hook.7.data-0.bin"
        );
        assert_eq!(
            manifest_name("gpu-hook.7.data-0.bin"),
            "gpu-hook.7.data-0.bin"
        );
        assert_eq!(manifest_name("pages-1.img"), "pages-1.img");
    }

    #[test]
    fn an_image_folds_flat_and_unfolds_back() {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path();
        std::fs::write(image.join("pages-1.img"), b"pages").unwrap();
        std::fs::write(image.join("gpucr-hook.json"), b"{}").unwrap();
        for pid in ["1", "23"] {
            let d = image.join(IMAGE_DIR).join(pid);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("manifest.json"), pid).unwrap();
            std::fs::write(d.join("data-000.bin"), format!("data {pid}")).unwrap();
        }
        assert_eq!(fold(image).unwrap(), 4);
        // Flat: nothing but files at the top, as CRI's copy needs.
        for (name, path) in entries(image).unwrap() {
            assert!(path.is_file(), "{name} is not a file");
        }
        assert_eq!(
            std::fs::read_to_string(image.join("gpu-hook.23.data-000.bin")).unwrap(),
            "data 23"
        );
        assert_eq!(unfold(image).unwrap(), 4);
        assert_eq!(
            std::fs::read_to_string(image.join("gpu-hook/23/data-000.bin")).unwrap(),
            "data 23"
        );
        assert_eq!(
            std::fs::read_to_string(image.join("gpu-hook/1/manifest.json")).unwrap(),
            "1"
        );
        assert!(image.join("gpucr-hook.json").is_file());
        // Unfolding an unfolded image changes nothing.
        assert_eq!(unfold(image).unwrap(), 0);
        assert_eq!(fold(dir.path().join("missing").as_path()).unwrap_or(0), 0);
    }
}
