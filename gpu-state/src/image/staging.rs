//! [`StagingPool`]: the host memory chunks pass through on their way between a device
//! and an image. One 2 MiB-aligned anonymous mapping (huge pages where granted), made once
//! and cut into `count` buffers of `buf_size` bytes, so a DMA engine can pin it with one
//! call ([`StagingPin`]) and the memory bound is fixed up front. Buffers go back to the
//! pool when dropped.

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::error::ImageError;

/// Pins staging memory for DMA (the hook: `cuMemHostRegister`) for the pool's lifetime.
pub trait StagingPin: Send + Sync {
    /// Pins `len` bytes at `ptr`; called once, right after the pool is allocated.
    fn pin(&self, ptr: *mut u8, len: usize) -> Result<(), String>;
    /// Undoes [`pin`](Self::pin); called once, before the memory is freed, only when
    /// `pin` succeeded.
    fn unpin(&self, ptr: *mut u8, len: usize);
}

const PAGE: usize = 4096;

/// Transparent huge pages: the unit [`map_huge`] aligns to.
const HUGE: usize = 2 << 20;

/// `len` bytes of anonymous memory, 2 MiB-aligned and advised as transparent huge pages,
/// zeroed by the kernel as touched. Not the allocator: its `alloc_zeroed` of a page-aligned
/// layout writes every byte (the whole pool resident, and time spent, before any use), and
/// huge pages make the first touch (the pinning) cheaper where the kernel grants them
/// (`madvise` mode; a refusal is harmless). Figures: docs/BENCHMARKS.md.
fn map_huge(len: usize) -> std::io::Result<NonNull<u8>> {
    let span = len + HUGE;
    // SAFETY: a fresh mapping; no existing memory is touched.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            span,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    let start = raw as usize;
    let aligned = start.next_multiple_of(HUGE);
    // SAFETY: head and tail lie inside the mapping just made and outside [aligned, +len).
    unsafe {
        if aligned > start {
            libc::munmap(raw, aligned - start);
        }
        let end = aligned + len;
        if start + span > end {
            libc::munmap(end as *mut libc::c_void, start + span - end);
        }
        libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
    }
    Ok(NonNull::new(aligned as *mut u8).expect("mmap never returns null"))
}

/// A fixed set of equally sized staging buffers. See the module docs.
pub struct StagingPool {
    ptr: NonNull<u8>,
    /// Bytes mapped at `ptr` (page-rounded).
    len: usize,
    buf_size: usize,
    count: usize,
    free: Mutex<Free>,
    returned: Condvar,
    pin: Option<Arc<dyn StagingPin>>,
    pinned: Mutex<Pinned>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pinned {
    /// Pinned at the first `acquire` (see [`StagingPool::new_deferred`]).
    Deferred,
    Yes,
    No,
}

struct Free {
    indices: Vec<usize>,
    peak_in_use: usize,
}

// SAFETY: the region is only reached through `StagingBuf`s, each owning one disjoint
// buffer exclusively (an index is either in the free list or in exactly one buffer).
unsafe impl Send for StagingPool {}
unsafe impl Sync for StagingPool {}

impl StagingPool {
    /// Allocates `count` buffers of `buf_size` bytes (zeroed; pages are only touched when
    /// used or pinned) and pins them with `pin`. A failed pin leaves the pool pageable
    /// (copies still work, slower), see [`is_pinned`](Self::is_pinned).
    pub fn new(
        count: usize,
        buf_size: usize,
        pin: Option<Arc<dyn StagingPin>>,
    ) -> Result<Arc<StagingPool>, ImageError> {
        let pool = Self::new_deferred(count, buf_size, pin)?;
        pool.pin_now();
        Ok(pool)
    }

