//! Cooperation with the gpucr shim, which quiesces its containers' CUDA processes itself
//! (the hook's fast path, then the driver) before `runc checkpoint`, and gives them their
//! GPU state back after `runc restore`. It says so in runc's environment, which runc hands
//! to CRIU: `GPUCR_SHIM_QUIESCED` holds the host pids it quiesced (a dump) or `all` (a
//! restore). Those processes are the shim's: this plugin leaves them alone, and handles
//! any other CUDA process as it would under plain runc, podman or CRI-O.

/// The variable the shim sets (the shim's `gpu::SHIM_QUIESCED_ENV`).
pub const ENV: &str = "GPUCR_SHIM_QUIESCED";

/// What the shim said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Quiesced {
    /// Not under the gpucr shim (or it quiesced nothing): every CUDA process is ours.
    None,
    /// These host pids are the shim's.
    Pids(Vec<i32>),
    /// Every process is the shim's.
    All,
}

impl Quiesced {
    pub fn parse(value: Option<&str>) -> Quiesced {
        match value.map(str::trim) {
            None | Some("") => Quiesced::None,
            Some("all") => Quiesced::All,
            Some(list) => Quiesced::Pids(
                list.split(',')
                    .filter_map(|p| p.trim().parse().ok())
                    .collect(),
            ),
        }
    }

    pub fn from_env() -> Quiesced {
        Quiesced::parse(std::env::var(ENV).ok().as_deref())
    }

    /// Whether `pid` is the shim's to handle.
    pub fn covers(&self, pid: i32) -> bool {
        match self {
            Quiesced::None => false,
            Quiesced::Pids(p) => p.contains(&pid),
            Quiesced::All => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shims_word_is_parsed() {
        assert_eq!(Quiesced::parse(None), Quiesced::None);
        assert_eq!(Quiesced::parse(Some("")), Quiesced::None);
        assert!(Quiesced::parse(Some("all")).covers(1));
        let q = Quiesced::parse(Some("7,42"));
        assert!(q.covers(42) && q.covers(7) && !q.covers(8));
        assert!(!Quiesced::None.covers(7));
    }
}
