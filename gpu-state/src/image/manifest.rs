//! The manifest of a GPU state image: what it holds and where every chunk's bytes are.
//!
//! [`Manifest::parse`] is the only way in from bytes; it checks the format name and
//! version first (so a newer image gives a version error, not a schema error), then
//! the whole structure, so readers can index with what it returns without further checks.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::error::ImageError;
pub use super::gpuhash::GpuHash;

/// The `format` field of every manifest.
pub const FORMAT_NAME: &str = "gpucr-gpu-state-image";
/// The newest format version this code reads. Version 2 added [`Chunk::gpu_hash`]; the
/// writer writes 1 for images without it, so older readers still read those.
pub const FORMAT_VERSION: u32 = 2;
/// The version of images whose chunks carry no `gpu_hash`.
pub const FORMAT_VERSION_BLAKE3_ONLY: u32 = 1;
/// File name of the manifest inside an image directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// File name of the manifest's BLAKE3 checksum (64 hex digits and a newline).
pub const MANIFEST_SUM_FILE: &str = "manifest.blake3";
/// Largest chunk size a manifest may declare (readers allocate buffers of this size).
pub const MAX_CHUNK_SIZE: u64 = 1 << 30;

/// How chunks are compressed (chosen per image; a chunk that does not shrink is stored raw).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "algorithm", rename_all = "lowercase")]
pub enum Compression {
    None,
    Zstd { level: i32 },
}

/// A BLAKE3 content hash, written as 64 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ContentHash(pub [u8; 32]);

impl ContentHash {
    pub fn of(data: &[u8]) -> Self {
        ContentHash(*blake3::hash(data).as_bytes())
    }
    pub fn to_hex(&self) -> String {
        blake3::Hash::from_bytes(self.0).to_hex().to_string()
    }
}

impl std::fmt::Debug for ContentHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ContentHash({})", self.to_hex())
    }
}

impl Serialize for ContentHash {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for ContentHash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        blake3::Hash::from_hex(text.as_bytes())
            .map(|h| ContentHash(*h.as_bytes()))
            .map_err(|e| serde::de::Error::custom(format!("bad blake3 hash {text:?}: {e}")))
    }
}

/// The whole manifest (`manifest.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT_NAME`].
    pub format: String,
    /// [`FORMAT_VERSION`] when written by this code.
    pub version: u32,
    /// Random 128-bit id, 32 lowercase hex digits.
    pub id: ImageId,
    /// Every chunk but an allocation's last is exactly this long.
    pub chunk_size: u64,
    pub compression: Compression,
    /// Set on delta images: chunks located `parent` are read from this chain.
    pub parent: Option<ParentRef>,
    /// The data files, indexed by [`Location::Data::file`].
    pub files: Vec<DataFile>,
    pub allocations: Vec<Allocation>,
}

/// The parent image of a delta image.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParentRef {
    /// The parent's [`Manifest::id`].
    pub id: ImageId,
    /// BLAKE3 of the parent's `manifest.json` bytes: a changed parent is refused.
    pub manifest_blake3: ContentHash,
    /// Where the parent was, relative to this image's directory (or absolute).
    pub path: String,
}

/// One data file of concatenated stored chunks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataFile {
    pub name: String,
    pub size: u64,
}

/// Optional labels of an allocation. `(pid, va)` identifies an allocation in an image.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocationTags {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

/// One device allocation and its chunks, in offset order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Allocation {
    pub va: u64,
    pub size: u64,
    #[serde(default)]
    pub tags: AllocationTags,
    pub chunks: Vec<Chunk>,
}

/// One chunk of an allocation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Chunk {
    /// Offset inside the allocation: chunk index × chunk size.
    pub offset: u64,
    /// Uncompressed length.
    pub len: u64,
    /// CRC32C (Castagnoli) of the uncompressed bytes; absent for zero chunks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crc32c: Option<u32>,
    /// BLAKE3 of the uncompressed bytes, the dedup key of chunks hashed on the CPU;
    /// absent for zero chunks and chunks hashed on the GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blake3: Option<ContentHash>,
    /// gh1 digest (`gpuhash`), the dedup key of chunks hashed on the GPU (format 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_hash: Option<GpuHash>,
    pub at: Location,
}

