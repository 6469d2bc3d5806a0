//! Token slices: a hot tenant-wide bucket answered from tokens taken ahead
//! (`--token-slices`, off by default).
//!
//! Every decision on a tenant's ceiling is a script call on the one Redis
//! slot that holds it, so one tenant's traffic is bound to one Redis core.
//! With slices, an instance takes a *slice* of the ceiling's tokens in one
//! decision (spent in the store at once, like any decision), answers its
//! next decisions on that bucket from the slice, and sends only the rest of
//! each decision (the per-key buckets) to the store.
//!
//! Exactness. The store spent the slice's tokens when it was taken, so
//! admissions never exceed what the store granted. One more thing could let
//! through more than the limit: the store's bucket refilling while this
//! instance still holds tokens it took earlier (taken from a full bucket
//! and used after the bucket was full again, they would be a second
//! burst). So the tokens held from one take never exceed the debt that
//! take left in the store, as it runs down: the take answered that the
//! bucket is full again at `full_at` (counted here from the moment the call
//! was sent, so no later than in the store), and at `now` at most
//! `(full_at - now) / interval` of its tokens may still be used. Summed
//! over every take of every instance (each take's debt includes the ones
//! before it), held tokens never exceed the store's debt, so held plus
//! stored never exceed the capacity. Tokens past that bound are dropped,
//! never given back: the store has refilled them already. An instance that
//! dies holding a slice has spent those tokens; the bucket refills as
//! usual.
//!
//! Near a full bucket this makes a slice of `n` tokens run down over `n`
//! refill intervals while the store refills by as much: what a quiet tenant
//! does not use flows back to the store, and its instances take a slice
//! every `n` intervals instead of calling the ceiling's shard per decision.
//!
//! What it costs. Refusals may come early by at most what other instances
//! hold (at most one slice each, `1/32` of the burst); the slice size
//! adapts (doubling while slices are used up or the bucket holds plenty,
//! halving when tokens run out unused while the bucket is short). The
//! reported `remaining` of a sliced bucket is this instance's slice plus
//! the store's balance at the last take; `retry_after` is computed from the
//! store's last answer, which others can only make later, never earlier.
//!
//! Only enforced token-bucket charges on tenant-wide buckets (scope `t`)
//! that spend what they need are sliced, and only in decisions that spend
//! (`ShouldAllow`, the Envoy API); every other operation reaches the store
//! as before.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dashmap::DashMap;
use smallvec::SmallVec;

use super::layer::{Applied, Layer, LayerFuture, Wrapper};
use super::{BucketKey, BucketKind, Request, StoreError, Verdicts};
use crate::algorithm::{Algorithm, Charge, Limit, Micros, Op, Verdict};
use crate::clock::Clock;
use crate::limits::OnStoreUnavailable;

/// A slice is at most this share of the bucket's burst.
const MAX_SHARE: u64 = 32;

/// A slice is taken only when it would stay usable at least this long
/// (the bucket's debt as last seen plus the refill time of a whole slice).
/// Below (a small bucket that refills fast), each decision spends exactly
/// its cost in its own store call, concurrently with the others, which
/// coalesce.
const MIN_HOLD: Micros = 1_000;

/// Tokens of one take, and when the store said the bucket is full again
/// after that take (local clock, counted from when the call was sent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Chunk {
    tokens: u64,
    full_at: Micros,
}

impl Chunk {
    /// The tokens the take's debt still covers at `now`.
    fn usable(&self, now: Micros, interval: Micros) -> u64 {
        self.tokens
            .min(self.full_at.saturating_sub(now) / interval.max(1))
    }
}

