//! Concurrency caps: at most `cap` leases held at once.
//!
//! A lease set holds, per lease, the instant it expires. A lease is held
//! from its acquire until it is released or its expiry passes (a lease
//! expiring at `now` is no longer held), so a holder that dies frees its
//! slot by itself. The decision reads only an [`Occupancy`], what the set
//! holds at `now` as seen by a cap: the store prunes the set, summarises it
//! and, when the plan grants the lease, adds it. The same arithmetic runs in
//! `lua/token_bucket.lua` (`apply_leases`), on a sorted set scored by expiry.
//!
//! A lease takes one slot. A refusal's `retry_after` is the time until
//! enough held leases expire for one to fit: an upper bound, since a holder
//! may release earlier. `reset_after` is the time until every held lease
//! has expired (all slots free, at the latest).

use super::{Micros, Verdict};

/// What a lease set holds at one instant, as one cap sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Occupancy {
    /// Leases held (expiring after now).
    pub held: u64,
    /// When held leases have expired enough for one more to fit under the
    /// cap (now when one fits already).
    pub free_at: Micros,
    /// When the last held lease expires (now when none is held).
    pub all_free_at: Micros,
}

impl Occupancy {
    /// Nothing held.
    pub fn empty(now: Micros) -> Self {
        Self {
            held: 0,
            free_at: now,
            all_free_at: now,
        }
    }
}

/// Decides a lease against `occupancy` for a cap of `cap`: admitted when
/// `held + need <= cap`. With `grant` (the new lease's expiry) an admitted
/// lease is counted in the occupancy returned; without it this is a check
/// and the occupancy is unchanged.
pub fn decide(
    occupancy: Option<Occupancy>,
    cap: u64,
    need: u64,
    grant: Option<Micros>,
    now: Micros,
) -> (Verdict, Occupancy) {
    let occ = occupancy.unwrap_or_else(|| Occupancy::empty(now));
    let all_free = occ.all_free_at.saturating_sub(now);
    if need > cap {
        let verdict = Verdict {
            allowed: false,
            remaining: cap.saturating_sub(occ.held),
            debt: 0,
            forgiven: 0,
            retry_after: Micros::MAX,
            reset_after: all_free,
        };
        return (verdict, occ);
    }
    if occ.held.saturating_add(need) > cap {
        let verdict = Verdict {
            allowed: false,
            remaining: cap.saturating_sub(occ.held),
            debt: 0,
            forgiven: 0,
            retry_after: occ.free_at.saturating_sub(now).max(1),
            reset_after: all_free,
        };
        return (verdict, occ);
    }
    let taken = u64::from(grant.is_some()).min(need);
    let after = match grant {
        Some(expires_at) => Occupancy {
            held: occ.held + taken,
            free_at: occ.free_at,
            all_free_at: occ.all_free_at.max(expires_at),
        },
        None => occ,
    };
    let verdict = Verdict {
        allowed: true,
        remaining: cap - occ.held - taken,
        debt: 0,
        forgiven: 0,
        retry_after: 0,
        reset_after: after.all_free_at.saturating_sub(now),
    };
    (verdict, after)
}

/// A lease set as the in-process store holds it: per lease its id and
/// expiry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeaseSet {
    /// (expires_at, lease nonce), kept sorted.
    leases: Vec<(Micros, u128)>,
}

impl LeaseSet {
    /// Drops leases expired at `now`.
    pub fn prune(&mut self, now: Micros) {
        let live = self.leases.partition_point(|(at, _)| *at <= now);
        self.leases.drain(..live);
    }

    /// Leases held (call [`LeaseSet::prune`] first).
    pub fn len(&self) -> usize {
        self.leases.len()
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }

    /// What the set holds at `now` for a cap of `cap` (prune first).
    pub fn occupancy(&self, cap: u64, now: Micros) -> Occupancy {
        let held = self.leases.len() as u64;
        let free_at = if held >= cap {
            self.leases[(held - cap) as usize].0
        } else {
            now
        };
        Occupancy {
            held,
            free_at,
            all_free_at: self.leases.last().map_or(now, |(at, _)| *at),
        }
    }

    /// Adds a lease (or moves it to a new expiry).
    pub fn insert(&mut self, nonce: u128, expires_at: Micros) {
        self.remove(nonce);
        let at = self.leases.partition_point(|(e, _)| *e <= expires_at);
        self.leases.insert(at, (expires_at, nonce));
    }

