//! The writer's worker pool: staging buffers go to worker threads, which elide zero
//! chunks, checksum, deduplicate, compress and append to their own data file.
//!
//! Memory bound: one [`StagingPool`] of `max_in_flight` buffers of `chunk_size` bytes,
//! allocated (and pinned) once per image, plus one compression buffer per worker when
//! compressing. The caller blocks in [`Pipeline::acquire`] while all staging buffers are
//! in use; a worker's buffer goes back to the pool when the worker drops it.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::direct::{DirectMap, DIRECT_ALIGN};
use super::layer::ParentChunk;
use super::manifest::{ChunkKey, Codec, Compression, ContentHash, DataFile, GpuHash, Location};
use super::staging::{StagingBuf, StagingPool};
use super::ImageOptions;

/// One filled chunk: in a staging buffer, or already in place in the direct file.
pub(crate) struct Job {
    pub alloc: usize,
    pub index: usize,
    pub data: JobData,
    pub len: usize,
    /// The chunk's gh1 digest, computed on the GPU before the copy: the chunk is known
    /// not to be zero, and the worker only CRCs it (no BLAKE3).
    pub known: Option<GpuHash>,
}

pub(crate) enum JobData {
    Staged(StagingBuf),
    /// At `at` in the direct file, which is data file `file` of the image.
    Direct {
        map: Arc<DirectMap>,
        at: u64,
        file: u32,
    },
}

/// Where a chunk went, as a worker reports it.
pub(crate) enum Placed {
    Final(Location),
    /// Same bytes as a chunk another worker claimed; its location is known at the end.
    SameAs(ChunkKey),
}

pub(crate) struct Done {
    pub alloc: usize,
    pub index: usize,
    pub crc32c: Option<u32>,
    pub blake3: Option<ContentHash>,
    pub gpu_hash: Option<GpuHash>,
    pub placed: Placed,
}

struct Shared {
    compression: Compression,
    /// Stored chunks start at multiples of this (0: appended end to end).
    align: u64,
    /// Keys stored in the parent chain, with the image that stores each.
    parent: HashMap<ChunkKey, ParentChunk>,
    /// Keys stored in this image: `None` while the claiming worker is still writing.
    stored: Mutex<HashMap<ChunkKey, Option<Location>>>,
    error: Mutex<Option<String>>,
    abort: AtomicBool,
}

pub(crate) struct Pipeline {
    shared: Arc<Shared>,
    jobs: Option<SyncSender<Job>>,
    done: Receiver<Done>,
    workers: Vec<JoinHandle<Result<DataFile, String>>>,
    pool: Arc<StagingPool>,
}

impl Pipeline {
    pub fn start(
        dir: &Path,
        opts: &ImageOptions,
        pool: Arc<StagingPool>,
        parent: HashMap<ChunkKey, ParentChunk>,
    ) -> std::io::Result<Pipeline> {
        let threads = opts.threads;
        let shared = Arc::new(Shared {
            compression: opts.compression,
            align: opts.align,
            parent,
            stored: Mutex::new(HashMap::new()),
            error: Mutex::new(None),
            abort: AtomicBool::new(false),
        });
        let (job_tx, job_rx) = mpsc::sync_channel::<Job>(pool.count());
        let job_rx = Arc::new(Mutex::new(job_rx));
        let (done_tx, done_rx) = mpsc::channel();
        let mut workers = Vec::with_capacity(threads);
        for i in 0..threads {
            let name = format!("data-{i:03}.bin");
            let file = File::create(dir.join(&name))?;
            let worker = Worker {
                shared: shared.clone(),
                index: i as u32,
                file,
                path: dir.join(&name),
                name,
                pos: 0,
                scratch: Vec::new(),
                compressor: None,
            };
            let (jobs, done) = (job_rx.clone(), done_tx.clone());
            let handle = std::thread::Builder::new()
                .name(format!("gpucr-image-{i}"))
                .spawn(move || worker.run(&jobs, &done))?;
            workers.push(handle);
        }
        Ok(Pipeline {
            shared,
            jobs: Some(job_tx),
            done: done_rx,
            workers,
            pool,
        })
    }

    /// A staging buffer of `chunk_size` bytes; blocks while all are in flight (workers
    /// always give theirs back, also after a failure).
    pub fn acquire(&mut self) -> Result<StagingBuf, String> {
        self.check()?;
        Ok(self.pool.acquire())
    }

