//! GPU state image: the direct data file (chunks written in place into a shared mapping
//! of a tmpfs file), checked against the plain write path.

mod image_util;

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use gpu_state::image::{
    is_tmpfs, Compression, ImageError, ImageOptions, ImageReader, ImageWriter, Location, Manifest,
    NoDirect,
};
use image_util::{alloc, largest_data_file, read_back, small_opts, write_image, Rng};

const CHUNK: usize = 64 << 10;

fn opts() -> ImageOptions {
    ImageOptions {
        compression: Compression::None,
        ..small_opts()
    }
}

fn tmpfs_dir() -> Option<tempfile::TempDir> {
    let shm = Path::new("/dev/shm");
    if !is_tmpfs(shm) {
        eprintln!("skipped: /dev/shm is not tmpfs");
        return None;
    }
    Some(tempfile::tempdir_in(shm).unwrap())
}

/// Zero chunks, repeated chunks, a short last chunk.
fn data() -> Vec<image_util::Alloc> {
    let mut rng = Rng(5);
    let mut with_zeros = rng.bytes(4 * CHUNK + 5);
    with_zeros[CHUNK..2 * CHUNK].fill(0);
    let repeated = [rng.bytes(CHUNK), rng.bytes(CHUNK)].concat().repeat(2);
    vec![
        alloc(0x7f00_0000_0000, with_zeros),
        alloc(0x7f00_1000_0000, repeated),
        alloc(0x7f00_2000_0000, rng.bytes(17)),
        alloc(0x7f00_3000_0000, vec![0; 3 * CHUNK]),
    ]
}

/// Chunk records without data-file places: (offset, len, crc, blake3, kind, first
/// chunk stored at the same place).
type Record = (u64, u64, Option<u32>, Option<String>, String);

fn records(m: &Manifest) -> Vec<Vec<Record>> {
    let mut first = std::collections::HashMap::new();
    let mut n = 0;
    m.allocations
        .iter()
        .map(|a| {
            a.chunks
                .iter()
                .map(|c| {
                    n += 1;
                    let at = match c.at {
                        Location::Zero => "zero".into(),
                        Location::Parent { .. } => "parent".into(),
                        Location::Data { file, offset, .. } => {
                            format!("data {}", first.entry((file, offset)).or_insert(n))
                        }
                    };
                    (c.offset, c.len, c.crc32c, c.blake3.map(|h| h.to_hex()), at)
                })
                .collect()
        })
        .collect()
}

/// Writes `allocs` through the direct file; with `staged_every`, every n-th chunk goes
/// through staging instead.
fn write_direct(
    dir: &Path,
    parent: Option<&Path>,
    allocs: &[image_util::Alloc],
    staged_every: Option<usize>,
) -> Manifest {
    let mut writer = ImageWriter::create(dir, parent, opts()).unwrap();
    let ids: Vec<_> = allocs
        .iter()
        .map(|a| {
            writer
                .begin_allocation(a.va, a.data.len() as u64, a.tags.clone())
                .unwrap()
        })
        .collect();
    assert_eq!(writer.direct_refusal(), None);
    let region = writer.start_direct().unwrap();
    let mut n = 0;
    // Last allocation first: any order works.
    for (a, id) in allocs.iter().zip(&ids).rev() {
        for (i, bytes) in a.data.chunks(CHUNK).enumerate() {
            let offset = (i * CHUNK) as u64;
            n += 1;
            if staged_every.is_some_and(|k| n % k == 0) {
                writer.write_chunk(*id, offset, bytes).unwrap();
                continue;
            }
            let chunk = writer.stage_direct(*id, offset).unwrap();
            assert_eq!(chunk.len(), bytes.len());
            assert_eq!(chunk.file_offset() % 4096, 0);
            let place = chunk.as_mut_ptr() as usize - region.base as usize;
            assert!(place + chunk.len() <= region.len);
            // SAFETY: the chunk's place in the mapping, ours until committed.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), chunk.as_mut_ptr(), bytes.len())
            };
            writer.commit_direct(chunk).unwrap();
        }
    }
    writer.finish().unwrap()
}

fn usage(dir: &Path) -> (u64, u64) {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".bin"))
        .map(|p| std::fs::metadata(p).unwrap())
        .fold((0, 0), |(b, l), m| (b + m.blocks() * 512, l + m.len()))
}

