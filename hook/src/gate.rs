//! The freeze gate: every intercepted call that starts GPU work (launch, allocation,
//! copy) holds a [`GateGuard`] from [`Gate::enter`] while it runs. [`Gate::freeze`]
//! stops new work and waits until the work in flight has left; [`Gate::thaw`] lets the
//! blocked callers go on.
//!
//! A thread that already holds a guard may enter again without blocking (a hooked call
//! that makes another hooked call), and only its outermost guard counts as in flight,
//! so a freeze never waits on a thread that is itself waiting at the gate.

use std::cell::RefCell;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Where the gate is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GateState {
    /// New work passes.
    Running,
    /// New work waits; work in flight is draining.
    Freezing,
    /// No work in flight, new work waits.
    Frozen,
    /// Waking the waiters (transient, inside [`Gate::thaw`]).
    Thawing,
}

/// What moves the gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateEvent {
    Freeze,
    /// The last work in flight left.
    Drained,
    /// The freeze gave up (timeout).
    Abort,
    Thaw,
    /// The waiters were woken.
    Thawed,
}

/// Gate errors.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum GateError {
    #[error("gate cannot {event:?} while {from:?}")]
    InvalidTransition { from: GateState, event: GateEvent },
    #[error(
        "freeze timed out after {waited:?} with {in_flight} calls in flight; gate running again"
    )]
    Timeout { waited: Duration, in_flight: usize },
    #[error("freeze called from a thread inside the gate would wait for itself")]
    FromInsideGate,
}

impl GateState {
    /// The state after `event`, or the error for an illegal one.
    pub fn on(self, event: GateEvent) -> Result<GateState, GateError> {
        use GateEvent as E;
        use GateState as S;
        match (self, event) {
            (S::Running, E::Freeze) => Ok(S::Freezing),
            (S::Freezing, E::Drained) => Ok(S::Frozen),
            (S::Freezing, E::Abort) => Ok(S::Running),
            (S::Frozen, E::Thaw) => Ok(S::Thawing),
            (S::Thawing, E::Thawed) => Ok(S::Running),
            (from, event) => Err(GateError::InvalidTransition { from, event }),
        }
    }
}

#[derive(Debug)]
struct Inner {
    state: GateState,
    /// Outermost guards alive.
    in_flight: usize,
}

/// The freeze gate. See the module docs.
///
/// Lock invariant: `inner` is held only for bookkeeping, never across GPU work or
/// driver calls; `cond` is notified on every state change and when `in_flight` drops
/// to zero.
#[derive(Debug)]
pub struct Gate {
    inner: Mutex<Inner>,
    cond: Condvar,
}

thread_local! {
    /// (gate address, nesting depth) for every gate this thread is inside.
    static DEPTH: RefCell<Vec<(usize, u32)>> = const { RefCell::new(Vec::new()) };
}

impl Default for Gate {
    fn default() -> Self {
        Gate::new()
    }
}

