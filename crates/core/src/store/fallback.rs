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
//!
//! A charge made after the fact (or a refund) is applied to the in-process
//! buckets of `local` rules; under `allow` and `deny` it is not recorded
//! anywhere, and its verdict says so (the whole cost `forgiven`). A
//! reservation decided here has no record: there is nothing to settle.

use std::sync::Arc;

use super::OnStoreUnavailable;
use super::layer::{Applied, Layer, LayerFuture, Shared, SharedFuture, Wrapper};
use super::{
    Attachment, LeaseFuture, LeaseId, LeaseOp, LeaseStatus, MemoryStore, Request, ShareAsk,
    StoreError, StoreStatus, Verdicts,
};
use crate::algorithm::{Algorithm, Charge, Micros, Op, Verdict};
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
        if !r.op.decides() {
            return self.apply_unconditional(r);
        }
        let spend = r.op.spends();
        let mut verdicts = Vec::with_capacity(r.charges.len());
        let mut local = Vec::new();
        let mut denied = false;
        for (i, (charge, policy)) in r.charges.iter().zip(r.policies).enumerate() {
            let verdict = match policy {
                OnStoreUnavailable::Allow => Verdict {
                    allowed: true,
                    remaining: charge.limit.burst().saturating_sub(charge.cost),
                    debt: 0,
                    forgiven: 0,
                    retry_after: 0,
                    reset_after: match (charge.limit.algorithm(), r.op) {
                        (Algorithm::TokenBucket, _) => {
                            charge.cost.min(charge.limit.burst()) * charge.limit.interval()
                        }
                        (Algorithm::Concurrency, Op::Acquire { ttl }) => ttl,
                        (Algorithm::Concurrency, _) => 0,
                        // A quota is counted afresh from the next period.
                        (Algorithm::Quota, _) => charge
                            .limit
                            .period()
                            .map_or(0, |p| p.end.saturating_sub(self.local.now())),
                        _ => charge.limit.interval(),
                    },
                },
                OnStoreUnavailable::Deny => {
                    denied |= charge.enforce;
                    self.refused()
                }
                OnStoreUnavailable::Local => {
                    local.push(i);
                    Verdict::admitted()
                }
            };
            verdicts.push(verdict);
        }
        let mut allowed = !denied;
        if !local.is_empty() {
            let buckets: Vec<BucketKey> = local.iter().map(|&i| r.buckets[i].clone()).collect();
            let charges = self.local_charges(r, &local);
            let decided = match r.attachment {
                Some(lease @ Attachment::Lease(_)) if !denied => {
                    self.local.attach_now(&buckets, &charges, lease)
                }
                _ => self.local.apply_now(
                    &buckets,
                    &charges,
                    Op::Decide {
                        spend: spend && !denied,
                    },
                ),
            };
            match decided {
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
                        verdicts[i] = self.refused();
                    }
                }
            }
        }
        Verdicts { allowed, verdicts }
    }

    /// A charge refused by a `deny` rule (or a `local` one without room).
    fn refused(&self) -> Verdict {
        Verdict {
            allowed: false,
            remaining: 0,
            debt: 0,
            forgiven: 0,
            retry_after: self.deny_retry_after,
            reset_after: 0,
        }
    }

    /// The charges at `at` scaled to this instance's share.
    fn local_charges(&self, r: Request<'_>, at: &[usize]) -> Vec<Charge> {
        at.iter()
            .map(|&i| {
                let limit = r.charges[i].limit.scaled(self.local_fraction);
                let scaled = |tokens: u64| {
                    if r.op.decides() {
                        tokens.min(limit.burst())
                    } else {
                        tokens
                    }
                };
                Charge {
                    limit,
                    cost: scaled(r.charges[i].cost),
                    need: scaled(r.charges[i].need),
                    enforce: r.charges[i].enforce,
                }
            })
            .collect()
    }

    /// A charge or refund while the shared store is unavailable: applied to
    /// the in-process buckets of `local` rules, not recorded under the
    /// others (a charge's whole cost is reported `forgiven`).
    fn apply_unconditional(&self, r: Request<'_>) -> Verdicts {
        let charge = r.op == Op::Charge;
        let mut verdicts: Vec<Verdict> = r
            .charges
            .iter()
            .map(|c| Verdict {
                forgiven: if charge { c.cost } else { 0 },
                ..Verdict::admitted()
            })
            .collect();
        let local: Vec<usize> = (0..r.charges.len())
            .filter(|&i| r.policies.get(i) == Some(&OnStoreUnavailable::Local))
            .collect();
        if !local.is_empty() {
            let buckets: Vec<BucketKey> = local.iter().map(|&i| r.buckets[i].clone()).collect();
            let charges = self.local_charges(r, &local);
            if let Ok(plan) = self.local.apply_now(&buckets, &charges, r.op) {
                for (&i, verdict) in local.iter().zip(plan.verdicts) {
                    verdicts[i] = verdict;
                }
            }
        }
        Verdicts {
            allowed: true,
            verdicts,
        }
    }
}

/// [`Fallback`] around a layer.
pub struct FallbackLayer {
    inner: Box<dyn Layer>,
    fallback: Fallback,
}

impl FallbackLayer {
    /// The inner layer's answer, or the policies' when it was unavailable.
    fn or_policies(
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

impl Wrapper for FallbackLayer {
    fn inner(&self) -> &dyn Layer {
        self.inner.as_ref()
    }

    fn apply<'a>(&'a self, r: Request<'a>) -> LayerFuture<'a> {
        let inner = self.inner.apply(r);
        Box::pin(async move { self.or_policies(r, inner.await) })
    }

    fn apply_now(&self, r: Request<'_>) -> Option<Result<Applied, StoreError>> {
        Some(self.or_policies(r, self.inner.apply_now(r)?))
    }

    /// A lease taken by a `local` rule while the backend was unavailable
    /// lives in the in-process store; one whose acquire reached the backend
    /// late (after its caller's timeout) lives there too. So a release or
    /// renew goes to both, and answers what whichever holds it says.
    fn lease<'a>(&'a self, id: &'a LeaseId, op: LeaseOp) -> LeaseFuture<'a> {
        Box::pin(async move {
            // The backend first: when it is the in-process store itself,
            // the local store's answer comes second and is the one dropped.
            let inner = self.inner.lease(id, op).await;
            let local = self.fallback.local.lease_now(id, op);
            match inner {
                Ok(answer) if answer.status != LeaseStatus::Unknown => Ok(answer),
                _ if local.status != LeaseStatus::Unknown => Ok(local),
                other => other,
            }
        })
    }

    /// While the backend is unavailable, the in-process share tables
    /// answer: the members this instance serves divide its local share.
    fn share<'a>(&'a self, ask: ShareAsk<'a>) -> SharedFuture<'a> {
        Box::pin(async move {
            match self.inner.share(ask).await {
                Err(err) if err.is_transient() => Ok(Shared {
                    share: self.fallback.local.share_now(&ask)?,
                    degraded: true,
                    scale: self.fallback.local_fraction,
                }),
                other => other,
            }
        })
    }

    fn status(&self) -> StoreStatus {
        StoreStatus {
            local: Some(self.fallback.local.figures()),
            ..self.inner.status()
        }
    }
}
