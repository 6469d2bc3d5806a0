//! From line verdicts to answers: the tightest bucket per item, the
//! outcome, and the header values. One set of rules for every API.

use std::collections::HashMap;

use smallvec::SmallVec;

use super::{Allowance, Answer, Demand, INLINE, ItemAnswer};
use crate::algorithm::{Micros, Verdict};
use crate::limits::OnStoreUnavailable;
use crate::store::BucketKey;
use crate::telemetry::metrics::Outcome;

/// The `RateLimit-*` and `Retry-After` values of an answer. Seconds round
/// up, so a caller that waits what a header says is never early.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Headers {
    /// `RateLimit-Limit`: the tightest bucket's capacity (0 for a limit of
    /// zero).
    pub limit: u64,
    /// `RateLimit-Remaining`.
    pub remaining: u64,
    /// `RateLimit-Reset`, whole seconds until the bucket is full again.
    pub reset: u64,
    /// `Retry-After`, whole seconds; only when rejected with a finite wait.
    pub retry_after: Option<u64>,
}

impl Headers {
    /// The header names and values, in the order above.
    pub fn pairs(&self) -> impl Iterator<Item = (&'static str, String)> + use<> {
        let n = |v: u64| itoa::Buffer::new().format(v).to_owned();
        [
            Some(("RateLimit-Limit", n(self.limit))),
            Some(("RateLimit-Remaining", n(self.remaining))),
            Some(("RateLimit-Reset", n(self.reset))),
            self.retry_after.map(|s| ("Retry-After", n(s))),
        ]
        .into_iter()
        .flatten()
    }
}

/// Whole seconds, rounded up.
pub fn whole_seconds(us: Micros) -> u64 {
    us.div_ceil(1_000_000)
}

/// Finds the charge already made for a bucket, so lines that share a
/// bucket add their costs. A linear scan while there are few buckets (a
/// single decision has one to three; no hashing, no copies of the names),
/// a hash map once a batch grows past [`BucketIndex::SCAN`].
#[derive(Default)]
pub(super) struct BucketIndex {
    map: Option<HashMap<BucketKey, usize>>,
}

impl BucketIndex {
    const SCAN: usize = 16;

    pub(super) fn find(&self, buckets: &[BucketKey], bucket: &BucketKey) -> Option<usize> {
        match &self.map {
            Some(map) => map.get(bucket).copied(),
            None => buckets.iter().position(|b| b == bucket),
        }
    }

    /// Records that `bucket` is about to be pushed onto `buckets`.
    pub(super) fn add(&mut self, buckets: &[BucketKey], bucket: &BucketKey) {
        if let Some(map) = &mut self.map {
            map.insert(bucket.clone(), buckets.len());
        } else if buckets.len() + 1 > Self::SCAN {
            let mut map: HashMap<BucketKey, usize> = buckets
                .iter()
                .enumerate()
                .map(|(i, b)| (b.clone(), i))
                .collect();
            map.insert(bucket.clone(), buckets.len());
            self.map = Some(map);
        }
    }
}

/// Whether bucket `a` is tighter than `b`: enforced beats shadow; a
/// rejection beats an admission; then the longer wait, then fewer tokens,
/// then the longer time to full.
pub(super) fn tighter(a_enforce: bool, a: &Verdict, b_enforce: bool, b: &Verdict) -> bool {
    if a_enforce != b_enforce {
        return a_enforce;
    }
    if a.allowed != b.allowed {
        return !a.allowed;
    }
    if !a.allowed {
        return a.retry_after > b.retry_after;
    }
    (a.remaining, std::cmp::Reverse(a.reset_after))
        < (b.remaining, std::cmp::Reverse(b.reset_after))
}

/// How an item's decision is counted.
fn classify(degraded: Option<OnStoreUnavailable>, allowed: bool, shadow: bool) -> Outcome {
    match (degraded, allowed, shadow) {
        (Some(OnStoreUnavailable::Allow), ..) => Outcome::FailedOpen,
        (Some(OnStoreUnavailable::Deny), ..) => Outcome::FailedClosed,
        (Some(OnStoreUnavailable::Local), ..) => Outcome::LocalFallback,
        (None, false, _) => Outcome::Rejected,
        (None, true, true) => Outcome::ShadowRejected,
        (None, true, false) => Outcome::Allowed,
    }
}

