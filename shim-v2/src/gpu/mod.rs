//! The shim's GPU layer, around CRIU: what a GPU container's checkpoint and restore do
//! besides `runc checkpoint` / `runc restore`.
//!
//! - `driver`: the driver path (lock → checkpoint → restore → unlock through gpu-state),
//!   who quiesces, and the restore's compatibility check.
//! - `hook`: the hook path, the in-container interceptor driven over its control socket
//!   (connection, `gpucr-hook.json`, checkpoint, give-back, restore) and its injection
//!   into the spec (`hook::spec`).
//! - `restore_helpers`: a restore's copy-in helpers, started before `runc restore`.
//! - `host`: CDI and the host manifest (`gpucr-host.json`), fitted to the restoring host.

pub mod driver;
pub mod hook;
pub mod host;
pub mod restore_helpers;
