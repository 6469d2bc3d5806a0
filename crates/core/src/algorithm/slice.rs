//! The arithmetic of token slices (`--token-slices`): what one instance
//! holds of a hot tenant-wide bucket, how much of it is still usable as the
//! store's debt runs down, and how big the next slice is. Pure: every
//! function takes `now`. The layer that takes slices from the store and
//! answers decisions from them is [`crate::store::slices`], whose module
//! docs explain why held plus stored tokens never exceed the burst.

use smallvec::SmallVec;

use super::{Limit, Micros, Verdict};

/// A slice is at most this share of the bucket's burst.
pub(crate) const MAX_SHARE: u64 = 32;

/// A slice is taken only when it would stay usable at least this long
/// (the bucket's debt as last seen plus the refill time of a whole slice).
/// Below (a small bucket that refills fast), each decision spends exactly
/// its cost in its own store call, concurrently with the others, which
/// coalesce.
pub(crate) const MIN_HOLD: Micros = 1_000;

/// Tokens of one take, and when the store said the bucket is full again
/// after that take (local clock, counted from when the call was sent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub(crate) tokens: u64,
    pub(crate) full_at: Micros,
}

impl Chunk {
    /// The tokens the take's debt still covers at `now`.
    pub(crate) fn usable(&self, now: Micros, interval: Micros) -> u64 {
        self.tokens
            .min(self.full_at.saturating_sub(now) / interval.max(1))
    }
}

/// This instance's view of one sliced bucket.
#[derive(Debug, Default)]
pub(crate) struct State {
    /// The limit the chunks were taken under; a new limit drops them.
    pub(crate) limit: Option<Limit>,
    /// Tokens held, earliest `full_at` first.
    pub(crate) chunks: SmallVec<[Chunk; 2]>,
    /// Tokens to take next time.
    pub(crate) size: u64,
    /// Tokens ran out unused while the bucket was short, since the last
    /// take.
    pub(crate) lost: bool,
    /// When the store said the bucket is full again (local clock, counted
    /// from when the call was sent), as of its last answer; 0 when unknown.
    pub(crate) full_at: Micros,
    /// The latest clock reading made under this state's lock: a reading
    /// before it means the clock stepped back.
    pub(crate) seen_at: Micros,
    /// The last decision on this bucket.
    pub(crate) used_at: Micros,
}

/// Tokens taken from chunks, to give back if the decision is refused.
pub(crate) type Taken = SmallVec<[Chunk; 2]>;

