//! What containerd's Go client does that `ctr` cannot (issues 23 and 24), each scenario run
//! with gpucr and with the stock runc shim (the reference) in the same test: the calls go
//! to the task's shim over ttrpc as the client's daemon forwards them.

use std::io::Write;
use std::time::{Duration, Instant};

use containerd_shim_protos::api::Status;
use containerd_shim_protos::shim::oci::CheckpointOptions;
use containerd_shim_protos::ttrpc::Code;
use gpucr_tests::task_rpc::{mkfifo, open_input, open_output, read_until, side_by_side, ExecIo};
use gpucr_tests::{poll_until, setup, unique_id, Containerd, GPUCR_RUNTIME};
use protobuf::{well_known_types::any::Any, CodedOutputStream, Message, MessageField};

fn short(runtime: &str) -> &str {
    if runtime == GPUCR_RUNTIME {
        "gpucr"
    } else {
        "runc"
    }
}

fn rpc_code(e: &gpucr_tests::HarnessError) -> Option<Code> {
    match e {
        gpucr_tests::HarnessError::Ttrpc(containerd_shim_protos::ttrpc::Error::RpcStatus(s)) => {
            Some(s.code())
        }
        _ => None,
    }
}

/// Issue 23.1: `task.Exec(…, &specs.Process{Terminal: true}, cio.NewCreator(
/// cio.WithStreams(nil, &out, nil), cio.WithTerminal))` then Start: a pty, no stdin.
#[test]
fn exec_with_a_terminal_and_no_stdin() {
    let (ctd, image) = setup();
    for runtime in side_by_side() {
        let id = unique_id(&format!("exec-tty-{}", short(runtime)));
        ctd.run_detached_on(runtime, &id, &image, &[], &["sleep", "1000"])
            .unwrap();
        let task = ctd.task_rpc(&id).unwrap();
        let stdout = ctd.dir().join(format!("{id}-tty-stdout"));
        mkfifo(&stdout).unwrap();
        let mut out = open_output(&stdout).unwrap();
        let io = ExecIo {
            stdout: stdout.to_string_lossy().into_owned(),
            terminal: true,
            ..Default::default()
        };
        let spec = task.process_spec(&["tty"], true).unwrap();
        task.exec("tty", spec, &io).unwrap();
        task.start("tty")
            .unwrap_or_else(|e| panic!("{runtime}: Start of an exec with a terminal: {e}"));
        let got = read_until(&mut out, Duration::from_secs(10), |b| {
            String::from_utf8_lossy(b).contains('\n')
        });
        let got = String::from_utf8_lossy(&got);
        assert!(got.contains("/dev/pts/"), "{runtime}: exec tty: {got:?}");
        assert_eq!(task.wait("tty").unwrap(), 0, "{runtime}");
        task.delete_exec("tty").unwrap();
        if runtime == GPUCR_RUNTIME {
            // gpucr only: a spec whose terminal disagrees with the request's (the terminal
            // set on the IO only) gets the terminal the IO was wired for; it failed with
            // runc's "cannot use console socket if runc will not detach or allocate tty"
            // (the runc shim refuses it the same way).
            let spec = task.process_spec(&["tty"], false).unwrap();
            task.exec("tty2", spec, &io).unwrap();
            task.start("tty2")
                .unwrap_or_else(|e| panic!("{runtime}: terminal on the IO only: {e}"));
            let got = read_until(&mut out, Duration::from_secs(10), |b| {
                String::from_utf8_lossy(b).contains('\n')
            });
            let got = String::from_utf8_lossy(&got);
            assert!(got.contains("/dev/pts/"), "{runtime}: exec tty: {got:?}");
            assert_eq!(task.wait("tty2").unwrap(), 0);
            task.delete_exec("tty2").unwrap();
        }
        ctd.remove_container(&id).unwrap();
    }
}

