//! The freeze gate: every intercepted call that starts GPU work (launch, allocation,
//! copy) holds a [`GateGuard`] from [`Gate::enter`] while it runs. [`Gate::freeze`]
//! stops new work and waits until the work in flight has left; [`Gate::thaw`] lets the
//! blocked callers go on.
//!
//! A thread that already holds a guard may enter again without blocking (a hooked call
//! that makes another hooked call), and only its outermost guard counts as in flight,
//! so a freeze never waits on a thread that is itself waiting at the gate.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
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

/// The freeze gate. See the module docs.
///
/// Fast path: `enter` is one atomic increment and two atomic loads while running, no
/// lock (the gate sits in front of every kernel launch). Protocol (all `SeqCst`): an
/// entering thread increments `in_flight` and then re-reads `state`, backing out if it
/// is no longer Running; a freezer stores Freezing and then reads `in_flight`. One of
/// the two always sees the other's write, so no work slips past a freeze.
///
/// Lock invariant: `state` is written only while `lock` is held; `cond` is notified
/// under `lock` on every state change and when `in_flight` drops to zero while not
/// running, so a waiter that checked under `lock` cannot miss the wakeup. The lock is
/// never held across GPU work or driver calls.
#[derive(Debug)]
pub struct Gate {
    state: AtomicU8,
    /// Outermost guards alive (and, briefly, entries backing out).
    in_flight: AtomicUsize,
    lock: Mutex<()>,
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

impl GateState {
    const ALL: [GateState; 4] = [
        GateState::Running,
        GateState::Freezing,
        GateState::Frozen,
        GateState::Thawing,
    ];

    fn from_u8(v: u8) -> GateState {
        GateState::ALL[v as usize]
    }
}

impl Gate {
    pub fn new() -> Gate {
        Gate {
            state: AtomicU8::new(GateState::Running as u8),
            in_flight: AtomicUsize::new(0),
            lock: Mutex::new(()),
            cond: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait<'a>(&self, guard: MutexGuard<'a, ()>) -> MutexGuard<'a, ()> {
        self.cond.wait(guard).unwrap_or_else(|p| p.into_inner())
    }

    /// Applies `event`; the caller holds `lock`.
    fn transition(&self, _held: &MutexGuard<'_, ()>, event: GateEvent) -> Result<(), GateError> {
        let next = self.state().on(event)?;
        self.state.store(next as u8, Ordering::SeqCst);
        Ok(())
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
        GateState::from_u8(self.state.load(Ordering::SeqCst))
    }

    /// Calls in flight now (plus, for an instant, callers backing out of a closed gate).
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Waits until the gate is running, then lets the caller's work in.
    pub fn enter(&self) -> GateGuard<'_> {
        let depth = self.depth();
        if depth == 0 {
            loop {
                if self.state() == GateState::Running {
                    self.in_flight.fetch_add(1, Ordering::SeqCst);
                    if self.state() == GateState::Running {
                        break;
                    }
                    self.leave();
                }
                let mut held = self.lock();
                while self.state() != GateState::Running {
                    held = self.wait(held);
                }
            }
        }
        self.set_depth(depth + 1);
        GateGuard { gate: self }
    }

    /// Drops one unit of work in flight, waking a freezer when it was the last.
    fn leave(&self) {
        let was = self.in_flight.fetch_sub(1, Ordering::SeqCst);
        if was == 1 && self.state() != GateState::Running {
            let _held = self.lock();
            self.cond.notify_all();
        }
    }

    /// Stops new work and waits up to `timeout` for the work in flight to leave. On
    /// timeout the gate runs again and the error says how much work was still inside.
    pub fn freeze(&self, timeout: Duration) -> Result<(), GateError> {
        if self.depth() > 0 {
            return Err(GateError::FromInsideGate);
        }
        let start = Instant::now();
        let mut held = self.lock();
        self.transition(&held, GateEvent::Freeze)?;
        while self.in_flight() > 0 {
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                let in_flight = self.in_flight();
                self.transition(&held, GateEvent::Abort)?;
                self.cond.notify_all();
                return Err(GateError::Timeout {
                    waited: start.elapsed(),
                    in_flight,
                });
            }
            held = self
                .cond
                .wait_timeout(held, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        self.transition(&held, GateEvent::Drained)?;
        tracing::debug!(waited = ?start.elapsed(), "gate frozen");
        Ok(())
    }

    /// Lets new work in again.
    pub fn thaw(&self) -> Result<(), GateError> {
        let held = self.lock();
        self.transition(&held, GateEvent::Thaw)?;
        self.cond.notify_all();
        self.transition(&held, GateEvent::Thawed)?;
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
            self.gate.leave();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
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
    fn many_threads_never_pass_a_frozen_gate() {
        let gate = Gate::new();
        let stop = AtomicBool::new(false);
        let inside_while_frozen = AtomicBool::new(false);
        thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    while !stop.load(Ordering::SeqCst) {
                        let _guard = gate.enter();
                        if gate.state() == GateState::Frozen {
                            inside_while_frozen.store(true, Ordering::SeqCst);
                        }
                    }
                });
            }
            let mut result = Ok(());
            for _ in 0..200 {
                result = gate.freeze(LONG).and_then(|()| gate.thaw());
                if result.is_err() {
                    break;
                }
            }
            // Never panic before `stop`: the workers would keep the scope open forever.
            stop.store(true, Ordering::SeqCst);
            result.unwrap();
        });
        assert!(!inside_while_frozen.load(Ordering::SeqCst));
    }

    /// `cargo test -p gpucr-hook --release -- --ignored --nocapture gate_overhead`
    #[test]
    #[ignore = "timing, not a check"]
    fn gate_overhead() {
        let gate = Gate::new();
        let n = 10_000_000u32;
        let start = Instant::now();
        for _ in 0..n {
            drop(std::hint::black_box(gate.enter()));
        }
        println!("enter+drop: {:?} each", start.elapsed() / n);
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
