//! Real CRIU (4.x on PATH, run as root) dumping and restoring a shell loop with this
//! plugin loaded: inert without a CUDA driver, and driving the fake libcuda when it
//! declares the shell a CUDA process. Skipped when CRIU or root is missing.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());

fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// `<target>/<profile>/<name>`, building `package` if it is not there yet.
fn artifact(name: &str, package: &str) -> PathBuf {
    let p = profile_dir().join(name);
    if !p.exists() {
        let ok = Command::new(env!("CARGO"))
            .args(["build", "-p", package])
            .env("CARGO_TARGET_DIR", profile_dir().parent().unwrap())
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .unwrap()
            .success();
        assert!(ok, "building {package} failed");
    }
    p
}

fn can_run() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let criu = Command::new("criu")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !(root && criu) {
        eprintln!("skipped: needs root and criu on PATH");
    }
    root && criu
}

struct Run {
    dir: tempfile::TempDir,
    pid: i32,
    env: Vec<(String, PathBuf)>,
}

impl Run {
    /// Starts `bash loop.sh` in its own session; it counts into `count`.
    fn start() -> Run {
        // Orphans (the loop's `sleep` after CRIU kills the tree) come to us to be
        // reaped; CRIU needs their pids free again for restore.
        // SAFETY: prctl with constant arguments.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
        let dir = tempfile::tempdir().unwrap();
        for d in ["lib", "img", "cuda"] {
            std::fs::create_dir(dir.path().join(d)).unwrap();
        }
        std::fs::copy(
            artifact("libgpucr_criu_plugin.so", "gpucr-criu-plugin"),
            dir.path().join("lib/libgpucr_criu_plugin.so"),
        )
        .unwrap();
        let count = dir.path().join("count");
        // No child processes: the fake's "restore thread" is the shell's main thread, which
        // the plugin lets run during the dump; a shell waiting for a `sleep` would reap it
        // then and change the tree CRIU seized. bash's `read -t` on a FIFO nobody writes
        // waits without forking.
        let fifo = dir.path().join("fifo");
        let path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
        let script = format!(
            "i=0\nexec 3<>{}\nwhile :; do i=$((i+1)); echo $i > {}; read -t 0.1 -u 3 x; done\n",
            fifo.display(),
            count.display()
        );
        std::fs::write(dir.path().join("loop.sh"), script).unwrap();
        let mut cmd = Command::new("bash");
        cmd.arg(dir.path().join("loop.sh"))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        // SAFETY: setsid is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::setsid();
                Ok(())
            })
        };
        let child = cmd.spawn().unwrap();
        let pid = child.id() as i32;
        std::mem::forget(child); // reaped by `reap`
        let run = Run {
            dir,
            pid,
            env: Vec::new(),
        };
        run.wait_count_above(2);
        run
    }

    fn with_fake_cuda(&mut self, script: &str) {
        let lib = self.dir.path().join("cuda/libcuda.so.1");
        std::fs::copy(artifact("libcuda.so", "fake-libcuda"), &lib).unwrap();
        std::fs::write(self.dir.path().join("script"), script).unwrap();
        self.env = vec![
            ("GPUCR_LIBCUDA".into(), lib),
            (
                "GPUCR_FAKE_CUDA_SCRIPT".into(),
                self.dir.path().join("script"),
            ),
            (
                "GPUCR_FAKE_CUDA_LOG".into(),
                self.dir.path().join("fake.log"),
            ),
            // The shell maps no libcuda; the fake's script says which pids are CUDA.
            ("GPUCR_GPU_ALL_PROCESSES".into(), "1".into()),
        ];
    }

    fn count(&self) -> u64 {
        std::fs::read_to_string(self.dir.path().join("count"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }

    fn wait_count_above(&self, n: u64) -> u64 {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(10) {
            let c = self.count();
            if c > n {
                return c;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the loop did not count past {n}");
    }

    fn criu(&self, args: &[&str]) -> (bool, String) {
        let img = self.dir.path().join("img");
        let lib = self.dir.path().join("lib");
        let log = if args[0] == "dump" {
            "dump.log"
        } else {
            "restore.log"
        };
        let mut cmd = Command::new("criu");
        cmd.args(args)
            .arg("-D")
            .arg(&img)
            .arg("-L")
            .arg(&lib)
            .args(["-v4", "-o", log])
            .env_remove("GPUCR_LIBCUDA");
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        let ok = cmd.status().unwrap().success();
        (
            ok,
            std::fs::read_to_string(img.join(log)).unwrap_or_default(),
        )
    }

    fn dump(&self, extra: &[&str]) -> String {
        let pid = self.pid.to_string();
        let mut args = vec!["dump", "-t", &pid];
        args.extend_from_slice(extra);
        let (ok, log) = self.criu(&args);
        assert!(ok, "criu dump failed:\n{log}");
        log
    }

    /// `None`: inconclusive, a pid of the dumped tree is still taken by another process.
    fn restore(&self) -> Option<String> {
        self.reap_until_gone();
        let (mut ok, mut log) = self.criu(&["restore", "-d"]);
        if !ok && log.contains("File exists") {
            // A pid of the tree is still taken (a busy CI machine can reuse one): say by what,
            // give it time to go, and try once more.
            let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid));
            eprintln!("pid {} still taken: {status:?}", self.pid);
            std::thread::sleep(Duration::from_secs(3));
            self.reap_until_gone();
            (ok, log) = self.criu(&["restore", "-d"]);
            if !ok && log.contains("File exists") {
                eprintln!(
                    "inconclusive: pid {} is still taken; restore not checked",
                    self.pid
                );
                return None;
            }
        }
        assert!(ok, "criu restore failed:\n{log}");
        Some(log)
    }

    /// Reaps the killed tree so its pids are free for restore.
    fn reap_until_gone(&self) {
        let t0 = Instant::now();
        while Path::new(&format!("/proc/{}", self.pid)).exists()
            && t0.elapsed() < Duration::from_secs(10)
        {
            // SAFETY: non-blocking wait for any child.
            while unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) } > 0 {}
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn fake_log(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.path().join("fake.log"))
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.starts_with("get_"))
            .map(String::from)
            .collect()
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        // SAFETY: signalling the session we started.
        unsafe { libc::kill(-self.pid, libc::SIGKILL) };
        self.reap_until_gone();
    }
}

