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

use super::reservation::{self, EXPIRED_GRACE, Record};
use super::{
    Attachment, BucketKey, LeaseFuture, LeaseId, LeaseOp, PingFuture, RecordsFull, Request,
    Reservation, ReservationId, SettleFuture, SettleStatus, Settled, Store, StoreError,
    StoreFuture, StoreStatus, Verdicts,
};
use crate::algorithm::concurrency::LeaseSet;
use crate::algorithm::{Charge, Micros, Op, Plan, State, plan};

mod journal;
mod leases;
mod records;
use crate::clock::Clock;
pub use journal::MAX_EVENTS as MAX_JOURNAL_EVENTS;
use journal::MemoryJournal;
use leases::HeldLease;
use records::Records;

const STRIPES: usize = 4096;

/// How often a full map may be swept for idle buckets when a decision needs
/// room: a flood of new keys at the cap costs one pass over the map per
/// period, not one per request.
pub const SWEEP_AT_CAP_EVERY: Micros = 10_000;

/// The map is at its cap and none of its buckets may be dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "the in-memory bucket table is full (at most {max} buckets and {max_bytes} bytes, \
     the buckets held all still refilling); new keys are refused until some refill \
     (raise --max-buckets or --max-bucket-bytes)"
)]
pub struct AtCapacity {
    /// The cap on buckets.
    pub max: usize,
    /// The cap on bytes.
    pub max_bytes: usize,
}