impl Chunk {
    /// The dedup key: the gh1 digest when there is one, else BLAKE3; `None` for zero chunks.
    pub fn key(&self) -> Option<ChunkKey> {
        match (self.gpu_hash, self.blake3) {
            (Some(h), _) => Some(ChunkKey::Gpu(h)),
            (None, Some(h)) => Some(ChunkKey::Blake3(h)),
            (None, None) => None,
        }
    }
}

/// What identifies a chunk's bytes for dedup. The two kinds never match each other: a
/// chunk hashed on the CPU and one hashed on the GPU are simply both stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChunkKey {
    Blake3(ContentHash),
    Gpu(GpuHash),
}

impl ChunkKey {
    pub fn to_hex(&self) -> String {
        match self {
            ChunkKey::Blake3(h) => h.to_hex(),
            ChunkKey::Gpu(h) => format!("gh1:{}", h.to_hex()),
        }
    }
}

/// Where a chunk's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Location {
    /// All bytes are zero; nothing is stored.
    Zero,
    /// In a data file of this image (several chunks may share one place: dedup).
    Data {
        file: u32,
        offset: u64,
        stored_len: u64,
        codec: Codec,
    },
    /// In the parent chain: the image with this id stores a chunk with the same BLAKE3.
    Parent { image: ImageId },
}

/// How one stored chunk is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Codec {
    Raw,
    /// One zstd frame.
    Zstd,
}

/// An image id held inline (32 hex digits), so [`Location`] stays `Copy`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ImageId(pub [u8; 16]);

impl ImageId {
    pub fn parse(text: &str) -> Option<Self> {
        if text.len() != 32 || !text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return None;
        }
        let mut out = [0u8; 16];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(ImageId(out))
    }
}

impl std::fmt::Display for ImageId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl std::fmt::Debug for ImageId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ImageId({self})")
    }
}

impl Serialize for ImageId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ImageId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        ImageId::parse(&text)
            .ok_or_else(|| serde::de::Error::custom(format!("bad image id {text:?}")))
    }
}

#[derive(Deserialize)]
struct Header {
    format: String,
    version: u32,
}