impl Gate {
    pub fn new() -> Gate {
        Gate {
            inner: Mutex::new(Inner {
                state: GateState::Running,
                in_flight: 0,
            }),
            cond: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn key(&self) -> usize {
        self as *const Gate as usize
    }

    /// This thread's nesting depth in this gate.
    fn depth(&self) -> u32 {
        let key = self.key();
        DEPTH.with(|d| {
            d.borrow()
                .iter()
                .find(|(k, _)| *k == key)
                .map_or(0, |(_, n)| *n)
        })
    }

    fn set_depth(&self, depth: u32) {
        let key = self.key();
        DEPTH.with(|d| {
            let mut d = d.borrow_mut();
            d.retain(|(k, _)| *k != key);
            if depth > 0 {
                d.push((key, depth));
            }
        });
    }

    /// The current state.
    pub fn state(&self) -> GateState {
        self.lock().state
    }

    /// Calls in flight now.
    pub fn in_flight(&self) -> usize {
        self.lock().in_flight
    }

    /// Waits until the gate is running, then lets the caller's work in.
    pub fn enter(&self) -> GateGuard<'_> {
        let depth = self.depth();
        if depth == 0 {
            let mut inner = self.lock();
            while inner.state != GateState::Running {
                inner = self.cond.wait(inner).unwrap_or_else(|p| p.into_inner());
            }
            inner.in_flight += 1;
        }
        self.set_depth(depth + 1);
        GateGuard { gate: self }
    }

    /// Stops new work and waits up to `timeout` for the work in flight to leave. On
    /// timeout the gate runs again and the error says how much work was still inside.
    pub fn freeze(&self, timeout: Duration) -> Result<(), GateError> {
        if self.depth() > 0 {
            return Err(GateError::FromInsideGate);
        }
        let start = Instant::now();
        let mut inner = self.lock();
        inner.state = inner.state.on(GateEvent::Freeze)?;
        while inner.in_flight > 0 {
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                let in_flight = inner.in_flight;
                inner.state = inner.state.on(GateEvent::Abort)?;
                self.cond.notify_all();
                return Err(GateError::Timeout {
                    waited: start.elapsed(),
                    in_flight,
                });
            }
            inner = self
                .cond
                .wait_timeout(inner, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        inner.state = inner.state.on(GateEvent::Drained)?;
        tracing::debug!(waited = ?start.elapsed(), "gate frozen");
        Ok(())
    }

    /// Lets new work in again.
    pub fn thaw(&self) -> Result<(), GateError> {
        let mut inner = self.lock();
        inner.state = inner.state.on(GateEvent::Thaw)?;
        self.cond.notify_all();
        inner.state = inner.state.on(GateEvent::Thawed)?;
        Ok(())
    }
}

/// Work in flight; leaving the gate when dropped.
#[must_use = "the work is only gated while the guard lives"]
#[derive(Debug)]
pub struct GateGuard<'g> {
    gate: &'g Gate,
}

impl Drop for GateGuard<'_> {
    fn drop(&mut self) {
        let depth = self.gate.depth().saturating_sub(1);
        self.gate.set_depth(depth);
        if depth == 0 {
            let mut inner = self.gate.lock();
            inner.in_flight -= 1;
            if inner.in_flight == 0 {
                self.gate.cond.notify_all();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{mpsc, Arc};
    use std::thread;

    const LONG: Duration = Duration::from_secs(10);

    #[test]
    fn transition_table() {
        use GateEvent as E;
        use GateState as S;
        let states = [S::Running, S::Freezing, S::Frozen, S::Thawing];
        let events = [E::Freeze, E::Drained, E::Abort, E::Thaw, E::Thawed];
        let legal = [
            (S::Running, E::Freeze, S::Freezing),
            (S::Freezing, E::Drained, S::Frozen),
            (S::Freezing, E::Abort, S::Running),
            (S::Frozen, E::Thaw, S::Thawing),
            (S::Thawing, E::Thawed, S::Running),
        ];
        for from in states {
            for event in events {
                let want = legal
                    .iter()
                    .find(|(f, e, _)| *f == from && *e == event)
                    .map(|(_, _, to)| *to);
                match want {
                    Some(to) => assert_eq!(from.on(event), Ok(to)),
                    None => assert_eq!(
                        from.on(event),
                        Err(GateError::InvalidTransition { from, event })
                    ),
                }
            }
        }
    }

    #[test]
    fn freeze_and_thaw_when_idle() {
        let gate = Gate::new();
        gate.freeze(LONG).unwrap();
        assert_eq!(gate.state(), GateState::Frozen);
        assert!(matches!(
            gate.freeze(LONG),
            Err(GateError::InvalidTransition { .. })
        ));
        gate.thaw().unwrap();
        assert_eq!(gate.state(), GateState::Running);
        assert!(gate.thaw().is_err(), "thaw while running");
        drop(gate.enter());
    }

    #[test]
    fn freeze_waits_for_work_in_flight() {
        let gate = Arc::new(Gate::new());
        let (inside_tx, inside_rx) = mpsc::channel();
        let (leave_tx, leave_rx) = mpsc::channel::<()>();
        let worker = {
            let gate = gate.clone();
            thread::spawn(move || {
                let _guard = gate.enter();
                inside_tx.send(()).unwrap();
                leave_rx.recv().unwrap();
            })
        };
        inside_rx.recv().unwrap();
        let freezer = {
            let gate = gate.clone();
            thread::spawn(move || gate.freeze(LONG))
        };
        while gate.state() != GateState::Freezing {
            thread::yield_now();
        }
        assert_eq!(gate.in_flight(), 1);
        leave_tx.send(()).unwrap();
        freezer.join().unwrap().unwrap();
        worker.join().unwrap();
        assert_eq!(gate.state(), GateState::Frozen);
        assert_eq!(gate.in_flight(), 0);
    }

    #[test]
    fn new_work_blocks_until_thaw() {
        let gate = Arc::new(Gate::new());
        gate.freeze(LONG).unwrap();
        let passed = Arc::new(AtomicBool::new(false));
        let worker = {
            let (gate, passed) = (gate.clone(), passed.clone());
            thread::spawn(move || {
                let _guard = gate.enter();
                passed.store(true, Ordering::SeqCst);
            })
        };
        thread::sleep(Duration::from_millis(50));
        assert!(!passed.load(Ordering::SeqCst), "work passed a frozen gate");
        gate.thaw().unwrap();
        worker.join().unwrap();
        assert!(passed.load(Ordering::SeqCst));
    }

    #[test]
    fn freeze_timeout_rolls_back_to_running() {
        let gate = Gate::new();
        let (tx, rx) = mpsc::channel::<()>();
        let (in_tx, in_rx) = mpsc::channel();
        thread::scope(|s| {
            let gate = &gate;
            s.spawn(move || {
                let _guard = gate.enter();
                in_tx.send(()).unwrap();
                rx.recv().unwrap();
            });
            in_rx.recv().unwrap();
            let err = gate.freeze(Duration::from_millis(30)).unwrap_err();
            assert!(matches!(err, GateError::Timeout { in_flight: 1, .. }));
            assert_eq!(gate.state(), GateState::Running);
            tx.send(()).unwrap();
        });
        gate.freeze(LONG).unwrap();
    }

    #[test]
    fn nested_entry_does_not_deadlock_a_freeze() {
        let gate = Arc::new(Gate::new());
        let (in_tx, in_rx) = mpsc::channel();
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let worker = {
            let gate = gate.clone();
            thread::spawn(move || {
                let outer = gate.enter();
                in_tx.send(()).unwrap();
                go_rx.recv().unwrap();
                // The gate is freezing now; a nested call must still pass.
                let inner = gate.enter();
                drop(inner);
                drop(outer);
            })
        };
        in_rx.recv().unwrap();
        let freezer = {
            let gate = gate.clone();
            thread::spawn(move || gate.freeze(LONG))
        };
        while gate.state() != GateState::Freezing {
            thread::yield_now();
        }
        go_tx.send(()).unwrap();
        freezer.join().unwrap().unwrap();
        worker.join().unwrap();
        assert_eq!(gate.in_flight(), 0);
    }

    #[test]
    fn freeze_from_inside_is_refused() {
        let gate = Gate::new();
        let guard = gate.enter();
        assert_eq!(gate.freeze(LONG), Err(GateError::FromInsideGate));
        assert_eq!(gate.state(), GateState::Running);
        drop(guard);
    }
}
