//! Garbage collection: which manifests are kept, and removal of every chunk no kept manifest
//! names. Runs under the store's exclusive lock, so it waits for writers in flight and no
//! writer starts until it is done.

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::os::unix::fs::MetadataExt;

use nix::fcntl::FlockArg;

use crate::digest::Digest;
use crate::error::{io, Result};
use crate::pack::{punch, Pointer, POINTER_SUFFIX};
use crate::store::{Store, CHUNKS, PACKS, TMP};

/// What a gc keeps: the newest `keep_last` manifests of each group (the name's first segment,
/// gpucr's container), and every manifest in `pinned` (e.g. referenced by a checkpoint that
/// containerd's content store or a kubelet archive still holds), whatever its age.
#[derive(Debug, Clone, Default)]
pub struct Retention {
    pub keep_last: usize,
    pub pinned: HashSet<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    pub manifests_removed: Vec<String>,
    /// Chunks and pointers into packs.
    pub chunks_removed: u64,
    pub packs_removed: u64,
    pub bytes_freed: u64,
}

impl Store {
    pub fn gc(&self, retention: &Retention) -> Result<GcReport> {
        let _lock = self.lock(FlockArg::LockExclusive)?;
        let mut report = GcReport::default();
        let mut groups: BTreeMap<String, Vec<_>> = BTreeMap::new();
        for m in self.manifests()? {
            groups.entry(m.group().to_string()).or_default().push(m);
        }
        let mut live: HashSet<Digest> = HashSet::new();
        for (_, mut ms) in groups {
            ms.sort_by(|a, b| (b.created_unix_ms, &b.name).cmp(&(a.created_unix_ms, &a.name)));
            for (i, m) in ms.into_iter().enumerate() {
                if i < retention.keep_last || retention.pinned.contains(&m.name) {
                    live.extend(m.chunks.iter().map(|c| c.digest));
                } else {
                    let path = self.manifest_path(&m.name)?;
                    fs::remove_file(&path).map_err(io("cannot remove manifest", &path))?;
                    report.manifests_removed.push(m.name);
                }
            }
        }
        // Chunks and pointers no kept manifest names; the packs' ranges they held.
        let mut live_packs: HashSet<String> = HashSet::new();
        let mut dead: BTreeMap<String, Vec<(u64, u64)>> = BTreeMap::new();
        let chunks = self.root().join(CHUNKS);
        for shard in fs::read_dir(&chunks).map_err(io("cannot list", &chunks))? {
            let shard = shard.map_err(io("cannot list", &chunks))?.path();
            for entry in fs::read_dir(&shard).map_err(io("cannot list", &shard))? {
                let entry = entry.map_err(io("cannot list", &shard))?;
                let name = entry.file_name();
                let name = name.to_str().unwrap_or_default();
                let (hex, pointer) = match name.strip_suffix(POINTER_SUFFIX) {
                    Some(hex) => (hex, Pointer::read(&entry.path())),
                    None => (name, None),
                };
                let keep = hex.parse::<Digest>().is_ok_and(|d| live.contains(&d));
                match (keep, pointer) {
                    (true, Some(p)) => {
                        live_packs.insert(p.pack);
                        continue;
                    }
                    (true, None) => continue,
                    (false, Some(p)) => dead.entry(p.pack).or_default().push((p.offset, p.len)),
                    (false, None) => {
                        report.bytes_freed += entry.metadata().map(|m| m.len()).unwrap_or(0);
                    }
                }
                fs::remove_file(entry.path()).map_err(io("cannot remove chunk", entry.path()))?;
                report.chunks_removed += 1;
            }
        }
        let packs = self.root().join(PACKS);
        for entry in fs::read_dir(&packs).map_err(io("cannot list", &packs))? {
            let entry = entry.map_err(io("cannot list", &packs))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if !live_packs.contains(&name) {
                report.bytes_freed += entry.metadata().map(|m| m.blocks() * 512).unwrap_or(0);
                fs::remove_file(entry.path()).map_err(io("cannot remove pack", entry.path()))?;
                report.packs_removed += 1;
                continue;
            }
            let ranges = dead.remove(&name).unwrap_or_default();
            if let Ok(f) = fs::File::options().write(true).open(entry.path()) {
                for (offset, len) in ranges {
                    if punch(&f, offset, len).is_ok() {
                        report.bytes_freed += len;
                    }
                }
            }
        }
        let tmp = self.root().join(TMP);
        for entry in fs::read_dir(&tmp).map_err(io("cannot list", &tmp))? {
            let entry = entry.map_err(io("cannot list", &tmp))?;
            // Writers and stages hold the lock shared: what is here was left by a dead one.
            let _ = match entry.file_type() {
                Ok(t) if t.is_dir() => fs::remove_dir_all(entry.path()),
                _ => fs::remove_file(entry.path()),
            };
        }
        tracing::info!(
            manifests_removed = report.manifests_removed.len(),
            chunks_removed = report.chunks_removed,
            packs_removed = report.packs_removed,
            bytes_freed = report.bytes_freed,
            "store gc"
        );
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn checkpoint(store: &Store, name: &str, chunks: &[&[u8]]) {
        let w = store.writer().unwrap();
        let refs = chunks
            .iter()
            .map(|c| w.put_chunk(c).unwrap().chunk)
            .collect();
        w.publish(name, refs, Value::Null).unwrap();
        // Names sort by creation time; make each checkpoint's millisecond distinct.
        std::thread::sleep(std::time::Duration::from_millis(2));
    }

    #[test]
    fn keeps_the_newest_per_container_and_the_pinned() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        checkpoint(&store, "a/1", &[b"shared", b"old-a"]);
        checkpoint(&store, "a/2", &[b"shared", b"new-a"]);
        checkpoint(&store, "a/3", &[b"shared", b"newest-a"]);
        checkpoint(&store, "b/1", &[b"only-b"]);
        let report = store
            .gc(&Retention {
                keep_last: 1,
                pinned: ["a/1".to_string()].into(),
            })
            .unwrap();
        assert_eq!(report.manifests_removed, vec!["a/2".to_string()]);
        assert_eq!(report.chunks_removed, 1);
        assert_eq!(report.bytes_freed, 5);
        for m in store.manifests().unwrap() {
            store.require_chunks(&m).unwrap();
        }
        assert_eq!(store.manifests().unwrap().len(), 3);
    }

    #[test]
    fn a_gc_during_a_checkpoint_keeps_its_unpublished_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let w = store.writer().unwrap();
        let c = w.put_chunk(b"in flight").unwrap().chunk;
        let gc_store = store.clone();
        let gc = std::thread::spawn(move || gc_store.gc(&Retention::default()).unwrap());
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(!gc.is_finished(), "gc must wait for the writer");
        w.publish("c/1", vec![c], Value::Null).unwrap();
        let report = gc.join().unwrap();
        // keep_last 0 removes the (now published) manifest and then its chunk: nothing was
        // removed before the manifest existed.
        assert_eq!(report.manifests_removed, vec!["c/1".to_string()]);
        assert_eq!(report.chunks_removed, 1);
    }
}