    /// Like [`new`](Self::new), but pins at the first [`acquire`](Self::acquire) (on
    /// that thread): a pool that may go unused (a direct copy-out) costs neither a
    /// registration nor resident memory.
    pub fn new_deferred(
        count: usize,
        buf_size: usize,
        pin: Option<Arc<dyn StagingPin>>,
    ) -> Result<Arc<StagingPool>, ImageError> {
        let usage = |why: &str| ImageError::Usage(format!("staging pool: {why}"));
        if count == 0 || buf_size == 0 {
            return Err(usage("needs at least one buffer of at least one byte"));
        }
        let len = count
            .checked_mul(buf_size)
            .and_then(|n| n.checked_next_multiple_of(PAGE))
            .ok_or_else(|| usage("size overflows"))?;
        let ptr = map_huge(len)
            .map_err(|e| ImageError::Usage(format!("staging pool: cannot map {len} bytes: {e}")))?;
        let pinned = Mutex::new(match pin {
            Some(_) => Pinned::Deferred,
            None => Pinned::No,
        });
        Ok(Arc::new(StagingPool {
            ptr,
            len,
            buf_size,
            count,
            free: Mutex::new(Free {
                indices: (0..count).rev().collect(),
                peak_in_use: 0,
            }),
            returned: Condvar::new(),
            pin,
            pinned,
        }))
    }

    /// Pins the region unless that was tried already.
    fn pin_now(&self) {
        let mut pinned = self.pinned.lock().unwrap_or_else(|p| p.into_inner());
        if *pinned != Pinned::Deferred {
            return;
        }
        let Some(pin) = &self.pin else {
            *pinned = Pinned::No;
            return;
        };
        // The kernel zeroes each page at its first touch; on many threads that is
        // several times quicker than the driver touching them one by one as it pins
        // (a failure only leaves the pinning to do it).
        if let Err(e) = super::direct::populate_parallel(self.ptr.as_ptr(), self.len) {
            tracing::debug!(error = %e, "staging memory not populated ahead of pinning");
        }
        *pinned = match pin.pin(self.ptr.as_ptr(), self.len) {
            Ok(()) => Pinned::Yes,
            Err(reason) => {
                tracing::warn!(%reason, bytes = self.len, "staging memory not pinned; copies go through pageable memory");
                Pinned::No
            }
        };
    }

    fn lock(&self) -> MutexGuard<'_, Free> {
        self.free.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A buffer; blocks until one is returned while all are in use.
    pub fn acquire(self: &Arc<Self>) -> StagingBuf {
        self.pin_now();
        let mut free = self.lock();
        loop {
            if let Some(index) = free.indices.pop() {
                free.peak_in_use = free.peak_in_use.max(self.count - free.indices.len());
                return StagingBuf {
                    pool: self.clone(),
                    index,
                };
            }
            free = self.returned.wait(free).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Bytes per buffer.
    pub fn buf_size(&self) -> usize {
        self.buf_size
    }

    /// Number of buffers.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Buffers handed out now.
    pub fn in_use(&self) -> usize {
        self.count - self.lock().indices.len()
    }

    /// Most buffers handed out at one time.
    pub fn peak_in_use(&self) -> usize {
        self.lock().peak_in_use
    }

    /// Whether the region is pinned for DMA.
    pub fn is_pinned(&self) -> bool {
        *self.pinned.lock().unwrap_or_else(|p| p.into_inner()) == Pinned::Yes
    }

    /// Total bytes of the region.
    pub fn bytes(&self) -> usize {
        self.len
    }

    fn give_back(&self, index: usize) {
        self.lock().indices.push(index);
        self.returned.notify_one();
    }
}

impl Drop for StagingPool {
    fn drop(&mut self) {
        if let (true, Some(pin)) = (self.is_pinned(), &self.pin) {
            pin.unpin(self.ptr.as_ptr(), self.len);
        }
        // SAFETY: mapped by `map_huge` with this length; no buffer outlives the pool.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// One buffer of a [`StagingPool`], owned exclusively; returns to the pool when dropped.
pub struct StagingBuf {
    pool: Arc<StagingPool>,
    index: usize,
}

impl StagingBuf {
    /// The buffer's start, for DMA. Valid while this `StagingBuf` lives.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        // SAFETY: inside the region (index < count).
        unsafe { self.pool.ptr.as_ptr().add(self.index * self.pool.buf_size) }
    }

    /// The pool it belongs to.
    pub fn pool(&self) -> &Arc<StagingPool> {
        &self.pool
    }
}

impl Deref for StagingBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: this buffer's bytes belong to it alone; the region is initialized
        // (zeroed) and alive while the pool is.
        unsafe {
            std::slice::from_raw_parts(
                self.pool.ptr.as_ptr().add(self.index * self.pool.buf_size),
                self.pool.buf_size,
            )
        }
    }
}

impl DerefMut for StagingBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        let len = self.pool.buf_size;
        // SAFETY: as `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), len) }
    }
}

