//! A read-only OCI registry on 127.0.0.1, in the test process: CRI pulls images (and a restore
//! re-pulls the checkpointed container's base image by digest), and no registry is reachable
//! from the test machines.
//!
//! It serves the distribution API's read side — `GET`/`HEAD` of `/v2/`,
//! `/v2/<name>/manifests/<tag or digest>` and `/v2/<name>/blobs/<digest>` — from what the test
//! put in with [`Registry::push`]; one request per connection. containerd reaches it over plain
//! HTTP through a `hosts.toml` ([`Registry::write_hosts_toml`]).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::error::{HarnessError, Result};
use crate::image::Blob;

#[derive(Default)]
struct Store {
    /// Blobs and manifests by digest.
    blobs: HashMap<String, Blob>,
    /// `(repository, tag)` → manifest digest.
    tags: HashMap<(String, String), String>,
}

/// The registry; stops serving on drop.
pub struct Registry {
    addr: SocketAddr,
    store: Arc<Mutex<Store>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Registry {
    /// Listens on an ephemeral port of 127.0.0.1.
    pub fn start() -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .map_err(HarnessError::io("bind the test registry", "127.0.0.1:0"))?;
        let addr = listener
            .local_addr()
            .map_err(HarnessError::io("test registry address", "127.0.0.1"))?;
        let store = Arc::new(Mutex::new(Store::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (store, stop) = (store.clone(), stop.clone());
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let store = store.clone();
                    std::thread::spawn(move || {
                        let _ = serve(conn, &store);
                    });
                }
            })
        };
        Ok(Self {
            addr,
            store,
            stop,
            thread: Some(thread),
        })
    }

    /// `127.0.0.1:<port>`, the host part of image references.
    pub fn host(&self) -> String {
        self.addr.to_string()
    }

    /// `<host>/<repository>:<tag>`.
    pub fn reference(&self, repository: &str, tag: &str) -> String {
        format!("{}/{repository}:{tag}", self.host())
    }

    /// Puts an image in: its blobs (config, layers) and its manifest (or index) under `tag`.
    pub fn push(&self, repository: &str, tag: &str, manifest: &Blob, blobs: &[&Blob]) {
        let mut store = self.store.lock().unwrap();
        for blob in blobs.iter().copied().chain([manifest]) {
            store.blobs.insert(blob.digest.clone(), blob.clone());
        }
        store.tags.insert(
            (repository.to_owned(), tag.to_owned()),
            manifest.digest.clone(),
        );
    }

    /// Writes `<certs_d>/<host>/hosts.toml`: plain HTTP, pull and resolve (containerd's
    /// registry `config_path` layout).
    pub fn write_hosts_toml(&self, certs_d: &Path) -> Result<()> {
        let dir = certs_d.join(self.host());
        std::fs::create_dir_all(&dir).map_err(HarnessError::io("create hosts.toml dir", &dir))?;
        let url = format!("http://{}", self.host());
        let text = format!(
            "server = \"{url}\"\n\n[host.\"{url}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"
        );
        let path = dir.join("hosts.toml");
        std::fs::write(&path, text).map_err(HarnessError::io("write hosts.toml", &path))
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop.
        let _ = TcpStream::connect(self.addr);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Answers one request on `conn`.
fn serve(conn: TcpStream, store: &Mutex<Store>) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    // The headers (GET and HEAD carry no body).
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" || line == "\n" {
            break;
        }
    }
    let mut parts = request_line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let found = match method {
        "GET" | "HEAD" => lookup(path, &store.lock().unwrap()),
        _ => None,
    };
    let mut conn = conn;
    match found {
        Some((media_type, digest, bytes)) => {
            write!(
                conn,
                "HTTP/1.1 200 OK\r\nContent-Type: {media_type}\r\nContent-Length: {}\r\n\
                 Docker-Content-Digest: {digest}\r\n\
                 Docker-Distribution-API-Version: registry/2.0\r\nConnection: close\r\n\r\n",
                bytes.len()
            )?;
            if method == "GET" {
                conn.write_all(&bytes)?;
            }
        }
        None => {
            let body = br#"{"errors":[{"code":"NOT_FOUND","message":"not in the test registry"}]}"#;
            write!(
                conn,
                "HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            )?;
            if method == "GET" {
                conn.write_all(body)?;
            }
        }
    }
    conn.flush()
}

/// `(media type, digest, bytes)` of what `path` names.
fn lookup(path: &str, store: &Store) -> Option<(String, String, Vec<u8>)> {
    let path = path.split('?').next()?;
    if path == "/v2/" || path == "/v2" {
        return Some(("application/json".into(), String::new(), b"{}".to_vec()));
    }
    let rest = path.strip_prefix("/v2/")?;
    let blob = if let Some((repository, reference)) = rest.rsplit_once("/manifests/") {
        let digest = if reference.starts_with("sha256:") {
            reference.to_owned()
        } else {
            store
                .tags
                .get(&(repository.to_owned(), reference.to_owned()))?
                .clone()
        };
        store.blobs.get(&digest)?
    } else {
        let (_, digest) = rest.rsplit_once("/blobs/")?;
        store.blobs.get(digest)?
    };
    Some((
        blob.media_type.clone(),
        blob.digest.clone(),
        blob.bytes.clone(),
    ))
}
