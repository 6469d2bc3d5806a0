//! The in-process store: buckets in a sharded hash map.
//!
//! Atomicity: every bucket maps to one of a fixed set of stripe locks. A
//! decision locks the stripes of all its buckets in ascending order (so two
//! decisions can never deadlock), reads, plans and writes, then unlocks. A
//! single-bucket decision takes one uncontended lock.
//!
//! Memory is bounded by *active* buckets. A full bucket is indistinguishable
//! from a new one, so it is dropped: by [`MemoryStore::sweep_idle`], which
//! the server runs periodically, and whenever the map reaches its cap.
//!
//! Eviction policy at the cap (`max_buckets`): first every idle (full) bucket
//! goes; if the map is still above 90% of the cap, the buckets that will be
//! full again soonest go until it is at 90%. Those buckets hold the least
//! debt, so evicting them hands out the fewest unearned tokens, and a key
//! that is actively being limited (deep in debt) is the last to be dropped.
//! Compacting to 90% keeps the cost amortised: one pass over the map buys
//! room for a tenth of the cap in new keys.

use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dashmap::DashMap;
use foldhash::fast::RandomState;
use parking_lot::Mutex;
use smallvec::SmallVec;

use super::{BucketKey, PingFuture, Store, StoreFuture, StoreStatus, Verdicts};
use crate::algorithm::{Charge, Micros, Plan, State, plan};
use crate::clock::Clock;

const STRIPES: usize = 4096;

/// Buckets per decision held inline before the per-decision scratch space
/// spills to the heap (a request rarely touches more than a key and a
/// tenant bucket, plus a resource rule or two).
const INLINE: usize = 4;

/// Buckets held in this process.
pub struct MemoryStore {
    /// Keyed with foldhash: bucket names come from callers, but the hasher
    /// is randomly seeded per process, and SipHash cost a tenth of a
    /// decision's time in the store.
    buckets: DashMap<BucketKey, State, RandomState>,
    stripes: Box<[Mutex<()>]>,
    stripe_hasher: RandomState,
    clock: Arc<dyn Clock>,
    max_buckets: usize,
    compacting: Mutex<()>,
    evicted_idle: AtomicU64,
    evicted_capacity: AtomicU64,
}

impl MemoryStore {
    /// A store holding at most about `max_buckets` buckets (at least 16).
    pub fn new(clock: Arc<dyn Clock>, max_buckets: usize) -> Self {
        Self {
            buckets: DashMap::with_hasher(RandomState::default()),
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            stripe_hasher: RandomState::default(),
            clock,
            max_buckets: max_buckets.max(16),
            compacting: Mutex::new(()),
            evicted_idle: AtomicU64::new(0),
            evicted_capacity: AtomicU64::new(0),
        }
    }

    /// Buckets currently held.
    pub fn len(&self) -> usize {
        self.buckets.len()
    }