#[test]
fn a_direct_image_has_the_staged_records_and_reads_back() {
    let Some(root) = tmpfs_dir() else { return };
    let allocs = data();
    let reference = write_image(&root.path().join("ref"), None, opts(), &allocs);
    for (name, staged_every) in [("direct", None), ("mixed", Some(3))] {
        let dir = root.path().join(name);
        let manifest = write_direct(&dir, None, &allocs, staged_every);
        assert_eq!(records(&manifest), records(&reference), "{name}");
        let reader = ImageReader::open(&dir).unwrap();
        reader.verify(2).unwrap();
        for a in &allocs {
            assert_eq!(read_back(&reader, a.va, None).unwrap(), a.data, "{name}");
        }
        let names: Vec<_> = manifest.files.iter().map(|f| f.name.clone()).collect();
        let expect: Vec<_> = (0..names.len())
            .map(|i| format!("data-{i:03}.bin"))
            .collect();
        assert_eq!(names, expect, "{name}: renumbered");
    }
    // Zero and repeated chunks are holes in the direct file.
    let (blocks, len) = usage(&root.path().join("direct"));
    assert!(blocks < len, "{blocks} allocated of {len}");
    let (ref_blocks, _) = usage(&root.path().join("ref"));
    assert!(blocks <= ref_blocks + 4 * 4096, "{blocks} vs {ref_blocks}");
}

#[test]
fn a_direct_delta_image_refers_to_its_parent() {
    let Some(root) = tmpfs_dir() else { return };
    let allocs = data();
    let parent = root.path().join("parent");
    write_image(&parent, None, opts(), &allocs);
    let mut changed = data();
    changed[0].data[3] ^= 1;
    let reference = write_image(&root.path().join("ref"), Some(&parent), opts(), &changed);
    let dir = root.path().join("delta");
    let manifest = write_direct(&dir, Some(&parent), &changed, None);
    assert_eq!(records(&manifest), records(&reference));
    let reader = ImageReader::open(&dir).unwrap();
    for a in &changed {
        assert_eq!(read_back(&reader, a.va, None).unwrap(), a.data);
    }
    // One changed chunk stored; the rest are in the parent.
    assert_eq!(manifest.files.len(), 1);
    assert_eq!(manifest.files[0].size, CHUNK as u64);
}

#[test]
fn all_zero_memory_gives_no_data_file() {
    let Some(root) = tmpfs_dir() else { return };
    let allocs = vec![alloc(0x1000_0000, vec![0; 2 * CHUNK + 3])];
    let manifest = write_direct(&root.path().join("img"), None, &allocs, None);
    assert!(manifest.files.is_empty());
    assert!(ImageReader::open(&root.path().join("img")).is_ok());
}

#[test]
fn direct_is_refused_when_it_cannot_work() {
    let Some(root) = tmpfs_dir() else { return };
    let mut w = ImageWriter::create(&root.path().join("a"), None, small_opts()).unwrap();
    w.begin_allocation(0x1000, 10, Default::default()).unwrap();
    assert_eq!(w.direct_refusal(), Some(NoDirect::Compressed));
    assert!(w.start_direct().is_err());
    drop(w);

    let mut w = ImageWriter::create(&root.path().join("b"), None, opts()).unwrap();
    assert_eq!(w.direct_refusal(), Some(NoDirect::Empty));
    w.begin_allocation(0x1000, 10, Default::default()).unwrap();
    w.start_direct().unwrap();
    assert_eq!(w.direct_refusal(), Some(NoDirect::AlreadyDirect));
    // An allocation begun later has no place in the file.
    let late = w.begin_allocation(0x2000, 10, Default::default()).unwrap();
    assert!(w.stage_direct(late, 0).is_err());
    // Dropped unfinished: nothing stays.
    drop(w);
    assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 0);

    let disk = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    if !is_tmpfs(disk.path()) {
        let mut w = ImageWriter::create(&disk.path().join("c"), None, opts()).unwrap();
        w.begin_allocation(0x1000, 10, Default::default()).unwrap();
        assert_eq!(w.direct_refusal(), Some(NoDirect::NotTmpfs));
    }
}

