//! The algorithms: pure functions of (state, limit, cost, now).
//!
//! No clock reads, no I/O: the caller reads the clock once and passes `now`.
//! Everything is integer microseconds, so the same arithmetic gives the same
//! answer in Redis's Lua (`lua/token_bucket.lua`).
//!
//! - [`token_bucket`]: the token bucket (GCRA), the default;
//! - [`window`]: fixed and sliding windows (envoyproxy/ratelimit's);
//! - [`plan()`]: several buckets decided together, all or nothing.
//!
//! This file holds the shared vocabulary: rates, limits, verdicts, charges,
//! and the [`Op`]s a set of charges can be applied with.
//!
//! ```
//! use tollgate_core::algorithm::{Limit, token_bucket};
//!
//! // 600 a minute with bursts of 30: one token every 100 ms.
//! let limit = Limit::new(30, "600/minute".parse().unwrap()).unwrap();
//! let mut state = None;
//! for _ in 0..30 {
//!     let (verdict, next) = token_bucket::decide(state, &limit, 1, 0).unwrap();
//!     assert!(verdict.allowed);
//!     state = Some(next);
//! }
//! // The 31st at the same instant waits exactly one refill interval...
//! let (refused, _) = token_bucket::decide(state, &limit, 1, 0).unwrap();
//! assert!(!refused.allowed);
//! assert_eq!(refused.retry_after, 100_000);
//! // ...and is admitted once it has passed, not a microsecond sooner.
//! let (early, _) = token_bucket::decide(state, &limit, 1, 99_999).unwrap();
//! assert!(!early.allowed);
//! let (on_time, _) = token_bucket::decide(state, &limit, 1, 100_000).unwrap();
//! assert!(on_time.allowed);
//! ```
//!
//! ## Debt
//!
//! A limit may allow debt ([`Limit::with_debt`]): usage charged after the
//! fact ([`Op::Charge`]) is applied in full even when the bucket holds less,
//! so its balance goes below zero, down to a floor of `-debt` tokens. A
//! decision still needs the bucket to hold what the request needs, so while
//! the balance is below that every request waits, for exactly as long as the
//! refill takes to cover it. A charge past the floor is not applied: the
//! part beyond it is reported as forgiven, so every token charged is either
//! in the balance or reported, never silently lost.

use std::fmt;
use std::time::Duration;

pub use crate::clock::Micros;

/// The largest concurrency cap: a million leases held at once.
pub const MAX_CONCURRENCY: u64 = 1_000_000;

/// Costs are clamped here: above every capacity (a capacity is below 2^53,
/// see [`MAX_TOLERANCE`]), and exact in Lua's doubles.
pub const MAX_COST: u64 = 1 << 53;

/// The largest time a bucket may take to refill from empty: about 100 years.
/// Keeps every instant below 2^53 µs so Lua's doubles hold it exactly.
pub const MAX_TOLERANCE: Micros = 100 * 365 * 86_400 * 1_000_000;

/// The unit of a rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum RateUnit {
    /// Per second (the default).
    #[default]
    Second,
    /// Per minute.
    Minute,
    /// Per hour.
    Hour,
    /// Per day.
    Day,
    /// Per week (7 days).
    Week,
    /// Per month (30 days, as envoyproxy/ratelimit counts it).
    Month,
    /// Per year (365 days).
    Year,
}

impl RateUnit {
    /// The unit's length in microseconds.
    pub const fn micros(self) -> Micros {
        match self {
            Self::Second => 1_000_000,
            Self::Minute => 60_000_000,
            Self::Hour => 3_600_000_000,
            Self::Day => 86_400_000_000,
            Self::Week => 7 * 86_400_000_000,
            Self::Month => 30 * 86_400_000_000,
            Self::Year => 365 * 86_400_000_000,
        }
    }

    /// The unit's name as written in the limits table.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Second => "second",
            Self::Minute => "minute",
            Self::Hour => "hour",
            Self::Day => "day",
            Self::Week => "week",
            Self::Month => "month",
            Self::Year => "year",
        }
    }

    /// Parses `second`, `minute`, `hour`, `day`, `week`, `month` or `year`
    /// (also `s`, `m`, `h`, `d`, `w`, `y` and plurals).
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s.trim().to_ascii_lowercase().as_str() {
            "s" | "sec" | "second" | "seconds" => Self::Second,
            "m" | "min" | "minute" | "minutes" => Self::Minute,
            "h" | "hour" | "hours" => Self::Hour,
            "d" | "day" | "days" => Self::Day,
            "w" | "week" | "weeks" => Self::Week,
            "month" | "months" => Self::Month,
            "y" | "year" | "years" => Self::Year,
            _ => return None,
        })
    }
}

