//! Restore anywhere, on a CPU machine: a container whose "GPU" is a CDI device (a character
//! device node, a driver-library bind mount and an env entry, described by a CDI spec) is
//! checkpointed, the CDI spec then changes as it would on another node (another device node,
//! another driver directory), and the restored container sees the target's device and mount
//! while its in-memory counter goes on.

use std::{path::Path, time::Instant};

use gpucr_tests::{counter_args, unique_id, Containerd, GPUCR_RUNTIME};

const ANNOTATION: &str = "cdi.k8s.io/gpucr-test=gpucr.test/gpu=gpu0";

fn write_cdi_spec(dir: &Path, device_host_path: &str, driver_dir: &Path, tag: &str) {
    let spec = serde_json::json!({
        "cdiVersion": "0.6.0",
        "kind": "gpucr.test/gpu",
        "devices": [{
            "name": "gpu0",
            "containerEdits": {
                "deviceNodes": [{ "path": "/dev/gpucr-gpu0", "hostPath": device_host_path }],
                "mounts": [{
                    "hostPath": driver_dir.to_str().unwrap(),
                    "containerPath": "/usr/lib/gpucr-driver",
                    "options": ["ro", "rbind"]
                }],
                "env": [format!("GPUCR_GPU=gpu0-{tag}")]
            }
        }]
    });
    std::fs::write(
        dir.join("gpucr-test.json"),
        serde_json::to_vec_pretty(&spec).unwrap(),
    )
    .unwrap();
}

fn driver_dir(root: &Path, version: &str) -> std::path::PathBuf {
    let d = root.join(format!("driver-{version}"));
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("version"), version).unwrap();
    d
}

/// `major:minor` (hex, as busybox stat prints them) of a device node inside the container.
fn device_numbers(ctd: &Containerd, id: &str) -> String {
    ctd.exec(id, &["stat", "-c", "%t:%T", "/dev/gpucr-gpu0"])
        .unwrap()
        .check()
        .unwrap()
        .stdout
        .trim()
        .to_owned()
}

fn driver_version(ctd: &Containerd, id: &str) -> String {
    ctd.exec(id, &["cat", "/usr/lib/gpucr-driver/version"])
        .unwrap()
        .check()
        .unwrap()
        .stdout
        .trim()
        .to_owned()
}

#[test]
fn restore_follows_the_target_cdi_spec() {
    if gpucr_tests::runtime_under_test() != GPUCR_RUNTIME {
        return; // CDI injection from annotations is gpucr's (ctr 1.7 does none)
    }
    let scratch = tempfile::tempdir().unwrap();
    let cdi_dir = scratch.path().join("cdi");
    std::fs::create_dir_all(&cdi_dir).unwrap();
    let v1 = driver_dir(scratch.path(), "v1");
    write_cdi_spec(&cdi_dir, "/dev/zero", &v1, "v1");

    let ctd = Containerd::start_with_env(&[("GPUCR_CDI_SPEC_DIRS", cdi_dir.as_os_str())])
        .expect("containerd");
    let image = ctd.import_busybox().unwrap();
    let id = unique_id("cdi");
    ctd.run_detached_with(&id, &image, &["--annotation", ANNOTATION], &counter_args())
        .unwrap();
    ctd.wait_status(&id, "RUNNING").unwrap();
    assert_eq!(
        device_numbers(&ctd, &id),
        "1:5",
        "/dev/zero stands in for the GPU"
    );
    assert_eq!(driver_version(&ctd, &id), "v1");
    let before = ctd.wait_counter_above(&id, 5).unwrap();

    let reference = format!("docker.io/gpucr/ckpt-{id}:1");
    ctd.container_checkpoint(&id, &reference, true)
        .expect("checkpoint");
    let after = ctd.read_counter(&id).unwrap();
    ctd.remove_container(&id).unwrap();

    // "Another node": another device node behind the same CDI name, the driver elsewhere.
    let v2 = driver_dir(scratch.path(), "v2");
    std::fs::remove_dir_all(&v1).unwrap();
    write_cdi_spec(&cdi_dir, "/dev/full", &v2, "v2");

    let restored_at = Instant::now();
    ctd.container_restore(&id, &reference, true)
        .expect("restore onto the changed CDI spec");
    ctd.wait_status(&id, "RUNNING").unwrap();
    assert_eq!(driver_version(&ctd, &id), "v2", "the target's driver mount");
    assert_eq!(
        device_numbers(&ctd, &id),
        "1:7",
        "the target's device (/dev/full)"
    );
    let restored = ctd.read_counter(&id).unwrap();
    assert!(
        restored >= before && restored <= after + 5 + restored_at.elapsed().as_secs() * 6,
        "counter went on from {before}..{after}: {restored}"
    );
    ctd.wait_counter_above(&id, restored).unwrap();
    ctd.remove_container(&id).unwrap();

    // A target without the device: refused before anything is created, naming it.
    std::fs::remove_file(cdi_dir.join("gpucr-test.json")).unwrap();
    let out = ctd
        .ctr(&["container", "restore", "--live", "--rw", &id, &reference])
        .unwrap();
    assert!(!out.success(), "restore without the CDI device must fail");
    assert!(
        out.stderr.contains("gpucr.test/gpu=gpu0"),
        "the refusal names the device: {}",
        out.stderr
    );
    assert!(
        ctd.task_status(&id).unwrap().is_none(),
        "no task left behind"
    );
}
