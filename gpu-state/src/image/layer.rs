//! Opening one image directory (a layer) and its parent chain, with every check that
//! needs no chunk data: completeness, manifest checksum and structure, data file
//! sizes, parent id and manifest hash, and that parent references resolve.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use super::atomic::{image_state, ImageState};
use super::direct::ReadMap;
use super::error::ImageError;
use super::manifest::{
    ChunkKey, ContentHash, ImageId, Location, Manifest, MANIFEST_FILE, MANIFEST_SUM_FILE,
};

/// Longest parent chain accepted (it also stops loops).
pub const MAX_CHAIN: usize = 64;

/// Where a stored chunk's bytes are in one layer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StoredAt {
    pub location: Location,
    pub len: u64,
    pub crc32c: u32,
}

pub(crate) struct Layer {
    pub dir: PathBuf,
    pub manifest: Manifest,
    pub manifest_hash: ContentHash,
    pub files: Vec<File>,
    /// Chunks stored in this layer's own data files, by dedup key.
    pub by_hash: HashMap<ChunkKey, StoredAt>,
    /// The data files mapped read-only (one per file, `None`: empty), once
    /// [`ImageReader::map_data_files`](super::ImageReader::map_data_files) asked; empty
    /// before.
    pub maps: Vec<Option<ReadMap>>,
}

impl Layer {
    pub fn open(dir: &Path) -> Result<Layer, ImageError> {
        match image_state(dir) {
            ImageState::Complete => {}
            ImageState::Incomplete { reason } => {
                return Err(ImageError::Incomplete {
                    path: dir.to_path_buf(),
                    reason,
                })
            }
            ImageState::Missing => {
                return Err(ImageError::io(dir, std::io::ErrorKind::NotFound.into()))
            }
        }
        let manifest_path = dir.join(MANIFEST_FILE);
        let bytes = std::fs::read(&manifest_path).map_err(|e| ImageError::io(&manifest_path, e))?;
        let manifest_hash = ContentHash::of(&bytes);
        let sum_path = dir.join(MANIFEST_SUM_FILE);
        let sum = std::fs::read_to_string(&sum_path).map_err(|e| ImageError::io(&sum_path, e))?;
        let manifest = Manifest::parse(&bytes, &manifest_path)?;
        if sum.trim() != manifest_hash.to_hex() {
            return Err(ImageError::bad_manifest(
                &manifest_path,
                format!("its BLAKE3 does not match {MANIFEST_SUM_FILE}"),
            ));
        }
        let mut files = Vec::with_capacity(manifest.files.len());
        for data in &manifest.files {
            let path = dir.join(&data.name);
            let file = File::open(&path).map_err(|e| ImageError::io(&path, e))?;
            let found = file.metadata().map_err(|e| ImageError::io(&path, e))?.len();
            if found != data.size {
                return Err(ImageError::DataFileSize {
                    path,
                    expected: data.size,
                    found,
                    first_damaged: first_damaged(&manifest, files.len() as u32, found),
                });
            }
            files.push(file);
        }
        let by_hash = stored_chunks(&manifest);
        Ok(Layer {
            dir: dir.to_path_buf(),
            manifest,
            manifest_hash,
            files,
            by_hash,
            maps: Vec::new(),
        })
    }

    /// Every data file mapped read-only, in order (`None` for an empty one); `populate`
    /// fills the page tables now.
    pub fn map_files(&self, populate: bool) -> Result<Vec<Option<ReadMap>>, ImageError> {
        self.files
            .iter()
            .zip(&self.manifest.files)
            .map(|(file, data)| match data.size {
                0 => Ok(None),
                n => ReadMap::new(file, n as usize, populate)
                    .map(Some)
                    .map_err(|e| ImageError::io(self.dir.join(&data.name), e)),
            })
            .collect()
    }

    /// Data file `file`'s mapping, when mapped.
    pub fn mapped(&self, file: usize) -> Option<&ReadMap> {
        self.maps.get(file)?.as_ref()
    }
}

