//! Checkpoints by reference (issue 22): a checkpoint's large files go into the node's gpucr
//! store (`GPUCR_STORE`) and the image keeps `gpucr-store.json`; a restore puts them back,
//! pulling from the shared store (`GPUCR_STORE_SHARED`) on a node whose store lacks them.
//! Nodes are containerds with their own stores, started with the mode as the node's default
//! (`GPUCR_STORE_MODE`); the counter's CRIU pages are large enough with
//! `GPUCR_STORE_MIN_BYTES` low.

use std::path::Path;

use gpucr_tests::{
    counter_args, files_under, runtime_under_test, unique_id, Containerd, GPUCR_RUNTIME,
};

const REF_FILE: &str = "gpucr-store.json";

struct Node {
    ctd: Containerd,
    image: String,
    store: tempfile::TempDir,
}

/// A containerd whose shims use a store of their own, `mode` by default, and `shared`.
fn node(mode: &str, shared: Option<&Path>) -> Option<Node> {
    if runtime_under_test() != GPUCR_RUNTIME {
        eprintln!("skipped: the gpucr store is gpucr's");
        return None;
    }
    let store = tempfile::Builder::new()
        .prefix("gpucr-store-")
        .tempdir()
        .unwrap();
    let mut env = vec![
        (
            "GPUCR_STORE".to_string(),
            store.path().display().to_string(),
        ),
        ("GPUCR_STORE_MODE".to_string(), mode.to_string()),
        ("GPUCR_STORE_MIN_BYTES".to_string(), "16384".to_string()),
    ];
    if let Some(s) = shared {
        env.push(("GPUCR_STORE_SHARED".into(), s.display().to_string()));
    }
    let ctd = Containerd::start_with_env(&env).expect("containerd");
    let image = ctd.import_busybox().expect("busybox image");
    Some(Node { ctd, image, store })
}

impl Node {
    /// Runs a counter, checkpoints it into `dir` (leave running) and removes it; its spec
    /// and the value it had reached.
    fn checkpoint_counter(&self, id: &str, dir: &Path) -> (Vec<u8>, u64) {
        self.ctd.run_counter(id, &self.image).unwrap();
        let before = self.ctd.wait_counter_above(id, 8).unwrap();
        let spec = self.ctd.container_spec(id).unwrap();
        self.ctd.checkpoint_into(id, dir).unwrap();
        self.ctd.remove_container(id).unwrap();
        (spec, before)
    }

    fn manifests_of(&self, id: &str) -> usize {
        std::fs::read_dir(self.store.path().join("manifests").join(id))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    /// The installed `gpucr` CLI on this node's store.
    fn gpucr(&self, args: &[&str]) -> String {
        let bin = gpucr_tests::shim_dir().unwrap().join("gpucr");
        let out = std::process::Command::new(&bin)
            .arg("--store")
            .arg(self.store.path())
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "gpucr {args:?}: {text}");
        text
    }

    fn restore(&self, id: &str, dir: &Path, spec: &[u8]) -> gpucr_tests::Result<()> {
        self.ctd.restore_from_image_path(id, dir, &self.image, spec)
    }

    /// A series of the node's metrics textfile (the harness puts it in the daemon's
    /// directory).
    fn metric(&self, series: &str) -> f64 {
        let path = self.ctd.metrics_textfile();
        let prom =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        prom.lines()
            .find_map(|l| {
                let (s, v) = l.rsplit_once(' ')?;
                (s == series).then(|| v.parse().ok()).flatten()
            })
            .unwrap_or_else(|| panic!("{series} not in\n{prom}"))
    }

    /// The node's event log, oldest first.
    fn events(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.ctd.event_log())
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    fn assert_counts_on(&self, id: &str, from: u64) {
        self.ctd.wait_status(id, "RUNNING").unwrap();
        let first = self.ctd.wait_counter_above(id, 0).unwrap();
        assert!(
            first >= from,
            "restored counter {first} < checkpointed {from}"
        );
        self.ctd.wait_counter_above(id, first).unwrap();
    }
}