/// A sustained rate: `count` tokens per `unit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rate {
    /// Tokens per unit; at least 1.
    pub count: u64,
    /// The unit.
    pub unit: RateUnit,
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.count, self.unit.as_str())
    }
}

impl std::str::FromStr for Rate {
    type Err = String;

    /// Parses `N/unit`, for example `600/minute`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (count, unit) = s
            .split_once('/')
            .ok_or_else(|| format!("rate {s:?} must look like N/unit, for example 600/minute"))?;
        let count = count
            .trim()
            .parse::<u64>()
            .map_err(|_| format!("rate {s:?}: {count:?} is not a whole number"))?;
        let unit = RateUnit::parse(unit).ok_or_else(|| {
            format!(
                "rate {s:?}: unit {unit:?} must be second, minute, hour, day, week, month or year"
            )
        })?;
        Ok(Self { count, unit })
    }
}

/// Why a burst and rate do not make a usable limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    /// Burst is zero.
    #[error("burst must be at least 1")]
    ZeroBurst,
    /// Rate is zero.
    #[error("rate must be at least 1 per unit")]
    ZeroRate,
    /// More than one token per microsecond.
    #[error("rate {0} is finer than one token per microsecond; at most 1000000/second")]
    TooFast(Rate),
    /// Refilling from empty would take longer than [`MAX_TOLERANCE`].
    #[error(
        "burst {burst} at {rate} takes more than 100 years to refill; lower the burst or raise the rate"
    )]
    TooSlow {
        /// The burst.
        burst: u64,
        /// The rate.
        rate: Rate,
    },
    /// Refilling from the debt floor would take longer than
    /// [`MAX_TOLERANCE`] (a sliding window: its weighting would lose
    /// precision).
    #[error("a debt of {debt} below a burst of {burst} takes too long to refill; lower the debt")]
    DebtTooLarge {
        /// The burst.
        burst: u64,
        /// The debt asked for.
        debt: u64,
    },
    /// A quota above [`MAX_TOLERANCE`] per period (counts stay exact in
    /// Lua).
    #[error("a quota of {0} per period is above the largest, {max}; lower it", max = MAX_TOLERANCE)]
    QuotaTooLarge(u64),
}

/// How a limit counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// A token bucket: bursts up to the capacity, refilled continuously.
    #[default]
    TokenBucket,
    /// A counter per calendar-aligned window (envoyproxy/ratelimit's).
    FixedWindow,
    /// The sliding-window counter: this window's count plus the previous
    /// window's, weighted by how much of it still overlaps.
    SlidingWindow,
    /// A concurrency cap: at most `burst` leases held at once
    /// ([`concurrency`]).
    Concurrency,
    /// A quota: a count per calendar period of a tenant's billing cycle
    /// ([`calendar`]), counted like a fixed window over the period the
    /// caller names ([`Limit::quota`]).
    Quota,
}

impl Algorithm {
    /// As written in configuration.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::TokenBucket => "token_bucket",
            Self::FixedWindow => "fixed_window",
            Self::SlidingWindow => "sliding_window",
            Self::Concurrency => "concurrency",
            Self::Quota => "quota",
        }
    }

    /// Parses `token_bucket`, `fixed_window`, `sliding_window`,
    /// `concurrency` or `quota`.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "token_bucket" => Self::TokenBucket,
            "fixed_window" => Self::FixedWindow,
            "sliding_window" => Self::SlidingWindow,
            "concurrency" => Self::Concurrency,
            "quota" => Self::Quota,
            _ => return None,
        })
    }
}

/// A validated limit: for a token bucket its capacity and refill interval;
/// for a window its request count and window length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limit {
    algorithm: Algorithm,
    /// Token bucket: capacity. Windows: requests per window.
    burst: u64,
    /// Token bucket: time to refill one token. Windows: the window length.
    /// Quotas: the period's length.
    interval: Micros,
    /// How many tokens the balance may go below zero through charges made
    /// after the fact (0: none).
    debt: u64,
    /// Quotas: the period's first instant (0 for every other algorithm).
    start: Micros,
    /// Quotas: the thresholds whose crossing is journaled.
    alerts: alerts::Alerts,
}

