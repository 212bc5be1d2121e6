//! Errors of the GPU state image, each naming the image, and where it matters the
//! data file, the allocation and the offset, so an operator knows what is damaged.

use std::path::PathBuf;

/// Where in an image a chunk lives: used in error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkPlace {
    /// The allocation's device virtual address.
    pub va: u64,
    /// The allocation's `pid` tag, if it has one.
    pub pid: Option<u32>,
    /// Offset of the chunk inside the allocation.
    pub offset: u64,
    /// The data file that holds it (empty for zero chunks).
    pub file: PathBuf,
    /// Byte offset of the stored chunk inside `file`.
    pub file_offset: u64,
}

impl std::fmt::Display for ChunkPlace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "chunk at offset {:#x} of allocation {:#x}",
            self.offset, self.va
        )?;
        if let Some(pid) = self.pid {
            write!(f, " (pid {pid})")?;
        }
        write!(
            f,
            ", stored in {} at byte {}",
            self.file.display(),
            self.file_offset
        )
    }
}

/// Writing, opening or reading a GPU state image.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{path} already exists; a GPU state image is never overwritten: remove it or pick another directory")]
    AlreadyExists { path: PathBuf },

    #[error("{path} is an incomplete GPU state image ({reason}): the write that made it was interrupted; discard it")]
    Incomplete { path: PathBuf, reason: &'static str },

    #[error("{path}: the manifest is damaged: {reason}")]
    BadManifest { path: PathBuf, reason: String },

    #[error("{path} is GPU state image format version {found}; this gpucr reads versions up to {supported}: upgrade gpucr")]
    UnsupportedVersion {
        path: PathBuf,
        found: u32,
        supported: u32,
    },

    #[error("{path}: data file is {found} bytes but the manifest says {expected}{first_damaged}: the image was truncated or altered")]
    DataFileSize {
        path: PathBuf,
        expected: u64,
        found: u64,
        /// Names the first chunk beyond the end, when there is one.
        first_damaged: String,
    },

    #[error("{image}: {place}: {reason}: the image is corrupt")]
    CorruptChunk {
        image: PathBuf,
        place: ChunkPlace,
        reason: String,
    },

    #[error("{image}: parent image {id} expected at {path} is missing: {reason}; restore it there or open with an explicit parent path")]
    ParentMissing {
        image: PathBuf,
        id: String,
        path: PathBuf,
        reason: String,
    },

    #[error("{image}: parent image at {path} has changed since this image was written ({what}): this delta image cannot be read against it")]
    ParentChanged {
        image: PathBuf,
        path: PathBuf,
        what: String,
    },

    #[error("{image}: parent chain is longer than {max} images (or loops)")]
    ParentChainTooLong { image: PathBuf, max: usize },

    #[error("invalid use of the image writer: {0}")]
    Usage(String),

    #[error("{image}: allocation {va:#x} is missing chunk(s) starting at offset {offset:#x}; every chunk must be written before finish()")]
    MissingChunks {
        image: PathBuf,
        va: u64,
        offset: u64,
    },

    #[error("compression worker failed: {0}")]
    Worker(String),
}

impl ImageError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ImageError::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn bad_manifest(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        ImageError::BadManifest {
            path: path.into(),
            reason: reason.into(),
        }
    }
}
