//! A checkpoint's record in the store: the chunks it needs, in order, and what the caller
//! wants kept beside them (`meta`, opaque to the store).

use serde::{Deserialize, Serialize};

use crate::digest::Digest;
use crate::error::{Result, StoreError};

pub const MANIFEST_FORMAT: &str = "gpucr-store-manifest";
pub const MANIFEST_VERSION: u32 = 1;

/// One chunk a manifest needs: its digest and length in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ChunkRef {
    pub digest: Digest,
    pub len: u64,
}

impl ChunkRef {
    /// `Ok` when `bytes` are this chunk's, else [`StoreError::ChunkDamaged`] naming `path`,
    /// where they were read.
    pub fn check(&self, bytes: &[u8], path: impl Into<std::path::PathBuf>) -> Result<()> {
        let actual = Digest::of(bytes);
        if actual != self.digest || bytes.len() as u64 != self.len {
            return Err(StoreError::ChunkDamaged {
                path: path.into(),
                actual,
                len: bytes.len() as u64,
            });
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    /// `GROUP/…`: retention counts manifests per first segment (gpucr names it by container).
    pub name: String,
    /// The id of the store that published it (its `STORE` file).
    pub store_id: String,
    pub created_unix_ms: u64,
    pub chunks: Vec<ChunkRef>,
    #[serde(default)]
    pub meta: serde_json::Value,
}

impl Manifest {
    /// The bytes of every chunk reference, duplicates included.
    pub fn logical_bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.len).sum()
    }

    /// The retention group: the name's first segment.
    pub fn group(&self) -> &str {
        self.name.split('/').next().unwrap_or_default()
    }

    pub(crate) fn parse(path: &std::path::Path, bytes: &[u8]) -> Result<Self> {
        let bad = |reason: String| StoreError::BadManifest {
            path: path.to_path_buf(),
            reason,
        };
        let m: Manifest = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
        if m.format != MANIFEST_FORMAT {
            return Err(bad(format!(
                "format {:?} is not {MANIFEST_FORMAT:?}",
                m.format
            )));
        }
        if m.version > MANIFEST_VERSION {
            return Err(bad(format!(
                "version {} is newer than this gpucr reads ({MANIFEST_VERSION}); upgrade gpucr",
                m.version
            )));
        }
        check_name(&m.name)?;
        Ok(m)
    }
}

/// Names are paths below `manifests/`: segments of `[A-Za-z0-9._-]`, none empty or hidden, so
/// a name can never leave the directory or collide with a temporary file.
pub fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 1024
        && name.split('/').all(|seg| {
            !seg.is_empty()
                && !seg.starts_with('.')
                && seg.len() <= 255
                && seg
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        });
    if ok {
        Ok(())
    } else {
        Err(StoreError::BadName(name.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_stay_below_the_manifest_directory() {
        for good in ["c1", "ctr-1/ckpt_2/pid.42", "a/b/c"] {
            check_name(good).unwrap();
        }
        for bad in [
            "",
            "/abs",
            "a//b",
            "../x",
            "a/.hidden",
            "a/b/",
            "sp ace",
            "a\\b",
        ] {
            assert!(check_name(bad).is_err(), "{bad:?} accepted");
        }
    }
}
