//! The in-process store's leases: concurrency caps' lease sets and the
//! records of leases (see [`crate::store::lease`]).
//!
//! A lease set lives under its cap's bucket name and is guarded by that
//! bucket's stripe lock, like a bucket; a record lives under
//! [`LeaseId::record_name`]. Sets are pruned of expired leases whenever a
//! decision reads them and by the sweep, which drops empty sets (an empty
//! set means the same as none) and records past their grace period.

use std::sync::atomic::Ordering;

use super::{HeldRecord, MemoryStore, Plan, bucket_bytes};
use crate::algorithm::concurrency::LeaseSet;
use crate::algorithm::{Charge, Micros, Op, State};
use crate::store::lease::MAX_TTL;
use crate::store::{BucketKey, Lease, LeaseAnswer, LeaseId, LeaseOp, LeaseStatus};

/// A lease's record held in memory.
#[derive(Debug, Clone)]
pub(super) struct HeldLease {
    /// The lease's member in its sets.
    pub(super) nonce: u128,
    /// The sets that hold it.
    pub(super) sets: Vec<BucketKey>,
    /// When it expires unless renewed.
    pub(super) expires_at: Micros,
    /// Released by its holder.
    pub(super) released: bool,
    /// Its expiry has been counted (`tollgate_leases_expired_total`).
    pub(super) expiry_counted: bool,
}

impl HeldRecord for HeldLease {
    fn expires_at(&self) -> Micros {
        self.expires_at
    }
    fn finished(&self) -> bool {
        self.released
    }
    fn expiry_counted(&mut self) -> &mut bool {
        &mut self.expiry_counted
    }
}

impl MemoryStore {
    /// A cap's occupancy at `now` (pruning its set); `None` when no lease
    /// is held. The caller holds the bucket's stripe.
    pub(super) fn occupancy(&self, bucket: &BucketKey, cap: u64, now: Micros) -> Option<State> {
        let mut set = self.lease_sets.get_mut(bucket)?;
        set.prune(now);
        Some(State::Leases(set.occupancy(cap, now)))
    }

    /// True when the store holds something under `bucket` for `charge`.
    pub(super) fn holds(&self, bucket: &BucketKey, charge: &Charge) -> bool {
        if charge.limit.is_concurrency() {
            self.lease_sets.contains_key(bucket)
        } else {
            self.buckets.contains_key(bucket)
        }
    }

    /// The record of a lease whose acquire `plan` admitted: the caps that
    /// took it.
    pub(super) fn lease_record(
        &self,
        lease: &Lease,
        buckets: &[BucketKey],
        plan: &Plan,
        op: Op,
        now: Micros,
    ) -> HeldLease {
        let ttl = match op {
            Op::Acquire { ttl } => ttl,
            _ => lease.ttl.min(MAX_TTL),
        };
        HeldLease {
            nonce: lease.id.nonce(),
            sets: buckets
                .iter()
                .zip(&plan.writes)
                .filter(|(_, w)| matches!(w, Some(State::Leases(_))))
                .map(|(b, _)| b.clone())
                .collect(),
            expires_at: now.saturating_add(ttl),
            released: false,
            expiry_counted: false,
        }
    }

    /// Adds a lease to a cap's set, creating (and counting) the set when
    /// there is none. The caller holds the bucket's stripe.
    pub(super) fn add_lease(&self, bucket: &BucketKey, nonce: u128, expires_at: Micros) {
        if let Some(mut set) = self.lease_sets.get_mut(bucket) {
            set.insert(nonce, expires_at);
            return;
        }
        let mut set = LeaseSet::default();
        set.insert(nonce, expires_at);
        let bytes = bucket_bytes(bucket);
        self.held.fetch_add(1, Ordering::Relaxed);
        self.held_bytes.fetch_add(bytes, Ordering::Relaxed);
        if self.lease_sets.insert(bucket.clone(), set).is_some() {
            self.held.fetch_sub(1, Ordering::Relaxed);
            self.held_bytes.fetch_sub(bytes, Ordering::Relaxed);
        }
    }

    /// Synchronous form of [`crate::store::Store::lease`].
    pub fn lease_now(&self, id: &LeaseId, op: LeaseOp) -> LeaseAnswer {
        let name = id.record_name();
        let Some(sets) = self.leases.get(&name).map(|h| h.sets.clone()) else {
            return LeaseAnswer::of(LeaseStatus::Unknown);
        };
        let now = self.clock.now();
        let _guards = self.lock(&sets, Some(&name));
        // Read again under the locks: a release of the same lease beside
        // this one holds the record's stripe.
        let Some(mut held) = self.leases.get_mut(&name) else {
            return LeaseAnswer::of(LeaseStatus::Unknown);
        };
        if held.released {
            return LeaseAnswer::of(LeaseStatus::AlreadyReleased);
        }
        if held.expires_at <= now {
            return LeaseAnswer::of(LeaseStatus::Expired);
        }
        match op {
            LeaseOp::Release => {
                for set in &sets {
                    if let Some(mut s) = self.lease_sets.get_mut(set) {
                        s.remove(held.nonce);
                    }
                }
                held.released = true;
                LeaseAnswer::of(LeaseStatus::Done)
            }
            LeaseOp::Renew { ttl } => {
                let ttl = ttl.min(MAX_TTL);
                let expires_at = now.saturating_add(ttl);
                for set in &sets {
                    match self.lease_sets.get_mut(set) {
                        // Inserted anew: a sweep beside this, at a later
                        // instant, may have pruned it.
                        Some(mut s) => s.insert(held.nonce, expires_at),
                        // Swept meanwhile (pruned to empty at a later
                        // instant than this renew's).
                        None => self.add_lease(set, held.nonce, expires_at),
                    }
                }
                held.expires_at = expires_at;
                LeaseAnswer {
                    status: LeaseStatus::Done,
                    expires_in: ttl,
                }
            }
        }
    }

    /// Prunes lease sets and drops the empty ones; counts leases whose time
    /// to live passed unreleased, and drops records past their grace
    /// period.
    pub(super) fn sweep_leases(&self, now: Micros) {
        if self.lease_sets.is_empty() && self.leases.is_empty() {
            return;
        }
        let (mut removed, mut bytes) = (0, 0);
        self.lease_sets.retain(|bucket, set| {
            set.prune(now);
            let keep = !set.is_empty();
            if !keep {
                removed += 1;
                bytes += bucket_bytes(bucket);
            }
            keep
        });
        self.held.fetch_sub(removed, Ordering::Relaxed);
        self.held_bytes.fetch_sub(bytes, Ordering::Relaxed);
        let expired = self.sweep_records(&self.leases, now);
        crate::telemetry::metrics::leases_expired(expired);
    }
}
