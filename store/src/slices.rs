//! Work over a file's slices on several threads: [`parallel`], the loop itself (each index
//! once, in any order, stopping at the first error), and [`for_each_range`], a file read range
//! by range through it: what a copy into the store ([`crate::dir`]) and an
//! adoption ([`crate::pack`]) both do with each slice's bytes. The slices are read in place
//! from a mapping of the file where it maps.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::error::{io, Result, StoreError};
use crate::mapped::MappedIn;
use crate::progress::Progress;

/// Calls `each(&mut state, i)` for every `i` in `0..n` on up to `threads` threads, each with
/// its own `state` from `init`; the results in index order. Stops at the first error, which it
/// returns.
pub(crate) fn parallel<S, T: Send>(
    n: usize,
    threads: usize,
    init: impl Fn() -> S + Sync,
    each: impl Fn(&mut S, usize) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let out: Mutex<Vec<Option<T>>> = Mutex::new((0..n).map(|_| None).collect());
    let next = AtomicUsize::new(0);
    let first_err: Mutex<Option<StoreError>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, n.max(1)) {
            s.spawn(|| {
                let mut state = init();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n || first_err.lock().unwrap().is_some() {
                        return;
                    }
                    match each(&mut state, i) {
                        Ok(t) => out.lock().unwrap()[i] = Some(t),
                        Err(e) => {
                            first_err.lock().unwrap().get_or_insert(e);
                            return;
                        }
                    }
                }
            });
        }
    });
    if let Some(e) = first_err.into_inner().unwrap() {
        return Err(e);
    }
    Ok(out
        .into_inner()
        .unwrap()
        .into_iter()
        .map(|t| t.expect("every index done"))
        .collect())
}

/// `(file, chunk)` for files of `counts[file]` chunks, chunk `i` of every file before chunk
/// `i + 1` of any: threads taking them in order spread over the files (on tmpfs one file's
/// page allocations go one at a time).
pub(crate) fn interleaved(counts: &[usize]) -> Vec<(usize, usize)> {
    let most = counts.iter().copied().max().unwrap_or(0);
    (0..most)
        .flat_map(|i| {
            counts
                .iter()
                .enumerate()
                .filter(move |&(_, &n)| i < n)
                .map(move |(f, _)| (f, i))
        })
        .collect()
}

/// `size` bytes cut every `slice` bytes: `(offset, len)`, the last one shorter.
pub(crate) fn fixed(size: u64, slice: u64) -> Vec<(u64, u64)> {
    (0..size.div_ceil(slice))
        .map(|i| (i * slice, slice.min(size - i * slice)))
        .collect()
}

/// Calls `each(offset, bytes)` for every `(offset, len)` range of `file` (in order and adjacent
/// from 0: [`fixed`] slices or the cuts of [`crate::cuts`]), on `threads` threads; the results
/// in range order. Stops at the first error, which it returns. `progress` advances by each
/// range's length.
pub(crate) fn for_each_range<T: Send>(
    file: &File,
    path: &Path,
    ranges: &[(u64, u64)],
    threads: usize,
    progress: &dyn Progress,
    each: impl Fn(u64, &[u8]) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let size = ranges.last().map_or(0, |&(o, l)| o + l);
    let longest = ranges.iter().map(|&(_, l)| l).max().unwrap_or(0);
    // In place where the file maps (no copy into a buffer); read into one where it does not.
    let mapped = (size > 0)
        .then(|| MappedIn::new(file, size as usize).ok())
        .flatten();
    let buffer = || match mapped {
        Some(_) => Vec::new(),
        None => vec![0u8; longest as usize],
    };
    parallel(ranges.len(), threads, buffer, |buf, i| {
        let (off, len) = ranges[i];
        let len = len as usize;
        let done = match &mapped {
            Some(map) => each(off, map.slice(off as usize, len)),
            None => file
                .read_exact_at(&mut buf[..len], off)
                .map_err(io("cannot read", path))
                .and_then(|()| each(off, &buf[..len])),
        }?;
        progress.advance(len as u64);
        Ok(done)
    })
}
