//! The hook's fast path through the shim, end to end on a CPU machine: a real containerd,
//! runc and CRIU; `libgpucr_hook.so` injected by the shim (`io.gpucr.hook=on`, there are no
//! `/dev/nvidia*` devices here) into a container running hook/preload/tests/cuda_app.c
//! ([`gpucr_tests::cuda_app`]), whose `libcuda.so.1` is tests/fake-libcuda. The program
//! allocates through `cuMemAlloc`, so through the hook's VMM backing.
//!
//! The shim's own libcuda (the checkpoint API) is the same fake on the host, scripted like
//! in gpu_fake.rs; the program is a CUDA process for the driver path only where a test's
//! script says so. Only meaningful for gpucr.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpucr_tests::cuda_app::{self, Step, APP_BYTES, HASH_FILE, MEM_LOG};
use gpucr_tests::fake_cuda::{self, FakeCuda};
use gpucr_tests::manifest::rewrite_with_manifest;
use gpucr_tests::shim_client::{CheckpointFlags, CheckpointOutcome};
use gpucr_tests::{procfs, runtime_under_test, unique_id, Containerd, GPUCR_RUNTIME};
use serde_json::Value;

const APP_IMAGE: &str = "docker.io/library/gpucr-cuda-app:test";
const WAIT: Duration = Duration::from_secs(30);

/// A daemon whose shims inject the hook and use a fake libcuda; the app image imported.
/// Fields drop in order: the daemon (and its shims) before the files they use.
struct Hooked {
    ctd: Containerd,
    fake: FakeCuda,
    hook_lib: PathBuf,
}

fn start() -> Option<Hooked> {
    start_with(&[])
}

/// [`start`] with more environment for the daemon and its shims.
fn start_with(extra: &[(String, String)]) -> Option<Hooked> {
    let runtime = runtime_under_test();
    if runtime != GPUCR_RUNTIME {
        eprintln!("skipped: the hook is gpucr's, the runtime under test is {runtime}");
        return None;
    }
    let fake = FakeCuda::new().expect("fake libcuda");
    // The installed library (the shim's default) and the installed CRIU plugin, which
    // leaves the shim's processes to the shim.
    let hook_lib = fake_cuda::hook_lib().expect("libgpucr_hook.so");
    let mut env = fake.env();
    env.extend_from_slice(extra);
    let ctd = Containerd::start_with_env(&env).expect("containerd");
    let layout = cuda_app::image(&fake.lib(), &hook_lib)
        .and_then(|image| image.layout_tar(APP_IMAGE))
        .expect("the app image");
    ctd.import_layout(&layout, &[])
        .expect("import the app image");
    Some(Hooked {
        ctd,
        fake,
        hook_lib,
    })
}

impl Hooked {
    /// Runs cuda_app with `io.gpucr.hook=<hook>` and waits until it checked its memory
    /// twice; returns the task's host pid and the memory's hash.
    fn run_app(&self, id: &str, hook: &str) -> (u32, String) {
        self.run_app_with(id, hook, &[])
    }

    /// [`Hooked::run_app`] with more `VAR=value` settings in the program's environment.
    fn run_app_with(&self, id: &str, hook: &str, env: &[&str]) -> (u32, String) {
        let annotation = format!("io.gpucr.hook={hook}");
        let app_env = cuda_app::env();
        let mut flags = vec!["--annotation", annotation.as_str()];
        for e in app_env
            .iter()
            .map(String::as_str)
            .chain(env.iter().copied())
        {
            flags.extend(["--env", e]);
        }
        self.ctd
            .run_detached_with(id, APP_IMAGE, &flags, &cuda_app::args())
            .expect("ctr run");
        self.ctd.wait_status(id, "RUNNING").unwrap();
        let first = self.wait_step_above(id, 1);
        assert!(
            first.verdict.starts_with("ok "),
            "{first:?}; log: {}",
            self.ctd.container_log(id)
        );
        (self.ctd.task_pid(id).unwrap(), first.verdict)
    }

    fn read_step(&self, id: &str) -> Option<Step> {
        Step::parse(&self.ctd.exec(id, &["cat", HASH_FILE]).ok()?.stdout)
    }

