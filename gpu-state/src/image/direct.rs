//! The direct data file: for images on tmpfs, one data file preallocated for every
//! chunk and mapped `MAP_SHARED`, so a DMA engine writes chunks straight into the
//! image's pages (on tmpfs the page cache IS the image) and the workers only read them:
//! no staging buffer, no `write()` copy. Chunks that are not stored (zero, duplicate,
//! in the parent chain) get their range punched out again.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::ptr::NonNull;

/// `statfs` `f_type` of tmpfs and shmem.
const TMPFS_MAGIC: i64 = 0x0102_1994;

/// Stored chunks start on page boundaries, so registration windows and hole punches
/// cover whole pages.
pub(crate) const DIRECT_ALIGN: u64 = 4096;

/// An allocation's first place in the direct data file starts on this boundary when it has
/// at least this many bytes of places (smaller ones are packed as before): a store
/// that cuts the file into 8 MiB slices at fixed offsets (gpucr's, `store/src/dir.rs`) then
/// finds an allocation's unchanged bytes in the same slices whatever changed before it (an
/// allocation more or less, zero chunks left out). The padding is punched out at the finish.
pub(crate) const DIRECT_ALLOC_ALIGN: u64 = 8 << 20;

/// Name of the direct data file while the image is written (renumbered at publish).
pub(crate) const DIRECT_FILE: &str = "data-direct.bin";

/// Whether `path` lies on tmpfs (shmem), where a shared mapping of a file may be
/// registered for DMA and holds the file's only copy of the data.
pub fn is_tmpfs(path: &Path) -> bool {
    let Ok(c) = CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: an all-zero `statfs` is a valid value; `c` is NUL-terminated.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    rc == 0 && st.f_type as i64 == TMPFS_MAGIC
}

/// A preallocated data file mapped read-write and shared. Unmapped when dropped.
pub(crate) struct DirectMap {
    file: File,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is only written by DMA into chunk ranges handed out once, and
// read by the one worker a chunk is committed to after its copy completed.
unsafe impl Send for DirectMap {}
unsafe impl Sync for DirectMap {}

impl DirectMap {
    /// Creates `path` (must not exist), allocates `len` bytes and maps them.
    pub(crate) fn create(path: &Path, len: usize) -> io::Result<DirectMap> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "empty direct file",
            ));
        }
        let file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)?;
        file.set_len(len as u64)?;
        // SAFETY: a fresh shared mapping of a file we hold open, `len` bytes long.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast()).ok_or_else(|| io::Error::other("mmap gave null"))?;
        // Allocating up front turns a full tmpfs into an error here, not a SIGBUS during
        // DMA. The kernel zeroes every new page: done by several threads at once, because
        // one thread's fallocate is bound by that zeroing (docs/BENCHMARKS.md).
        let populated = populate_parallel(ptr.as_ptr(), len);
        let populated = match populated {
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                // No MADV_POPULATE_WRITE (Linux < 5.14): one fallocate.
                // SAFETY: plain syscall on an fd we own.
                if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len as libc::off_t) } != 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(())
                }
            }
            other => other,
        };
        if let Err(e) = populated {
            // SAFETY: our mapping, unused.
            unsafe { libc::munmap(ptr.as_ptr().cast(), len) };
            // Populating past what tmpfs (or memory) has left fails with EFAULT.
            let why = match e.raw_os_error() {
                Some(libc::EFAULT | libc::ENOSPC | libc::ENOMEM) => {
                    " (no room: free space on that tmpfs or checkpoint elsewhere)"
                }
                _ => "",
            };
            return Err(io::Error::new(
                e.kind(),
                format!("allocating {len} bytes of tmpfs for the image: {e}{why}"),
            ));
        }
        Ok(DirectMap { file, ptr, len })
    }

    pub(crate) fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The bytes at `[offset, offset + len)`.
    ///
    /// # Safety
    /// Nothing may write that range while the slice lives.
    pub(crate) unsafe fn slice(&self, offset: u64, len: usize) -> &[u8] {
        assert!(
            offset as usize + len <= self.len,
            "direct range out of the file"
        );
        std::slice::from_raw_parts(self.ptr.as_ptr().add(offset as usize), len)
    }

    /// Gives the pages of `[offset, offset + len)` back (they read as zeros).
    pub(crate) fn punch(&self, offset: u64, len: usize) -> io::Result<()> {
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        // SAFETY: a syscall on our fd; nobody reads the range afterwards.
        let rc = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                mode,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Cuts the file to `len` bytes (past the last stored chunk) and syncs it.
    pub(crate) fn finish(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)?;
        self.file.sync_all()
    }
}

/// Faults in (allocates) every page of the mapping `[ptr, ptr + len)` with
/// `MADV_POPULATE_WRITE`, split over up to 16 threads.
pub(crate) fn populate_parallel(ptr: *mut u8, len: usize) -> io::Result<()> {
    /// `MADV_POPULATE_WRITE` (Linux 5.14).
    const MADV_POPULATE_WRITE: libc::c_int = 23;
    const MIN_PIECE: usize = 64 << 20;
    let threads = std::thread::available_parallelism()
        .map_or(4, |n| n.get())
        .clamp(1, 16)
        .min(len.div_ceil(MIN_PIECE))
        .max(1);
    let page = DIRECT_ALIGN as usize;
    let piece = len.div_ceil(threads).next_multiple_of(page);
    let base = ptr as usize;
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|i| {
                scope.spawn(move || {
                    let start = i * piece;
                    if start >= len {
                        return Ok(());
                    }
                    let n = piece.min(len - start);
                    // SAFETY: a page-aligned range inside our mapping.
                    let rc = unsafe {
                        libc::madvise((base + start) as *mut libc::c_void, n, MADV_POPULATE_WRITE)
                    };
                    if rc != 0 {
                        return Err(io::Error::last_os_error());
                    }
                    Ok(())
                })
            })
            .collect();
        handles.into_iter().try_for_each(|h| {
            h.join()
                .unwrap_or_else(|_| Err(io::Error::other("populate panicked")))
        })
    })
}

impl Drop for DirectMap {
    fn drop(&mut self) {
        // SAFETY: our own mapping; every user (DMA, workers) is gone by now.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A data file mapped read-only and shared, for DMA straight from the image (copy-in).
pub(crate) struct ReadMap {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: read-only memory.
unsafe impl Send for ReadMap {}
unsafe impl Sync for ReadMap {}

impl ReadMap {
    /// Maps `len` bytes of `file`; `populate`: the page tables are filled now (one
    /// call, cheap for a huge-page tmpfs) rather than by faults during the reads.
    pub(crate) fn new(file: &File, len: usize, populate: bool) -> io::Result<ReadMap> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "empty data file",
            ));
        }
        // SAFETY: a fresh read-only mapping of a file we hold open.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED | if populate { libc::MAP_POPULATE } else { 0 },
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast()).ok_or_else(|| io::Error::other("mmap gave null"))?;
        Ok(ReadMap { ptr, len })
    }

    pub(crate) fn base(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn slice(&self, offset: u64, len: usize) -> Option<&[u8]> {
        let end = (offset as usize).checked_add(len)?;
        // SAFETY: inside the mapping, which nobody writes through.
        (end <= self.len)
            .then(|| unsafe { std::slice::from_raw_parts(self.base().add(offset as usize), len) })
    }
}

impl Drop for ReadMap {
    fn drop(&mut self) {
        // SAFETY: our own mapping; its users borrow the `MappedImage` holding it.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}