/// Opens `dir` and its parents. `parent_override` replaces the recorded path of the
/// first parent (for a chain that was moved).
pub(crate) fn open_chain(
    dir: &Path,
    parent_override: Option<&Path>,
) -> Result<Vec<Layer>, ImageError> {
    let mut layers = vec![Layer::open(dir)?];
    let mut override_path = parent_override.map(Path::to_path_buf);
    while let Some(parent) = layers.last().and_then(|l| l.manifest.parent.clone()) {
        let child = layers.last().expect("at least one layer");
        if layers.len() >= MAX_CHAIN {
            return Err(ImageError::ParentChainTooLong {
                image: dir.to_path_buf(),
                max: MAX_CHAIN,
            });
        }
        let path = override_path
            .take()
            .unwrap_or_else(|| child.dir.join(&parent.path));
        let layer = match image_state(&path) {
            ImageState::Complete => Layer::open(&path)?,
            ImageState::Missing => {
                return Err(parent_missing(child, &path, "no such directory".into()))
            }
            ImageState::Incomplete { reason } => {
                return Err(parent_missing(child, &path, reason.into()))
            }
        };
        if layer.manifest.id != parent.id {
            return Err(ImageError::ParentChanged {
                image: child.dir.clone(),
                path,
                what: format!("its id is {}, expected {}", layer.manifest.id, parent.id),
            });
        }
        if layer.manifest_hash != parent.manifest_blake3 {
            return Err(ImageError::ParentChanged {
                image: child.dir.clone(),
                path,
                what: "its manifest checksum differs".into(),
            });
        }
        layers.push(layer);
    }
    check_parent_refs(&layers)?;
    Ok(layers)
}

fn parent_missing(child: &Layer, path: &Path, reason: String) -> ImageError {
    ImageError::ParentMissing {
        image: child.dir.clone(),
        id: child
            .manifest
            .parent
            .as_ref()
            .map(|p| p.id.to_string())
            .unwrap_or_default(),
        path: path.to_path_buf(),
        reason,
    }
}

/// Every `parent` chunk must name a deeper layer that stores its hash.
fn check_parent_refs(layers: &[Layer]) -> Result<(), ImageError> {
    for (depth, layer) in layers.iter().enumerate() {
        for alloc in &layer.manifest.allocations {
            for chunk in &alloc.chunks {
                let (Location::Parent { image }, Some(hash)) = (chunk.at, chunk.key()) else {
                    continue;
                };
                let holder = layers[depth + 1..].iter().find(|l| l.manifest.id == image);
                let stored = holder.and_then(|l| l.by_hash.get(&hash));
                let matches =
                    stored.is_some_and(|s| s.len == chunk.len && Some(s.crc32c) == chunk.crc32c);
                if !matches {
                    return Err(ImageError::ParentChanged {
                        image: layer.dir.clone(),
                        path: layers.get(depth + 1).map_or_else(PathBuf::new, |l| l.dir.clone()),
                        what: format!(
                            "chunk at offset {:#x} of allocation {:#x} refers to image {image}, which does not hold it (or holds it with another length or CRC)",
                            chunk.offset, alloc.va
                        ),
                    });
                }
            }
        }
    }
    Ok(())
}

fn stored_chunks(manifest: &Manifest) -> HashMap<ChunkKey, StoredAt> {
    let mut by_hash = HashMap::new();
    for alloc in &manifest.allocations {
        for chunk in &alloc.chunks {
            if let (Location::Data { .. }, Some(hash), Some(crc32c)) =
                (chunk.at, chunk.key(), chunk.crc32c)
            {
                by_hash.entry(hash).or_insert(StoredAt {
                    location: chunk.at,
                    len: chunk.len,
                    crc32c,
                });
            }
        }
    }
    by_hash
}

/// The first chunk stored past `size` bytes of data file `file`, for the error message.
fn first_damaged(manifest: &Manifest, file: u32, size: u64) -> String {
    for alloc in &manifest.allocations {
        for chunk in &alloc.chunks {
            if let Location::Data {
                file: f,
                offset,
                stored_len,
                ..
            } = chunk.at
            {
                if f == file && offset + stored_len > size {
                    return format!(
                        "; first damaged: chunk at offset {:#x} of allocation {:#x} (stored at byte {offset})",
                        chunk.offset, alloc.va
                    );
                }
            }
        }
    }
    String::new()
}

/// A chunk the parent chain stores: which image, and its length and CRC (which a chunk
/// that refers to it must repeat).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ParentChunk {
    pub image: ImageId,
    pub len: u64,
    pub crc32c: u32,
}

/// All keys stored anywhere in the chain, with the image that stores each (the nearest
/// layer wins).
pub(crate) fn chain_hashes(layers: &[Layer]) -> HashMap<ChunkKey, ParentChunk> {
    let mut out = HashMap::new();
    for layer in layers.iter().rev() {
        for (key, at) in &layer.by_hash {
            out.insert(
                *key,
                ParentChunk {
                    image: layer.manifest.id,
                    len: at.len,
                    crc32c: at.crc32c,
                },
            );
        }
    }
    out
}
