//! A circuit breaker, one per Redis node (see `redis::node`).
//!
//! After `threshold` consecutive failed calls (transient errors: the node
//! down, a timeout) the breaker opens: calls to that node fail at once,
//! without waiting for a timeout, for `cooldown`, and the fallback layer
//! answers them by each rule's policy. Then one decision is let through as
//! a probe (half-open): its success closes the breaker, its failure opens
//! it again. So a dead Redis costs each request nothing, and a recovered
//! one is used again without a restart. A probe whose caller goes away
//! before the answer counts as failed, so the breaker never stays half-open.

use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

/// Consecutive failures that open a breaker unless configured otherwise.
pub const DEFAULT_THRESHOLD: u32 = 5;
/// How long an open breaker waits before probing, unless configured
/// otherwise.
pub const DEFAULT_COOLDOWN: Duration = Duration::from_secs(1);

/// The breaker's state, as exported in metrics (0, 1, 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Calls go through.
    Closed = 0,
    /// Calls fail fast.
    Open = 1,
    /// One probe call is in flight.
    HalfOpen = 2,
}

#[derive(Debug)]
enum Inner {
    Closed { failures: u32 },
    Open { until: Instant },
    HalfOpen,
}

/// See the module docs.
#[derive(Debug)]
pub struct Breaker {
    inner: Mutex<Inner>,
    threshold: u32,
    cooldown: Duration,
}

/// The breaker refused the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Open;

impl Breaker {
    /// Opens after `threshold` consecutive failures (at least 1), for `cooldown`.
    pub fn new(threshold: u32, cooldown: Duration) -> Self {
        Self {
            inner: Mutex::new(Inner::Closed { failures: 0 }),
            threshold: threshold.max(1),
            cooldown,
        }
    }

    /// Asks to make a call. When open and the cooldown has passed, this call
    /// becomes the probe.
    pub fn admit(&self) -> Result<(), Open> {
        let mut inner = self.inner.lock();
        match *inner {
            Inner::Closed { .. } => Ok(()),
            Inner::Open { until } if Instant::now() >= until => {
                *inner = Inner::HalfOpen;
                Ok(())
            }
            Inner::Open { .. } | Inner::HalfOpen => Err(Open),
        }
    }

    /// True when [`Breaker::admit`] would refuse a call now. Unlike
    /// `admit`, asking does not make the caller the probe.
    pub fn refuses(&self) -> bool {
        match *self.inner.lock() {
            Inner::Closed { .. } => false,
            Inner::Open { until } => Instant::now() < until,
            Inner::HalfOpen => true,
        }
    }

    /// Reports a successful call.
    pub fn success(&self) {
        *self.inner.lock() = Inner::Closed { failures: 0 };
    }

    /// Reports a failed call.
    pub fn failure(&self) {
        let mut inner = self.inner.lock();
        let open = match *inner {
            Inner::Closed { failures } if failures + 1 < self.threshold => {
                *inner = Inner::Closed {
                    failures: failures + 1,
                };
                false
            }
            Inner::Open { .. } => false,
            _ => true,
        };
        if open {
            *inner = Inner::Open {
                until: Instant::now() + self.cooldown,
            };
        }
    }

    /// The current state.
    pub fn state(&self) -> BreakerState {
        match *self.inner.lock() {
            Inner::Closed { .. } => BreakerState::Closed,
            Inner::Open { .. } => BreakerState::Open,
            Inner::HalfOpen => BreakerState::HalfOpen,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn opens_after_threshold_probes_after_cooldown_and_recovers() {
        let b = Breaker::new(3, Duration::from_secs(1));
        for _ in 0..2 {
            assert_eq!(b.admit(), Ok(()));
            b.failure();
        }
        assert_eq!(b.state(), BreakerState::Closed);
        b.failure();
        assert_eq!(b.state(), BreakerState::Open);
        assert_eq!(b.admit(), Err(Open));
        assert!(b.refuses());
        tokio::time::advance(Duration::from_millis(999)).await;
        assert_eq!(b.admit(), Err(Open));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(!b.refuses(), "a probe is due");
        assert!(!b.refuses(), "and asking twice does not take it");
        assert_eq!(b.state(), BreakerState::Open);
        assert_eq!(b.admit(), Ok(()), "the probe");
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert!(b.refuses());
        assert_eq!(b.admit(), Err(Open), "only one probe at a time");
        b.failure();
        assert_eq!(b.state(), BreakerState::Open, "a failed probe reopens");
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(b.admit(), Ok(()));
        b.success();
        assert_eq!(b.state(), BreakerState::Closed);
        assert_eq!(b.admit(), Ok(()));
    }

    #[tokio::test(start_paused = true)]
    async fn a_success_resets_the_failure_count() {
        let b = Breaker::new(2, Duration::from_secs(1));
        b.failure();
        b.success();
        b.failure();
        assert_eq!(b.state(), BreakerState::Closed);
    }
}
