//! Shares of a limit for data planes that enforce it themselves.
//!
//! A data plane (an Envoy with the `rate_limit_quota` filter) decides its
//! requests locally on an assignment and reports what it allowed and
//! denied. [`Engine::share`] charges what it allowed to the rules' buckets
//! (so every API, and every instance, sees one balance), counts both as
//! decisions, reports its demand to the share table of the tightest rule,
//! and turns the grant into the assignment the data plane enforces next: a
//! token bucket of its share of the rule's rate, holding its share of what
//! the rule's bucket has left.

use smallvec::SmallVec;

use super::{Allowance, Demand, Engine, OnStoreUnavailable};
use crate::algorithm::{Algorithm, Limit, Micros, Op};
use crate::store::ShareAsk;
use crate::store::shares::{MAX_WEIGHT, PPM};
use crate::telemetry::metrics::{self, Outcome};

/// What a data plane did with one bucket since its last report.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Usage {
    /// Requests it allowed (charged to the rules' buckets).
    pub allowed: u64,
    /// Requests it denied.
    pub denied: u64,
    /// Time since its last report (a report over less than a second is
    /// taken as one second: Envoy reports whole seconds).
    pub elapsed: Micros,
    /// The demand (requests a second) to report instead of the one the
    /// counts make: a share asked again between reports, with nothing to
    /// charge, keeps the demand of the last report.
    pub demand: Option<f64>,
}

/// What a data plane is told to enforce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Assignment {
    /// Admit every request: no rule limits the bucket, only shadow rules
    /// do, or the store is unavailable and the rule fails open.
    AllowAll,
    /// Refuse every request: a rule of zero, a share of nothing (the other
    /// members hold the whole limit until they report), or the store is
    /// unavailable and the rule fails closed.
    DenyAll,
    /// A token bucket.
    Bucket(ShareBucket),
}

/// A token bucket as Envoy's `TokenBucket` configures one: at most
/// `max_tokens`, refilled by `tokens_per_fill` every `fill_interval`
/// seconds (whole seconds: Envoy 1.40 reads no fraction of them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareBucket {
    /// Capacity; the bucket starts full.
    pub max_tokens: u32,
    /// Tokens added per interval.
    pub tokens_per_fill: u32,
    /// The interval, in whole seconds.
    pub fill_interval: u32,
}

impl ShareBucket {
    /// Tokens per second.
    pub fn rate(&self) -> f64 {
        f64::from(self.tokens_per_fill) / f64::from(self.fill_interval.max(1))
    }
}

/// One member's part in a share: who it is, for how long its assignment
/// holds, and what it was told last.
#[derive(Debug, Clone, Copy)]
pub struct Member<'a> {
    /// Its identity in the share table (bounded by the caller).
    pub id: &'a str,
    /// How long its assignment is in force at the data plane: its entry in
    /// the share table lives as long. 0: the member leaves (nothing is
    /// charged, and it is assigned nothing).
    pub ttl: Micros,
    /// Its assignment in force, if any.
    pub last: Option<Assignment>,
}

/// What [`Engine::share`] decided.
#[derive(Debug, Clone, PartialEq)]
pub struct Shared {
    /// The assignment to send.
    pub assignment: Assignment,
    /// The member's part of the tightest rule, in parts per million
    /// (`PPM` when no share table was asked).
    pub ppm: u64,
    /// Members sharing the tightest rule, this one included (0: none asked).
    pub members: u64,
    /// The member's demand, in requests per second.
    pub demand: f64,
    /// The tightest line, which the share divides.
    pub line: Option<usize>,
    /// Set when the store was unavailable and the tightest rule's policy
    /// decided.
    pub degraded: Option<OnStoreUnavailable>,
    /// The share table was full: the member was granted nothing.
    pub full: bool,
    /// The part is short of the fair one while the others hold the rest:
    /// asked again after they report, it grows.
    pub waiting: bool,
}

/// Fill intervals a share's rate is written in, shortest first: the first
/// that carries at least a hundred tokens per fill (1 % precision).
const FILL_INTERVALS: [u32; 10] = [1, 2, 5, 10, 30, 60, 300, 600, 1800, 3600];

/// A grant of a burst keeps the assignment in force unless the new burst
/// is more than a tenth larger (the data plane's bucket refills when its
/// assignment changes).
const BURST_SLACK: u64 = 10;

/// Tokens per second a limit refills: a bucket's rate, a window's count
/// per window, a quota's count per period.
pub fn tokens_per_second(limit: &Limit) -> f64 {
    let per_interval = match limit.algorithm() {
        Algorithm::TokenBucket => 1.0,
        _ => limit.burst() as f64,
    };
    per_interval * 1e6 / limit.interval().max(1) as f64
}