/// This instance's view of one sliced bucket.
#[derive(Debug, Default)]
struct State {
    /// The limit the chunks were taken under; a new limit drops them.
    limit: Option<Limit>,
    /// Tokens held, earliest `full_at` first.
    chunks: SmallVec<[Chunk; 2]>,
    /// Tokens to take next time.
    size: u64,
    /// Tokens ran out unused while the bucket was short, since the last
    /// take.
    lost: bool,
    /// When the store said the bucket is full again (local clock, counted
    /// from when the call was sent), as of its last answer; 0 when unknown.
    full_at: Micros,
    /// The latest clock reading made under this state's lock: a reading
    /// before it means the clock stepped back.
    seen_at: Micros,
    /// The last decision on this bucket.
    used_at: Micros,
}

/// Tokens taken from chunks, to give back if the decision is refused.
type Taken = SmallVec<[Chunk; 2]>;

impl State {
    /// Drops what can no longer be used at `now` (read under the lock).
    fn sync(&mut self, limit: &Limit, now: Micros) {
        if self.limit != Some(*limit) || now < self.seen_at {
            // A new limit, or a clock that stepped back: start over.
            *self = State {
                limit: Some(*limit),
                size: self.size.max(1),
                seen_at: now,
                ..State::default()
            };
            return;
        }
        self.seen_at = now;
        let short = self.short(limit, now);
        for chunk in &mut self.chunks {
            let usable = chunk.usable(now, limit.interval());
            if usable < chunk.tokens {
                // Unused tokens flowing back to a bucket that holds plenty
                // cost nobody anything; to a short one they are refusals.
                self.lost |= short;
                chunk.tokens = usable;
            }
        }
        self.chunks.retain(|c| c.tokens > 0);
    }

    /// True when the store's last answer showed the bucket at most half
    /// full.
    fn short(&self, limit: &Limit, now: Micros) -> bool {
        self.debt(now) * 2 >= limit.tolerance()
    }

    fn held(&self) -> u64 {
        self.chunks.iter().map(|c| c.tokens).sum()
    }

    /// Takes `cost` tokens from the chunks, all or nothing.
    fn take(&mut self, cost: u64) -> Option<Taken> {
        if self.held() < cost {
            return None;
        }
        let mut taken = Taken::new();
        let mut left = cost;
        for chunk in &mut self.chunks {
            let n = chunk.tokens.min(left);
            if n > 0 {
                chunk.tokens -= n;
                left -= n;
                taken.push(Chunk {
                    tokens: n,
                    full_at: chunk.full_at,
                });
            }
        }
        self.chunks.retain(|c| c.tokens > 0);
        Some(taken)
    }

    /// Puts back tokens taken under `limit` by a decision that was
    /// refused (unless the slice started over meanwhile), as far as their
    /// take's debt still covers them.
    fn give_back(&mut self, taken: &Taken, limit: &Limit, now: Micros) {
        if self.limit != Some(*limit) || now < self.seen_at {
            return;
        }
        for back in taken.iter() {
            match self.chunks.iter_mut().find(|c| c.full_at == back.full_at) {
                Some(chunk) => chunk.tokens += back.tokens,
                None => self.add(*back),
            }
        }
        self.sync(limit, now);
    }

    /// Holds the tokens of `chunk` (dropped at the next [`Self::sync`] as
    /// far as its debt no longer covers them).
    fn add(&mut self, chunk: Chunk) {
        if chunk.tokens > 0 {
            let at = self.chunks.partition_point(|c| c.full_at < chunk.full_at);
            self.chunks.insert(at, chunk);
        }
    }

    /// The store's debt at `now`, as of its last answer (at least that:
    /// other instances only add to it).
    fn debt(&self, now: Micros) -> Micros {
        self.full_at.saturating_sub(now)
    }

    /// When the last answer proves `cost` cannot be admitted yet: the wait
    /// until it could be.
    fn certain_wait(&self, limit: &Limit, cost: u64, now: Micros) -> Option<Micros> {
        if self.full_at == 0 {
            return None;
        }
        let needed = self.debt(now) + cost * limit.interval();
        let wait = needed.saturating_sub(limit.tolerance());
        (wait > 0).then_some(wait)
    }

