//! [`FakeDriver`]: an in-process stand-in for the CUDA driver's VMM API. "Device memory"
//! is host `Vec`s, one per physical allocation; mappings and reservations are checked the
//! way the driver checks them, so the hook's bookkeeping bugs show up as errors.
//!
//! New physical memory is filled with [`FakeDriver::FILL`], not zeros, so a test notices
//! when a copy-in was skipped.
//!
//! Exported memory ([`VmmDriver::export`]) is a memfd standing for the allocation:
//! releasing the exporter's handle keeps the bytes while the export is known, and
//! [`VmmDriver::import`] of that fd (after the release; sharing one allocation between
//! live handles is not modelled) gives them a new handle. The fake cannot see an fd
//! close, so exported memory lives on until imported (once: the import spends it). An imported handle cannot be
//! exported again (as the real driver behaves: a second keep after a reattach kept
//! nothing).
//!
//! Async copies are honest about their timing: issuing one only checks it and queues
//! it on its stream; the bytes move when that stream is waited for. So a caller that
//! reads a device-to-host buffer, or reuses a host-to-device buffer, before `wait` gets
//! wrong data, and the fake counts copies never waited for, copies into unpinned
//! memory and host registrations.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Mutex, MutexGuard};

use gpu_state::image::gpuhash::{self, ChunkSums};

use crate::driver::{
    fd_identity, DevicePtr, DriverCall, PhysHandle, VmmDriver, VmmError, CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_OUT_OF_MEMORY,
};

/// Where the fake's address space starts (like the driver's, above user mappings).
const VA_BASE: u64 = 0x7f00_0000_0000;

#[derive(Debug)]
struct Mapping {
    size: u64,
    handle: PhysHandle,
    accessible: bool,
}

#[derive(Debug, Default)]
struct State {
    next_va: u64,
    next_handle: u64,
    /// Reservation start → size.
    reservations: BTreeMap<u64, u64>,
    physical: HashMap<PhysHandle, Vec<u8>>,
    /// Mapping start → mapping.
    mappings: BTreeMap<u64, Mapping>,
    /// Calls that fail once after skipping some successful ones, for error-path tests.
    fail_next: Vec<(DriverCall, usize)>,
    /// Most bytes of physical memory alive at one time.
    peak_physical: u64,
    /// Registered host ranges: start → length.
    registered: BTreeMap<usize, usize>,
    host: HostStats,
    /// Async copies issued and not yet waited for, in issue order.
    pending: Vec<Pending>,
    /// Whether `chunk_sums` hashes (like a driver with the kernel) or says it cannot.
    device_hash: bool,
    /// Whether `export` exports (like a driver with exportable memory) or says it cannot.
    no_export: bool,
    /// What `device_ordinal` says (tests of copy-in helpers set one).
    device_ordinal: Option<i32>,
    /// Exported memory by its fd's identity (device, inode): the handle it belongs to now.
    exports: HashMap<(u64, u64), PhysHandle>,
    /// Memory whose handle was released while exported, by that old handle.
    orphans: HashMap<PhysHandle, Vec<u8>>,
    /// Handles made by `import`: the driver does not export them again.
    imported: std::collections::HashSet<PhysHandle>,
}

impl State {
    fn used(&self) -> u64 {
        let bytes =
            |m: &HashMap<PhysHandle, Vec<u8>>| m.values().map(|v| v.len() as u64).sum::<u64>();
        bytes(&self.physical) + bytes(&self.orphans)
    }
}

/// What the fake saw of host registrations and async copies.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct HostStats {
    /// `register_host` calls that succeeded.
    pub registrations: usize,
    /// `unregister_host` calls that succeeded.
    pub unregistrations: usize,
    /// Async copies issued.
    pub async_copies: usize,
    /// Async copies whose host memory was not registered.
    pub pageable_async_copies: usize,
    /// Most async copies outstanding at one time.
    pub peak_outstanding: usize,
    /// Unregistrations refused because a copy into the range was outstanding.
    pub unregistered_under_dma: usize,
    /// Device bytes copied to the host (sync and async).
    pub bytes_to_host: u64,
    /// `chunk_sums` calls answered with sums.
    pub device_hashes: usize,
}