#[test]
fn without_driver_the_plugin_loads_and_changes_nothing() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !can_run() {
        return;
    }
    let mut run = Run::start();
    // A library path that does not exist: a machine without the CUDA driver.
    run.env = vec![(
        "GPUCR_LIBCUDA".into(),
        run.dir.path().join("cuda/absent.so.1"),
    )];
    let dump = run.dump(&[]);
    assert!(
        dump.contains("Plugin \"cuda_plugin\""),
        "plugin not loaded:\n{dump}"
    );
    assert!(
        dump.contains("gpucr cuda_plugin: no CUDA driver: inactive"),
        "{dump}"
    );
    let before = run.count();
    let Some(restore) = run.restore() else {
        return;
    };
    assert!(restore.contains("no CUDA state: inactive"), "{restore}");
    run.wait_count_above(before + 3);
}

#[test]
fn fake_cuda_process_is_locked_checkpointed_restored_unlocked() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !can_run() {
        return;
    }
    let mut run = Run::start();
    run.with_fake_cuda(&format!("cuda {}\n", run.pid));
    let pid = run.pid;
    let dump = run.dump(&[]);
    assert!(
        dump.contains(&format!("locking CUDA process {pid}")),
        "{dump}"
    );
    assert!(
        dump.contains("leaving 1 CUDA processes checkpointed"),
        "{dump}"
    );
    assert_eq!(
        run.fake_log(),
        vec![format!("lock {pid} -> 0"), format!("checkpoint {pid} -> 0")]
    );
    let before = run.count();
    let Some(restore) = run.restore() else {
        return;
    };
    assert!(
        restore.contains(&format!("resuming CUDA process {pid} from CHECKPOINTED")),
        "{restore}"
    );
    assert_eq!(
        run.fake_log(),
        vec![
            format!("lock {pid} -> 0"),
            format!("checkpoint {pid} -> 0"),
            format!("restore {pid} -> 0"),
            format!("unlock {pid} -> 0"),
        ]
    );
    run.wait_count_above(before + 3);
}

