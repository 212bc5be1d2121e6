//! The control protocol's messages. Their framing ([`crate::control::wire`]): a frame is a 4-byte
//! big-endian length followed by that many bytes of JSON. A request is `{"verb": "Freeze"}`,
//! `{"verb": "CopyOut", "image_dir": "...", "parent": null}` and so on; a reply is `{"ok": {...}}`
//! or `{"error": {"kind": "...", "message": "..."}}`.
//!
//! **Directories by fd.** The hook lives in the container's mount namespace and cannot see the
//! shim's paths, so a request may carry open directory fds (SCM_RIGHTS with the frame's bytes, at
//! most [`MAX_FDS`](crate::control::wire::MAX_FDS)). Then its paths are relative, like `openat`:
//! CopyOut's `image_dir` is a new name inside the first fd and its `parent` is inside the second
//! (`.` for the fd itself); CopyIn's `image_dir` is inside the first fd. The hook reaches them as
//! `/proc/self/fd/<n>/...`, which works across mount namespaces. Fds given with CopyOut stay open
//! while the hook is CopiedOut (a Release that fails half-way refills from that image) and are
//! closed when it leaves that state; all other fds are closed after the verb. Requests without fds
//! use absolute paths.
//!
//! **Memory by fd.** `Release` with `keep` exports each allocation's physical memory as an fd
//! before releasing it; the reply lists their addresses in `held`, and the fds follow the reply
//! frame in batches (one byte `F` with at most [`FD_BATCH`](crate::control::wire::FD_BATCH) fds
//! each, as many batches as `held` needs). Whoever holds the fds keeps the memory on the GPU: the
//! shim, across the driver's checkpoint of a leave-running checkpoint. `Reattach` gives them back
//! the same way (the request frame, then the batches) and the hook maps them at their addresses
//! again: no copy-in.
//!
//! **Snapshot.** `Snapshot` (while Frozen) copies every allocation device to device into
//! one region of new memory, exports that region (the reply's `held` is its address, one
//! fd follows as after Release) and releases it and every allocation. `Reattach` with
//! that fd maps the snapshot again and refills new memory for every allocation from it,
//! device to device. After Thaw the workload runs while `WriteSnapshot` writes the image
//! from the snapshot (its directory like CopyOut's); `DropSnapshot` frees a snapshot that
//! will not be written. A leave-running checkpoint then pauses the workload only for the
//! driver's cycle and the dump.
//!
//! **Prepare.** `Prepare` (while Running, directories like CopyOut's) readies the CopyOut
//! that follows while the workload still runs: the image's data file is allocated on
//! tmpfs, mapped and registered for DMA, so the frozen CopyOut moves device memory
//! straight into it at the link's speed. Its fds are held until the CopyOut into the same
//! image (same directory, name and parent) uses it; any other verb but Freeze and Status
//! (or a CopyOut elsewhere, or changed allocations) drops it, and so does the close of the
//! connection that sent it. Refused, changing nothing,
//! where the image cannot take direct copies (not tmpfs, compression, pinning off).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::alloc::Unsupported;
use crate::gate::GateState;
use crate::helper::AheadJob;

/// A request on the control socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "verb", deny_unknown_fields)]
pub enum Request {
    /// Stop new GPU work, wait for the work in flight, synchronize the device.
    Freeze,
    /// Write every tracked allocation into a new image at `image_dir` (a delta of
    /// `parent` when given).
    CopyOut {
        image_dir: PathBuf,
        #[serde(default)]
        parent: Option<PathBuf>,
    },
    /// Release the physical memory of every allocation, keeping the VA ranges. With
    /// `keep`, the memory is exported first and its fds follow the reply (see the module
    /// docs): nothing is freed while they are held.
    Release {
        #[serde(default)]
        keep: bool,
    },
    /// Start the copy-in helpers now, ahead of the copy-in (their CUDA contexts take a
    /// while; sent before the driver's restore). With `image_dir` (the image the
    /// CopyIn will name) they also get their shares now and pin them ahead. With
    /// `helpers` (no image), the caller started the helpers and sent them these jobs:
    /// their sockets follow the frame in fd batches, one per job, and the hook uses them
    /// instead of its own. The state does not change.
    Warm {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        image_dir: Option<PathBuf>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        helpers: Vec<AheadJob>,
    },
    /// Create physical memory again at the same VAs.
    Remap,
    /// Map the memory kept since Release back at its addresses `held` (the reply's
    /// list; the fds follow this request in the same order): contents as at the release.
    Reattach { held: Vec<u64> },
    /// Fill every allocation from the image at `image_dir`.
    CopyIn { image_dir: PathBuf },
    /// Copy every allocation into a snapshot on the device, then release the snapshot
    /// (kept: its fd follows the reply) and every allocation. Refused (state unchanged)
    /// when the device has no room for the snapshot or it cannot be exported.
    Snapshot,
    /// Write the snapshot into a new image at `image_dir` (a delta of `parent` when
    /// given), as CopyOut would have written the memory at the freeze; then free it.
    WriteSnapshot {
        image_dir: PathBuf,
        #[serde(default)]
        parent: Option<PathBuf>,
    },
    /// Free a snapshot that will not be written (the checkpoint failed).
    DropSnapshot,
    /// Let GPU work go on.
    Thaw,
    /// Report the state; legal in every state.
    Status,
    /// Ready a CopyOut into `image_dir` (a delta of `parent` when given) while the
    /// workload runs: its data file allocated and registered for DMA (see the module docs).
    Prepare {
        image_dir: PathBuf,
        #[serde(default)]
        parent: Option<PathBuf>,
    },
}