/// Fills each item's answer from the verdicts of its lines: rejected by
/// any enforced line; the tightest line decides what is reported.
pub(super) fn summarise(
    demand: &Demand<'_>,
    lines: SmallVec<[Verdict; INLINE]>,
    degraded: bool,
) -> Answer {
    let mut items: SmallVec<[ItemAnswer; 1]> = demand
        .items
        .iter()
        .map(|_| ItemAnswer {
            allowed: true,
            shadow: false,
            remaining: 0,
            debt: 0,
            retry_after: 0,
            reset_after: 0,
            line: None,
            degraded: None,
            outcome: Outcome::Allowed,
            headers: None,
        })
        .collect();
    for (i, (line, verdict)) in demand.lines.iter().zip(&lines).enumerate() {
        let item = &mut items[line.item];
        item.debt = item.debt.max(verdict.debt);
        if line.enforce {
            item.allowed &= verdict.allowed;
        } else if !verdict.allowed {
            item.shadow = true;
        }
        let better = match item.line {
            None => true,
            Some(p) => tighter(line.enforce, verdict, demand.lines[p].enforce, &lines[p]),
        };
        if better {
            item.line = Some(i);
        }
    }
    // The tightest item over the whole demand: (item, its deciding line).
    let mut tightest: Option<(usize, usize)> = None;
    for (index, item) in items.iter_mut().enumerate() {
        if let Some(l) = item.line {
            let (line, verdict) = (&demand.lines[l], &lines[l]);
            item.remaining = verdict.remaining;
            item.reset_after = verdict.reset_after;
            item.retry_after = if item.allowed { 0 } else { verdict.retry_after };
            item.degraded = degraded.then_some(line.on_store_unavailable);
            let limit = match line.allowance {
                Allowance::Limited(limit) => Some(limit.burst()),
                Allowance::Blocked { .. } => Some(0),
                Allowance::Unlimited => None,
            };
            item.headers = limit.map(|limit| Headers {
                limit,
                remaining: verdict.remaining,
                reset: whole_seconds(verdict.reset_after),
                retry_after: (!item.allowed && item.retry_after != Micros::MAX)
                    .then(|| whole_seconds(item.retry_after)),
            });
            if item.headers.is_some() {
                let better = match tightest {
                    None => true,
                    Some((_, p)) => {
                        tighter(line.enforce, verdict, demand.lines[p].enforce, &lines[p])
                    }
                };
                if better {
                    tightest = Some((index, l));
                }
            }
        }
        item.outcome = classify(item.degraded, item.allowed, item.shadow);
    }
    let allowed = items.iter().all(|i| i.allowed);
    let retry_after = items
        .iter()
        .map(|i| i.retry_after)
        .filter(|&r| r != Micros::MAX)
        .max()
        .unwrap_or(0);
    let headers = tightest.and_then(|(t, _)| items[t].headers);
    Answer {
        allowed,
        retry_after,
        items,
        lines,
        headers,
        forgiven: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::token_bucket::decide;
    use crate::algorithm::{Limit, Rate};
    use proptest::prelude::*;

    proptest! {
        /// A client that waits the whole seconds of `Retry-After` is
        /// admitted, and the header is never more than a second later than
        /// the exact wait: rounding up, never down, never further.
        #[test]
        fn retry_after_header_is_never_early_and_at_most_a_second_late(
            burst in 1u64..2000,
            per in 1u64..100_000,
            unit in prop::sample::select(vec!["second", "minute", "hour", "day"]),
            spend in prop::collection::vec((0u64..5_000_000, 1u64..50), 1..60),
        ) {
            let limit = Limit::new(burst, format!("{per}/{unit}").parse::<Rate>().unwrap()).unwrap();
            let (mut state, mut now) = (None, 1_700_000_000_000_000u64);
            for (dt, cost) in spend {
                now += dt;
                let cost = cost.min(burst);
                let (v, next) = decide(state, &limit, cost, now).unwrap();
                if v.allowed {
                    state = Some(next);
                    continue;
                }
                let header = whole_seconds(v.retry_after);
                prop_assert!(header * 1_000_000 < v.retry_after + 1_000_000);
                prop_assert!(decide(state, &limit, cost, now + header * 1_000_000).unwrap().0.allowed);
                if header > 1 {
                    // One second less would be early.
                    prop_assert!(!decide(state, &limit, cost, now + (header - 1) * 1_000_000).unwrap().0.allowed);
                }
            }
        }
    }
}
