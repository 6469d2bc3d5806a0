//! A circuit breaker for the shared store, as a layer.
//!
//! After `threshold` consecutive failed decisions (transient errors: Redis
//! down, a timeout) the breaker opens: decisions fail at once, without
//! waiting for a timeout, for `cooldown`, and the fallback layer above
//! answers them by each rule's policy. Then one decision is let through as
//! a probe (half-open): its success closes the breaker, its failure opens
//! it again. So a dead Redis costs each request nothing, and a recovered
//! one is used again without a restart. A probe whose caller goes away
//! before the answer counts as failed, so the breaker never stays half-open.

use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use super::stack::{Applied, Layer, LayerFuture, Request};
use super::{
    LeaseFuture, LeaseId, LeaseOp, PingFuture, ReservationId, SettleFuture, StoreError, StoreStatus,
};
use crate::telemetry::metrics;

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

/// [`Breaker`] around a layer.
pub struct BreakerLayer {
    inner: Box<dyn Layer>,
    breaker: Breaker,
    kind: &'static str,
}

impl Breaker {
    /// This breaker around `inner`.
    pub fn wrap(self, inner: Box<dyn Layer>) -> BreakerLayer {
        let kind = inner.status().kind;
        BreakerLayer {
            inner,
            breaker: self,
            kind,
        }
    }
}

/// Reports a call's result to the breaker; a call dropped before it ended
/// counts as a failure.
struct Pending<'a> {
    breaker: &'a Breaker,
    done: bool,
}

impl Pending<'_> {
    fn report<T>(mut self, result: &Result<T, StoreError>) {
        match result {
            Err(err) if err.is_transient() => self.breaker.failure(),
            // A request the store cannot take (it spans cluster slots)
            // says nothing about the store's health.
            _ => self.breaker.success(),
        }
        self.done = true;
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.breaker.failure();
        }
    }
}

impl BreakerLayer {
    fn admit(&self) -> Result<Pending<'_>, StoreError> {
        match self.breaker.admit() {
            Ok(()) => Ok(Pending {
                breaker: &self.breaker,
                done: false,
            }),
            Err(Open) => {
                metrics::store_error(self.kind, "circuit_open");
                Err(StoreError::Unavailable("circuit breaker open".into()))
            }
        }
    }
}

impl Layer for BreakerLayer {
    fn apply<'a>(&'a self, r: Request<'a>) -> LayerFuture<'a> {
        let pending = match self.admit() {
            Ok(pending) => pending,
            Err(err) => return Box::pin(std::future::ready(Err(err))),
        };
        let inner = self.inner.apply(r);
        Box::pin(async move {
            let result: Result<Applied, StoreError> = inner.await;
            pending.report(&result);
            result
        })
    }

    fn settle<'a>(&'a self, id: &'a ReservationId, actual: u64) -> SettleFuture<'a> {
        Box::pin(async move {
            let pending = self.admit()?;
            let result = self.inner.settle(id, actual).await;
            pending.report(&result);
            result
        })
    }

    fn lease<'a>(&'a self, id: &'a LeaseId, op: LeaseOp) -> LeaseFuture<'a> {
        Box::pin(async move {
            let pending = self.admit()?;
            let result = self.inner.lease(id, op).await;
            pending.report(&result);
            result
        })
    }

    fn ping(&self) -> PingFuture<'_> {
        Box::pin(async move {
            let pending = self.admit()?;
            let result = self.inner.ping().await;
            pending.report(&result);
            result
        })
    }

    fn status(&self) -> StoreStatus {
        StoreStatus {
            breaker: Some(self.breaker.state()),
            ..self.inner.status()
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

    /// A layer below the breaker whose answers the test chooses: a
    /// transient failure, a request it cannot take, or never answering.
    struct Scripted(parking_lot::Mutex<Vec<Option<StoreError>>>);

    impl Layer for Scripted {
        fn apply<'a>(&'a self, _: Request<'a>) -> LayerFuture<'a> {
            let next = self.0.lock().remove(0);
            Box::pin(async move {
                match next {
                    Some(err) => Err(err),
                    None => std::future::pending().await,
                }
            })
        }
        fn settle<'a>(&'a self, _: &'a ReservationId, _: u64) -> SettleFuture<'a> {
            Box::pin(std::future::pending())
        }
        fn lease<'a>(&'a self, _: &'a LeaseId, _: LeaseOp) -> LeaseFuture<'a> {
            unreachable!()
        }
        fn ping(&self) -> PingFuture<'_> {
            Box::pin(std::future::ready(Ok(())))
        }
        fn status(&self) -> StoreStatus {
            StoreStatus {
                kind: "scripted",
                breaker: None,
                local: None,
                answered: false,
            }
        }
    }

    fn request() -> Request<'static> {
        Request {
            buckets: &[],
            charges: &[],
            policies: &[],
            op: crate::algorithm::Op::SPEND,
            reserve: None,
            lease: None,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn as_a_layer_only_transient_failures_count_and_a_dropped_probe_reopens() {
        let unsupported = || Some(StoreError::Unsupported("two slots".into()));
        let down = || Some(StoreError::Unavailable("down".into()));
        let layer = Breaker::new(2, Duration::from_secs(1)).wrap(Box::new(Scripted(
            parking_lot::Mutex::new(vec![
                unsupported(),
                unsupported(),
                unsupported(),
                down(),
                down(),
                None,
            ]),
        )));
        for _ in 0..3 {
            assert!(matches!(
                layer.apply(request()).await,
                Err(StoreError::Unsupported(_))
            ));
        }
        assert_eq!(
            layer.status().breaker,
            Some(BreakerState::Closed),
            "the caller's mistakes"
        );
        for _ in 0..2 {
            assert!(layer.apply(request()).await.is_err());
        }
        assert_eq!(layer.status().breaker, Some(BreakerState::Open));
        let refused = layer.apply(request()).await.unwrap_err();
        assert_eq!(
            refused.to_string(),
            "store unavailable: circuit breaker open"
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        // The probe's caller goes away before the store answers.
        let probe = layer.apply(request());
        assert_eq!(layer.status().breaker, Some(BreakerState::HalfOpen));
        drop(probe);
        assert_eq!(
            layer.status().breaker,
            Some(BreakerState::Open),
            "a dropped probe counts as failed, so the breaker probes again later"
        );
    }
}
