#![doc = include_str!("../README.md")]

pub mod alloc;
pub mod control;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod driver;
#[cfg(any(test, feature = "fake"))]
pub mod fake;
pub mod fastpath;
pub mod gate;
pub mod helper;
pub mod hook;
pub mod prepared;
pub mod protocol;
pub mod snapshot;
