//! Checkpoint and restore through `ctr`, including restores `ctr` 1.7 cannot do by itself.
//!
//! containerd 1.7's `ctr` restores only images made by `ctr container checkpoint`
//! (`ctr container restore`); it has no `ctr task start --checkpoint` and no restore from a
//! `--image-path` directory. For those, the harness repackages the dump (from the content
//! store, or from the image directory) as a container checkpoint image, imports it, and runs
//! `ctr container restore --live`: the shim then gets a `Create` with `checkpoint` set to the
//! unpacked directory, exactly as for a native container checkpoint.

use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};

use serde_json::Value;

use crate::command::Output;
use crate::containerd::Containerd;
use crate::error::{HarnessError, Result};
use crate::image::{CheckpointImage, MEDIA_CHECKPOINT_CONFIG, MEDIA_CRIU_TAR, MEDIA_LAYER_GZIP};

/// The prefix of the images `ctr task checkpoint` stores.
pub fn task_checkpoint_prefix(id: &str) -> String {
    format!("containerd.io/checkpoint/{id}:")
}

impl Containerd {
    /// `ctr task checkpoint <extra> <id>`; returns the image it stored, if any (none with
    /// `--image-path`).
    pub fn task_checkpoint(&self, id: &str, extra: &[&str]) -> Result<Option<String>> {
        let prefix = task_checkpoint_prefix(id);
        let before = self.images_with_prefix(&prefix)?;
        let mut args = vec!["task", "checkpoint"];
        args.extend_from_slice(extra);
        args.push(id);
        self.ctr_ok(&args)?;
        Ok(self
            .images_with_prefix(&prefix)?
            .into_iter()
            .find(|name| !before.contains(name)))
    }

    /// `ctr container checkpoint --task [--rw] <id> <reference>`.
    pub fn container_checkpoint(&self, id: &str, reference: &str, rw: bool) -> Result<Output> {
        let mut args = vec!["container", "checkpoint", "--task"];
        if rw {
            args.push("--rw");
        }
        args.extend([id, reference]);
        self.ctr_ok(&args)
    }

    /// `ctr container restore --live [--rw] <id> <reference>` (creates and starts the task).
    pub fn container_restore(&self, id: &str, reference: &str, rw: bool) -> Result<Output> {
        let mut args = vec!["container", "restore", "--live"];
        if rw {
            args.push("--rw");
        }
        args.extend([id, reference]);
        self.ctr_ok(&args)
    }

    /// `ctr image rm --sync <reference>`: frees the checkpoint blobs so that a later
    /// checkpoint with an identical spec stores its own (containerd 1.7 pitfall).
    pub fn remove_image(&self, reference: &str) -> Result<Output> {
        self.ctr_ok(&["image", "rm", "--sync", reference])
    }

    /// The digest of image `reference`'s target.
    pub fn image_digest(&self, reference: &str) -> Result<String> {
        let out = self.ctr_ok(&["image", "ls"])?;
        out.stdout
            .lines()
            .skip(1)
            .find_map(|line| {
                let mut cols = line.split_whitespace();
                (cols.next()? == reference).then(|| cols.nth(1).map(str::to_owned))?
            })
            .ok_or_else(|| HarnessError::Unexpected(format!("no image {reference}")))
    }

    /// The bytes of blob `digest` from the content store.
    pub fn content(&self, digest: &str) -> Result<Vec<u8>> {
        Ok(self.ctr_ok(&["content", "get", digest])?.stdout_bytes)
    }

