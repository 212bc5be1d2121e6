//! Atomic publication of an image directory: everything is written under a temporary
//! sibling name (`.NAME.tmp-PID-RANDOM`), fsynced, and renamed to `NAME` at the end,
//! then the containing directory is fsynced. A crash leaves only a temporary name,
//! which readers refuse and the next writer of the same name removes.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use super::error::ImageError;
use super::manifest::{ImageId, MANIFEST_FILE};

const TEMP_MARK: &str = ".tmp-";

/// What is at a path where an image is expected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageState {
    /// Nothing there.
    Missing,
    /// A directory that is not a finished image (a temporary name, or no manifest).
    Incomplete { reason: &'static str },
    /// A directory with a manifest (not yet validated: [`super::ImageReader::open`] does that).
    Complete,
}

/// Tells a finished image from an interrupted one, without reading it.
pub fn image_state(dir: &Path) -> ImageState {
    if !dir.exists() {
        return ImageState::Missing;
    }
    if dir
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(is_temp_name)
    {
        return ImageState::Incomplete {
            reason: "temporary name of an unfinished write",
        };
    }
    if !dir.join(MANIFEST_FILE).is_file() {
        return ImageState::Incomplete {
            reason: "no manifest",
        };
    }
    ImageState::Complete
}

pub(crate) fn is_temp_name(name: &str) -> bool {
    name.starts_with('.') && name.contains(TEMP_MARK)
}

/// Splits `target` into its (existing) parent directory and final name.
pub(crate) fn split_target(target: &Path) -> Result<(PathBuf, String), ImageError> {
    let name = target
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| !is_temp_name(n))
        .ok_or_else(|| {
            ImageError::Usage(format!(
                "{} is not a usable image directory name",
                target.display()
            ))
        })?;
    let parent = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((parent, name.to_string()))
}

/// A fresh temporary directory next to `target` (created, empty).
pub(crate) fn create_temp_dir(target: &Path) -> Result<PathBuf, ImageError> {
    let (parent, name) = split_target(target)?;
    std::fs::create_dir_all(&parent).map_err(|e| ImageError::io(&parent, e))?;
    let suffix = random_id().to_string();
    let temp = parent.join(format!(
        ".{name}{TEMP_MARK}{}-{}",
        std::process::id(),
        &suffix[..8]
    ));
    std::fs::create_dir(&temp).map_err(|e| ImageError::io(&temp, e))?;
    Ok(temp)
}

/// Removes temporary directories left next to `target` by writers that are gone
/// (their pid no longer exists). Returns what it removed.
pub fn remove_stale_temps(target: &Path) -> Result<Vec<PathBuf>, ImageError> {
    let (parent, name) = split_target(target)?;
    let prefix = format!(".{name}{TEMP_MARK}");
    let mut removed = Vec::new();
    let entries = match std::fs::read_dir(&parent) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(removed),
        Err(e) => return Err(ImageError::io(&parent, e)),
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(rest) = file_name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
            continue;
        };
        let pid = rest.split('-').next().and_then(|p| p.parse::<i32>().ok());
        if pid.is_some_and(pid_alive) {
            continue;
        }
        let path = entry.path();
        std::fs::remove_dir_all(&path).map_err(|e| ImageError::io(&path, e))?;
        tracing::info!(path = %path.display(), "removed an interrupted GPU state image write");
        removed.push(path);
    }
    Ok(removed)
}

fn pid_alive(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    // SAFETY: kill with signal 0 only checks for the process; it sends nothing.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

pub(crate) fn fsync_path(path: &Path) -> Result<(), ImageError> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| ImageError::io(path, e))
}

/// Makes `temp` durable and renames it to `target`; `target` must not exist.
pub(crate) fn publish(temp: &Path, target: &Path) -> Result<(), ImageError> {
    fsync_path(temp)?;
    if target.exists() {
        return Err(ImageError::AlreadyExists {
            path: target.to_path_buf(),
        });
    }
    std::fs::rename(temp, target).map_err(|e| ImageError::io(target, e))?;
    let (parent, _) = split_target(target)?;
    fsync_path(&parent)
}

/// A random id from the kernel's generator (falls back to time and pid).
pub(crate) fn random_id() -> ImageId {
    let mut bytes = [0u8; 16];
    let from_kernel = File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    if from_kernel.is_err() {
        let seed = format!("{:?} {}", std::time::SystemTime::now(), std::process::id());
        bytes.copy_from_slice(&blake3::hash(seed.as_bytes()).as_bytes()[..16]);
    }
    ImageId(bytes)
}
