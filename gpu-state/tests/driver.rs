//! CudaDriver loading and calling, against the fake libcuda and without any.

mod common;

use std::time::Duration;

use common::Fake;
use gpu_state::{CheckpointApi, CudaDriver, DriverError, ProcessState};

#[test]
fn missing_libcuda_is_no_driver() {
    let fake = Fake::new("");
    std::env::set_var("GPUCR_LIBCUDA", fake.dir.path().join("absent/libcuda.so.1"));
    assert!(CudaDriver::probe().unwrap().is_none());
    assert!(matches!(
        CudaDriver::load(),
        Err(DriverError::NoDriver { .. })
    ));
}

#[test]
fn library_without_the_api_is_an_error() {
    let _fake = Fake::new("");
    let libc = [
        "/lib/x86_64-linux-gnu/libc.so.6",
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
        "/lib64/libc.so.6",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists())
    .expect("libc");
    let err = CudaDriver::load_from(std::path::Path::new(libc)).unwrap_err();
    assert!(matches!(err, DriverError::MissingSymbol { .. }), "{err}");
    assert!(err.to_string().contains("r570"), "{err}");
}

#[test]
fn direct_calls_follow_the_driver_state_machine() {
    let fake = Fake::new("driver_version 12080\ncuda 555 tid=556\n");
    let d = CudaDriver::load().unwrap();
    assert_eq!(d.driver_version().unwrap(), 12080);
    assert!(!d.supports_gpu_pairs());
    assert_eq!(d.get_restore_thread_id(555).unwrap(), 556);
    assert!(d.get_restore_thread_id(556).is_err(), "not a CUDA process");
    assert_eq!(d.get_state(555).unwrap(), ProcessState::Running);
    d.lock(555, Some(Duration::from_secs(1))).unwrap();
    // Unlock-checkpoint-restore out of order is refused like the driver does.
    let err = d.restore(555, &[]).unwrap_err();
    assert_eq!(err.cuda_code().map(|c| c.0), Some(401), "{err}");
    assert!(
        err.to_string().contains("CUDA_ERROR_ILLEGAL_STATE"),
        "{err}"
    );
    d.checkpoint(555).unwrap();
    assert_eq!(d.get_state(555).unwrap(), ProcessState::Checkpointed);
    d.restore(555, &[]).unwrap();
    d.unlock(555).unwrap();
    assert_eq!(fake.state(555), ProcessState::Running);
}
