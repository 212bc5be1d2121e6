//! Deadlines for the two steps that can run for minutes: `runc checkpoint` and `runc
//! restore` (CRIU under them). Past its deadline the step is killed with CRIU, and the
//! caller undoes what it did (the task is left running, the GPU given back).
//!
//! A step's deadline is the shortest of: the request's own (the ttrpc deadline containerd
//! forwards, e.g. CRI's timeout), the container's annotation, or — without an annotation —
//! a default that grows with the memory CRIU moves.

use std::{collections::HashMap, fmt, time::Duration};

use crate::error::{Error, Result};

/// Annotation: seconds `runc checkpoint` may take (CRIU's dump included).
pub const CHECKPOINT_ANNOTATION: &str = "io.gpucr.checkpoint-timeout-s";
/// Annotation: seconds `runc restore` may take (CRIU's restore included).
pub const RESTORE_ANNOTATION: &str = "io.gpucr.restore-timeout-s";

/// The default: this much for any container, plus [`PER_GIB`] for each GiB CRIU moves
/// (a 0.2 GB/s disk still finishes in time; 140 GiB get ~14 minutes).
const FLOOR: Duration = Duration::from_secs(120);
const PER_GIB: Duration = Duration::from_secs(5);
/// The share of the request's own deadline a step may use: the undo and the reply need
/// the rest.
const REQUEST_SHARE: f64 = 0.9;

/// The container's deadline annotations (absent: the memory-scaled default).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Deadlines {
    pub checkpoint: Option<Duration>,
    pub restore: Option<Duration>,
}

/// One step's deadline and where it came from, for the error and the log.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Deadline {
    pub after: Duration,
    pub source: Source,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Source {
    Request,
    Annotation(&'static str),
    /// The default for this many bytes; the annotation that sets more.
    Memory(u64, &'static str),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Request => write!(f, "the request's deadline"),
            Source::Annotation(a) => write!(f, "annotation {a}"),
            Source::Memory(b, a) => write!(
                f,
                "the default for {:.1} GiB (annotation {a} sets more)",
                *b as f64 / (1u64 << 30) as f64
            ),
        }
    }
}

fn seconds(annotations: &HashMap<String, String>, key: &str) -> Result<Option<Duration>> {
    let Some(v) = annotations.get(key) else {
        return Ok(None);
    };
    match v.trim().parse::<f64>() {
        Ok(s) if s > 0.0 && s.is_finite() => Ok(Some(Duration::from_secs_f64(s))),
        _ => Err(Error::invalid(format!(
            "{key}={v:?}: give a positive number of seconds"
        ))),
    }
}

impl Deadlines {
    pub fn from_annotations(annotations: &HashMap<String, String>) -> Result<Deadlines> {
        Ok(Deadlines {
            checkpoint: seconds(annotations, CHECKPOINT_ANNOTATION)?,
            restore: seconds(annotations, RESTORE_ANNOTATION)?,
        })
    }

    /// The checkpoint's deadline for a container of `bytes` of memory.
    pub fn checkpoint(&self, bytes: u64, request: Option<Duration>) -> Deadline {
        pick(self.checkpoint, CHECKPOINT_ANNOTATION, bytes, request)
    }

    /// The restore's deadline for an image of `bytes`.
    pub fn restore(&self, bytes: u64, request: Option<Duration>) -> Deadline {
        pick(self.restore, RESTORE_ANNOTATION, bytes, request)
    }
}

fn pick(
    annotated: Option<Duration>,
    annotation: &'static str,
    bytes: u64,
    request: Option<Duration>,
) -> Deadline {
    let own = match annotated {
        Some(after) => Deadline {
            after,
            source: Source::Annotation(annotation),
        },
        None => {
            let gib = bytes.div_ceil(1 << 30) as u32;
            Deadline {
                after: FLOOR + PER_GIB * gib,
                source: Source::Memory(bytes, annotation),
            }
        }
    };
    match request.map(|r| r.mul_f64(REQUEST_SHARE)) {
        Some(r) if r < own.after => Deadline {
            after: r,
            source: Source::Request,
        },
        _ => own,
    }
}

/// The ttrpc request's deadline (0: none).
pub fn request_timeout(timeout_nano: i64) -> Option<Duration> {
    (timeout_nano > 0).then(|| Duration::from_nanos(timeout_nano as u64))
}

/// Bytes of memory the processes `pids` hold (their RSS; shared pages count once per
/// process, which only makes the deadline longer).
pub fn resident_bytes(pids: &[i32]) -> u64 {
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/statm")).ok())
        .filter_map(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum::<u64>()
        * page_size()
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as u64
    } else {
        4096
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_grows_with_memory_and_the_request_caps_it() {
        let d = Deadlines::default();
        let small = d.checkpoint(100 << 20, None);
        assert_eq!(small.after, FLOOR + PER_GIB);
        let big = d.checkpoint(140 << 30, None);
        assert_eq!(big.after, FLOOR + PER_GIB * 140);
        assert_eq!(big.source, Source::Memory(140 << 30, CHECKPOINT_ANNOTATION));
        let capped = d.restore(140 << 30, Some(Duration::from_secs(60)));
        assert_eq!(capped.source, Source::Request);
        assert_eq!(capped.after, Duration::from_secs(54));
    }

    #[test]
    fn annotations_set_the_deadline_and_bad_values_are_refused() {
        let mut a = HashMap::new();
        a.insert(CHECKPOINT_ANNOTATION.to_string(), "2.5".to_string());
        let d = Deadlines::from_annotations(&a).unwrap();
        let c = d.checkpoint(1 << 40, None);
        assert_eq!(c.after, Duration::from_millis(2500));
        assert_eq!(c.source, Source::Annotation(CHECKPOINT_ANNOTATION));
        assert_eq!(d.restore, None);
        a.insert(RESTORE_ANNOTATION.to_string(), "soon".to_string());
        let e = Deadlines::from_annotations(&a).unwrap_err().to_string();
        assert!(e.contains(RESTORE_ANNOTATION), "{e}");
    }

    #[test]
    fn resident_bytes_counts_this_process() {
        assert!(resident_bytes(&[std::process::id() as i32]) > 0);
        assert_eq!(resident_bytes(&[]), 0);
    }
}
