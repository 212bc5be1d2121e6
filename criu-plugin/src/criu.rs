//! CRIU's own functions, found at run time.
//!
//! CRIU links its binary with `-rdynamic`, so a plugin can call internals such as
//! `add_inventory_plugin`. They are not a stable API: each is looked up with
//! `dlsym(RTLD_DEFAULT, ...)` and used only if present, so the plugin still loads into a
//! CRIU without them (or into a test binary).

use std::ffi::{c_char, c_int, c_uint, CStr, CString};

/// CRIU's log levels (`criu-log.h`).
#[derive(Clone, Copy)]
pub enum Level {
    Error = 1,
    Warn = 2,
    Info = 3,
    Debug = 4,
}

fn lookup(name: &CStr) -> Option<*mut libc::c_void> {
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only reads.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    (!p.is_null()).then_some(p)
}

/// Writes to CRIU's log (dump.log/restore.log) through `print_on_level`, or to stderr
/// outside CRIU.
pub fn log(level: Level, msg: &str) {
    type PrintOnLevel = unsafe extern "C" fn(c_uint, *const c_char, ...);
    let line = CString::new(format!("{}: {msg}\n", crate::LOG_PREFIX))
        .unwrap_or_else(|_| CString::from(c"gpucr: (unprintable message)\n"));
    match lookup(c"print_on_level") {
        Some(f) => {
            // SAFETY: print_on_level(unsigned loglevel, const char *fmt, ...), called with "%s".
            let f: PrintOnLevel = unsafe { std::mem::transmute(f) };
            unsafe { f(level as c_uint, c"%s".as_ptr(), line.as_ptr()) };
        }
        None => eprint!("{}", line.to_string_lossy()),
    }
}

/// Records our name in the dump's inventory image, so that restore refuses to run
/// without a plugin that can bring the CUDA state back. `Ok(false)` when this CRIU
/// has no inventory support.
pub fn add_inventory_plugin(name: &CStr) -> Result<bool, ()> {
    let Some(f) = lookup(c"add_inventory_plugin") else {
        return Ok(false);
    };
    // SAFETY: int add_inventory_plugin(const char *name).
    let f: unsafe extern "C" fn(*const c_char) -> c_int = unsafe { std::mem::transmute(f) };
    if unsafe { f(name.as_ptr()) } == 0 {
        Ok(true)
    } else {
        Err(())
    }
}

/// Whether the image being restored lists `name` (and takes it off the list, which
/// tells CRIU a plugin handled it). `None` when this CRIU has no inventory support.
pub fn check_and_remove_inventory_plugin(name: &CStr) -> Option<bool> {
    let f = lookup(c"check_and_remove_inventory_plugin")?;
    // SAFETY: bool check_and_remove_inventory_plugin(const char *name, size_t n).
    let f: unsafe extern "C" fn(*const c_char, usize) -> bool = unsafe { std::mem::transmute(f) };
    Some(unsafe { f(name.as_ptr(), name.to_bytes().len()) })
}

/// CRIU's image directory, as an fd (`criu_get_image_dir`, the public plugin API).
pub fn image_dir_fd() -> Option<c_int> {
    let f = lookup(c"criu_get_image_dir")?;
    // SAFETY: int criu_get_image_dir(void).
    let f: unsafe extern "C" fn() -> c_int = unsafe { std::mem::transmute(f) };
    let fd = unsafe { f() };
    (fd >= 0).then_some(fd)
}

/// Makes CRIU stop tasks with ptrace interrupts instead of the cgroup freezer: a
/// frozen cgroup would keep the CUDA restore thread from running during checkpoint.
pub fn set_compel_interrupt_only_mode() -> bool {
    let Some(f) = lookup(c"set_compel_interrupt_only_mode") else {
        return false;
    };
    // SAFETY: void set_compel_interrupt_only_mode(void).
    let f: unsafe extern "C" fn() = unsafe { std::mem::transmute(f) };
    unsafe { f() };
    true
}
