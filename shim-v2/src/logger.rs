//! Logs go to the `log` FIFO that containerd opens in the shim's working directory (the
//! bundle), so they appear in containerd's own log; `tracing` spans carry container ids.

use std::{fs::OpenOptions, sync::Mutex};

use tracing_subscriber::{fmt, EnvFilter};

/// Installs the subscriber once. `debug` comes from containerd's `-debug` flag.
pub fn init(debug: bool) {
    let level = if debug { "debug" } else { "info" };
    let filter = EnvFilter::try_from_env("GPUCR_LOG").unwrap_or_else(|_| EnvFilter::new(level));
    let builder = fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_target(false);
    // containerd holds the reader open, so opening for write does not block.
    let res = match OpenOptions::new().write(true).open("log") {
        Ok(fifo) => builder.with_writer(Mutex::new(fifo)).try_init(),
        Err(_) => builder.with_writer(std::io::stderr).try_init(),
    };
    if let Err(e) = res {
        eprintln!("gpucr: logger already set: {e}");
    }
}
