//! The store as the engine sees it: a backend wrapped in layers.
//!
//! A [`Layer`] applies one atomic decision like a [`Store`] does, and
//! reports whether the answer came from a fallback. Each layer adds one
//! behaviour by wrapping the next ([`super::layer::Wrapper`]: it overrides
//! what it changes, the rest passes through), and [`build`] composes them
//! in one place:
//!
//! ```text
//! DenyCache  ->  Fallback  ->  Slices  ->  backend (memory, or Redis)
//! ```
//!
//! Token slices (off by default) answer hot tenant-wide buckets from
//! tokens taken ahead; they sit under the fallback, so a store that fails
//! while a slice is taken is answered by policy like any other call.
//!
//! The deny cache answers buckets it knows are exhausted without a store
//! call; the fallback answers by each rule's policy when what is below it
//! fails with a transient error. The Redis backend keeps its timeout on
//! each call and a circuit breaker per node, so that a dead node costs its
//! callers nothing and the other nodes' callers are not touched.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::deny_cache::DenyCache;
use super::fallback::Fallback;
use super::layer::{Applied, Layer, LayerFuture, Shared, SharedFuture};
use super::slices::Slices;
use super::{
    LeaseFuture, LeaseId, LeaseOp, PingFuture, Request, ReservationId, SettleFuture, ShareAsk,
    Store, StoreError, StoreStatus,
};
use crate::clock::Clock;

/// The bottom of the stack: a backend store, and whether it has answered
/// yet (readiness turns on with the first answer, not the next ping).
struct Backend {
    store: Arc<dyn Store>,
    answered: AtomicBool,
}

impl Backend {
    fn answered<T>(&self, result: &Result<T, StoreError>) {
        if result.is_ok() && !self.answered.load(Ordering::Relaxed) {
            self.answered.store(true, Ordering::Relaxed);
        }
    }
}

impl Layer for Backend {
    fn apply<'a>(&'a self, r: Request<'a>) -> LayerFuture<'a> {
        let inner = self.store.apply(r);
        Box::pin(async move {
            let verdicts = inner.await;
            self.answered(&verdicts);
            Ok(Applied {
                outcome: verdicts?,
                degraded: false,
            })
        })
    }

    fn apply_now(&self, r: Request<'_>) -> Option<Result<Applied, StoreError>> {
        let verdicts = self.store.apply_now(r)?;
        Some(verdicts.map(|outcome| Applied {
            outcome,
            degraded: false,
        }))
    }

    fn settle<'a>(&'a self, id: &'a ReservationId, actual: u64) -> SettleFuture<'a> {
        let inner = self.store.settle(id, actual);
        Box::pin(async move {
            let settled = inner.await;
            self.answered(&settled);
            settled
        })
    }

    fn lease<'a>(&'a self, id: &'a LeaseId, op: LeaseOp) -> LeaseFuture<'a> {
        let inner = self.store.lease(id, op);
        Box::pin(async move {
            let answer = inner.await;
            self.answered(&answer);
            answer
        })
    }

    fn share<'a>(&'a self, ask: ShareAsk<'a>) -> SharedFuture<'a> {
        let inner = self.store.share(ask);
        Box::pin(async move {
            let share = inner.await;
            self.answered(&share);
            Ok(Shared {
                share: share?,
                degraded: false,
                scale: 1.0,
            })
        })
    }

    fn ping(&self) -> PingFuture<'_> {
        let ping = self.store.ping();
        Box::pin(async move {
            let answer = ping.await;
            self.answered(&answer);
            answer
        })
    }

    fn status(&self) -> StoreStatus {
        let inner = self.store.status();
        StoreStatus {
            answered: self.answered.load(Ordering::Relaxed) || inner.answered,
            ..inner
        }
    }
}

/// The layers to put around a backend.
pub struct Layers {
    /// Decide by each rule's policy when the backend is unavailable (Redis
    /// down, or the in-process store at its cap).
    pub fallback: Option<Fallback>,
    /// Answer recently rejected buckets locally (`--deny-cache`), holding
    /// at most this many buckets and bytes.
    pub deny_cache: Option<(usize, usize)>,
    /// Answer hot tenant-wide buckets from token slices
    /// (`--token-slices`), for at most this many buckets at once.
    pub slices: Option<usize>,
}

/// Composes the stack: the one place the layers are put together.
pub fn build(backend: Arc<dyn Store>, layers: Layers, clock: Arc<dyn Clock>) -> Arc<dyn Layer> {
    let mut stack: Box<dyn Layer> = Box::new(Backend {
        store: backend,
        answered: AtomicBool::new(false),
    });
    if let Some(max_slots) = layers.slices {
        stack = Box::new(Slices::new(clock.clone(), max_slots).wrap(stack));
    }
    if let Some(fallback) = layers.fallback {
        stack = Box::new(fallback.wrap(stack));
    }
    if let Some((capacity, max_bytes)) = layers.deny_cache {
        stack = Box::new(DenyCache::new(clock, capacity, max_bytes).wrap(stack));
    }
    Arc::from(stack)
}