#[test]
fn mapped_chunks_are_the_image_bytes_and_checked_in_place() {
    let Some(root) = tmpfs_dir() else { return };
    let allocs = data();
    let parent = root.path().join("parent");
    write_image(&parent, None, opts(), &allocs);
    let mut changed = data();
    changed[1].data[7] ^= 1;
    let dir = root.path().join("delta");
    write_direct(&dir, Some(&parent), &changed, Some(2));
    let reader = ImageReader::open(&dir).unwrap();
    assert_eq!(reader.direct_refusal(), None);
    let work: Vec<_> = (0..changed.len())
        .flat_map(|a| {
            let n = reader.allocations()[a].chunks.len();
            (0..n).map(move |i| (gpu_state::image::AllocId(a), i))
        })
        .collect();
    let mapped = reader.map_chunks(&work).unwrap();
    assert_eq!(mapped.len(), work.len());
    for (i, (id, index)) in work.iter().enumerate() {
        mapped.verify(i).unwrap();
        let c = mapped.chunk(i);
        let expect = &changed[id.0].data[index * CHUNK..][..c.len];
        match c.at {
            None => assert!(expect.iter().all(|&b| b == 0)),
            Some((map, offset)) => {
                let r = mapped.region(map).unwrap();
                assert!(offset as usize + c.len <= r.len);
                // SAFETY: inside the mapping, alive while `mapped` is.
                let got = unsafe { std::slice::from_raw_parts(r.base.add(offset as usize), c.len) };
                assert_eq!(got, expect);
            }
        }
    }
    drop(mapped);

    // A damaged byte of the image's first data file (map 0) shows in `verify`.
    let (i, offset) = {
        let m = reader.map_chunks(&work).unwrap();
        (0..work.len())
            .find_map(|i| match m.chunk(i).at {
                Some((0, offset)) => Some((i, offset)),
                _ => None,
            })
            .unwrap()
    };
    let file = dir.join(&reader.manifest().files[0].name);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[offset as usize] ^= 0x10;
    std::fs::write(&file, bytes).unwrap();
    let reader = ImageReader::open(&dir).unwrap();
    let mapped = reader.map_chunks(&work).unwrap();
    let err = mapped.verify(i).unwrap_err();
    assert!(
        matches!(err, ImageError::CorruptChunk { ref place, .. } if place.file == file && place.file_offset == offset),
        "{err}"
    );
    // The whole-image check reads it in place on tmpfs, and finds the same byte.
    let err = reader.verify(2).unwrap_err();
    assert!(
        matches!(err, ImageError::CorruptChunk { ref place, .. } if place.file == file && place.file_offset == offset),
        "{err}"
    );

    // Compressed or on a disk: refused.
    // (Per chunk: random bytes stay raw even in a zstd image, repeated ones shrink.)
    let z = root.path().join("z");
    write_image(&z, None, small_opts(), &[alloc(0x1000, vec![7; 2 * CHUNK])]);
    let reader = ImageReader::open(&z).unwrap();
    assert_eq!(reader.direct_refusal(), Some(NoDirect::Compressed));
    assert!(reader.map_chunks(&[]).is_err());
    let disk = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    if !is_tmpfs(disk.path()) {
        write_image(&disk.path().join("d"), None, opts(), &allocs);
        let reader = ImageReader::open(&disk.path().join("d")).unwrap();
        assert_eq!(reader.direct_refusal(), Some(NoDirect::NotTmpfs));
    }
}

#[test]
fn the_direct_file_is_allocated_up_front_and_trimmed_on_request() {
    let Some(root) = tmpfs_dir() else { return };
    let mut w = ImageWriter::create(&root.path().join("img"), None, opts()).unwrap();
    let id = w
        .begin_allocation(0x1000, 4 * CHUNK as u64, Default::default())
        .unwrap();
    w.start_direct().unwrap();
    let temp = std::fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .next()
        .unwrap();
    let file = temp.join("data-direct.bin");
    let blocks = || std::fs::metadata(&file).unwrap().blocks() * 512;
    assert_eq!(blocks(), 4 * CHUNK as u64, "fallocated");
    let (at, _) = w.direct_place(id, CHUNK as u64).unwrap();
    w.trim_direct(at).unwrap();
    assert_eq!(blocks(), CHUNK as u64, "the rest given back");
    // The first chunk still goes direct; the others staged.
    let chunk = w.stage_direct(id, 0).unwrap();
    // SAFETY: the chunk's place, ours until committed.
    unsafe { std::ptr::write_bytes(chunk.as_mut_ptr(), 3, chunk.len()) };
    w.commit_direct(chunk).unwrap();
    for i in 1..4 {
        w.write_chunk(id, (i * CHUNK) as u64, &vec![i as u8; CHUNK])
            .unwrap();
    }
    w.finish().unwrap();
    let reader = ImageReader::open(&root.path().join("img")).unwrap();
    let back = read_back(&reader, 0x1000, None).unwrap();
    assert!(back[..CHUNK].iter().all(|&b| b == 3));
    assert!(back[3 * CHUNK..].iter().all(|&b| b == 3));
}