/// A rate in tokens per second as a fill of whole tokens per whole
/// seconds, rounded down (a share never exceeds its part); at least one
/// token per hour.
pub fn fill_of(rate: f64) -> (u32, u32) {
    for interval in FILL_INTERVALS {
        let tokens = rate * f64::from(interval);
        if tokens >= 100.0 || interval == 3600 {
            let tokens = tokens.floor().clamp(1.0, f64::from(u32::MAX)) as u32;
            return (tokens, interval);
        }
    }
    (1, 3600)
}

impl Engine {
    /// Settles one report of a data plane on one bucket and answers its
    /// next assignment. `demand` holds one item (its cost is set here to
    /// the requests allowed) and the lines of the rules that apply; its op
    /// is set to a charge. Errors are the store's or the demand's, as
    /// [`Engine::decide`] answers them.
    pub async fn share(
        &self,
        demand: &mut Demand<'_>,
        usage: Usage,
        member: Member<'_>,
    ) -> Result<Shared, super::DecideError> {
        demand.op = Op::Charge;
        demand.lines.retain(|l| !l.is_concurrency());
        if let Some(item) = demand.items.first_mut() {
            item.cost = usage.allowed;
        }
        // The tightest enforced rule (the smallest rate) is the one shared;
        // its bucket's name is kept before the store call takes it.
        let blocked = demand
            .lines
            .iter()
            .filter(|l| l.enforce)
            .position(|l| matches!(l.allowance, Allowance::Blocked { .. }));
        let tightest = demand
            .lines
            .iter()
            .enumerate()
            .filter(|(_, l)| l.enforce)
            .filter_map(|(i, l)| match l.allowance {
                Allowance::Limited(limit) => Some((i, limit)),
                _ => None,
            })
            .min_by(|a, b| tokens_per_second(&a.1).total_cmp(&tokens_per_second(&b.1)));
        let table = tightest.map(|(i, _)| demand.lines[i].bucket.clone());
        if member.ttl == 0 {
            return self.leave(table, member, demand.api).await;
        }
        let answer = match self.apply_demand(demand, &mut None).await {
            Ok(answer) => answer,
            Err(err) => {
                super::refused(demand.api, 1, &tracing::Span::none());
                return Err(err);
            }
        };
        let elapsed = usage.elapsed.max(1_000_000);
        let requests = usage.allowed.saturating_add(usage.denied);
        let demand_rate = usage
            .demand
            .unwrap_or(requests as f64 * 1e6 / elapsed as f64);
        let degraded = answer.items.first().and_then(|a| a.degraded);
        self.record_usage(demand, usage, tightest.map(|(i, _)| i).or(blocked));
        let mut shared = Shared {
            assignment: Assignment::AllowAll,
            ppm: PPM,
            members: 0,
            demand: demand_rate,
            line: tightest.map(|(i, _)| i).or(blocked),
            degraded: None,
            full: false,
            waiting: false,
        };
        let unmatched = demand.lines.is_empty() && self.unmatched == super::Unmatched::Deny;
        if blocked.is_some() || unmatched {
            shared.assignment = Assignment::DenyAll;
            return Ok(shared);
        }
        let (Some((line, limit)), Some(table)) = (tightest, table) else {
            return Ok(shared);
        };
        let policy = demand.lines[line].on_store_unavailable;
        if degraded.is_some() {
            shared.degraded = Some(policy);
            match policy {
                OnStoreUnavailable::Allow => return Ok(shared),
                OnStoreUnavailable::Deny => {
                    shared.assignment = Assignment::DenyAll;
                    return Ok(shared);
                }
                OnStoreUnavailable::Local => {}
            }
        }
        let rate = tokens_per_second(&limit);
        // Demand in thousandths of a request per second, with a floor of a
        // hundredth of the rule's rate so that an idle member can start.
        let weight = ((demand_rate.max(rate / 100.0) * 1000.0) as u64).clamp(1, MAX_WEIGHT);
        let ask = ShareAsk {
            table: &table,
            member: member.id,
            weight,
            ttl: member.ttl,
        };
        let granted = match self.store.share(ask).await {
            Ok(granted) => granted,
            Err(err) => {
                super::refused(demand.api, 1, &tracing::Span::none());
                return Err(err.into());
            }
        };
        if granted.degraded && shared.degraded.is_none() {
            shared.degraded = Some(policy);
        }
        shared.ppm = granted.share.ppm;
        shared.members = granted.share.members;
        shared.full = granted.share.full;
        shared.waiting = granted.share.waiting;
        let part = granted.share.ppm as f64 / PPM as f64;
        // While degraded, the in-process buckets hold this instance's
        // fraction of the limit (their remaining tokens already do).
        let rate = rate * granted.scale;
        // The burst: the member's part of what every enforced bucket has
        // left (after this report's charge).
        let left = demand
            .lines
            .iter()
            .zip(&answer.lines)
            .filter(|(l, _)| l.enforce && matches!(l.allowance, Allowance::Limited(_)))
            .map(|(_, v)| v.remaining)
            .min()
            .unwrap_or(0);
        let burst = (left as f64 * part).floor() as u64;
        let fill_rate = rate * part;
        if granted.share.ppm == 0 || (fill_rate * 3600.0 < 1.0 && burst == 0) {
            shared.assignment = Assignment::DenyAll;
            return Ok(shared);
        }
        let (tokens_per_fill, fill_interval) = fill_of(fill_rate);
        // At least a quarter of a second of refill (and one token): a
        // bucket capped lower wastes refill between requests that arrive
        // in bunches.
        let floor = (fill_rate / 4.0).ceil().max(1.0) as u64;
        let mut bucket = ShareBucket {
            max_tokens: u32::try_from(burst.max(floor)).unwrap_or(u32::MAX),
            tokens_per_fill,
            fill_interval,
        };
        if let Some(Assignment::Bucket(last)) = member.last {
            let same_fill =
                (last.tokens_per_fill, last.fill_interval) == (tokens_per_fill, fill_interval);
            let grown = u64::from(bucket.max_tokens) * BURST_SLACK
                > u64::from(last.max_tokens) * (BURST_SLACK + 1);
            if same_fill && !grown {
                // Unchanged: the data plane keeps its bucket, tokens and all.
                bucket = last;
            } else if bucket.max_tokens == last.max_tokens
                && bucket.tokens_per_fill == last.tokens_per_fill
            {
                // Envoy 1.40 compares a fill interval's nanoseconds only:
                // a change of whole seconds alone would go unseen.
                bucket.max_tokens = bucket.max_tokens.saturating_add(1);
            }
        }
        shared.assignment = Assignment::Bucket(bucket);
        Ok(shared)
    }

