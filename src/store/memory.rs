//! The in-process store: buckets in a sharded hash map.
//!
//! Atomicity: every bucket maps to one of a fixed set of stripe locks. A
//! decision locks the stripes of all its buckets in ascending order (so two
//! decisions can never deadlock), reads, plans and writes, then unlocks. A
//! single-bucket decision takes one uncontended lock.
//!
//! Memory is bounded by *active* buckets. A full bucket is indistinguishable
//! from a new one, so it is dropped: by [`MemoryStore::sweep_idle`], which
//! the server runs periodically, and when the map reaches its cap.
//!
//! At the cap (`max_buckets`) only full buckets are ever dropped: dropping
//! one that is still refilling would give its spent tokens back, so a flood
//! of new keys could reset a bystander's exhausted key. When a decision
//! needs new buckets and the map is full of buckets still refilling, the
//! idle ones are swept (at most once per [`SWEEP_AT_CAP_EVERY`]), and if
//! there is still no room the decision is refused with
//! [`AtCapacity`]: nothing is written, and the layer above answers by the
//! rule's store-unavailable policy. Keys already held keep working.

use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use dashmap::DashMap;
use foldhash::fast::RandomState;
use parking_lot::Mutex;
use smallvec::SmallVec;

use super::{BucketKey, PingFuture, Store, StoreError, StoreFuture, StoreStatus, Verdicts};
use crate::algorithm::{Charge, Micros, Plan, State, plan};
use crate::clock::Clock;

const STRIPES: usize = 4096;

/// How often a full map may be swept for idle buckets when a decision needs
/// room: a flood of new keys at the cap costs one pass over the map per
/// period, not one per request.
pub const SWEEP_AT_CAP_EVERY: Micros = 10_000;