impl Limit {
    /// A bucket of `burst` tokens refilling at `rate`.
    pub fn new(burst: u64, rate: Rate) -> Result<Self, LimitError> {
        if burst == 0 {
            return Err(LimitError::ZeroBurst);
        }
        if rate.count == 0 {
            return Err(LimitError::ZeroRate);
        }
        if rate.count > rate.unit.micros() {
            return Err(LimitError::TooFast(rate));
        }
        let interval = rate.unit.micros().div_ceil(rate.count);
        match burst.checked_mul(interval) {
            Some(tolerance) if tolerance <= MAX_TOLERANCE => Ok(Self {
                algorithm: Algorithm::TokenBucket,
                burst,
                interval,
                debt: 0,
                start: 0,
                alerts: alerts::Alerts::NONE,
            }),
            _ => Err(LimitError::TooSlow { burst, rate }),
        }
    }

    /// A fixed or sliding window allowing `rate.count` per `rate.unit`.
    /// (For [`Algorithm::TokenBucket`] this is a bucket whose burst is the
    /// rate's count.)
    pub fn window(algorithm: Algorithm, rate: Rate) -> Result<Self, LimitError> {
        if rate.count == 0 {
            return Err(LimitError::ZeroRate);
        }
        if algorithm == Algorithm::TokenBucket {
            return Self::new(rate.count, rate);
        }
        // The sliding window weighs counts by milliseconds: keep
        // count × window-in-ms exact in a double. A fixed window only
        // counts, so any count up to the caps is exact.
        if algorithm == Algorithm::SlidingWindow
            && rate.count.saturating_mul(rate.unit.micros() / 1000) > window::MAX_WEIGHT
        {
            return Err(LimitError::TooSlow {
                burst: rate.count,
                rate,
            });
        }
        Ok(Self {
            algorithm,
            burst: rate.count,
            interval: rate.unit.micros(),
            debt: 0,
            start: 0,
            alerts: alerts::Alerts::NONE,
        })
    }

    /// A quota of `count` per period, for the period `bounds` (from
    /// [`calendar::Cycle::bounds`]): counted like a fixed window that starts
    /// and ends where the period does.
    pub fn quota(count: u64, bounds: calendar::Bounds) -> Result<Self, LimitError> {
        if count == 0 {
            return Err(LimitError::ZeroRate);
        }
        if count > MAX_TOLERANCE {
            return Err(LimitError::QuotaTooLarge(count));
        }
        Ok(Self {
            algorithm: Algorithm::Quota,
            burst: count,
            interval: bounds.end.saturating_sub(bounds.start).max(1),
            debt: 0,
            start: bounds.start,
            alerts: alerts::Alerts::NONE,
        })
    }

    /// This quota for the period `bounds` (any other limit unchanged).
    pub fn in_period(self, bounds: calendar::Bounds) -> Self {
        if self.algorithm != Algorithm::Quota {
            return self;
        }
        Self {
            interval: bounds.end.saturating_sub(bounds.start).max(1),
            start: bounds.start,
            ..self
        }
    }

    /// This quota with alert `thresholds` (nothing for other algorithms:
    /// only quotas count towards a fixed amount per period).
    pub fn with_alerts(self, thresholds: alerts::Alerts) -> Self {
        if self.algorithm != Algorithm::Quota {
            return self;
        }
        Self {
            alerts: thresholds,
            ..self
        }
    }

    /// A quota's alert thresholds.
    pub fn alerts(&self) -> alerts::Alerts {
        self.alerts
    }

    /// A concurrency cap: at most `cap` leases held at once.
    pub fn concurrency(cap: u64) -> Result<Self, LimitError> {
        if cap == 0 {
            return Err(LimitError::ZeroBurst);
        }
        Ok(Self {
            algorithm: Algorithm::Concurrency,
            burst: cap.min(MAX_CONCURRENCY),
            interval: 1,
            debt: 0,
            start: 0,
            alerts: alerts::Alerts::NONE,
        })
    }

    /// True for a concurrency cap.
    pub fn is_concurrency(&self) -> bool {
        self.algorithm == Algorithm::Concurrency
    }

