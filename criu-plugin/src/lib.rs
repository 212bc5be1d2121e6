#![doc = include_str!("../README.md")]

mod checkpoint;
mod criu;
pub mod final_state;
pub mod gpus;
pub mod isolated;
mod ptrace;
mod restore;
pub mod shim;
mod state;

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

use isolated::IsolatedDriver;

use criu::Level;

/// The name CRIU records in the inventory image; the same as NVIDIA's plugin so that
/// images are interchangeable (see README).
pub const PLUGIN_NAME: &CStr = c"cuda_plugin";
const LOG_PREFIX: &str = "gpucr cuda_plugin";

/// `-ENOTSUP`: "not mine", CRIU asks the next plugin.
const ENOTSUP: c_int = -libc::ENOTSUP;

const STAGE_DUMP: c_int = 0;
const STAGE_PRE_DUMP: c_int = 1;
const STAGE_RESTORE: c_int = 2;

const HOOK_RESUME_DEVICES_LATE: usize = 9;
const HOOK_PAUSE_DEVICES: usize = 10;
const HOOK_CHECKPOINT_DEVICES: usize = 11;
/// CRIU 4.0 and 4.1 reject a plugin with more hooks than they know (12).
const MAX_HOOKS: usize = 12;

/// `cr_plugin_desc_t` from criu-plugin.h.
#[repr(C)]
pub struct CrPluginDesc {
    pub name: *const c_char,
    pub init: unsafe extern "C" fn(c_int) -> c_int,
    pub exit: unsafe extern "C" fn(c_int, c_int),
    pub version: c_uint,
    pub max_hooks: c_uint,
    pub hooks: [*const c_void; MAX_HOOKS],
}

// SAFETY: the descriptor is immutable and only holds pointers to static data and code.
unsafe impl Sync for CrPluginDesc {}

const fn hooks() -> [*const c_void; MAX_HOOKS] {
    let mut h = [std::ptr::null(); MAX_HOOKS];
    h[HOOK_RESUME_DEVICES_LATE] = hook_resume_devices_late as *const c_void;
    h[HOOK_PAUSE_DEVICES] = hook_pause_devices as *const c_void;
    h[HOOK_CHECKPOINT_DEVICES] = hook_checkpoint_devices as *const c_void;
    h
}

/// What CRIU looks up after `dlopen`.
#[no_mangle]
pub static CR_PLUGIN_DESC: CrPluginDesc = CrPluginDesc {
    name: PLUGIN_NAME.as_ptr(),
    init: plugin_init,
    exit: plugin_exit,
    version: 0x200,
    max_hooks: MAX_HOOKS as c_uint,
    hooks: hooks(),
};

/// Never unwind into CRIU.
fn guarded(what: &str, f: impl FnOnce() -> c_int) -> c_int {
    let rc = catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        criu::log(Level::Error, &format!("{what} panicked"));
        -1
    });
    // CRIU must stay single-threaded (setns into mount namespaces); say who broke it.
    let threads = isolated::thread_count();
    if threads > 1 {
        criu::log(
            Level::Warn,
            &format!("CRIU has {threads} threads after {what}; setns may fail"),
        );
    }
    rc
}

unsafe extern "C" fn plugin_init(stage: c_int) -> c_int {
    guarded("init", || init(stage))
}