    /// True when no bucket is held.
    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }

    /// The configured cap.
    pub fn max_buckets(&self) -> usize {
        self.max_buckets
    }

    /// Buckets dropped so far: (idle, at capacity).
    pub fn evictions(&self) -> (u64, u64) {
        (
            self.evicted_idle.load(Ordering::Relaxed),
            self.evicted_capacity.load(Ordering::Relaxed),
        )
    }

    /// The stored state of a bucket, if any (for tests and inspection).
    pub fn state(&self, bucket: &BucketKey) -> Option<State> {
        self.buckets.get(bucket).map(|e| *e)
    }

    /// Drops every bucket that is full now. Returns how many went.
    ///
    /// Safe against concurrent decisions without taking the stripe locks:
    /// only full buckets are removed, and a full bucket means the same as an
    /// absent one, so a decision that read it before the removal writes a
    /// correct state after it.
    pub fn sweep_idle(&self) -> usize {
        let now = self.clock.now();
        let before = self.buckets.len();
        self.buckets.retain(|_, state| !state.is_idle(now));
        let removed = before.saturating_sub(self.buckets.len());
        self.evicted_idle
            .fetch_add(removed as u64, Ordering::Relaxed);
        removed
    }

    /// Synchronous form of [`Store::apply`].
    pub fn apply_now(&self, buckets: &[BucketKey], charges: &[Charge], spend: bool) -> Plan {
        debug_assert_eq!(buckets.len(), charges.len());
        let now = self.clock.now();
        let mut stripes: SmallVec<[usize; INLINE]> =
            buckets.iter().map(|b| self.stripe_of(b)).collect();
        stripes.sort_unstable();
        stripes.dedup();
        let guards: SmallVec<[_; INLINE]> =
            stripes.iter().map(|&i| self.stripes[i].lock()).collect();

        let states: SmallVec<[Option<State>; INLINE]> =
            buckets.iter().map(|b| self.state(b)).collect();
        let plan = plan(&states, charges, now, spend);
        let mut added = false;
        for (bucket, write) in buckets.iter().zip(&plan.writes) {
            let Some(state) = write else { continue };
            match self.buckets.get_mut(bucket) {
                Some(mut entry) => *entry = *state,
                None => {
                    self.buckets.insert(bucket.clone(), *state);
                    added = true;
                }
            }
        }
        drop(guards);

        if added && self.buckets.len() > self.max_buckets {
            self.make_room(now);
        }
        plan
    }

    fn stripe_of(&self, bucket: &BucketKey) -> usize {
        (self.stripe_hasher.hash_one(bucket) as usize) % STRIPES
    }

    /// Brings the map back under its cap (see the module docs for the
    /// policy). One caller compacts at a time; others carry on, so the map
    /// may briefly exceed the cap by the number of concurrent inserts.
    fn make_room(&self, now: Micros) {
        let Some(_compacting) = self.compacting.try_lock() else {
            return;
        };
        if self.buckets.len() <= self.max_buckets {
            return;
        }
        let before = self.buckets.len();
        self.buckets.retain(|_, state| !state.is_idle(now));
        let after_idle = self.buckets.len();
        self.evicted_idle
            .fetch_add(before.saturating_sub(after_idle) as u64, Ordering::Relaxed);

        let target = self.max_buckets - self.max_buckets / 10;
        if after_idle <= target {
            return;
        }
        // Find the full_at below which `after_idle - target` buckets lie.
        let mut full_at: Vec<Micros> = self.buckets.iter().map(|e| e.idle_at()).collect();
        let excess = full_at.len().saturating_sub(target);
        if excess == 0 {
            return;
        }
        let (_, cutoff, _) = full_at.select_nth_unstable(excess - 1);
        let cutoff = *cutoff;
        self.buckets.retain(|_, state| state.idle_at() > cutoff);
        self.evicted_capacity.fetch_add(
            after_idle.saturating_sub(self.buckets.len()) as u64,
            Ordering::Relaxed,
        );
    }
}