impl Drop for StagingBuf {
    fn drop(&mut self) {
        self.pool.give_back(self.index);
    }
}

impl std::fmt::Debug for StagingBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingBuf")
            .field("index", &self.index)
            .field("len", &self.pool.buf_size)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[derive(Default)]
    struct CountPin {
        pins: AtomicUsize,
        unpins: AtomicUsize,
    }
    impl StagingPin for CountPin {
        fn pin(&self, ptr: *mut u8, len: usize) -> Result<(), String> {
            assert_eq!(ptr as usize % PAGE, 0);
            assert_eq!(len % PAGE, 0);
            self.pins.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        fn unpin(&self, _: *mut u8, _: usize) {
            self.unpins.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn buffers_are_disjoint_bounded_and_pinned_once() {
        let pin = Arc::new(CountPin::default());
        let pool = StagingPool::new(3, 1000, Some(pin.clone())).unwrap();
        assert!(pool.is_pinned());
        let mut a = pool.acquire();
        let mut b = pool.acquire();
        a.fill(1);
        b.fill(2);
        assert!(a.iter().all(|&x| x == 1) && b.iter().all(|&x| x == 2));
        assert_eq!(pool.in_use(), 2);
        drop(a);
        let c = pool.acquire();
        let d = pool.acquire();
        assert_eq!((pool.in_use(), pool.peak_in_use()), (3, 3));
        // A fourth waits for a return.
        let waiter = {
            let pool = pool.clone();
            std::thread::spawn(move || pool.acquire().len())
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!waiter.is_finished());
        drop(c);
        assert_eq!(waiter.join().unwrap(), 1000);
        drop((b, d));
        assert_eq!(pin.unpins.load(Ordering::SeqCst), 0, "alive");
        drop(pool);
        assert_eq!(pin.pins.load(Ordering::SeqCst), 1);
        assert_eq!(pin.unpins.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_deferred_pool_pins_at_first_use_or_never() {
        let pin = Arc::new(CountPin::default());
        let unused = StagingPool::new_deferred(2, 10, Some(pin.clone())).unwrap();
        assert!(!unused.is_pinned());
        drop(unused);
        assert_eq!(pin.pins.load(Ordering::SeqCst), 0);
        assert_eq!(pin.unpins.load(Ordering::SeqCst), 0);
        let pool = StagingPool::new_deferred(2, 10, Some(pin.clone())).unwrap();
        let (a, b) = (pool.acquire(), pool.acquire());
        assert!(pool.is_pinned());
        drop((a, b, pool));
        assert_eq!(pin.pins.load(Ordering::SeqCst), 1);
        assert_eq!(pin.unpins.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn the_pool_outlives_its_last_buffer() {
        let pin = Arc::new(CountPin::default());
        let pool = StagingPool::new(1, 10, Some(pin.clone())).unwrap();
        let buf = pool.acquire();
        drop(pool);
        assert_eq!(pin.unpins.load(Ordering::SeqCst), 0);
        drop(buf);
        assert_eq!(pin.unpins.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_failed_pin_leaves_it_pageable() {
        struct No;
        impl StagingPin for No {
            fn pin(&self, _: *mut u8, _: usize) -> Result<(), String> {
                Err("no".into())
            }
            fn unpin(&self, _: *mut u8, _: usize) {
                panic!("unpin without pin");
            }
        }
        let pool = StagingPool::new(2, 10, Some(Arc::new(No))).unwrap();
        assert!(!pool.is_pinned());
        assert!(StagingPool::new(0, 10, None).is_err());
    }
}
