//! The Task API over ttrpc, driven the way containerd 2.1's CRI drives a shim for a runtime
//! that is not `io.containerd.runc.v2`: `Checkpoint` with `CheckpointTaskRequest.path` and no
//! options at all, then a restore as `Create` with `checkpoint` set followed by `Start`.
//!
//! The shim is started by hand exactly as containerd starts it (`start` action in the bundle,
//! `TTRPC_ADDRESS` pointing at a real containerd for events), over a bundle made here (runc's
//! default spec, a busybox rootfs), so no ctr is involved.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use containerd_shim_protos::{
    api::*,
    shim::oci::CheckpointOptions,
    shim_sync::{Client, TaskClient},
    ttrpc::{context, Code},
};
use gpucr_tests::{shim_dir, Containerd, COUNTER_SCRIPT};
use protobuf::{well_known_types::any::Any, Message, MessageField};
use serde_json::Value;

const NAMESPACE_HEADER: &str = "containerd-namespace-ttrpc";

struct ShimUnderTest {
    client: TaskClient,
    namespace: String,
    id: String,
    bundle: PathBuf,
}

impl ShimUnderTest {
    fn ctx(&self) -> context::Context {
        let mut ctx = context::with_timeout(60_000_000_000);
        ctx.add(NAMESPACE_HEADER.to_owned(), self.namespace.clone());
        ctx
    }

