//! The writer's worker pool: staging buffers go to worker threads, which elide zero
//! chunks, checksum, deduplicate, compress and append to their own data file.
//!
//! Memory bound: at most `max_in_flight` staging buffers of `chunk_size` bytes exist,
//! plus one compression buffer per worker. The caller blocks in [`Pipeline::acquire`]
//! while all staging buffers are in use.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::manifest::{Codec, Compression, ContentHash, DataFile, ImageId, Location};

/// A filled staging buffer for one chunk.
pub(crate) struct Job {
    pub alloc: usize,
    pub index: usize,
    pub buf: Vec<u8>,
    pub len: usize,
}

/// Where a chunk went, as a worker reports it.
pub(crate) enum Placed {
    Final(Location),
    /// Same bytes as a chunk another worker claimed; its location is known at the end.
    SameAs(ContentHash),
}

pub(crate) struct Done {
    pub alloc: usize,
    pub index: usize,
    pub crc32c: Option<u32>,
    pub blake3: Option<ContentHash>,
    pub placed: Placed,
}

struct Shared {
    compression: Compression,
    /// Hashes stored in the parent chain, with the image that stores each.
    parent: HashMap<ContentHash, ImageId>,
    /// Hashes stored in this image: `None` while the claiming worker is still writing.
    stored: Mutex<HashMap<ContentHash, Option<Location>>>,
    error: Mutex<Option<String>>,
    abort: AtomicBool,
    out: AtomicUsize,
}

pub(crate) struct Pipeline {
    shared: Arc<Shared>,
    jobs: Option<SyncSender<Job>>,
    done: Receiver<Done>,
    free: Receiver<Vec<u8>>,
    workers: Vec<JoinHandle<Result<DataFile, String>>>,
    chunk_size: usize,
    max_in_flight: usize,
    allocated: usize,
    peak: usize,
}

impl Pipeline {
    pub fn start(
        dir: &Path,
        threads: usize,
        max_in_flight: usize,
        chunk_size: usize,
        compression: Compression,
        parent: HashMap<ContentHash, ImageId>,
    ) -> std::io::Result<Pipeline> {
        let shared = Arc::new(Shared {
            compression,
            parent,
            stored: Mutex::new(HashMap::new()),
            error: Mutex::new(None),
            abort: AtomicBool::new(false),
            out: AtomicUsize::new(0),
        });
        let (job_tx, job_rx) = mpsc::sync_channel::<Job>(max_in_flight);
        let job_rx = Arc::new(Mutex::new(job_rx));
        let (done_tx, done_rx) = mpsc::channel();
        let (free_tx, free_rx) = mpsc::channel();
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
            let (jobs, done, free) = (job_rx.clone(), done_tx.clone(), free_tx.clone());
            let handle = std::thread::Builder::new()
                .name(format!("gpucr-image-{i}"))
                .spawn(move || worker.run(&jobs, &done, &free))?;
            workers.push(handle);
        }
        Ok(Pipeline {
            shared,
            jobs: Some(job_tx),
            done: done_rx,
            free: free_rx,
            workers,
            chunk_size,
            max_in_flight,
            allocated: 0,
            peak: 0,
        })
    }

    /// A staging buffer of `chunk_size` bytes; blocks while all are in flight.
    pub fn acquire(&mut self) -> Result<Vec<u8>, String> {
        self.check()?;
        let buf = match self.free.try_recv() {
            Ok(buf) => buf,
            Err(_) if self.allocated < self.max_in_flight => {
                self.allocated += 1;
                vec![0u8; self.chunk_size]
            }
            Err(_) => self
                .free
                .recv()
                .map_err(|_| "all compression workers stopped".to_string())?,
        };
        let out = self.shared.out.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak = self.peak.max(out);
        Ok(buf)
    }

    /// Gives back a staging buffer that was not submitted (it is freed).
    pub fn release(&mut self, buf: Vec<u8>) {
        self.shared.out.fetch_sub(1, Ordering::SeqCst);
        drop(buf);
        self.allocated -= 1;
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

    pub fn peak_in_flight(&self) -> usize {
        self.peak
    }

    pub fn buffers_allocated(&self) -> usize {
        self.allocated
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
    pub stored: HashMap<ContentHash, Option<Location>>,
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
    fn run(
        mut self,
        jobs: &Mutex<Receiver<Job>>,
        done: &Sender<Done>,
        free: &Sender<Vec<u8>>,
    ) -> Result<DataFile, String> {
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
            self.shared.out.fetch_sub(1, Ordering::SeqCst);
            let _ = free.send(job.buf);
        }
        if self.shared.abort.load(Ordering::SeqCst) {
            return Ok(DataFile {
                name: self.name,
                size: self.pos,
            });
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
        let data = &job.buf[..job.len];
        let mut record = Done {
            alloc: job.alloc,
            index: job.index,
            crc32c: None,
            blake3: None,
            placed: Placed::Final(Location::Zero),
        };
        if is_zero(data) {
            return Ok(record);
        }
        let hash = ContentHash::of(data);
        record.crc32c = Some(crc32c::crc32c(data));
        record.blake3 = Some(hash);
        if let Some(image) = self.shared.parent.get(&hash) {
            record.placed = Placed::Final(Location::Parent { image: *image });
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
            return Ok(record);
        }
        let location = self.store(data)?;
        let mut stored = self.shared.stored.lock().map_err(|_| "poisoned")?;
        stored.insert(hash, Some(location));
        record.placed = Placed::Final(location);
        Ok(record)
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
        self.file
            .write_all(bytes)
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

/// True when every byte is zero (checked 4 KiB at a time so the loop vectorizes).
pub(crate) fn is_zero(data: &[u8]) -> bool {
    data.chunks(4096)
        .all(|block| block.iter().fold(0u8, |acc, &b| acc | b) == 0)
}