    /// Waits until the program checked its memory after step `n`.
    fn wait_step_above(&self, id: &str, n: u64) -> Step {
        gpucr_tests::poll_until(&format!("{id} past step {n}"), WAIT, || {
            Ok(match self.read_step(id) {
                Some(s) if s.n > n => Ok(s),
                other => Err(other),
            })
        })
        .unwrap_or_else(|e| panic!("{e}; log: {}", self.ctd.container_log(id)))
    }

    /// The program runs on with its memory as it was (`hash`).
    fn assert_memory_kept(&self, id: &str, hash: &str) {
        let now = self.read_step(id).map_or(0, |s| s.n);
        let next = self.wait_step_above(id, now);
        assert_eq!(
            next.verdict,
            hash,
            "memory of {id} after step {now}; mem log: {:#?}",
            self.mem_log(id)
        );
    }

    /// The fake driver's memory calls in the container (`<function> <args> -> <rc>`).
    fn mem_log(&self, id: &str) -> Vec<String> {
        self.ctd
            .exec(id, &["cat", MEM_LOG])
            .map(|o| o.stdout.lines().map(str::to_owned).collect())
            .unwrap_or_default()
    }

    fn count(&self, id: &str, function: &str) -> usize {
        let prefix = format!("{function} ");
        self.mem_log(id)
            .iter()
            .filter(|l| l.starts_with(&prefix))
            .count()
    }

    /// Asserts `function` succeeded `n` times in the container's fake driver log.
    fn assert_ok_calls(&self, id: &str, function: &str, n: usize) {
        assert_eq!(
            self.count_ok(id, function),
            n,
            "{function}: {:#?}",
            self.mem_log(id)
        );
    }

    /// Calls of `function` that succeeded (`-> 0`).
    fn count_ok(&self, id: &str, function: &str) -> usize {
        let prefix = format!("{function} ");
        self.mem_log(id)
            .iter()
            .filter(|l| l.starts_with(&prefix) && l.ends_with("-> 0"))
            .count()
    }

    fn config(&self, id: &str) -> Value {
        let path = self.ctd.bundle(id).join("config.json");
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
    }

    fn shim_log(&self) -> String {
        self.ctd.log_tail(400)
    }

    /// Restores `id` from the image directory `dir` and checks that the restored process
    /// got its device memory back from the hook's image, with the hash it had.
    fn restore_from_dir(&self, id: &str, dir: &Path, spec: &[u8], hash: &str) {
        self.ctd
            .restore_from_image_path(id, dir, APP_IMAGE, spec)
            .unwrap_or_else(|e| {
                panic!(
                    "restore from {}: {e}\nshim log: {}",
                    dir.display(),
                    self.shim_log()
                )
            });
        self.ctd.wait_status(id, "RUNNING").unwrap();
        self.assert_memory_kept(id, hash);
        assert!(
            self.shim_log()
                .contains("restored process's device memory copied in"),
            "{}",
            self.shim_log()
        );
    }
}

/// The mounts at the hook's two destinations: (destination, source).
fn hook_mounts(config: &Value) -> Vec<(String, String)> {
    config["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| {
            let dest = m["destination"].as_str()?;
            let source = m["source"].as_str()?;
            dest.starts_with("/.gpucr/")
                .then(|| (dest.to_owned(), source.to_owned()))
        })
        .collect()
}

fn env_of(config: &Value, key: &str) -> Option<String> {
    let prefix = format!("{key}=");
    config["process"]["env"]
        .as_array()?
        .iter()
        .filter_map(Value::as_str)
        .find_map(|e| e.strip_prefix(&prefix).map(str::to_owned))
}

/// Checks `gpucr-hook.json` (text) lists namespace pid 1 with all the program's bytes.
fn assert_hook_record(record: &[u8]) {
    let record: Value = serde_json::from_slice(record).unwrap();
    assert_eq!(record["injected"], true, "{record}");
    let processes = record["processes"].as_array().unwrap();
    assert_eq!(processes.len(), 1, "{record}");
    assert_eq!(processes[0]["ns_pid"], 1, "{record}");
    assert_eq!(processes[0]["allocations"], 2, "{record}");
    assert_eq!(
        processes[0]["kept"], 2,
        "leave-running keeps the memory: {record}"
    );
    let bytes = processes[0]["copy_out_bytes"].as_u64().unwrap();
    assert!(
        bytes >= APP_BYTES,
        "copied out {bytes} of {APP_BYTES}: {record}"
    );
    assert!(
        record["fallbacks"].as_array().unwrap().is_empty(),
        "{record}"
    );
}

