//! Where a file is cut into chunks. Fixed [`CHUNK_SIZE`] slices suit the hook's GPU state,
//! whose writer starts every chunk on a slice. CRIU's pages do not hold still: the image is
//! every dumped page in address order, so a heap grown by a few pages shifts everything after
//! it, and no fixed slice of a second dump equals one of the first (a Python process dumped
//! twice: 100 % new at fixed 8 MiB slices, 4.7 % new 4 KiB pages, 7.6 % new with these cuts).
//! Cut by content (FastCDC, the `fastcdc` crate), equal runs of bytes give equal chunks
//! wherever they lie.
//!
//! The file is cut in [`SEGMENT`]-byte segments on several threads, each segment on its own
//! (a cut is forced at each segment's end): a shift then costs about one chunk per segment.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::dir::CHUNK_SIZE;
use crate::error::{io, Result};
use crate::mapped::MappedIn;
use crate::slices::parallel;

/// The segments cut on their own (fixed, so that two dumps' segments start alike).
const SEGMENT: u64 = 128 << 20;
/// FastCDC's bounds: chunks of 256 KiB to [`CHUNK_SIZE`], about 1 MiB on average.
const MIN: u32 = 256 << 10;
const AVG: u32 = 1 << 20;
const MAX: u32 = CHUNK_SIZE as u32;

/// The `(offset, len)` chunks of the first `size` bytes of `file`, cut by content, in order.
pub(crate) fn by_content(
    file: &File,
    path: &Path,
    size: u64,
    threads: usize,
) -> Result<Vec<(u64, u64)>> {
    let mapped = (size > 0)
        .then(|| MappedIn::new(file, size as usize).ok())
        .flatten();
    let segments = size.div_ceil(SEGMENT) as usize;
    let cut = parallel(segments, threads, Vec::new, |buf: &mut Vec<u8>, s| {
        let start = s as u64 * SEGMENT;
        let len = SEGMENT.min(size - start) as usize;
        let bytes = match &mapped {
            Some(map) => map.slice(start as usize, len),
            None => {
                buf.resize(len, 0);
                file.read_exact_at(buf, start)
                    .map_err(io("cannot read", path))?;
                &buf[..]
            }
        };
        Ok(fastcdc::v2020::FastCDC::new(bytes, MIN, AVG, MAX)
            .map(|c| (start + c.offset as u64, c.length as u64))
            .collect::<Vec<_>>())
    })?;
    Ok(cut.concat())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dir::tests::noise;

    fn cuts_of(bytes: &[u8]) -> Vec<(u64, u64)> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, bytes).unwrap();
        by_content(&File::open(&path).unwrap(), &path, bytes.len() as u64, 3).unwrap()
    }

    #[test]
    fn the_cuts_cover_the_file_and_survive_a_shift() {
        let bytes = noise(3 * SEGMENT as usize / 2, 9);
        let cuts = cuts_of(&bytes);
        let mut at = 0;
        for &(o, l) in &cuts {
            assert_eq!(o, at);
            assert!(l > 0 && l <= CHUNK_SIZE);
            at += l;
        }
        assert_eq!(at, bytes.len() as u64);
        // Three pages more near the start: most chunks are still there, bytes for bytes.
        let shifted = [&bytes[..5000], &[7u8; 3 * 4096][..], &bytes[5000..]].concat();
        let before: std::collections::HashSet<&[u8]> = cuts
            .iter()
            .map(|&(o, l)| &bytes[o as usize..(o + l) as usize])
            .collect();
        let new: u64 = cuts_of(&shifted)
            .iter()
            .filter(|&&(o, l)| !before.contains(&shifted[o as usize..(o + l) as usize]))
            .map(|&(_, l)| l)
            .sum();
        assert!(
            new < 5 * CHUNK_SIZE / 2,
            "{new} of {} bytes new after a shift",
            shifted.len()
        );
    }
}
