//! The store-unavailable fallback, as a layer.
//!
//! When the backend fails with a transient error (Redis down, a timeout,
//! the breaker open, the in-process store at its cap), each charge is
//! decided by its rule's policy: `allow`
//! admits (reporting the bucket as if full before this request), `deny`
//! rejects enforced charges, `local` decides with in-process buckets scaled
//! to the configured fraction (refusing, as `deny`, if memory has no room
//! either). Still all or nothing: local buckets are spent only when no
//! enforced charge is denied.

use std::sync::Arc;

use super::stack::{Applied, Layer, LayerFuture, Request};
use super::{MemoryStore, PingFuture, StoreError, StoreStatus, Verdicts};
use crate::algorithm::{Algorithm, Charge, Micros, Verdict};
use crate::limits::OnStoreUnavailable;
use crate::store::BucketKey;

/// How to decide while the shared store is unavailable.
pub struct Fallback {
    /// In-process buckets for rules whose policy is `local`.
    pub local: Arc<MemoryStore>,
    /// The share of each limit a `local` rule allows in one instance, in
    /// (0, 1]; for example 1/N with N instances sharing the limit.
    pub local_fraction: f64,
    /// The `retry_after` of a request refused because its rule fails closed.
    pub deny_retry_after: Micros,
}

impl Fallback {
    /// This fallback around `inner`.
    pub fn wrap(self, inner: Box<dyn Layer>) -> FallbackLayer {
        FallbackLayer {
            inner,
            fallback: self,
        }
    }

    /// Decides without the shared store, by each charge's policy.
    pub fn decide(&self, r: Request<'_>) -> Verdicts {
        let mut verdicts = Vec::with_capacity(r.charges.len());
        let mut local = Vec::new();
        let mut denied = false;
        for (i, (charge, policy)) in r.charges.iter().zip(r.policies).enumerate() {
            let verdict = match policy {
                OnStoreUnavailable::Allow => Verdict {
                    allowed: true,
                    remaining: charge.limit.burst().saturating_sub(charge.cost),
                    retry_after: 0,
                    reset_after: match charge.limit.algorithm() {
                        Algorithm::TokenBucket => {
                            charge.cost.min(charge.limit.burst()) * charge.limit.interval()
                        }
                        _ => charge.limit.interval(),
                    },
                },
                OnStoreUnavailable::Deny => {
                    denied |= charge.enforce;
                    Verdict {
                        allowed: false,
                        remaining: 0,
                        retry_after: self.deny_retry_after,
                        reset_after: 0,
                    }
                }
                OnStoreUnavailable::Local => {
                    local.push(i);
                    Verdict {
                        allowed: true,
                        remaining: 0,
                        retry_after: 0,
                        reset_after: 0,
                    }
                }
            };
            verdicts.push(verdict);
        }
        let mut allowed = !denied;
        if !local.is_empty() {
            let buckets: Vec<BucketKey> = local.iter().map(|&i| r.buckets[i].clone()).collect();
            let charges: Vec<Charge> = local
                .iter()
                .map(|&i| {
                    let limit = r.charges[i].limit.scaled(self.local_fraction);
                    Charge {
                        limit,
                        cost: r.charges[i].cost.min(limit.burst()),
                        enforce: r.charges[i].enforce,
                    }
                })
                .collect();
            match self.local.apply_now(&buckets, &charges, r.spend && !denied) {
                Ok(plan) => {
                    allowed &= plan.allowed;
                    for (&i, verdict) in local.iter().zip(plan.verdicts) {
                        verdicts[i] = verdict;
                    }
                }
                // No room in memory either: `local` rules refuse, as `deny`.
                Err(_) => {
                    for &i in &local {
                        allowed &= !r.charges[i].enforce;
                        verdicts[i] = Verdict {
                            allowed: false,
                            remaining: 0,
                            retry_after: self.deny_retry_after,
                            reset_after: 0,
                        };
                    }
                }
            }
        }
        Verdicts { allowed, verdicts }
    }
}

/// [`Fallback`] around a layer.
pub struct FallbackLayer {
    inner: Box<dyn Layer>,
    fallback: Fallback,
}

impl FallbackLayer {
    /// The inner layer's answer, or the policies' when it was unavailable.
    fn settle(
        &self,
        r: Request<'_>,
        result: Result<Applied, StoreError>,
    ) -> Result<Applied, StoreError> {
        match result {
            Err(err) if err.is_transient() => {
                tracing::debug!(error = %err, "store unavailable; deciding by each rule's policy");
                Ok(Applied {
                    outcome: self.fallback.decide(r),
                    degraded: true,
                })
            }
            other => other,
        }
    }
}

impl Layer for FallbackLayer {
    fn apply<'a>(&'a self, r: Request<'a>) -> LayerFuture<'a> {
        let inner = self.inner.apply(r);
        Box::pin(async move { self.settle(r, inner.await) })
    }

    fn apply_now(&self, r: Request<'_>) -> Option<Result<Applied, StoreError>> {
        Some(self.settle(r, self.inner.apply_now(r)?))
    }

    fn ping(&self) -> PingFuture<'_> {
        self.inner.ping()
    }

    fn status(&self) -> StoreStatus {
        StoreStatus {
            local: Some(super::stack::memory_status(&self.fallback.local)),
            ..self.inner.status()
        }
    }
}
