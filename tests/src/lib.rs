//! Test harness: starts containerd with a temporary config and builds images by hand.
//!
//! - The product is what `install/install.sh` installed, where it installed it
//!   ([`installed`]): the shim, the hook library, CRIU's plugin in CRIU's own directory.
//! - [`Containerd`] runs a private daemon (own root, state, sockets, namespace, log) with the
//!   directory of `containerd-shim-gpucr-v2` first in its PATH, and cleans everything up on
//!   drop, printing the daemon's log tail when the test panicked.
//! - [`image`] packs a busybox rootfs, and containerd checkpoint images, as OCI layouts.
//! - [`cri`] makes kubelet's CRI calls to a containerd 2.x, pulling from a loopback
//!   [`registry`]; [`cri_node`] is such a node (daemon, registry, client, pods) for a test.
//! - [`fake_cuda`] scripts tests/fake-libcuda as the driver; [`cuda_app`] is the hook's test
//!   program as an image.
//! - [`leftovers`] checks that a fault left nothing of a container, and drives the shim's
//!   failpoints.
//! - [`task`] and [`checkpoint`] wrap `ctr` for the tests; [`command::Cmd`] runs anything with
//!   a timeout; [`poll::poll_until`] waits for conditions.
//!
//! The runtime under test comes from `GPUCR_TEST_RUNTIME` (default `io.containerd.gpucr.v2`);
//! run with `GPUCR_TEST_RUNTIME=io.containerd.runc.v2` to check the tests against the stock
//! runc shim.

pub mod checkpoint;
pub mod command;
pub mod containerd;
pub mod cri;
pub mod cri_node;
pub mod criu_wrapper;
pub mod cuda_app;
pub mod error;
pub mod fake_cuda;
pub mod image;
pub mod installed;
pub mod leftovers;
pub mod manifest;
pub mod netns;
pub mod poll;
pub mod procfs;
pub mod registry;
pub mod s3;
pub mod shim_client;
pub mod task;
pub mod task_rpc;

pub use command::{Cmd, Output};
pub use containerd::{
    runtime_under_test, shim_dir, Containerd, Daemon, StartOptions, GPUCR_RUNTIME, RUNC_RUNTIME,
};
pub use error::{HarnessError, Result};
pub use poll::poll_until;
pub use task::{counter_args, COUNTER_FILE, COUNTER_SCRIPT};

/// Starts a daemon and imports the busybox image; returns both. Panics with context on error.
pub fn setup() -> (Containerd, String) {
    let containerd = Containerd::start().unwrap_or_else(|e| panic!("starting containerd: {e}"));
    let image = containerd
        .import_busybox()
        .unwrap_or_else(|e| panic!("importing the busybox image: {e}"));
    (containerd, image)
}

/// A container id unique to this test process and `name`.
pub fn unique_id(name: &str) -> String {
    format!("{name}-{}", std::process::id())
}

/// The regular files under `dir`, at any depth (none when it does not exist).
pub fn files_under(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(files_under(&path));
        } else {
            out.push(path);
        }
    }
    out
}