/// The verbs [`Request`] knows, to tell an unknown verb from a malformed request.
pub const VERBS: [&str; 13] = [
    "Freeze",
    "CopyOut",
    "Release",
    "Remap",
    "Reattach",
    "CopyIn",
    "Thaw",
    "Status",
    "Snapshot",
    "WriteSnapshot",
    "DropSnapshot",
    "Prepare",
    "Warm",
];

impl Request {
    /// The request's verb.
    pub fn verb(&self) -> Verb {
        match self {
            Request::Freeze => Verb::Freeze,
            Request::CopyOut { .. } => Verb::CopyOut,
            Request::Release { .. } => Verb::Release,
            Request::Remap => Verb::Remap,
            Request::Reattach { .. } => Verb::Reattach,
            Request::CopyIn { .. } => Verb::CopyIn,
            Request::Thaw => Verb::Thaw,
            Request::Status => Verb::Status,
            Request::Snapshot => Verb::Snapshot,
            Request::WriteSnapshot { .. } => Verb::WriteSnapshot,
            Request::DropSnapshot => Verb::DropSnapshot,
            Request::Prepare { .. } => Verb::Prepare,
            Request::Warm { .. } => Verb::Warm,
        }
    }
}

/// A request's verb without its arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Verb {
    Freeze,
    CopyOut,
    Release,
    Remap,
    Reattach,
    CopyIn,
    Thaw,
    Status,
    Snapshot,
    WriteSnapshot,
    DropSnapshot,
    Prepare,
    Warm,
}

/// Where the hook is in the checkpoint sequence. Declaration order is the protocol
/// order: Running → Frozen → CopiedOut → Released → Remapped → CopiedIn → Running, or
/// Released → Reattached → Running when the memory was kept (fds held by the shim), or
/// Frozen → Snapshotted → SnapshotReattached → WritePending → Running with a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CheckpointState {
    Running,
    Frozen,
    CopiedOut,
    Released,
    Remapped,
    CopiedIn,
    /// The kept memory is mapped again: contents as at the release; Thaw is next.
    Reattached,
    /// The memory freed, a snapshot of it held by the shim (its fd). (A process
    /// restored from such a checkpoint wakes up here: Remap and CopyIn from the image.)
    Snapshotted,
    /// The memory back from the snapshot, still mapped for the write; Thaw is next.
    SnapshotReattached,
    /// Running, with a snapshot to write (WriteSnapshot) or drop (DropSnapshot).
    WritePending,
}

/// A reply on the control socket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reply {
    Ok(Outcome),
    Error(ErrorReply),
}

/// What a successful verb did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Outcome {
    Frozen,
    CopiedOut(CopyOutReport),
    Released(MemoryReport),
    Remapped(MemoryReport),
    Reattached(MemoryReport),
    CopiedIn(CopyInReport),
    Thawed,
    Status(HookStatus),
    Snapshotted(SnapshotReport),
    SnapshotWritten(CopyOutReport),
    SnapshotDropped,
    Prepared(PrepareReport),
    Warmed(WarmReport),
}

/// A Prepare's result: the data file's size (every chunk's place), the windows
/// registered and how long allocating and registering took.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PrepareReport {
    pub bytes: u64,
    pub windows: usize,
    pub allocate_seconds: f64,
    pub register_seconds: f64,
}