impl Store for MemoryStore {
    fn apply<'a>(
        &'a self,
        buckets: &'a [BucketKey],
        charges: &'a [Charge],
        spend: bool,
    ) -> StoreFuture<'a> {
        let plan = self.apply_now(buckets, charges, spend);
        Box::pin(std::future::ready(Ok(Verdicts {
            allowed: plan.allowed,
            verdicts: plan.verdicts,
        })))
    }

    fn ping(&self) -> PingFuture<'_> {
        Box::pin(std::future::ready(Ok(())))
    }

    fn kind(&self) -> &'static str {
        "memory"
    }

    fn status(&self) -> StoreStatus {
        StoreStatus {
            kind: "memory",
            breaker: None,
            local: Some(super::stack::memory_status(self)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{Limit, Rate};
    use crate::clock::ManualClock;
    use std::time::Duration;

    const T0: Micros = 1_700_000_000_000_000;

    fn charge(burst: u64, rate: &str, cost: u64) -> Charge {
        Charge {
            limit: Limit::new(burst, rate.parse::<Rate>().unwrap()).unwrap(),
            cost,
            enforce: true,
        }
    }

    fn key(k: &str) -> BucketKey {
        BucketKey::new("t", "k", "", k)
    }

    #[test]
    fn five_hundred_racers_at_a_bucket_of_one_hundred_admit_exactly_one_hundred() {
        let store = Arc::new(MemoryStore::new(Arc::new(ManualClock::new(T0)), 1000));
        // No refill to speak of: one token a day, and the clock stands still.
        let c = [charge(100, "1/day", 1)];
        let b = [key("hot")];
        let barrier = Arc::new(std::sync::Barrier::new(500));
        let handles: Vec<_> = (0..500)
            .map(|_| {
                let (store, barrier) = (store.clone(), barrier.clone());
                let (c, b) = (c, b.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    store.apply_now(&b, &c, true).allowed
                })
            })
            .collect();
        let admitted = handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .filter(|a| *a)
            .count();
        assert_eq!(admitted, 100);
        let state = store.state(&key("hot")).unwrap();
        assert_eq!(state.idle_at(), T0 + 100 * 86_400_000_000);
    }

    #[test]
    fn multi_bucket_decisions_race_without_deadlock_or_overshoot() {
        // Each decision charges a shared tenant bucket and one of 8 keys, in
        // varying order; the tenant bucket admits exactly its burst of 200.
        let store = Arc::new(MemoryStore::new(Arc::new(ManualClock::new(T0)), 1000));
        let handles: Vec<_> = (0..8)
            .map(|t| {
                let store = store.clone();
                std::thread::spawn(move || {
                    let mut admitted = 0;
                    for i in 0..100 {
                        let mut b = vec![BucketKey::new("t", "t", "", ""), key(&format!("k{t}"))];
                        let mut c = vec![charge(200, "1/day", 1), charge(1000, "1/day", 1)];
                        if i % 2 == 0 {
                            b.reverse();
                            c.reverse();
                        }
                        admitted += usize::from(store.apply_now(&b, &c, true).allowed);
                    }
                    admitted
                })
            })
            .collect();
        let admitted: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(admitted, 200);
        // Keys were only charged for admitted requests.
        let spent: u64 = (0..8)
            .map(|t| {
                store
                    .state(&key(&format!("k{t}")))
                    .map_or(0, |s| (s.idle_at() - T0) / 86_400_000_000)
            })
            .sum();
        assert_eq!(spent, 200);
    }

    #[test]
    fn idle_buckets_are_swept_once_full_again() {
        let clock = Arc::new(ManualClock::new(T0));
        let store = MemoryStore::new(clock.clone(), 1000);
        store.apply_now(&[key("a")], &[charge(10, "10/second", 5)], true); // full in 500 ms
        store.apply_now(&[key("b")], &[charge(10, "10/second", 1)], true); // full in 100 ms
        assert_eq!(store.len(), 2);
        clock.advance(Duration::from_millis(100));
        assert_eq!(store.sweep_idle(), 1);
        assert!(store.state(&key("b")).is_none());
        clock.advance(Duration::from_millis(399));
        assert_eq!(store.sweep_idle(), 0);
        clock.advance(Duration::from_millis(1));
        assert_eq!(store.sweep_idle(), 1);
        assert!(store.is_empty());
        assert_eq!(store.evictions(), (2, 0));
    }

    #[test]
    fn spraying_a_million_unique_keys_stays_under_the_cap_and_keeps_the_limited_key() {
        let clock = Arc::new(ManualClock::new(T0));
        let store = MemoryStore::new(clock.clone(), 10_000);
        let c = [charge(5, "1/hour", 1)];
        // A key that is being limited: burst spent, the next request rejected.
        let victim = [key("victim")];
        for _ in 0..5 {
            assert!(store.apply_now(&victim, &c, true).allowed);
        }
        let mut peak = 0;
        for i in 0..1_000_000u32 {
            clock.advance(Duration::from_micros(1));
            store.apply_now(&[key(&i.to_string())], &c, true);
            peak = peak.max(store.len());
        }
        assert!(peak <= 10_000 + 1, "peak {peak}");
        let (idle, capacity) = store.evictions();
        assert_eq!(idle, 0, "no bucket was full again");
        assert_eq!(capacity as usize + store.len(), 1_000_001);
        // The limited key owes the most time and was never dropped.
        assert!(!store.apply_now(&victim, &c, true).allowed);
    }
}

/// Measures the resident memory of a million buckets (run with
/// `cargo test --release --lib bytes_per_bucket -- --ignored --nocapture`;
/// the figure is in BENCHMARKS.md).
#[cfg(test)]
#[test]
#[ignore = "a measurement, not a check"]
fn bytes_per_bucket() {
    use crate::algorithm::{Limit, Rate};
    use crate::clock::ManualClock;
    let rss = || {
        std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .find_map(|l| {
                l.strip_prefix("VmRSS:")
                    .map(|v| v.trim().trim_end_matches(" kB").parse::<u64>().unwrap())
            })
            .unwrap()
            * 1024
    };
    let store = MemoryStore::new(Arc::new(ManualClock::new(1_700_000_000_000_000)), 2_000_000);
    let charge = [crate::algorithm::Charge {
        limit: Limit::new(30, "600/minute".parse::<Rate>().unwrap()).unwrap(),
        cost: 1,
        enforce: true,
    }];
    let before = rss();
    for i in 0..1_000_000u32 {
        store.apply_now(
            &[BucketKey::new("acme", "k", "", &format!("user-{i:07}"))],
            &charge,
            true,
        );
    }
    let after = rss();
    println!(
        "{} buckets, keys like acme:k::user-0000001: {} bytes each",
        store.len(),
        (after - before) / store.len() as u64
    );
}