/// The image holds the reference and not the pages; the files listed in the reference are
/// the ones gone.
fn assert_by_reference(dir: &Path) {
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join(REF_FILE)).expect("gpucr-store.json"))
            .unwrap();
    let files = r["files"].as_array().unwrap();
    assert!(
        files
            .iter()
            .any(|f| f["name"].as_str().unwrap().starts_with("pages-")),
        "{r}"
    );
    for f in files {
        let name = f["name"].as_str().unwrap();
        assert!(!dir.join(name).exists(), "{name} is still in the image");
    }
}

#[test]
fn a_local_checkpoint_is_by_reference_and_restores() {
    let Some(a) = node("local", None) else {
        return;
    };
    let id = unique_id("st-local");
    let dir = a.ctd.dir().join("ck-local");
    let (spec, before) = a.checkpoint_counter(&id, &dir);
    assert_by_reference(&dir);
    assert_eq!(a.manifests_of(&id), 1);
    a.restore(&id, &dir, &spec).expect("restore by reference");
    a.assert_counts_on(&id, before);
    // Counted in the node's metrics and event log, with the bytes the store took.
    assert_eq!(
        a.metric("gpucr_checkpoints_total{mode=\"local\",result=\"ok\"}"),
        1.0
    );
    assert_eq!(
        a.metric("gpucr_restores_total{mode=\"local\",result=\"ok\"}"),
        1.0
    );
    assert!(a.metric("gpucr_store_written_bytes_total") >= 16384.0);
    let events = a.events();
    assert_eq!(events.len(), 2, "{events:?}");
    assert_eq!(
        (&events[0]["kind"], &events[0]["mode"]),
        (&"checkpoint".into(), &"local".into())
    );
    assert!(events[0]["store_written_bytes"].as_u64().unwrap() >= 16384);
    // The checkpoint's bytes are the image's, the ones in the store included.
    assert!(
        events[0]["bytes"].as_u64() >= events[0]["store_written_bytes"].as_u64(),
        "{}",
        events[0]
    );
    assert_eq!(events[1]["kind"], "restore");
    assert_eq!(events[1]["result"], "ok");
    // Through containerd's content store too: checkpoint the restored task, restore that.
    let reference = format!("docker.io/gpucr/store-ref:{id}");
    a.ctd.container_checkpoint(&id, &reference, true).unwrap();
    let now = a.ctd.read_counter(&id).unwrap();
    a.ctd.remove_container(&id).unwrap();
    assert_eq!(a.manifests_of(&id), 2);
    // gc keeping none by age: the checkpoint containerd holds keeps its chunks, the image-path
    // one (self-contained again since its restore) goes.
    let content = a.ctd.dir().join("root/io.containerd.content.v1.content");
    let out = a.gpucr(&[
        "gc",
        "--keep-last",
        "0",
        "--referenced-in",
        content.to_str().unwrap(),
    ]);
    assert!(out.contains("1 checkpoints referenced"), "{out}");
    assert_eq!(a.manifests_of(&id), 1);
    a.ctd.container_restore(&id, &reference, true).unwrap();
    a.assert_counts_on(&id, now);
    a.ctd.remove_container(&id).unwrap();
}

