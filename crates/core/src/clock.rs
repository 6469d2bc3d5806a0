//! The one place that reads the time.
//!
//! Decisions take `now` as an argument; stores that own time (the in-process
//! store) read it here, once per decision. Time is an integer count of
//! microseconds since the Unix epoch: exact in an `f64` until the year 2255,
//! which matters once the same arithmetic runs inside Redis's Lua.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Microseconds since the Unix epoch.
pub type Micros = u64;

/// A source of the current time.
pub trait Clock: Send + Sync + 'static {
    /// The current time in microseconds since the Unix epoch.
    fn now(&self) -> Micros;
}

/// The wall clock. Wall time (not a monotonic clock) because instances that
/// share buckets must agree on what "now" means; the bucket arithmetic never
/// lets a backwards step create tokens.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    #[allow(clippy::disallowed_methods)] // the one sanctioned clock read
    fn now(&self) -> Micros {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as Micros)
    }
}

/// A clock that only moves when told to: for tests and simulations.
#[derive(Debug, Default)]
pub struct ManualClock {
    now: AtomicU64,
}

impl ManualClock {
    /// A clock reading `start` microseconds.
    pub fn new(start: Micros) -> Self {
        Self {
            now: AtomicU64::new(start),
        }
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        self.now
            .fetch_add(by.as_micros() as Micros, Ordering::SeqCst);
    }

    /// Sets the clock, which may move it backwards.
    pub fn set(&self, to: Micros) {
        self.now.store(to, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Micros {
        self.now.load(Ordering::SeqCst)
    }
}
