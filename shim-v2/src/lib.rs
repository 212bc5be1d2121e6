//! gpucr's containerd shim v2 (`io.containerd.gpucr.v2`): a full runtime over runc, with
//! checkpoint/restore through CRIU and (for GPU containers) the CUDA driver.
//!
//! Layers, top down: `service` (the shim binary's lifecycle) → `task` (the ttrpc Task API)
//! → `container` + `checkpoint` (verbs on one task) → `process` (state machines) → `runc`,
//! `io`, `reaper` (the outside world).

pub mod by_reference;
pub mod checkpoint;
pub mod container;
pub mod criu_log;
pub mod deadline;
pub mod error;
pub mod events;
pub mod failpoint;
pub mod gpu;
pub mod io;
pub mod layout;
pub mod logger;
pub mod manifest;
pub mod metrics;
pub mod oom;
pub mod options;
pub mod process;
pub mod reaper;
pub mod records;
pub mod restore_cgroup;
pub mod runc;
pub mod service;
pub mod stats;
pub mod store_config;
pub mod task;
pub mod unpacked;

/// The runtime name containerd knows this shim by.
pub const RUNTIME_ID: &str = "io.containerd.gpucr.v2";