/// A snapshot's result: the release (its `held` is the snapshot's address), the
/// snapshot's size and how long the device-to-device copy took.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SnapshotReport {
    pub release: MemoryReport,
    pub snapshot_bytes: u64,
    pub copy_seconds: f64,
}

/// A copy-out's result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CopyOutReport {
    pub allocations: usize,
    /// Device bytes copied out.
    pub bytes: u64,
    /// Most staging memory in use at one time (the writer's buffers).
    pub peak_staging_bytes: u64,
    pub seconds: f64,
    /// Where the copying thread waited.
    #[serde(default)]
    pub profile: CopyProfile,
    /// Device bytes that crossed to the host: `bytes` less the chunks the GPU hash found
    /// all zero or stored by the parent image.
    #[serde(default)]
    pub copied_bytes: u64,
    /// Chunks found all zero on the GPU (never copied).
    #[serde(default)]
    pub zero_chunks: usize,
    /// Chunks found in the parent image on the GPU (never copied).
    #[serde(default)]
    pub parent_chunks: usize,
}

/// Seconds the thread that issues the copies spent waiting, by cause: it tells a copy
/// bound by the PCIe link (`dma_wait`) from one bound by the CPU side (`buffer_wait`:
/// no staging buffer free, the workers are behind; `verify_wait`: a chunk's check not
/// done yet) or by pinning (`register_wait`); `finish`: the writer draining, syncing
/// and writing the manifest after the last copy.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CopyProfile {
    pub dma_wait: f64,
    pub buffer_wait: f64,
    pub verify_wait: f64,
    pub register_wait: f64,
    pub finish: f64,
    /// Hashing every chunk on the GPU and resolving zero and parent chunks, before the
    /// first copy (0 without the device hash).
    pub device_hash: f64,
    /// Copy-out: making the image writer (its workers' files, the parent chain) and, in
    /// direct mode, the direct data file with all its pages (done by Prepare when
    /// prepared). Copy-in: opening and checking the image, mapping its data files and
    /// making the staging pool, before the first read.
    pub setup: f64,
    /// Copy-out after a Prepare: unregistering the data file's windows.
    #[serde(default)]
    pub unregister: f64,
}

/// A release's, remap's or reattach's result.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryReport {
    pub allocations: usize,
    /// Physical bytes released or created (granularity-rounded).
    pub bytes: u64,
    /// Release with `keep`: the addresses whose memory fds follow the reply, in order
    /// (empty: nothing kept, e.g. the driver cannot export; then Remap and CopyIn).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held: Vec<u64>,
}

/// A copy-in's result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CopyInReport {
    pub allocations: usize,
    pub bytes: u64,
    /// The staging buffer's size.
    pub staging_bytes: u64,
    pub seconds: f64,
    #[serde(default)]
    pub profile: CopyProfile,
    /// The image's data files were read through a mapping (tmpfs), not `read(2)`.
    #[serde(default)]
    pub mapped_reads: bool,
    /// The copy-in helpers that took a share (see [`crate::helper`]).
    #[serde(default)]
    pub helpers: Vec<HelperReport>,
}

/// One copy-in helper's part.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct HelperReport {
    pub pid: u32,
    /// Bytes it was given.
    pub bytes: u64,
    /// From its Go (the copy-in handing it the memory) to its reply.
    pub seconds: f64,
    /// Its context's start-up, from its spawn.
    pub init_s: f64,
    /// From its Go until the memory was imported and mapped.
    #[serde(default)]
    pub setup_s: f64,
    /// From its job until its last stretch was pinned.
    pub register_s: f64,
    /// From its job to its Go: how long it pinned ahead (0: the job came with the Go).
    #[serde(default)]
    pub ahead_s: f64,
    /// After its Go, waiting for stretches still being pinned.
    #[serde(default)]
    pub pin_wait_s: f64,
    /// Why it failed (its share was staged after the others).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// What Warm started.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct WarmReport {
    /// Copy-in helpers now starting (0: none configured, or they could not start).
    pub helpers: usize,
    /// Bytes of the image the helpers were given to pin ahead of the copy-in (0: no
    /// image named, or the copy-in will not use helpers for it).
    #[serde(default)]
    pub ahead_bytes: u64,
}