    /// The verdict of a bucket answered here.
    fn verdict(&self, limit: &Limit, allowed: bool, retry_after: Micros, now: Micros) -> Verdict {
        let debt = self.debt(now).min(limit.tolerance());
        let store_balance = (limit.tolerance() - debt) / limit.interval();
        Verdict {
            allowed,
            remaining: (store_balance + self.held()).min(limit.burst()),
            debt: 0,
            forgiven: 0,
            retry_after,
            reset_after: self.debt(now),
        }
    }

    /// True when a slice for decisions of `cost` taken now would stay
    /// usable for a while: at least [`MIN_HOLD`], counting the bucket's
    /// debt (as last seen) and the refill time of the largest slice.
    fn worth_a_slice(&self, limit: &Limit, cost: u64, now: Micros) -> bool {
        self.full_at != 0 && self.debt(now) + Self::cap(limit, cost) * limit.interval() >= MIN_HOLD
    }

    /// The most tokens one slice of `limit` holds (at least `cost`).
    fn cap(limit: &Limit, cost: u64) -> u64 {
        (limit.burst() / MAX_SHARE).max(cost)
    }

    /// The tokens this instance waits for before it takes a new slice of
    /// a bucket the store's last answer shows short: the slice it would
    /// take, so that a hot bucket is taken from in slices, not a token at
    /// a time.
    fn wanted(&self, limit: &Limit, cost: u64) -> u64 {
        self.size.clamp(cost, Self::cap(limit, cost))
    }

    /// How many tokens to ask the store for, for a decision of `cost`.
    fn want(&mut self, limit: &Limit, cost: u64, now: Micros) -> u64 {
        let debt = self.debt(now).min(limit.tolerance());
        if !self.worth_a_slice(limit, cost, now) {
            return cost;
        }
        if self.lost {
            self.size = (self.size / 2).max(1);
        } else {
            self.size = self.size.saturating_mul(2);
        }
        self.lost = false;
        // No more than the bucket held at the last answer.
        let balance = (limit.tolerance() - debt) / limit.interval();
        let want = self.wanted(limit, cost).min(balance.max(cost));
        self.size = want.max(self.size.min(Self::cap(limit, cost)));
        want
    }
}

/// One sliced bucket: its state, and a gate so that one decision at a time
/// takes a new slice while the others wait for it.
#[derive(Default)]
struct Slot {
    state: parking_lot::Mutex<State>,
    gate: tokio::sync::Mutex<()>,
}

/// Slices held by this instance, one per hot tenant-wide bucket.
pub struct Slices {
    slots: DashMap<BucketKey, Arc<Slot>>,
    clock: Arc<dyn Clock>,
    max_slots: usize,
    /// When the slots were last swept for idle ones (at most once a
    /// second: a caller spraying new tenants at the cap gets slots that are
    /// not kept, not a sweep per decision).
    swept_at: AtomicU64,
}

impl Slices {
    /// Slices for at most `max_slots` buckets at once (beyond, a bucket's
    /// decisions take exactly their cost from the store, holding nothing).
    pub fn new(clock: Arc<dyn Clock>, max_slots: usize) -> Self {
        Self {
            slots: DashMap::new(),
            clock,
            max_slots: max_slots.max(16),
            swept_at: AtomicU64::new(0),
        }
    }

    /// This layer around `inner`.
    pub fn wrap(self, inner: Box<dyn Layer>) -> SlicesLayer {
        SlicesLayer {
            inner,
            slices: self,
        }
    }

    /// Tokens this instance holds for `bucket` now.
    pub fn held(&self, bucket: &BucketKey) -> u64 {
        let now = self.clock.now();
        self.slots.get(bucket).map_or(0, |slot| {
            let state = slot.state.lock();
            let interval = state.limit.map_or(1, |l| l.interval());
            state.chunks.iter().map(|c| c.usable(now, interval)).sum()
        })
    }