/// `containerd.linux.runc.CheckpointOptions` as containerd 1.7's Go client encodes
/// `WithCheckpointImagePath(dir)` (image_path is field 9 there).
fn legacy_checkpoint_options(image_path: &str) -> Any {
    let mut value = Vec::new();
    {
        let mut os = CodedOutputStream::vec(&mut value);
        os.write_string(9, image_path).unwrap();
        os.flush().unwrap();
    }
    Any {
        type_url: "containerd.linux.runc.CheckpointOptions".into(),
        value,
        ..Default::default()
    }
}

/// Issue 23.3: `task.Checkpoint(ctx, containerd.WithCheckpointImagePath(dir))` on a
/// running task, then `task.Exec`. The client pauses, containerd 1.7's daemon sends the
/// shim its own temporary path for a non-runc runtime (the image path for runc's, whose
/// options type it reads) with the client's options, the client resumes.
#[test]
fn checkpoint_with_an_image_path_keeps_the_task_running() {
    let (ctd, image) = setup();
    for runtime in side_by_side() {
        let id = unique_id(&format!("ckpt-path-{}", short(runtime)));
        ctd.run_counter_on(runtime, &id, &image).unwrap();
        let dir = ctd.dir().join(format!("{id}-image"));
        let daemon_tmp = ctd.dir().join(format!("{id}-ctd-checkpoint"));
        std::fs::create_dir_all(&daemon_tmp).unwrap();
        let (path, options) = if runtime == GPUCR_RUNTIME {
            (
                daemon_tmp.clone(),
                legacy_checkpoint_options(&dir.to_string_lossy()),
            )
        } else {
            let o = CheckpointOptions {
                image_path: dir.to_string_lossy().into_owned(),
                ..Default::default()
            };
            let any = Any {
                type_url: "containerd.runc.v1.CheckpointOptions".into(),
                value: o.write_to_bytes().unwrap(),
                ..Default::default()
            };
            (dir.clone(), any)
        };
        ctd.ctr_ok(&["task", "pause", &id]).unwrap();
        let task = ctd.task_rpc(&id).unwrap();
        let req = containerd_shim_protos::api::CheckpointTaskRequest {
            id: id.clone(),
            path: path.to_string_lossy().into_owned(),
            options: MessageField::some(options),
            ..Default::default()
        };
        task.client
            .checkpoint(task.ctx(), &req)
            .unwrap_or_else(|e| panic!("{runtime}: Checkpoint: {e:?}"));
        ctd.ctr_ok(&["task", "resume", &id]).unwrap();
        assert!(
            dir.join("inventory.img").is_file(),
            "{runtime}: the CRIU image is in the image path {}",
            dir.display()
        );
        assert_eq!(task.status("").unwrap(), Status::RUNNING, "{runtime}");
        let out = ctd.exec(&id, &["echo", "after"]).unwrap();
        assert_eq!(out.stdout.trim(), "after", "{runtime}: exec after: {out:?}");
        ctd.remove_container(&id).unwrap();
    }
}