/// Why the in-memory store refused a decision, writing nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// No room for its new buckets: the rules' store-unavailable policies
    /// answer.
    #[error(transparent)]
    Buckets(#[from] AtCapacity),
    /// Its tenant may hold no more records: the caller is told so.
    #[error(transparent)]
    Records(#[from] RecordsFull),
}

impl From<Refused> for StoreError {
    fn from(refused: Refused) -> Self {
        match refused {
            Refused::Buckets(full) => StoreError::AtCapacity(full.to_string()),
            Refused::Records(full) => StoreError::TooManyRecords(full.to_string()),
        }
    }
}

/// Buckets per decision held inline before the per-decision scratch space
/// spills to the heap (a request rarely touches more than a key and a
/// tenant bucket, plus a resource rule or two).
const INLINE: usize = 4;

/// What one bucket costs besides its key: the state, the map entry and the
/// key's allocation (measured at 148 bytes; `bytes_per_bucket_stay_under_what_the_cap_counts`).
pub const BUCKET_OVERHEAD_BYTES: usize = 160;

/// The bytes a bucket is counted as against the byte cap.
fn bucket_bytes(bucket: &BucketKey) -> usize {
    BUCKET_OVERHEAD_BYTES + bucket.as_str().len()
}

/// A record held beside the buckets (a reservation's, or a lease's):
/// counted in `records`, its expiry counted once, dropped
/// [`EXPIRED_GRACE`] after it expires.
trait HeldRecord {
    /// When its time to live ends.
    fn expires_at(&self) -> Micros;
    /// Settled or released: its expiry is never counted.
    fn finished(&self) -> bool;
    /// Whether its expiry has been counted.
    fn expiry_counted(&mut self) -> &mut bool;
}

/// A reservation record held in memory.
#[derive(Debug, Clone)]
struct Held {
    record: Record,
    buckets: Vec<BucketKey>,
    /// Its expiry has been counted (`tollgate_reservations_expired_total`).
    expiry_counted: bool,
}

impl HeldRecord for Held {
    fn expires_at(&self) -> Micros {
        self.record.expires_at
    }
    fn finished(&self) -> bool {
        self.record.settled.is_some()
    }
    fn expiry_counted(&mut self) -> &mut bool {
        &mut self.expiry_counted
    }
}

/// Buckets held in this process.
pub struct MemoryStore {
    /// Keyed with foldhash: bucket names come from callers, but the hasher
    /// is randomly seeded per process, and SipHash cost a tenth of a
    /// decision's time in the store.
    buckets: DashMap<BucketKey, State, RandomState>,
    /// Reservation records by [`ReservationId::record_name`]; counted in
    /// `records`, apart from buckets.
    reservations: DashMap<BucketKey, Held, RandomState>,
    /// Concurrency caps' lease sets, by bucket; each counted as a bucket.
    lease_sets: DashMap<BucketKey, LeaseSet, RandomState>,
    /// Lease records by [`LeaseId::record_name`]; counted in `records`.
    leases: DashMap<BucketKey, HeldLease, RandomState>,
    records: Records,
    stripes: Box<[Mutex<()>]>,
    stripe_hasher: RandomState,
    clock: Arc<dyn Clock>,
    max_buckets: usize,
    compacting: Mutex<()>,
    /// Buckets held, kept beside the map so that the cap check on every
    /// decision is one atomic load, not a pass over the map's shards.
    held: AtomicUsize,
    /// Bytes held, counted by [`bucket_bytes`].
    held_bytes: AtomicUsize,
    max_bytes: usize,
    last_sweep_at_cap: AtomicU64,
    evicted_idle: AtomicU64,
    refused: AtomicU64,
    /// Quota events, when this store is the one the ledger records from
    /// (not when it stands in for Redis).
    journal: Option<Box<MemoryJournal>>,
    /// Share tables ([`super::shares`]).
    shares: super::shares::ShareTables,
}

impl MemoryStore {
    /// The current time on this store's clock.
    pub fn now(&self) -> Micros {
        self.clock.now()
    }

    /// A store holding at most about `max_buckets` buckets (at least 16).
    pub fn new(clock: Arc<dyn Clock>, max_buckets: usize) -> Self {
        Self {
            buckets: DashMap::with_hasher(RandomState::default()),
            reservations: DashMap::with_hasher(RandomState::default()),
            lease_sets: DashMap::with_hasher(RandomState::default()),
            leases: DashMap::with_hasher(RandomState::default()),
            records: Records::new(max_buckets, usize::MAX),
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            stripe_hasher: RandomState::default(),
            clock,
            max_buckets: max_buckets.max(16),
            compacting: Mutex::new(()),
            held: AtomicUsize::new(0),
            held_bytes: AtomicUsize::new(0),
            max_bytes: usize::MAX,
            last_sweep_at_cap: AtomicU64::new(0),
            evicted_idle: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            journal: None,
            shares: super::shares::ShareTables::default(),
        }
    }

    /// Keeps a quota journal ([`crate::store::journal`]): this store holds
    /// the counters the usage ledger records.
    pub fn with_journal(mut self) -> Self {
        self.journal = Some(Box::default());
        self
    }

    /// Quota events lost to a full journal (a ledger that could not write
    /// for [`MAX_JOURNAL_EVENTS`] events).
    pub fn journal_dropped(&self) -> u64 {
        self.journal.as_ref().map_or(0, |j| j.dropped())
    }

    /// Caps the bytes held too (each bucket counted as
    /// [`BUCKET_OVERHEAD_BYTES`] plus its key), so that long keys cannot
    /// take more memory than the cap says.
    pub fn with_max_bytes(mut self, max_bytes: usize) -> Self {
        self.max_bytes = max_bytes.max(16 * BUCKET_OVERHEAD_BYTES);
        self
    }

    /// Caps reservation and lease records: `max` in all (by default as
    /// many as `max_buckets`), and `per_tenant` for any one tenant besides
    /// its fair share (see `records`).
    pub fn with_max_records(mut self, max: usize, per_tenant: Option<usize>) -> Self {
        self.records = Records::new(max, per_tenant.unwrap_or(usize::MAX));
        self
    }

    /// The byte cap.
    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// Bytes currently held, as counted against the byte cap.
    pub fn bytes(&self) -> usize {
        self.held_bytes.load(Ordering::Relaxed)
    }

    /// Buckets currently held.
    pub fn len(&self) -> usize {
        self.buckets.len()
    }

    /// Reservation records currently held (settled ones until they expire).
    pub fn reservations(&self) -> usize {
        self.reservations.len()
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
        let (mut removed, mut bytes) = (0, 0);
        self.buckets.retain(|bucket, state| {
            let idle = state.is_idle(now);
            if idle {
                removed += 1;
                bytes += bucket_bytes(bucket);
            }
            !idle
        });
        self.held.fetch_sub(removed, Ordering::Relaxed);
        self.held_bytes.fetch_sub(bytes, Ordering::Relaxed);
        self.evicted_idle
            .fetch_add(removed as u64, Ordering::Relaxed);
        self.sweep_reservations(now);
        self.sweep_leases(now);
        removed
    }

    /// Counts reservations whose time to live passed unsettled, and drops
    /// records past their grace period.
    fn sweep_reservations(&self, now: Micros) {
        if !self.reservations.is_empty() {
            let expired = self.sweep_records(&self.reservations, now);
            crate::telemetry::metrics::reservations_expired(expired);
        }
    }

    /// Counts the records of `map` whose time to live passed unfinished
    /// (each once), drops those past their grace period, and returns how
    /// many it counted.
    fn sweep_records<R: HeldRecord>(
        &self,
        map: &DashMap<BucketKey, R, RandomState>,
        now: Micros,
    ) -> u64 {
        let mut expired = 0;
        let mut removed: Vec<BucketKey> = Vec::new();
        map.retain(|name, held| {
            if held.expires_at() <= now && !held.finished() && !*held.expiry_counted() {
                *held.expiry_counted() = true;
                expired += 1;
            }
            let keep = held.expires_at().saturating_add(EXPIRED_GRACE) > now;
            if !keep {
                removed.push(name.clone());
            }
            keep
        });
        for name in &removed {
            self.records.give_back(name.tenant(), 1);
        }
        expired
    }

    /// Synchronous form of [`Store::apply`]. Refused, writing nothing, when
    /// it needs new buckets and the map is full of buckets still refilling.
    pub fn apply_now(
        &self,
        buckets: &[BucketKey],
        charges: &[Charge],
        op: Op,
    ) -> Result<Plan, Refused> {
        self.apply_locked(buckets, charges, op, None)
    }

    /// Synchronous form of [`Store::apply`] writing `attachment` when the
    /// decision admits.
    pub fn attach_now(
        &self,
        buckets: &[BucketKey],
        charges: &[Charge],
        attachment: &Attachment,
    ) -> Result<Plan, Refused> {
        let op = match attachment.op() {
            Op::Acquire { ttl } => Op::Acquire {
                ttl: ttl.min(super::lease::MAX_TTL),
            },
            op => op,
        };
        self.apply_locked(buckets, charges, op, Some(attachment))
    }

    /// Locks the stripes of `buckets` (and of `extra`, a record's name),
    /// in ascending order.
    fn lock(
        &self,
        buckets: &[BucketKey],
        extra: Option<&BucketKey>,
    ) -> SmallVec<[parking_lot::MutexGuard<'_, ()>; INLINE]> {
        if let ([bucket], None) = (buckets, extra) {
            // The usual decision: one bucket, one stripe, nothing to order.
            let mut guards = SmallVec::new();
            guards.push(self.stripes[self.stripe_of(bucket)].lock());
            return guards;
        }
        let mut stripes: SmallVec<[usize; INLINE]> =
            buckets.iter().map(|b| self.stripe_of(b)).collect();
        if let Some(name) = extra {
            stripes.push(self.stripe_of(name));
        }
        stripes.sort_unstable();
        stripes.dedup();
        stripes.iter().map(|&i| self.stripes[i].lock()).collect()
    }

    fn apply_locked(
        &self,
        buckets: &[BucketKey],
        charges: &[Charge],
        op: Op,
        attach: Option<&Attachment>,
    ) -> Result<Plan, Refused> {
        debug_assert_eq!(buckets.len(), charges.len());
        let now = self.clock.now();
        let guards = self.lock(buckets, None);

        let states: SmallVec<[Option<State>; INLINE]> = buckets
            .iter()
            .zip(charges)
            .map(|(b, c)| {
                if c.limit.is_concurrency() {
                    self.occupancy(b, c.limit.burst(), now)
                } else {
                    self.state(b)
                }
            })
            .collect();
        let mut plan = plan(&states, charges, now, op);
        // A state that is full again means the same as none: not stored
        // anew (a refund to a full bucket, a charge of nothing).
        for ((write, bucket), charge) in plan.writes.iter_mut().zip(buckets).zip(charges) {
            if write.is_some_and(|w| w.is_idle(now)) && !self.holds(bucket, charge) {
                *write = None;
            }
        }
        let (record, lease) = match attach {
            Some(Attachment::Reservation(r)) if plan.allowed => {
                (Some(self.record(r, buckets, charges, &plan, now)), None)
            }
            Some(Attachment::Lease(l)) if plan.allowed => {
                let record = self.lease_record(l, buckets, &plan, op, now);
                // Held by no cap (every one was shadow and full): no record.
                (None, (!record.sets.is_empty()).then_some(record))
            }
            _ => (None, None),
        };
        // A record takes room of its own tenant's, never a bucket's.
        let tenant = match attach {
            Some(Attachment::Reservation(r)) if record.is_some() => Some(r.id.tenant()),
            Some(Attachment::Lease(l)) if lease.is_some() => Some(l.id.tenant()),
            _ => None,
        };
        if let Some(tenant) = tenant {
            self.records.take(tenant).map_err(|full| {
                crate::telemetry::metrics::store_error("memory", "too_many_records");
                Refused::Records(full)
            })?;
        }
        let give_back = |refused: Refused| {
            if let Some(tenant) = tenant {
                self.records.give_back(tenant, 1);
            }
            refused
        };
        // Far from the caps (the usual case) this is two loads and a sum.
        let over = |store: &Self, count: usize, bytes: usize| {
            store.held.load(Ordering::Relaxed).saturating_add(count) > store.max_buckets
                || store
                    .held_bytes
                    .load(Ordering::Relaxed)
                    .saturating_add(bytes)
                    > store.max_bytes
        };
        let written = || {
            buckets
                .iter()
                .zip(&plan.writes)
                .filter(|(_, w)| w.is_some())
        };
        let (writes, write_bytes) = written().fold((0, 0), |(n, bytes), (b, _)| {
            (n + 1, bytes + bucket_bytes(b))
        });
        if writes > 0 && over(self, writes, write_bytes) {
            let new = |store: &Self| {
                written()
                    .filter(|(b, _)| {
                        !store.buckets.contains_key(*b) && !store.lease_sets.contains_key(*b)
                    })
                    .fold((0, 0), |(n, bytes), (b, _)| {
                        (n + 1, bytes + bucket_bytes(b))
                    })
            };
            let (count, bytes) = new(self);
            if count > 0 && over(self, count, bytes) {
                self.sweep_at_cap(now);
                let (count, bytes) = new(self);
                if over(self, count, bytes) {
                    self.refused.fetch_add(1, Ordering::Relaxed);
                    return Err(give_back(Refused::Buckets(AtCapacity {
                        max: self.max_buckets,
                        max_bytes: self.max_bytes,
                    })));
                }
            }
        }
        for (((bucket, write), charge), old) in
            buckets.iter().zip(&plan.writes).zip(charges).zip(&states)
        {
            let Some(state) = write else { continue };
            if let Some(journal) = &self.journal {
                journal.note(bucket, charge, old.as_ref(), state);
            }
            if charge.limit.is_concurrency() {
                if let (Some(held), Op::Acquire { ttl }) = (&lease, op) {
                    self.add_lease(bucket, held.nonce, now.saturating_add(ttl));
                }
                continue;
            }
            match self.buckets.get_mut(bucket) {
                Some(mut entry) => *entry = *state,
                None => {
                    // Counted before it is visible: a sweep running beside
                    // this may remove the new bucket at once (when it is
                    // already full again) and subtract it, and must never
                    // subtract what was not yet added.
                    let bytes = bucket_bytes(bucket);
                    self.held.fetch_add(1, Ordering::Relaxed);
                    self.held_bytes.fetch_add(bytes, Ordering::Relaxed);
                    if self.buckets.insert(bucket.clone(), *state).is_some() {
                        self.held.fetch_sub(1, Ordering::Relaxed);
                        self.held_bytes.fetch_sub(bytes, Ordering::Relaxed);
                    }
                }
            }
        }
        // A record already held under the same name (a retried id) keeps
        // one place.
        if let (Some(held), Some(Attachment::Reservation(r))) = (record, attach)
            && self.reservations.insert(r.id.record_name(), held).is_some()
        {
            self.records.give_back(r.id.tenant(), 1);
        }
        if let (Some(held), Some(Attachment::Lease(l))) = (lease, attach)
            && self.leases.insert(l.id.record_name(), held).is_some()
        {
            self.records.give_back(l.id.tenant(), 1);
        }
        drop(guards);
        Ok(plan)
    }

    /// The record of a reservation whose decision `plan` admitted: the
    /// charges it spent.
    fn record(
        &self,
        r: &Reservation,
        buckets: &[BucketKey],
        charges: &[Charge],
        plan: &Plan,
        now: Micros,
    ) -> Held {
        let spent = |i: &usize| plan.verdicts[*i].allowed;
        let at: Vec<usize> = (0..charges.len()).filter(spent).collect();
        Held {
            record: Record {
                reserved_at: now,
                expires_at: now.saturating_add(r.ttl.min(reservation::MAX_TTL)),
                estimate: r.estimate,
                charges: at.iter().map(|&i| charges[i]).collect(),
                lines: at.iter().map(|&i| r.lines[i]).collect(),
                settled: None,
            },
            buckets: at.iter().map(|&i| buckets[i].clone()).collect(),
            expiry_counted: false,
        }
    }

    /// Synchronous form of [`Store::settle`].
    pub fn settle_now(&self, id: &ReservationId, actual: u64) -> Settled {
        let name = id.record_name();
        let unknown = Settled {
            status: SettleStatus::Unknown,
            estimate: 0,
            verdicts: Vec::new(),
        };
        let Some(buckets) = self.reservations.get(&name).map(|h| h.buckets.clone()) else {
            return unknown;
        };
        let now = self.clock.now();
        let guards = self.lock(&buckets, Some(&name));
        // Read again under the locks: a settle of the same reservation
        // beside this one holds the record's stripe.
        let Some(held) = self.reservations.get(&name).map(|h| h.record.clone()) else {
            return unknown;
        };
        let status = match held.settled {
            Some(actual) => SettleStatus::AlreadySettled { actual },
            None if held.expires_at <= now => SettleStatus::Expired,
            None => SettleStatus::Settled,
        };
        if status != SettleStatus::Settled {
            return Settled {
                status,
                estimate: held.estimate,
                verdicts: Vec::new(),
            };
        }
        let states: Vec<Option<State>> = buckets.iter().map(|b| self.state(b)).collect();
        let (verdicts, writes) = reservation::settle_plan(&held, &states, actual, now);
        for (((bucket, write), charge), old) in
            buckets.iter().zip(writes).zip(&held.charges).zip(&states)
        {
            let Some(state) = write else { continue };
            if let Some(journal) = &self.journal {
                journal.note(bucket, charge, old.as_ref(), &state);
            }
            match self.buckets.get_mut(bucket) {
                Some(mut entry) => *entry = state,
                // Swept meanwhile (it was full again) and still full: no
                // need to hold it. Otherwise held over the caps rather than
                // lose the charge: it was counted when reserved.
                None if state.is_idle(now) => {}
                None => {
                    self.held.fetch_add(1, Ordering::Relaxed);
                    self.held_bytes
                        .fetch_add(bucket_bytes(bucket), Ordering::Relaxed);
                    if self.buckets.insert(bucket.clone(), state).is_some() {
                        self.held.fetch_sub(1, Ordering::Relaxed);
                        self.held_bytes
                            .fetch_sub(bucket_bytes(bucket), Ordering::Relaxed);
                    }
                }
            }
        }
        if let Some(mut entry) = self.reservations.get_mut(&name) {
            entry.record.settled = Some(actual);
        }
        drop(guards);
        Settled {
            status,
            estimate: held.estimate,
            verdicts,
        }
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

fn verdicts(result: Result<Plan, Refused>) -> Result<Verdicts, StoreError> {
    result
        .map(|plan| Verdicts {
            allowed: plan.allowed,
            verdicts: plan.verdicts,
        })
        .map_err(StoreError::from)
}

impl MemoryStore {
    /// The figures a status reports.
    pub fn figures(&self) -> super::MemoryFigures {
        let (idle, refused) = self.evictions();
        super::MemoryFigures {
            buckets: self.len(),
            max_buckets: self.max_buckets(),
            bytes: self.bytes(),
            max_bytes: self.max_bytes(),
            evicted_idle: idle,
            refused_at_capacity: refused,
        }
    }

    /// [`Store::share`] at once.
    pub fn share_now(&self, ask: &super::ShareAsk<'_>) -> Result<super::Share, StoreError> {
        self.shares.share(ask, self.clock.now())
    }

    /// Drops expired share table members (the server's sweep calls it).
    pub fn sweep_shares(&self) {
        self.shares.sweep(self.clock.now());
    }

    /// [`Store::apply`] at once.
    fn apply_request(&self, r: Request<'_>) -> Result<Verdicts, StoreError> {
        verdicts(match r.attachment {
            None => MemoryStore::apply_now(self, r.buckets, r.charges, r.op),
            Some(attachment) => self.attach_now(r.buckets, r.charges, attachment),
        })
    }
}

impl Store for MemoryStore {
    fn apply<'a>(&'a self, request: Request<'a>) -> StoreFuture<'a> {
        Box::pin(std::future::ready(self.apply_request(request)))
    }

    fn apply_now(&self, request: Request<'_>) -> Option<Result<Verdicts, StoreError>> {
        Some(self.apply_request(request))
    }

    fn settle<'a>(&'a self, id: &'a ReservationId, actual: u64) -> SettleFuture<'a> {
        Box::pin(std::future::ready(Ok(self.settle_now(id, actual))))
    }

    fn lease<'a>(&'a self, id: &'a LeaseId, op: LeaseOp) -> LeaseFuture<'a> {
        Box::pin(std::future::ready(Ok(self.lease_now(id, op))))
    }

    fn share<'a>(&'a self, ask: super::ShareAsk<'a>) -> super::ShareFuture<'a> {
        Box::pin(std::future::ready(self.share_now(&ask)))
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
            nodes: Vec::new(),
            local: Some(self.figures()),
            answered: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{Limit, Rate};
    use crate::clock::ManualClock;
    use crate::store::BucketKind;
    use crate::store::Lease;
    use std::time::Duration;

    const T0: Micros = 1_700_000_000_000_000;

    fn charge(burst: u64, rate: &str, cost: u64) -> Charge {
        Charge::new(
            Limit::new(burst, rate.parse::<Rate>().unwrap()).unwrap(),
            cost,
        )
    }

    fn key(k: &str) -> BucketKey {
        BucketKey::new("t", BucketKind::KEY, "", k)
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
                    store.apply_now(&b, &c, Op::SPEND).unwrap().allowed
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
                        let mut b = vec![
                            BucketKey::new("t", BucketKind::TENANT, "", ""),
                            key(&format!("k{t}")),
                        ];
                        let mut c = vec![charge(200, "1/day", 1), charge(1000, "1/day", 1)];
                        if i % 2 == 0 {
                            b.reverse();
                            c.reverse();
                        }
                        admitted +=
                            usize::from(store.apply_now(&b, &c, Op::SPEND).unwrap().allowed);
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
            .apply_now(&[key("a")], &[charge(10, "10/second", 5)], Op::SPEND)
            .unwrap(); // full in 500 ms
        store
            .apply_now(&[key("b")], &[charge(10, "10/second", 1)], Op::SPEND)
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
            assert!(store.apply_now(&victim, &c, Op::SPEND).unwrap().allowed);
        }
        let (mut peak, mut refused) = (0, 0);
        for i in 0..1_000_000u32 {
            clock.advance(Duration::from_micros(1));
            match store.apply_now(&[key(&i.to_string())], &c, Op::SPEND) {
                Ok(plan) => assert!(plan.allowed),
                Err(full) => {
                    assert_eq!(
                        full,
                        Refused::Buckets(AtCapacity {
                            max: 10_000,
                            max_bytes: usize::MAX
                        })
                    );
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
        assert!(!store.apply_now(&victim, &c, Op::SPEND).unwrap().allowed);
    }

    /// Concurrent inserts and sweeps count every bucket exactly once: each
    /// one inserted is, by the end, either held or counted as evicted, and
    /// the held figure matches the map.
    #[test]
    fn eviction_and_held_counts_stay_exact_under_concurrent_inserts_and_sweeps() {
        let clock = Arc::new(ManualClock::new(T0));
        let store = Arc::new(MemoryStore::new(clock.clone(), 1_000_000));
        let c = [charge(5, "1000/second", 1)];
        let inserters: Vec<_> = (0..4)
            .map(|t| {
                let store = store.clone();
                std::thread::spawn(move || {
                    for i in 0..20_000u32 {
                        store
                            .apply_now(&[key(&format!("{t}-{i}"))], &c, Op::SPEND)
                            .unwrap();
                    }
                })
            })
            .collect();
        let sweeper = {
            let (store, clock) = (store.clone(), clock.clone());
            std::thread::spawn(move || {
                for _ in 0..200 {
                    clock.advance(Duration::from_millis(1));
                    store.sweep_idle();
                }
            })
        };
        for t in inserters {
            t.join().unwrap();
        }
        sweeper.join().unwrap();
        let (evicted, refused) = store.evictions();
        assert_eq!(refused, 0);
        assert_eq!(store.held.load(Ordering::Relaxed), store.len());
        assert_eq!(evicted as usize + store.len(), 80_000);
        clock.advance(Duration::from_secs(1));
        store.sweep_idle();
        assert_eq!(store.evictions().0, 80_000);
        assert_eq!((store.len(), store.bytes()), (0, 0));
    }

    /// The flood of the issue that found this: a bystander's exhausted key
    /// refills fast, the flood's keys slowly, so the old policy (drop those
    /// closest to full) dropped the bystander and gave its tokens back.
    #[test]
    fn a_flood_of_new_keys_never_refills_a_bystanders_exhausted_key() {
        let clock = Arc::new(ManualClock::new(T0));
        let store = MemoryStore::new(clock.clone(), 1_000);
        let bystander = [BucketKey::new("calm", BucketKind::KEY, "", "user")];
        let fast = [charge(10, "10/second", 1)];
        for _ in 0..10 {
            assert!(
                store
                    .apply_now(&bystander, &fast, Op::SPEND)
                    .unwrap()
                    .allowed
            );
        }
        let slow = [charge(10, "1/hour", 1)];
        for i in 0..1_200u32 {
            let _ = store.apply_now(
                &[BucketKey::new("flood", BucketKind::KEY, "", &i.to_string())],
                &slow,
                Op::SPEND,
            );
        }
        for _ in 0..10 {
            assert!(
                !store
                    .apply_now(&bystander, &fast, Op::SPEND)
                    .unwrap()
                    .allowed,
                "the bystander's key stays exhausted"
            );
        }
        // Once its bucket is full again it may go, and new keys get room.
        clock.advance(Duration::from_secs(1));
        assert_eq!(
            store
                .apply_now(&bystander, &fast, Op::SPEND)
                .unwrap()
                .verdicts[0]
                .remaining,
            9
        );
        clock.advance(Duration::from_secs(2));
        assert!(
            store
                .apply_now(
                    &[BucketKey::new("new", BucketKind::KEY, "", "x")],
                    &slow,
                    Op::SPEND
                )
                .is_ok()
        );
        assert!(store.state(&bystander[0]).is_none(), "swept once full");
    }

    /// Long keys reach the byte cap long before the bucket cap: the bytes
    /// counted never pass it, a key already held still decides, and the
    /// refusal names both caps.
    #[test]
    fn long_keys_stop_at_the_byte_cap() {
        let clock = Arc::new(ManualClock::new(T0));
        let store = MemoryStore::new(clock.clone(), 1_000_000).with_max_bytes(100_000);
        let slow = [charge(10, "1/hour", 1)];
        let long = |i: u32| {
            BucketKey::new(
                "t",
                BucketKind::KEY,
                "",
                &format!("{i:04}{}", "x".repeat(996)),
            )
        };
        let per_bucket = BUCKET_OVERHEAD_BYTES + long(0).as_str().len();
        let mut admitted = 0;
        for i in 0..200 {
            if store.apply_now(&[long(i)], &slow, Op::SPEND).is_ok() {
                admitted += 1;
            }
            assert!(store.bytes() <= 100_000);
        }
        assert_eq!(admitted, 100_000 / per_bucket);
        assert_eq!(store.bytes(), admitted * per_bucket);
        let refused = store.apply_now(&[long(500)], &slow, Op::SPEND).unwrap_err();
        assert_eq!(
            refused,
            Refused::Buckets(AtCapacity {
                max: 1_000_000,
                max_bytes: 100_000
            })
        );
        assert!(refused.to_string().contains("--max-bucket-bytes"));
        // A held key still decides: no new bytes.
        assert!(
            store
                .apply_now(&[long(0)], &slow, Op::SPEND)
                .unwrap()
                .allowed
        );
        // Once full again, buckets are swept and their bytes come back.
        clock.advance(Duration::from_secs(2 * 3600));
        assert_eq!(store.sweep_idle(), admitted);
        assert_eq!(store.bytes(), 0);
    }

    #[test]
    fn caps_are_at_least_sixteen_buckets() {
        let clock = Arc::new(ManualClock::new(T0));
        let small = MemoryStore::new(clock.clone(), 10).with_max_bytes(1);
        assert_eq!(small.max_buckets(), 16);
        assert_eq!(small.max_bytes(), 16 * BUCKET_OVERHEAD_BYTES);
        let large = MemoryStore::new(clock, 5_000).with_max_bytes(1 << 20);
        assert_eq!((large.max_buckets(), large.max_bytes()), (5_000, 1 << 20));
    }

    fn reservation(tenant: &str, estimate: u64, ttl: Micros) -> Attachment {
        Attachment::Reservation(Reservation {
            id: ReservationId::new(tenant),
            estimate,
            lines: vec![1],
            ttl,
        })
    }

    #[test]
    fn a_refused_decision_records_nothing_and_takes_no_room() {
        let clock = Arc::new(ManualClock::new(T0));
        let store = MemoryStore::new(clock, 1000).with_max_records(100, Some(1));
        let (b, c) = ([key("k")], [charge(3, "1/day", 2)]);
        let first = reservation("t", 2, 60_000_000);
        assert!(store.attach_now(&b, &c, &first).unwrap().allowed);
        // The bucket has 1 left: refused, and no record is written.
        let refused = reservation("t", 2, 60_000_000);
        assert!(!store.attach_now(&b, &c, &refused).unwrap().allowed);
        assert_eq!(store.reservations(), 1);
        let Attachment::Reservation(r) = &refused else {
            unreachable!()
        };
        assert_eq!(store.settle_now(&r.id, 0).status, SettleStatus::Unknown);
        // The tenant's one record is taken: a third, admissible, is refused
        // for that, and nothing is charged.
        let other = [key("other")];
        let third = reservation("t", 1, 60_000_000);
        assert!(matches!(
            store.attach_now(&other, &c, &third),
            Err(Refused::Records(_))
        ));
        assert!(store.state(&key("other")).is_none());
        // Settling the first frees its room.
        let Attachment::Reservation(r) = &first else {
            unreachable!()
        };
        assert_eq!(store.settle_now(&r.id, 2).status, SettleStatus::Settled);
    }

    #[test]
    fn leases_take_a_record_each_and_a_refused_acquire_none() {
        let clock = Arc::new(ManualClock::new(T0));
        let store = MemoryStore::new(clock, 1000).with_max_records(100, Some(2));
        let cap = [Charge::new(Limit::concurrency(1).unwrap(), 1)];
        let lease = |_: &str| {
            Attachment::Lease(Lease {
                id: LeaseId::new("t"),
                ttl: 60_000_000,
            })
        };
        assert!(
            store
                .attach_now(&[key("a")], &cap, &lease("a"))
                .unwrap()
                .allowed
        );
        // Full cap: refused, taking no record.
        assert!(
            !store
                .attach_now(&[key("a")], &cap, &lease("a"))
                .unwrap()
                .allowed
        );
        assert!(
            store
                .attach_now(&[key("b")], &cap, &lease("b"))
                .unwrap()
                .allowed
        );
        // Two records held: a third lease is refused for that.
        assert!(matches!(
            store.attach_now(&[key("c")], &cap, &lease("c")),
            Err(Refused::Records(_))
        ));
    }

    #[test]
    fn sweeping_gives_back_only_the_records_it_drops() {
        let clock = Arc::new(ManualClock::new(T0));
        let store = MemoryStore::new(clock.clone(), 1000).with_max_records(100, Some(2));
        let c = [charge(100, "1/day", 1)];
        for k in ["a", "b"] {
            let r = reservation("t", 1, 1_000_000);
            assert!(store.attach_now(&[key(k)], &c, &r).unwrap().allowed);
        }
        // Live records swept: both stay, and still count.
        store.sweep_idle();
        let third = reservation("t", 1, 1_000_000);
        assert!(matches!(
            store.attach_now(&[key("c")], &c, &third),
            Err(Refused::Records(_))
        ));
        // Expired and past their grace: dropped, and their room is free.
        clock.advance(Duration::from_micros(1_000_000 + EXPIRED_GRACE));
        store.sweep_idle();
        assert_eq!(store.reservations(), 0);
        assert!(store.attach_now(&[key("c")], &c, &third).unwrap().allowed);
    }

    #[test]
    fn a_charge_of_nothing_stores_no_bucket() {
        let clock = Arc::new(ManualClock::new(T0));
        let store = MemoryStore::new(clock, 1000);
        let c = [charge(10, "1/second", 0)];
        for op in [Op::SPEND, Op::Charge] {
            assert!(store.apply_now(&[key("new")], &c, op).unwrap().allowed);
        }
        assert_eq!(store.len(), 0, "a full bucket is the same as none");
        assert_eq!(store.bytes(), 0);
    }

    #[test]
    fn the_bucket_cap_admits_exactly_its_count_of_refilling_buckets() {
        let clock = Arc::new(ManualClock::new(T0));
        let store = MemoryStore::new(clock, 16);
        let c = [charge(10, "1/day", 1)];
        for i in 0..16 {
            let k = key(&format!("k{i}"));
            assert!(store.apply_now(&[k], &c, Op::SPEND).is_ok(), "bucket {i}");
        }
        assert_eq!(store.len(), 16);
        assert!(matches!(
            store.apply_now(&[key("k16")], &c, Op::SPEND),
            Err(Refused::Buckets(_))
        ));
    }

    #[test]
    fn the_byte_cap_admits_exactly_the_buckets_it_counts() {
        let clock = Arc::new(ManualClock::new(T0));
        let each = bucket_bytes(&key("k00"));
        let store = MemoryStore::new(clock, 1000).with_max_bytes(20 * each);
        let c = [charge(10, "1/day", 1)];
        for i in 0..20 {
            let k = key(&format!("k{i:02}"));
            assert!(store.apply_now(&[k], &c, Op::SPEND).is_ok(), "bucket {i}");
        }
        assert_eq!(store.bytes(), 20 * each);
        assert!(matches!(
            store.apply_now(&[key("k20")], &c, Op::SPEND),
            Err(Refused::Buckets(_))
        ));
    }

    #[test]
    fn two_threads_draining_one_bucket_admit_exactly_its_burst() {
        // Many decisions from two threads at once on one bucket: each
        // decision reads and writes the bucket under its stripe's lock, so
        // no update is lost.
        const BURST: u64 = 200_000;
        let store = Arc::new(MemoryStore::new(Arc::new(ManualClock::new(T0)), 1000));
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let store = store.clone();
                std::thread::spawn(move || {
                    let c = [charge(BURST, "10/second", 1)];
                    let b = [key("hot")];
                    let mut admitted = 0u64;
                    while store.apply_now(&b, &c, Op::SPEND).unwrap().allowed {
                        admitted += 1;
                    }
                    admitted
                })
            })
            .collect();
        let admitted: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(admitted, BURST);
    }

    /// A store of 16 buckets holding `n` that refill over a day.
    fn with_slow_buckets(clock: &Arc<ManualClock>, n: usize) -> MemoryStore {
        let store = MemoryStore::new(clock.clone(), 16);
        for i in 0..n {
            let k = key(&format!("slow{i}"));
            assert!(
                store
                    .apply_now(&[k], &[charge(10, "1/day", 1)], Op::SPEND)
                    .unwrap()
                    .allowed
            );
        }
        store
    }

    #[test]
    fn below_its_cap_the_store_keeps_its_idle_buckets() {
        let clock = Arc::new(ManualClock::new(T0));
        let store = with_slow_buckets(&clock, 14);
        // Full again 10 ms from now.
        let fast = [charge(100, "100/second", 1)];
        store.apply_now(&[key("fast")], &fast, Op::SPEND).unwrap();
        clock.advance(Duration::from_millis(20));
        // One existing bucket and one new: 16 held, at the cap, not over.
        let b = [key("slow0"), key("new")];
        let c = [charge(10, "1/day", 1), charge(10, "1/day", 1)];
        assert!(store.apply_now(&b, &c, Op::SPEND).unwrap().allowed);
        assert_eq!(
            store.len(),
            16,
            "the idle bucket is not swept below the cap"
        );
        assert_eq!(store.evictions(), (0, 0));
    }

    #[test]
    fn at_its_cap_the_store_sweeps_idle_buckets_once_per_period() {
        let clock = Arc::new(ManualClock::new(T0));
        let store = with_slow_buckets(&clock, 15);
        // Full again at T0 + 10 ms.
        let fast = [charge(100, "100/second", 1)];
        store.apply_now(&[key("fast")], &fast, Op::SPEND).unwrap();
        let slow = [charge(10, "1/day", 1)];
        // At T0 + 5 ms: a sweep finds nothing idle, and the new bucket is
        // refused.
        clock.advance(Duration::from_millis(5));
        assert!(matches!(
            store.apply_now(&[key("n1")], &slow, Op::SPEND),
            Err(Refused::Buckets(_))
        ));
        // One sweep period later exactly, the next sweep drops the idle one.
        clock.advance(Duration::from_micros(SWEEP_AT_CAP_EVERY));
        assert!(
            store
                .apply_now(&[key("n2")], &slow, Op::SPEND)
                .unwrap()
                .allowed
        );
        assert!(store.state(&key("fast")).is_none());
    }

    #[test]
    fn a_settle_on_a_swept_bucket_keeps_its_charge_and_leaves_a_full_one_out() {
        let clock = Arc::new(ManualClock::new(T0));
        let store = MemoryStore::new(clock.clone(), 1000);
        let c = [charge(10, "1/second", 4)];
        let (x, y) = (
            reservation("t", 4, 60_000_000),
            reservation("t", 4, 60_000_000),
        );
        assert!(store.attach_now(&[key("x")], &c, &x).unwrap().allowed);
        assert!(store.attach_now(&[key("y")], &c, &y).unwrap().allowed);
        // Full again after 4 s, and swept.
        clock.advance(Duration::from_secs(4));
        assert_eq!(store.sweep_idle(), 2);
        let id = |a: &Attachment| match a {
            Attachment::Reservation(r) => r.id.clone(),
            Attachment::Lease(_) => unreachable!(),
        };
        // 6 over the estimate: charged to the full bucket, which is held
        // again with 4 tokens.
        assert_eq!(store.settle_now(&id(&x), 10).status, SettleStatus::Settled);
        let spend = |n| charge(10, "1/second", n);
        assert!(
            !store
                .apply_now(&[key("x")], &[spend(5)], Op::DRY)
                .unwrap()
                .allowed
        );
        assert!(
            store
                .apply_now(&[key("x")], &[spend(4)], Op::DRY)
                .unwrap()
                .allowed
        );
        // A refund to a full bucket: nothing to hold.
        assert_eq!(store.settle_now(&id(&y), 0).status, SettleStatus::Settled);
        assert_eq!(store.len(), 1);
        assert!(store.state(&key("y")).is_none());
    }

    #[test]
    fn a_decision_adding_no_bucket_passes_while_settles_hold_the_store_over_its_cap() {
        let clock = Arc::new(ManualClock::new(T0));
        let store = with_slow_buckets(&clock, 15);
        let c = [charge(10, "1/second", 4)];
        let x = reservation("t", 4, 60_000_000);
        assert!(store.attach_now(&[key("x")], &c, &x).unwrap().allowed);
        assert_eq!(store.len(), 16);
        // x is full again and swept; another bucket takes its room.
        clock.advance(Duration::from_secs(4));
        store.sweep_idle();
        let slow = [charge(10, "1/day", 1)];
        assert!(
            store
                .apply_now(&[key("y")], &slow, Op::SPEND)
                .unwrap()
                .allowed
        );
        // The settle's charge is held over the cap rather than lost.
        let Attachment::Reservation(r) = &x else {
            unreachable!()
        };
        assert_eq!(store.settle_now(&r.id, 10).status, SettleStatus::Settled);
        assert_eq!(store.len(), 17);
        // Decisions on buckets already held still pass; a new one does not.
        assert!(
            store
                .apply_now(&[key("y")], &slow, Op::SPEND)
                .unwrap()
                .allowed
        );
        assert!(
            store
                .apply_now(&[key("slow3")], &slow, Op::SPEND)
                .unwrap()
                .allowed
        );
        assert!(matches!(
            store.apply_now(&[key("z")], &slow, Op::SPEND),
            Err(Refused::Buckets(_))
        ));
    }

    #[test]
    fn the_store_names_its_kind() {
        let store = MemoryStore::new(Arc::new(ManualClock::new(T0)), 16);
        assert_eq!(Store::kind(&store), "memory");
        assert_eq!(Store::status(&store).kind, "memory");
    }

    /// The process-wide count of leases that expired unreleased.
    fn leases_expired_so_far() -> u64 {
        crate::telemetry::metrics::handle()
            .render()
            .lines()
            .find_map(|l| l.strip_prefix("tollgate_leases_expired_total "))
            .map_or(0, |v| v.trim().parse().unwrap())
    }

    #[test]
    fn an_unreleased_lease_is_counted_once_at_its_expiry_and_its_room_returned_after_its_grace() {
        let clock = Arc::new(ManualClock::new(T0));
        let store = MemoryStore::new(clock.clone(), 16).with_max_records(100, Some(2));
        let cap = [Charge::new(Limit::concurrency(2).unwrap(), 1)];
        let lease = || Lease {
            id: LeaseId::new("t"),
            ttl: 1_000_000,
        };
        let (kept, released) = (lease(), lease());
        for l in [&kept, &released] {
            let attached = Attachment::Lease(l.clone());
            assert!(
                store
                    .attach_now(&[key("a")], &cap, &attached)
                    .unwrap()
                    .allowed
            );
        }
        assert_eq!(
            store.lease_now(&released.id, LeaseOp::Release).status,
            crate::store::LeaseStatus::Done
        );
        let set_bytes = store.bytes();
        assert!(set_bytes > 0, "the cap's set is held");
        let before = leases_expired_so_far();
        // A microsecond before its expiry: held, not counted.
        clock.advance(Duration::from_micros(999_999));
        store.sweep_idle();
        assert_eq!(leases_expired_so_far(), before);
        assert_eq!(store.bytes(), set_bytes);
        // At it: counted once (the released one not), and the empty set
        // is dropped with its bytes.
        clock.advance(Duration::from_micros(1));
        store.sweep_idle();
        assert_eq!(leases_expired_so_far(), before + 1);
        assert_eq!(store.bytes(), 0);
        store.sweep_idle();
        assert_eq!(leases_expired_so_far(), before + 1);
        // Both records stay for the grace period and take the tenant's
        // room; then they go, and the room comes back.
        let third = Attachment::Lease(lease());
        assert!(matches!(
            store.attach_now(&[key("b")], &cap, &third),
            Err(Refused::Records(_))
        ));
        clock.advance(Duration::from_micros(EXPIRED_GRACE));
        store.sweep_idle();
        assert!(store.attach_now(&[key("b")], &cap, &third).unwrap().allowed);
        assert_eq!(leases_expired_so_far(), before + 1);
    }

    #[test]
    fn expired_lease_sets_give_their_room_back() {
        let clock = Arc::new(ManualClock::new(T0));
        let store = MemoryStore::new(clock.clone(), 16);
        let cap = [Charge::new(Limit::concurrency(1).unwrap(), 1)];
        for i in 0..16 {
            let lease = Attachment::Lease(Lease {
                id: LeaseId::new("t"),
                ttl: 1_000_000,
            });
            let b = [key(&format!("cap{i}"))];
            assert!(store.attach_now(&b, &cap, &lease).unwrap().allowed);
        }
        let slow = [charge(10, "1/day", 1)];
        assert!(matches!(
            store.apply_now(&[key("new")], &slow, Op::SPEND),
            Err(Refused::Buckets(_))
        ));
        clock.advance(Duration::from_secs(1));
        store.sweep_idle();
        for i in 0..16 {
            let b = [key(&format!("new{i}"))];
            assert!(store.apply_now(&b, &slow, Op::SPEND).is_ok(), "bucket {i}");
        }
    }

    /// The process-wide count of reservations that expired unsettled.
    fn expired_so_far() -> u64 {
        crate::telemetry::metrics::handle()
            .render()
            .lines()
            .find_map(|l| l.strip_prefix("tollgate_reservations_expired_total "))
            .map_or(0, |v| v.trim().parse().unwrap())
    }

    #[test]
    fn an_unsettled_reservation_is_counted_once_at_its_expiry_and_dropped_after_its_grace() {
        let clock = Arc::new(ManualClock::new(T0));
        let store = MemoryStore::new(clock.clone(), 1000);
        assert!(store.is_empty());
        let (b, c) = ([key("k")], [charge(100, "1/day", 5)]);
        let reserve = || Reservation {
            id: ReservationId::new("t"),
            estimate: 5,
            lines: vec![1],
            ttl: 1_000_000,
        };
        // One left unsettled, two settled: only the first is counted.
        let (abandoned, settled) = (reserve(), [reserve(), reserve()]);
        for r in settled.iter().chain([&abandoned]) {
            let attached = Attachment::Reservation(r.clone());
            assert!(store.attach_now(&b, &c, &attached).unwrap().allowed);
        }
        assert!(!store.is_empty());
        assert_eq!(store.reservations(), 3);
        for r in &settled {
            assert_eq!(store.settle_now(&r.id, 5).status, SettleStatus::Settled);
        }
        let before = expired_so_far();
        // A microsecond before its expiry: held.
        clock.advance(Duration::from_micros(999_999));
        store.sweep_idle();
        assert_eq!(expired_so_far(), before);
        // At it: counted, the settled one not; and only once.
        clock.advance(Duration::from_micros(1));
        store.sweep_idle();
        assert_eq!(expired_so_far(), before + 1);
        store.sweep_idle();
        assert_eq!(expired_so_far(), before + 1);
        // The records stay for the grace period (a late settle is told it
        // expired), then go.
        assert_eq!(store.reservations(), 3);
        assert_eq!(
            store.settle_now(&abandoned.id, 5).status,
            SettleStatus::Expired
        );
        clock.advance(Duration::from_micros(EXPIRED_GRACE));
        store.sweep_idle();
        assert_eq!(store.reservations(), 0);
        assert_eq!(expired_so_far(), before + 1);
    }
}

/// What a bucket really takes stays under what the byte cap counts for it
/// (`BUCKET_OVERHEAD_BYTES` plus the key), measured on the resident set of
/// the test's own process (nextest runs each test in a process of its own),
/// for short and for long keys. The figures print with `--nocapture`.
#[cfg(test)]
fn measure_buckets(n: u32, pad: usize) {
    use crate::algorithm::{Limit, Rate};
    use crate::clock::ManualClock;
    let rss = || {
        std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .find_map(|l| {
                l.strip_prefix("VmRSS:")
                    .map(|v| v.trim().trim_end_matches(" kB").parse::<usize>().unwrap())
            })
            .unwrap()
            * 1024
    };
    let charge = [crate::algorithm::Charge::new(
        Limit::new(30, "600/minute".parse::<Rate>().unwrap()).unwrap(),
        1,
    )];
    let store = MemoryStore::new(Arc::new(ManualClock::new(1_700_000_000_000_000)), 2_000_000);
    let padding = "x".repeat(pad);
    let before = rss();
    for i in 0..n {
        let key = BucketKey::new(
            "acme",
            crate::store::BucketKind::KEY,
            "",
            &format!("user-{i:07}{padding}"),
        );
        store.apply_now(&[key], &charge, Op::SPEND).unwrap();
    }
    let taken = rss() - before;
    let key_len = format!("acme:k::user-0000000{padding}").len();
    let counted = store.bytes();
    assert_eq!(counted, n as usize * (BUCKET_OVERHEAD_BYTES + key_len));
    println!(
        "{} buckets, keys of {key_len} bytes: {} bytes each measured, {} counted",
        store.len(),
        taken / store.len(),
        counted / store.len()
    );
    assert!(
        taken <= counted,
        "{n} buckets with {key_len}-byte keys took {taken} bytes, more than the {counted} counted"
    );
}

#[cfg(test)]
#[test]
fn bytes_per_bucket_with_short_keys_stay_under_what_the_cap_counts() {
    measure_buckets(1_000_000, 0);
}

#[cfg(test)]
#[test]
fn bytes_per_bucket_with_long_keys_stay_under_what_the_cap_counts() {
    measure_buckets(200_000, 680);
}
