//! Whether the dumped tasks keep running after `criu dump`.
//!
//! CRIU calls our `exit(DUMP, ret)` *before* it kills or resumes the tasks, so
//! `/proc/<pid>` cannot tell; the answer is in CRIU's private `opts.final_state`, whose
//! layout changes between releases. So we decide from, in order:
//! 1. `ret != 0`: the dump failed, CRIU resumes the tasks → alive.
//! 2. `$GPUCR_CRIU_LEAVE_RUNNING` = `1`/`true` (alive) or `0`/`false` (killed): set by
//!    whoever starts CRIU (the gpucr shim, through runc's environment).
//! 3. CRIU's command line, for `criu dump`: `-R`/`--leave-running` or
//!    `-s`/`--leave-stopped` → alive, otherwise killed.
//! 4. Otherwise (RPC/`swrk` mode, as runc uses): alive. Restoring a process that is
//!    then killed only costs time; leaving a living process CHECKPOINTED would hang it.

pub const ENV: &str = "GPUCR_CRIU_LEAVE_RUNNING";

pub fn tasks_stay_alive(dump_ret: i32) -> (bool, &'static str) {
    if dump_ret != 0 {
        return (true, "the dump failed");
    }
    match std::env::var(ENV).as_deref() {
        Ok("1" | "true" | "yes") => return (true, "GPUCR_CRIU_LEAVE_RUNNING=1"),
        Ok("0" | "false" | "no") => return (false, "GPUCR_CRIU_LEAVE_RUNNING=0"),
        _ => {}
    }
    let cmdline = std::fs::read("/proc/self/cmdline").unwrap_or_default();
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    match from_args(&args) {
        Some(true) => (true, "criu dump --leave-running/--leave-stopped"),
        Some(false) => (
            false,
            "criu dump without --leave-running: CRIU kills the tasks",
        ),
        None => (
            true,
            "cannot tell how CRIU ends the dump (RPC mode); resuming to be safe",
        ),
    }
}

/// `Some(alive)` for a `criu dump` command line, `None` for anything else.
pub fn from_args(args: &[String]) -> Option<bool> {
    if !args.iter().skip(1).any(|a| a == "dump") {
        return None;
    }
    let alive = args.iter().skip(1).any(|a| {
        matches!(a.as_str(), "--leave-running" | "--leave-stopped")
            || (a.starts_with('-')
                && !a.starts_with("--")
                && a[1..].bytes().all(|b| b.is_ascii_alphabetic())
                && a[1..].bytes().any(|b| b == b'R' || b == b's'))
    });
    Some(alive)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &str) -> Vec<String> {
        s.split(' ').map(String::from).collect()
    }

    #[test]
    fn reads_criu_dump_flags() {
        assert_eq!(from_args(&v("criu dump -t 1 -D d -R")), Some(true));
        assert_eq!(from_args(&v("criu dump -t 1 --leave-stopped")), Some(true));
        assert_eq!(from_args(&v("criu dump -vvvR -t 1")), Some(true));
        assert_eq!(
            from_args(&v("criu dump -t 1 -D /x/R -o dump.log")),
            Some(false)
        );
        assert_eq!(from_args(&v("criu swrk 3")), None);
    }
}
