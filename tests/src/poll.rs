//! Polling for a condition with a deadline.

use std::fmt::Debug;
use std::thread;
use std::time::{Duration, Instant};

use crate::error::{HarnessError, Result};

/// How often [`poll_until`] checks.
pub const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// Calls `probe` every [`POLL_INTERVAL`] until it returns `Ok(Some(value))` or `timeout`
/// passes. `Ok(None)` and errors both mean "not yet"; the last one is reported on timeout.
pub fn poll_until<T, O: Debug>(
    what: &str,
    timeout: Duration,
    mut probe: impl FnMut() -> Result<std::result::Result<T, O>>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        let last = match probe() {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(observed)) => format!("{observed:?}"),
            Err(error) => format!("error: {error}"),
        };
        if Instant::now() >= deadline {
            return Err(HarnessError::PollTimeout {
                what: what.to_owned(),
                timeout,
                last,
            });
        }
        thread::sleep(POLL_INTERVAL);
    }
}
