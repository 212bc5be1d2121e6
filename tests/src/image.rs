//! OCI images built by hand: a busybox rootfs and containerd checkpoint images, packed as OCI
//! image-layout tarballs for `ctr image import` (no registry is needed).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use flate2::write::GzEncoder;
use flate2::Compression;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::command::Cmd;
use crate::error::{HarnessError, Result};

pub const MEDIA_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const MEDIA_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const MEDIA_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const MEDIA_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
/// containerd's media type for the tar of a CRIU image directory.
pub const MEDIA_CRIU_TAR: &str = "application/vnd.containerd.container.criu.checkpoint.criu.tar";
/// containerd's media type for the container spec (a protobuf `Any`) of a checkpoint.
pub const MEDIA_CHECKPOINT_CONFIG: &str =
    "application/vnd.containerd.container.checkpoint.config.v1+proto";
/// The annotation that names an image in an OCI layout's index.json.
pub const REF_NAME: &str = "org.opencontainers.image.ref.name";
/// Index annotations that `ctr container restore` reads (containerd 1.7).
pub const CHECKPOINT_RUNTIME: &str = "io.containerd.checkpoint.runtime";
pub const CHECKPOINT_SNAPSHOTTER: &str = "io.containerd.checkpoint.snapshotter";
/// The `Any` type URL containerd uses for a JSON runtime spec.
pub const SPEC_TYPE_URL: &str = "types.containerd.io/opencontainers/runtime-spec/1/Spec";

/// Name under which the busybox image is imported.
pub const BUSYBOX_REF: &str = "docker.io/library/gpucr-busybox:test";

/// A content-addressed blob.
#[derive(Debug, Clone)]
pub struct Blob {
    pub media_type: String,
    pub digest: String,
    pub bytes: Vec<u8>,
}

impl Blob {
    pub fn new(media_type: &str, bytes: Vec<u8>) -> Self {
        Self {
            media_type: media_type.to_owned(),
            digest: sha256_digest(&bytes),
            bytes,
        }
    }

    /// The blob's OCI descriptor.
    pub fn descriptor(&self) -> Value {
        json!({ "mediaType": self.media_type, "digest": self.digest, "size": self.bytes.len() })
    }
}

