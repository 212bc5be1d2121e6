#![doc = include_str!("../README.md")]

pub mod driver;
pub mod error;
pub mod image;
pub mod inventory;
pub mod process;

pub use driver::{CheckpointApi, CudaDriver, GpuPair, GpuUuid, ProcessState, Step};
pub use error::{DiscoveryError, DriverError, RecordError};
pub use image::{ImageError, ImageOptions, ImageReader, ImageWriter};
pub use inventory::{check_compatibility, CompatibilityError, Inventory};
pub use process::{
    GpuCheckpointRecord, GpuProcess, GpuProcessSet, OrchestrationError, ProcessSource,
    StepTimeouts, RECORD_FILE_NAME,
};