#[test]
fn hook_moves_memory_across_checkpoints_and_a_restore() {
    let Some(g) = start() else {
        return;
    };
    let id = unique_id("hook-fast");
    let (_pid, hash) = g.run_app(&id, "on");

    // Injection: the library read-only, the socket directory, the environment, and the
    // program's hook serving in the bundle's socket directory (namespace pid 1).
    let config = g.config(&id);
    let sockets = g.ctd.bundle(&id).join("gpucr-hook");
    assert_eq!(
        hook_mounts(&config),
        [
            (
                "/.gpucr/lib/libgpucr_hook.so".to_owned(),
                g.hook_lib.to_string_lossy().into_owned()
            ),
            (
                "/.gpucr/run".to_owned(),
                sockets.to_string_lossy().into_owned()
            ),
        ]
    );
    assert_eq!(
        env_of(&config, "LD_PRELOAD").as_deref(),
        Some("/.gpucr/lib/libgpucr_hook.so")
    );
    assert_eq!(
        env_of(&config, "GPUCR_HOOK_SOCKET_DIR").as_deref(),
        Some("/.gpucr/run")
    );
    assert!(
        sockets.join("hook-1.sock").exists(),
        "no hook-1.sock in {}; log: {}",
        sockets.display(),
        g.ctd.container_log(&id)
    );
    // Both allocations are the hook's (VMM), none the driver's plain cuMemAlloc.
    assert_eq!(g.count(&id, "cuMemCreate"), 2, "{:#?}", g.mem_log(&id));
    assert_eq!(g.count(&id, "cuMemAlloc_v2"), 0, "{:#?}", g.mem_log(&id));

    // Leave-running checkpoint: the hook moved the memory into the image and got it back.
    let stored = g
        .ctd
        .task_checkpoint(&id, &[])
        .expect("ctr task checkpoint")
        .expect("checkpoint image stored");
    let files = g.ctd.checkpoint_files(&stored).unwrap();
    assert_hook_record(
        files
            .get("gpucr-hook.json")
            .unwrap_or_else(|| panic!("no gpucr-hook.json in {:?}", files.keys())),
    );
    // Folded flat (CRI carries no directories): the hook's image of ns pid 1 at the top.
    assert!(
        files.keys().any(|f| f.starts_with("gpu-hook.1.")),
        "no gpu-hook.1.* in {:?}",
        files.keys()
    );
    g.ctd.wait_status(&id, "RUNNING").unwrap();
    g.assert_memory_kept(&id, &hash);
    // Leave-running: the memory was released but kept (exported, its fds held by the
    // shim across the dump) and reattached, no copy-in; then, imported memory not being
    // exportable again, moved onto new memory with a device copy for the next keep.
    g.assert_ok_calls(&id, "cuMemExportToShareableHandle", 2);
    g.assert_ok_calls(&id, "cuMemImportFromShareableHandle", 2);
    g.assert_ok_calls(&id, "cuMemcpyDtoD_v2", 2);
    assert_eq!(g.count(&id, "cuMemCreate"), 4, "{:#?}", g.mem_log(&id));
    assert!(g.shim_log().contains("(no copy-in)"), "{}", g.shim_log());

    // A container checkpoint (ctr pauses the task around it), then a restore of it.
    // containerd 1.7 stores no CRIU tar while an identical spec blob is referenced: the
    // first image goes first.
    g.ctd.remove_image(&stored).unwrap();
    let reference = format!("docker.io/gpucr/hook-{id}:1");
    g.ctd
        .container_checkpoint(&id, &reference, true)
        .expect("ctr container checkpoint --task --rw");
    g.assert_memory_kept(&id, &hash);
    // Kept again (the reattached memory was made exportable again).
    assert_eq!(
        g.shim_log().matches("(no copy-in)").count(),
        2,
        "{}",
        g.shim_log()
    );
    g.ctd.remove_container(&id).unwrap();
    g.ctd
        .container_restore(&id, &reference, true)
        .unwrap_or_else(|e| panic!("restore: {e}\nshim log: {}", g.shim_log()));
    g.ctd.wait_status(&id, "RUNNING").unwrap();
    g.assert_memory_kept(&id, &hash);
    // The restored process got its memory back from the image (remap: two more
    // cuMemCreate in the restored log, which is the rw layer's copy plus what the
    // restored process wrote: 4 after the first checkpoint, then 2), and the shim said so.
    assert!(
        g.count(&id, "cuMemCreate") >= 6,
        "no remap after the restore: {:#?}",
        g.mem_log(&id)
    );
    assert!(
        g.shim_log()
            .contains("restored process's device memory copied in"),
        "{}",
        g.shim_log()
    );
    assert!(g.ctd.bundle(&id).join("gpucr-hook/hook-1.sock").exists());
    g.ctd.remove_container(&id).unwrap();
    let _ = g.ctd.remove_image(&reference);
    drop(g.fake);
}