/// `sha256:<hex>` of `bytes`.
pub fn sha256_digest(bytes: &[u8]) -> String {
    let hash = Sha256::digest(bytes);
    let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// An OCI image layout (`oci-layout`, `index.json`, `blobs/sha256/*`) under construction.
#[derive(Debug, Default)]
pub struct OciLayout {
    blobs: Vec<Blob>,
    manifests: Vec<Value>,
}

impl OciLayout {
    pub fn add_blob(&mut self, blob: &Blob) {
        if !self.blobs.iter().any(|b| b.digest == blob.digest) {
            self.blobs.push(blob.clone());
        }
    }

    /// Adds `blob` and lists it in index.json under the name `reference`.
    pub fn add_named(&mut self, blob: &Blob, reference: &str) {
        self.add_blob(blob);
        let mut descriptor = blob.descriptor();
        descriptor["annotations"] = json!({ REF_NAME: reference });
        self.manifests.push(descriptor);
    }

    /// The layout as an uncompressed tar archive.
    pub fn to_tar(&self) -> Result<Vec<u8>> {
        let index =
            json!({ "schemaVersion": 2, "mediaType": MEDIA_INDEX, "manifests": self.manifests });
        let mut tar = TarWriter::new();
        tar.file("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#)?;
        tar.file("index.json", &serde_json::to_vec(&index)?)?;
        tar.dir("blobs")?;
        tar.dir("blobs/sha256")?;
        for blob in &self.blobs {
            let hex = blob.digest.trim_start_matches("sha256:");
            tar.file(&format!("blobs/sha256/{hex}"), &blob.bytes)?;
        }
        tar.finish()
    }
}

/// A deterministic in-memory tar writer (mtime 0, root-owned).
struct TarWriter {
    builder: tar::Builder<Vec<u8>>,
}

impl TarWriter {
    fn new() -> Self {
        let mut builder = tar::Builder::new(Vec::new());
        builder.mode(tar::HeaderMode::Deterministic);
        Self { builder }
    }

    fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(kind);
        header.set_mode(mode);
        header.set_size(size);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(0);
        header
    }

    fn file(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        self.file_mode(name, bytes, 0o644)
    }

    fn file_mode(&mut self, name: &str, bytes: &[u8], mode: u32) -> Result<()> {
        let mut header = Self::header(tar::EntryType::Regular, mode, bytes.len() as u64);
        self.builder
            .append_data(&mut header, name, bytes)
            .map_err(HarnessError::io("append to tar", name))
    }

    fn dir(&mut self, name: &str) -> Result<()> {
        self.dir_mode(name, 0o755)
    }

    fn dir_mode(&mut self, name: &str, mode: u32) -> Result<()> {
        let mut header = Self::header(tar::EntryType::Directory, mode, 0);
        self.builder
            .append_data(&mut header, format!("{name}/"), std::io::empty())
            .map_err(HarnessError::io("append to tar", name))
    }

    fn symlink(&mut self, name: &str, target: &str) -> Result<()> {
        let mut header = Self::header(tar::EntryType::Symlink, 0o777, 0);
        self.builder
            .append_link(&mut header, name, target)
            .map_err(HarnessError::io("append symlink to tar", name))
    }

    fn finish(self) -> Result<Vec<u8>> {
        self.builder
            .into_inner()
            .map_err(HarnessError::io("finish tar", "<memory>"))
    }
}

fn gzip(bytes: &[u8]) -> Result<Vec<u8>> {
    use std::io::Write;
    let mut encoder = GzEncoder::new(Vec::new(), Compression::fast());
    encoder
        .write_all(bytes)
        .and_then(|()| encoder.finish())
        .map_err(HarnessError::io("gzip", "<memory>"))
}

/// The busybox image: one gzip layer with a static busybox and its applet links.
#[derive(Debug)]
pub struct BusyboxImage {
    pub reference: String,
    pub manifest: Blob,
    pub config: Blob,
    pub layer: Blob,
}

impl BusyboxImage {
    /// The image, built once per test process from the host's static busybox
    /// (`GPUCR_BUSYBOX`, else `/bin/busybox` or `/usr/bin/busybox`).
    pub fn get() -> Result<&'static BusyboxImage> {
        static IMAGE: OnceLock<std::result::Result<BusyboxImage, String>> = OnceLock::new();
        IMAGE
            .get_or_init(|| Self::build().map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| HarnessError::Unexpected(format!("building the busybox image: {e}")))
    }

    fn build() -> Result<Self> {
        let busybox = find_busybox()?;
        let binary = std::fs::read(&busybox).map_err(HarnessError::io("read busybox", &busybox))?;
        let list = Cmd::new(&busybox).arg("--list").run_ok()?.stdout;

        let mut tar = TarWriter::new();
        for dir in [
            "bin", "dev", "etc", "proc", "root", "run", "sys", "usr", "var",
        ] {
            tar.dir(dir)?;
        }
        tar.dir_mode("tmp", 0o1777)?;
        tar.file("tmp/counter", crate::task::COUNTER_FILE_INITIAL)?;
        tar.file_mode("bin/busybox", &binary, 0o755)?;
        for applet in list.lines().map(str::trim) {
            if !applet.is_empty() && applet != "busybox" && !applet.contains('/') {
                tar.symlink(&format!("bin/{applet}"), "busybox")?;
            }
        }
        tar.file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")?;
        tar.file("etc/group", b"root:x:0:\n")?;
        let layer_tar = tar.finish()?;
        let diff_id = sha256_digest(&layer_tar);
        let layer = Blob::new(MEDIA_LAYER_GZIP, gzip(&layer_tar)?);

        let config = json!({
            "architecture": go_arch(),
            "os": "linux",
            "config": { "Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"], "Cmd": ["/bin/sh"], "WorkingDir": "/" },
            "rootfs": { "type": "layers", "diff_ids": [diff_id] },
        });
        let config = Blob::new(MEDIA_CONFIG, serde_json::to_vec(&config)?);
        let manifest = image_manifest(&config, &[&layer], None)?;
        Ok(Self {
            reference: BUSYBOX_REF.to_owned(),
            manifest,
            config,
            layer,
        })
    }

    /// The image as an OCI layout tarball.
    pub fn layout_tar(&self) -> Result<Vec<u8>> {
        let mut layout = OciLayout::default();
        layout.add_blob(&self.config);
        layout.add_blob(&self.layer);
        layout.add_named(&self.manifest, &self.reference);
        layout.to_tar()
    }
}

