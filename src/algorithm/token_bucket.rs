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

    /// True when the bucket is full at `now`: it is then indistinguishable
    /// from a bucket that was never used and may be dropped.
    pub fn is_full(&self, now: Micros) -> bool {
        self.full_at <= now
    }
}

/// The bucket's debt at `now`, carried over from `state` into `limit`'s terms.
///
/// The stored instant is never moved backwards, so a clock that steps back
/// sees a larger debt (fewer tokens), never a smaller one. When the limit has
/// changed since the state was written, the debt is converted in tokens (the
/// spent tokens stay spent) and clamped to the new capacity.
fn debt(state: Option<BucketState>, limit: &Limit, now: Micros) -> Micros {
    let Some(state) = state else { return 0 };
    let debt = state.full_at.saturating_sub(now);
    if state.interval == limit.interval && state.burst == limit.burst {
        return debt;
    }
    let tokens_owed = debt.div_ceil(state.interval.max(1));
    tokens_owed
        .saturating_mul(limit.interval)
        .min(limit.tolerance())
}

/// Decides whether a bucket admits `cost` tokens at `now`.
///
/// Returns the verdict and the state to store if the cost is spent. A denied
/// request spends nothing: the caller keeps the old state. A cost above the
/// capacity is an error, since it could never be admitted.
pub fn decide(
    state: Option<BucketState>,
    limit: &Limit,
    cost: u64,
    now: Micros,
) -> Result<(Verdict, BucketState), CostExceedsBurst> {
    if cost > limit.burst {
        return Err(CostExceedsBurst {
            cost,
            burst: limit.burst,
        });
    }
    let tolerance = limit.tolerance();
    let debt_now = debt(state, limit, now);
    // cost <= burst, so this is at most the tolerance and cannot overflow.
    let debt_after = debt_now + cost * limit.interval;
    if debt_after <= tolerance {
        let verdict = Verdict {
            allowed: true,
            remaining: (tolerance - debt_after) / limit.interval,
            retry_after: 0,
            reset_after: debt_after,
        };
        let next = BucketState {
            full_at: now + debt_after,
            interval: limit.interval,
            burst: limit.burst,
        };
        Ok((verdict, next))
    } else {
        let verdict = Verdict {
            allowed: false,
            remaining: tolerance.saturating_sub(debt_now) / limit.interval,
            retry_after: debt_after - tolerance,
            reset_after: debt_now,
        };
        Ok((
            verdict,
            state.unwrap_or_else(|| BucketState::full(limit, now)),
        ))
    }
}
