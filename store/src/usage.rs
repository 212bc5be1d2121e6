//! What the store holds, for `gpucr ls` and `gpucr report`: per manifest its logical bytes and
//! the bytes only it references (what removing it would free), and the store's totals.

use std::collections::HashMap;

use crate::digest::Digest;
use crate::error::Result;
use crate::manifest::Manifest;
use crate::store::Store;

#[derive(Debug, Clone)]
pub struct ManifestUsage {
    pub manifest: Manifest,
    /// Bytes of the distinct chunks it names.
    pub stored_bytes: u64,
    /// Bytes of the chunks no other manifest names.
    pub unique_bytes: u64,
}

#[derive(Debug, Clone, Default)]
pub struct Usage {
    pub manifests: Vec<ManifestUsage>,
    /// Distinct chunks the manifests name, and their bytes: what the store holds for them.
    pub chunks: u64,
    pub chunk_bytes: u64,
    /// What the same checkpoints would take without sharing.
    pub logical_bytes: u64,
}

impl Store {
    pub fn usage(&self) -> Result<Usage> {
        let manifests = self.manifests()?;
        // How many manifests name each chunk (a chunk repeated inside one counts once).
        let mut owners: HashMap<Digest, (u64, u64)> = HashMap::new();
        for m in &manifests {
            let mut mine: Vec<_> = m.chunks.iter().map(|c| (c.digest, c.len)).collect();
            mine.sort_unstable();
            mine.dedup();
            for (d, len) in mine {
                owners.entry(d).or_insert((0, len)).0 += 1;
            }
        }
        let mut usage = Usage {
            chunks: owners.len() as u64,
            chunk_bytes: owners.values().map(|(_, len)| len).sum(),
            ..Default::default()
        };
        for m in manifests {
            let mut mine: Vec<_> = m.chunks.iter().map(|c| c.digest).collect();
            mine.sort_unstable();
            mine.dedup();
            let (mut stored, mut unique) = (0, 0);
            for d in mine {
                let (n, len) = owners[&d];
                stored += len;
                if n == 1 {
                    unique += len;
                }
            }
            usage.logical_bytes += m.logical_bytes();
            usage.manifests.push(ManifestUsage {
                manifest: m,
                stored_bytes: stored,
                unique_bytes: unique,
            });
        }
        Ok(usage)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicas_of_one_model_share_their_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        for replica in 0..8 {
            let w = store.writer().unwrap();
            let weights = w.put_chunk(&[7u8; 1000]).unwrap().chunk;
            let own = w
                .put_chunk(format!("kv-cache-{replica}").as_bytes())
                .unwrap()
                .chunk;
            w.publish(
                &format!("r{replica}/1"),
                vec![weights, own],
                serde_json::Value::Null,
            )
            .unwrap();
        }
        let u = store.usage().unwrap();
        assert_eq!(u.chunks, 9);
        assert_eq!(u.chunk_bytes, 1000 + 8 * 10);
        assert_eq!(u.logical_bytes, 8 * 1010);
        for m in &u.manifests {
            assert_eq!((m.stored_bytes, m.unique_bytes), (1010, 10));
        }
    }
}
