//! GPU state image: an interrupted write never looks like an image.

mod image_util;

use gpu_state::image::{
    image_state, AllocationTags, ImageError, ImageReader, ImageState, ImageWriter,
};
use image_util::{alloc, small_opts, write_image, Rng};

#[test]
fn dropping_the_writer_publishes_nothing_and_leaves_nothing() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("gpu-state");
    let mut writer = ImageWriter::create(&dir, None, small_opts()).unwrap();
    let id = writer
        .begin_allocation(0x1000, 1 << 20, AllocationTags::default())
        .unwrap();
    writer.write_chunk(id, 0, &Rng(1).bytes(64 << 10)).unwrap();
    assert_eq!(
        image_state(&dir),
        ImageState::Missing,
        "nothing at the final name while writing"
    );
    let temps: Vec<_> = std::fs::read_dir(root.path()).unwrap().flatten().collect();
    assert_eq!(temps.len(), 1);
    let temp = temps[0].path();
    assert!(matches!(image_state(&temp), ImageState::Incomplete { .. }));
    assert!(matches!(
        ImageReader::open(&temp),
        Err(ImageError::Incomplete { .. })
    ));
    drop(writer);
    assert_eq!(image_state(&dir), ImageState::Missing);
    assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 0);
}

#[test]
fn leftovers_of_a_crashed_writer_are_refused_and_cleaned() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("gpu-state");
    // A writer killed mid-way: pid 2^22+ is above Linux's pid_max default, so not alive.
    let stale = root.path().join(".gpu-state.tmp-4194305-0badf00d");
    std::fs::create_dir(&stale).unwrap();
    std::fs::write(stale.join("data-000.bin"), b"partial").unwrap();
    std::fs::write(stale.join("manifest.json"), b"{}").unwrap();
    assert!(matches!(image_state(&stale), ImageState::Incomplete { .. }));
    assert!(matches!(
        ImageReader::open(&stale),
        Err(ImageError::Incomplete { .. })
    ));

    // A live writer's temp (our own pid) must be left alone.
    let live = root
        .path()
        .join(format!(".gpu-state.tmp-{}-12345678", std::process::id()));
    std::fs::create_dir(&live).unwrap();

    let data = Rng(2).bytes(100_000);
    write_image(&dir, None, small_opts(), &[alloc(0x2000, data)]);
    assert!(!stale.exists(), "stale temporary directory removed");
    assert!(live.exists(), "a running writer's directory is kept");
    assert_eq!(image_state(&dir), ImageState::Complete);
}

#[test]
fn a_directory_without_manifest_is_incomplete_and_existing_images_are_not_overwritten() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("gpu-state");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("data-000.bin"), b"x").unwrap();
    let err = ImageReader::open(&dir).err().unwrap();
    assert!(
        matches!(
            err,
            ImageError::Incomplete {
                reason: "no manifest",
                ..
            }
        ),
        "{err}"
    );
    let err = ImageWriter::create(&dir, None, small_opts()).err().unwrap();
    assert!(matches!(err, ImageError::AlreadyExists { .. }), "{err}");
    let err = ImageReader::open(&root.path().join("absent"))
        .err()
        .unwrap();
    assert!(err.to_string().contains("absent"), "{err}");
}