    /// Gives a member's part of `table` back: nothing to charge, nothing
    /// to assign (a member leaving is not told).
    async fn leave(
        &self,
        table: Option<crate::store::BucketKey>,
        member: Member<'_>,
        api: super::Api,
    ) -> Result<Shared, super::DecideError> {
        if let Some(table) = &table {
            let ask = ShareAsk {
                table,
                member: member.id,
                weight: 1,
                ttl: 0,
            };
            if let Err(err) = self.store.share(ask).await {
                super::refused(api, 1, &tracing::Span::none());
                return Err(err.into());
            }
        }
        Ok(Shared {
            assignment: Assignment::DenyAll,
            ppm: 0,
            members: 0,
            demand: 0.0,
            line: None,
            degraded: None,
            full: false,
            waiting: false,
        })
    }

    /// Counts a report's requests as decisions of the API (allowed and
    /// rejected, under the deciding rule) and its denied requests in the
    /// top-limited views.
    fn record_usage(&self, demand: &Demand<'_>, usage: Usage, line: Option<usize>) {
        let label = line.map_or("", |l| demand.lines[l].label);
        let api = demand.api.label();
        let outcomes: SmallVec<[(Outcome, u64); 2]> = [
            (Outcome::Allowed, usage.allowed),
            (Outcome::Rejected, usage.denied),
        ]
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .collect();
        for (outcome, n) in outcomes {
            metrics::decisions(api, outcome, label, n, n);
        }
        if let Some(item) = demand.items.first()
            && usage.denied > 0
        {
            self.top.record(item.tenant, item.key, usage.denied);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rate_is_written_in_whole_tokens_and_seconds_rounded_down() {
        assert_eq!(fill_of(250.7), (250, 1));
        assert_eq!(fill_of(100.0), (100, 1));
        assert_eq!(fill_of(57.2), (114, 2));
        assert_eq!(fill_of(14.3), (143, 10));
        assert_eq!(fill_of(0.5), (150, 300));
        assert_eq!(fill_of(0.0001), (1, 3600));
        assert_eq!(fill_of(1e12), (u32::MAX, 1));
    }

    #[test]
    fn rates_of_each_algorithm() {
        let rate = |s: &str| s.parse().unwrap();
        let bucket = Limit::new(50, rate("100/second")).unwrap();
        assert!((tokens_per_second(&bucket) - 100.0).abs() < 1e-9);
        let window = Limit::window(Algorithm::FixedWindow, rate("60/minute")).unwrap();
        assert!((tokens_per_second(&window) - 1.0).abs() < 1e-9);
    }
}