    fn slot(&self, bucket: &BucketKey, now: Micros) -> Arc<Slot> {
        if let Some(slot) = self.slots.get(bucket) {
            return slot.clone();
        }
        if self.slots.len() >= self.max_slots {
            let last = self.swept_at.load(Ordering::Relaxed);
            if now < last + 1_000_000
                || self
                    .swept_at
                    .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                    .is_err()
            {
                return Arc::default();
            }
            // Forget the slots nobody used for a minute and that hold
            // nothing valid.
            self.slots.retain(|_, slot| {
                let state = slot.state.lock();
                state.used_at + 60_000_000 > now || state.chunks.iter().any(|c| c.full_at > now)
            });
            if self.slots.len() >= self.max_slots {
                return Arc::default();
            }
        }
        self.slots.entry(bucket.clone()).or_default().clone()
    }
}

/// True for a charge answered from a slice.
fn sliced(bucket: &BucketKey, charge: &Charge) -> bool {
    charge.enforce
        && charge.cost > 0
        && charge.need == charge.cost
        && charge.cost <= charge.limit.burst()
        && charge.limit.algorithm() == Algorithm::TokenBucket
        && bucket.kind() == BucketKind::TENANT
}

/// What a sliced bucket answered.
struct Answer {
    verdict: Verdict,
    /// The limit it was answered under.
    limit: Limit,
    /// Tokens taken from a slice, to give back on a refusal.
    taken: Taken,
    slot: Arc<Slot>,
}

/// [`Slices`] around a layer.
pub struct SlicesLayer {
    inner: Box<dyn Layer>,
    slices: Slices,
}

impl SlicesLayer {
    /// The slices.
    pub fn slices(&self) -> &Slices {
        &self.slices
    }

    /// Takes a new slice for a decision of `charge` that the slice held
    /// here could not answer, and answers it from the slice (one decision
    /// at a time per bucket takes; the others wait and use its slice).
    async fn take(
        &self,
        bucket: &BucketKey,
        charge: &Charge,
        policy: OnStoreUnavailable,
        slot: Arc<Slot>,
    ) -> Result<Answer, StoreError> {
        let (limit, cost) = (charge.limit, charge.cost);
        let clock = &self.slices.clock;
        let slice = {
            let mut state = slot.state.lock();
            let now = clock.now();
            state.sync(&limit, now);
            state.worth_a_slice(&limit, cost, now)
        };
        // One decision at a time takes a slice, and the others wait for it;
        // without one, decisions spend their cost side by side.
        let _gate = match slice {
            true => Some(slot.gate.lock().await),
            false => None,
        };
        // Another decision may have taken a slice while this one waited.
        if slice && let Some(answer) = Self::local(&slot, &limit, cost, clock.as_ref()) {
            return Ok(answer);
        }
        let mut want = match slice {
            true => {
                let mut state = slot.state.lock();
                let now = clock.now();
                state.sync(&limit, now);
                state.want(&limit, cost, now)
            }
            false => cost,
        };
        loop {
            // Counted from before the call: the store's clock reads later,
            // so what is derived from it here ends no later than there.
            let sent = clock.now();
            let charges = [Charge::new(limit, want)];
            let applied = self
                .inner
                .apply(
                    Request::new(std::slice::from_ref(bucket), &charges, Op::SPEND)
                        .with_policies(&[policy]),
                )
                .await?;
            let got =
                applied.outcome.verdicts.first().copied().ok_or_else(|| {
                    StoreError::Protocol("a slice's take answered no verdict".into())
                })?;
            let answer = |verdict, taken| Answer {
                verdict,
                limit,
                taken,
                slot: slot.clone(),
            };
            if applied.degraded {
                // A policy's answer, not the store's: hold nothing.
                return Ok(answer(got, Taken::new()));
            }
            let mut state = slot.state.lock();
            let now = clock.now();
            state.sync(&limit, now);
            state.full_at = sent + got.reset_after;
            if got.allowed {
                crate::telemetry::metrics::slice_taken(true);
                // This decision's cost was spent in the store, like any
                // admitted decision's; the rest of the slice is held, as
                // far as the take's debt covers it.
                let full_at = state.full_at;
                state.add(Chunk {
                    tokens: want - cost,
                    full_at,
                });
                state.sync(&limit, now);
                let taken = Taken::from_elem(
                    Chunk {
                        tokens: cost,
                        full_at,
                    },
                    1,
                );
                let verdict = state.verdict(&limit, true, 0, now);
                return Ok(answer(verdict, taken));
            }
            crate::telemetry::metrics::slice_taken(false);
            if want > cost && got.remaining >= cost {
                // The bucket holds less than the slice but enough for this
                // decision: ask for exactly that.
                want = cost;
                continue;
            }
            let retry_after = state
                .certain_wait(&limit, cost, now)
                .unwrap_or(got.retry_after);
            let verdict = Verdict {
                remaining: got.remaining,
                debt: got.debt,
                ..state.verdict(&limit, false, retry_after, now)
            };
            return Ok(answer(verdict, Taken::new()));
        }
    }

