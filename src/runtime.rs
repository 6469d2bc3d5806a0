//! The tokio runtime every `tollgate` command runs on.
//!
//! One setting matters for throughput: the worker's LIFO slot. Tokio runs a
//! task woken by the running task next, ahead of everything queued. That is
//! the wrong order for a gRPC server. When a decision finishes, its stream
//! task wakes the HTTP/2 connection task, which then runs at once and writes
//! that one response: one `writev` per decision, and on loopback the sender
//! also pays for most of the receiver's TCP work. With the slot off, the
//! connection task waits its turn behind the other finished streams and
//! writes all their responses in one go. Measured here: eight times fewer
//! writes and about a third less server CPU per decision (BENCHMARKS.md,
//! "Runtime").
//!
//! Turning the slot off is one of tokio's unstable options, available when
//! the crate is built with `--cfg tokio_unstable`, which `.cargo/config.toml`
//! sets. A build without it still works, keeps the slot and says so
//! ([`LIFO_SLOT`], the `tollgate_runtime_lifo_slot` gauge, a warning at
//! start).

use std::io;

/// Whether this build keeps tokio's LIFO slot: false when it was built with
/// `--cfg tokio_unstable` (as `.cargo/config.toml` does), true otherwise.
pub const LIFO_SLOT: bool = !cfg!(tokio_unstable);

/// A multi-threaded runtime with `worker_threads` workers (0: one per CPU
/// the process may use), timers and I/O enabled, and the LIFO slot off
/// where the build allows it.
pub fn build(worker_threads: usize) -> io::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    if worker_threads > 0 {
        builder.worker_threads(worker_threads);
    }
    #[cfg(tokio_unstable)]
    builder.disable_lifo_slot();
    builder.build()
}
