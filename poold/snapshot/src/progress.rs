//! Progress of long byte-counted work (transfers, ingests): an indicatif bar
//! (bytes, rate, ETA) when stderr is a terminal, otherwise a plain line every few seconds (logs, CI), or
//! nothing at all.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often the plain mode prints.
const PLAIN_INTERVAL: Duration = Duration::from_secs(2);

/// Progress of one transfer phase, counted in bytes. Thread-safe.
pub struct Progress {
    label: String,
    mode: Mode,
    done: AtomicU64,
    total: AtomicU64,
    start: Instant,
    last_line: Mutex<Instant>,
}

enum Mode {
    Bar(ProgressBar),
    Plain,
    Quiet,
}

impl Progress {
    /// A bar on a terminal, plain lines otherwise; nothing when `quiet`.
    pub fn new(label: &str, quiet: bool) -> Progress {
        let mode = if quiet {
            Mode::Quiet
        } else if std::io::stderr().is_terminal() {
            let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template(
                    "{msg:>12} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}",
                )
                .expect("valid template")
                .progress_chars("=> "),
            );
            bar.set_message(label.to_string());
            Mode::Bar(bar)
        } else {
            Mode::Plain
        };
        Progress {
            label: label.to_string(),
            mode,
            done: AtomicU64::new(0),
            total: AtomicU64::new(0),
            start: Instant::now(),
            last_line: Mutex::new(Instant::now()),
        }
    }

    /// A progress that shows nothing.
    pub fn quiet() -> Progress {
        Progress::new("", true)
    }

    /// Sets the number of bytes this phase will move.
    pub fn set_total(&self, bytes: u64) {
        self.total.store(bytes, Ordering::Relaxed);
        if let Mode::Bar(b) = &self.mode {
            b.set_length(bytes);
        }
    }

    /// Counts `bytes` more done.
    pub fn inc(&self, bytes: u64) {
        let done = self.done.fetch_add(bytes, Ordering::Relaxed) + bytes;
        match &self.mode {
            Mode::Bar(b) => b.inc(bytes),
            Mode::Plain => {
                let mut last = self.last_line.lock().unwrap();
                if last.elapsed() >= PLAIN_INTERVAL {
                    *last = Instant::now();
                    eprintln!("{}", self.line(done));
                }
            }
            Mode::Quiet => {}
        }
    }

    /// Ends the phase, printing a last line unless quiet.
    pub fn finish(&self) {
        match &self.mode {
            Mode::Bar(b) => b.finish_and_clear(),
            Mode::Plain => eprintln!("{}", self.line(self.done.load(Ordering::Relaxed))),
            Mode::Quiet => {}
        }
    }

    fn line(&self, done: u64) -> String {
        let total = self.total.load(Ordering::Relaxed);
        let secs = self.start.elapsed().as_secs_f64().max(1e-3);
        let rate = done as f64 / secs;
        let pct = if total > 0 {
            format!(" ({:.0}%)", done as f64 * 100.0 / total as f64)
        } else {
            String::new()
        };
        let eta = if total > done && rate > 0.0 {
            format!(", ETA {:.0}s", (total - done) as f64 / rate)
        } else {
            String::new()
        };
        format!(
            "{}: {} / {}{pct}, {}/s{eta}",
            self.label,
            mib(done),
            mib(total),
            mib(rate as u64)
        )
    }
}

/// Bytes as MiB with one decimal.
pub fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}