    /// The answer from what this instance holds or knows, if it can give
    /// one without the store: tokens from the slice, or a refusal the
    /// store's last answer proves.
    fn local(slot: &Arc<Slot>, limit: &Limit, cost: u64, clock: &dyn Clock) -> Option<Answer> {
        let mut state = slot.state.lock();
        // Read under the lock, so that readings on one slot are in order.
        let now = clock.now();
        state.sync(limit, now);
        state.used_at = now;
        let answer = |verdict, taken| Answer {
            verdict,
            limit: *limit,
            taken,
            slot: slot.clone(),
        };
        if let Some(taken) = state.take(cost) {
            let verdict = state.verdict(limit, true, 0, now);
            return Some(answer(verdict, taken));
        }
        let wanted = state.wanted(limit, cost);
        let wait = state.certain_wait(limit, wanted, now)?;
        crate::telemetry::metrics::slice_refused_locally();
        Some(answer(state.verdict(limit, false, wait, now), Taken::new()))
    }

    /// A spending decision with sliced buckets: the slices answer what they
    /// can; then the rest goes to the store; then the sliced buckets that
    /// need a new slice take one. The rest goes first so that a decision
    /// its own key refuses never spends the tenant's tokens; a decision
    /// whose new slice is refused has spent the rest's tokens (bounded: the
    /// refusal is then remembered and answered here until it could pass).
    async fn apply_sliced(
        &self,
        r: Request<'_>,
        sliced: SmallVec<[usize; 2]>,
    ) -> Result<Applied, StoreError> {
        let now = self.slices.clock.now();
        let mut verdicts: Vec<Verdict> = vec![Verdict::admitted(); r.buckets.len()];
        let mut answers: SmallVec<[Answer; 2]> = SmallVec::new();
        let mut pending: SmallVec<[(usize, Arc<Slot>); 2]> = SmallVec::new();
        let mut allowed = true;
        let mut degraded = false;
        for &i in &sliced {
            let slot = self.slices.slot(&r.buckets[i], now);
            let (limit, cost) = (r.charges[i].limit, r.charges[i].cost);
            match Self::local(&slot, &limit, cost, self.slices.clock.as_ref()) {
                Some(answer) => {
                    allowed &= answer.verdict.allowed;
                    verdicts[i] = answer.verdict;
                    answers.push(answer);
                }
                None => {
                    verdicts[i] = slot.state.lock().verdict(&limit, true, 0, now);
                    pending.push((i, slot));
                }
            }
        }
        let give_back = |answers: &SmallVec<[Answer; 2]>| {
            for a in answers {
                let mut state = a.slot.state.lock();
                let now = self.slices.clock.now();
                state.give_back(&a.taken, &a.limit, now);
            }
        };
        let rest: SmallVec<[usize; 4]> = (0..r.buckets.len())
            .filter(|i| !sliced.contains(i))
            .collect();
        if !rest.is_empty() {
            let buckets: SmallVec<[BucketKey; 4]> =
                rest.iter().map(|&i| r.buckets[i].clone()).collect();
            let charges: SmallVec<[Charge; 4]> = rest.iter().map(|&i| r.charges[i]).collect();
            let policies: SmallVec<[OnStoreUnavailable; 4]> = rest
                .iter()
                .filter_map(|&i| r.policies.get(i).copied())
                .collect();
            // A refused decision spends nothing: the rest is only asked
            // what it holds, for its verdicts.
            let op = if allowed { Op::SPEND } else { Op::DRY };
            let applied = self
                .inner
                .apply(Request::new(&buckets, &charges, op).with_policies(&policies))
                .await;
            match applied {
                Ok(applied) => {
                    allowed &= applied.outcome.allowed;
                    degraded |= applied.degraded;
                    for (&i, v) in rest.iter().zip(applied.outcome.verdicts) {
                        verdicts[i] = v;
                    }
                }
                Err(e) => {
                    give_back(&answers);
                    return Err(e);
                }
            }
        }
        if allowed {
            for (i, slot) in pending {
                let answer = self.take(&r.buckets[i], &r.charges[i], r.policies[i], slot);
                match answer.await {
                    Ok(answer) => {
                        allowed &= answer.verdict.allowed;
                        verdicts[i] = answer.verdict;
                        answers.push(answer);
                        if !allowed {
                            break;
                        }
                    }
                    Err(e) => {
                        give_back(&answers);
                        return Err(e);
                    }
                }
            }
        }
        if !allowed {
            give_back(&answers);
        }
        Ok(Applied {
            outcome: Verdicts { allowed, verdicts },
            degraded,
        })
    }
}