/// The map is at its cap and none of its buckets may be dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "the in-memory bucket table is full ({max} buckets, all still refilling); \
     new keys are refused until some refill (raise --max-buckets)"
)]
pub struct AtCapacity {
    /// The cap.
    pub max: usize,
}

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
    /// Buckets held, kept beside the map so that the cap check on every
    /// decision is one atomic load, not a pass over the map's shards.
    held: AtomicUsize,
    last_sweep_at_cap: AtomicU64,
    evicted_idle: AtomicU64,
    refused: AtomicU64,
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
            held: AtomicUsize::new(0),
            last_sweep_at_cap: AtomicU64::new(0),
            evicted_idle: AtomicU64::new(0),
            refused: AtomicU64::new(0),
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

    /// So far: (buckets dropped because they were full, decisions refused
    /// at the cap).
    pub fn evictions(&self) -> (u64, u64) {
        (
            self.evicted_idle.load(Ordering::Relaxed),
            self.refused.load(Ordering::Relaxed),
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
        let mut removed = 0;
        self.buckets.retain(|_, state| {
            let idle = state.is_idle(now);
            removed += usize::from(idle);
            !idle
        });
        self.held.fetch_sub(removed, Ordering::Relaxed);
        self.evicted_idle
            .fetch_add(removed as u64, Ordering::Relaxed);
        removed
    }

    /// Synchronous form of [`Store::apply`]. Refused, writing nothing, when
    /// it needs new buckets and the map is full of buckets still refilling.
    pub fn apply_now(
        &self,
        buckets: &[BucketKey],
        charges: &[Charge],
        spend: bool,
    ) -> Result<Plan, AtCapacity> {
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
        let writes = plan.writes.iter().filter(|w| w.is_some()).count();
        // Far from the cap (the usual case) this is one length check.
        let held = |store: &Self| store.held.load(Ordering::Relaxed);
        if writes > 0 && held(self) + writes > self.max_buckets {
            let new = |store: &Self| {
                buckets
                    .iter()
                    .zip(&plan.writes)
                    .filter(|(b, w)| w.is_some() && !store.buckets.contains_key(*b))
                    .count()
            };
            if new(self) > 0 && held(self) + new(self) > self.max_buckets {
                self.sweep_at_cap(now);
                if held(self) + new(self) > self.max_buckets {
                    self.refused.fetch_add(1, Ordering::Relaxed);
                    return Err(AtCapacity {
                        max: self.max_buckets,
                    });
                }
            }
        }
        for (bucket, write) in buckets.iter().zip(&plan.writes) {
            let Some(state) = write else { continue };
            match self.buckets.get_mut(bucket) {
                Some(mut entry) => *entry = *state,
                None => {
                    if self.buckets.insert(bucket.clone(), *state).is_none() {
                        self.held.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        drop(guards);
        Ok(plan)
    }

    fn stripe_of(&self, bucket: &BucketKey) -> usize {
        (self.stripe_hasher.hash_one(bucket) as usize) % STRIPES
    }

    /// Drops the idle buckets of a full map, at most once per
    /// [`SWEEP_AT_CAP_EVERY`]; one caller sweeps while the others go on.
    /// (Safe under the caller's stripe locks: see [`Self::sweep_idle`].)
    fn sweep_at_cap(&self, now: Micros) {
        let last = self.last_sweep_at_cap.load(Ordering::Relaxed);
        if now < last.saturating_add(SWEEP_AT_CAP_EVERY) {
            return;
        }
        let Some(_sweeping) = self.compacting.try_lock() else {
            return;
        };
        self.last_sweep_at_cap.store(now, Ordering::Relaxed);
        self.sweep_idle();
    }
}

impl Store for MemoryStore {
    fn apply<'a>(
        &'a self,
        buckets: &'a [BucketKey],
        charges: &'a [Charge],
        spend: bool,
    ) -> StoreFuture<'a> {
        let result = Store::apply_now(self, buckets, charges, spend).expect("never waits");
        Box::pin(std::future::ready(result))
    }

    fn apply_now(
        &self,
        buckets: &[BucketKey],
        charges: &[Charge],
        spend: bool,
    ) -> Option<Result<Verdicts, StoreError>> {
        Some(
            MemoryStore::apply_now(self, buckets, charges, spend)
                .map(|plan| Verdicts {
                    allowed: plan.allowed,
                    verdicts: plan.verdicts,
                })
                .map_err(|full| StoreError::AtCapacity(full.to_string())),
        )
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
                    store.apply_now(&b, &c, true).unwrap().allowed
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
                        admitted += usize::from(store.apply_now(&b, &c, true).unwrap().allowed);
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
        store
            .apply_now(&[key("a")], &[charge(10, "10/second", 5)], true)
            .unwrap(); // full in 500 ms
        store
            .apply_now(&[key("b")], &[charge(10, "10/second", 1)], true)
            .unwrap(); // full in 100 ms
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
            assert!(store.apply_now(&victim, &c, true).unwrap().allowed);
        }
        let (mut peak, mut refused) = (0, 0);
        for i in 0..1_000_000u32 {
            clock.advance(Duration::from_micros(1));
            match store.apply_now(&[key(&i.to_string())], &c, true) {
                Ok(plan) => assert!(plan.allowed),
                Err(full) => {
                    assert_eq!(full, AtCapacity { max: 10_000 });
                    refused += 1;
                }
            }
            peak = peak.max(store.len());
        }
        assert_eq!(peak, 10_000);
        assert_eq!(refused, 1_000_000 - 9_999, "every key past the cap");
        assert_eq!(
            store.evictions(),
            (0, refused as u64),
            "nothing was full again"
        );
        // The limited key was never dropped.
        assert!(!store.apply_now(&victim, &c, true).unwrap().allowed);
    }

    /// The flood of the issue that found this: a bystander's exhausted key
    /// refills fast, the flood's keys slowly, so the old policy (drop those
    /// closest to full) dropped the bystander and gave its tokens back.
    #[test]
    fn a_flood_of_new_keys_never_refills_a_bystanders_exhausted_key() {
        let clock = Arc::new(ManualClock::new(T0));
        let store = MemoryStore::new(clock.clone(), 1_000);
        let bystander = [BucketKey::new("calm", "k", "", "user")];
        let fast = [charge(10, "10/second", 1)];
        for _ in 0..10 {
            assert!(store.apply_now(&bystander, &fast, true).unwrap().allowed);
        }
        let slow = [charge(10, "1/hour", 1)];
        for i in 0..1_200u32 {
            let _ = store.apply_now(
                &[BucketKey::new("flood", "k", "", &i.to_string())],
                &slow,
                true,
            );
        }
        for _ in 0..10 {
            assert!(
                !store.apply_now(&bystander, &fast, true).unwrap().allowed,
                "the bystander's key stays exhausted"
            );
        }
        // Once its bucket is full again it may go, and new keys get room.
        clock.advance(Duration::from_secs(1));
        assert_eq!(
            store.apply_now(&bystander, &fast, true).unwrap().verdicts[0].remaining,
            9
        );
        clock.advance(Duration::from_secs(2));
        assert!(
            store
                .apply_now(&[BucketKey::new("new", "k", "", "x")], &slow, true)
                .is_ok()
        );
        assert!(store.state(&bystander[0]).is_none(), "swept once full");
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
        store
            .apply_now(
                &[BucketKey::new("acme", "k", "", &format!("user-{i:07}"))],
                &charge,
                true,
            )
            .unwrap();
    }
    let after = rss();
    println!(
        "{} buckets, keys like acme:k::user-0000001: {} bytes each",
        store.len(),
        (after - before) / store.len() as u64
    );
}
