//! A real S3-compatible server for the shared store's end-to-end tests: `s3s-fs` (from
//! crates.io; tests/run.sh installs it into /opt/gpucr-test/s3s), on an address of the
//! caller's choosing, with the `AWS_*` environment a node's containerd passes its shims.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::error::{HarnessError, Result};

const KEY: &str = "gpucrtest";
const SECRET: &str = "gpucrtestsecret";

pub struct S3Server {
    child: Child,
    pub host: String,
    pub port: u16,
    root: tempfile::TempDir,
}

impl S3Server {
    /// `s3s-fs` serving `bucket` on `host` (an address of this host) and a free port.
    pub fn start(host: &str, bucket: &str) -> Result<S3Server> {
        let bin = std::env::var_os("GPUCR_S3S_FS")
            .map(PathBuf::from)
            .unwrap_or_else(|| "/opt/gpucr-test/s3s/bin/s3s-fs".into());
        if !bin.is_file() {
            return Err(HarnessError::Unexpected(format!(
                "{} missing: tests/run.sh installs it, or set GPUCR_S3S_FS",
                bin.display()
            )));
        }
        let root = tempfile::tempdir().map_err(HarnessError::io("s3 root", "/tmp"))?;
        let bucket_dir = root.path().join(bucket);
        std::fs::create_dir(&bucket_dir).map_err(HarnessError::io("s3 bucket", &bucket_dir))?;
        let port = std::net::TcpListener::bind((host, 0))
            .and_then(|l| l.local_addr())
            .map_err(HarnessError::io("a free port", host))?
            .port();
        let child = Command::new(&bin)
            .args(["--host", host, "--port", &port.to_string()])
            .args(["--access-key", KEY, "--secret-key", SECRET])
            .arg(root.path())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|source| HarnessError::Spawn {
                command: bin.display().to_string(),
                source,
            })?;
        let server = S3Server {
            child,
            host: host.to_owned(),
            port,
            root,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect((host, port)).is_err() {
            if Instant::now() > deadline {
                return Err(HarnessError::Unexpected(format!(
                    "s3s-fs did not listen on {host}:{port}"
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(server)
    }

    /// The variables the store's S3 client reads (`object_store`'s `AWS_*`).
    pub fn aws_env(&self) -> Vec<(String, String)> {
        [
            (
                "AWS_ENDPOINT",
                format!("http://{}:{}", self.host, self.port),
            ),
            ("AWS_ALLOW_HTTP", "true".into()),
            ("AWS_ACCESS_KEY_ID", KEY.into()),
            ("AWS_SECRET_ACCESS_KEY", SECRET.into()),
            ("AWS_REGION", "us-east-1".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }

    /// Where the server keeps its objects: `ROOT/BUCKET/KEY`.
    pub fn root(&self) -> &Path {
        self.root.path()
    }

    /// Stops the server: the shared store is unreachable from then on.
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
    }
}
