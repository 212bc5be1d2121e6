//! Files through mappings. A new file filled by several threads at once: on tmpfs, writes to
//! one file take its lock one at a time (about 1.4 GB/s on the GPU host, docs/BENCHMARKS.md),
//! while page faults into a shared mapping of it run in parallel. A file read in place: hashed
//! straight from the page cache, without a copy into a buffer first.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;

/// `MADV_POPULATE_WRITE` (Linux 5.14): allocates the pages now and says so with an error (a
/// full tmpfs) instead of a SIGBUS at the first write.
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// A shared mapping of the first `len` bytes of a file. Unmapped when dropped.
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

impl Mapping {
    /// Maps `len` bytes (> 0) of `file` with protection `prot`.
    fn new(file: &File, len: usize, prot: libc::c_int) -> io::Result<Mapping> {
        // SAFETY: a fresh shared mapping of a file we hold open.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: NonNull::new(ptr.cast()).ok_or_else(|| io::Error::other("mmap gave null"))?,
            len,
        })
    }

    /// The address of `offset`, checked to leave `len` bytes inside the mapping.
    fn at(&self, offset: usize, len: usize) -> *mut u8 {
        assert!(offset + len <= self.len, "range out of the mapping");
        // SAFETY: inside the mapping (checked above).
        unsafe { self.ptr.as_ptr().add(offset) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: our mapping; every slice of it borrows its owner.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A read-write shared mapping of a whole file.
pub(crate) struct MappedOut(Mapping);

// SAFETY: threads only write disjoint ranges handed out by the caller (see `range`).
unsafe impl Send for MappedOut {}
unsafe impl Sync for MappedOut {}

impl MappedOut {
    /// Maps `file` (opened read-write, already `len` bytes long, `len` > 0) and checks that
    /// this kernel can populate it; `Err` means: write it another way.
    pub(crate) fn new(file: &File, len: usize) -> io::Result<MappedOut> {
        let map = MappedOut(Mapping::new(file, len, libc::PROT_READ | libc::PROT_WRITE)?);
        map.populate(0, len.min(4096))?;
        Ok(map)
    }

    /// Allocates the pages of `[offset, offset + len)`; a full filesystem is an error here.
    fn populate(&self, offset: usize, len: usize) -> io::Result<()> {
        let start = offset / 4096 * 4096;
        // SAFETY: a page-aligned range inside our mapping.
        let rc = unsafe {
            libc::madvise(
                self.0.at(start, offset + len - start).cast(),
                offset + len - start,
                MADV_POPULATE_WRITE,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// The bytes of `[offset, offset + len)`, populated first.
    ///
    /// # Safety
    /// No other live slice may overlap the range.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn range(&self, offset: usize, len: usize) -> io::Result<&mut [u8]> {
        self.populate(offset, len)?;
        Ok(std::slice::from_raw_parts_mut(self.0.at(offset, len), len))
    }
}

/// A read-only shared mapping of a whole file, for reading it in place. The file must not be
/// cut shorter while mapped (a read past its end would be a SIGBUS): gpucr maps only the
/// checkpoint's own files, which nothing else writes by then.
pub(crate) struct MappedIn(Mapping);

// SAFETY: read-only memory.
unsafe impl Send for MappedIn {}
unsafe impl Sync for MappedIn {}

impl MappedIn {
    /// Maps the first `len` bytes of `file` (`len` > 0).
    pub(crate) fn new(file: &File, len: usize) -> io::Result<MappedIn> {
        Ok(MappedIn(Mapping::new(file, len, libc::PROT_READ)?))
    }

    /// The bytes of `[offset, offset + len)`.
    pub(crate) fn slice(&self, offset: usize, len: usize) -> &[u8] {
        // SAFETY: inside the mapping, which nobody writes through.
        unsafe { std::slice::from_raw_parts(self.0.at(offset, len), len) }
    }
}
