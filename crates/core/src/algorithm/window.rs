//! Fixed and sliding windows, and quotas: pure functions of (state, limit,
//! cost, now).
//!
//! Windows are aligned to the Unix epoch (a minute window starts on the
//! minute), as envoyproxy/ratelimit aligns them, so every instance agrees on
//! where a window starts.
//!
//! - Fixed window: a counter per window; it admits while
//!   `count + cost <= limit` and resets when the next window starts.
//! - Sliding window counter: the estimate is this window's count plus the
//!   previous window's count weighted by the share of the previous window
//!   still inside the sliding window (in whole milliseconds, rounded so the
//!   estimate is never low). It avoids the fixed window's double burst at a
//!   window boundary.
//!
//! - Quota: a fixed window over a calendar period of a tenant's billing
//!   cycle ([`super::calendar`]), which the limit names
//!   ([`Limit::quota`]): the caller computes the period, the store counts in
//!   it. A stored period that began after the caller's is counted in
//!   instead (an instance whose clock runs ahead turned it already), so no
//!   period is counted twice; `now` outside the period counted is taken as
//!   its nearest instant, so a refusal waits exactly until that period
//!   ends.
//!
//! Like the token bucket, a rejected request spends nothing, `retry_after`
//! is exact and never early, and a clock that steps back never resets a
//! window: the stored window is kept until time passes it again.

use super::{CostExceedsBurst, Limit, Micros, Verdict};
use crate::algorithm::Algorithm;

/// The largest `limit × window-in-ms` of a sliding window, so that the
/// weighting stays exact in a double (Lua) and a u64.
pub const MAX_WEIGHT: u64 = 1 << 52;

/// What a store keeps per window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowState {
    /// Start of the window `count` belongs to.
    pub start: Micros,
    /// Requests counted in that window.
    pub count: u64,
    /// Requests counted in the window before it (sliding windows only).
    pub previous: u64,
    /// From this instant the state means nothing (the window, and for a
    /// sliding window the next one too, is over). A quota's outlives its
    /// period by one more period's length, as on Redis: the usage ledger
    /// reads a closed period's final count after its end.
    pub idle_at: Micros,
}

/// The counts that apply at `now`: the stored ones rolled forward to the
/// window `now` falls in (a quota: to the period the limit names). Returns
/// (window start, window end, count, previous, now), where `now` is moved
/// up to the stored window's start if the clock went back before it (a
/// quota: into the period counted).
fn rolled(
    state: Option<WindowState>,
    limit: &Limit,
    now: Micros,
) -> (Micros, Micros, u64, u64, Micros) {
    if let Some(period) = limit.period() {
        // The period is the caller's; a stored one that began later (an
        // instance whose clock is ahead turned it already) is counted in
        // instead, so a period is never counted twice.
        let (start, end, count) = match state {
            Some(s) if s.start > period.start => (s.start, quota_end(s), s.count),
            Some(s) if s.start == period.start => (period.start, period.end, s.count),
            _ => (period.start, period.end, 0),
        };
        return (start, end, count, 0, now.clamp(start, end - 1));
    }
    let window = limit.interval();
    let start = now - now % window;
    let end = start + window;
    match state {
        Some(s) if s.start > start => (s.start, s.start + window, s.count, s.previous, s.start),
        Some(s) if s.start == start => (start, end, s.count, s.previous, now),
        Some(s) if s.start + window == start => (start, end, 0, s.count, now),
        _ => (start, end, 0, 0, now),
    }
}

/// The end of the period a quota's stored state counts in: its state is
/// idle one period's length after it.
pub fn quota_end(state: WindowState) -> Micros {
    state.start + (state.idle_at - state.start) / 2
}

/// Decides `cost` against a fixed or sliding window: the [`decide_need`] of
/// a request that needs what it spends.
pub fn decide(
    state: Option<WindowState>,
    limit: &Limit,
    cost: u64,
    now: Micros,
) -> Result<(Verdict, WindowState), CostExceedsBurst> {
    decide_need(state, limit, cost, cost, now)
}

/// The counts at `now` and what they add up to.
struct Counts {
    start: Micros,
    /// Where the window (the period) ends.
    end: Micros,
    count: u64,
    previous: u64,
    /// `now`, moved up to the stored window's start if the clock went back.
    now: Micros,
    /// `count` plus the weighted previous count.
    used: u64,
    sliding: bool,
    quota: bool,
    window: Micros,
}

