//! Letting the CUDA restore thread run while CRIU holds the task stopped.
//!
//! The driver does checkpoint and restore work on a helper thread inside the target
//! process (the "restore thread"). CRIU has every thread ptrace-stopped when our hooks
//! run, so the driver call would wait forever. We, being CRIU (its tracer), resume that
//! one thread with all signals but SIGTRAP blocked, make the driver call, then stop it
//! again and put its signal mask back, leaving the thread as CRIU expects it.

use std::io;

type Pid = libc::pid_t;

/// The restore thread's state saved while it runs.
pub struct Resumed {
    tid: Pid,
    saved_mask: u64,
}

fn check(what: &str, tid: Pid, rc: libc::c_long) -> io::Result<()> {
    if rc == -1 {
        let e = io::Error::last_os_error();
        Err(io::Error::new(
            e.kind(),
            format!("{what} of thread {tid}: {e}"),
        ))
    } else {
        Ok(())
    }
}

/// Resumes the stopped restore thread `tid`.
pub fn resume(tid: Pid) -> io::Result<Resumed> {
    let mut saved_mask: u64 = 0;
    let size = std::mem::size_of::<u64>();
    // SAFETY: ptrace on a thread we trace; the kernel sigset is 8 bytes.
    unsafe {
        check(
            "PTRACE_GETSIGMASK",
            tid,
            libc::ptrace(
                libc::PTRACE_GETSIGMASK,
                tid,
                size,
                &mut saved_mask as *mut u64,
            ),
        )?;
        let block: u64 = !(1u64 << (libc::SIGTRAP - 1));
        check(
            "PTRACE_SETSIGMASK",
            tid,
            libc::ptrace(libc::PTRACE_SETSIGMASK, tid, size, &block as *const u64),
        )?;
        // Seccomp stays suspended for CRIU's own syscalls; the driver's thread must
        // run under the process's normal rules.
        check(
            "PTRACE_SETOPTIONS",
            tid,
            libc::ptrace(libc::PTRACE_SETOPTIONS, tid, 0, 0),
        )?;
        check(
            "PTRACE_CONT",
            tid,
            libc::ptrace(libc::PTRACE_CONT, tid, 0, 0),
        )?;
    }
    Ok(Resumed { tid, saved_mask })
}

impl Resumed {
    /// Stops the thread again and restores what [`resume`] changed.
    pub fn stop(self) -> io::Result<()> {
        let tid = self.tid;
        // SAFETY: as in `resume`.
        unsafe {
            check(
                "PTRACE_INTERRUPT",
                tid,
                libc::ptrace(libc::PTRACE_INTERRUPT, tid, 0, 0),
            )?;
            wait_stopped(tid)?;
            let opts = libc::PTRACE_O_SUSPEND_SECCOMP | libc::PTRACE_O_TRACESYSGOOD;
            check(
                "PTRACE_SETOPTIONS",
                tid,
                libc::ptrace(libc::PTRACE_SETOPTIONS, tid, 0, opts as libc::c_long),
            )?;
            check(
                "PTRACE_SETSIGMASK",
                tid,
                libc::ptrace(
                    libc::PTRACE_SETSIGMASK,
                    tid,
                    std::mem::size_of::<u64>(),
                    &self.saved_mask as *const u64,
                ),
            )?;
        }
        Ok(())
    }
}

/// Waits until `tid` reports the stop of our `PTRACE_INTERRUPT`.
///
/// A signal can come first (a signal-delivery-stop, e.g. SIGCHLD from a child that exits
/// meanwhile): it is put back as pending (restarting with it while the mask blocks it
/// requeues it, so the process loses nothing and CRIU dumps it as pending), and we wait
/// on for the interrupt's stop. Returning at the signal's stop instead left the
/// interrupt's stop queued, and CRIU's parasite then failed on an "unexpected task
/// interruption".
fn wait_stopped(tid: Pid) -> io::Result<()> {
    loop {
        let mut status = 0;
        // SAFETY: plain waitpid on a traced thread.
        let rc = unsafe { libc::waitpid(tid, &mut status, libc::__WALL) };
        if rc == -1 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if libc::WIFSTOPPED(status) {
            let sig = libc::WSTOPSIG(status);
            if status >> 16 == libc::PTRACE_EVENT_STOP || sig == libc::SIGSTOP {
                return Ok(());
            }
            crate::criu::log(
                crate::criu::Level::Warn,
                &format!(
                    "restore thread {tid} stopped by signal {sig} before the interrupt; requeued"
                ),
            );
            // SAFETY: restarting a thread we trace from its signal-delivery-stop; our
            // interrupt is still pending and stops it right after.
            unsafe {
                check(
                    "PTRACE_CONT",
                    tid,
                    libc::ptrace(libc::PTRACE_CONT, tid, 0, sig as libc::c_long),
                )?;
            }
            continue;
        }
        if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
            return Err(io::Error::other(format!(
                "restore thread {tid} exited while running"
            )));
        }
    }
}
