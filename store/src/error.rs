//! Errors of the store; each message names the path or chunk and what an operator can do.

use std::path::PathBuf;

use crate::digest::Digest;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{} is not a gpucr store ({reason}); point the store option at an empty directory or \
         an existing store",
        path.display()
    )]
    NotAStore { path: PathBuf, reason: String },
    #[error("{0:?} is not a chunk digest (64 lowercase hex digits of BLAKE3)")]
    BadDigest(String),
    #[error(
        "{0:?} is not a manifest name (segments of [A-Za-z0-9._-] joined by '/', none empty or \
         starting with '.')"
    )]
    BadName(String),
    #[error(
        "manifest {name} already exists in the store: manifests are immutable, pick a new name"
    )]
    ManifestExists { name: String },
    #[error("manifest {name} is not in the store at {}", root.display())]
    ManifestMissing { name: String, root: PathBuf },
    #[error("manifest {} is damaged: {reason}", path.display())]
    BadManifest { path: PathBuf, reason: String },
    #[error(
        "chunk {digest} ({len} bytes) is missing from the store at {}; fetch it from the \
         shared store it was pushed to, or restore from a self-contained (inline) export",
        root.display()
    )]
    ChunkMissing {
        digest: Digest,
        len: u64,
        root: PathBuf,
    },
    #[error(
        "chunk {} is damaged: its bytes hash to {actual} ({len} bytes); run `gpucr validate` \
         and fetch the chunk again from a shared store",
        path.display()
    )]
    ChunkDamaged {
        path: PathBuf,
        actual: Digest,
        len: u64,
    },
    #[error(
        "{} changed after the store took it in ahead of its checkpoint's ingest: something \
         other than the hook wrote to the hook's images; the checkpoint is refused (take it \
         again)",
        path.display()
    )]
    ChangedAfterTaken { path: PathBuf },
    #[error("shared store {location}: {what}: {source}")]
    Remote {
        what: &'static str,
        location: String,
        #[source]
        source: Box<object_store::Error>,
    },
}

pub type Result<T> = std::result::Result<T, StoreError>;

/// Maps an I/O error to [`StoreError::Io`] naming `what` failed on `path`.
pub fn io(
    what: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(std::io::Error) -> StoreError {
    let path = path.into();
    move |source| StoreError::Io { what, path, source }
}
