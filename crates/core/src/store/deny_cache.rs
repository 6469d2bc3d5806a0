//! A local cache of rejected buckets, as a store layer (off by default;
//! `--deny-cache`).
//!
//! When the shared store rejects a request, the bucket that rejected it
//! cannot admit the same cost again before `retry_after`, whatever any
//! instance does meanwhile (others only spend tokens). So for that long this
//! instance can answer "no" itself, without a Redis round trip: a client
//! hammering an exhausted key costs Redis nothing. A refund through this
//! instance lifts its buckets' cached rejections; one through another
//! instance is seen when the cached wait is over.
//!
//! The trade-off, measured in BENCHMARKS.md: it can only reject more, never
//! admit more. A cheaper request than the one that was rejected, or a limit
//! raised in the meantime, may have been admitted by the store earlier than
//! the cached wait says. Cached rejections report the cached bucket only
//! (remaining 0 and the remaining wait).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use dashmap::DashMap;

use super::layer::{Applied, Layer, LayerFuture, Wrapper};
use super::{BucketKey, Request, StoreError, Verdicts};
use crate::algorithm::{Charge, Micros, Op, Verdict};
use crate::clock::Clock;

/// What one cached bucket is counted as besides its key.
const ENTRY_OVERHEAD_BYTES: usize = 96;

fn entry_bytes(bucket: &BucketKey) -> usize {
    ENTRY_OVERHEAD_BYTES + bucket.as_str().len()
}

/// Rejected buckets and until when.
pub struct DenyCache {
    until: DashMap<BucketKey, Micros>,
    clock: Arc<dyn Clock>,
    capacity: usize,
    max_bytes: usize,
    /// Bytes held, counted by [`entry_bytes`].
    bytes: AtomicUsize,
}

impl DenyCache {
    /// A cache holding at most `capacity` buckets and `max_bytes` bytes;
    /// when full of rejections still running, new ones are not cached
    /// (the store answers them, as without the cache).
    pub fn new(clock: Arc<dyn Clock>, capacity: usize, max_bytes: usize) -> Self {
        Self {
            until: DashMap::new(),
            clock,
            capacity: capacity.max(16),
            max_bytes: max_bytes.max(16 * ENTRY_OVERHEAD_BYTES),
            bytes: AtomicUsize::new(0),
        }
    }

