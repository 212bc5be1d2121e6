//! The shared store on real S3-compatible object storage: `s3s-fs` (an S3 server from
//! crates.io, installed by tests/run.sh into /opt/gpucr-test/s3s), driven through the `gpucr`
//! CLI as an operator would, with the usual AWS_* variables.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use gpucr_store::Store;

const KEY: &str = "gpucrtest";
const SECRET: &str = "gpucrtestsecret";

struct S3Server {
    child: Child,
    port: u16,
    root: tempfile::TempDir,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn s3s_fs() -> PathBuf {
    let p = std::env::var_os("GPUCR_S3S_FS")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/opt/gpucr-test/s3s/bin/s3s-fs".into());
    assert!(
        p.is_file(),
        "{} missing: tests/run.sh installs it (cargo install s3s-fs@0.14.1 --features binary \
         --locked --root /opt/gpucr-test/s3s), or set GPUCR_S3S_FS",
        p.display()
    );
    p
}

fn start_s3(bucket: &str) -> S3Server {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join(bucket)).unwrap();
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new(s3s_fs())
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--access-key", KEY, "--secret-key", SECRET])
        .arg(root.path())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "s3s-fs did not listen on {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
    S3Server { child, port, root }
}

fn gpucr(store: &Path, s3: &S3Server, args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gpucr"))
        .env("AWS_ENDPOINT", format!("http://127.0.0.1:{}", s3.port))
        .env("AWS_ALLOW_HTTP", "true")
        .env("AWS_ACCESS_KEY_ID", KEY)
        .env("AWS_SECRET_ACCESS_KEY", SECRET)
        .env("AWS_REGION", "us-east-1")
        .arg("--store")
        .arg(store)
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn a_checkpoint_moves_between_nodes_through_s3() {
    let s3 = start_s3("ckpts");
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let node_a = Store::open(a.path()).unwrap();
    let w = node_a.writer().unwrap();
    let weights = w.put_chunk(&vec![3u8; 4 << 20]).unwrap().chunk;
    let kv = w.put_chunk(b"kv cache").unwrap().chunk;
    let m = w
        .publish("llm/1", vec![weights, kv, weights], serde_json::Value::Null)
        .unwrap();

    let (rc, out) = gpucr(
        a.path(),
        &s3,
        &["push", "llm/1", "--to", "s3://ckpts/node-pool"],
    );
    assert_eq!(rc, 0, "{out}");
    assert!(out.contains("4.0 MiB sent"), "{out}");
    let (rc, out) = gpucr(
        a.path(),
        &s3,
        &["push", "llm/1", "--to", "s3://ckpts/node-pool"],
    );
    assert!(
        rc == 0 && out.contains("0 B sent, 2 chunks already there"),
        "{out}"
    );

    let (rc, out) = gpucr(
        b.path(),
        &s3,
        &["pull", "llm/1", "--from", "s3://ckpts/node-pool"],
    );
    assert_eq!(rc, 0, "{out}");
    let node_b = Store::open(b.path()).unwrap();
    assert_eq!(node_b.manifest("llm/1").unwrap(), m);
    assert_eq!(node_b.read_chunk(&weights).unwrap(), vec![3u8; 4 << 20]);

    // One bit flipped in the bucket: a third node refuses it and publishes nothing.
    let hex = kv.digest.to_hex();
    let object = s3
        .root
        .path()
        .join(format!("ckpts/node-pool/chunks/{}/{hex}", &hex[..2]));
    std::fs::write(&object, b"kv cachf").unwrap();
    let c = tempfile::tempdir().unwrap();
    let (rc, out) = gpucr(
        c.path(),
        &s3,
        &["pull", "llm/1", "--from", "s3://ckpts/node-pool"],
    );
    assert_eq!(rc, 2, "{out}");
    assert!(out.contains("damaged") && out.contains(&hex), "{out}");
    assert!(Store::open(c.path()).unwrap().manifest("llm/1").is_err());
    // A name the bucket does not hold.
    let (rc, out) = gpucr(
        c.path(),
        &s3,
        &["pull", "llm/9", "--from", "s3://ckpts/node-pool"],
    );
    assert!(
        rc == 2 && out.contains("llm/9 is not in the store"),
        "{out}"
    );
}