/// Issue 24.1: a client writes two lines into an exec's stdin and sends CloseIO at once;
/// `cat` must print both (then ends when the client closes its end). 50 tries per runtime
/// (the loss was ~5%).
#[test]
fn stdin_written_before_close_io_is_not_lost() {
    const TRIES: usize = 50;
    let (ctd, image) = setup();
    for runtime in side_by_side() {
        let id = unique_id(&format!("closeio-{}", short(runtime)));
        ctd.run_detached_on(runtime, &id, &image, &[], &["sleep", "1000"])
            .unwrap();
        let task = ctd.task_rpc(&id).unwrap();
        let started = Instant::now();
        let mut lost = Vec::new();
        for n in 0..TRIES {
            let exec_id = format!("cat-{n}");
            let fifo = |name: &str| {
                let path = ctd.dir().join(format!("{id}-{n}-{name}"));
                mkfifo(&path).unwrap();
                path
            };
            let (stdin, stdout, stderr) = (fifo("stdin"), fifo("stdout"), fifo("stderr"));
            let mut out = open_output(&stdout).unwrap();
            let _err = open_output(&stderr).unwrap();
            let mut input = open_input(&stdin).unwrap();
            let io = ExecIo {
                stdin: stdin.to_string_lossy().into_owned(),
                stdout: stdout.to_string_lossy().into_owned(),
                stderr: stderr.to_string_lossy().into_owned(),
                ..Default::default()
            };
            task.exec(&exec_id, task.process_spec(&["cat"], false).unwrap(), &io)
                .unwrap();
            task.start(&exec_id).unwrap();
            input.write_all(b"hello\n").unwrap();
            input.write_all(b"hello\n").unwrap();
            task.close_stdin(&exec_id).unwrap();
            let want = b"hello\nhello\n";
            let got = read_until(&mut out, Duration::from_secs(3), |b| b.len() >= want.len());
            // The client's own end closes last (as the Go client's fifos at its Close): the
            // runc shim opens its reader asynchronously and would wait for a writer forever
            // if every writer was gone before it (seen 1 in 50 with the close before CloseIO).
            drop(input);
            let status = task.wait(&exec_id).unwrap();
            if got != want {
                lost.push((n, String::from_utf8_lossy(&got).into_owned(), status));
            }
            task.delete_exec(&exec_id).unwrap();
        }
        eprintln!(
            "{runtime}: {TRIES} CloseIO tries in {:?}",
            started.elapsed()
        );
        assert!(
            lost.is_empty(),
            "{runtime}: stdin lost at CloseIO: {lost:?}"
        );
        ctd.remove_container(&id).unwrap();
    }
}

/// Issue 24.2: a container in the host's PID namespace (`sh -c 'sleep & sleep'`), its init
/// SIGKILLed: the exit is reported at once and the orphaned child is killed.
#[test]
fn a_host_pid_containers_exit_is_reported_at_once() {
    let (ctd, image) = setup();
    for runtime in side_by_side() {
        let id = unique_id(&format!("hostpid-{}", short(runtime)));
        ctd.run_detached_on(
            runtime,
            &id,
            &image,
            &[
                "--with-ns",
                &format!("pid:/proc/{}/ns/pid", std::process::id()),
            ],
            &["sh", "-c", "sleep 1000 & sleep 1001"],
        )
        .unwrap();
        let init = ctd.task_pid(&id).unwrap() as i32;
        let child = poll_until("the orphan-to-be", Duration::from_secs(10), || {
            let found = gpucr_tests::procfs::processes()
                .into_iter()
                .find(|p| p.argv == ["sleep", "1000"] && p.pid != init);
            Ok(found.map(|p| p.pid).ok_or(()))
        })
        .unwrap();
        let task = ctd.task_rpc(&id).unwrap();
        let killed = Instant::now();
        ctd.ctr_ok(&["task", "kill", "-s", "SIGKILL", &id]).unwrap();
        assert_eq!(task.wait("").unwrap(), 137, "{runtime}");
        let reported = killed.elapsed();
        assert!(
            reported < Duration::from_millis(1000),
            "{runtime}: the init's exit came {reported:?} after the kill"
        );
        poll_until("the orphan killed", Duration::from_secs(5), || {
            let alive = gpucr_tests::procfs::processes()
                .into_iter()
                .any(|p| p.pid == child && p.argv == ["sleep", "1000"]);
            Ok(if alive { Err(child) } else { Ok(()) })
        })
        .unwrap_or_else(|e| panic!("{runtime}: {e}"));
        eprintln!("{runtime}: exit reported {reported:?} after the kill");
        ctd.remove_container(&id).unwrap();
    }
}

/// A runc wrapper (BinaryName) that holds every `runc exec` until `<dir>/release` exists,
/// leaving `<dir>/exec-held.<pid>` while it waits.
fn delaying_runc(ctd: &Containerd) -> std::path::PathBuf {
    let dir = ctd.dir().join("delay-exec");
    std::fs::create_dir_all(&dir).unwrap();
    let wrapper = dir.join("runc-delay-exec");
    let script = format!(
        "#!/bin/sh\ncase \" $* \" in *\" exec \"*)\n  touch {d}/exec-held.$$\n  \
         while [ ! -e {d}/release ]; do sleep 0.05; done;;\nesac\nexec runc \"$@\"\n",
        d = dir.display()
    );
    std::fs::write(&wrapper, script).unwrap();
    std::fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    wrapper
}

