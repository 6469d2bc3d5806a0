//! A local cache of rejected buckets, as a store layer (off by default;
//! `--deny-cache`).
//!
//! When the shared store rejects a request, the bucket that rejected it
//! cannot admit the same cost again before `retry_after`, whatever any
//! instance does meanwhile (others only spend tokens). So for that long this
//! instance can answer "no" itself, without a Redis round trip: a client
//! hammering an exhausted key costs Redis nothing.
//!
//! The trade-off, measured in BENCHMARKS.md: it can only reject more, never
//! admit more. A cheaper request than the one that was rejected, or a limit
//! raised in the meantime, may have been admitted by the store earlier than
//! the cached wait says. Cached rejections report the cached bucket only
//! (remaining 0 and the remaining wait).

use std::sync::Arc;

use dashmap::DashMap;

use super::stack::{Applied, Layer, LayerFuture, Request};
use super::{BucketKey, PingFuture, StoreError, StoreStatus, Verdicts};
use crate::algorithm::{Charge, Micros, Verdict};
use crate::clock::Clock;

/// Rejected buckets and until when.
pub struct DenyCache {
    until: DashMap<BucketKey, Micros>,
    clock: Arc<dyn Clock>,
    capacity: usize,
}

impl DenyCache {
    /// A cache holding at most about `capacity` buckets.
    pub fn new(clock: Arc<dyn Clock>, capacity: usize) -> Self {
        Self {
            until: DashMap::new(),
            clock,
            capacity: capacity.max(16),
        }
    }

    /// Buckets cached now.
    pub fn len(&self) -> usize {
        self.until.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.until.is_empty()
    }

    /// A rejection decided from the cache, when an enforced charge's bucket
    /// is known to be unable to admit it yet.
    pub fn check(&self, buckets: &[BucketKey], charges: &[Charge]) -> Option<Verdicts> {
        if self.until.is_empty() {
            return None;
        }
        let now = self.clock.now();
        let (at, until) = buckets
            .iter()
            .zip(charges)
            .enumerate()
            .find_map(|(i, (b, c))| {
                let until = *self.until.get(b)?;
                (c.enforce && until > now).then_some((i, until))
            })?;
        let verdicts = charges
            .iter()
            .enumerate()
            .map(|(i, _)| Verdict {
                allowed: i != at,
                remaining: 0,
                retry_after: if i == at { until - now } else { 0 },
                reset_after: 0,
            })
            .collect();
        Some(Verdicts {
            allowed: false,
            verdicts,
        })
    }

    /// Remembers the buckets the store just rejected.
    pub fn remember(&self, buckets: &[BucketKey], charges: &[Charge], outcome: &Verdicts) {
        if outcome.allowed {
            return;
        }
        let now = self.clock.now();
        for ((bucket, charge), verdict) in buckets.iter().zip(charges).zip(&outcome.verdicts) {
            if charge.enforce && !verdict.allowed && verdict.retry_after != Micros::MAX {
                self.until.insert(bucket.clone(), now + verdict.retry_after);
            }
        }
        if self.until.len() > self.capacity {
            self.until.retain(|_, until| *until > now);
        }
    }
}

impl DenyCache {
    /// This cache around `inner`.
    pub fn wrap(self, inner: Box<dyn Layer>) -> DenyCacheLayer {
        DenyCacheLayer { inner, cache: self }
    }
}

/// [`DenyCache`] around a layer.
pub struct DenyCacheLayer {
    inner: Box<dyn Layer>,
    cache: DenyCache,
}

impl Layer for DenyCacheLayer {
    fn apply<'a>(&'a self, r: Request<'a>) -> LayerFuture<'a> {
        if let Some(outcome) = self.cache.check(r.buckets, r.charges) {
            crate::telemetry::metrics::deny_cache_hit();
            return Box::pin(std::future::ready(Ok(Applied {
                outcome,
                degraded: false,
            })));
        }
        let inner = self.inner.apply(r);
        Box::pin(async move {
            let applied = inner.await?;
            if !applied.degraded {
                self.cache.remember(r.buckets, r.charges, &applied.outcome);
            }
            Ok(applied)
        })
    }

    fn apply_now(&self, r: Request<'_>) -> Option<Result<Applied, StoreError>> {
        if let Some(outcome) = self.cache.check(r.buckets, r.charges) {
            crate::telemetry::metrics::deny_cache_hit();
            return Some(Ok(Applied {
                outcome,
                degraded: false,
            }));
        }
        let result = self.inner.apply_now(r)?;
        if let Ok(applied) = &result
            && !applied.degraded
        {
            self.cache.remember(r.buckets, r.charges, &applied.outcome);
        }
        Some(result)
    }

    fn ping(&self) -> PingFuture<'_> {
        self.inner.ping()
    }

    fn status(&self) -> StoreStatus {
        self.inner.status()
    }
}
