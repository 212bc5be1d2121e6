//! A shim killed with SIGKILL is cleaned up through `delete`: containerd runs
//! `<shim> delete`, and `ctr task rm` / `ctr container rm` leave no process or mount behind.

use std::time::Duration;

use gpucr_tests::procfs::{is_alive, mounts_under, shim_pid, sigkill};
use gpucr_tests::{poll_until, setup, unique_id};

#[test]
fn killed_shim_is_cleaned_up_by_delete() {
    let (ctd, image) = setup();
    let id = unique_id("shim-kill");
    ctd.run_counter(&id, &image).unwrap();
    let init = ctd.task_pid(&id).unwrap() as i32;
    let address = ctd.address().to_string_lossy().into_owned();
    let shim = shim_pid(&address, &id)
        .unwrap_or_else(|| panic!("no shim process with -address {address} -id {id}"));
    let bundle = ctd.bundle(&id);
    assert!(
        !mounts_under(&bundle).is_empty(),
        "rootfs mounted under {}",
        bundle.display()
    );

    sigkill(shim).expect("kill -9 the shim");
    gpucr_tests::procfs::wait_gone("shim gone", shim, Duration::from_secs(10)).unwrap();

    // containerd notices the lost connection and runs the shim's delete action; then the
    // task is stopped or gone. `task rm` must succeed (or find nothing left to remove).
    poll_until("task not running", Duration::from_secs(30), || {
        Ok(match ctd.task_status(&id)? {
            Some(status) if status == "RUNNING" => Err(status),
            _ => Ok(()),
        })
    })
    .unwrap();
    let out = ctd.ctr(&["task", "rm", "-f", &id]).unwrap();
    assert!(
        out.success() || out.stderr.contains("not found"),
        "task rm after the shim died: {out:?}"
    );
    ctd.ctr_ok(&["container", "rm", &id])
        .expect("container rm after the shim died");

    // containerd cleans up after a dead shim asynchronously; give it a moment.
    poll_until(
        "container process and mounts gone",
        Duration::from_secs(15),
        || {
            let members = gpucr_tests::procfs::cgroup_members(ctd.namespace());
            let mounts = mounts_under(&bundle);
            Ok(
                if is_alive(init) || !members.is_empty() || !mounts.is_empty() {
                    Err((is_alive(init), members, mounts))
                } else {
                    Ok(())
                },
            )
        },
    )
    .unwrap();
    assert!(!bundle.exists(), "bundle {} left behind", bundle.display());
    assert_eq!(
        shim_pid(&address, &id),
        None,
        "a shim for {id} is still running"
    );
}
