//! The token bucket: a pure function of (state, limit, cost, now).
//!
//! A bucket holds up to `burst` tokens and refills at `rate`, lazily: nothing
//! runs between requests. The state is a single instant, the moment the
//! bucket will be full again (the "theoretical arrival time" of GCRA, which
//! is a token bucket written as one number):
//!
//! ```text
//! interval  = time to refill one token          (unit / rate, rounded up to 1 µs)
//! tolerance = burst × interval                  (time to refill an empty bucket)
//! debt      = max(full_at − now, 0)             (time until full)
//! tokens    = (tolerance − debt) / interval
//! ```
//!
//! Spending `cost` tokens adds `cost × interval` to the debt; the request is
//! admitted when the debt stays within the tolerance. Everything is integer
//! microseconds, so the same arithmetic gives the same answer in Redis's Lua.
//!
//! Rounding the interval up means the sustained rate is at most the nominal
//! rate (never above it): 3000/second refills one token every 334 µs.
//!
//! A limit with debt lets charges made after the fact ([`charge`]) push the
//! debt past the tolerance, up to `floor = (burst + debt) × interval`: the
//! balance is then below zero, and every decision waits until the refill
//! has covered what it needs. [`refund`] gives tokens back.

use super::{CostExceedsBurst, Limit, Micros, Verdict};

/// What a store keeps per bucket. A bucket with no state is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketState {
    /// The instant the bucket is full again.
    pub full_at: Micros,
    /// The refill interval `full_at` was computed with, so that a limit
    /// change converts the debt in tokens, not in time.
    pub interval: Micros,
    /// The capacity the state was written under, so that a smaller burst
    /// clamps the debt.
    pub burst: u64,
}

impl BucketState {
    /// The state of a full bucket at `now` (equivalent to no state).
    pub fn full(limit: &Limit, now: Micros) -> Self {
        Self {
            full_at: now,
            interval: limit.interval,
            burst: limit.burst,
        }
    }
}

/// The bucket's debt at `now` (time until full), carried over from `state`
/// into `limit`'s terms.
///
/// The stored instant is never moved backwards (except by a refund), so a
/// clock that steps back sees a larger debt (fewer tokens), never a smaller
/// one; such a debt may exceed the floor while the clock is behind. When the
/// limit has changed since the state was written, the debt is converted in
/// tokens (the spent tokens stay spent) and clamped to the new floor.
fn debt(state: Option<BucketState>, limit: &Limit, now: Micros) -> Micros {
    let Some(state) = state else { return 0 };
    let debt = state.full_at.saturating_sub(now);
    if state.interval == limit.interval && state.burst == limit.burst {
        return debt;
    }
    let tokens_owed = debt.div_ceil(state.interval.max(1));
    tokens_owed
        .saturating_mul(limit.interval)
        .min(limit.floor())
}

/// A verdict's figures for a debt of `d` µs: whole tokens left, and whole
/// tokens owed below zero (rounded up).
fn balance(limit: &Limit, d: Micros) -> (u64, u64) {
    let tolerance = limit.tolerance();
    if d <= tolerance {
        ((tolerance - d) / limit.interval, 0)
    } else {
        (0, (d - tolerance).div_ceil(limit.interval))
    }
}

fn state_at(limit: &Limit, now: Micros, d: Micros) -> BucketState {
    BucketState {
        full_at: now + d,
        interval: limit.interval,
        burst: limit.burst,
    }
}

/// Decides whether a bucket admits `cost` tokens at `now`: the
/// [`decide_need`] of a request that needs what it spends.
pub fn decide(
    state: Option<BucketState>,
    limit: &Limit,
    cost: u64,
    now: Micros,
) -> Result<(Verdict, BucketState), CostExceedsBurst> {
    decide_need(state, limit, cost, cost, now)
}

/// Decides whether a bucket holding `need` tokens at `now` admits a request
/// spending `cost` (`cost <= need`; an ask without spending has cost 0).
///
/// Returns the verdict and the state to store if the cost is spent. A denied
/// request spends nothing: the caller keeps the old state. A need above the
/// capacity is an error, since it could never be admitted. In debt, the
/// wait is until the refill has covered the debt and the need.
pub fn decide_need(
    state: Option<BucketState>,
    limit: &Limit,
    cost: u64,
    need: u64,
    now: Micros,
) -> Result<(Verdict, BucketState), CostExceedsBurst> {
    let need = need.max(cost);
    if need > limit.burst {
        return Err(CostExceedsBurst {
            cost: need,
            burst: limit.burst,
        });
    }
    let tolerance = limit.tolerance();
    let debt_now = debt(state, limit, now);
    // need <= burst and debt_now <= floor, so none of this can overflow.
    let needed = debt_now + need * limit.interval;
    if needed <= tolerance {
        let debt_after = debt_now + cost * limit.interval;
        let (remaining, _) = balance(limit, debt_after);
        let verdict = Verdict {
            allowed: true,
            remaining,
            debt: 0,
            forgiven: 0,
            retry_after: 0,
            reset_after: debt_after,
        };
        Ok((verdict, state_at(limit, now, debt_after)))
    } else {
        let (remaining, owed) = balance(limit, debt_now);
        let verdict = Verdict {
            allowed: false,
            remaining,
            debt: owed,
            forgiven: 0,
            retry_after: needed - tolerance,
            reset_after: debt_now,
        };
        Ok((
            verdict,
            state.unwrap_or_else(|| BucketState::full(limit, now)),
        ))
    }
}

/// Charges `cost` tokens at `now` whatever the bucket holds: usage reported
/// after the fact. The balance goes down by `cost`, below zero as far as
/// the limit's debt floor; the part of the charge beyond the floor is
/// reported as `forgiven` (whole tokens: the charge applied is `cost −
/// forgiven`, rounded up to a whole token).
pub fn charge(
    state: Option<BucketState>,
    limit: &Limit,
    cost: u64,
    now: Micros,
) -> (Verdict, BucketState) {
    let floor = limit.floor();
    let debt_now = debt(state, limit, now);
    // Past burst + debt + 1 tokens any charge lands on the floor: clamp
    // first so the product stays exact (and within a double in Lua).
    let capped = cost.min(limit.burst + limit.debt + 1);
    // A charge never lowers the debt, not even one seen past the floor
    // through a clock that stepped back.
    let debt_after = (debt_now + capped * limit.interval)
        .min(floor)
        .max(debt_now);
    let applied = (debt_after - debt_now).div_ceil(limit.interval);
    let (remaining, owed) = balance(limit, debt_after);
    let verdict = Verdict {
        allowed: true,
        remaining,
        debt: owed,
        forgiven: cost - applied,
        retry_after: 0,
        reset_after: debt_after,
    };
    (verdict, state_at(limit, now, debt_after))
}

/// Gives `tokens` back to the bucket at `now`, never above its capacity.
pub fn refund(
    state: Option<BucketState>,
    limit: &Limit,
    tokens: u64,
    now: Micros,
) -> (Verdict, BucketState) {
    let debt_now = debt(state, limit, now);
    let capped = tokens.min(limit.burst + limit.debt + 1);
    let debt_after = debt_now.saturating_sub(capped * limit.interval);
    let (remaining, owed) = balance(limit, debt_after);
    let verdict = Verdict {
        allowed: true,
        remaining,
        debt: owed,
        forgiven: 0,
        retry_after: 0,
        reset_after: debt_after,
    };
    (verdict, state_at(limit, now, debt_after))
}
