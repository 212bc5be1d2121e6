use std::io::{Read, Write};

use containerd_shim::{protos::protobuf::Message, Config};
use gpucr_shim::{service, RUNTIME_ID};

#[tokio::main]
async fn main() {
    // -v and -info run without containerd's environment (TTRPC_ADDRESS…), which the
    // crate's `run` requires before it looks at any flag.
    let args: Vec<String> = std::env::args().collect();
    if let Ok(flags) = containerd_shim::parse(&args[1..]) {
        if flags.version {
            print!("{}", service::version_text(&args[0]));
            return;
        }
        if flags.info {
            if let Err(e) = write_runtime_info() {
                eprintln!("{RUNTIME_ID}: -info: {e}");
                std::process::exit(1);
            }
            return;
        }
    }
    // Our own reaper (reaper.rs) and tracing logger replace the crate's.
    let config = Config {
        no_setup_logger: true,
        no_reaper: true,
        ..Default::default()
    };
    containerd_shim::run::<service::Service>(RUNTIME_ID, Some(config)).await;
}

/// The runtime options on stdin, the `RuntimeInfo` protobuf on stdout.
fn write_runtime_info() -> Result<(), Box<dyn std::error::Error>> {
    let mut stdin = Vec::new();
    std::io::stdin().read_to_end(&mut stdin)?;
    let info = service::runtime_info(&stdin)?;
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(&info.write_to_bytes()?)?;
    stdout.flush()?;
    Ok(())
}