impl State {
    /// Drops what can no longer be used at `now` (read under the lock).
    pub(crate) fn sync(&mut self, limit: &Limit, now: Micros) {
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
    pub(crate) fn short(&self, limit: &Limit, now: Micros) -> bool {
        self.debt(now) * 2 >= limit.tolerance()
    }

    pub(crate) fn held(&self) -> u64 {
        self.chunks.iter().map(|c| c.tokens).sum()
    }

    /// Takes `cost` tokens from the chunks, all or nothing.
    pub(crate) fn take(&mut self, cost: u64) -> Option<Taken> {
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
    pub(crate) fn give_back(&mut self, taken: &Taken, limit: &Limit, now: Micros) {
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

    /// Records the store's answer to a take sent at `sent` (local clock,
    /// read before the call) and read at `now`: the bucket is full again
    /// `reset_after` after the store decided, which was no earlier than
    /// `sent`, so counting from `sent` ends no later than the store's own
    /// instant. When it admitted, `tokens` more than the decision's own
    /// cost are held, as far as the take's debt covers them. Returns the
    /// take's `full_at`.
    pub(crate) fn answered(
        &mut self,
        limit: &Limit,
        sent: Micros,
        reset_after: Micros,
        tokens: u64,
        now: Micros,
    ) -> Micros {
        self.sync(limit, now);
        let full_at = sent + reset_after;
        self.full_at = full_at;
        self.add(Chunk { tokens, full_at });
        self.sync(limit, now);
        full_at
    }

    /// Holds the tokens of `chunk` (dropped at the next [`Self::sync`] as
    /// far as its debt no longer covers them).
    pub(crate) fn add(&mut self, chunk: Chunk) {
        if chunk.tokens > 0 {
            let at = self.chunks.partition_point(|c| c.full_at < chunk.full_at);
            self.chunks.insert(at, chunk);
        }
    }

    /// The store's debt at `now`, as of its last answer (at least that:
    /// other instances only add to it).
    pub(crate) fn debt(&self, now: Micros) -> Micros {
        self.full_at.saturating_sub(now)
    }

    /// When the last answer proves `cost` cannot be admitted yet: the wait
    /// until it could be.
    pub(crate) fn certain_wait(&self, limit: &Limit, cost: u64, now: Micros) -> Option<Micros> {
        if self.full_at == 0 {
            return None;
        }
        let needed = self.debt(now) + cost * limit.interval();
        let wait = needed.saturating_sub(limit.tolerance());
        (wait > 0).then_some(wait)
    }

    /// The verdict of a bucket answered here.
    pub(crate) fn verdict(
        &self,
        limit: &Limit,
        allowed: bool,
        retry_after: Micros,
        now: Micros,
    ) -> Verdict {
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
    pub(crate) fn worth_a_slice(&self, limit: &Limit, cost: u64, now: Micros) -> bool {
        self.full_at != 0 && self.debt(now) + Self::cap(limit, cost) * limit.interval() >= MIN_HOLD
    }

    /// The most tokens one slice of `limit` holds (at least `cost`).
    pub(crate) fn cap(limit: &Limit, cost: u64) -> u64 {
        (limit.burst() / MAX_SHARE).max(cost)
    }

    /// The tokens this instance waits for before it takes a new slice of
    /// a bucket the store's last answer shows short: the slice it would
    /// take, so that a hot bucket is taken from in slices, not a token at
    /// a time.
    pub(crate) fn wanted(&self, limit: &Limit, cost: u64) -> u64 {
        self.size.clamp(cost, Self::cap(limit, cost))
    }

    /// How many tokens to ask the store for, for a decision of `cost`.
    pub(crate) fn want(&mut self, limit: &Limit, cost: u64, now: Micros) -> u64 {
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
        // A take lists only the chunks it drew from, each by what it drew.
        let one = s.take(1).unwrap();
        assert_eq!(one.as_slice(), [c(1, 500_000)]);
        s.give_back(&one, &l, 2_000);
        let five = s.take(5).unwrap();
        assert_eq!(five.as_slice(), [c(2, 500_000), c(3, 900_000)]);
        s.give_back(&five, &l, 2_000);
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
        // A reading equal to the last one is not a step back; and starting
        // over keeps the slice size learned (at least 1).
        let mut s = state(l, 10_000);
        assert_eq!(s.size, 1);
        s.size = 8;
        s.add(c(5, 900_000));
        s.sync(&l, 10_000);
        assert_eq!(s.chunks.as_slice(), [c(5, 900_000)]);
        s.sync(&limit(100, "100/second"), 10_000);
        assert!(s.chunks.is_empty());
        assert_eq!(s.size, 8);
    }

    #[test]
    fn an_answer_is_held_from_its_sending_and_reported_with_the_stores_balance() {
        // 100/second, burst 320 (3.2 s to fill). A take sent at 1.0 s,
        // read at 1.001 s: the store is full again 2 s after it decided.
        let l = limit(320, "100/second");
        let mut s = state(l, 1_000_000);
        let full_at = s.answered(&l, 1_000_000, 2_000_000, 5, 1_001_000);
        assert_eq!(full_at, 3_000_000);
        assert_eq!(s.full_at, 3_000_000);
        assert_eq!(s.chunks.as_slice(), [c(5, 3_000_000)]);
        // At 1.001 s the store holds (3.2 s - 1.999 s) / 10 ms = 120 whole
        // tokens; with the 5 held here, 125 remain; the reset is the debt.
        let v = s.verdict(&l, true, 0, 1_001_000);
        assert_eq!(
            (v.allowed, v.remaining, v.reset_after),
            (true, 125, 1_999_000)
        );
        let v = s.verdict(&l, false, 7, 1_001_000);
        assert_eq!((v.allowed, v.retry_after), (false, 7));
        // Never more than the burst: a full store plus what is held.
        let v = s.verdict(&l, true, 0, 3_000_000);
        assert_eq!((v.remaining, v.reset_after), (320, 0));
        // Nothing to hold adds no chunk.
        s.add(c(0, 4_000_000));
        assert_eq!(s.chunks.as_slice(), [c(5, 3_000_000)]);
    }

    #[test]
    fn tokens_go_back_only_under_the_same_limit_and_a_clock_that_did_not_step_back() {
        let l = limit(320, "100/second");
        let mut s = state(l, 10_000);
        s.add(c(5, 900_000));
        let taken = s.take(2).unwrap();
        // Given back at the very instant of the last reading: back.
        s.give_back(&taken, &l, 10_000);
        assert_eq!(s.chunks.as_slice(), [c(5, 900_000)]);
        // Given back with an earlier reading: ignored, and what is held
        // stays held (the next decision's reading decides what is kept).
        let taken = s.take(2).unwrap();
        s.give_back(&taken, &l, 9_000);
        assert_eq!(s.chunks.as_slice(), [c(3, 900_000)]);
    }

    #[test]
    fn a_slice_is_worth_taking_when_it_lasts_the_minimum_hold() {
        // Burst 320: slices of 10. At 10 000/second a slice refills in
        // 10 × 100 µs = MIN_HOLD: worth it even with a full bucket; at
        // 20 000/second, 500 µs: not.
        for (rate, worth) in [("10000/second", true), ("20000/second", false)] {
            let l = limit(320, rate);
            let mut s = state(l, 10);
            s.full_at = 1;
            assert_eq!(s.worth_a_slice(&l, 1, 10), worth, "{rate}");
        }
    }

    #[test]
    fn a_slice_is_never_more_than_the_store_held_at_its_last_answer() {
        // Burst 320 at 100/second: slices of up to 10. The last answer left
        // 3.15 s of debt: (3.2 s - 3.15 s) / 10 ms = 5 tokens in the store.
        let l = limit(320, "100/second");
        let mut s = state(l, 0);
        s.full_at = 3_150_000;
        s.size = 8;
        assert_eq!(s.want(&l, 1, 0), 5);
        // With the store full, the slice size rules: doubled to 16, capped
        // at 10.
        let mut s = state(l, 0);
        s.full_at = 1;
        s.size = 8;
        assert_eq!(s.want(&l, 1, 10), 10);
    }

    #[test]
    fn only_tokens_that_ran_out_count_as_lost() {
        // 100/second, burst 320: the store's debt of 3 s (short: over half
        // the 3.2 s tolerance) covers the 5 tokens held until 0.85 s.
        let l = limit(320, "100/second");
        let mut s = state(l, 0);
        s.full_at = 3_000_000;
        s.add(c(5, 900_000));
        s.sync(&l, 850_000);
        assert_eq!(s.chunks.as_slice(), [c(5, 900_000)]);
        assert!(!s.lost, "every token still usable");
        // At 0.87 s the take's debt covers 3 of them: 2 ran out unused.
        s.sync(&l, 870_000);
        assert_eq!(s.chunks.as_slice(), [c(3, 900_000)]);
        assert!(s.lost);
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
                    // A take, sent `latency` before the store applied it
                    // (and answered at once): recorded as the layer does.
                    0 => if let Some(debt) = store.spend(n, now) {
                        let sent = now.saturating_sub(latency);
                        s.answered(&l, sent, debt, n, now);
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
}