    pub fn submit(&mut self, job: Job) -> Result<(), String> {
        let jobs = self.jobs.as_ref().ok_or("the pipeline is closed")?;
        jobs.send(job)
            .map_err(|_| "all compression workers stopped".to_string())?;
        self.check()
    }

    /// Results that are ready now (never blocks).
    pub fn ready(&mut self) -> Vec<Done> {
        self.done.try_iter().collect()
    }

    pub fn pool(&self) -> &Arc<StagingPool> {
        &self.pool
    }

    fn check(&self) -> Result<(), String> {
        match &*self.shared.error.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Waits for every worker; returns the remaining results, the data files and the
    /// final location of every stored hash.
    pub fn finish(mut self) -> Result<Finished, String> {
        self.jobs = None;
        let mut files = Vec::new();
        for handle in std::mem::take(&mut self.workers) {
            let file = handle
                .join()
                .map_err(|_| "a compression worker panicked")??;
            files.push(file);
        }
        self.check()?;
        let done = self.done.try_iter().collect();
        let stored = std::mem::take(&mut *self.shared.stored.lock().map_err(|_| "poisoned")?);
        Ok(Finished {
            done,
            files,
            stored,
        })
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        self.shared.abort.store(true, Ordering::SeqCst);
        self.jobs = None;
        for handle in self.workers.drain(..) {
            let _ = handle.join();
        }
    }
}

pub(crate) struct Finished {
    pub done: Vec<Done>,
    pub files: Vec<DataFile>,
    pub stored: HashMap<ChunkKey, Option<Location>>,
}

struct Worker {
    shared: Arc<Shared>,
    index: u32,
    name: String,
    path: PathBuf,
    file: File,
    pos: u64,
    scratch: Vec<u8>,
    compressor: Option<zstd::bulk::Compressor<'static>>,
}

impl Worker {
    fn run(mut self, jobs: &Mutex<Receiver<Job>>, done: &Sender<Done>) -> Result<DataFile, String> {
        loop {
            let job = match jobs.lock() {
                Ok(rx) => rx.recv(),
                Err(_) => break,
            };
            let Ok(job) = job else { break };
            if !self.shared.abort.load(Ordering::SeqCst) && self.failed().is_none() {
                let result =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.process(&job)));
                match result {
                    Ok(Ok(record)) => {
                        let _ = done.send(record);
                    }
                    Ok(Err(e)) => self.fail(e),
                    Err(_) => self.fail("a compression worker panicked".into()),
                }
            }
            // Dropping the job gives its staging buffer back to the pool.
            drop(job);
        }
        if self.shared.abort.load(Ordering::SeqCst) {
            return Ok(DataFile {
                name: self.name,
                size: self.pos,
            });
        }
        // Aligned: the last chunk's slice reads as it does anywhere else (its tail, zeros).
        if self.shared.align > 0 && !self.pos.is_multiple_of(self.shared.align) {
            self.pos = self.pos.next_multiple_of(self.shared.align);
            if let Err(e) = self.file.set_len(self.pos) {
                return Err(format!("{}: {e}", self.path.display()));
            }
        }
        self.file
            .flush()
            .and_then(|()| self.file.sync_all())
            .map_err(|e| format!("{}: {e}", self.path.display()))?;
        Ok(DataFile {
            name: self.name,
            size: self.pos,
        })
    }

    fn failed(&self) -> Option<String> {
        self.shared.error.lock().ok().and_then(|e| e.clone())
    }

    fn fail(&self, message: String) {
        if let Ok(mut slot) = self.shared.error.lock() {
            slot.get_or_insert(message);
        }
    }

    fn process(&mut self, job: &Job) -> Result<Done, String> {
        let data = match &job.data {
            JobData::Staged(buf) => &buf[..job.len],
            // SAFETY: the chunk's copy completed before it was committed, and nothing
            // writes its range afterwards.
            JobData::Direct { map, at, .. } => unsafe { map.slice(*at, job.len) },
        };
        let mut record = Done {
            alloc: job.alloc,
            index: job.index,
            crc32c: None,
            blake3: None,
            gpu_hash: None,
            placed: Placed::Final(Location::Zero),
        };
        let hash = match job.known {
            Some(h) => {
                record.crc32c = Some(crc32c::crc32c(data));
                record.gpu_hash = Some(h);
                ChunkKey::Gpu(h)
            }
            None => {
                if is_zero(data) {
                    self.unplace(job)?;
                    return Ok(record);
                }
                let (hash, crc) = checksums(data);
                record.crc32c = Some(crc);
                record.blake3 = Some(hash);
                ChunkKey::Blake3(hash)
            }
        };
        if let Some(p) = self.shared.parent.get(&hash) {
            record.placed = Placed::Final(Location::Parent { image: p.image });
            self.unplace(job)?;
            return Ok(record);
        }
        let claimed = {
            let mut stored = self.shared.stored.lock().map_err(|_| "poisoned")?;
            match stored.entry(hash) {
                std::collections::hash_map::Entry::Occupied(_) => false,
                std::collections::hash_map::Entry::Vacant(slot) => {
                    slot.insert(None);
                    true
                }
            }
        };
        if !claimed {
            record.placed = Placed::SameAs(hash);
            self.unplace(job)?;
            return Ok(record);
        }
        let location = match &job.data {
            JobData::Staged(_) => self.store(data)?,
            JobData::Direct { at, file, .. } => Location::Data {
                file: *file,
                offset: *at,
                stored_len: job.len as u64,
                codec: Codec::Raw,
            },
        };
        let mut stored = self.shared.stored.lock().map_err(|_| "poisoned")?;
        stored.insert(hash, Some(location));
        record.placed = Placed::Final(location);
        Ok(record)
    }

    /// A direct chunk that is not stored: its pages go back to tmpfs.
    fn unplace(&self, job: &Job) -> Result<(), String> {
        if let JobData::Direct { map, at, .. } = &job.data {
            // The place runs to the next page (places are page aligned): punch whole
            // pages, or a short chunk's page would stay allocated.
            let len = (job.len as u64).next_multiple_of(DIRECT_ALIGN) as usize;
            map.punch(*at, len)
                .map_err(|e| format!("punching a hole in the direct data file: {e}"))?;
        }
        Ok(())
    }

    /// Appends one chunk to this worker's data file, compressed when that helps.
    fn store(&mut self, data: &[u8]) -> Result<Location, String> {
        let mut codec = Codec::Raw;
        if let Compression::Zstd { level } = self.shared.compression {
            if self.compressor.is_none() {
                let c = zstd::bulk::Compressor::new(level).map_err(|e| format!("zstd: {e}"))?;
                self.compressor = Some(c);
            }
            let compressor = self.compressor.as_mut().expect("just set");
            self.scratch.clear();
            self.scratch
                .reserve(zstd::zstd_safe::compress_bound(data.len()));
            compressor
                .compress_to_buffer(data, &mut self.scratch)
                .map_err(|e| format!("zstd: {e}"))?;
            if self.scratch.len() < data.len() {
                codec = Codec::Zstd;
            }
        }
        let bytes = if codec == Codec::Zstd {
            &self.scratch[..]
        } else {
            data
        };
        if self.shared.align > 0 {
            self.pos = self.pos.next_multiple_of(self.shared.align);
        }
        self.file
            .write_all_at(bytes, self.pos)
            .map_err(|e| format!("{}: {e}", self.path.display()))?;
        let location = Location::Data {
            file: self.index,
            offset: self.pos,
            stored_len: bytes.len() as u64,
            codec,
        };
        self.pos += bytes.len() as u64;
        Ok(location)
    }
}

/// BLAKE3 and CRC32C of `data` in one pass over cache-sized pieces: a chunk is read
/// from memory once, not twice (figures: docs/BENCHMARKS.md).
fn checksums(data: &[u8]) -> (ContentHash, u32) {
    const PIECE: usize = 256 << 10;
    let mut hasher = blake3::Hasher::new();
    let mut crc = 0;
    for piece in data.chunks(PIECE) {
        hasher.update(piece);
        crc = crc32c::crc32c_append(crc, piece);
    }
    (ContentHash(*hasher.finalize().as_bytes()), crc)
}

/// True when every byte is zero (checked 4 KiB at a time so the loop vectorizes).
pub(crate) fn is_zero(data: &[u8]) -> bool {
    data.chunks(4096)
        .all(|block| block.iter().fold(0u8, |acc, &b| acc | b) == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_pass_checksums_match_the_plain_ones() {
        for len in [1, 1000, 256 << 10, (256 << 10) + 1, 1 << 20] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 300) as u8).collect();
            assert_eq!(
                checksums(&data),
                (ContentHash::of(&data), crc32c::crc32c(&data))
            );
        }
    }
}