#[test]
fn snapshot_checkpoint_is_written_while_the_task_runs_and_restores() {
    let Some(g) = start() else {
        return;
    };
    let id = unique_id("hook-snap");
    let (_pid, hash) = g.run_app(&id, "on");
    let spec = g.ctd.container_spec(&id).unwrap();
    // The shim's Checkpoint on the running task (containerd's client would pause it
    // first, and a paused task's memory is copied out while frozen).
    let dir = g.ctd.dir().join(format!("snap-{id}"));
    g.ctd
        .shim_checkpoint(&id, &dir, &CheckpointFlags::default())
        .unwrap_or_else(|e| panic!("checkpoint: {e}\nshim log: {}", g.shim_log()));
    assert_hook_record(&std::fs::read(dir.join("gpucr-hook.json")).unwrap());
    assert!(dir.join("gpu-hook.1.manifest.json").is_file());
    g.ctd.wait_status(&id, "RUNNING").unwrap();
    g.assert_memory_kept(&id, &hash);
    // The free memory asked, both allocations copied into one snapshot on the device,
    // which alone is exported (held by the shim) and imported back to refill new memory
    // for both, then the image written from the snapshot.
    assert!(
        g.count_ok(&id, "cuMemGetInfo_v2") >= 1,
        "{:#?}",
        g.mem_log(&id)
    );
    g.assert_ok_calls(&id, "cuMemExportToShareableHandle", 1);
    g.assert_ok_calls(&id, "cuMemImportFromShareableHandle", 1);
    // Two into the snapshot, two back out of it; the new memory: the snapshot and two.
    g.assert_ok_calls(&id, "cuMemcpyDtoD_v2", 4);
    assert_eq!(g.count(&id, "cuMemCreate"), 5, "{:#?}", g.mem_log(&id));
    let log = g.shim_log();
    assert!(
        log.contains("given back by the hook from its snapshot on the GPU (no copy-in)"),
        "{log}"
    );
    assert!(
        log.contains("device memory snapshot written while the process runs"),
        "{log}"
    );
    // Restored from that image: the process wakes up Snapshotted and gets its memory
    // from the image written after the thaw.
    g.ctd.remove_container(&id).unwrap();
    g.restore_from_dir(&id, &dir, &spec, &hash);
    g.ctd.remove_container(&id).unwrap();
}

#[test]
fn failed_driver_lock_gives_the_memory_back() {
    let Some(g) = start() else {
        return;
    };
    let id = unique_id("hook-lockfail");
    let (pid, hash) = g.run_app(&id, "on");
    // The program is a CUDA process for the driver too, whose lock fails after the hook
    // moved its memory.
    g.fake
        .set_script(&format!("cuda {pid}\nlock {pid} fail 2\n"))
        .unwrap();
    let err = match g.ctd.task_checkpoint(&id, &[]) {
        Ok(image) => panic!("checkpoint succeeded ({image:?}): {:#?}", g.fake.calls()),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("lock"), "the error names the step: {err}");
    assert_eq!(g.fake.calls_of(pid), ["lock -> 2"]);
    g.ctd.wait_status(&id, "RUNNING").unwrap();
    g.assert_memory_kept(&id, &hash);
    // Released (kept by the shim), then reattached (and moved onto exportable memory).
    g.assert_ok_calls(&id, "cuMemImportFromShareableHandle", 2);
    assert_eq!(g.count(&id, "cuMemCreate"), 4, "{:#?}", g.mem_log(&id));
    g.ctd.remove_container(&id).unwrap();
}