/// An async copy waiting for its stream's `wait`. Host addresses as integers: the
/// caller promised (unsafe contract) they stay valid until then.
#[derive(Debug)]
struct Pending {
    stream: usize,
    to_host: bool,
    va: DevicePtr,
    host: usize,
    len: usize,
}

/// The fake driver. See the module docs.
#[derive(Debug)]
pub struct FakeDriver {
    granularity: u64,
    /// Total "device memory"; `create` beyond it fails with out-of-memory.
    capacity: u64,
    state: Mutex<State>,
}

impl Default for FakeDriver {
    fn default() -> Self {
        FakeDriver::new(64 << 10, 1 << 30)
    }
}

impl FakeDriver {
    /// The byte new physical memory holds.
    pub const FILL: u8 = 0xA5;

    /// A fake device with this granularity and capacity in bytes.
    pub fn new(granularity: u64, capacity: u64) -> FakeDriver {
        FakeDriver {
            granularity,
            capacity,
            state: Mutex::new(State {
                next_va: VA_BASE,
                next_handle: 1,
                ..State::default()
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes the next call of `call` fail with `CUDA_ERROR_INVALID_VALUE`.
    pub fn fail_next(&self, call: DriverCall) {
        self.fail_nth(call, 0);
    }

    /// Lets `skip` calls of `call` succeed, then fails the next one.
    pub fn fail_nth(&self, call: DriverCall, skip: usize) {
        self.lock().fail_next.push((call, skip));
    }

    /// Makes `chunk_sums` hash on the "device" (the CPU reference over the fake's
    /// memory), as the real driver does with the hash kernel; off by default.
    pub fn set_device_hash(&self, on: bool) {
        self.lock().device_hash = on;
    }

    /// Makes `device_ordinal` say `ordinal` (copy-in helpers need one to start).
    pub fn set_device_ordinal(&self, ordinal: Option<i32>) {
        self.lock().device_ordinal = ordinal;
    }

    /// Makes `export` say it cannot (`Ok(None)`), as a driver without exportable memory.
    pub fn set_no_export(&self, on: bool) {
        self.lock().no_export = on;
    }

    /// Bytes of physical memory alive now (exported memory no handle holds included).
    pub fn physical_bytes(&self) -> u64 {
        self.lock().used()
    }

    /// Most bytes of physical memory alive at one time.
    pub fn peak_physical_bytes(&self) -> u64 {
        self.lock().peak_physical
    }

    /// Number of live reservations.
    pub fn reservations(&self) -> usize {
        self.lock().reservations.len()
    }

    /// Number of live mappings.
    pub fn mappings(&self) -> usize {
        self.lock().mappings.len()
    }

    /// Host registrations and async copies so far.
    pub fn host_stats(&self) -> HostStats {
        self.lock().host
    }

    /// Host ranges registered now.
    pub fn registered_ranges(&self) -> usize {
        self.lock().registered.len()
    }

    /// Async copies issued and not waited for.
    pub fn outstanding_copies(&self) -> usize {
        self.lock().pending.len()
    }

    /// Whether `[ptr, ptr + len)` lies inside one registered range.
    fn is_registered(state: &State, ptr: usize, len: usize) -> bool {
        state
            .registered
            .range(..=ptr)
            .next_back()
            .is_some_and(|(start, l)| ptr + len <= start + l)
    }

    /// Checks and queues an async copy.
    fn issue(&self, call: DriverCall, p: Pending) -> Result<(), VmmError> {
        let mut s = self.lock();
        Self::check(&mut s, call)?;
        if p.host == 0 || p.len == 0 {
            return Err(invalid(call));
        }
        Self::resolve(&s, call, p.va, p.len as u64)?;
        s.host.async_copies += 1;
        if p.to_host {
            s.host.bytes_to_host += p.len as u64;
        }
        if !Self::is_registered(&s, p.host, p.len) {
            s.host.pageable_async_copies += 1;
        }
        s.pending.push(p);
        s.host.peak_outstanding = s.host.peak_outstanding.max(s.pending.len());
        Ok(())
    }

    fn check(state: &mut State, call: DriverCall) -> Result<(), VmmError> {
        let Some(i) = state.fail_next.iter().position(|(c, _)| *c == call) else {
            return Ok(());
        };
        if state.fail_next[i].1 == 0 {
            state.fail_next.remove(i);
            return Err(invalid(call));
        }
        state.fail_next[i].1 -= 1;
        Ok(())
    }

    fn check_aligned(&self, call: DriverCall, values: &[u64]) -> Result<(), VmmError> {
        if values.iter().any(|v| v % self.granularity != 0) {
            return Err(invalid(call));
        }
        Ok(())
    }

    /// The mapping holding `[va, va + len)` with access granted, and the offset in it.
    fn resolve(
        state: &State,
        call: DriverCall,
        va: DevicePtr,
        len: u64,
    ) -> Result<(PhysHandle, usize), VmmError> {
        let (start, m) = state
            .mappings
            .range(..=va)
            .next_back()
            .ok_or_else(|| invalid(call))?;
        let end = va.checked_add(len).ok_or_else(|| invalid(call))?;
        if !m.accessible || end > start + m.size {
            return Err(invalid(call));
        }
        Ok((m.handle, (va - start) as usize))
    }
}

fn invalid(call: DriverCall) -> VmmError {
    VmmError {
        call,
        code: CUDA_ERROR_INVALID_VALUE,
    }
}

fn overlaps<V>(map: &BTreeMap<u64, V>, start: u64, end: u64, size_of: impl Fn(&V) -> u64) -> bool {
    map.range(..end)
        .next_back()
        .is_some_and(|(s, v)| s + size_of(v) > start)
}

impl VmmDriver for FakeDriver {
    fn device_ordinal(&self) -> Option<i32> {
        self.lock().device_ordinal
    }

    fn granularity(&self) -> Result<u64, VmmError> {
        Self::check(&mut self.lock(), DriverCall::Granularity)?;
        Ok(self.granularity)
    }

    fn reserve(&self, size: u64, fixed: Option<DevicePtr>) -> Result<DevicePtr, VmmError> {
        let call = DriverCall::AddressReserve;
        let mut s = self.lock();
        Self::check(&mut s, call)?;
        self.check_aligned(call, &[size, fixed.unwrap_or(0)])?;
        if size == 0 {
            return Err(invalid(call));
        }
        let va = fixed.unwrap_or(s.next_va);
        let end = va.checked_add(size).ok_or_else(|| invalid(call))?;
        if overlaps(&s.reservations, va, end, |size| *size) {
            return Err(invalid(call));
        }
        s.reservations.insert(va, size);
        s.next_va = s.next_va.max(end);
        Ok(va)
    }

    fn create(&self, size: u64) -> Result<PhysHandle, VmmError> {
        let call = DriverCall::Create;
        let mut s = self.lock();
        Self::check(&mut s, call)?;
        self.check_aligned(call, &[size])?;
        let used = s.used();
        if size == 0 || used + size > self.capacity {
            return Err(VmmError {
                call,
                code: CUDA_ERROR_OUT_OF_MEMORY,
            });
        }
        let handle = PhysHandle(s.next_handle);
        s.next_handle += 1;
        s.physical.insert(handle, vec![Self::FILL; size as usize]);
        s.peak_physical = s.peak_physical.max(used + size);
        Ok(handle)
    }

    fn map(&self, va: DevicePtr, size: u64, handle: PhysHandle) -> Result<(), VmmError> {
        let call = DriverCall::Map;
        let mut s = self.lock();
        Self::check(&mut s, call)?;
        self.check_aligned(call, &[va, size])?;
        let end = va.checked_add(size).ok_or_else(|| invalid(call))?;
        let reserved = s
            .reservations
            .range(..=va)
            .next_back()
            .is_some_and(|(start, len)| end <= start + len);
        let phys_len = s.physical.get(&handle).map(|v| v.len() as u64);
        if !reserved
            || phys_len != Some(size)
            || overlaps(&s.mappings, va, end, |m: &Mapping| m.size)
        {
            return Err(invalid(call));
        }
        s.mappings.insert(
            va,
            Mapping {
                size,
                handle,
                accessible: false,
            },
        );
        Ok(())
    }

    fn set_access(&self, va: DevicePtr, size: u64) -> Result<(), VmmError> {
        let call = DriverCall::SetAccess;
        let mut s = self.lock();
        Self::check(&mut s, call)?;
        match s.mappings.get_mut(&va) {
            Some(m) if m.size == size => {
                m.accessible = true;
                Ok(())
            }
            _ => Err(invalid(call)),
        }
    }

    fn unmap(&self, va: DevicePtr, size: u64) -> Result<(), VmmError> {
        let call = DriverCall::Unmap;
        let mut s = self.lock();
        Self::check(&mut s, call)?;
        match s.mappings.get(&va) {
            Some(m) if m.size == size => {
                s.mappings.remove(&va);
                Ok(())
            }
            _ => Err(invalid(call)),
        }
    }

    fn release(&self, handle: PhysHandle) -> Result<(), VmmError> {
        let call = DriverCall::Release;
        let mut s = self.lock();
        Self::check(&mut s, call)?;
        // The real driver keeps mapped memory alive until unmapped; the hook always
        // unmaps first, so the fake refuses instead.
        if s.mappings.values().any(|m| m.handle == handle) {
            return Err(invalid(call));
        }
        let bytes = s.physical.remove(&handle).ok_or_else(|| invalid(call))?;
        if s.exports.values().any(|h| *h == handle) {
            s.orphans.insert(handle, bytes);
        }
        Ok(())
    }

    fn free_va(&self, va: DevicePtr, size: u64) -> Result<(), VmmError> {
        let call = DriverCall::AddressFree;
        let mut s = self.lock();
        Self::check(&mut s, call)?;
        let end = va.checked_add(size).ok_or_else(|| invalid(call))?;
        if s.reservations.get(&va) != Some(&size) || overlaps(&s.mappings, va, end, |m| m.size) {
            return Err(invalid(call));
        }
        s.reservations.remove(&va);
        Ok(())
    }

    fn copy_to_host(&self, src: DevicePtr, dst: &mut [u8]) -> Result<(), VmmError> {
        let call = DriverCall::CopyToHost;
        let mut s = self.lock();
        Self::check(&mut s, call)?;
        let (handle, offset) = Self::resolve(&s, call, src, dst.len() as u64)?;
        dst.copy_from_slice(&s.physical[&handle][offset..offset + dst.len()]);
        s.host.bytes_to_host += dst.len() as u64;
        Ok(())
    }

    fn copy_device(&self, dst: DevicePtr, src: DevicePtr, len: u64) -> Result<(), VmmError> {
        let call = DriverCall::CopyDevice;
        let mut s = self.lock();
        Self::check(&mut s, call)?;
        let (from, at) = Self::resolve(&s, call, src, len)?;
        let (to, to_at) = Self::resolve(&s, call, dst, len)?;
        let bytes = s.physical[&from][at..at + len as usize].to_vec();
        s.physical.get_mut(&to).expect("resolved")[to_at..to_at + len as usize]
            .copy_from_slice(&bytes);
        Ok(())
    }

    fn free_memory(&self) -> Result<Option<u64>, VmmError> {
        let mut s = self.lock();
        Self::check(&mut s, DriverCall::MemInfo)?;
        Ok(Some(self.capacity.saturating_sub(s.used())))
    }

    fn copy_from_host(&self, dst: DevicePtr, src: &[u8]) -> Result<(), VmmError> {
        let call = DriverCall::CopyFromHost;
        let mut s = self.lock();
        Self::check(&mut s, call)?;
        let (handle, offset) = Self::resolve(&s, call, dst, src.len() as u64)?;
        let memory = s.physical.get_mut(&handle).ok_or_else(|| invalid(call))?;
        memory[offset..offset + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn synchronize(&self) -> Result<(), VmmError> {
        Self::check(&mut self.lock(), DriverCall::Synchronize)
    }

    fn register_host(&self, ptr: *mut u8, len: usize) -> Result<(), VmmError> {
        let call = DriverCall::RegisterHost;
        let mut s = self.lock();
        Self::check(&mut s, call)?;
        let start = ptr as usize;
        let end = start.checked_add(len).ok_or_else(|| invalid(call))?;
        // Like the driver: overlapping registrations are refused.
        if start == 0 || len == 0 || overlaps_host(&s.registered, start, end) {
            return Err(invalid(call));
        }
        s.registered.insert(start, len);
        s.host.registrations += 1;
        Ok(())
    }

    fn unregister_host(&self, ptr: *mut u8) -> Result<(), VmmError> {
        let call = DriverCall::UnregisterHost;
        let mut s = self.lock();
        Self::check(&mut s, call)?;
        let start = ptr as usize;
        let len = *s.registered.get(&start).ok_or_else(|| invalid(call))?;
        if s.pending
            .iter()
            .any(|p| p.host < start + len && p.host + p.len > start)
        {
            s.host.unregistered_under_dma += 1;
            return Err(invalid(call));
        }
        s.registered.remove(&start);
        s.host.unregistrations += 1;
        Ok(())
    }

    unsafe fn copy_to_host_async(
        &self,
        src: DevicePtr,
        dst: *mut u8,
        len: usize,
        stream: usize,
    ) -> Result<(), VmmError> {
        let p = Pending {
            stream,
            to_host: true,
            va: src,
            host: dst as usize,
            len,
        };
        self.issue(DriverCall::CopyToHost, p)
    }

    unsafe fn copy_from_host_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        stream: usize,
    ) -> Result<(), VmmError> {
        let p = Pending {
            stream,
            to_host: false,
            va: dst,
            host: src as usize,
            len,
        };
        self.issue(DriverCall::CopyFromHost, p)
    }

    fn chunk_sums(
        &self,
        regions: &[(DevicePtr, u64)],
        chunk: u64,
    ) -> Result<Option<Vec<Vec<ChunkSums>>>, VmmError> {
        let call = DriverCall::Hash;
        let mut s = self.lock();
        if !s.device_hash {
            return Ok(None);
        }
        Self::check(&mut s, call)?;
        if chunk == 0 {
            return Err(invalid(call));
        }
        let mut out = Vec::with_capacity(regions.len());
        for &(va, len) in regions {
            let (handle, offset) = Self::resolve(&s, call, va, len)?;
            let memory = &s.physical[&handle][offset..offset + len as usize];
            let sums = memory
                .chunks(chunk as usize)
                .map(|c| gpuhash::chunk_sums(c).ok_or_else(|| invalid(call)))
                .collect::<Result<Vec<_>, _>>()?;
            out.push(sums);
        }
        s.host.device_hashes += 1;
        Ok(Some(out))
    }

    fn export(&self, handle: PhysHandle) -> Result<Option<OwnedFd>, VmmError> {
        let call = DriverCall::Export;
        let mut s = self.lock();
        Self::check(&mut s, call)?;
        if s.no_export {
            return Ok(None);
        }
        if !s.physical.contains_key(&handle) || s.imported.contains(&handle) {
            return Err(invalid(call));
        }
        let fd = nix::sys::memfd::memfd_create(
            c"gpucr-fake-export",
            nix::sys::memfd::MFdFlags::MFD_CLOEXEC,
        )
        .map_err(|_| invalid(call))?;
        let id = fd_identity(fd.as_fd()).ok_or_else(|| invalid(call))?;
        s.exports.insert(id, handle);
        Ok(Some(fd))
    }

    fn import(&self, fd: BorrowedFd<'_>) -> Result<PhysHandle, VmmError> {
        let call = DriverCall::Import;
        let mut s = self.lock();
        Self::check(&mut s, call)?;
        let id = fd_identity(fd).ok_or_else(|| invalid(call))?;
        let old = *s.exports.get(&id).ok_or_else(|| invalid(call))?;
        // Released by its owner, or still held (a release that failed: the hook leaks
        // that handle and never uses it again, so a copy stands for the shared memory).
        let bytes = match s.orphans.remove(&old) {
            Some(bytes) => bytes,
            None => s.physical.get(&old).cloned().ok_or_else(|| invalid(call))?,
        };
        let handle = PhysHandle(s.next_handle);
        s.next_handle += 1;
        s.physical.insert(handle, bytes);
        // One import per export (what the hook does): the fd is spent.
        s.exports.remove(&id);
        s.imported.insert(handle);
        Ok(handle)
    }

    fn wait(&self, stream: usize) -> Result<(), VmmError> {
        let mut s = self.lock();
        let (mine, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut s.pending)
            .into_iter()
            .partition(|p| p.stream == stream);
        s.pending = rest;
        // A failed wait still ends the stream's copies (their data is undefined).
        Self::check(&mut s, DriverCall::Wait)?;
        for p in mine {
            let call = if p.to_host {
                DriverCall::CopyToHost
            } else {
                DriverCall::CopyFromHost
            };
            let (handle, offset) = Self::resolve(&s, call, p.va, p.len as u64)?;
            let memory = s.physical.get_mut(&handle).ok_or_else(|| invalid(call))?;
            let device = &mut memory[offset..offset + p.len];
            // SAFETY: the issuer promised the host range stays valid and unshared until
            // this wait (the unsafe contract of the async copies).
            unsafe {
                if p.to_host {
                    std::ptr::copy_nonoverlapping(device.as_ptr(), p.host as *mut u8, p.len);
                } else {
                    std::ptr::copy_nonoverlapping(p.host as *const u8, device.as_mut_ptr(), p.len);
                }
            }
        }
        Ok(())
    }
}

fn overlaps_host(map: &BTreeMap<usize, usize>, start: usize, end: usize) -> bool {
    map.range(..end)
        .next_back()
        .is_some_and(|(s, len)| s + len > start)
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 64 << 10;

    fn mapped(d: &FakeDriver, size: u64) -> (DevicePtr, PhysHandle) {
        let va = d.reserve(size, None).unwrap();
        let h = d.create(size).unwrap();
        d.map(va, size, h).unwrap();
        d.set_access(va, size).unwrap();
        (va, h)
    }

    #[test]
    fn contents_survive_release_and_remap_only_through_copies() {
        let d = FakeDriver::default();
        let (va, h) = mapped(&d, 2 * G);
        d.copy_from_host(va + 10, b"abc").unwrap();
        let mut out = [0u8; 3];
        d.copy_to_host(va + 10, &mut out).unwrap();
        assert_eq!(&out, b"abc");

        d.unmap(va, 2 * G).unwrap();
        d.release(h).unwrap();
        assert!(
            d.copy_to_host(va, &mut out).is_err(),
            "unmapped VA is not readable"
        );
        assert_eq!(d.physical_bytes(), 0);

        let h2 = d.create(2 * G).unwrap();
        d.map(va, 2 * G, h2).unwrap();
        assert!(
            d.copy_to_host(va, &mut out).is_err(),
            "no access before set_access"
        );
        d.set_access(va, 2 * G).unwrap();
        d.copy_to_host(va + 10, &mut out).unwrap();
        assert_eq!(
            out,
            [FakeDriver::FILL; 3],
            "new physical memory is not the old one"
        );
    }

    #[test]
    fn checks_like_the_driver() {
        let d = FakeDriver::new(G, 4 * G);
        assert!(d.reserve(G + 1, None).is_err(), "unaligned size");
        let va = d.reserve(2 * G, None).unwrap();
        assert!(
            d.reserve(G, Some(va + G)).is_err(),
            "overlapping reservation"
        );
        let h = d.create(G).unwrap();
        assert!(d.map(va + 2 * G, G, h).is_err(), "outside the reservation");
        d.map(va, G, h).unwrap();
        assert!(d.map(va, G, h).is_err(), "already mapped");
        assert!(d.release(h).is_err(), "still mapped");
        assert!(d.free_va(va, 2 * G).is_err(), "mapping inside");
        let oom = d.create(4 * G).unwrap_err();
        assert_eq!(oom.code, CUDA_ERROR_OUT_OF_MEMORY);
        d.set_access(va, G).unwrap();
        let mut big = vec![0u8; (G + 1) as usize];
        assert!(d.copy_to_host(va, &mut big).is_err(), "past the mapping");
        d.unmap(va, G).unwrap();
        d.release(h).unwrap();
        d.free_va(va, 2 * G).unwrap();
        assert_eq!((d.reservations(), d.mappings()), (0, 0));
    }

    #[test]
    fn injected_failure_happens_once() {
        let d = FakeDriver::default();
        d.fail_next(DriverCall::Create);
        assert_eq!(d.create(G).unwrap_err().call, DriverCall::Create);
        assert!(d.create(G).is_ok());
        d.fail_nth(DriverCall::Create, 1);
        assert!(d.create(G).is_ok());
        assert!(d.create(G).is_err());
        assert!(d.create(G).is_ok());
    }

    #[test]
    fn async_copies_move_bytes_only_at_wait() {
        let d = FakeDriver::default();
        let (va, _) = mapped(&d, G);
        d.copy_from_host(va, b"device").unwrap();
        let mut host = vec![0u8; 6];
        unsafe { d.copy_to_host_async(va, host.as_mut_ptr(), 6, 1).unwrap() };
        assert_eq!(host, [0; 6], "nothing before wait");
        assert_eq!(d.outstanding_copies(), 1);
        d.wait(0).unwrap();
        assert_eq!(d.outstanding_copies(), 1, "another stream's wait");
        d.wait(1).unwrap();
        assert_eq!(&host, b"device");

        let mut src = b"newval".to_vec();
        unsafe { d.copy_from_host_async(va, src.as_ptr(), 6, 0).unwrap() };
        src.copy_from_slice(b"reused");
        d.wait(0).unwrap();
        assert_eq!(read6(&d, va), *b"reused", "the buffer is read at wait");
        let st = d.host_stats();
        assert_eq!((st.async_copies, st.pageable_async_copies), (2, 2));
        assert!(
            unsafe { d.copy_to_host_async(va + G - 2, host.as_mut_ptr(), 6, 0) }.is_err(),
            "checked at issue"
        );
    }

    fn read6(d: &FakeDriver, va: DevicePtr) -> [u8; 6] {
        let mut out = [0u8; 6];
        d.copy_to_host(va, &mut out).unwrap();
        out
    }

    #[test]
    fn registrations_are_checked_and_counted() {
        let d = FakeDriver::default();
        let (va, _) = mapped(&d, G);
        let mut host = vec![0u8; 8192];
        let p = host.as_mut_ptr();
        d.register_host(p, 8192).unwrap();
        assert!(
            d.register_host(unsafe { p.add(4096) }, 10).is_err(),
            "overlap"
        );
        unsafe { d.copy_to_host_async(va, p.add(100), 50, 0).unwrap() };
        assert!(d.unregister_host(p).is_err(), "DMA outstanding");
        d.wait(0).unwrap();
        d.unregister_host(p).unwrap();
        assert!(d.unregister_host(p).is_err(), "not registered");
        let st = d.host_stats();
        assert_eq!(
            (
                st.registrations,
                st.unregistrations,
                st.unregistered_under_dma
            ),
            (1, 1, 1)
        );
        assert_eq!((st.async_copies, st.pageable_async_copies), (1, 0));
        assert_eq!(d.registered_ranges(), 0);
    }
}
