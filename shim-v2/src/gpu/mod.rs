//! The shim's GPU layer, around CRIU: what a GPU container's checkpoint and restore do
//! besides `runc checkpoint` / `runc restore`.
//!
//! - `driver`: the driver path (lock → checkpoint → restore → unlock through gpu-state),
//!   who quiesces, and the restore's compatibility check.
//! - `hook`: the hook path, the in-container interceptor driven over its control socket
//!   (connection, `gpucr-hook.json`, checkpoint, give-back, restore) and its injection
//!   into the spec (`hook::spec`).
//! - `restore_helpers`: a restore's copy-in helpers, started before `runc restore`.
//! - `error`: [`error::GpuError`], the driver path's errors with gpu-state's as sources.
//! - `host`: CDI and the host manifest (`gpucr-host.json`), fitted to the restoring host.

pub mod driver;
pub mod error;
pub mod hook;
pub mod host;
pub mod restore_helpers;

/// Runs `f` on a blocking thread (`what`: whose worker, for a panic's error).
pub async fn blocking<T: Send + 'static>(
    what: &'static str,
    f: impl FnOnce() -> T + Send + 'static,
) -> crate::error::Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| error::GpuError::panicked(what)(e).into())
}
