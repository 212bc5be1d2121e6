//! Processes of a container: the init process and exec processes, each with an explicit
//! state machine (`state`) and an exit cell that Wait and the exit handler share.

pub mod exec;
pub mod init;
pub mod state;

use std::time::SystemTime;

use tokio::sync::watch;

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitInfo {
    pub status: u32,
    pub at: SystemTime,
}

/// Set once when the process exits; Wait calls await it without taking any process lock.
pub struct ExitCell(watch::Sender<Option<ExitInfo>>);

impl Default for ExitCell {
    fn default() -> Self {
        ExitCell(watch::channel(None).0)
    }
}

impl ExitCell {
    /// Records the exit; a second exit for the same process is ignored (reported once).
    pub fn set(&self, info: ExitInfo) -> bool {
        self.0.send_if_modified(|v| {
            if v.is_none() {
                *v = Some(info);
                true
            } else {
                false
            }
        })
    }

    pub fn get(&self) -> Option<ExitInfo> {
        *self.0.borrow()
    }

    pub async fn wait(&self) -> ExitInfo {
        let mut rx = self.0.subscribe();
        loop {
            if let Some(info) = *rx.borrow_and_update() {
                return info;
            }
            if rx.changed().await.is_err() {
                // The sender lives as long as the process: not reachable while we hold &self.
                continue;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn exit_is_reported_once_and_wakes_waiters() {
        let cell = std::sync::Arc::new(ExitCell::default());
        let c = cell.clone();
        let waiter = tokio::spawn(async move { c.wait().await });
        let first = ExitInfo {
            status: 3,
            at: SystemTime::now(),
        };
        assert!(cell.set(first));
        assert!(!cell.set(ExitInfo {
            status: 9,
            at: SystemTime::now()
        }));
        assert_eq!(waiter.await.unwrap(), first);
        assert_eq!(cell.get(), Some(first));
    }
}
