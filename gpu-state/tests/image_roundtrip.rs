//! GPU state image: round trips, zero elision, dedup, the Write sink, usage errors and
//! the staging-buffer bound.

mod image_util;

use std::io::Write;

use gpu_state::image::{
    image_state, AllocationTags, Codec, Compression, ImageError, ImageOptions, ImageReader,
    ImageState, ImageWriter, Location,
};
use image_util::{alloc, read_back, small_opts, write_image, Rng};

const CHUNK: usize = 64 << 10;

#[test]
fn round_trip_of_several_allocations() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("gpu-state");
    let mut rng = Rng(7);
    let pattern: Vec<u8> = (0..3 * CHUNK + 17).map(|i| (i % 251) as u8).collect();
    let allocs = vec![
        alloc(0x7f00_0000_0000, rng.bytes(5 * CHUNK + 123)),
        alloc(0x7f00_1000_0000, Vec::new()),
        alloc(0x7f00_2000_0000, pattern),
        alloc(0x7f00_3000_0000, rng.bytes(100)),
        alloc(0x7f00_4000_0000, rng.bytes(CHUNK)),
    ];
    let manifest = write_image(&dir, None, small_opts(), &allocs);
    assert_eq!(manifest.allocations.len(), 5);
    assert_eq!(image_state(&dir), ImageState::Complete);

    let reader = ImageReader::open(&dir).unwrap();
    for a in &allocs {
        assert_eq!(
            read_back(&reader, a.va, None).unwrap(),
            a.data,
            "allocation {:#x}",
            a.va
        );
        let id = reader.find(a.va, None).unwrap();
        let mut buf = vec![0xaau8; a.data.len()];
        reader.read_allocation_into(id, &mut buf, 3).unwrap();
        assert_eq!(buf, a.data);
    }
    let id = reader.find(0x7f00_0000_0000, None).unwrap();
    let mut chunk = vec![0u8; CHUNK];
    let n = reader.read_chunk_into(id, 5, &mut chunk).unwrap();
    assert_eq!(&chunk[..n], &allocs[0].data[5 * CHUNK..]);

    let summary = reader.verify(2).unwrap();
    let logical: u64 = allocs.iter().map(|a| a.data.len() as u64).sum();
    assert_eq!(summary.logical_bytes, logical);
    assert_eq!(
        summary.zero_bytes + summary.parent_bytes + summary.dedup_bytes + summary.unique_bytes,
        logical
    );
    assert!(
        summary.stored_bytes < logical,
        "the pattern compresses: {summary}"
    );
    assert_eq!(summary.chain_depth, 0);
}

#[test]
fn incompressible_chunks_are_stored_raw_and_compression_can_be_off() {
    let root = tempfile::tempdir().unwrap();
    let mut rng = Rng(11);
    let data = rng.bytes(2 * CHUNK + 5);
    for (name, compression) in [
        ("zstd", Compression::Zstd { level: 1 }),
        ("none", Compression::None),
    ] {
        let dir = root.path().join(name);
        let opts = ImageOptions {
            compression,
            ..small_opts()
        };
        let manifest = write_image(&dir, None, opts, &[alloc(0x1000, data.clone())]);
        for chunk in &manifest.allocations[0].chunks {
            assert!(
                matches!(
                    chunk.at,
                    Location::Data {
                        codec: Codec::Raw,
                        ..
                    }
                ),
                "{chunk:?}"
            );
        }
        let reader = ImageReader::open(&dir).unwrap();
        assert_eq!(read_back(&reader, 0x1000, None).unwrap(), data);
    }
}

#[test]
fn all_zero_chunks_are_not_stored() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("gpu-state");
    let mut partly = vec![0u8; 3 * CHUNK];
    partly[CHUNK + 9] = 1;
    let allocs = [
        alloc(0x10_0000, vec![0u8; 8 << 20]),
        alloc(0x90_0000, partly.clone()),
    ];
    let manifest = write_image(&dir, None, small_opts(), &allocs);
    assert!(manifest.allocations[0]
        .chunks
        .iter()
        .all(|c| c.at == Location::Zero));
    let reader = ImageReader::open(&dir).unwrap();
    let summary = reader.inspect();
    assert_eq!(summary.zero_bytes, (8 << 20) + 2 * CHUNK as u64);
    assert!(
        summary.stored_bytes < 1024,
        "only one nearly-zero chunk is stored: {summary}"
    );
    assert_eq!(read_back(&reader, 0x10_0000, None).unwrap(), allocs[0].data);
    assert_eq!(read_back(&reader, 0x90_0000, None).unwrap(), partly);
}

#[test]
fn identical_chunks_are_stored_once() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("gpu-state");
    let mut rng = Rng(3);
    let block = rng.bytes(CHUNK);
    let repeated: Vec<u8> = block.iter().copied().cycle().take(10 * CHUNK).collect();
    let allocs = [
        alloc(0x100_0000, repeated.clone()),
        alloc(0x200_0000, repeated.clone()),
        alloc(0x300_0000, block.clone()),
    ];
    write_image(
        &dir,
        None,
        ImageOptions {
            compression: Compression::None,
            ..small_opts()
        },
        &allocs,
    );
    let reader = ImageReader::open(&dir).unwrap();
    let summary = reader.verify(2).unwrap();
    assert_eq!(summary.unique_bytes, CHUNK as u64);
    assert_eq!(summary.stored_bytes, CHUNK as u64);
    assert_eq!(summary.dedup_bytes, 20 * CHUNK as u64);
    for a in &allocs {
        assert_eq!(read_back(&reader, a.va, None).unwrap(), a.data);
    }
}

