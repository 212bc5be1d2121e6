use containerd_shim::Config;
use gpucr_shim::{service::Service, RUNTIME_ID};

#[tokio::main]
async fn main() {
    // Our own reaper (reaper.rs) and tracing logger replace the crate's.
    let config = Config {
        no_setup_logger: true,
        no_reaper: true,
        ..Default::default()
    };
    containerd_shim::run::<Service>(RUNTIME_ID, Some(config)).await;
}