#[test]
fn damaged_hook_image_is_refused_before_anything_is_created() {
    let Some(g) = start() else {
        return;
    };
    let id = unique_id("hook-damaged");
    let (_pid, hash) = g.run_app(&id, "on");
    let spec = g.ctd.container_spec(&id).unwrap();
    let dir = g.ctd.dir().join("damaged-images");
    let flags = CheckpointFlags {
        image_path: Some(&dir),
        ..Default::default()
    };
    let outcome = g
        .ctd
        .checkpoint_with_flags(&id, &flags)
        .expect("checkpoint");
    assert_eq!(outcome, CheckpointOutcome::Dir(dir.clone()));
    assert_hook_record(&std::fs::read(dir.join("gpucr-hook.json")).unwrap());
    g.assert_memory_kept(&id, &hash);
    g.ctd.remove_container(&id).unwrap();

    // One byte of the largest data file of the hook's image (folded flat) flipped.
    let data = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let n = p.file_name().unwrap().to_string_lossy();
            n.starts_with("gpu-hook.1.data-")
        })
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .unwrap_or_else(|| panic!("no data file of the hook in {}", dir.display()));
    let mut bytes = std::fs::read(&data).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x5a;
    let name = data
        .strip_prefix(&dir)
        .unwrap()
        .to_string_lossy()
        .into_owned();
    rewrite_with_manifest(&dir, &name, &bytes);

    let err = g
        .ctd
        .restore_from_image_path(&id, &dir, APP_IMAGE, &spec)
        .expect_err("restore of a damaged hook image")
        .to_string();
    assert!(
        err.contains("GPU state image of pid 1 is damaged") && err.contains("gpu-hook/1"),
        "the hook's image check refuses, naming the damage: {err}"
    );
    // Nothing was created: no task, no shim, no runc container.
    assert_eq!(g.ctd.task_status(&id).unwrap(), None, "no task {id}");
    let address = g.ctd.address().to_string_lossy().into_owned();
    gpucr_tests::poll_until("shim exits", Duration::from_secs(10), || {
        Ok(match procfs::shim_pid(&address, &id) {
            None => Ok(()),
            Some(p) => Err(p),
        })
    })
    .unwrap();
    let runc_state = Path::new("/run/containerd/runc")
        .join(g.ctd.namespace())
        .join(&id);
    assert!(!runc_state.exists(), "runc still knows {id}");
    let _ = g.ctd.ctr(&["container", "rm", &id]);
}

#[test]
fn hook_off_injects_nothing() {
    let Some(g) = start() else {
        return;
    };
    let id = unique_id("hook-off");
    let started = Instant::now();
    g.run_app(&id, "off");
    let config = g.config(&id);
    assert!(hook_mounts(&config).is_empty(), "{config}");
    assert_eq!(env_of(&config, "LD_PRELOAD"), None);
    assert_eq!(env_of(&config, "GPUCR_HOOK_SOCKET_DIR"), None);
    assert!(!g.ctd.bundle(&id).join("gpucr-hook").exists());
    // Without the hook the program's memory is the driver's plain allocations.
    assert_eq!(g.count(&id, "cuMemAlloc_v2"), 2, "{:#?}", g.mem_log(&id));
    assert_eq!(g.count(&id, "cuMemCreate"), 0);
    eprintln!("hook off: ran in {:?}", started.elapsed());
    g.ctd.remove_container(&id).unwrap();
}

/// CRI's copy of a checkpoint into kubelet's archive (containerd's
/// `writeCriuCheckpointData`): every entry of the CRIU tar, directories included, is
/// created as one file in one directory. A hooked checkpoint must come through that whole
/// and restore with its device memory.
#[test]
fn a_hooked_checkpoint_survives_cris_copy_and_restores() {
    let Some(g) = start() else {
        return;
    };
    let id = unique_id("hook-cri");
    let (_pid, hash) = g.run_app(&id, "on");
    let spec = g.ctd.container_spec(&id).unwrap();
    let reference = format!("docker.io/gpucr/hook-cri-{id}:1");
    g.ctd
        .container_checkpoint(&id, &reference, true)
        .expect("ctr container checkpoint --task --rw");
    let files = g.ctd.checkpoint_files(&reference).unwrap();
    let dir = g.ctd.dir().join("cri-copy");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, data) in &files {
        if name.is_empty() || name == "." {
            continue;
        }
        // os.Create(filepath.Join(dir, name)): no directory is made.
        std::fs::write(dir.join(name), data)
            .unwrap_or_else(|e| panic!("CRI's copy fails at {name}: {e}"));
    }
    g.ctd.remove_container(&id).unwrap();
    g.restore_from_dir(&id, &dir, &spec, &hash);
    g.ctd.remove_container(&id).unwrap();
    let _ = g.ctd.remove_image(&reference);
}