#[test]
fn same_address_in_two_processes_and_tags_round_trip() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("gpu-state");
    let mut rng = Rng(5);
    let tags = |pid, device| AllocationTags {
        pid: Some(pid),
        device: Some(device),
        labels: [("kind".to_string(), "weights".to_string())].into(),
    };
    let (a, b) = (rng.bytes(1000), rng.bytes(2000));
    let mut writer = ImageWriter::create(&dir, None, small_opts()).unwrap();
    let ia = writer.begin_allocation(0x5000, 1000, tags(10, 0)).unwrap();
    let ib = writer.begin_allocation(0x5000, 2000, tags(11, 1)).unwrap();
    writer.write_chunk(ib, 0, &b).unwrap();
    writer.write_chunk(ia, 0, &a).unwrap();
    writer.finish().unwrap();
    let reader = ImageReader::open(&dir).unwrap();
    assert_eq!(read_back(&reader, 0x5000, Some(10)).unwrap(), a);
    assert_eq!(read_back(&reader, 0x5000, Some(11)).unwrap(), b);
    assert_eq!(reader.allocations()[1].tags, tags(11, 1));
    assert!(reader.find(0x5000, None).is_none());
}

#[test]
fn write_sink_accepts_any_write_sizes() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("gpu-state");
    let mut rng = Rng(9);
    let data = rng.bytes(4 * CHUNK + 999);
    let mut writer = ImageWriter::create(&dir, None, small_opts()).unwrap();
    let id = writer
        .begin_allocation(0xa000_0000, data.len() as u64, AllocationTags::default())
        .unwrap();
    let empty = writer
        .begin_allocation(0xb000_0000, 0, AllocationTags::default())
        .unwrap();
    let mut sink = writer.allocation_writer(id).unwrap();
    let mut rest = &data[..];
    while !rest.is_empty() {
        let n = (rng.below(20_000) as usize + 1).min(rest.len());
        sink.write_all(&rest[..n]).unwrap();
        rest = &rest[n..];
    }
    assert!(
        sink.write(b"x").is_err(),
        "no room past the allocation's end"
    );
    sink.close().unwrap();
    writer.allocation_writer(empty).unwrap().close().unwrap();
    writer.finish().unwrap();
    let reader = ImageReader::open(&dir).unwrap();
    assert_eq!(read_back(&reader, 0xa000_0000, None).unwrap(), data);
    assert_eq!(
        read_back(&reader, 0xb000_0000, None).unwrap(),
        Vec::<u8>::new()
    );
}

#[test]
fn misuse_is_refused_and_an_unfinished_allocation_publishes_nothing() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("gpu-state");
    let mut writer = ImageWriter::create(&dir, None, small_opts()).unwrap();
    let id = writer
        .begin_allocation(0x10000, 3 * CHUNK as u64, AllocationTags::default())
        .unwrap();
    let overlap = writer.begin_allocation(0x10000 + CHUNK as u64, 10, AllocationTags::default());
    assert!(matches!(overlap, Err(ImageError::Usage(_))), "{overlap:?}");
    assert!(
        writer.write_chunk(id, 1, &[0; 10]).is_err(),
        "unaligned offset"
    );
    assert!(writer.write_chunk(id, 0, &[1; 10]).is_err(), "short chunk");
    assert!(
        writer.write_chunk(id, 3 * CHUNK as u64, &[1; 10]).is_err(),
        "past the end"
    );
    writer.write_chunk(id, 0, &vec![1; CHUNK]).unwrap();
    assert!(
        writer.write_chunk(id, 0, &vec![1; CHUNK]).is_err(),
        "written twice"
    );
    let err = writer.finish().unwrap_err();
    assert!(
        matches!(err, ImageError::MissingChunks { offset, .. } if offset == CHUNK as u64),
        "{err}"
    );
    assert_eq!(image_state(&dir), ImageState::Missing);
    assert_eq!(
        std::fs::read_dir(root.path()).unwrap().count(),
        0,
        "temporary directory removed"
    );
}

#[test]
fn staging_buffers_stay_within_the_limit() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("gpu-state");
    let chunk = 4 << 20;
    let opts = ImageOptions {
        chunk_size: chunk,
        compression: Compression::Zstd { level: 1 },
        threads: 2,
        max_in_flight: 4,
        align: 0,
    };
    let total: u64 = 256 << 20;
    let mut writer = ImageWriter::create(&dir, None, opts).unwrap();
    let id = writer
        .begin_allocation(0x7000_0000_0000, total, AllocationTags::default())
        .unwrap();
    for (i, offset) in (0..total).step_by(chunk).enumerate() {
        writer
            .write_chunk_with(id, offset, |buf| {
                buf.fill(i as u8 | 1);
                buf[..8].copy_from_slice(&offset.to_le_bytes());
                Ok(())
            })
            .unwrap();
        let stats = writer.stats();
        assert!(
            stats.buffers_allocated <= 4 && stats.peak_in_flight <= 4,
            "{stats:?}"
        );
    }
    let stats = writer.stats();
    assert!(stats.peak_in_flight >= 1);
    writer.finish().unwrap();
    let reader = ImageReader::open(&dir).unwrap();
    let summary = reader.verify(2).unwrap();
    assert_eq!(summary.logical_bytes, total);
    assert!(summary.stored_bytes < total / 100, "{summary}");
}