    /// Removes a lease; true when it was held.
    pub fn remove(&mut self, nonce: u128) -> bool {
        match self.leases.iter().position(|(_, n)| *n == nonce) {
            Some(i) => {
                self.leases.remove(i);
                true
            }
            None => false,
        }
    }

    /// Moves a held lease to a new expiry; false when it is not held.
    pub fn renew(&mut self, nonce: u128, expires_at: Micros) -> bool {
        if self.remove(nonce) {
            self.insert(nonce, expires_at);
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: Micros = 1_700_000_000_000_000;

    #[test]
    fn grants_up_to_the_cap_then_refuses_until_the_earliest_expiry() {
        let mut set = LeaseSet::default();
        for (i, ttl) in [(1, 5_000_000), (2, 3_000_000), (3, 9_000_000)] {
            let occ = set.occupancy(3, T0);
            let (v, after) = decide(Some(occ), 3, 1, Some(T0 + ttl), T0);
            assert!(v.allowed);
            assert_eq!(v.remaining, 3 - i as u64);
            assert_eq!(after.held, i as u64);
            set.insert(i, T0 + ttl);
        }
        let occ = set.occupancy(3, T0);
        assert_eq!(occ.free_at, T0 + 3_000_000);
        assert_eq!(occ.all_free_at, T0 + 9_000_000);
        let (v, _) = decide(Some(occ), 3, 1, Some(T0 + 1), T0);
        assert!(!v.allowed);
        assert_eq!(v.remaining, 0);
        assert_eq!(v.retry_after, 3_000_000);
        assert_eq!(v.reset_after, 9_000_000);
        // At its expiry the lease is no longer held: one fits again.
        let later = T0 + 3_000_000;
        set.prune(later);
        assert_eq!(set.len(), 2);
        let (v, _) = decide(Some(set.occupancy(3, later)), 3, 1, Some(later + 1), later);
        assert!(v.allowed);
        assert_eq!(v.remaining, 0);
    }

    #[test]
    fn a_lowered_cap_waits_for_enough_expiries() {
        let mut set = LeaseSet::default();
        for i in 0..5u128 {
            set.insert(i, T0 + (i as Micros + 1) * 1_000_000);
        }
        // Five held under a cap of two: three must expire for one to fit.
        let (v, _) = decide(Some(set.occupancy(2, T0)), 2, 1, None, T0);
        assert!(!v.allowed);
        assert_eq!(v.retry_after, 4_000_000);
        assert_eq!(v.reset_after, 5_000_000);
    }

    #[test]
    fn a_need_above_the_cap_never_fits_and_one_equal_to_it_does() {
        // Nothing held (no set yet): the occupancy is empty at `now`.
        let (v, occ) = decide(None, 3, 1, None, T0);
        assert!(v.allowed);
        assert_eq!(occ, Occupancy::empty(T0));
        assert_eq!(
            Occupancy::empty(T0),
            Occupancy {
                held: 0,
                free_at: T0,
                all_free_at: T0
            }
        );
        let (v, after) = decide(None, 3, 3, Some(T0 + 5), T0);
        assert!(v.allowed, "a need equal to the cap fits an empty set");
        assert_eq!(
            (after.held, after.free_at, after.all_free_at),
            (1, T0, T0 + 5)
        );
        assert_eq!((v.remaining, v.reset_after), (2, 5));
        // Above the cap no expiry helps: an infinite wait, not the next expiry.
        let (v, _) = decide(None, 3, 4, None, T0);
        assert!(!v.allowed);
        assert_eq!((v.remaining, v.retry_after), (3, Micros::MAX));
    }

    #[test]
    fn release_and_renew_touch_only_held_leases() {
        let mut set = LeaseSet::default();
        assert!(set.is_empty());
        set.insert(7, T0 + 10);
        set.insert(8, T0 + 5);
        assert!(!set.is_empty());
        assert!(set.renew(8, T0 + 20));
        assert_eq!(set.occupancy(9, T0).all_free_at, T0 + 20);
        assert!(set.remove(8));
        assert!(!set.remove(8));
        assert!(!set.renew(8, T0 + 30));
        set.prune(T0 + 10);
        assert!(set.is_empty());
    }
}
