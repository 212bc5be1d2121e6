//! Where `install/install.sh` puts gpucr's files: the tests run exactly these (the CI
//! installs first), never copies of their own, and never with a product file moved aside.

use std::path::{Path, PathBuf};

use crate::error::{HarnessError, Result};

/// The shim and `gpucr-copyin` (install.sh's default `--prefix /usr/local`).
pub const SHIM_DIR: &str = "/usr/local/bin";
/// The hook library the shim injects into GPU containers by default.
pub const HOOK_LIB: &str = "/usr/lib/gpucr/libgpucr_hook.so";
/// gpucr's CRIU plugin, in the directory CRIU loads every plugin from.
pub const CRIU_PLUGIN: &str = "/usr/lib/criu/gpucr_cuda_plugin.so";

/// `path` when it is installed, else an error that says how to install it.
pub fn file(path: &str) -> Result<PathBuf> {
    let p = Path::new(path);
    if p.is_file() {
        Ok(p.to_path_buf())
    } else {
        Err(HarnessError::Unexpected(format!(
            "{path} is not installed: the tests run the installed layout, run \
             install/install.sh first"
        )))
    }
}