/// Adds the files under `dir` to `tar` below `prefix`, subdirectories (the hook's
/// `gpu-hook/<pid>/` images) included, in name order.
fn add_dir(tar: &mut TarWriter, dir: &Path, prefix: &str) -> Result<()> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .map_err(HarnessError::io("read checkpoint dir", dir))?
        .collect::<std::io::Result<_>>()
        .map_err(HarnessError::io("read checkpoint dir", dir))?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        let name = format!("{prefix}{}", entry.file_name().to_string_lossy());
        if path.is_dir() {
            tar.dir(&name)?;
            add_dir(tar, &path, &format!("{name}/"))?;
        } else if path.is_file() {
            let bytes = std::fs::read(&path).map_err(HarnessError::io("read", &path))?;
            tar.file(&name, &bytes)?;
        }
    }
    Ok(())
}

/// A file of an extra image layer: its path in the rootfs (no leading `/`), bytes, mode.
#[derive(Debug, Clone)]
pub struct LayerFile {
    pub path: String,
    pub bytes: Vec<u8>,
    pub mode: u32,
}

/// An image of busybox's layer plus one more (see [`BusyboxImage::with_files`]).
#[derive(Debug)]
pub struct ExtendedImage {
    pub manifest: Blob,
    pub config: Blob,
    /// Busybox's layer, then the one holding the files.
    pub layers: [Blob; 2],
}

impl ExtendedImage {
    /// The config and the layers: what a registry push needs beside the manifest.
    pub fn blobs(&self) -> [&Blob; 3] {
        [&self.config, &self.layers[0], &self.layers[1]]
    }

    /// The image named `reference`, as an OCI layout tarball.
    pub fn layout_tar(&self, reference: &str) -> Result<Vec<u8>> {
        let mut layout = OciLayout::default();
        for blob in self.blobs() {
            layout.add_blob(blob);
        }
        layout.add_named(&self.manifest, reference);
        layout.to_tar()
    }
}

impl BusyboxImage {
    /// An image named `reference`: the busybox layer plus one layer holding `files` (their
    /// parent directories made `0755`), as an OCI layout tarball.
    pub fn with_files_layout_tar(&self, reference: &str, files: &[LayerFile]) -> Result<Vec<u8>> {
        self.with_files(files)?.layout_tar(reference)
    }

    /// The busybox layer plus one layer holding `files` (their parent directories made
    /// `0755`).
    pub fn with_files(&self, files: &[LayerFile]) -> Result<ExtendedImage> {
        let mut dirs = std::collections::BTreeSet::new();
        for f in files {
            let mut parent = Path::new(&f.path).parent();
            while let Some(p) = parent.filter(|p| !p.as_os_str().is_empty()) {
                dirs.insert(p.to_string_lossy().into_owned());
                parent = p.parent();
            }
        }
        let mut tar = TarWriter::new();
        // BTreeSet order puts every parent before its children.
        for d in &dirs {
            tar.dir(d)?;
        }
        for f in files {
            tar.file_mode(&f.path, &f.bytes, f.mode)?;
        }
        let layer_tar = tar.finish()?;
        let extra = Blob::new(MEDIA_LAYER_GZIP, gzip(&layer_tar)?);

        let base: Value = serde_json::from_slice(&self.config.bytes)?;
        let mut config = base.clone();
        config["rootfs"]["diff_ids"]
            .as_array_mut()
            .ok_or_else(|| HarnessError::Unexpected("busybox config has no diff_ids".into()))?
            .push(json!(sha256_digest(&layer_tar)));
        let config = Blob::new(MEDIA_CONFIG, serde_json::to_vec(&config)?);
        let manifest = image_manifest(&config, &[&self.layer, &extra], None)?;
        Ok(ExtendedImage {
            manifest,
            config,
            layers: [self.layer.clone(), extra],
        })
    }
}