fn init(stage: c_int) -> c_int {
    let mut guard = state::get();
    *guard = Some(state::Plugin::default());
    if stage == STAGE_PRE_DUMP {
        // Device memory cannot be dumped incrementally.
        criu::log(Level::Info, "pre-dump: inactive");
        return 0;
    }
    // On restore, whether the image was dumped with CUDA state (None: this CRIU keeps
    // no plugin inventory, so we cannot tell).
    let needed = if stage == STAGE_RESTORE {
        criu::check_and_remove_inventory_plugin(PLUGIN_NAME)
    } else {
        None
    };
    if needed == Some(false) {
        criu::log(Level::Info, "the image holds no CUDA state: inactive");
        return 0;
    }
    if stage == STAGE_RESTORE && shim::Quiesced::from_env() == shim::Quiesced::All {
        // The shim restores every CUDA process after CRIU (its own checks, its own GPU
        // pairs); the inventory entry is taken above, so CRIU does not miss us.
        criu::log(
            Level::Info,
            &format!(
                "{}=all: the gpucr shim restores the GPU state: inactive",
                shim::ENV
            ),
        );
        return 0;
    }
    let driver = match IsolatedDriver::probe() {
        Ok(Some(d)) => d,
        Ok(None) if needed == Some(true) => {
            criu::log(
                Level::Error,
                "the checkpoint holds CUDA state but this host has no CUDA driver",
            );
            return -1;
        }
        Ok(None) => {
            criu::log(Level::Info, "no CUDA driver: inactive");
            return 0;
        }
        Err(e) if needed == Some(true) => {
            criu::log(Level::Error, &format!("cannot restore CUDA state: {e}"));
            return -1;
        }
        Err(e) => {
            criu::log(
                Level::Warn,
                &format!("{e}; CUDA processes cannot be handled: inactive"),
            );
            return 0;
        }
    };
    criu::log(
        Level::Info,
        &format!("active (stage {stage}), driver {}", driver.path()),
    );
    if stage == STAGE_DUMP && !criu::set_compel_interrupt_only_mode() {
        criu::log(
            Level::Warn,
            "this CRIU cannot stop tasks by interrupt only; do not use --freeze-cgroup",
        );
    }
    let mut gpu_pairs = Vec::new();
    if stage == STAGE_RESTORE {
        // Before anything is restored: can this host take the checkpoint's GPUs?
        match restore_gpu_pairs() {
            Ok(p) => gpu_pairs = p,
            Err(e) => {
                criu::log(Level::Error, &format!("refusing the restore: {e}"));
                return -1;
            }
        }
    }
    if let Some(p) = guard.as_mut() {
        p.driver = Some(driver);
        p.gpu_pairs = gpu_pairs;
    }
    0
}

fn restore_gpu_pairs() -> Result<Vec<gpu_state::GpuPair>, String> {
    let Some(dir) = gpus::image_dir() else {
        return Ok(Vec::new());
    };
    let Some(record) = gpus::load(&dir)? else {
        return Ok(Vec::new());
    };
    let current = gpu_state::inventory::Inventory::gather_procfs();
    let map = std::env::var(gpus::MAP_ENV).ok();
    let always = std::env::var(gpus::PAIRS_ENV).is_ok_and(|v| v == "always");
    let pairs = gpus::plan(&record.inventory, &current, map.as_deref(), always)?;
    criu::log(
        Level::Info,
        &format!(
            "{} recorded GPUs; {} GPU pairs for the driver",
            record.inventory.gpus.len(),
            pairs.len()
        ),
    );
    Ok(pairs)
}

unsafe extern "C" fn plugin_exit(stage: c_int, ret: c_int) {
    guarded("exit", || {
        if stage == STAGE_DUMP {
            checkpoint::finish_dump(ret);
        }
        *state::get() = None;
        0
    });
}

unsafe extern "C" fn hook_pause_devices(pid: c_int) -> c_int {
    guarded("PAUSE_DEVICES", || checkpoint::pause_devices(pid))
}

unsafe extern "C" fn hook_checkpoint_devices(pid: c_int) -> c_int {
    guarded("CHECKPOINT_DEVICES", || checkpoint::checkpoint_devices(pid))
}

unsafe extern "C" fn hook_resume_devices_late(pid: c_int) -> c_int {
    guarded("RESUME_DEVICES_LATE", || restore::resume_devices_late(pid))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_layout_matches_criu() {
        assert_eq!(std::mem::offset_of!(CrPluginDesc, init), 8);
        assert_eq!(std::mem::offset_of!(CrPluginDesc, exit), 16);
        assert_eq!(std::mem::offset_of!(CrPluginDesc, version), 24);
        assert_eq!(std::mem::offset_of!(CrPluginDesc, max_hooks), 28);
        assert_eq!(std::mem::offset_of!(CrPluginDesc, hooks), 32);
        assert_eq!(CR_PLUGIN_DESC.max_hooks, 12);
        assert!(CR_PLUGIN_DESC.hooks[HOOK_PAUSE_DEVICES] == hook_pause_devices as *const c_void);
        assert!(CR_PLUGIN_DESC.hooks[0].is_null());
    }
}