/// The failpoints of the hook's steps (see faults.rs for the rest): each fails once, the
/// program keeps its device memory and runs on, a failed restore leaves no task, and the
/// checkpoint restores after.
#[test]
fn every_hook_failpoint_ends_clean() {
    let points = tempfile::tempdir().unwrap();
    let dir_env = points.path().to_string_lossy().into_owned();
    let Some(g) = start_with(&[("GPUCR_FAILPOINTS".into(), dir_env)]) else {
        return;
    };
    let arm = |point: &str| std::fs::write(points.path().join(point), "").unwrap();
    let fired = |point: &str| !points.path().join(point).exists();
    let named = |err: &str, point: &str| {
        assert!(
            err.contains(&format!("failpoint {point} fired")),
            "the error names {point}: {err}"
        )
    };
    let id = unique_id("hook-fp");
    let (_pid, hash) = g.run_app(&id, "on");
    for point in [
        "checkpoint.after-copy-out",
        "checkpoint.before-dump",
        "checkpoint.before-manifest",
    ] {
        arm(point);
        let err = g
            .ctd
            .task_checkpoint(&id, &[])
            .expect_err("a checkpoint through a failpoint")
            .to_string();
        assert!(fired(point), "{point} was not reached");
        named(&err, point);
        g.ctd.wait_status(&id, "RUNNING").unwrap();
        g.assert_memory_kept(&id, &hash);
    }
    let spec = g.ctd.container_spec(&id).unwrap();
    let dir = g.ctd.dir().join("failpoint-images");
    let flags = CheckpointFlags {
        image_path: Some(&dir),
        ..Default::default()
    };
    g.ctd
        .checkpoint_with_flags(&id, &flags)
        .expect("checkpoint");
    g.assert_memory_kept(&id, &hash);
    g.ctd.remove_container(&id).unwrap();
    for point in ["restore.after-criu", "restore.before-hook-copy-in"] {
        arm(point);
        let err = g
            .ctd
            .restore_from_image_path(&id, &dir, APP_IMAGE, &spec)
            .expect_err("a restore through a failpoint")
            .to_string();
        assert!(fired(point), "{point} was not reached");
        named(&err, point);
        let _ = g.ctd.ctr(&["task", "rm", "-f", &id]);
        let _ = g.ctd.ctr(&["container", "rm", &id]);
        assert_eq!(g.ctd.task_status(&id).unwrap(), None, "no task {id}");
        let members = procfs::cgroup_members(g.ctd.namespace());
        assert!(members.is_empty(), "{point}: processes left {members:?}");
    }
    g.restore_from_dir(&id, &dir, &spec, &hash);
    g.ctd.remove_container(&id).unwrap();
}

/// By reference (`GPUCR_STORE_MODE=local`), the hook writes its GPU state into a stage on
/// the store's filesystem and the store takes it in as a pack, without a second write: the
/// image keeps the hook's small files and `gpucr-store.json`, no link and no data file; the
/// stage is gone. A second checkpoint of the unchanged memory adds nothing for it (the hook's
/// direct writer: see below). Restores
/// read the hook's data in place (the pack linked into a stage), and an image restores twice.
#[test]
fn a_checkpoint_by_reference_takes_the_hooks_image_in_place() {
    // The direct writer places every chunk by its allocation and index, so the second
    // image's data file is the first one's, slice for slice: read in place too.
    by_reference_in_place(&["GPUCR_HOOK_DIRECT=1"], true);
}

#[test]
fn a_second_checkpoint_by_reference_with_the_staged_writer_adds_nothing() {
    // The staged writer (the default) writes chunks as its workers finish them, into one file
    // per worker; by reference the shim has it start each chunk on the store's slices, so
    // unchanged memory dedups wherever it lands (the second image is then slices of several
    // packs, copied back at its restore).
    by_reference_in_place(&[], false);
}

