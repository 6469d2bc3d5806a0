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

use super::OnStoreUnavailable;
use super::layer::{Applied, Layer, LayerFuture, Wrapper};
use super::{BucketKey, BucketKind, Request, StoreError, Verdicts};
use crate::algorithm::slice::{Chunk, State, Taken};
use crate::algorithm::{Algorithm, Charge, Limit, Micros, Op, Verdict};
use crate::clock::Clock;

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
            // This decision's cost was spent in the store, like any
            // admitted decision's; the rest of the slice is held, as far as
            // the take's debt covers it.
            let held = if got.allowed { want - cost } else { 0 };
            let full_at = state.answered(&limit, sent, got.reset_after, held, now);
            if got.allowed {
                crate::telemetry::metrics::slice_taken(true);
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

    #[test]
    fn slots_are_bounded_and_idle_ones_swept_at_most_once_a_second() {
        let clock = Arc::new(crate::clock::ManualClock::new(100_000_000));
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
        // A slot left idle for a minute is not swept within the second
        // after a sweep, and is at the second's end.
        slices.slot(&bucket(0), now).state.lock().used_at = now - 60_000_000;
        slices.slot(&bucket(19), now + 999_999);
        assert!(slices.slots.contains_key(&bucket(0)));
        assert!(!slices.slots.contains_key(&bucket(19)));
        slices.slot(&bucket(20), now + 1_000_000);
        assert!(!slices.slots.contains_key(&bucket(0)));
        assert!(slices.slots.contains_key(&bucket(20)));
        assert_eq!(slices.slots.len(), 16);
        // At the next sweep, a second on: a slot last used exactly a minute
        // before goes; one holding tokens still refilling stays; one whose
        // tokens are full just then goes.
        let sweep = now + 2_000_000;
        slices.slot(&bucket(1), now).state.lock().used_at = sweep - 60_000_000;
        for (i, full_at) in [(2, sweep + 1), (3, sweep)] {
            let slot = slices.slot(&bucket(i), now);
            let mut state = slot.state.lock();
            state.used_at = 0;
            state.chunks.push(Chunk { tokens: 1, full_at });
        }
        slices.slot(&bucket(21), sweep);
        let held: Vec<bool> = [1, 2, 3, 21]
            .iter()
            .map(|&i| slices.slots.contains_key(&bucket(i)))
            .collect();
        assert_eq!(held, [false, true, false, true]);
        // Back at the cap; a minute later the idle slots go at the next
        // sweep.
        slices.slot(&bucket(22), sweep);
        slices.slot(&bucket(23), sweep);
        assert_eq!(slices.slots.len(), 16);
        let later = now + 62_000_000;
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