/// The hook's state, for the shim and tools.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HookStatus {
    pub pid: u32,
    pub state: CheckpointState,
    pub gate: GateState,
    pub allocations: usize,
    /// Application-visible bytes of all tracked allocations.
    pub bytes: u64,
    pub released: usize,
    /// Bytes of device memory a snapshot holds (WritePending), else 0.
    #[serde(default)]
    pub snapshot_bytes: u64,
    /// Memory the hook cannot move; when not empty the shim must use the driver path.
    pub unsupported: Vec<Unsupported>,
}

/// Why a request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorKind {
    /// Not JSON, or not a request object.
    BadRequest,
    /// A verb the hook does not know.
    UnknownVerb,
    /// A frame longer than [`MAX_FRAME`]; the connection is closed after the reply.
    FrameTooLarge,
    /// The verb is not legal in the current state; nothing changed.
    IllegalInState,
    /// The verb failed; the state did not change.
    Failed,
}

/// An error reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    pub kind: ErrorKind,
    pub message: String,
}

impl Reply {
    pub fn error(kind: ErrorKind, message: impl Into<String>) -> Reply {
        Reply::Error(ErrorReply {
            kind,
            message: message.into(),
        })
    }
}

/// Parses a request frame, telling malformed requests from unknown verbs.
pub fn parse_request(bytes: &[u8]) -> Result<Request, ErrorReply> {
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| ErrorReply {
        kind: ErrorKind::BadRequest,
        message: format!("request is not JSON: {e}"),
    })?;
    let verb = value.get("verb").and_then(|v| v.as_str());
    match verb {
        None => Err(ErrorReply {
            kind: ErrorKind::BadRequest,
            message: "request is not an object with a string \"verb\"".into(),
        }),
        Some(v) if !VERBS.contains(&v) => Err(ErrorReply {
            kind: ErrorKind::UnknownVerb,
            message: format!("unknown verb {v:?}; known: {}", VERBS.join(", ")),
        }),
        Some(v) => {
            let bad = |message: String| ErrorReply {
                kind: ErrorKind::BadRequest,
                message: format!("bad arguments for {v}: {message}"),
            };
            let req: Request =
                serde_json::from_value(value.clone()).map_err(|e| bad(e.to_string()))?;
            // serde ignores unknown fields of unit variants in an internally tagged enum.
            let known = serde_json::to_value(&req).map_err(|e| bad(e.to_string()))?;
            if let (Some(got), Some(known)) = (value.as_object(), known.as_object()) {
                if let Some(extra) = got.keys().find(|k| !known.contains_key(*k)) {
                    return Err(bad(format!("unknown field {extra:?}")));
                }
            }
            Ok(req)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_wire_format() {
        let req = Request::CopyOut {
            image_dir: "/ckpt/gpu".into(),
            parent: None,
        };
        let json = serde_json::to_string(&req).unwrap();
        assert_eq!(
            json,
            r#"{"verb":"CopyOut","image_dir":"/ckpt/gpu","parent":null}"#
        );
        assert_eq!(parse_request(json.as_bytes()).unwrap(), req);
        assert_eq!(
            parse_request(br#"{"verb":"CopyOut","image_dir":"/x"}"#).unwrap(),
            Request::CopyOut {
                image_dir: "/x".into(),
                parent: None
            }
        );
        assert_eq!(
            parse_request(br#"{"verb":"Status"}"#).unwrap(),
            Request::Status
        );
        // Warm without an image is the bare verb, as before.
        let warm = Request::Warm {
            image_dir: None,
            helpers: Vec::new(),
        };
        assert_eq!(serde_json::to_string(&warm).unwrap(), r#"{"verb":"Warm"}"#);
        assert_eq!(parse_request(br#"{"verb":"Warm"}"#).unwrap(), warm);
        let reply = Reply::Ok(Outcome::Thawed);
        assert_eq!(serde_json::to_string(&reply).unwrap(), r#"{"ok":"Thawed"}"#);
    }

    #[test]
    fn bad_requests_are_classified() {
        let kind = |b: &[u8]| parse_request(b).unwrap_err().kind;
        assert_eq!(kind(b"\xff\x00garbage"), ErrorKind::BadRequest);
        assert_eq!(kind(b"[1,2]"), ErrorKind::BadRequest);
        assert_eq!(kind(br#"{"verb":7}"#), ErrorKind::BadRequest);
        assert_eq!(kind(br#"{"verb":"Explode"}"#), ErrorKind::UnknownVerb);
        assert_eq!(kind(br#"{"verb":"CopyIn"}"#), ErrorKind::BadRequest);
        assert_eq!(kind(br#"{"verb":"Thaw","extra":1}"#), ErrorKind::BadRequest);
    }
}
