//! The decision engine: the one door to the store for every API.
//!
//! Each API (native single, batch and stream; Envoy's rate limit service)
//! only translates its wire format into a [`Demand`] and the engine's
//! [`Answer`] back into its wire format. Everything between happens here,
//! once, so a limit or a fix holds for every API at once:
//!
//! 1. validate the demand against the [`caps`] (items, buckets, bucket name
//!    bytes) and its cost arithmetic (saturating sums, a cost no limit can
//!    hold is refused or rejected as the API asks);
//! 2. merge the lines that share a bucket into one charge each;
//! 3. apply the charges as one atomic store call through the store's layers
//!    (deny cache, store-unavailable fallback), all or nothing;
//! 4. per item, pick the tightest bucket and classify the outcome;
//! 5. record metrics, the top-limited sketch and the span's outcome;
//! 6. build the `RateLimit-*` / `Retry-After` header values.

pub mod caps;
mod error;
mod summary;

use std::sync::Arc;

use smallvec::SmallVec;

pub use error::DecideError;
pub use summary::Headers;

use crate::algorithm::{Charge, Limit, Micros, Verdict};
use crate::clock::Clock;
use crate::limits::OnStoreUnavailable;
use crate::store::BucketKey;
use crate::store::stack::{Applied, Layer, Request};
use crate::telemetry::metrics::{self, Outcome};
use crate::telemetry::top::TopLimited;

/// Charges per decision held inline before the scratch space spills to the
/// heap: a key bucket, a tenant ceiling and a resource rule or two.
const INLINE: usize = 4;

/// Which API a demand came through: the `api` label of its metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `tollgate.v1.RateLimiter`.
    Native,
    /// `envoy.service.ratelimit.v3.RateLimitService`.
    Envoy,
}

impl Api {
    /// The `api` label.
    pub const fn label(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Envoy => "envoy",
        }
    }
}

/// What to do with an enforced charge whose cost exceeds its capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverCapacity {
    /// Refuse the demand as invalid: it could never pass, so waiting would
    /// not help (the native API).
    Invalid,
    /// Answer over the limit, never admitted (envoyproxy/ratelimit's answer
    /// to a `hits_addend` above the limit).
    Reject,
}

/// What a line's rule allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allowance {
    /// A bucket or window in the store.
    Limited(Limit),
    /// Never limited; the store is not asked.
    Unlimited,
    /// A limit of zero: never admitted; the store is not asked. `window` is
    /// the rule's unit, so the answer can say when the current one ends.
    Blocked {
        /// The rule's unit, in microseconds.
        window: Micros,
    },
}

/// One item asked for: a key of a tenant spending `cost` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Item<'a> {
    /// The tenant, as the top-limited views show it.
    pub tenant: &'a str,
    /// The key, as the top-limited views show it.
    pub key: &'a str,
    /// Tokens to spend (the API has already applied its default).
    pub cost: u64,
}

/// One rule's part in an item: which bucket it charges, and how.
#[derive(Debug, Clone)]
pub struct Line<'a> {
    /// Index of the item in [`Demand::items`].
    pub item: usize,
    /// The bucket charged; lines sharing a bucket add their costs.
    pub bucket: BucketKey,
    /// What the rule allows.
    pub allowance: Allowance,
    /// False for shadow rules: counted, never the cause of a rejection.
    pub enforce: bool,
    /// What the rule does when the shared store is unavailable.
    pub on_store_unavailable: OnStoreUnavailable,
    /// The rule's identity in metrics: a configured rule's name, or a
    /// fixed label such as `override`; never a value taken from a request.
    pub label: &'a str,
}

/// One decision asked of the engine: items, the rules' lines on them, and
/// whether to spend.
#[derive(Debug, Clone)]
pub struct Demand<'a> {
    /// The API, for metric labels and error field names.
    pub api: Api,
    /// The items, decided together: all are charged, or none is.
    pub items: SmallVec<[Item<'a>; 1]>,
    /// The lines, in the order the API wants them reported.
    pub lines: SmallVec<[Line<'a>; INLINE]>,
    /// False for a dry run: decide without spending.
    pub spend: bool,
    /// How to treat an enforced cost above a capacity.
    pub over_capacity: OverCapacity,
}

impl<'a> Demand<'a> {
    /// An empty demand.
    pub fn new(api: Api, spend: bool, over_capacity: OverCapacity) -> Self {
        Self {
            api,
            items: SmallVec::new(),
            lines: SmallVec::new(),
            spend,
            over_capacity,
        }
    }
}

/// The engine's answer for one item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemAnswer {
    /// The item may go ahead.
    pub allowed: bool,
    /// A shadow line would have rejected it.
    pub shadow: bool,
    /// Whole tokens left in the tightest bucket.
    pub remaining: u64,
    /// Zero when allowed; otherwise the exact wait until it would be
    /// ([`Micros::MAX`]: never).
    pub retry_after: Micros,
    /// Time until the tightest bucket is full (a window: resets).
    pub reset_after: Micros,
    /// The tightest line, which decided; `None` when no line applied.
    pub line: Option<usize>,
    /// Set when the store was unavailable and the deciding line's policy
    /// answered instead.
    pub degraded: Option<OnStoreUnavailable>,
    /// How the item's decision is counted.
    pub outcome: Outcome,
    /// The header values; `None` when no limited line applied.
    pub headers: Option<Headers>,
}

