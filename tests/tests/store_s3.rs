//! The shared store on real S3-compatible object storage, through containerd: a node
//! checkpoints by reference into S3 (`s3s-fs`), and a second node — another containerd with
//! its own store, in its own network namespace, reaching S3 only over a veth pair — restores
//! it, pulling the chunks it lacks. With S3 gone, a third node's restore is refused before
//! anything is created.

use std::path::Path;

use gpucr_tests::netns::NetNs;
use gpucr_tests::s3::S3Server;
use gpucr_tests::{runtime_under_test, unique_id, Containerd, StartOptions, GPUCR_RUNTIME};

const BUCKET: &str = "gpucr";
const SHARED: &str = "s3://gpucr/nodes";

/// A containerd whose shims use their own store in `mode`, S3 as the shared store.
fn node(
    mode: &str,
    s3: &S3Server,
    netns: Option<&NetNs>,
) -> (Containerd, String, tempfile::TempDir) {
    let store = tempfile::Builder::new()
        .prefix("gpucr-store-")
        .tempdir()
        .unwrap();
    let mut env: Vec<(String, String)> = vec![
        ("GPUCR_STORE".into(), store.path().display().to_string()),
        ("GPUCR_STORE_MODE".into(), mode.into()),
        ("GPUCR_STORE_MIN_BYTES".into(), "16384".into()),
        ("GPUCR_STORE_SHARED".into(), SHARED.into()),
    ];
    env.extend(s3.aws_env());
    let ctd = Containerd::start_opts(StartOptions {
        env: env.into_iter().map(|(k, v)| (k.into(), v.into())).collect(),
        netns: netns.map(NetNs::path),
        ..StartOptions::default()
    })
    .expect("containerd");
    let image = ctd.import_busybox().expect("busybox image");
    (ctd, image, store)
}

fn net_ns_of(pid: u32) -> std::path::PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap()
}

fn manifests(store: &Path, id: &str) -> usize {
    std::fs::read_dir(store.join("manifests").join(id))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[test]
fn a_checkpoint_in_s3_restores_on_a_node_in_another_network() {
    if runtime_under_test() != GPUCR_RUNTIME {
        eprintln!("skipped: the gpucr store is gpucr's");
        return;
    }
    let ns = NetNs::create(0).expect("a network namespace (ip netns)");
    let mut s3 = S3Server::start(&ns.host_ip, BUCKET).expect("s3s-fs");
    let (a, a_image, _a_store) = node("shared", &s3, None);
    let (b, b_image, b_store) = node("inline", &s3, Some(&ns));
    let b_pid = b.daemon_pid().unwrap();
    assert_ne!(
        net_ns_of(b_pid),
        net_ns_of(std::process::id()),
        "the second node's containerd runs in its own network"
    );

    let id = unique_id("st-s3");
    a.run_counter(&id, &a_image).unwrap();
    let before = a.wait_counter_above(&id, 8).unwrap();
    let spec = a.container_spec(&id).unwrap();
    let dir = a.dir().join("ck-s3");
    a.checkpoint_into(&id, &dir).unwrap();
    a.remove_container(&id).unwrap();
    assert!(
        dir.join("gpucr-store.json").is_file(),
        "the image holds the reference"
    );
    let objects = s3.root().join(BUCKET).join("nodes");
    assert!(
        objects.join("manifests").is_dir() && objects.join("chunks").is_dir(),
        "pushed to S3: {}",
        objects.display()
    );

    // The second node lacks every chunk: pulled over the veth pair, then restored.
    b.restore_from_image_path(&id, &dir, &b_image, &spec)
        .expect("restore on the node in its own network");
    b.wait_status(&id, "RUNNING").unwrap();
    let first = b.wait_counter_above(&id, 0).unwrap();
    assert!(first >= before, "restored counter {first} < {before}");
    b.wait_counter_above(&id, first).unwrap();
    assert_eq!(manifests(b_store.path(), &id), 1, "pulled into its store");
    let log = b.log_tail(400);
    assert!(log.contains("pulled"), "the shim logs the pull: {log}");
    b.remove_container(&id).unwrap();

    // S3 gone: a node that lacks the chunks refuses the restore, and creates nothing.
    s3.stop();
    let (c, c_image, c_store) = node("inline", &s3, Some(&ns));
    let e = c
        .restore_from_image_path(&id, &dir, &c_image, &spec)
        .unwrap_err()
        .to_string();
    assert!(e.contains(SHARED) || e.contains("shared store"), "{e}");
    assert!(
        c.tasks().unwrap().is_empty(),
        "a refused restore made a task"
    );
    assert_eq!(manifests(c_store.path(), &id), 0);
}