#[test]
fn a_shared_checkpoint_restores_on_another_node_and_a_missing_one_is_refused() {
    let shared = tempfile::Builder::new()
        .prefix("gpucr-shared-")
        .tempdir()
        .unwrap();
    let Some(a) = node("shared", Some(shared.path())) else {
        return;
    };
    let b = node("inline", Some(shared.path())).unwrap();
    let c = node("inline", None).unwrap();
    let id = unique_id("st-shared");
    let dir = a.ctd.dir().join("ck-shared");
    let (spec, before) = a.checkpoint_counter(&id, &dir);
    assert_by_reference(&dir);

    // A node with no shared store: refused, naming what to set, and nothing created.
    let e = c.restore(&id, &dir, &spec).unwrap_err().to_string();
    assert!(e.contains("GPUCR_STORE_SHARED"), "{e}");
    assert!(
        c.ctd.tasks().unwrap().is_empty(),
        "a refused restore made a task"
    );
    assert_eq!(c.manifests_of(&id), 0);
    assert_eq!(
        c.metric("gpucr_restores_total{mode=\"shared\",result=\"error\"}"),
        1.0
    );
    let refused = c.events();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert!(
        refused[0]["error"]
            .as_str()
            .is_some_and(|m| m.contains("GPUCR_STORE_SHARED")),
        "{}",
        refused[0]
    );
    assert!(a.metric("gpucr_store_pushed_bytes_total") >= 16384.0);

    // Another node pulls the chunks it lacks from the shared store.
    assert_eq!(b.manifests_of(&id), 0);
    b.restore(&id, &dir, &spec)
        .expect("restore on the second node");
    b.assert_counts_on(&id, before);
    assert_eq!(
        b.manifests_of(&id),
        1,
        "pulled into the second node's store"
    );
    let pulled = b.metric("gpucr_store_pulled_bytes_total");
    assert!(pulled >= 16384.0, "{pulled}");
    let restored = b.events();
    assert_eq!(restored[0]["mode"], "shared");
    assert_eq!(
        restored[0]["store_pulled_bytes"].as_u64(),
        Some(pulled as u64)
    );
    // The shim logged the pull's progress with the container's id.
    let log = b.ctd.log_tail(usize::MAX);
    assert!(
        log.lines()
            .any(|l| l.contains("pulling from") && l.contains(id.as_str())),
        "no progress of the pull in containerd's log"
    );
    b.ctd.remove_container(&id).unwrap();

    // A local checkpoint whose chunk is gone from the only store: refused, nothing created.
    let lid = unique_id("st-gone");
    let local = node("local", None).unwrap();
    let ldir = local.ctd.dir().join("ck-gone");
    let (lspec, _) = local.checkpoint_counter(&lid, &ldir);
    let chunks = local.store.path().join("chunks");
    let victim = files_under(&chunks).into_iter().next().expect("a chunk");
    std::fs::remove_file(&victim).unwrap();
    let e = local.restore(&lid, &ldir, &lspec).unwrap_err().to_string();
    assert!(e.contains("missing") || e.contains("lacks"), "{e}");
    assert!(local.ctd.tasks().unwrap().is_empty());
}

/// A store named in the runtime's options instead of the environment: `ctr run
/// --runtime-config-path` sends an options file (`runtimeoptions.v1.Options`), the way CRI
/// sends a RuntimeClass's table. The checkpoint goes by reference into that store, the node's
/// (environment, mode inline) stays empty, and the restore takes the files back from it.
#[test]
fn a_store_named_in_the_runtime_options_is_used() {
    let Some(a) = node("inline", None) else {
        return;
    };
    let class_store = tempfile::Builder::new()
        .prefix("gpucr-class-store-")
        .tempdir()
        .unwrap();
    let options = a.ctd.dir().join("gpucr-local.toml");
    std::fs::write(
        &options,
        format!(
            "StoreMode = \"local\"\nStore = {:?}\nStoreMinBytes = 16384\n",
            class_store.path().display().to_string()
        ),
    )
    .unwrap();
    let id = unique_id("st-options");
    let flags = ["--runtime-config-path", options.to_str().unwrap()];
    a.ctd
        .run_detached_with(&id, &a.image, &flags, &counter_args())
        .unwrap();
    a.ctd.wait_status(&id, "RUNNING").unwrap();
    let before = a.ctd.wait_counter_above(&id, 8).unwrap();
    let reference = format!("docker.io/gpucr/store-options:{id}");
    a.ctd.container_checkpoint(&id, &reference, true).unwrap();
    let manifests = class_store.path().join("manifests").join(&id);
    assert_eq!(
        std::fs::read_dir(&manifests)
            .map(|d| d.count())
            .unwrap_or(0),
        1,
        "no checkpoint in {}",
        manifests.display()
    );
    let elsewhere = files_under(a.store.path());
    assert!(elsewhere.is_empty(), "the node's store got {elsewhere:?}");
    a.ctd.remove_container(&id).unwrap();
    a.ctd.container_restore(&id, &reference, true).unwrap();
    a.assert_counts_on(&id, before);
    a.ctd.remove_container(&id).unwrap();
}