/// The engine's answer for a demand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// Every item was allowed (and, unless a dry run, charged).
    pub allowed: bool,
    /// Zero when allowed; otherwise the longest finite wait among the items.
    pub retry_after: Micros,
    /// One answer per item, in order.
    pub items: SmallVec<[ItemAnswer; 1]>,
    /// One verdict per line, in order.
    pub lines: SmallVec<[Verdict; INLINE]>,
    /// The tightest item's header values, for APIs that answer a whole
    /// request with one set of headers.
    pub headers: Option<Headers>,
}

/// Decides demands with one store.
pub struct Engine {
    store: Arc<dyn Layer>,
    clock: Arc<dyn Clock>,
    top: Arc<TopLimited>,
}

impl Engine {
    /// An engine over `store` (already wrapped in its layers), counting
    /// rejections in `top`.
    pub fn new(store: Arc<dyn Layer>, clock: Arc<dyn Clock>, top: Arc<TopLimited>) -> Self {
        Self { store, clock, top }
    }

    /// Decides a demand: validates it, applies it to the store as one
    /// atomic step, and records what happened. The demand's bucket names
    /// move into the store call (its lines are left without them). Every error is counted once,
    /// as the `error` outcome of the demand's API.
    /// `span` is the API's decision span; its `outcome` and `rule` fields
    /// are filled here (a disabled span costs nothing).
    pub async fn decide(
        &self,
        demand: &mut Demand<'_>,
        span: &tracing::Span,
    ) -> Result<Answer, DecideError> {
        // Everything but a wait for a remote store happens synchronously:
        // the future holds the demand and, only when it must wait, a boxed
        // store call, so that the futures of the wings above stay small.
        let result = match self.prepare(demand) {
            Err(err) => Err(err),
            Ok(merged) if merged.charges.is_empty() => Ok(self.answer(demand, &merged, None)),
            Ok(merged) => match self.store.apply_now(merged.request(demand.spend)) {
                Some(applied) => applied
                    .map(|a| self.answer(demand, &merged, Some(a)))
                    .map_err(Into::into),
                None => {
                    let store = &self.store;
                    let spend = demand.spend;
                    let (merged, applied) = Box::pin(async move {
                        let applied = store.apply(merged.request(spend)).await;
                        (merged, applied)
                    })
                    .await;
                    applied
                        .map(|a| self.answer(demand, &merged, Some(a)))
                        .map_err(Into::into)
                }
            },
        };
        match &result {
            Ok(answer) => self.record(demand, answer, span),
            Err(_) => refused(demand.api, demand.items.len().max(1), span),
        }
        result
    }

    /// Validates the demand and merges its lines into charges.
    fn prepare(&self, demand: &mut Demand<'_>) -> Result<Merged, DecideError> {
        caps::check_demand(demand)?;
        merge(demand)
    }

    /// The answer from the store's verdicts (`None`: nothing was charged).
    fn answer(&self, demand: &Demand<'_>, merged: &Merged, applied: Option<Applied>) -> Answer {
        let (outcome, degraded) = match applied {
            Some(a) => (Some(a.outcome), a.degraded),
            None => (None, false),
        };
        let now = if demand
            .lines
            .iter()
            .any(|l| matches!(l.allowance, Allowance::Blocked { .. }))
        {
            self.clock.now()
        } else {
            0
        };
        let lines: SmallVec<[Verdict; INLINE]> = demand
            .lines
            .iter()
            .zip(&merged.line_charge)
            .map(|(line, charge)| {
                let verdict = charge.and_then(|c| outcome.as_ref().map(|o| o.verdicts[c]));
                match (line.allowance, verdict) {
                    (Allowance::Limited(_), Some(v)) => v,
                    // A limit of zero never admits; its window ends on the
                    // unit, as envoyproxy/ratelimit reports it.
                    (Allowance::Blocked { window }, _) => Verdict {
                        allowed: false,
                        remaining: 0,
                        retry_after: Micros::MAX,
                        reset_after: window.max(1) - now % window.max(1),
                    },
                    _ => Verdict {
                        allowed: true,
                        remaining: u64::MAX,
                        retry_after: 0,
                        reset_after: 0,
                    },
                }
            })
            .collect();
        summary::summarise(demand, lines, degraded)
    }