#[test]
fn leave_running_puts_the_process_back() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !can_run() {
        return;
    }
    let mut run = Run::start();
    run.with_fake_cuda(&format!("cuda {}\n", run.pid));
    let pid = run.pid;
    let dump = run.dump(&["--leave-running"]);
    assert!(dump.contains("resuming 1 CUDA processes"), "{dump}");
    assert_eq!(
        run.fake_log(),
        vec![
            format!("lock {pid} -> 0"),
            format!("checkpoint {pid} -> 0"),
            format!("restore {pid} -> 0"),
            format!("unlock {pid} -> 0"),
        ]
    );
    let c = run.count();
    run.wait_count_above(c + 3);
}

#[test]
fn failed_checkpoint_fails_the_dump_and_resumes() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !can_run() {
        return;
    }
    let mut run = Run::start();
    run.with_fake_cuda(&format!("cuda {0}\ncheckpoint {0} fail 2\n", run.pid));
    let pid = run.pid.to_string();
    let (ok, log) = run.criu(&["dump", "-t", &pid]);
    assert!(!ok, "dump should fail:\n{log}");
    assert!(log.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{log}");
    assert_eq!(
        run.fake_log(),
        vec![
            format!("lock {pid} -> 0"),
            format!("checkpoint {pid} -> 2"),
            format!("unlock {pid} -> 0")
        ]
    );
    let c = run.count();
    run.wait_count_above(c + 3);
}

/// A stand-in for `/proc/driver/nvidia` with one GPU.
fn fake_procfs(root: &Path, model: &str, uuid: &str) -> PathBuf {
    let gpu = root.join("gpus/0000:19:00.0");
    std::fs::create_dir_all(&gpu).unwrap();
    std::fs::write(
        root.join("version"),
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build\n",
    )
    .unwrap();
    std::fs::write(
        gpu.join("information"),
        format!("Model: \t\t {model}\nGPU UUID: \t {uuid}\nBus Location: \t 0000:19:00.0\nDevice Minor: \t 0\n"),
    )
    .unwrap();
    root.to_path_buf()
}

const UUID_A: &str = "GPU-aaaaaaaa-1111-2222-3333-444444444444";
const UUID_B: &str = "GPU-bbbbbbbb-1111-2222-3333-444444444444";

#[test]
fn restore_onto_another_gpu_passes_the_pair_and_refuses_another_model() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !can_run() {
        return;
    }
    let mut run = Run::start();
    run.with_fake_cuda(&format!("cuda {}\n", run.pid));
    let pid = run.pid;
    let hosts = run.dir.path().join("hosts");
    let a = fake_procfs(&hosts.join("a"), "NVIDIA H200", UUID_A);
    let b = fake_procfs(&hosts.join("b"), "NVIDIA H200", UUID_B);
    let other = fake_procfs(&hosts.join("other"), "NVIDIA A100-SXM4-80GB", UUID_B);
    run.env.push(("GPUCR_NVIDIA_PROCFS".into(), a));
    let dump = run.dump(&[]);
    assert!(
        dump.contains("recorded 1 GPUs (driver 580.159.04)"),
        "{dump}"
    );
    let record =
        std::fs::read_to_string(run.dir.path().join("img/gpucr-plugin-gpus.json")).unwrap();
    assert!(record.contains(UUID_A), "{record}");

    // Another model: refused before anything is restored, naming both.
    run.env.retain(|(k, _)| k != "GPUCR_NVIDIA_PROCFS");
    run.env.push(("GPUCR_NVIDIA_PROCFS".into(), other));
    run.reap_until_gone();
    let (ok, log) = run.criu(&["restore", "-d"]);
    assert!(!ok, "restore onto an A100 must fail:\n{log}");
    assert!(
        log.contains("refusing the restore") && log.contains("A100") && log.contains("H200"),
        "{log}"
    );
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "nothing restored"
    );
    assert!(
        !run.fake_log().iter().any(|l| l.starts_with("restore")),
        "the driver was not asked: {:?}",
        run.fake_log()
    );

    // Another H200: restored with the old->new pair given to the driver.
    run.env.retain(|(k, _)| k != "GPUCR_NVIDIA_PROCFS");
    run.env.push(("GPUCR_NVIDIA_PROCFS".into(), b));
    let before = run.count();
    let Some(restore) = run.restore() else {
        return;
    };
    assert!(restore.contains("1 GPU pairs for the driver"), "{restore}");
    assert!(
        run.fake_log()
            .contains(&format!("restore {pid} pairs=1 -> 0")),
        "{:?}",
        run.fake_log()
    );
    run.wait_count_above(before + 3);
}