impl Counts {
    fn at(state: Option<WindowState>, limit: &Limit, now: Micros) -> Self {
        let window = limit.interval();
        let (start, end, count, previous, now) = rolled(state, limit, now);
        let sliding = limit.algorithm() == Algorithm::SlidingWindow;
        let (previous, weighted) = if sliding {
            (previous, weigh(previous, window, now - start))
        } else {
            (0, 0)
        };
        Self {
            start,
            end,
            count,
            previous,
            now,
            used: count + weighted,
            sliding,
            quota: limit.period().is_some(),
            window,
        }
    }

    fn state(&self) -> WindowState {
        WindowState {
            start: self.start,
            count: self.count,
            previous: self.previous,
            idle_at: if self.sliding {
                self.end + self.window
            } else if self.quota {
                self.end + (self.end - self.start)
            } else {
                self.end
            },
        }
    }

    /// A verdict that admitted (or applied) what is now counted.
    fn applied(&self, limit: &Limit, forgiven: u64) -> Verdict {
        Verdict {
            allowed: true,
            remaining: limit.burst().saturating_sub(self.used),
            debt: self.used.saturating_sub(limit.burst()),
            forgiven,
            retry_after: 0,
            reset_after: self.reset_after(),
        }
    }

    fn reset_after(&self) -> Micros {
        reset_after(
            self.sliding,
            self.end,
            self.window,
            self.count,
            self.previous,
            self.now,
        )
    }
}

/// Decides a request spending `cost` that needs `need` (`cost <= need`)
/// against a fixed or sliding window.
pub fn decide_need(
    state: Option<WindowState>,
    limit: &Limit,
    cost: u64,
    need: u64,
    now: Micros,
) -> Result<(Verdict, WindowState), CostExceedsBurst> {
    let max = limit.burst();
    let need = need.max(cost);
    if need > max {
        return Err(CostExceedsBurst {
            cost: need,
            burst: max,
        });
    }
    let mut c = Counts::at(state, limit, now);
    if c.used + need <= max {
        c.count += cost;
        c.used += cost;
        return Ok((c.applied(limit, 0), c.state()));
    }
    // A rejection spends nothing: the count stays.
    let retry_at = if c.sliding {
        sliding_retry_at(c.start, c.window, c.count, c.previous, max - need)
    } else {
        c.end
    };
    let verdict = Verdict {
        allowed: false,
        remaining: max.saturating_sub(c.used),
        debt: c.used.saturating_sub(max),
        forgiven: 0,
        retry_after: retry_at - c.now,
        reset_after: c.reset_after(),
    };
    Ok((verdict, c.state()))
}

/// Counts `cost` at `now` whatever the window holds (usage reported after
/// the fact), up to `burst + debt` in use; the rest is reported forgiven.
pub fn charge(
    state: Option<WindowState>,
    limit: &Limit,
    cost: u64,
    now: Micros,
) -> (Verdict, WindowState) {
    let mut c = Counts::at(state, limit, now);
    let cap = limit.burst() + limit.debt();
    let room = cap.saturating_sub(c.used);
    let applied = cost.min(room);
    c.count += applied;
    c.used += applied;
    (c.applied(limit, cost - applied), c.state())
}

/// Uncounts `tokens` charged at `since`, while that window still counts:
/// from this window's count when `since` falls in it, from the previous
/// count (a sliding window) when it fell in the one before; otherwise the
/// tokens have already been forgotten with their window.
pub fn refund(
    state: Option<WindowState>,
    limit: &Limit,
    tokens: u64,
    since: Micros,
    now: Micros,
) -> (Verdict, WindowState) {
    let mut c = Counts::at(state, limit, now);
    if (c.start..c.end).contains(&since) {
        c.count = c.count.saturating_sub(tokens);
    } else if c.sliding && since < c.start && since + c.window >= c.start {
        c.previous = c.previous.saturating_sub(tokens);
    }
    // Recount from what is left.
    let c = Counts::at(Some(c.state()), limit, c.now);
    (c.applied(limit, 0), c.state())
}

/// `previous` weighted by the share of the previous window still inside the
/// sliding window, `elapsed` into the current one: in whole milliseconds
/// (elapsed rounded down), the result rounded up.
fn weigh(previous: u64, window: Micros, elapsed: Micros) -> u64 {
    let w = window / 1000;
    let e = elapsed / 1000;
    (previous * (w - e)).div_ceil(w)
}

