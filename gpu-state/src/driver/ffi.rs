//! `#[repr(C)]` mirrors of the checkpoint types in cuda.h (12.8 and 13.0 layouts).
//!
//! Every args struct is 64 bytes and its reserved fields must be zero; the driver
//! rejects anything else. The size asserts below keep us honest at compile time.

use std::os::raw::{c_int, c_uint};

/// `CUresult`.
pub type CuResult = c_int;

/// `CUuuid`: 16 raw bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CuUuid {
    pub bytes: [u8; 16],
}

/// `CUcheckpointGpuPair` (CUDA 13.0+).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CuCheckpointGpuPair {
    pub old_uuid: CuUuid,
    pub new_uuid: CuUuid,
}

/// `CUcheckpointLockArgs`: `timeoutMs` 0 means "no timeout".
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CuCheckpointLockArgs {
    pub timeout_ms: c_uint,
    pub reserved0: c_uint,
    pub reserved1: [u64; 7],
}

/// `CUcheckpointCheckpointArgs` (12.8–13.3; on 13.4 the first pointer is a NULL
/// `customStorageInfo_out`, so all-zero stays valid).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CuCheckpointCheckpointArgs {
    pub reserved: [u64; 8],
}

/// `CUcheckpointUnlockArgs`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CuCheckpointUnlockArgs {
    pub reserved: [u64; 8],
}

/// `CUcheckpointRestoreArgs` on a 12.x driver: all reserved.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CuCheckpointRestoreArgsV12 {
    pub reserved: [u64; 8],
}

/// `CUcheckpointRestoreArgs` on a 13.0+ driver. 13.4 adds a padding word and a
/// NULL-able custom-storage pointer inside what 13.0 calls `reserved`, so zeros keep
/// the 13.0 meaning there too.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CuCheckpointRestoreArgsV13 {
    pub gpu_pairs: *mut CuCheckpointGpuPair,
    pub gpu_pairs_count: c_uint,
    pub reserved: [u8; 52 - std::mem::size_of::<*mut u8>()],
    pub reserved1: u64,
}

impl Default for CuCheckpointRestoreArgsV13 {
    fn default() -> Self {
        Self {
            gpu_pairs: std::ptr::null_mut(),
            gpu_pairs_count: 0,
            reserved: [0; 52 - std::mem::size_of::<*mut u8>()],
            reserved1: 0,
        }
    }
}

const _: () = assert!(std::mem::size_of::<CuUuid>() == 16);
const _: () = assert!(std::mem::size_of::<CuCheckpointGpuPair>() == 32);
const _: () = assert!(std::mem::size_of::<CuCheckpointLockArgs>() == 64);
const _: () = assert!(std::mem::size_of::<CuCheckpointCheckpointArgs>() == 64);
const _: () = assert!(std::mem::size_of::<CuCheckpointUnlockArgs>() == 64);
const _: () = assert!(std::mem::size_of::<CuCheckpointRestoreArgsV12>() == 64);
const _: () = assert!(std::mem::size_of::<CuCheckpointRestoreArgsV13>() == 64);

pub type FnDriverGetVersion = unsafe extern "C" fn(*mut c_int) -> CuResult;
pub type FnGetState = unsafe extern "C" fn(c_int, *mut c_int) -> CuResult;
pub type FnGetRestoreThreadId = unsafe extern "C" fn(c_int, *mut c_int) -> CuResult;
pub type FnLock = unsafe extern "C" fn(c_int, *mut CuCheckpointLockArgs) -> CuResult;
pub type FnCheckpoint = unsafe extern "C" fn(c_int, *mut CuCheckpointCheckpointArgs) -> CuResult;
/// Restore takes a pointer to whichever RestoreArgs layout the driver speaks.
pub type FnRestore = unsafe extern "C" fn(c_int, *mut std::ffi::c_void) -> CuResult;
pub type FnUnlock = unsafe extern "C" fn(c_int, *mut CuCheckpointUnlockArgs) -> CuResult;

/// `cuDriverGetVersion` value from which RestoreArgs carries GPU pairs.
pub const CUDA_13_0: i32 = 13000;