    /// The files of checkpoint image `reference`'s CRIU tar, by path (no leading `./`).
    pub fn checkpoint_files(
        &self,
        reference: &str,
    ) -> Result<std::collections::BTreeMap<String, Vec<u8>>> {
        use std::io::Read;
        let index: Value = serde_json::from_slice(&self.content(&self.image_digest(reference)?)?)?;
        let digest = index["manifests"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|d| d["mediaType"] == MEDIA_CRIU_TAR)
            .and_then(|d| d["digest"].as_str())
            .ok_or_else(|| HarnessError::Unexpected(format!("{reference} has no CRIU tar")))?
            .to_owned();
        let tar = self.content(&digest)?;
        let io = HarnessError::io("reading the CRIU tar of", reference);
        let read = || -> std::io::Result<std::collections::BTreeMap<String, Vec<u8>>> {
            let mut files = std::collections::BTreeMap::new();
            for entry in tar::Archive::new(tar.as_slice()).entries()? {
                let mut entry = entry?;
                let path = entry.path()?.to_string_lossy().into_owned();
                let mut data = Vec::new();
                entry.read_to_end(&mut data)?;
                files.insert(path.trim_start_matches("./").to_owned(), data);
            }
            Ok(files)
        };
        read().map_err(io)
    }

    /// Restores container `id` (which must not exist) from a `ctr task checkpoint` image.
    pub fn restore_task_checkpoint(&self, id: &str, checkpoint: &str, rw: bool) -> Result<()> {
        let index: Value = serde_json::from_slice(&self.content(&self.image_digest(checkpoint)?)?)?;
        let image = index["annotations"]["image.name"]
            .as_str()
            .ok_or_else(|| HarnessError::Unexpected(format!("{checkpoint} has no image.name")))?
            .to_owned();
        let blob = |media_type: &str| -> Result<Option<Vec<u8>>> {
            let found = index["manifests"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|d| d["mediaType"] == media_type);
            match found.and_then(|d| d["digest"].as_str()) {
                Some(digest) => self.content(digest).map(Some),
                None => Ok(None),
            }
        };
        let missing = |what: &str| HarnessError::Unexpected(format!("{checkpoint} has no {what}"));
        let checkpoint_image = CheckpointImage {
            image,
            runtime: self.runtime().to_owned(),
            snapshotter: "overlayfs".to_owned(),
            criu_tar: blob(MEDIA_CRIU_TAR)?.ok_or_else(|| missing("criu tar"))?,
            spec_any: blob(MEDIA_CHECKPOINT_CONFIG)?.ok_or_else(|| missing("spec"))?,
            rw_layer: if rw { blob(MEDIA_LAYER_GZIP)? } else { None },
        };
        self.restore_checkpoint_image(id, &checkpoint_image)
    }

    /// Restores container `id` (which must not exist) from a CRIU image directory written by
    /// `ctr task checkpoint --image-path`, with the container's former spec (JSON).
    pub fn restore_from_image_path(
        &self,
        id: &str,
        image_path: &Path,
        image: &str,
        spec_json: &[u8],
    ) -> Result<()> {
        let checkpoint_image = CheckpointImage {
            image: image.to_owned(),
            runtime: self.runtime().to_owned(),
            snapshotter: "overlayfs".to_owned(),
            criu_tar: CheckpointImage::tar_dump_dir(image_path)?,
            spec_any: CheckpointImage::spec_any_from_json(spec_json)?,
            rw_layer: None,
        };
        self.restore_checkpoint_image(id, &checkpoint_image)
    }

    /// Imports `checkpoint` under a fresh name, runs `ctr container restore --live` and removes
    /// the imported image again.
    pub fn restore_checkpoint_image(&self, id: &str, checkpoint: &CheckpointImage) -> Result<()> {
        static SEQUENCE: AtomicU32 = AtomicU32::new(0);
        let reference = format!(
            "docker.io/gpucr/repacked-{id}:{}",
            SEQUENCE.fetch_add(1, Ordering::Relaxed)
        );
        self.import_layout(&checkpoint.layout_tar(&reference)?, &["--no-unpack"])?;
        let restored = self.container_restore(id, &reference, checkpoint.rw_layer.is_some());
        // The repacked image holds the same blobs a later checkpoint of this container
        // writes; containerd 1.7 refuses to store those twice ("already exists").
        let removed = self.remove_image(&reference);
        restored?;
        removed?;
        Ok(())
    }

    /// `ctr container info --spec <id>`: the container's OCI spec as JSON.
    pub fn container_spec(&self, id: &str) -> Result<Vec<u8>> {
        Ok(self
            .ctr_ok(&["container", "info", "--spec", id])?
            .stdout_bytes)
    }
}