fn held_execs(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("exec-held."))
                .count()
        })
        .unwrap_or(0)
}

/// Issue 23.5 (containerd issue 10589): exec1's start is held in `runc exec`, the init is
/// SIGKILLed, exec2 is added and started. As the runc shim: exec2's start is refused at
/// once (the init is not running), the init's exit waits for exec1's start, exec1's start
/// fails, then the init's exit is reported (137) and Delete returns.
#[test]
fn init_killed_while_an_exec_is_starting() {
    let (ctd, image) = setup();
    let wrapper = delaying_runc(&ctd);
    let held = wrapper.parent().unwrap().to_path_buf();
    for runtime in side_by_side() {
        let _ = std::fs::remove_file(held.join("release"));
        let id = unique_id(&format!("i10589-{}", short(runtime)));
        let config = ctd.dir().join(format!("{id}-options.toml"));
        std::fs::write(&config, format!("BinaryName = '{}'\n", wrapper.display())).unwrap();
        let config_flag = config.to_string_lossy().into_owned();
        let wrapper_flag = wrapper.to_string_lossy().into_owned();
        let flags: Vec<&str> = if runtime == GPUCR_RUNTIME {
            vec!["--runtime-config-path", &config_flag]
        } else {
            vec!["--runc-binary", &wrapper_flag]
        };
        ctd.run_detached_on(runtime, &id, &image, &flags, &["sleep", "1000"])
            .unwrap();
        let init = ctd.task_pid(&id).unwrap() as i32;
        let task = ctd.task_rpc(&id).unwrap();
        let before = held_execs(&held);
        task.exec(
            "exec1",
            task.process_spec(&["sleep", "100"], false).unwrap(),
            &ExecIo::default(),
        )
        .unwrap();
        let second = task.reconnect().unwrap();
        let exec1 = std::thread::spawn(move || second.start("exec1"));
        poll_until("exec1 held in runc exec", Duration::from_secs(10), || {
            let n = held_execs(&held);
            Ok(if n > before { Ok(()) } else { Err(n) })
        })
        .unwrap();
        // SAFETY: kill(2) of the container's init, a process of this test's containerd.
        unsafe { libc::kill(init, libc::SIGKILL) };
        poll_until("the init reaped", Duration::from_secs(10), || {
            let alive = std::path::Path::new(&format!("/proc/{init}")).exists();
            Ok(if alive { Err(init) } else { Ok(()) })
        })
        .unwrap();
        task.exec(
            "exec2",
            task.process_spec(&["sleep", "100"], false).unwrap(),
            &ExecIo::default(),
        )
        .unwrap_or_else(|e| panic!("{runtime}: Exec of exec2 while the init's exit is held: {e}"));
        let refused = task
            .start("exec2")
            .expect_err("exec2 started after the init exited");
        assert_eq!(
            rpc_code(&refused),
            Some(Code::FAILED_PRECONDITION),
            "{runtime}: exec2's start: {refused}"
        );
        assert_eq!(
            task.status("").unwrap(),
            Status::RUNNING,
            "{runtime}: the init's exit is held while exec1 starts"
        );
        std::fs::write(held.join("release"), b"").unwrap();
        let exec1 = exec1.join().unwrap();
        assert!(
            exec1.is_err(),
            "{runtime}: exec1 started in a dead container: {exec1:?}"
        );
        assert_eq!(task.wait("").unwrap(), 137, "{runtime}");
        assert_eq!(task.status("").unwrap(), Status::STOPPED, "{runtime}");
        for exec in ["exec1", "exec2"] {
            task.delete_exec(exec)
                .unwrap_or_else(|e| panic!("{runtime}: Delete of {exec}: {e}"));
        }
        ctd.ctr_ok(&["task", "rm", &id]).unwrap();
        ctd.ctr_ok(&["container", "rm", &id]).unwrap();
    }
}

