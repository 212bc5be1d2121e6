//! `gpucr validate`: every chunk's bytes against its digest, and every manifest's chunks
//! present, on several threads.

use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::digest::Digest;
use crate::error::{io, Result};
use crate::manifest::ChunkRef;
use crate::pack::{Pointer, POINTER_SUFFIX};
use crate::store::{Store, CHUNKS};

#[derive(Debug, Default)]
pub struct ValidateReport {
    pub chunks_checked: u64,
    pub bytes_checked: u64,
    /// Chunk files whose bytes do not hash to their name.
    pub damaged: Vec<PathBuf>,
    /// (manifest, chunk) pairs whose chunk is absent or of the wrong length.
    pub missing: Vec<(String, ChunkRef)>,
}

impl ValidateReport {
    pub fn is_clean(&self) -> bool {
        self.damaged.is_empty() && self.missing.is_empty()
    }
}

fn hash_file(path: &Path) -> std::io::Result<(Digest, u64)> {
    File::open(path).and_then(Digest::of_reader)
}

/// The digest of the range a pointer names; an unreadable pointer or a short pack is an error.
fn hash_packed(store: &Store, pointer: &Path) -> std::io::Result<(Digest, u64)> {
    let bad = || std::io::Error::from(std::io::ErrorKind::InvalidData);
    let p = Pointer::read(pointer).ok_or_else(bad)?;
    let mut f = File::open(store.pack_path(&p.pack))?;
    f.seek(SeekFrom::Start(p.offset))?;
    let (digest, len) = Digest::of_reader(f.take(p.len))?;
    if len != p.len {
        return Err(bad());
    }
    Ok((digest, len))
}

impl Store {
    /// Checks every chunk, loose or in a pack, against its name, and that every manifest's
    /// chunks are present.
    pub fn validate(&self, threads: usize) -> Result<ValidateReport> {
        let mut files = Vec::new();
        let chunks = self.root().join(CHUNKS);
        for shard in fs::read_dir(&chunks).map_err(io("cannot list", &chunks))? {
            let shard = shard.map_err(io("cannot list", &chunks))?.path();
            for entry in fs::read_dir(&shard).map_err(io("cannot list", &shard))? {
                files.push(entry.map_err(io("cannot list", &shard))?.path());
            }
        }
        let next = AtomicUsize::new(0);
        let report = Mutex::new(ValidateReport::default());
        std::thread::scope(|s| {
            for _ in 0..threads.max(1) {
                s.spawn(|| {
                    while let Some(path) = files.get(next.fetch_add(1, Ordering::Relaxed)) {
                        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
                        let (named, hashed) = match name.strip_suffix(POINTER_SUFFIX) {
                            Some(hex) => (hex.parse::<Digest>().ok(), hash_packed(self, path)),
                            None => (name.parse::<Digest>().ok(), hash_file(path)),
                        };
                        let mut r = report.lock().unwrap();
                        r.chunks_checked += 1;
                        match (named, hashed) {
                            (Some(want), Ok((got, len))) => {
                                r.bytes_checked += len;
                                if want != got {
                                    r.damaged.push(path.clone());
                                }
                            }
                            _ => r.damaged.push(path.clone()),
                        }
                    }
                });
            }
        });
        let mut report = report.into_inner().unwrap();
        for m in self.manifests()? {
            for c in self.missing_chunks(&m) {
                report.missing.push((m.name.clone(), c));
            }
        }
        report.damaged.sort();
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_damaged_and_missing_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let w = store.writer().unwrap();
        let good = w.put_chunk(b"good").unwrap().chunk;
        let bad = w.put_chunk(b"will rot").unwrap().chunk;
        let gone = w.put_chunk(b"will vanish").unwrap().chunk;
        w.publish("c/1", vec![good, bad, gone], serde_json::Value::Null)
            .unwrap();
        assert!(store.validate(2).unwrap().is_clean());

        fs::write(store.chunk_path(&bad.digest), b"will rXt").unwrap();
        fs::remove_file(store.chunk_path(&gone.digest)).unwrap();
        let r = store.validate(2).unwrap();
        assert_eq!(r.damaged, vec![store.chunk_path(&bad.digest)]);
        assert_eq!(r.missing, vec![("c/1".to_string(), gone)]);
        assert_eq!(r.chunks_checked, 2);
        let err = store.read_chunk(&bad).unwrap_err().to_string();
        assert!(
            err.contains("damaged") && err.contains("gpucr validate"),
            "{err}"
        );
        let err = store
            .require_chunks(&store.manifest("c/1").unwrap())
            .unwrap_err();
        assert!(err.to_string().contains(&gone.digest.to_hex()), "{err}");
    }
}