impl Manifest {
    /// Parses and checks manifest bytes; `path` only names the file in errors.
    /// Never panics, whatever the bytes.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Manifest, ImageError> {
        let header: Header = serde_json::from_slice(bytes)
            .map_err(|e| ImageError::bad_manifest(path, format!("not a manifest: {e}")))?;
        if header.format != FORMAT_NAME {
            return Err(ImageError::bad_manifest(
                path,
                format!("format is {:?}, not {FORMAT_NAME:?}", header.format),
            ));
        }
        if header.version == 0 || header.version > FORMAT_VERSION {
            return Err(ImageError::UnsupportedVersion {
                path: path.to_path_buf(),
                found: header.version,
                supported: FORMAT_VERSION,
            });
        }
        let manifest: Manifest = serde_json::from_slice(bytes)
            .map_err(|e| ImageError::bad_manifest(path, e.to_string()))?;
        manifest
            .validate()
            .map_err(|reason| ImageError::bad_manifest(path, reason))?;
        Ok(manifest)
    }

    /// The manifest as written to disk: compact JSON and a newline.
    pub fn to_json(&self) -> Vec<u8> {
        let mut out = serde_json::to_vec(self).expect("a manifest always serializes");
        out.push(b'\n');
        out
    }

    /// Checks every structural rule of the format (see FORMAT.md, "Rules").
    pub fn validate(&self) -> Result<(), String> {
        let own_id = self.id;
        if self.chunk_size == 0 || self.chunk_size > MAX_CHUNK_SIZE {
            return Err(format!("chunk_size {} is out of range", self.chunk_size));
        }
        if let Compression::Zstd { level } = self.compression {
            if !zstd::compression_level_range().contains(&level) {
                return Err(format!("zstd level {level} is out of range"));
            }
        }
        if let Some(parent) = &self.parent {
            if parent.id == own_id {
                return Err("the image is its own parent".into());
            }
        }
        let mut names = HashSet::new();
        for file in &self.files {
            if !valid_file_name(&file.name) || !names.insert(file.name.as_str()) {
                return Err(format!("bad or repeated data file name {:?}", file.name));
            }
        }
        for alloc in &self.allocations {
            self.validate_allocation(alloc, own_id)
                .map_err(|e| format!("allocation {:#x}: {e}", alloc.va))?;
        }
        check_overlaps(&self.allocations)
    }

    fn validate_allocation(&self, alloc: &Allocation, own_id: ImageId) -> Result<(), String> {
        let expected = alloc.size.div_ceil(self.chunk_size);
        if alloc.va.checked_add(alloc.size).is_none() {
            return Err("va + size overflows".into());
        }
        if alloc.chunks.len() as u64 != expected {
            return Err(format!(
                "{} chunks, expected {expected}",
                alloc.chunks.len()
            ));
        }
        for (i, chunk) in alloc.chunks.iter().enumerate() {
            let offset = i as u64 * self.chunk_size;
            let len = self.chunk_size.min(alloc.size - offset);
            if chunk.offset != offset || chunk.len != len {
                return Err(format!(
                    "chunk {i} is offset {:#x} length {}, expected {offset:#x} length {len}",
                    chunk.offset, chunk.len
                ));
            }
            self.validate_location(chunk, own_id)
                .map_err(|e| format!("chunk at offset {offset:#x}: {e}"))?;
        }
        Ok(())
    }

    fn validate_location(&self, chunk: &Chunk, own_id: ImageId) -> Result<(), String> {
        let has_sums = chunk.crc32c.is_some() && chunk.key().is_some();
        match chunk.at {
            Location::Zero if chunk.crc32c.is_none() && chunk.key().is_none() => Ok(()),
            Location::Zero => Err("zero chunk carries checksums".into()),
            _ if !has_sums => Err("crc32c or a hash (blake3 or gpu_hash) missing".into()),
            _ if chunk.blake3.is_some() && chunk.gpu_hash.is_some() => {
                Err("carries both blake3 and gpu_hash".into())
            }
            _ if chunk.gpu_hash.is_some() && self.version < 2 => {
                Err(format!("gpu_hash in a version {} manifest", self.version))
            }
            Location::Parent { image } => match &self.parent {
                Some(_) if image != own_id => Ok(()),
                Some(_) => Err("refers to its own image as parent".into()),
                None => Err("refers to a parent but the image has none".into()),
            },
            Location::Data {
                file,
                offset,
                stored_len,
                codec,
            } => {
                let data = self
                    .files
                    .get(file as usize)
                    .ok_or_else(|| format!("data file index {file} does not exist"))?;
                let end = offset.checked_add(stored_len).ok_or("offset overflows")?;
                if stored_len == 0 || end > data.size {
                    return Err(format!(
                        "stored range {offset}..{end} lies outside {}",
                        data.name
                    ));
                }
                if codec == Codec::Raw && stored_len != chunk.len {
                    return Err("raw chunk's stored length differs from its length".into());
                }
                Ok(())
            }
        }
    }
}

/// Data file names are plain: letters, digits, `.`, `_`, `-`; no leading dot; ≤ 64 bytes.
fn valid_file_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Allocations of one process (same `pid` tag) must not overlap or share a va.
pub(crate) fn check_overlaps(allocations: &[Allocation]) -> Result<(), String> {
    let mut ranges: Vec<(Option<u32>, u64, u64)> = allocations
        .iter()
        .map(|a| (a.tags.pid, a.va, a.va.saturating_add(a.size)))
        .collect();
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        let ((pid_a, va_a, end_a), (pid_b, va_b, _)) = (pair[0], pair[1]);
        if pid_a == pid_b && (va_a == va_b || end_a > va_b) {
            return Err(format!(
                "allocations {va_a:#x} and {va_b:#x} overlap (pid {pid_a:?})"
            ));
        }
    }
    Ok(())
}