/// Reads through mapped data files (what the hook's staged copy-in does on tmpfs) give
/// what `read(2)` gives, raw and compressed, across a parent chain, and still check
/// every chunk's CRC.
#[test]
fn mapped_reads_match_plain_reads_and_check_crcs() {
    let Some(root) = tmpfs_dir() else { return };
    let allocs = data();
    let parent = root.path().join("parent");
    // Compressed parent, raw child: both decoders read from the mapping.
    write_image(&parent, None, small_opts(), &allocs);
    let mut changed = data();
    changed[0].data[..CHUNK].fill(0x5a);
    let child = root.path().join("child");
    write_image(&child, Some(&parent), opts(), &changed);

    // Kept to huge pages only where the tmpfs holds them so (st_blksize 2 MiB).
    let huge = std::fs::read_dir(&child).unwrap().all(|e| {
        let p = e.unwrap().path();
        !p.to_string_lossy().ends_with(".bin") || p.metadata().unwrap().blksize() >= 2 << 20
    });
    let mut strict = ImageReader::open(&child).unwrap();
    assert_eq!(strict.map_data_files(true).unwrap(), huge);

    let plain = ImageReader::open(&child).unwrap();
    let mut mapped = ImageReader::open(&child).unwrap();
    assert!(mapped.map_data_files(false).unwrap());
    assert!(
        mapped.map_data_files(false).unwrap(),
        "mapping twice is harmless"
    );
    for a in &changed {
        let want = read_back(&plain, a.va, None).unwrap();
        assert_eq!(want, a.data);
        assert_eq!(read_back(&mapped, a.va, None).unwrap(), want, "{:#x}", a.va);
    }

    // A flipped byte (written in place, as damage would be) is caught through the map.
    let file = largest_data_file(&child);
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
        let mut byte = [0u8];
        std::fs::File::open(&file)
            .unwrap()
            .read_exact_at(&mut byte, 3)
            .unwrap();
        f.write_all_at(&[byte[0] ^ 1], 3).unwrap();
    }
    let mut damaged = ImageReader::open(&child).unwrap();
    assert!(damaged.map_data_files(false).unwrap());
    let err = changed
        .iter()
        .find_map(|a| read_back(&damaged, a.va, None).err())
        .expect("the damage is found");
    assert!(err.to_string().contains("CRC32C mismatch"), "{err}");

    // Off tmpfs nothing is mapped (reads keep readahead).
    let disk = tempfile::tempdir().unwrap();
    if !is_tmpfs(disk.path()) {
        let dir = disk.path().join("img");
        write_image(&dir, None, opts(), &allocs);
        let mut reader = ImageReader::open(&dir).unwrap();
        assert!(!reader.map_data_files(false).unwrap());
        assert_eq!(
            read_back(&reader, allocs[0].va, None).unwrap(),
            allocs[0].data
        );
    }
}

/// Each allocation starts on an 8 MiB boundary of the direct file, so a store that cuts the
/// file into 8 MiB slices finds an unchanged allocation in equal slices when one before it
/// grew, and the padding costs no memory once the image is finished.
#[test]
fn an_allocation_keeps_its_slices_when_an_earlier_one_changes() {
    const SLICE: u64 = 8 << 20;
    let Some(root) = tmpfs_dir() else { return };
    let mut rng = Rng(9);
    let weights = rng.bytes((9 << 20) + 123);
    let first = vec![
        alloc(0x7f00_0000_0000, rng.bytes(3 * CHUNK + 5)),
        alloc(0x7f00_4000_0000, weights.clone()),
    ];
    let second = vec![
        alloc(0x7f00_0000_0000, rng.bytes(5 * CHUNK + 77)),
        alloc(0x7f00_4000_0000, weights),
    ];
    let mut slices = Vec::new();
    for (name, allocs) in [("a", &first), ("b", &second)] {
        let dir = root.path().join(name);
        let m = write_direct(&dir, None, allocs, None);
        let Location::Data { file, offset, .. } = m.allocations[1].chunks[0].at else {
            panic!("the weights' first chunk is stored");
        };
        assert_eq!(offset % SLICE, 0, "{name}: the weights start at {offset}");
        let bytes = std::fs::read(dir.join(&m.files[file as usize].name)).unwrap();
        let at = offset as usize;
        slices.push(bytes[at..at + SLICE as usize].to_vec());
        let (blocks, len) = usage(&dir);
        assert!(
            blocks < len,
            "{name}: the padding is punched ({blocks} of {len})"
        );
        let reader = ImageReader::open(&dir).unwrap();
        for a in allocs {
            assert_eq!(read_back(&reader, a.va, None).unwrap(), a.data);
        }
    }
    assert!(slices[0] == slices[1], "the weights' first slice differs");
}
