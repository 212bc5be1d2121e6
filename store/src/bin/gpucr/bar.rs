//! A progress bar on stderr for the CLI's long transfers, only when stderr is a terminal: a
//! script or a log sees the same output as without it.

use std::io::IsTerminal;

use gpucr_store::{NoProgress, Progress};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

struct Bar(ProgressBar);

impl Progress for Bar {
    fn start(&self, total: u64) {
        self.0.set_length(total);
        self.0.reset_elapsed();
        // Drawn from here on: before its length is known the bar would show 0/0 as done.
        self.0.set_draw_target(ProgressDrawTarget::stderr());
    }

    fn advance(&self, bytes: u64) {
        self.0.inc(bytes);
    }

    fn finish(&self) {
        // The command prints its own summary line.
        self.0.finish_and_clear();
    }
}

/// A bar labelled `what` on a terminal, else nothing.
pub fn for_terminal(what: &str) -> Box<dyn Progress> {
    if !std::io::stderr().is_terminal() {
        return Box::new(NoProgress);
    }
    let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::hidden());
    let style = ProgressStyle::with_template(
        "{msg} [{bar:30}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}",
    )
    .expect("the template parses")
    .progress_chars("=> ");
    bar.set_style(style);
    bar.set_message(what.to_string());
    Box::new(Bar(bar))
}
