//! A checkpoint the way containerd's client does not make one, for the GPU end-to-end script
//! (`tests/gpu/h200-e2e.sh`, scenario `s`): the shim's Checkpoint RPC over ttrpc with no Pause
//! around it (`ctr`, CRI and nerdctl always pause the task first), so gpucr takes its
//! leave-running snapshot path. And the layout `ctr container restore` reads, made from the
//! image directory that RPC wrote.
//!
//! ```text
//! shim-ckpt checkpoint ADDRESS_FILE NAMESPACE ID DIR [--exit]
//!     prints "checkpoint_ms=N"
//! shim-ckpt layout DIR IMAGE RUNTIME SPEC_JSON REFERENCE > layout.tar
//!     then: ctr image import --no-unpack layout.tar; ctr container restore --live ID REFERENCE
//! ```

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use gpucr_tests::image::CheckpointImage;
use gpucr_tests::shim_client::{checkpoint_over_ttrpc, connect, CheckpointFlags};

/// A GPU checkpoint of tens of GiB may take minutes.
const TIMEOUT_NS: i64 = 600_000_000_000;

const USAGE: &str = "usage: shim-ckpt checkpoint ADDRESS_FILE NAMESPACE ID DIR [--exit]\n       \
shim-ckpt layout DIR IMAGE RUNTIME SPEC_JSON REFERENCE > layout.tar";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["checkpoint", address, ns, id, dir] => checkpoint(address, ns, id, dir, false),
        ["checkpoint", address, ns, id, dir, "--exit"] => checkpoint(address, ns, id, dir, true),
        ["layout", dir, image, runtime, spec, reference] => {
            layout(dir, image, runtime, spec, reference)
        }
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("shim-ckpt: {e}");
            ExitCode::FAILURE
        }
    }
}

fn checkpoint(
    address_file: &str,
    ns: &str,
    id: &str,
    dir: &str,
    exit: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let address = std::fs::read_to_string(address_file)
        .map_err(|e| format!("reading the shim's address from {address_file}: {e}"))?;
    let (client, ctx) = connect(address.trim(), ns, TIMEOUT_NS)?;
    let flags = CheckpointFlags {
        exit,
        ..Default::default()
    };
    let t = Instant::now();
    checkpoint_over_ttrpc(&client, ctx, id, Path::new(dir), &flags)?;
    println!("checkpoint_ms={}", t.elapsed().as_millis());
    Ok(())
}

fn layout(
    dir: &str,
    image: &str,
    runtime: &str,
    spec: &str,
    reference: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let spec_json = std::fs::read(spec).map_err(|e| format!("reading {spec}: {e}"))?;
    let checkpoint = CheckpointImage {
        image: image.to_owned(),
        runtime: runtime.to_owned(),
        snapshotter: "overlayfs".to_owned(),
        criu_tar: CheckpointImage::tar_dump_dir(Path::new(dir))?,
        spec_any: CheckpointImage::spec_any_from_json(&spec_json)?,
        rw_layer: None,
    };
    std::io::stdout().write_all(&checkpoint.layout_tar(reference)?)?;
    Ok(())
}