    fn counter(&self) -> Option<u64> {
        std::fs::read_to_string(self.bundle.join("rootfs/tmp/counter"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Waits until the counter exceeds `above`; returns the value seen.
    fn counter_above(&self, above: u64) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(v) = self.counter().filter(|v| *v > above) {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "counter stuck at {:?} (wanted > {above})",
                self.counter()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn create(&self, checkpoint: Option<&Path>) -> containerd_shim_protos::ttrpc::Result<u32> {
        let req = CreateTaskRequest {
            id: self.id.clone(),
            bundle: self.bundle.to_string_lossy().into_owned(),
            checkpoint: checkpoint
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default(),
            ..Default::default()
        };
        self.client.create(self.ctx(), &req).map(|r| r.pid)
    }

    fn start(&self) -> u32 {
        let req = StartRequest {
            id: self.id.clone(),
            ..Default::default()
        };
        self.client.start(self.ctx(), &req).expect("Start").pid
    }

    fn status(&self) -> containerd_shim_protos::ttrpc::Result<Status> {
        let req = StateRequest {
            id: self.id.clone(),
            ..Default::default()
        };
        self.client
            .state(self.ctx(), &req)
            .map(|s| s.status.enum_value_or_default())
    }

    fn checkpoint(&self, path: &Path, options: Option<CheckpointOptions>) {
        let req = CheckpointTaskRequest {
            id: self.id.clone(),
            path: path.to_string_lossy().into_owned(),
            options: MessageField::from_option(options.map(|o| Any {
                type_url: "containerd.runc.v1.CheckpointOptions".into(),
                value: o.write_to_bytes().unwrap(),
                ..Default::default()
            })),
            ..Default::default()
        };
        self.client
            .checkpoint(self.ctx(), &req)
            .unwrap_or_else(|e| panic!("Checkpoint into {}: {e:?}", path.display()));
    }

    /// Kill (if running), Wait and Delete: what containerd does to stop a task.
    fn kill_and_delete(&self) -> u32 {
        let kill = KillRequest {
            id: self.id.clone(),
            signal: 9,
            ..Default::default()
        };
        // A task stopped by a checkpoint with `exit` has nothing left to kill.
        let _ = self.client.kill(self.ctx(), &kill);
        let wait = WaitRequest {
            id: self.id.clone(),
            ..Default::default()
        };
        let status = self
            .client
            .wait(self.ctx(), &wait)
            .expect("Wait")
            .exit_status;
        let del = DeleteRequest {
            id: self.id.clone(),
            ..Default::default()
        };
        self.client.delete(self.ctx(), &del).expect("Delete");
        status
    }
}

/// A bundle: runc's default spec running the counter, a busybox rootfs, host network (CRI
/// containers join a pod network namespace the shim does not own).
fn make_bundle(dir: &Path, id: &str) -> PathBuf {
    let bundle = dir.join(format!("bundle-{id}"));
    let bin = bundle.join("rootfs/bin");
    std::fs::create_dir_all(&bin).unwrap();
    for d in ["tmp", "proc", "sys", "dev"] {
        std::fs::create_dir_all(bundle.join("rootfs").join(d)).unwrap();
    }
    std::fs::copy("/bin/busybox", bin.join("busybox")).expect("busybox-static installed");
    for applet in ["sh", "sleep", "echo", "mv", "cat"] {
        std::os::unix::fs::symlink("busybox", bin.join(applet)).unwrap();
    }
    let st = Command::new("runc")
        .args(["spec", "--bundle"])
        .arg(&bundle)
        .status()
        .unwrap();
    assert!(st.success(), "runc spec");
    let path = bundle.join("config.json");
    let mut spec: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    spec["process"]["terminal"] = Value::Bool(false);
    spec["process"]["args"] = serde_json::json!(["sh", "-c", COUNTER_SCRIPT]);
    spec["root"]["readonly"] = Value::Bool(false);
    spec["annotations"] = serde_json::json!({ "io.kubernetes.cri.sandbox-id": id });
    let namespaces = spec["linux"]["namespaces"].as_array_mut().unwrap();
    namespaces.retain(|n| n["type"] != "network");
    std::fs::write(&path, serde_json::to_vec_pretty(&spec).unwrap()).unwrap();
    bundle
}

/// Starts the shim as containerd does and connects to it.
fn start_shim(ctd: &Containerd, id: &str, bundle: &Path) -> ShimUnderTest {
    let shim = shim_dir().unwrap().join("containerd-shim-gpucr-v2");
    let out = Command::new(&shim)
        .args(["-namespace", ctd.namespace(), "-id", id, "-address"])
        .arg(ctd.address())
        .args(["-publish-binary", "containerd", "start"])
        .current_dir(bundle)
        .env(
            "TTRPC_ADDRESS",
            format!("{}.ttrpc", ctd.address().display()),
        )
        .output()
        .unwrap();
    assert!(out.status.success(), "shim start: {out:?}");
    let address = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    assert!(address.starts_with("unix://"), "address {address:?}");
    let written = std::fs::read_to_string(bundle.join("address")).unwrap();
    assert_eq!(written.trim(), address, "the address file names the socket");
    ShimUnderTest {
        client: TaskClient::new(Client::connect(&address).unwrap()),
        namespace: ctd.namespace().to_owned(),
        id: id.to_owned(),
        bundle: bundle.to_path_buf(),
    }
}

fn is_not_found(e: &containerd_shim_protos::ttrpc::Error) -> bool {
    matches!(e, containerd_shim_protos::ttrpc::Error::RpcStatus(s) if s.code() == Code::NOT_FOUND)
}

#[test]
fn task_api_checkpoint_restore_like_cri() {
    let ctd = Containerd::start().expect("containerd");
    let id = format!("cri-{}", std::process::id());
    let bundle = make_bundle(ctd.dir(), &id);
    let shim = start_shim(&ctd, &id, &bundle);

    let pid = shim.create(None).expect("Create");
    assert!(pid > 0);
    assert_eq!(shim.status().unwrap(), Status::CREATED);
    shim.start();
    assert_eq!(shim.status().unwrap(), Status::RUNNING);
    let before = shim.counter_above(5);

    // containerd 2.1's CRI for a non-runc runtime: a path and no options.
    let image = ctd.dir().join("checkpoint");
    shim.checkpoint(&image, None);
    assert_eq!(
        shim.status().unwrap(),
        Status::RUNNING,
        "no options means leave running"
    );
    assert!(image.join("inventory.img").is_file(), "CRIU image written");
    assert!(
        image.join("gpucr-checkpoint.json").is_file(),
        "gpucr manifest"
    );
    for kept in ["dump.log", "stats-dump"] {
        assert!(
            bundle.join("criu-work").join(kept).is_file(),
            "{kept} kept in the work directory for CRI"
        );
    }
    let at_checkpoint = shim.counter_above(before);
    assert_eq!(shim.kill_and_delete(), 137);

    // A damaged image is refused at Create, and nothing is left behind.
    let damaged = ctd.dir().join("damaged");
    std::fs::create_dir_all(&damaged).unwrap();
    let mut biggest = (0, PathBuf::new());
    for e in std::fs::read_dir(&image).unwrap().flatten() {
        let to = damaged.join(e.file_name());
        std::fs::copy(e.path(), &to).unwrap();
        let len = e.metadata().unwrap().len();
        if len > biggest.0 {
            biggest = (len, to);
        }
    }
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&biggest.1)
        .unwrap();
    f.set_len(biggest.0 / 2).unwrap();
    let err = shim
        .create(Some(&damaged))
        .expect_err("damaged image refused");
    assert!(format!("{err:?}").contains("truncated"), "{err:?}");
    assert!(
        shim.status().is_err_and(|e| is_not_found(&e)),
        "no half-created task after a refused restore"
    );
    // Same size, one byte changed in every page (the silent data loss): refused,
    // naming the file and where.
    let name = biggest
        .1
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let mut data = std::fs::read(image.join(&name)).unwrap();
    for at in (0..data.len()).step_by(4096) {
        data[at] ^= 0x5a;
    }
    std::fs::write(&biggest.1, &data).unwrap();
    let err = format!(
        "{:?}",
        shim.create(Some(&damaged))
            .expect_err("damaged image refused")
    );
    assert!(
        err.contains(&name) && err.contains("damaged at byte offset 0"),
        "{err}"
    );
    assert!(
        shim.status().is_err_and(|e| is_not_found(&e)),
        "no half-created task after a refused restore"
    );
    let err = shim
        .create(Some(&ctd.dir().join("missing")))
        .expect_err("missing image refused");
    assert!(format!("{err:?}").contains("does not exist"), "{err:?}");

    // Restore: Create with the checkpoint (the rootfs is mounted by now), then Start.
    assert_eq!(
        shim.create(Some(&image)).expect("Create from checkpoint"),
        0
    );
    assert_eq!(shim.status().unwrap(), Status::CREATED);
    shim.start();
    assert_eq!(shim.status().unwrap(), Status::RUNNING);
    let restored = shim.counter_above(0);
    assert!(
        restored >= at_checkpoint.saturating_sub(3) && restored > 5,
        "counter went on from the checkpoint ({at_checkpoint}), not from 0: {restored}"
    );
    shim.counter_above(restored);

    // A second checkpoint of the restored task, now with options (exit, work path).
    let image2 = ctd.dir().join("checkpoint2");
    let work2 = ctd.dir().join("work2");
    let value2 = shim.counter_above(restored);
    shim.checkpoint(
        &image2,
        Some(CheckpointOptions {
            exit: true,
            work_path: work2.to_string_lossy().into_owned(),
            ..Default::default()
        }),
    );
    assert!(work2.join("dump.log").is_file(), "work path honoured");
    let wait = WaitRequest {
        id: id.clone(),
        ..Default::default()
    };
    shim.client
        .wait(shim.ctx(), &wait)
        .expect("exit stops the task");
    shim.kill_and_delete();
    assert_eq!(shim.create(Some(&image2)).expect("Create again"), 0);
    shim.start();
    let again = shim.counter_above(0);
    assert!(
        again >= value2 && again <= value2 + 10,
        "second restore goes on from {value2}: {again}"
    );

    // Connect, Pids and Stats answer for the restored task.
    let conn = shim
        .client
        .connect(
            shim.ctx(),
            &ConnectRequest {
                id: id.clone(),
                ..Default::default()
            },
        )
        .unwrap();
    assert!(conn.shim_pid > 0 && conn.task_pid > 0);
    let pids = shim
        .client
        .pids(
            shim.ctx(),
            &PidsRequest {
                id: id.clone(),
                ..Default::default()
            },
        )
        .unwrap();
    assert!(pids.processes.iter().any(|p| p.pid == conn.task_pid));
    let stats = shim
        .client
        .stats(
            shim.ctx(),
            &StatsRequest {
                id: id.clone(),
                ..Default::default()
            },
        )
        .unwrap();
    assert!(stats.stats.type_url.starts_with("io.containerd.cgroups."));

    shim.kill_and_delete();
    shim.client
        .shutdown(
            shim.ctx(),
            &ShutdownRequest {
                id: id.clone(),
                ..Default::default()
            },
        )
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while gpucr_tests::procfs::is_alive(conn.shim_pid as i32) {
        assert!(Instant::now() < deadline, "shim exits after Shutdown");
        std::thread::sleep(Duration::from_millis(50));
    }
}