    /// This limit, allowing the balance to go `debt` tokens below zero
    /// through charges made after the fact. Refused when refilling from the
    /// floor would take longer than [`MAX_TOLERANCE`] (a sliding window:
    /// when `(burst + debt) × window-in-ms` passes [`window::MAX_WEIGHT`]).
    pub fn with_debt(self, debt: u64) -> Result<Self, LimitError> {
        let too_large = LimitError::DebtTooLarge {
            burst: self.burst,
            debt,
        };
        let depth = self.burst.checked_add(debt).ok_or(too_large.clone())?;
        let fits = match self.algorithm {
            Algorithm::TokenBucket => depth
                .checked_mul(self.interval)
                .is_some_and(|t| t <= MAX_TOLERANCE),
            Algorithm::SlidingWindow => {
                depth.saturating_mul(self.interval / 1000) <= window::MAX_WEIGHT
            }
            Algorithm::FixedWindow | Algorithm::Quota => depth <= MAX_TOLERANCE,
            Algorithm::Concurrency => debt == 0,
        };
        if !fits {
            return Err(too_large);
        }
        Ok(Self { debt, ..self })
    }

    /// A fixed window of one per `window` µs, for a limit of zero: charged
    /// with a cost above its capacity, it never admits.
    pub fn blocking(window: Micros) -> Self {
        Self {
            algorithm: Algorithm::FixedWindow,
            burst: 1,
            interval: window.clamp(1_000_000, MAX_TOLERANCE),
            debt: 0,
            start: 0,
            alerts: alerts::Alerts::NONE,
        }
    }

    /// How this limit counts.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// Capacity in tokens (windows: requests per window).
    pub fn burst(&self) -> u64 {
        self.burst
    }

    /// Microseconds to refill one token (windows: the window length).
    pub fn interval(&self) -> Micros {
        self.interval
    }

    /// Tokens the balance may go below zero (0: no debt).
    pub fn debt(&self) -> u64 {
        self.debt
    }

    /// A quota's period: its first instant and the first of the next one
    /// (`None` for every other algorithm).
    pub fn period(&self) -> Option<calendar::Bounds> {
        (self.algorithm == Algorithm::Quota).then_some(calendar::Bounds {
            start: self.start,
            end: self.start + self.interval,
        })
    }

    /// The largest time a token bucket may take to be full again: from
    /// the debt floor, `(burst + debt) × interval`.
    pub fn floor(&self) -> Micros {
        (self.burst + self.debt) * self.interval
    }

    /// Microseconds to refill an empty bucket (windows: the window length).
    pub fn tolerance(&self) -> Micros {
        match self.algorithm {
            Algorithm::TokenBucket => self.burst * self.interval,
            _ => self.interval,
        }
    }

    /// This limit shrunk to `fraction` (0 < fraction < 1) of its burst and
    /// rate, rounding the burst up to at least 1 and the interval up; any
    /// other fraction leaves it unchanged. Used by the local fallback, where
    /// each instance may hold only its share of a shared limit.
    pub fn scaled(&self, fraction: f64) -> Self {
        if !(fraction > 0.0 && fraction < 1.0) {
            return *self;
        }
        let burst = ((self.burst as f64 * fraction).ceil() as u64).max(1);
        let debt = (self.debt as f64 * fraction).ceil() as u64;
        if self.algorithm != Algorithm::TokenBucket {
            return Self {
                burst,
                debt,
                ..*self
            };
        }
        let interval = ((self.interval as f64 / fraction).ceil() as u64)
            .clamp(1, MAX_TOLERANCE / (burst + debt));
        Self {
            algorithm: self.algorithm,
            burst,
            interval,
            debt,
            start: self.start,
            alerts: self.alerts,
        }
    }
}

/// The answer for one bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// The bucket admits the cost.
    pub allowed: bool,
    /// Whole tokens left (after the spend when allowed); 0 in debt.
    pub remaining: u64,
    /// Tokens the balance is below zero, rounded up (0: not in debt).
    pub debt: u64,
    /// [`Op::Charge`] only: tokens of the charge not applied because the
    /// balance reached the limit's debt floor.
    pub forgiven: u64,
    /// Zero when allowed; otherwise the exact wait until the same cost fits.
    pub retry_after: Micros,
    /// Time until the bucket is full again.
    pub reset_after: Micros,
}