    /// Counts the answer's items by outcome and deciding rule (one counter
    /// update per run of equal items), records rejections in the
    /// top-limited sketch, and fills the current span's outcome.
    fn record(&self, demand: &Demand<'_>, answer: &Answer, span: &tracing::Span) {
        let mut run: Option<(Outcome, &str, u64, u64)> = None;
        for (item, a) in demand.items.iter().zip(&answer.items) {
            let label = a.line.map_or("", |l| demand.lines[l].label);
            if !a.allowed {
                self.top.record(item.tenant, item.key, item.cost);
            }
            match &mut run {
                Some((o, r, n, tokens)) if *o == a.outcome && *r == label => {
                    *n += 1;
                    *tokens = tokens.saturating_add(item.cost);
                }
                _ => {
                    if let Some((o, r, n, tokens)) = run {
                        metrics::decisions(demand.api.label(), o, r, n, tokens);
                    }
                    run = Some((a.outcome, label, 1, item.cost));
                }
            }
        }
        if let Some((o, r, n, tokens)) = run {
            metrics::decisions(demand.api.label(), o, r, n, tokens);
        }
        if !span.is_disabled() {
            let outcome = match answer.items.as_slice() {
                [one] => one.outcome.label(),
                _ if answer.allowed => "allowed",
                _ => "rejected",
            };
            span.record("outcome", outcome);
            if let Some(line) = answer.items.first().and_then(|a| a.line) {
                span.record("rule", demand.lines[line].label);
            }
        }
    }
}

/// Counts a refused demand (invalid, or the store failed with no fallback)
/// as `n` decisions with the `error` outcome. Tokens asked for by a refused
/// demand are not counted: they were never decided, and a hostile caller
/// could make the sum wrap.
pub fn refused(api: Api, n: usize, span: &tracing::Span) {
    metrics::decisions(api.label(), Outcome::Error, "", n as u64, 0);
    if !span.is_disabled() {
        span.record("outcome", Outcome::Error.label());
    }
}

/// The demand's charges, one per distinct bucket.
struct Merged {
    buckets: SmallVec<[BucketKey; INLINE]>,
    charges: SmallVec<[Charge; INLINE]>,
    policies: SmallVec<[OnStoreUnavailable; INLINE]>,
    /// For each line, the charge it adds to (limited lines only).
    line_charge: SmallVec<[Option<usize>; INLINE]>,
}

impl Merged {
    fn request(&self, spend: bool) -> Request<'_> {
        Request {
            buckets: &self.buckets,
            charges: &self.charges,
            policies: &self.policies,
            spend,
        }
    }
}

/// Merges lines that share a bucket into one charge, adding their costs
/// (saturating, and clamped to [`caps::MAX_COST`], above every capacity),
/// and checks the bucket cap and each enforced cost against its capacity.
/// The lines' buckets move into the charges (a line's own is left empty).
fn merge(demand: &mut Demand<'_>) -> Result<Merged, DecideError> {
    let mut merged = Merged {
        buckets: SmallVec::new(),
        charges: SmallVec::new(),
        policies: SmallVec::new(),
        line_charge: SmallVec::new(),
    };
    let mut index = summary::BucketIndex::default();
    for n in 0..demand.lines.len() {
        let line = &demand.lines[n];
        let (limit, cost) = match line.allowance {
            Allowance::Limited(limit) => (limit, demand.items[line.item].cost.min(caps::MAX_COST)),
            // A limit of zero is a charge no bucket can hold: the store
            // denies it like any cost above a capacity, so the demand is
            // rejected in the same atomic step and nothing is spent.
            Allowance::Blocked { window } => (Limit::blocking(window), caps::MAX_COST),
            Allowance::Unlimited => {
                merged.line_charge.push(None);
                continue;
            }
        };
        let at = match index.find(&merged.buckets, &line.bucket) {
            Some(c) => {
                let charge = &mut merged.charges[c];
                charge.cost = charge.cost.saturating_add(cost).min(caps::MAX_COST);
                // One enforced line makes the shared bucket enforced.
                charge.enforce |= line.enforce;
                c
            }
            None => {
                if merged.buckets.len() == caps::MAX_BUCKETS {
                    return Err(DecideError::TooManyBuckets {
                        api: demand.api,
                        max: caps::MAX_BUCKETS,
                    });
                }
                index.add(&merged.buckets, &line.bucket);
                let (enforce, policy) = (line.enforce, line.on_store_unavailable);
                merged
                    .buckets
                    .push(std::mem::take(&mut demand.lines[n].bucket));
                merged.charges.push(Charge {
                    limit,
                    cost,
                    enforce,
                });
                merged.policies.push(policy);
                merged.charges.len() - 1
            }
        };
        let line = &demand.lines[n];
        let charge = &merged.charges[at];
        if demand.over_capacity == OverCapacity::Invalid
            && matches!(line.allowance, Allowance::Limited(_))
            && charge.enforce
            && charge.cost > limit.burst()
        {
            let earlier = demand.lines[..n]
                .iter()
                .zip(&merged.line_charge)
                .filter(|(_, c)| **c == Some(at))
                .map(|(l, _)| l.item);
            let shared = earlier
                .chain([line.item])
                .collect::<std::collections::BTreeSet<_>>();
            return Err(DecideError::CostExceedsCapacity {
                what: if demand.items.len() == 1 {
                    "the request".into()
                } else if shared.len() == 1 {
                    format!("items[{}]", line.item)
                } else {
                    format!("the items sharing bucket {:?}", merged.buckets[at].as_str())
                },
                rule: line.label.to_owned(),
                burst: limit.burst(),
                cost: charge.cost,
            });
        }
        merged.line_charge.push(Some(at));
    }
    Ok(merged)
}
