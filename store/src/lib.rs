//! gpucr's node-local store of checkpoint data (`FORMAT.md` beside this crate is the layout's
//! specification).
//!
//! A checkpoint's bulk bytes (device memory, later CRIU's pages) are cut into chunks that are
//! written once, named by their BLAKE3 digest, and never changed; a checkpoint is a small
//! [`Manifest`] listing the chunks it needs, published last and atomically. So a second
//! checkpoint of unchanged memory writes nothing new, replicas of one model share their chunks,
//! and what containerd tars can be the manifest alone.
//!
//! - [`Store`]: opening a store and reading from it ([`store`]).
//! - [`Writer`]: one checkpoint's writes, holding the store's shared lock so a concurrent
//!   [`Store::gc`] never removes a chunk whose manifest is not yet published ([`writer`]).
//! - [`Writer::adopt`]: a file on the store's filesystem taken in without copying its bytes
//!   (a pack, with a pointer per new chunk); [`Stage`]: where such files are written
//!   ([`pack`]).
//! - [`Store::gc`] and [`Retention`]: what is kept ([`gc`]); [`Store::validate`]: every chunk
//!   against its digest ([`validate`]).
//! - [`Remote`]: the shared store other nodes reach; `push` and `pull` ([`remote`]).
//! - [`references::referenced_manifests`]: what checkpoints held by containerd or kubelet
//!   still name, for `gc` to keep ([`references`]).
//! - [`dir::ingest`] and [`dir::materialize`]: a checkpoint directory by reference, its large
//!   files in the store and a small [`DirRef`] in their place ([`dir`]).
//! - [`Progress`]: how a long transfer goes, for the shim's log and the CLI's bar
//!   ([`progress`]).
//! - [`events`]: the node's log of checkpoints and restores, which every shim appends to and
//!   `gpucr events` reads (here so that both use one format).

pub mod ahead;
mod cuts;
pub mod digest;
pub mod dir;
pub mod error;
pub mod events;
pub mod gc;
pub mod manifest;
mod mapped;
pub mod pack;
pub mod progress;
pub mod references;
pub mod remote;
mod slices;
pub mod store;
pub mod usage;
pub mod validate;
pub mod writer;

pub use ahead::{take_ahead, TakenAhead};
pub use digest::Digest;
pub use dir::{DirRef, IngestOptions, Ingested, Materialized, Reclaim, RefMode};
pub use error::{Result, StoreError};
pub use gc::{GcReport, Retention};
pub use manifest::{ChunkRef, Manifest};
pub use pack::{Adopted, Stage};
pub use progress::{LogProgress, NoProgress, Progress};
pub use remote::{Remote, Transfer};
pub use store::{Located, Store};
pub use usage::{ManifestUsage, Usage};
pub use validate::ValidateReport;
pub use writer::{Put, Writer};