/// The first instant a sliding window admits `cost` = `max - avail`.
fn sliding_retry_at(
    start: Micros,
    window: Micros,
    count: u64,
    previous: u64,
    avail: u64,
) -> Micros {
    let w = window / 1000;
    if count <= avail {
        // Within this window, once the previous window's weight has shrunk:
        // ceil(previous × (w − e) / w) ≤ avail − count.
        let e = w - ((avail - count) * w) / previous;
        start + e * 1000
    } else {
        // In the next window, where this window's count is the previous one.
        let e = w - (avail * w) / count;
        start + window + e * 1000
    }
}

/// Time until the window (ending at `end`) forgets everything counted so
/// far.
fn reset_after(
    sliding: bool,
    end: Micros,
    window: Micros,
    count: u64,
    previous: u64,
    now: Micros,
) -> Micros {
    match (sliding, count, previous) {
        (false, 0, _) | (true, 0, 0) => 0,
        (false, _, _) | (true, 0, _) => end - now,
        (true, _, _) => end + window - now,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{Rate, RateUnit};
    use proptest::prelude::*;

    const MIN: Micros = 60_000_000;
    /// A minute boundary.
    const T0: Micros = 1_700_000_040_000_000;

    fn limit(algorithm: Algorithm, count: u64) -> Limit {
        Limit::window(
            algorithm,
            Rate {
                count,
                unit: RateUnit::Minute,
            },
        )
        .unwrap()
    }

    #[test]
    fn a_state_means_nothing_once_its_windows_are_over() {
        // A fixed window's count matters until its window ends; a sliding
        // window's until the next window ends too (it is weighed there).
        for (algorithm, idle) in [
            (Algorithm::FixedWindow, T0 + MIN),
            (Algorithm::SlidingWindow, T0 + 2 * MIN),
        ] {
            let (v, state) = decide(None, &limit(algorithm, 3), 1, T0 + 5).unwrap();
            assert_eq!((state.start, state.count, state.idle_at), (T0, 1, idle));
            // Everything counted is forgotten then.
            assert_eq!(v.reset_after, idle - (T0 + 5));
        }
    }

    #[test]
    fn a_charge_is_counted_in_the_state_it_leaves() {
        let l = limit(Algorithm::FixedWindow, 3);
        let (v, state) = charge(None, &l, 2, T0 + 5);
        assert_eq!((v.remaining, state.count), (1, 2));
        let (v, _) = decide(Some(state), &l, 1, T0 + 6).unwrap();
        assert!(v.allowed);
        assert_eq!(v.remaining, 0);
    }

    #[test]
    fn a_refund_uncounts_from_the_window_that_charged_it_while_it_counts() {
        // 10 a minute, sliding. 6 charged in the first window; half-way
        // through the next one they weigh 3.
        let l = limit(Algorithm::SlidingWindow, 10);
        let (_, state) = charge(None, &l, 6, T0 + 5);
        let half = T0 + MIN + MIN / 2;
        let (v, _) = charge(Some(state), &l, 0, half);
        assert_eq!(v.remaining, 7);
        // Refunding 4 of them leaves 2, weighing 1.
        let (v, after) = refund(Some(state), &l, 4, T0 + 5, half);
        assert_eq!((after.previous, v.remaining), (2, 9));
        // A charge from two windows back is forgotten already: nothing to
        // take back from the previous window's count.
        let (v, after) = refund(Some(state), &l, 4, T0 - MIN + 5, half);
        assert_eq!((after.previous, v.remaining), (6, 7));
        // A fixed window forgets a window once it is over.
        let fixed = limit(Algorithm::FixedWindow, 10);
        let (_, state) = charge(None, &fixed, 6, T0 + 5);
        let (_, state) = charge(Some(state), &fixed, 1, T0 + MIN + 5);
        let (v, after) = refund(Some(state), &fixed, 4, T0 + 5, T0 + MIN + 6);
        assert_eq!((after.count, v.remaining), (1, 9));
    }

    #[test]
    fn fixed_window_counts_per_aligned_window() {
        assert_eq!(T0 % MIN, 0);
        let l = limit(Algorithm::FixedWindow, 3);
        let mut state = None;
        for left in [2, 1, 0] {
            let (v, s) = decide(state, &l, 1, T0 + 10_000_000).unwrap();
            assert!(v.allowed);
            assert_eq!(v.remaining, left);
            assert_eq!(v.reset_after, 50_000_000);
            state = Some(s);
        }
        let (v, s) = decide(state, &l, 1, T0 + 59_000_000).unwrap();
        assert!(!v.allowed);
        assert_eq!(
            (v.remaining, v.retry_after, v.reset_after),
            (0, 1_000_000, 1_000_000)
        );
        assert_eq!(Some(s), state, "a rejection spends nothing");
        // The next minute starts over.
        let (v, _) = decide(state, &l, 3, T0 + MIN).unwrap();
        assert_eq!((v.allowed, v.remaining), (true, 0));
        // A clock stepping back into the previous minute does not reset it.
        let (v, _) = decide(state, &l, 1, T0 - 1).unwrap();
        assert!(!v.allowed);
    }

    #[test]
    fn sliding_window_weighs_the_previous_window() {
        let l = limit(Algorithm::SlidingWindow, 10);
        let (_, s) = decide(None, &l, 10, T0 + 30_000_000).unwrap();
        // 15 s into the next minute, 75% of the previous 10 still count: 8 (rounded up).
        let now = T0 + MIN + 15_000_000;
        let (v, _) = decide(Some(s), &l, 2, now).unwrap();
        assert!(v.allowed);
        assert_eq!(v.remaining, 0);
        let (v, _) = decide(Some(s), &l, 3, now).unwrap();
        assert!(!v.allowed);
        assert_eq!(v.remaining, 2);
        // Three fit once the weight is down to 7, ceil(10 × (60 − e) / 60) = 7:
        // at e = 18 s, 3 s from now.
        assert_eq!(v.retry_after, 3_000_000);
        let (later, _) = decide(Some(s), &l, 3, now + v.retry_after).unwrap();
        assert!(later.allowed);
        let (early, _) = decide(Some(s), &l, 3, now + v.retry_after - 1_000).unwrap();
        assert!(!early.allowed);
    }

    /// A quota of 3 over the period [P0, P1), then [P1, P2).
    const P0: Micros = 1_700_000_000_000_000;
    const P1: Micros = P0 + 31 * 86_400_000_000;
    const P2: Micros = P1 + 30 * 86_400_000_000;

    fn quota(count: u64, start: Micros, end: Micros) -> Limit {
        Limit::quota(count, super::super::calendar::Bounds { start, end }).unwrap()
    }

    #[test]
    fn a_quota_counts_in_its_period_and_refuses_until_the_next() {
        let march = quota(3, P0, P1);
        let (v, s) = decide(None, &march, 2, P0 + 5).unwrap();
        assert_eq!(
            (v.allowed, v.remaining, v.reset_after),
            (true, 1, P1 - P0 - 5)
        );
        assert_eq!((s.start, s.count, quota_end(s)), (P0, 2, P1));
        // Kept one more period's length, for the ledger to read.
        assert_eq!(s.idle_at, P1 + (P1 - P0));
        let (v, s) = decide(Some(s), &march, 1, P1 - 10).unwrap();
        assert_eq!((v.allowed, v.remaining), (true, 0));
        // Refused: exactly until the period ends, spending nothing.
        let (v, same) = decide(Some(s), &march, 1, P1 - 10).unwrap();
        assert_eq!((v.allowed, v.retry_after, v.reset_after), (false, 10, 10));
        assert_eq!(same, s);
        // The next period starts over, at its first instant.
        let april = quota(3, P1, P2);
        let (v, s) = decide(Some(s), &april, 3, P1).unwrap();
        assert_eq!((v.allowed, v.remaining), (true, 0));
        assert_eq!((s.start, quota_end(s)), (P1, P2));
    }

    #[test]
    fn a_later_period_already_stored_is_counted_in_and_never_reset() {
        let (_, april_state) = decide(None, &quota(3, P1, P2), 3, P1 + 1).unwrap();
        // An instance whose clock is behind still names March: counted in
        // April, refused until April ends.
        let (v, s) = decide(Some(april_state), &quota(3, P0, P1), 1, P1 - 5).unwrap();
        assert!(!v.allowed);
        assert_eq!(v.retry_after, P2 - P1);
        assert_eq!(s, april_state);
    }

    #[test]
    fn a_quota_takes_an_instant_outside_its_period_as_the_nearest_inside() {
        let march = quota(1, P0, P1);
        let (_, s) = decide(None, &march, 1, P0).unwrap();
        // The store's clock behind the period: the wait is the whole period.
        let (v, _) = decide(Some(s), &march, 1, P0 - 7).unwrap();
        assert_eq!(v.retry_after, P1 - P0);
        // Ahead of it: one microsecond, never zero.
        let (v, _) = decide(Some(s), &march, 1, P1 + 7).unwrap();
        assert_eq!((v.allowed, v.retry_after), (false, 1));
    }

    #[test]
    fn a_quota_refund_uncounts_only_in_the_period_that_charged_it() {
        let march = quota(10, P0, P1);
        let (_, s) = charge(None, &march, 6, P0 + 5);
        let (v, after) = refund(Some(s), &march, 4, P0 + 5, P0 + 9);
        assert_eq!((after.count, v.remaining), (2, 8));
        // Charged in March, refunded in April: April's count stays.
        let april = quota(10, P1, P2);
        let (_, s) = charge(Some(after), &april, 5, P1 + 1);
        let (v, after) = refund(Some(s), &april, 4, P0 + 5, P1 + 2);
        assert_eq!((after.count, v.remaining), (5, 5));
        // With debt, a charge past the quota is counted up to the floor.
        let deep = quota(10, P0, P1).with_debt(5).unwrap();
        let (v, s) = charge(None, &deep, 17, P0 + 1);
        assert_eq!((s.count, v.forgiven, v.debt, v.remaining), (15, 2, 5, 0));
        let (v, _) = decide(Some(s), &deep, 1, P0 + 2).unwrap();
        assert_eq!((v.allowed, v.retry_after), (false, P1 - P0 - 2));
    }

    #[test]
    fn window_limits_validate() {
        let r = |count, unit| Rate { count, unit };
        assert!(Limit::window(Algorithm::FixedWindow, r(0, RateUnit::Second)).is_err());
        assert!(Limit::window(Algorithm::SlidingWindow, r(1_000_000, RateUnit::Year)).is_err());
        assert!(Limit::window(Algorithm::SlidingWindow, r(1_000_000, RateUnit::Day)).is_ok());
    }

    fn arb_limit() -> impl Strategy<Value = Limit> {
        (
            prop_oneof![Just(Algorithm::FixedWindow), Just(Algorithm::SlidingWindow)],
            1u64..20,
            prop_oneof![Just(RateUnit::Second), Just(RateUnit::Minute)],
        )
            .prop_map(|(a, count, unit)| Limit::window(a, Rate { count, unit }).unwrap())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Over the days of a billing cycle in New York (a DST change
        /// among them): never more than the quota admitted in a day, a
        /// refusal's wait ends exactly where the next day starts, and the
        /// same request is admitted there.
        #[test]
        fn a_quota_admits_at_most_its_count_per_period(
            count in 1u64..8,
            steps in prop::collection::vec((0u64..7_200_000_000, 1u64..4), 1..200),
        ) {
            use super::super::calendar::{Cycle, Period};
            let cycle = Cycle::new("America/New_York", 1, 1, "monday").unwrap();
            // 2026-03-06T00:00Z: the spring change is two days on.
            let mut now: Micros = 1_772_755_200_000_000;
            let mut state: Option<WindowState> = None;
            let mut admitted: Vec<(Micros, u64)> = Vec::new();
            for (dt, cost) in steps {
                now += dt;
                let cost = cost.min(count);
                let bounds = cycle.bounds(Period::Day, now);
                let limit = quota(count, bounds.start, bounds.end);
                let (v, s) = decide(state, &limit, cost, now).unwrap();
                if v.allowed {
                    state = Some(s);
                    admitted.push((bounds.start, cost));
                } else {
                    prop_assert_eq!(now + v.retry_after, bounds.end);
                    let next = cycle.bounds(Period::Day, bounds.end);
                    let (later, _) = decide(state, &quota(count, next.start, next.end), cost, bounds.end).unwrap();
                    prop_assert!(later.allowed);
                }
            }
            for &(start, _) in &admitted {
                let in_period: u64 = admitted.iter().filter(|(s, _)| *s == start).map(|(_, c)| c).sum();
                prop_assert!(in_period <= count);
            }
        }

        /// Retry-after is exact: at `retry_after` the same request passes, a
        /// millisecond earlier it does not (whole-ms weighting).
        #[test]
        fn retry_after_is_honest(
            limit in arb_limit(),
            steps in prop::collection::vec((0u64..3_000_000, 1u64..20), 1..60),
        ) {
            let mut now = T0;
            let mut state = None;
            for (dt, cost) in steps {
                now += dt;
                let cost = cost.min(limit.burst());
                let (v, s) = decide(state, &limit, cost, now).unwrap();
                if v.allowed {
                    state = Some(s);
                } else {
                    prop_assert!(v.retry_after > 0);
                    let (later, _) = decide(state, &limit, cost, now + v.retry_after).unwrap();
                    prop_assert!(later.allowed, "not allowed after retry_after {}", v.retry_after);
                    if v.retry_after > 1_000 {
                        let (early, _) = decide(state, &limit, cost, now + v.retry_after - 1_000).unwrap();
                        prop_assert!(!early.allowed);
                    }
                }
            }
        }

        /// A fixed window never admits more than its limit per window; a
        /// sliding window never more than twice its limit in any window
        /// length (and its estimate never exceeds the limit).
        #[test]
        fn never_over_the_limit_in_a_window(
            limit in arb_limit(),
            steps in prop::collection::vec((0u64..2_000_000, 1u64..5), 1..200),
        ) {
            let mut now = T0;
            let mut state: Option<WindowState> = None;
            let mut admitted: Vec<(Micros, u64)> = Vec::new();
            for (dt, cost) in steps {
                now += dt;
                let cost = cost.min(limit.burst());
                let (v, s) = decide(state, &limit, cost, now).unwrap();
                if v.allowed {
                    state = Some(s);
                    admitted.push((now, cost));
                }
            }
            let w = limit.interval();
            for &(t, _) in &admitted {
                let start = t - t % w;
                let in_window: u64 = admitted.iter().filter(|(u, _)| *u >= start && *u < start + w).map(|(_, c)| c).sum();
                prop_assert!(in_window <= limit.burst());
                let sliding: u64 = admitted.iter().filter(|(u, _)| *u + w > t && *u <= t).map(|(_, c)| c).sum();
                prop_assert!(sliding <= 2 * limit.burst());
            }
        }

        /// A window with debt: a charge counts exactly what it reports as
        /// applied (cost − forgiven), never past `limit + debt` in use; a
        /// refund of tokens charged in this window uncounts them; and while
        /// over the limit, `retry_after` is exact (to the millisecond).
        #[test]
        fn charges_count_once_up_to_the_debt_floor(
            limit in arb_limit(),
            debt in 0u64..40,
            steps in prop::collection::vec((0u64..3_000_000, 0u64..3, 0u64..60), 1..80),
        ) {
            let limit = limit.with_debt(debt).unwrap();
            let mut now = T0;
            let mut state: Option<WindowState> = None;
            for (dt, kind, amount) in steps {
                now += dt;
                let used = |s: Option<WindowState>, now| {
                    let (v, _) = decide_need(s, &limit, 0, 0, now).unwrap();
                    (limit.burst() + v.debt).saturating_sub(v.remaining)
                };
                let before = used(state, now);
                let count_before = Counts::at(state, &limit, now).count;
                match kind {
                    0 => {
                        let (v, next) = charge(state, &limit, amount, now);
                        let counted = next.count - count_before;
                        prop_assert_eq!(counted + v.forgiven, amount);
                        prop_assert!(used(Some(next), now) <= (limit.burst() + debt).max(before));
                        state = Some(next);
                    }
                    1 => {
                        let (_, next) = refund(state, &limit, amount, now, now);
                        prop_assert_eq!(next.count, count_before.saturating_sub(amount));
                        state = Some(next);
                    }
                    _ => {
                        let need = 1 + amount % limit.burst();
                        let (v, next) = decide(state, &limit, need, now).unwrap();
                        if v.allowed {
                            state = Some(next);
                        } else {
                            let (later, _) = decide(state, &limit, need, now + v.retry_after).unwrap();
                            prop_assert!(later.allowed);
                            if v.retry_after > 1_000 {
                                let (early, _) = decide(state, &limit, need, now + v.retry_after - 1_000).unwrap();
                                prop_assert!(!early.allowed);
                            }
                        }
                    }
                }
            }
        }
    }
}
