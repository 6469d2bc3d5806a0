//! Room for records (reservations' and leases'), counted apart from
//! buckets and shared fairly between tenants.
//!
//! Records have a cap of their own, so no number of them can evict a
//! bucket or keep a new bucket out. Within it, one tenant may hold at most
//! a fair share: the cap divided by one more than the number of tenants
//! holding records (so a tenant alone may fill half, two may fill a third
//! each, and a newcomer always finds room for its share), never less than
//! [`MIN_SHARE`], and never more than the fixed per-tenant cap when one is
//! set. A tenant over its share is refused new records (its reserves and
//! acquires answer RESOURCE_EXHAUSTED) until some of its own expire or are
//! swept; nobody else's records are touched.

use std::sync::atomic::{AtomicUsize, Ordering};

use dashmap::DashMap;
use dashmap::mapref::entry::Entry;
use foldhash::fast::RandomState;

use crate::store::RecordsFull;

/// A share no tenant is refused below, however many tenants hold records
/// (the total cap still holds).
pub(super) const MIN_SHARE: usize = 16;

/// See the module docs.
pub(super) struct Records {
    max: usize,
    per_tenant: usize,
    held: AtomicUsize,
    by_tenant: DashMap<Box<str>, usize, RandomState>,
    /// Entries of `by_tenant`, kept beside it (its `len` locks every shard).
    tenants: AtomicUsize,
}

impl Records {
    /// At most `max` records in all, and `per_tenant` for any one tenant
    /// (`usize::MAX`: only the fair share).
    pub fn new(max: usize, per_tenant: usize) -> Self {
        Self {
            max: max.max(MIN_SHARE),
            per_tenant: per_tenant.max(1),
            held: AtomicUsize::new(0),
            by_tenant: DashMap::with_hasher(RandomState::default()),
            tenants: AtomicUsize::new(0),
        }
    }

    /// Records held in all.
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// Records `tenant` holds.
    #[cfg(test)]
    pub fn held_by(&self, tenant: &str) -> usize {
        self.by_tenant.get(tenant).map_or(0, |n| *n)
    }

    /// Takes room for one record of `tenant`, or says which bound it met.
    pub fn take(&self, tenant: &str) -> Result<(), RecordsFull> {
        let full = |held: usize, why: String, flag| RecordsFull {
            tenant: tenant.to_owned(),
            held,
            why,
            flag,
        };
        // The tenant's entry is locked while it is checked and counted, so
        // two records of one tenant cannot both take its last place.
        let mut entry = match self.by_tenant.entry(tenant.into()) {
            Entry::Occupied(e) => e.into_ref(),
            Entry::Vacant(e) => {
                self.tenants.fetch_add(1, Ordering::Relaxed);
                e.insert(0)
            }
        };
        let mine = *entry;
        let tenants = self.tenants.load(Ordering::Relaxed).max(1);
        let share = (self.max / (tenants + 1)).max(MIN_SHARE);
        let refused = if mine >= self.per_tenant {
            Some(full(
                mine,
                format!("the cap of {} per tenant", self.per_tenant),
                "--max-records-per-tenant",
            ))
        } else if mine >= share {
            Some(full(
                mine,
                format!(
                    "its fair share of {share}: {} records among the {tenants} tenants holding some",
                    self.max
                ),
                "--max-records",
            ))
        } else if self.held.fetch_add(1, Ordering::Relaxed) >= self.max {
            self.held.fetch_sub(1, Ordering::Relaxed);
            Some(full(
                mine,
                format!("all {} records are held", self.max),
                "--max-records",
            ))
        } else {
            None
        };
        match refused {
            Some(err) => {
                if mine == 0 {
                    drop(entry);
                    self.forget_if_empty(tenant);
                }
                Err(err)
            }
            None => {
                *entry += 1;
                Ok(())
            }
        }
    }

    /// Gives back `n` records of `tenant` (taken by [`Records::take`]).
    pub fn give_back(&self, tenant: &str, n: usize) {
        if n == 0 {
            return;
        }
        if let Some(mut mine) = self.by_tenant.get_mut(tenant) {
            let n = n.min(*mine);
            *mine -= n;
            self.held.fetch_sub(n, Ordering::Relaxed);
        }
        self.forget_if_empty(tenant);
    }

    fn forget_if_empty(&self, tenant: &str) {
        if self
            .by_tenant
            .remove_if(tenant, |_, mine| *mine == 0)
            .is_some()
        {
            self.tenants.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_tenant_fills_half_and_a_newcomer_always_finds_its_share() {
        let records = Records::new(1_000, usize::MAX);
        for _ in 0..500 {
            records.take("greedy").unwrap();
        }
        let refused = records.take("greedy").unwrap_err();
        assert_eq!(refused.held, 500);
        assert!(refused.why.contains("fair share of 500"), "{}", refused.why);
        // Two tenants now: each may hold a third.
        for _ in 0..333 {
            records.take("newcomer").unwrap();
        }
        assert_eq!(records.take("newcomer").unwrap_err().held, 333);
        assert_eq!(records.held(), 833);
        // A third arrives: shares are a quarter, and it still finds 167
        // places free.
        for _ in 0..167 {
            records.take("third").unwrap();
        }
        let full = records.take("third").unwrap_err();
        assert!(
            full.why.contains("all 1000 records are held"),
            "{}",
            full.why
        );
        // The greedy tenant's records expire: room comes back to everyone.
        records.give_back("greedy", 500);
        assert_eq!(records.held_by("greedy"), 0);
        assert_eq!(records.held(), 500);
        records.take("third").unwrap();
        // Refused takes leave nothing behind.
        assert!(records.take("greedy").is_ok());
        records.give_back("greedy", 1);
        assert_eq!(records.tenants.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_newcomer_refused_when_all_are_held_is_not_counted_as_a_tenant() {
        let records = Records::new(100, usize::MAX);
        // Shares of a half, a third and a quarter: 50 + 33 + 17 fill it.
        for (tenant, n) in [("a", 50), ("b", 33), ("c", 17)] {
            for _ in 0..n {
                records.take(tenant).unwrap();
            }
        }
        let full = records.take("d").unwrap_err();
        assert!(
            full.why.contains("all 100 records are held"),
            "{}",
            full.why
        );
        assert_eq!(records.tenants.load(Ordering::Relaxed), 3);
        assert_eq!(records.held_by("d"), 0);
        // A tenant refused while holding some keeps its count.
        assert!(records.take("c").is_err());
        assert_eq!(records.held_by("c"), 17);
        // Room comes back; shares are a quarter among the three that hold
        // some, so c takes up to 25.
        records.give_back("a", 10);
        let taken = (0..50).take_while(|_| records.take("c").is_ok()).count();
        assert_eq!(taken, 8);
    }

    #[test]
    fn the_fixed_cap_per_tenant_holds_below_the_share() {
        let records = Records::new(1_000_000, 3);
        for _ in 0..3 {
            records.take("t").unwrap();
        }
        let err = records.take("t").unwrap_err();
        assert_eq!(err.flag, "--max-records-per-tenant");
        assert_eq!(
            err.to_string(),
            "tenant \"t\" holds 3 reservation and lease records (open, or settled and released \
             ones for ten minutes after their ttl), the most it may hold now (the cap of 3 per \
             tenant); settle or release what it holds, reserve with shorter ttls, or raise \
             --max-records-per-tenant"
        );
        records.take("u").unwrap();
        assert_eq!(records.held(), 4);
    }
}
