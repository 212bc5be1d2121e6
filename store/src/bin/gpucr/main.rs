//! `gpucr`: the operator's view of a node's gpucr store — what checkpoints it holds and what
//! they cost, checking every chunk, retention, and moving checkpoints to and from a shared
//! store; the node's log of checkpoints and restores.

mod bar;
mod events;

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use gpucr_store::events::{DEFAULT_EVENT_LOG, EVENT_LOG_ENV};
use gpucr_store::references::{referenced_manifests, DEFAULT_PLACES};
use gpucr_store::remote::DEFAULT_PARALLEL;
use gpucr_store::{dir, DirRef, IngestOptions, RefMode, Remote, Retention, Store, StoreError};

#[derive(Parser)]
#[command(
    name = "gpucr",
    version,
    about = "gpucr's checkpoint store on this node"
)]
struct Cli {
    /// The node's store.
    #[arg(long, env = "GPUCR_STORE", default_value = "/var/lib/gpucr/store")]
    store: PathBuf,
    /// The node's event log, which the shims append to.
    #[arg(long, env = EVENT_LOG_ENV, default_value = DEFAULT_EVENT_LOG)]
    event_log: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Checkpoints in the store: chunks, logical size, bytes only they hold, age.
    Ls,
    /// One checkpoint's manifest, as JSON.
    Inspect { name: String },
    /// Every chunk against its digest and every checkpoint's chunks present; exits 1 otherwise.
    Validate {
        #[arg(long, default_value_t = default_threads())]
        threads: usize,
    },
    /// Removes checkpoints beyond the newest N per container (and the chunks only they hold),
    /// keeping every one a checkpoint still held by containerd or kubelet names.
    Gc {
        #[arg(long)]
        keep_last: usize,
        /// A checkpoint to keep whatever its age (repeatable).
        #[arg(long = "pin")]
        pinned: Vec<String>,
        /// Where checkpoints that may reference the store are kept: files, directories or
        /// tar archives searched for gpucr-store.json (repeatable; default containerd's
        /// content store and kubelet's checkpoint directory).
        #[arg(long = "referenced-in", default_values_t = DEFAULT_PLACES.map(String::from))]
        referenced_in: Vec<String>,
    },
    /// Copies a checkpoint and its chunks to a shared store: a directory other nodes mount, or
    /// s3://BUCKET[/PREFIX] (endpoint and credentials from AWS_* variables).
    Push {
        name: String,
        #[arg(long)]
        to: String,
        #[arg(long, default_value_t = DEFAULT_PARALLEL)]
        parallel: usize,
    },
    /// Fetches a checkpoint and the chunks this node lacks from a shared store.
    Pull {
        name: String,
        #[arg(long)]
        from: String,
        #[arg(long, default_value_t = DEFAULT_PARALLEL)]
        parallel: usize,
    },
    /// The store's totals (checkpoints, chunks, bytes held, bytes without sharing) and the
    /// event log's (checkpoints and restores, failed ones, mean durations).
    Report,
    /// The node's checkpoints and restores from the event log, oldest first.
    Events {
        /// Only the newest N.
        #[arg(long)]
        last: Option<usize>,
        /// Only this container's.
        #[arg(long)]
        container: Option<String>,
        /// The log's JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Makes a by-reference checkpoint directory self-contained (its files back from the
    /// store, pulled first from a shared store with --from): for copying it elsewhere, a
    /// kubelet archive or `ctr image push`.
    Export {
        dir: PathBuf,
        #[arg(long)]
        from: Option<String>,
        #[arg(long, default_value_t = default_threads())]
        threads: usize,
    },
    /// Puts a self-contained checkpoint directory's large files into the store (the
    /// directory keeps gpucr-store.json naming them), as a checkpoint with io.gpucr.store=local.
    Import {
        dir: PathBuf,
        /// The store manifest's name, CONTAINER/LABEL (retention counts per CONTAINER).
        #[arg(long)]
        name: String,
        /// Files smaller than this stay in the directory.
        #[arg(long, default_value_t = 1 << 20)]
        min_size: u64,
        #[arg(long, default_value_t = default_threads())]
        threads: usize,
    },
}

fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(4, |n| n.get())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("GPUCR_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("gpucr: {e}");
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode, StoreError> {
    // The log needs no store on the node.
    if let Command::Events {
        last,
        container,
        json,
    } = cli.command
    {
        events::print(&cli.event_log, last, container.as_deref(), json)?;
        return Ok(ExitCode::SUCCESS);
    }
    let store = Store::open(&cli.store)?;
    match cli.command {
        Command::Ls => {
            let usage = store.usage()?;
            println!(
                "{:<48} {:>7} {:>10} {:>10} {:>8}  {:<7} WHERE",
                "NAME", "CHUNKS", "SIZE", "UNIQUE", "AGE", "MODE"
            );
            for m in &usage.manifests {
                let meta = |k: &str| m.manifest.meta.get(k).and_then(|v| v.as_str());
                let place = match (meta("shared"), meta("node")) {
                    (Some(s), _) => format!("shared {s}"),
                    (None, Some(n)) => format!("node {n}"),
                    (None, None) => "-".into(),
                };
                println!(
                    "{:<48} {:>7} {:>10} {:>10} {:>8}  {:<7} {place}",
                    m.manifest.name,
                    m.manifest.chunks.len(),
                    bytes(m.manifest.logical_bytes()),
                    bytes(m.unique_bytes),
                    age(m.manifest.created_unix_ms),
                    meta("mode").unwrap_or("-"),
                );
            }
        }
        Command::Inspect { name } => {
            let m = store.manifest(&name)?;
            println!(
                "{}",
                serde_json::to_string_pretty(&m).expect("manifest serialises")
            );
        }
        Command::Validate { threads } => {
            let r = store.validate(threads)?;
            for path in &r.damaged {
                println!("damaged: {}", path.display());
            }
            for (name, c) in &r.missing {
                println!("missing: {name}: chunk {} ({} bytes)", c.digest, c.len);
            }
            println!(
                "{} chunks, {} checked: {}",
                r.chunks_checked,
                bytes(r.bytes_checked),
                if r.is_clean() { "clean" } else { "NOT clean" }
            );
            if !r.is_clean() {
                return Ok(ExitCode::from(1));
            }
        }
        Command::Gc {
            keep_last,
            pinned,
            referenced_in,
        } => {
            let places: Vec<PathBuf> = referenced_in.iter().map(PathBuf::from).collect();
            let refs = referenced_manifests(&places)?;
            for holder in &refs.unreadable {
                eprintln!(
                    "gpucr: unreadable reference (not pinned): {}",
                    holder.display()
                );
            }
            println!(
                "{} checkpoints referenced by {} held checkpoints: kept",
                refs.manifests.len(),
                refs.holders.len()
            );
            let mut pinned: HashSet<String> = pinned.into_iter().collect();
            pinned.extend(refs.manifests);
            let r = store.gc(&Retention { keep_last, pinned })?;
            for name in &r.manifests_removed {
                println!("removed: {name}");
            }
            println!(
                "{} chunks freed, {}",
                r.chunks_removed,
                bytes(r.bytes_freed)
            );
        }
        Command::Push { name, to, parallel } => {
            let remote = Remote::open(&to)?;
            let bar = bar::for_terminal(&format!("pushing {name}"));
            let t = runtime().block_on(remote.push_with(&store, &name, parallel, bar.as_ref()))?;
            println!(
                "pushed {name} to {}: {} sent, {} chunks already there",
                remote.label(),
                bytes(t.bytes),
                t.chunks_present
            );
        }
        Command::Pull {
            name,
            from,
            parallel,
        } => {
            let remote = Remote::open(&from)?;
            let bar = bar::for_terminal(&format!("pulling {name}"));
            let t = runtime().block_on(remote.pull_with(&store, &name, parallel, bar.as_ref()))?;
            println!(
                "pulled {name} from {}: {} fetched, {} chunks already here",
                remote.label(),
                bytes(t.bytes),
                t.chunks_present
            );
        }
        Command::Report => {
            let u = store.usage()?;
            println!(
                "store:       {} (id {})",
                store.root().display(),
                store.id()
            );
            println!("checkpoints: {}", u.manifests.len());
            println!("chunks:      {} ({})", u.chunks, bytes(u.chunk_bytes));
            println!("logical:     {}", bytes(u.logical_bytes));
            if u.chunk_bytes > 0 {
                println!(
                    "sharing:     {:.2}x",
                    u.logical_bytes as f64 / u.chunk_bytes as f64
                );
            }
            match events::summary(&cli.event_log) {
                Ok(lines) => lines.iter().for_each(|l| println!("{l}")),
                Err(e) => eprintln!("gpucr: {e}"),
            }
        }
        Command::Export { dir, from, threads } => {
            let Some(r) = DirRef::read(&dir)? else {
                println!("{} is self-contained already", dir.display());
                return Ok(ExitCode::SUCCESS);
            };
            if let Some(from) = from {
                let remote = Remote::open(&from)?;
                let bar = bar::for_terminal(&format!("pulling {}", r.manifest));
                let t = runtime().block_on(remote.pull_files_with(
                    &store,
                    &r.manifest,
                    &r.file_layout(),
                    DEFAULT_PARALLEL,
                    bar.as_ref(),
                ))?;
                println!("pulled {}: {} fetched", r.manifest, bytes(t.bytes));
            }
            let bar = bar::for_terminal(&format!("exporting {}", dir.display()));
            dir::materialize_with(&store, &dir, threads, bar.as_ref())?;
            println!(
                "exported {}: {} files, {} back in the directory",
                dir.display(),
                r.files.len(),
                bytes(r.bytes())
            );
        }
        Command::Events { .. } => unreachable!("answered before the store is opened"),
        Command::Import {
            dir,
            name,
            min_size,
            threads,
        } => {
            let opts = IngestOptions {
                min_size,
                mode: RefMode::Local,
                shared: None,
                threads,
                // Files on the store's filesystem go in by a link; they leave the directory anyway.
                adopt: true,
                cut_by_content: dir::criu_pages,
            };
            let bar = bar::for_terminal(&format!("importing {}", dir.display()));
            let got = dir::ingest_with(&store, &dir, &name, &opts, bar.as_ref())?;
            println!(
                "imported {} as {name}: {} files, {} ({} new in the store)",
                dir.display(),
                got.dir_ref.files.len(),
                bytes(got.dir_ref.bytes()),
                bytes(got.written_bytes)
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

pub(crate) fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

fn age(created_unix_ms: u64) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default();
    let s = now.saturating_sub(created_unix_ms) / 1000;
    match s {
        0..=119 => format!("{s}s"),
        120..=7199 => format!("{}m", s / 60),
        7200..=172_799 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}
