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
//! The slot has a use: with it, a call made while the server is otherwise
//! idle never leaves the thread that took it. Without it, every hand-off
//! between tasks can wake the other worker to steal the task, so calls made
//! one at a time cost more CPU and wait longer (about 30 µs more in memory,
//! 40 µs on Redis). `--runtime-lifo-slot` keeps the slot for deployments
//! whose traffic is sparse and latency-bound.
//!
//! Turning the slot off is one of tokio's unstable options, available when
//! the crate is built with `--cfg tokio_unstable`, which `.cargo/config.toml`
//! sets. A build without it still works, keeps the slot and says so
//! ([`lifo_slot`], the `tollgate_runtime_lifo_slot` gauge, a warning at
//! start).

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};

/// Whether this build can turn the LIFO slot off (it was built with
/// `--cfg tokio_unstable`, as `.cargo/config.toml` does).
pub const CAN_TURN_OFF_LIFO_SLOT: bool = cfg!(tokio_unstable);

static LIFO_SLOT: AtomicBool = AtomicBool::new(true);

/// Whether the runtime [`build`] made last keeps tokio's LIFO slot.
pub fn lifo_slot() -> bool {
    LIFO_SLOT.load(Ordering::Relaxed)
}

/// A multi-threaded runtime with `worker_threads` workers (0: one per CPU
/// the process may use), timers and I/O enabled, and the LIFO slot off
/// unless `keep_lifo_slot` (or the build cannot turn it off).
pub fn build(worker_threads: usize, keep_lifo_slot: bool) -> io::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    if worker_threads > 0 {
        builder.worker_threads(worker_threads);
    }
    #[cfg(tokio_unstable)]
    if !keep_lifo_slot {
        builder.disable_lifo_slot();
    }
    let runtime = builder.build()?;
    LIFO_SLOT.store(keep_lifo_slot || !CAN_TURN_OFF_LIFO_SLOT, Ordering::Relaxed);
    Ok(runtime)
}