impl Wrapper for SlicesLayer {
    fn inner(&self) -> &dyn Layer {
        self.inner.as_ref()
    }

    fn apply<'a>(&'a self, r: Request<'a>) -> LayerFuture<'a> {
        if r.op != Op::SPEND || r.attachment.is_some() {
            return self.inner.apply(r);
        }
        let sliced: SmallVec<[usize; 2]> = (0..r.buckets.len())
            .filter(|&i| sliced(&r.buckets[i], &r.charges[i]))
            .collect();
        if sliced.is_empty() {
            return self.inner.apply(r);
        }
        Box::pin(self.apply_sliced(r, sliced))
    }

    fn apply_now(&self, r: Request<'_>) -> Option<Result<Applied, StoreError>> {
        let plain = r.op != Op::SPEND
            || r.attachment.is_some()
            || !r.buckets.iter().zip(r.charges).any(|(b, c)| sliced(b, c));
        if plain { self.inner.apply_now(r) } else { None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Rate;

    fn limit(burst: u64, rate: &str) -> Limit {
        Limit::new(burst, rate.parse::<Rate>().unwrap()).unwrap()
    }

    fn c(tokens: u64, full_at: Micros) -> Chunk {
        Chunk { tokens, full_at }
    }

    fn state(limit: Limit, now: Micros) -> State {
        let mut s = State::default();
        s.sync(&limit, now);
        s
    }

    #[test]
    fn chunks_are_spent_earliest_first_and_run_down_with_their_debt() {
        // 100/second: 10 ms a token.
        let l = limit(320, "100/second");
        let mut s = state(l, 1_000);
        s.add(c(2, 500_000));
        s.add(c(5, 900_000));
        let taken = s.take(4).unwrap();
        assert_eq!(taken.as_slice(), [c(2, 500_000), c(2, 900_000)]);
        assert_eq!(s.chunks.as_slice(), [c(3, 900_000)]);
        assert!(s.take(4).is_none(), "all or nothing");
        s.give_back(&taken, &l, 2_000);
        assert_eq!(s.chunks.as_slice(), [c(2, 500_000), c(5, 900_000)]);
        // 15 ms before its take's debt runs out, the first chunk's debt
        // covers one token.
        s.sync(&l, 485_000);
        assert_eq!(s.chunks.as_slice(), [c(1, 500_000), c(5, 900_000)]);
        assert!(!s.lost, "nothing known of the bucket: not short");
        // The bucket is short (full again only at 3 s): tokens running out
        // unused count as lost.
        s.full_at = 3_000_000;
        s.sync(&l, 500_000);
        assert_eq!(s.chunks.as_slice(), [c(5, 900_000)]);
        assert!(s.lost);
        // Tokens given back only as far as their debt still covers them.
        let taken = s.take(5).unwrap();
        s.give_back(&taken, &l, 870_000);
        assert_eq!(s.chunks.as_slice(), [c(3, 900_000)]);
        s.sync(&l, 900_000);
        assert!(s.chunks.is_empty());
    }

    #[test]
    fn a_new_limit_or_an_earlier_clock_reading_drops_everything() {
        let l = limit(320, "100/second");
        let mut s = state(l, 10_000);
        s.add(c(5, 900_000));
        s.full_at = 50_000;
        let taken = s.take(1).unwrap();
        s.sync(&limit(100, "100/second"), 11_000);
        assert!(s.chunks.is_empty() && s.full_at == 0);
        // Tokens taken under the old limit do not come back.
        s.give_back(&taken, &l, 11_000);
        assert!(s.chunks.is_empty());
        let mut s = state(l, 10_000);
        s.add(c(5, 900_000));
        s.sync(&l, 9_999);
        assert!(s.chunks.is_empty(), "the clock stepped back");
    }

    #[test]
    fn waits_and_slice_sizes_follow_the_last_answer() {
        // 100/second: 10 ms a token; burst 320, so slices of at most 10.
        let l = limit(320, "100/second");
        let mut s = state(l, 0);
        // Nothing known: take exactly the cost, and no slice.
        assert_eq!(s.want(&l, 3, 0), 3);
        assert!(!s.worth_a_slice(&l, 3, 0));
        // The bucket is empty until 3.2 s: 4 tokens are there at 40 ms.
        s.full_at = 3_200_000;
        assert_eq!(s.certain_wait(&l, 4, 0), Some(40_000));
        assert_eq!(s.certain_wait(&l, 4, 40_000), None);
        assert!(s.worth_a_slice(&l, 1, 40_000));
        // Slices double while they run out in time, within the cap and
        // what the bucket held.
        s.size = 4;
        assert_eq!(s.want(&l, 1, 100_000), 8, "10 tokens there");
        assert_eq!(s.want(&l, 1, 200_000), 10, "capped at burst / 32");
        s.lost = true;
        assert_eq!(s.want(&l, 1, 200_000), 5, "halved after tokens were lost");
        assert_eq!(s.wanted(&l, 1), 5);
        // A full bucket is worth a slice: it runs down over 100 ms.
        s.full_at = 200_000;
        assert!(s.worth_a_slice(&l, 1, 200_000));
        assert_eq!(s.want(&l, 1, 200_000), 10);
        // A small bucket refilling every 10 µs is not: decisions spend their
        // cost side by side.
        let fast = limit(31, "100000/second");
        let mut s = state(fast, 0);
        s.full_at = 500;
        assert!(!s.worth_a_slice(&fast, 2, 0));
        assert_eq!(s.want(&fast, 2, 0), 2);
    }

    /// A store's token bucket, exact: the instant it is full again.
    struct Exact {
        limit: Limit,
        full_at: Micros,
    }

    impl Exact {
        fn debt(&self, now: Micros) -> Micros {
            self.full_at.saturating_sub(now)
        }

        /// Spends `n` if the bucket holds them: the debt after, or None.
        fn spend(&mut self, n: u64, now: Micros) -> Option<Micros> {
            let after = self.debt(now) + n * self.limit.interval();
            (after <= self.limit.tolerance()).then(|| {
                self.full_at = now + after;
                after
            })
        }

        fn balance(&self, now: Micros) -> u64 {
            (self.limit.tolerance() - self.debt(now)) / self.limit.interval()
        }
    }

    proptest::proptest! {
        /// Three instances take slices of various sizes from one bucket,
        /// spend from them, and the bucket is spent from directly too; at
        /// every step what the instances may still use plus what the store
        /// holds is at most the burst.
        #[test]
        fn held_plus_stored_never_exceed_the_burst(
            burst in 1u64..400,
            per_second in 1u64..20_000,
            steps in proptest::collection::vec(
                (0usize..3, 0u64..20_000, 0u64..2_000, 0u8..3, 1u64..40),
                1..300,
            ),
        ) {
            let rate = Rate { count: per_second, unit: crate::algorithm::RateUnit::Second };
            let l = Limit::new(burst, rate).unwrap();
            let mut store = Exact { limit: l, full_at: 0 };
            let mut states: Vec<State> = (0..3).map(|_| state(l, 0)).collect();
            let mut now = 0;
            for (who, dt, latency, action, n) in steps {
                now += dt;
                let n = n.min(burst);
                let s = &mut states[who];
                s.sync(&l, now);
                match action {
                    // A take, sent `latency` before the store applied it.
                    0 => if let Some(debt) = store.spend(n, now) {
                        let sent = now.saturating_sub(latency);
                        s.full_at = sent + debt;
                        s.add(c(n, sent + debt));
                        s.sync(&l, now);
                    },
                    1 => { let _ = s.take(n); }
                    _ => { let _ = store.spend(n, now); }
                }
                let mut held = 0;
                for s in &mut states {
                    s.sync(&l, now);
                    held += s.held();
                }
                proptest::prop_assert!(
                    held + store.balance(now) <= burst,
                    "held {} + stored {} > burst {} at {}",
                    held, store.balance(now), burst, now
                );
            }
        }
    }

    #[test]
    fn slots_are_bounded_and_idle_ones_swept_at_most_once_a_second() {
        let clock = Arc::new(crate::clock::ManualClock::new(1_000_000));
        let slices = Slices::new(clock.clone(), 16);
        let bucket = |i: usize| BucketKey::new(&format!("t{i}"), BucketKind::TENANT, "", "");
        let now = clock.now();
        for i in 0..16 {
            slices.slot(&bucket(i), now).state.lock().used_at = now;
        }
        // At the cap, with every slot in use: a new bucket's slot is not
        // kept (its decisions take exactly their cost), and the next one
        // within the second does not sweep again.
        slices.slot(&bucket(16), now);
        slices.slot(&bucket(17), now);
        assert_eq!(slices.slots.len(), 16);
        assert!(!slices.slots.contains_key(&bucket(16)));
        // A minute later the idle slots go at the next sweep.
        let later = now + 61_000_000;
        slices.slot(&bucket(18), later);
        assert_eq!(slices.slots.len(), 1);
        assert!(slices.slots.contains_key(&bucket(18)));
    }

    #[test]
    fn only_enforced_tenant_wide_token_buckets_that_spend_are_sliced() {
        let l = limit(100, "10/second");
        let tenant = BucketKey::new("acme", BucketKind::TENANT, "", "");
        assert!(sliced(&tenant, &Charge::new(l, 1)));
        assert!(!sliced(
            &BucketKey::new("acme", BucketKind::KEY, "", "u"),
            &Charge::new(l, 1)
        ));
        assert!(!sliced(
            &BucketKey::new(
                "acme",
                BucketKind::Rule {
                    per_key: false,
                    concurrency: false,
                    shadow: true
                },
                "",
                ""
            ),
            &Charge::new(l, 1)
        ));
        let shadow = Charge {
            enforce: false,
            ..Charge::new(l, 1)
        };
        assert!(!sliced(&tenant, &shadow));
        let ask = Charge {
            need: 1,
            ..Charge::new(l, 0)
        };
        assert!(!sliced(&tenant, &ask));
        assert!(!sliced(&tenant, &Charge::new(l, 101)), "beyond the burst");
        let window = Limit::window(Algorithm::FixedWindow, "10/second".parse().unwrap()).unwrap();
        assert!(!sliced(&tenant, &Charge::new(window, 1)));
    }
}
