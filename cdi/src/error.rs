//! Errors of this crate: one enum, each variant names the file, device or mount at fault.

use std::fmt;
use std::path::PathBuf;

/// Everything that can go wrong while resolving CDI devices, recording a manifest or planning a restore.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read CDI spec directory {dir}: {source}")]
    ReadSpecDir {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A CDI spec file that does not parse or breaks the CDI rules (schema, version, names).
    #[error("invalid CDI spec {path}: {reason}")]
    InvalidSpec { path: PathBuf, reason: String },

    /// Two spec files of the same directory priority define the same device; CDI drops it.
    #[error("CDI device {name} is defined by both {first} and {second}")]
    ConflictingDevice {
        name: String,
        first: PathBuf,
        second: PathBuf,
    },

    #[error("invalid CDI device name {name:?}: {reason}")]
    InvalidDeviceName { name: String, reason: String },

    #[error("unknown CDI device {name}{}", broken_hint(.broken_specs))]
    UnknownDevice {
        name: String,
        /// Spec files that failed to load: the device may have been defined there.
        broken_specs: Vec<String>,
    },

    /// A CDI device node without major/minor whose host path cannot be inspected.
    #[error("CDI device node {path}: cannot stat host path {host_path}: {source}")]
    DeviceNodeStat {
        path: String,
        host_path: String,
        #[source]
        source: std::io::Error,
    },

    #[error("CDI device node {path}: host path {host_path} is not a device node or fifo")]
    NotADeviceNode { path: String, host_path: String },

    #[error("invalid CDI hook name {0:?}")]
    InvalidHookName(String),

    /// The OCI runtime spec (config.json) has an unexpected shape.
    #[error("invalid OCI runtime spec: {0}")]
    InvalidOciSpec(String),

    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{path}: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },

    #[error("{path}: host manifest version {found} is newer than supported version {supported}")]
    UnsupportedManifestVersion {
        path: PathBuf,
        found: u32,
        supported: u32,
    },

    /// The restore target cannot take the checkpoint; nothing was created.
    #[error("restore refused: {}", join_problems(.0))]
    RestoreRefused(Vec<RestoreProblem>),
}

/// One reason why a target host cannot take a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RestoreProblem {
    /// The bind mount's source does not exist on the target.
    MissingMountSource { destination: String, source: String },
    /// The checkpoint has a bind mount the restore spec lacks: CRIU would find no mapping for it.
    MountMissingInTarget { destination: String },
    /// A target CDI device could not be resolved or applied.
    UnresolvableDevice { name: String, reason: String },
    /// The number of requested CDI devices differs from the checkpoint's.
    DeviceCountMismatch {
        recorded: Vec<String>,
        target: Vec<String>,
    },
    /// The number of GPUs differs from the checkpoint's.
    GpuCountMismatch { recorded: usize, target: usize },
    /// A target CDI device carries no GPU UUID and none was given.
    TargetGpuUuidUnknown { device: String },
}

impl fmt::Display for RestoreProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MissingMountSource {
                destination,
                source,
            } => {
                write!(
                    f,
                    "mount {destination}: source {source} does not exist on this host"
                )
            }
            Self::MountMissingInTarget { destination } => write!(
                f,
                "mount {destination} was in the checkpoint but is not in the restore spec"
            ),
            Self::UnresolvableDevice { name, reason } => {
                write!(f, "CDI device {name} cannot be resolved here: {reason}")
            }
            Self::DeviceCountMismatch { recorded, target } => write!(
                f,
                "checkpoint had CDI devices [{}], restore asks for [{}]",
                recorded.join(", "),
                target.join(", ")
            ),
            Self::GpuCountMismatch { recorded, target } => {
                write!(f, "checkpoint had {recorded} GPU(s), target has {target}")
            }
            Self::TargetGpuUuidUnknown { device } => write!(
                f,
                "no GPU UUID known for target device {device} (name it by UUID or pass the UUIDs)"
            ),
        }
    }
}

fn join_problems(problems: &[RestoreProblem]) -> String {
    problems
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

fn broken_hint(broken: &[String]) -> String {
    if broken.is_empty() {
        String::new()
    } else {
        format!(" (spec files that failed to load: {})", broken.join("; "))
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