/// Two checkpoints by reference of an app with unchanged device memory (the hook's `env`),
/// then three restores; `second_in_place`: the second image's data is read in place too.
fn by_reference_in_place(env: &[&str], second_in_place: bool) {
    // On tmpfs, as recommended, and away from the image directories: what the store takes in
    // place is then the hook's alone (CRIU's pages, on another filesystem, are copied).
    let store = tempfile::Builder::new()
        .prefix("gpucr-store-")
        .tempdir_in("/dev/shm")
        .unwrap();
    let Some(g) = start_with(&[
        ("GPUCR_STORE".into(), store.path().display().to_string()),
        ("GPUCR_STORE_MODE".into(), "local".into()),
        ("GPUCR_STORE_MIN_BYTES".into(), "16384".into()),
    ]) else {
        return;
    };
    let id = unique_id("hook-ref");
    let (_pid, hash) = g.run_app_with(&id, "on", env);
    let spec = g.ctd.container_spec(&id).unwrap();
    let mut dirs = Vec::new();
    for n in 1..=2 {
        let dir = g.ctd.dir().join(format!("ref-{n}-{id}"));
        g.ctd
            .checkpoint_into(&id, &dir)
            .unwrap_or_else(|e| panic!("checkpoint {n}: {e}\nshim log: {}", g.shim_log()));
        g.ctd.wait_status(&id, "RUNNING").unwrap();
        g.assert_memory_kept(&id, &hash);
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().any(|n| n == "gpucr-store.json"), "{names:?}");
        assert!(
            !names.iter().any(|n| n.starts_with("gpu-hook.1.data")),
            "{names:?}"
        );
        for name in &names {
            let md = dir.join(name).symlink_metadata().unwrap();
            assert!(!md.file_type().is_symlink(), "{name} is a link");
        }
        assert!(dir.join("gpu-hook.1.manifest.json").is_file(), "{names:?}");
        dirs.push(dir);
    }
    // The first checkpoint took the hook's data in place; the second found the unchanged
    // device memory in the store already.
    let log = g.shim_log();
    let took = logged(&log, &id, "taken_in_place");
    assert_eq!(took.len(), 2, "{log}");
    // With the staged writer, each allocation's last chunk is padded to a slice (a hole).
    assert!(
        (APP_BYTES..APP_BYTES + (16 << 20)).contains(&took[0]),
        "{took:?}\n{log}"
    );
    assert_eq!(took[1], 0, "{log}");
    let packs = std::fs::read_dir(store.path().join("packs"))
        .unwrap()
        .count();
    assert!(packs >= 1, "no pack in the store");
    let tmp: Vec<_> = std::fs::read_dir(store.path().join("tmp"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(tmp.is_empty(), "left in the store's tmp: {tmp:?}");
    // Each restore reads the hook's data in place: a link to the pack in a stage (the second
    // checkpoint's data is the first one's pack, slice for slice). The image keeps its
    // reference, so the first one restores twice; the stages go with the restores.
    for dir in [&dirs[0], &dirs[1], &dirs[0]] {
        g.ctd.remove_container(&id).unwrap();
        g.restore_from_dir(&id, dir, &spec, &hash);
        assert!(dir.join("gpucr-store.json").is_file());
    }
    let log = g.shim_log();
    let read = logged(&log, &id, "read_in_place");
    assert_eq!(read.len(), 3, "{log}");
    assert!(
        read[0] >= APP_BYTES && read[2] >= APP_BYTES,
        "{read:?}\n{log}"
    );
    assert!(!second_in_place || read[1] >= APP_BYTES, "{read:?}\n{log}");
    g.ctd.remove_container(&id).unwrap();
    let tmp = std::fs::read_dir(store.path().join("tmp")).unwrap().count();
    assert_eq!(tmp, 0, "a restore's stage was left in the store");
}

/// The numbers the shim logged as `field=N` on lines about container `id`, in order.
fn logged(log: &str, id: &str, field: &str) -> Vec<u64> {
    let key = format!("{field}=");
    log.lines()
        .filter(|l| l.contains(id))
        .filter_map(|l| l.split(&key).nth(1)?.split(' ').next()?.parse().ok())
        .collect()
}