impl Verdict {
    /// An admission that reports nothing held: every figure zero.
    pub const fn admitted() -> Self {
        Self {
            allowed: true,
            remaining: 0,
            debt: 0,
            forgiven: 0,
            retry_after: 0,
            reset_after: 0,
        }
    }

    /// `retry_after` as a [`Duration`].
    pub fn retry_after(&self) -> Duration {
        Duration::from_micros(self.retry_after)
    }

    /// `reset_after` as a [`Duration`].
    pub fn reset_after(&self) -> Duration {
        Duration::from_micros(self.reset_after)
    }
}

/// A cost that no amount of waiting lets through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("cost {cost} exceeds the bucket's capacity of {burst}")]
pub struct CostExceedsBurst {
    /// The cost asked for.
    pub cost: u64,
    /// The bucket's capacity.
    pub burst: u64,
}

/// What a store keeps per bucket, for any algorithm. No state means a full
/// bucket or an empty window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// A token bucket's state.
    Tokens(BucketState),
    /// A fixed or sliding window's state.
    Window(window::WindowState),
    /// A lease set's occupancy (the store holds the set itself).
    Leases(concurrency::Occupancy),
}

impl State {
    /// The instant from which this state means the same as no state, so it
    /// can be dropped.
    pub fn idle_at(&self) -> Micros {
        match self {
            Self::Tokens(s) => s.full_at,
            Self::Window(w) => w.idle_at,
            Self::Leases(o) => o.all_free_at,
        }
    }

    /// True when the state can be dropped at `now`.
    pub fn is_idle(&self, now: Micros) -> bool {
        self.idle_at() <= now
    }
}

/// One bucket's part in a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Charge {
    /// The bucket's shape.
    pub limit: Limit,
    /// Tokens to spend (for [`Op::Charge`], to charge; for
    /// [`Op::Refund`], to give back).
    pub cost: u64,
    /// Tokens the bucket must hold for a decision to admit: at least
    /// `cost`; more to ask whether a request could go ahead while spending
    /// less (an ask without spending: cost 0, need 1).
    pub need: u64,
    /// False for shadow-mode rules: they are evaluated and charged when they
    /// admit, but never cause a rejection.
    pub enforce: bool,
}

impl Charge {
    /// A charge of `cost` tokens that needs `cost`, enforced.
    pub fn new(limit: Limit, cost: u64) -> Self {
        Self {
            limit,
            cost,
            need: cost,
            enforce: true,
        }
    }
}

/// How a set of charges is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Decide: admitted when every enforced bucket holds what it needs;
    /// then, when `spend`, every admitting bucket is charged. All or
    /// nothing.
    Decide {
        /// False for a dry run.
        spend: bool,
    },
    /// Charge usage after the fact, unconditionally: every bucket is
    /// charged in full, into debt down to its floor.
    Charge,
    /// Give back tokens charged by a decision made at `since` (a settled
    /// reservation that used less than its estimate): a token bucket gets
    /// them back at once, never above its capacity; a window only while
    /// the window charged at `since` still counts.
    Refund {
        /// When the tokens were charged.
        since: Micros,
    },
    /// Decide and spend like [`Op::SPEND`] and, when admitted, take a
    /// lease that expires `ttl` µs from now in every admitting concurrency
    /// cap: tokens and slots, all or nothing.
    Acquire {
        /// The lease's time to live.
        ttl: Micros,
    },
}

impl Op {
    /// A decision that spends.
    pub const SPEND: Self = Self::Decide { spend: true };
    /// A dry run.
    pub const DRY: Self = Self::Decide { spend: false };

    /// True when the op may write.
    pub fn writes(self) -> bool {
        !matches!(self, Self::Decide { spend: false })
    }

    /// True for an op that decides (admits or refuses): a decision or an
    /// acquire.
    pub fn decides(self) -> bool {
        matches!(self, Self::Decide { .. } | Self::Acquire { .. })
    }

    /// True for an op that spends what it admits.
    pub fn spends(self) -> bool {
        matches!(self, Self::Decide { spend: true } | Self::Acquire { .. })
    }
}

pub mod alerts;
pub mod calendar;
pub mod concurrency;
pub mod plan;
pub mod slice;
pub mod token_bucket;
pub mod window;

pub use plan::{Plan, apply_any, current, decide_any, plan};
pub use token_bucket::{BucketState, decide};

#[cfg(test)]
mod tests;
