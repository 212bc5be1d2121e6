#![doc = include_str!("../README.md")]

mod error;
mod manifest;
mod model;
mod oci;
mod registry;
mod restore;

#[cfg(test)]
mod tests;

pub use error::{Error, RestoreProblem, Result};
pub use manifest::{
    cdi_devices_from_annotations, BindMountRecord, DeviceNodeRecord, HostManifest, RecordOptions,
    RecordedCdiDevice, CDI_ANNOTATION_PREFIX, MANIFEST_FILE, MANIFEST_VERSION,
};
pub use model::{CdiDeviceEntry, CdiSpecFile, ContainerEdits, DeviceNode, Hook, Mount, NetDevice};
pub use oci::{
    apply_edits, bind_mounts, read_oci_spec, remove_edits, write_json_atomic, BindMount,
};
pub use registry::{
    is_gpu_uuid, parse_qualified_name, CdiRegistry, Resolved, ResolvedDevice, DEFAULT_SPEC_DIRS,
};
pub use restore::{
    plan_restore, plan_restore_bundle, ExtMount, GpuUuidPair, RestorePlan, RestoreTarget,
    RESTORE_ANNOTATION,
};
