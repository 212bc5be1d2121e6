//! The GPU state image: device memory stored outside the driver's own checkpoint.
//!
//! An image is a directory (e.g. `gpu-state/` inside a checkpoint directory) holding
//! `manifest.json` (allocations and a chunk index), `manifest.blake3` and data files of
//! zstd-compressed chunks. All-zero chunks are not stored, identical chunks are stored
//! once, and a delta image refers to chunks its parent chain already stores. The format
//! is specified in `FORMAT.md` next to this file.
//!
//! When to use: the hook's copy-out (device → staging buffer → [`ImageWriter`]) and its
//! copy-in ([`ImageReader`]); the shim opens images to check them before a restore and
//! to plan its copy-in helpers' jobs; tools use [`ImageReader::inspect`] and
//! [`ImageReader::verify`]. Downsides: the whole manifest is held in memory (about 200
//! bytes per chunk: 4 MiB for 64 GiB at 4 MiB chunks), and a delta image is only
//! readable while its parent is unchanged.
//!
//! ```
//! use gpu_state::image::{AllocationTags, ImageOptions, ImageReader, ImageWriter};
//! use std::io::Read;
//!
//! let root = tempfile::tempdir().unwrap();
//! let dir = root.path().join("gpu-state");
//! let mut writer = ImageWriter::create(&dir, None, ImageOptions::default()).unwrap();
//! let alloc = writer.begin_allocation(0x7f00_0000_0000, 5, AllocationTags::default()).unwrap();
//! writer.write_chunk(alloc, 0, b"hello").unwrap();
//! writer.finish().unwrap();
//!
//! let reader = ImageReader::open(&dir).unwrap();
//! let id = reader.find(0x7f00_0000_0000, None).unwrap();
//! let mut bytes = Vec::new();
//! reader.read_allocation(id).unwrap().read_to_end(&mut bytes).unwrap();
//! assert_eq!(bytes, b"hello");
//! ```

mod atomic;
mod direct;
mod error;
pub mod gpuhash;
mod layer;
mod manifest;
mod pipeline;
mod reader;
mod sink;
mod staging;
mod summary;
mod writer;

pub use atomic::{image_state, remove_stale_temps, ImageState};
pub use direct::is_tmpfs;
pub use error::{ChunkPlace, ImageError};
pub use layer::MAX_CHAIN;
pub use manifest::{
    Allocation, AllocationTags, Chunk, ChunkKey, Codec, Compression, ContentHash, DataFile,
    GpuHash, ImageId, Location, Manifest, ParentRef, FORMAT_NAME, FORMAT_VERSION,
    FORMAT_VERSION_BLAKE3_ONLY, MANIFEST_FILE, MANIFEST_SUM_FILE, MAX_CHUNK_SIZE,
};
pub use reader::{AllocationReader, ImageReader, MappedChunk, MappedImage, MappedRegion, RawPlace};
pub use sink::AllocationSink;
pub use staging::{StagingBuf, StagingPin, StagingPool};
pub use summary::Summary;
pub use writer::{DirectChunk, DirectRegion, ImageWriter, NoDirect, StagedChunk, WriterStats};

/// Default chunk size: 4 MiB.
pub const DEFAULT_CHUNK_SIZE: usize = 4 << 20;
/// Default zstd level: 1, the fastest of the normal levels.
pub const DEFAULT_ZSTD_LEVEL: i32 = 1;

/// An allocation of the image being written or read: its index in the manifest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AllocId(pub usize);

/// How an image is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageOptions {
    /// Bytes per chunk (the last chunk of an allocation may be shorter).
    pub chunk_size: usize,
    pub compression: Compression,
    /// Worker threads (each also owns one data file).
    pub threads: usize,
    /// Staging buffers of `chunk_size` bytes, allocated once per image: the writer's
    /// memory bound is `max_in_flight × chunk_size`, plus `threads × chunk_size` of
    /// compression output buffers when compressing.
    pub max_in_flight: usize,
    /// When not 0: each stored chunk of a staged data file starts at a multiple of this
    /// many bytes (the gap is a hole), and the file's size is one too. A store that cuts the
    /// file into slices of this size then sees each chunk's bytes in the same slices
    /// wherever the worker that wrote it put it, so an unchanged chunk dedups
    /// (`GPUCR_HOOK_ALIGN_MIB`, set by the shim for checkpoints by reference).
    pub align: u64,
}

impl Default for ImageOptions {
    fn default() -> Self {
        let threads = std::thread::available_parallelism()
            .map_or(2, |n| n.get())
            .clamp(1, 8);
        ImageOptions {
            chunk_size: DEFAULT_CHUNK_SIZE,
            compression: Compression::Zstd {
                level: DEFAULT_ZSTD_LEVEL,
            },
            threads,
            max_in_flight: 2 * threads,
            align: 0,
        }
    }
}

impl ImageOptions {
    fn check(&self) -> Result<(), ImageError> {
        if self.chunk_size == 0 || self.chunk_size as u64 > MAX_CHUNK_SIZE {
            return Err(ImageError::Usage(format!(
                "chunk size {} must be between 1 and {MAX_CHUNK_SIZE}",
                self.chunk_size
            )));
        }
        if self.threads == 0 || self.threads > 256 || self.max_in_flight == 0 {
            return Err(ImageError::Usage(
                "threads must be 1..=256 and max_in_flight at least 1".into(),
            ));
        }
        if let Compression::Zstd { level } = self.compression {
            if !zstd::compression_level_range().contains(&level) {
                return Err(ImageError::Usage(format!(
                    "zstd level {level} is out of range"
                )));
            }
        }
        Ok(())
    }
}
