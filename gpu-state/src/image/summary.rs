//! [`Summary`]: what an image holds and what each saving bought, from its manifest.

use std::collections::HashSet;

use serde::Serialize;

use super::manifest::{ImageId, Location, Manifest};

/// Sizes of an image. Every logical byte is exactly one of: zero, parent, dedup or
/// unique (`logical = zero + parent + dedup + unique`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub id: ImageId,
    pub parent: Option<ImageId>,
    /// Ancestors opened with this image (0 for a full image).
    pub chain_depth: usize,
    pub allocations: usize,
    pub chunks: usize,
    /// Bytes of device memory the image describes.
    pub logical_bytes: u64,
    /// Elided all-zero chunks.
    pub zero_bytes: u64,
    /// Chunks that repeat another chunk of this image.
    pub dedup_bytes: u64,
    /// Chunks stored by the parent chain.
    pub parent_bytes: u64,
    /// Chunks stored in this image, before compression.
    pub unique_bytes: u64,
    /// Bytes in this image's data files.
    pub stored_bytes: u64,
    /// `unique_bytes / stored_bytes` (1.0 when nothing is stored).
    pub compression_ratio: f64,
    /// `logical_bytes / stored_bytes` (infinite when nothing is stored).
    pub reduction_ratio: f64,
}

impl Summary {
    pub(crate) fn of(manifest: &Manifest, chain_depth: usize) -> Summary {
        let mut summary = Summary {
            id: manifest.id,
            parent: manifest.parent.as_ref().map(|p| p.id),
            chain_depth,
            allocations: manifest.allocations.len(),
            chunks: 0,
            logical_bytes: 0,
            zero_bytes: 0,
            dedup_bytes: 0,
            parent_bytes: 0,
            unique_bytes: 0,
            stored_bytes: manifest
                .files
                .iter()
                .fold(0u64, |sum, f| sum.saturating_add(f.size)),
            compression_ratio: 1.0,
            reduction_ratio: f64::INFINITY,
        };
        let mut seen = HashSet::new();
        for alloc in &manifest.allocations {
            summary.logical_bytes = summary.logical_bytes.saturating_add(alloc.size);
            summary.chunks += alloc.chunks.len();
            for chunk in &alloc.chunks {
                let bucket = match chunk.at {
                    Location::Zero => &mut summary.zero_bytes,
                    Location::Parent { .. } => &mut summary.parent_bytes,
                    Location::Data { file, offset, .. } if seen.insert((file, offset)) => {
                        &mut summary.unique_bytes
                    }
                    Location::Data { .. } => &mut summary.dedup_bytes,
                };
                *bucket = bucket.saturating_add(chunk.len);
            }
        }
        if summary.stored_bytes > 0 {
            summary.compression_ratio = summary.unique_bytes as f64 / summary.stored_bytes as f64;
            summary.reduction_ratio = summary.logical_bytes as f64 / summary.stored_bytes as f64;
        }
        summary
    }
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "image {}", self.id)?;
        match self.parent {
            Some(parent) => writeln!(f, "parent {parent} (chain depth {})", self.chain_depth)?,
            None => writeln!(f, "parent none")?,
        }
        writeln!(
            f,
            "allocations {} in {} chunks",
            self.allocations, self.chunks
        )?;
        writeln!(f, "logical {} bytes", self.logical_bytes)?;
        writeln!(f, "  zero    {} bytes (elided)", self.zero_bytes)?;
        writeln!(f, "  parent  {} bytes (referenced)", self.parent_bytes)?;
        writeln!(f, "  dedup   {} bytes (repeats)", self.dedup_bytes)?;
        writeln!(f, "  unique  {} bytes", self.unique_bytes)?;
        if self.stored_bytes == 0 {
            return write!(f, "stored 0 bytes");
        }
        write!(
            f,
            "stored {} bytes (compression {:.2}x, overall {:.2}x)",
            self.stored_bytes, self.compression_ratio, self.reduction_ratio
        )
    }
}