    /// Bytes held, as counted against the cap.
    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    fn full(&self, adding: usize) -> bool {
        self.until.len() >= self.capacity
            || self.bytes.load(Ordering::Relaxed) + adding > self.max_bytes
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
                debt: 0,
                forgiven: 0,
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
            if !charge.enforce || verdict.allowed || verdict.retry_after == Micros::MAX {
                continue;
            }
            let until = now + verdict.retry_after;
            if let Some(mut entry) = self.until.get_mut(bucket) {
                *entry = until;
                continue;
            }
            let adding = entry_bytes(bucket);
            if self.full(adding) {
                self.drop_expired(now);
                if self.full(adding) {
                    continue;
                }
            }
            if self.until.insert(bucket.clone(), until).is_none() {
                self.bytes.fetch_add(adding, Ordering::Relaxed);
            }
        }
    }

    /// Forgets the buckets a refund gave tokens back to: they may admit
    /// before their cached wait is over.
    pub fn forget(&self, buckets: &[BucketKey]) {
        if self.until.is_empty() {
            return;
        }
        for bucket in buckets {
            if self.until.remove(bucket).is_some() {
                self.bytes.fetch_sub(entry_bytes(bucket), Ordering::Relaxed);
            }
        }
    }

    /// Drops the rejections whose wait is over.
    fn drop_expired(&self, now: Micros) {
        let mut freed = 0;
        self.until.retain(|bucket, until| {
            let keep = *until > now;
            if !keep {
                freed += entry_bytes(bucket);
            }
            keep
        });
        self.bytes.fetch_sub(freed, Ordering::Relaxed);
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

impl Wrapper for DenyCacheLayer {
    fn inner(&self) -> &dyn Layer {
        self.inner.as_ref()
    }

    fn apply<'a>(&'a self, r: Request<'a>) -> LayerFuture<'a> {
        if !matches!(r.op, Op::Decide { .. }) {
            // Charges, refunds and acquires always reach the store (a slot
            // can free up at any moment: a refused acquire is not
            // remembered), and a refund lifts what was cached.
            if matches!(r.op, Op::Refund { .. }) {
                self.cache.forget(r.buckets);
            }
            return self.inner.apply(r);
        }
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
        if !matches!(r.op, Op::Decide { .. }) {
            if matches!(r.op, Op::Refund { .. }) {
                self.cache.forget(r.buckets);
            }
            return self.inner.apply_now(r);
        }
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{Limit, Rate};
    use crate::clock::ManualClock;
    use crate::store::BucketKind;
    use std::time::Duration;

    fn rejected(retry_after: Micros) -> Verdicts {
        Verdicts {
            allowed: false,
            verdicts: vec![Verdict {
                allowed: false,
                remaining: 0,
                debt: 0,
                forgiven: 0,
                retry_after,
                reset_after: retry_after,
            }],
        }
    }

    /// An enforced charge of 1 on a bucket of 1 a minute.
    fn one_a_minute() -> Charge {
        Charge {
            limit: Limit::new(1, "1/minute".parse::<Rate>().unwrap()).unwrap(),
            cost: 1,
            need: 1,
            enforce: true,
        }
    }

    /// Full of rejections still running, the cache stops caching (the store
    /// answers instead) rather than growing; expired ones make room again.
    #[test]
    fn holds_no_more_than_its_caps_in_entries_and_bytes() {
        let clock = Arc::new(ManualClock::new(1_700_000_000_000_000));
        let charge = [one_a_minute()];
        let key = |i: u32| {
            BucketKey::new(
                "t",
                BucketKind::KEY,
                "",
                &format!("{i:04}{}", "x".repeat(196)),
            )
        };
        let per_entry = entry_bytes(&key(0));
        let cache = DenyCache::new(clock.clone(), 1_000_000, 50 * per_entry);
        for i in 0..500 {
            cache.remember(&[key(i)], &charge, &rejected(60_000_000));
            assert!(cache.bytes() <= 50 * per_entry);
        }
        assert_eq!(cache.len(), 50);
        assert!(cache.check(&[key(49)], &charge).is_some());
        assert!(cache.check(&[key(50)], &charge).is_none());

        let by_count = DenyCache::new(clock.clone(), 20, usize::MAX);
        for i in 0..100 {
            by_count.remember(&[key(i)], &charge, &rejected(60_000_000));
        }
        assert_eq!(by_count.len(), 20);

        clock.advance(Duration::from_secs(61));
        cache.remember(&[key(900)], &charge, &rejected(60_000_000));
        assert_eq!(cache.len(), 1);
        assert_eq!(cache.bytes(), per_entry);
    }

    /// A refund lifts its buckets' cached rejections (and only theirs),
    /// bytes included.
    #[test]
    fn a_refund_lifts_the_rejections_of_its_buckets() {
        let clock = Arc::new(ManualClock::new(1_700_000_000_000_000));
        let charge = [one_a_minute()];
        let (a, b) = (
            BucketKey::new("t", BucketKind::KEY, "", "a"),
            BucketKey::new("t", BucketKind::KEY, "", "b"),
        );
        let cache = DenyCache::new(clock.clone(), 100, 1 << 20);
        cache.remember(std::slice::from_ref(&a), &charge, &rejected(60_000_000));
        cache.remember(std::slice::from_ref(&b), &charge, &rejected(60_000_000));
        assert!(cache.check(std::slice::from_ref(&a), &charge).is_some());
        cache.forget(std::slice::from_ref(&a));
        assert!(cache.check(&[a], &charge).is_none(), "lifted");
        assert!(
            cache.check(std::slice::from_ref(&b), &charge).is_some(),
            "kept"
        );
        assert_eq!((cache.len(), cache.bytes()), (1, entry_bytes(&b)));
    }
}