fn find_busybox() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("GPUCR_BUSYBOX") {
        return Ok(PathBuf::from(path));
    }
    ["/bin/busybox", "/usr/bin/busybox"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .ok_or_else(|| {
            HarnessError::Unexpected(
                "no busybox binary: install busybox-static or set GPUCR_BUSYBOX".into(),
            )
        })
}

fn go_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// A checkpoint image in the layout `ctr container restore` reads: an index with the CRIU
/// tar, the spec, optionally the rw layer, and the runtime/snapshotter/image annotations.
#[derive(Debug)]
pub struct CheckpointImage {
    /// Name of the image the container was created from.
    pub image: String,
    pub runtime: String,
    pub snapshotter: String,
    pub criu_tar: Vec<u8>,
    /// The container's runtime spec as containerd stores it: a protobuf `Any`
    /// (see [`CheckpointImage::spec_any_from_json`]).
    pub spec_any: Vec<u8>,
    /// The rw layer diff (gzip tar), when the rootfs changes are to be restored.
    pub rw_layer: Option<Vec<u8>>,
}

impl CheckpointImage {
    /// Tars a CRIU image directory the way containerd stores it (flat, relative names).
    pub fn tar_dump_dir(dir: &Path) -> Result<Vec<u8>> {
        let mut tar = TarWriter::new();
        add_dir(&mut tar, dir, "")?;
        tar.finish()
    }

    /// A JSON spec wrapped in a protobuf `Any`, as containerd stores it.
    pub fn spec_any_from_json(spec_json: &[u8]) -> Result<Vec<u8>> {
        use protobuf::Message;
        let any = protobuf::well_known_types::any::Any {
            type_url: SPEC_TYPE_URL.to_owned(),
            value: spec_json.to_vec(),
            ..Default::default()
        };
        any.write_to_bytes()
            .map_err(|e| HarnessError::Unexpected(format!("encoding the spec Any: {e}")))
    }

    /// An OCI layout naming the checkpoint index `reference`.
    pub fn layout_tar(&self, reference: &str) -> Result<Vec<u8>> {
        let mut layout = OciLayout::default();
        let mut children = Vec::new();
        if let Some(rw) = &self.rw_layer {
            let blob = Blob::new(MEDIA_LAYER_GZIP, rw.clone());
            layout.add_blob(&blob);
            children.push(with_platform(blob.descriptor()));
        }
        for blob in [
            Blob::new(MEDIA_CRIU_TAR, self.criu_tar.clone()),
            Blob::new(MEDIA_CHECKPOINT_CONFIG, self.spec_any.clone()),
        ] {
            layout.add_blob(&blob);
            children.push(with_platform(blob.descriptor()));
        }
        let index = json!({
            "schemaVersion": 2,
            "mediaType": MEDIA_INDEX,
            "manifests": children,
            "annotations": {
                CHECKPOINT_RUNTIME: self.runtime,
                CHECKPOINT_SNAPSHOTTER: self.snapshotter,
                REF_NAME: self.image,
            },
        });
        layout.add_named(
            &Blob::new(MEDIA_INDEX, serde_json::to_vec(&index)?),
            reference,
        );
        layout.to_tar()
    }
}

/// An OCI image manifest of `config` and `layers` (in order), with `annotations` if given.
pub fn image_manifest(config: &Blob, layers: &[&Blob], annotations: Option<Value>) -> Result<Blob> {
    let mut manifest = json!({
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": config.descriptor(),
        "layers": layers.iter().map(|l| l.descriptor()).collect::<Vec<_>>(),
    });
    if let Some(a) = annotations {
        manifest["annotations"] = a;
    }
    Ok(Blob::new(MEDIA_MANIFEST, serde_json::to_vec(&manifest)?))
}

fn with_platform(mut descriptor: Value) -> Value {
    descriptor["platform"] = json!({ "architecture": go_arch(), "os": "linux" });
    descriptor
}