/// `containerd.linux.runc.CreateOptions` with `shim_cgroup` (field 9), as containerd 1.7's
/// Go client encodes `WithShimCgroup(path)` for a non-runc runtime.
fn legacy_create_options(cgroup: &str) -> Any {
    let mut value = Vec::new();
    {
        let mut os = CodedOutputStream::vec(&mut value);
        os.write_string(9, cgroup).unwrap();
        os.flush().unwrap();
    }
    Any {
        type_url: "containerd.linux.runc.CreateOptions".into(),
        value,
        ..Default::default()
    }
}

/// The cgroup directories of `name` in every mounted hierarchy (v1 controllers, or v2).
fn cgroup_dirs(name: &str) -> Vec<std::path::PathBuf> {
    let root = std::path::Path::new("/sys/fs/cgroup");
    if root.join("cgroup.controllers").exists() {
        return vec![root.join(name)];
    }
    std::fs::read_dir(root)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("cgroup.procs").exists())
        .map(|p| p.join(name))
        .collect()
}

/// A bundle containerd would make for `sleep 1000` (runc's default spec, busybox rootfs).
fn sleep_bundle(ctd: &Containerd, id: &str) -> std::path::PathBuf {
    let bundle = ctd.dir().join(format!("bundle-{id}"));
    let bin = bundle.join("rootfs/bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::copy("/bin/busybox", bin.join("busybox")).expect("busybox-static installed");
    for applet in ["sh", "sleep"] {
        std::os::unix::fs::symlink("busybox", bin.join(applet)).unwrap();
    }
    gpucr_tests::Cmd::new("runc")
        .args(["spec", "--bundle"])
        .arg(&bundle)
        .run_ok()
        .unwrap();
    let path = bundle.join("config.json");
    let mut spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    spec["process"]["terminal"] = false.into();
    spec["process"]["args"] = serde_json::json!(["sleep", "1000"]);
    std::fs::write(&path, serde_json::to_vec(&spec).unwrap()).unwrap();
    bundle
}

/// Issue 23.2: `container.NewTask(ctx, io, containerd.WithShimCgroup(path))`: containerd
/// sends the options to the shim's `start` (stdin) and with the task's Create; the shim
/// ends up in the cgroup, also when only the Create carries them.
#[test]
fn the_shim_moves_into_its_cgroup() {
    let ctd = Containerd::start().expect("containerd");
    // The runc shim is not a leg here: started by hand like this (containerd 1.7.24's
    // containerd-shim-runc-v2), its own cgroup move fails with ESRCH on this host's cgroup
    // v1 hierarchies, so it cannot serve as the reference for this one.
    if !side_by_side().contains(&GPUCR_RUNTIME) {
        return;
    }
    let legs = [(GPUCR_RUNTIME, true), (GPUCR_RUNTIME, false)];
    for (runtime, on_start) in legs {
        let id = unique_id(&format!("shimcg-{}-{on_start}", short(runtime)));
        let cgroup = format!("gpucr-test-{id}");
        let dirs = cgroup_dirs(&cgroup);
        for d in &dirs {
            std::fs::create_dir_all(d).unwrap();
            // A new v1 cpuset takes no task until it has CPUs and memory nodes.
            for knob in ["cpuset.cpus", "cpuset.mems"] {
                if let Ok(v) = std::fs::read_to_string(d.parent().unwrap().join(knob)) {
                    std::fs::write(d.join(knob), v.trim()).unwrap();
                }
            }
        }
        let bundle = sleep_bundle(&ctd, &id);
        let options = legacy_create_options(&format!("/{cgroup}"));
        let binary = gpucr_tests::shim_dir()
            .unwrap()
            .join("containerd-shim-gpucr-v2");
        let stdin = if on_start {
            options.write_to_bytes().unwrap()
        } else {
            Vec::new()
        };
        let mut child = std::process::Command::new(binary)
            .args(["-namespace", ctd.namespace(), "-id", &id, "-address"])
            .arg(ctd.address())
            .args(["-publish-binary", "containerd", "start"])
            .current_dir(&bundle)
            .env(
                "TTRPC_ADDRESS",
                format!("{}.ttrpc", ctd.address().display()),
            )
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(&stdin).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{runtime}: shim start: {out:?}");
        let address = String::from_utf8(out.stdout).unwrap().trim().to_owned();
        let (client, ctx) =
            gpucr_tests::shim_client::connect(&address, ctd.namespace(), 30_000_000_000).unwrap();
        let create = containerd_shim_protos::api::CreateTaskRequest {
            id: id.clone(),
            bundle: bundle.to_string_lossy().into_owned(),
            options: MessageField::some(options),
            ..Default::default()
        };
        client
            .create(ctx.clone(), &create)
            .unwrap_or_else(|e| panic!("{runtime}: Create: {e:?}"));
        let connect = containerd_shim_protos::api::ConnectRequest {
            id: id.clone(),
            ..Default::default()
        };
        let shim_pid = client.connect(ctx.clone(), &connect).unwrap().shim_pid;
        let cgroups = std::fs::read_to_string(format!("/proc/{shim_pid}/cgroup")).unwrap();
        let inside = cgroups
            .lines()
            .filter(|l| l.ends_with(&format!(":/{cgroup}")))
            .count();
        assert!(
            inside >= 1,
            "{runtime} (options at start: {on_start}): shim {shim_pid} not in /{cgroup}:\n{cgroups}"
        );
        let delete = containerd_shim_protos::api::DeleteRequest {
            id: id.clone(),
            ..Default::default()
        };
        client.delete(ctx.clone(), &delete).unwrap();
        let shutdown = containerd_shim_protos::api::ShutdownRequest {
            id: id.clone(),
            ..Default::default()
        };
        let _ = client.shutdown(ctx, &shutdown);
        let _ = gpucr_tests::procfs::wait_gone(
            "the shim gone",
            shim_pid as i32,
            Duration::from_secs(10),
        );
        for d in &dirs {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// Issue 24.3: SIGTERM to a shim with a live container: the shim exits (the runc shim does),
/// containerd sees it go and cleans up after it — the container's processes are gone and no
/// task runs on.
#[test]
fn a_shim_ends_on_sigterm_and_containerd_cleans_up() {
    let (ctd, image) = setup();
    let address = ctd.address().to_string_lossy().into_owned();
    for runtime in side_by_side() {
        let id = unique_id(&format!("sigterm-{}", short(runtime)));
        ctd.run_detached_on(runtime, &id, &image, &[], &["sleep", "1000"])
            .unwrap();
        ctd.wait_status(&id, "RUNNING").unwrap();
        let init = ctd.task_pid(&id).unwrap() as i32;
        let shim = gpucr_tests::procfs::shim_pid(&address, &id)
            .unwrap_or_else(|| panic!("{runtime}: no shim for {id}"));
        gpucr_tests::procfs::signal(shim, libc::SIGTERM).expect("kill -TERM the shim");
        let what = format!("{runtime}: shim {shim} exits on SIGTERM");
        gpucr_tests::procfs::wait_gone(&what, shim, Duration::from_secs(10)).unwrap();
        let what = format!("{runtime}: the container's init {init} is gone");
        gpucr_tests::procfs::wait_gone(&what, init, Duration::from_secs(15)).unwrap();
        poll_until(
            &format!("{runtime}: no task {id} runs"),
            Duration::from_secs(15),
            || {
                Ok(match ctd.task_status(&id)? {
                    Some(s) if s == "RUNNING" => Err(s),
                    _ => Ok(()),
                })
            },
        )
        .unwrap();
        let _ = ctd.ctr(&["task", "rm", "-f", &id]);
        let _ = ctd.ctr(&["container", "rm", &id]);
    }
}
