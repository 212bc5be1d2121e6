//! hook/preload/tests/cuda_app.c as a container image, for the hook's tests (through `ctr`
//! and through CRI): the program, tests/fake-libcuda as its `/usr/lib/libcuda.so.1` (its
//! memory API runs on the CPU: device pointers are host addresses, VMM memory is memfd
//! mappings), and the host libraries they and the hook need, over busybox.
//!
//! The program allocates through `cuMemAlloc`, fills a pattern, then every 100 ms reads its
//! memory back through the driver and writes `<step> ok <hash>` to [`HASH_FILE`]: memory that
//! survives a checkpoint keeps its hash, and a growing step shows the program runs. The
//! fake's memory log ([`MEM_LOG`] in the container) shows what the hook did to the driver.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{HarnessError, Result};
use crate::image::{BusyboxImage, ExtendedImage, LayerFile};

/// Where the program writes its steps.
pub const HASH_FILE: &str = "/tmp/hash";
/// The fake driver's memory log in the container (`GPUCR_FAKE_CUDA_MEM_LOG`).
pub const MEM_LOG: &str = "/tmp/mem.log";
/// The program's two allocations (cuda_app.c: 5 MiB + 123 and 3 MiB).
pub const APP_BYTES: u64 = (5 << 20) + 123 + (3 << 20);
/// The program in the image.
pub const APP_PATH: &str = "/usr/bin/cuda_app";

/// The program's argv: loop, writing its steps to [`HASH_FILE`].
pub fn args() -> Vec<String> {
    [APP_PATH, "loop", HASH_FILE].map(String::from).to_vec()
}

/// The environment the program runs with (`KEY=value`): the container's library path, the
/// fake's memory log, the hook's log.
pub fn env() -> Vec<String> {
    vec![
        format!("LD_LIBRARY_PATH={}", library_path()),
        format!("GPUCR_FAKE_CUDA_MEM_LOG={MEM_LOG}"),
        "GPUCR_HOOK_LOG=1".to_owned(),
    ]
}

/// One line of the program's hash file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub n: u64,
    /// `ok <hash>` or `bad <offset>`.
    pub verdict: String,
}

impl Step {
    /// The hash file's content (`<step> <verdict>`).
    pub fn parse(text: &str) -> Option<Step> {
        let (n, verdict) = text.trim().split_once(' ')?;
        Some(Step {
            n: n.parse().ok()?,
            verdict: verdict.to_owned(),
        })
    }
}

/// The shared libraries `ldd` names for `file` (absolute paths, the loader included).
fn ldd(file: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(file)
        .output()
        .map_err(|source| HarnessError::Spawn {
            command: format!("ldd {}", file.display()),
            source,
        })?;
    if !out.status.success() {
        return Err(HarnessError::Unexpected(format!(
            "ldd {}: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter(|w| w.starts_with('/'))
        .map(PathBuf::from)
        .collect())
}

/// Compiles cuda_app.c into `dir` (a C compiler is needed).
fn compile(dir: &Path) -> Result<PathBuf> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../hook/preload/tests/cuda_app.c");
    let app = dir.join("cuda_app");
    let out = Command::new("cc")
        .args(["-O1", "-Wall", "-o"])
        .arg(&app)
        .arg(&src)
        .arg("-ldl")
        .output()
        .map_err(|source| HarnessError::Spawn {
            command: "cc (a C compiler is needed for the hook's tests)".into(),
            source,
        })?;
    if !out.status.success() {
        return Err(HarnessError::Unexpected(format!(
            "cc {}: {}",
            src.display(),
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(app)
}

/// The image: busybox plus cuda_app, the fake libcuda (`fake_lib`) as
/// /usr/lib/libcuda.so.1, and the host libraries the app, the fake and the hook (`hook_lib`)
/// need (at their host paths).
pub fn image(fake_lib: &Path, hook_lib: &Path) -> Result<ExtendedImage> {
    let dir = tempfile::tempdir().map_err(HarnessError::io("create temp dir", "<cuda_app>"))?;
    let app = compile(dir.path())?;
    let file = |path: &str, from: &Path, mode: u32| -> Result<LayerFile> {
        Ok(LayerFile {
            path: path.trim_start_matches('/').to_owned(),
            bytes: std::fs::read(from).map_err(HarnessError::io("read", from))?,
            mode,
        })
    };
    let mut files = vec![
        file(APP_PATH, &app, 0o755)?,
        file("/usr/lib/libcuda.so.1", fake_lib, 0o755)?,
    ];
    let mut libs = Vec::new();
    for f in [app.as_path(), fake_lib, hook_lib] {
        libs.extend(ldd(f)?);
    }
    libs.sort();
    libs.dedup();
    for lib in &libs {
        files.push(file(&lib.to_string_lossy(), lib, 0o755)?);
    }
    BusyboxImage::get()?.with_files(&files)
}

/// The library directories the container's loader searches (no ld.so.cache there).
pub fn library_path() -> String {
    let mut dirs = vec!["/usr/lib".to_owned()];
    for lib in ldd(Path::new("/bin/sh")).unwrap_or_default() {
        let Some(parent) = lib.parent() else {
            continue;
        };
        let parent = parent.to_string_lossy().into_owned();
        if !dirs.contains(&parent) {
            dirs.push(parent);
        }
    }
    dirs.join(":")
}
