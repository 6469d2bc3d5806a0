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
//! 3. apply the charges as one [`crate::store::Request`] through the store's
//!    layers (deny cache, store-unavailable fallback, token slices), all or
//!    nothing: one atomic backend call, except that a decision on a sliced
//!    ceiling may take a new slice first (a call of its own, whose tokens
//!    are given back when the decision is refused);
//! 4. per item, pick the tightest bucket and classify the outcome;
//! 5. record metrics, the top-limited sketch and the span's outcome;
//! 6. build the `RateLimit-*` / `Retry-After` header values.
//!
//! A wing's whole part, in short: a demand of one item and one line, decided
//! three times against a bucket of two.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use tollgate_engine::algorithm::{Limit, Op};
//! use tollgate_engine::clock::{Clock, ManualClock};
//! use tollgate_engine::engine::backend::{Backend, BackendOptions};
//! use tollgate_engine::engine::{
//!     Allowance, Api, BucketKey, BucketKind, Demand, Item, Line, OnStoreUnavailable,
//!     OverCapacity, Unmatched,
//! };
//! use tollgate_engine::telemetry::top::TopLimited;
//!
//! let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(0));
//! let options = BackendOptions {
//!     redis: None,
//!     redis_uses_clock: false,
//!     max_buckets: 1_000,
//!     max_bucket_bytes: 1 << 20,
//!     max_records: 1_000,
//!     max_records_per_tenant: None,
//!     local_fraction: 1.0,
//!     deny_retry_after: 1_000_000,
//!     deny_cache: false,
//!     token_slices: false,
//! };
//! let backend = Backend::build(&options, &clock).unwrap();
//! let top = Arc::new(TopLimited::new(16, Duration::from_secs(60), clock.clone()));
//! let engine = backend.engine(clock, top, Unmatched::Allow);
//! // Two at once, then one a second.
//! let limit = Limit::new(2, "1/second".parse().unwrap()).unwrap();
//! let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
//! let mut answers = Vec::new();
//! for _ in 0..3 {
//!     let mut demand = Demand::new(Api::Native, Op::SPEND, OverCapacity::Invalid);
//!     demand.items.push(Item::new("acme", "", "alice", 1));
//!     demand.lines.push(Line {
//!         item: 0,
//!         bucket: BucketKey::new("acme", BucketKind::KEY, "", "alice"),
//!         allowance: Allowance::Limited(limit),
//!         enforce: true,
//!         on_store_unavailable: OnStoreUnavailable::Allow,
//!         label: "per-key",
//!         calendar: None,
//!     });
//!     let span = tracing::Span::none();
//!     answers.push(runtime.block_on(engine.decide(&mut demand, &span)).unwrap());
//! }
//! assert!(answers[0].allowed && answers[1].allowed);
//! let refused = &answers[2];
//! assert!(!refused.allowed);
//! assert_eq!(refused.retry_after, 1_000_000, "exactly one refill interval");
//! let headers = refused.headers.unwrap();
//! assert_eq!((headers.limit, headers.remaining, headers.retry_after), (2, 0, Some(1)));
//! ```

pub mod backend;
pub mod caps;
mod error;
pub mod fields;
mod leases;
pub mod shares;
mod summary;
mod ttl;

use std::sync::Arc;

use smallvec::SmallVec;

pub use error::DecideError;
pub use fields::{Fields, HeaderStyle};
pub use leases::Acquired;
pub use summary::Headers;
pub use ttl::Ttl;

/// The store's vocabulary the APIs and the server speak: bucket names,
/// lease and reservation ids and statuses, store errors and status, the
/// Redis options and their defaults. The store itself stays behind the
/// engine.
pub mod vocabulary {
    pub use crate::store::breaker::{self, BreakerState};
    pub use crate::store::redis::{self, RedisConfig};
    pub use crate::store::{
        BucketKey, BucketKind, LeaseAnswer, LeaseId, LeaseOp, LeaseStatus, MemoryFigures,
        NodeStatus, OnStoreUnavailable, ReservationId, SettleStatus, StoreError, StoreStatus,
        redact,
    };
}
pub use vocabulary::*;

use crate::algorithm::calendar::{Cycle, Period};
use crate::algorithm::{Charge, Limit, Micros, Op, Verdict};
use crate::clock::Clock;
use crate::store::Reservation;
use crate::store::layer::{Applied, Layer};
use crate::store::{Attachment, Request};

/// What to do with a native request no rule applies to.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Unmatched {
    /// Admit it, unlimited (the default).
    #[default]
    Allow,
    /// Refuse it with FAILED_PRECONDITION.
    Deny,
}
use crate::telemetry::metrics::{self, Outcome};
use crate::telemetry::recent::Recent;
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
    /// `envoy.service.rate_limit_quota.v3.RateLimitQuotaService`: usage
    /// the Envoys decided themselves, on shares of the limits.
    Rlqs,
}

impl Api {
    /// The `api` label.
    pub const fn label(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Envoy => "envoy",
            Self::Rlqs => "rlqs",
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
///
/// A bucket must hold the item's cost for it to be admitted, except that a
/// decision of cost 0 (an ask: "may this caller go on?") needs one token of
/// each bucket that allows debt, so that a caller in debt is refused until
/// the refill has covered it, and nothing of a bucket without debt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Item<'a> {
    /// The tenant, as the top-limited views show it.
    pub tenant: &'a str,
    /// The resource asked about (for the error that names an item no rule
    /// applies to).
    pub resource: &'a str,
    /// The key, as the top-limited views show it.
    pub key: &'a str,
    /// Tokens to spend (the API has already applied its default).
    pub cost: u64,
}

impl<'a> Item<'a> {
    /// An item of `tenant`'s `key`, on `resource`, spending `cost`.
    pub fn new(tenant: &'a str, resource: &'a str, key: &'a str, cost: u64) -> Self {
        Self {
            tenant,
            resource,
            key,
            cost,
        }
    }
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
    /// A quota's period and the billing cycle it follows: the engine puts
    /// the quota ([`Allowance::Limited`]) in the period that holds the
    /// decision's instant ([`Limit::in_period`]).
    pub calendar: Option<(Period, &'a Cycle)>,
}

impl<'a> Line<'a> {
    /// The line of a limits-table `rule` (one of `rules`) on item `item`,
    /// `tenant`'s `key`: the one mapping of a rule to a bucket, for every
    /// API.
    pub fn of_rule(
        rules: &'a crate::limits::RuleSet,
        item: usize,
        tenant: &str,
        key: &str,
        rule: &'a crate::limits::Rule,
    ) -> Self {
        let key = if rule.scope == crate::limits::Scope::Key {
            key
        } else {
            ""
        };
        Line {
            item,
            bucket: BucketKey::new(tenant, rule.bucket_kind(), &rule.resource, key),
            allowance: Allowance::Limited(rule.limit),
            enforce: rule.mode == crate::limits::Mode::Enforce,
            on_store_unavailable: rule.on_store_unavailable,
            label: &rule.name,
            calendar: rule.period().map(|p| (p, rules.cycle_of(tenant))),
        }
    }

    /// True for a concurrency cap's line: it takes a slot, not tokens.
    pub fn is_concurrency(&self) -> bool {
        matches!(self.allowance, Allowance::Limited(l) if l.is_concurrency())
    }

    /// A concurrency cap's size.
    pub fn cap(&self) -> Option<u64> {
        match self.allowance {
            Allowance::Limited(l) if l.is_concurrency() => Some(l.burst()),
            _ => None,
        }
    }
}

/// One decision asked of the engine: items, the rules' lines on them, and
/// how to apply them.
#[derive(Debug, Clone)]
pub struct Demand<'a> {
    /// The API, for metric labels and error field names.
    pub api: Api,
    /// The items, decided together: all are charged, or none is.
    pub items: SmallVec<[Item<'a>; 1]>,
    /// The lines, in the order the API wants them reported.
    pub lines: SmallVec<[Line<'a>; INLINE]>,
    /// A decision (spending, or a dry run), or usage charged after the
    /// fact ([`Op::Charge`]).
    pub op: Op,
    /// How to treat an enforced cost above a capacity (decisions only: a
    /// charge after the fact is applied whatever its size).
    pub over_capacity: OverCapacity,
    /// Every line counts and none enforces, as if each rule were in shadow
    /// mode (a global shadow mode): what would have been refused is
    /// admitted, answered `shadow` and counted as `shadow_rejected`.
    pub shadow: bool,
}

impl<'a> Demand<'a> {
    /// An empty demand.
    pub fn new(api: Api, op: Op, over_capacity: OverCapacity) -> Self {
        Self {
            api,
            items: SmallVec::new(),
            lines: SmallVec::new(),
            op,
            over_capacity,
            shadow: false,
        }
    }
}

/// What a settle did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettleAnswer {
    /// What the store found: settled now, or settled before (a retry).
    pub status: SettleStatus,
    /// The estimate that was reserved (per line).
    pub estimate: u64,
    /// The actual cost the reservation is settled at: this call's, or the
    /// first settle's when it was settled before.
    pub actual: u64,
    /// `estimate - actual` when the actual was lower: given back.
    pub refunded: u64,
    /// `actual - estimate` when the actual was higher: charged.
    pub charged: u64,
    /// The tightest bucket after the settle (an admitting verdict with no
    /// tokens reported when the settle found nothing to report).
    pub tightest: Verdict,
    /// Tokens of the excess not charged at debt floors (settled now only).
    pub forgiven: u64,
}

/// What a reserve did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reserved {
    /// The decision on the estimate.
    pub answer: Answer,
    /// The reservation recorded, `None` when nothing was (refused, no rule
    /// applied, or a store-unavailable policy answered).
    pub reservation: Option<ReservationId>,
    /// Its time to live.
    pub ttl: Micros,
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
    /// The most tokens any of the item's buckets is below zero (0: none in
    /// debt).
    pub debt: u64,
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
    /// Tokens of a charge after the fact left unapplied at debt floors,
    /// counted once per bucket (lines sharing a bucket share its verdict).
    pub forgiven: u64,
}

/// Decides demands with one store.
pub struct Engine {
    store: Arc<dyn Layer>,
    clock: Arc<dyn Clock>,
    top: Arc<TopLimited>,
    leases: leases::LeaseBook,
    unmatched: Unmatched,
    header_style: HeaderStyle,
    recent: Recent,
}

impl Engine {
    /// An engine over `store` (already wrapped in its layers), counting
    /// rejections in `top`, admitting native requests no rule applies to.
    pub fn new(store: Arc<dyn Layer>, clock: Arc<dyn Clock>, top: Arc<TopLimited>) -> Self {
        Self {
            store,
            clock,
            top,
            leases: leases::LeaseBook::default(),
            unmatched: Unmatched::Allow,
            header_style: HeaderStyle::default(),
            recent: Recent::new(),
        }
    }

    /// Which RateLimit header fields answers carry.
    pub fn with_header_style(mut self, style: HeaderStyle) -> Self {
        self.header_style = style;
        self
    }

    /// The header fields of `item`'s answer (`None`: of the whole
    /// answer), in the engine's [`HeaderStyle`]; `demand` is the one
    /// `answer` decided.
    pub fn header_fields(
        &self,
        demand: &Demand<'_>,
        answer: &Answer,
        item: Option<usize>,
    ) -> Fields {
        fields::header_fields(self.header_style, demand, answer, item)
    }

    /// What to do with a native request no rule applies to. (Envoy's
    /// protocol answers `OK` for a descriptor without a limit, so its
    /// demands are never refused for that.)
    pub fn with_unmatched(mut self, unmatched: Unmatched) -> Self {
        self.unmatched = unmatched;
        self
    }

    /// The engine's clock, now.
    pub fn now(&self) -> Micros {
        self.clock.now()
    }

    /// The most recent decisions per key (sampled; see [`Recent`]).
    pub fn recent(&self) -> &Recent {
        &self.recent
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
        self.decide_attached(demand, &mut None, span).await
    }

    /// Decides a demand of one item and, when admitted with the store's
    /// answer (not a fallback's), records a reservation of the item's cost
    /// per line for the time to live `asked` (microseconds as the caller
    /// sent it, checked against [`Ttl::Reservation`]; `None`: the default):
    /// settle it with [`Engine::settle`]. An invalid time to live refuses
    /// the demand like any invalid field.
    pub async fn reserve(
        &self,
        demand: &mut Demand<'_>,
        asked: Option<i128>,
        span: &tracing::Span,
    ) -> Result<Reserved, DecideError> {
        let ttl = Ttl::Reservation.check(asked).inspect_err(|_| {
            refused(demand.api, 1, span);
        })?;
        let tenant = demand.items.first().map_or("", |i| i.tenant).to_owned();
        let estimate = demand.items.first().map_or(0, |i| i.cost);
        let reservation = Reservation {
            id: record_id(demand, &tenant),
            estimate,
            lines: Vec::new(),
            ttl,
        };
        let mut recorded = Some(Attachment::Reservation(reservation));
        let answer = self.decide_attached(demand, &mut recorded, span).await?;
        let reservation = match recorded {
            Some(Attachment::Reservation(r)) => {
                metrics::reserved(demand.api.label(), r.estimate);
                Some(r.id)
            }
            _ => None,
        };
        Ok(Reserved {
            answer,
            reservation,
            ttl,
        })
    }

    /// Settles the reservation `token` (as `Reserve` returned it) at
    /// `actual` per line (see [`crate::store::Store::settle`]). A token
    /// that is not a reservation's is refused and counted as an `invalid`
    /// settle.
    pub async fn settle(
        &self,
        api: Api,
        token: &str,
        actual: u64,
    ) -> Result<SettleAnswer, DecideError> {
        let Some(id) = ReservationId::parse(token) else {
            metrics::settle_outcome(api.label(), "invalid");
            return Err(DecideError::InvalidToken(format!(
                "reservation {:?} is not a token Reserve returned (they start with \"r1.\")",
                error::shortened(token)
            )));
        };
        let applied = actual.min(caps::MAX_COST);
        let settled = self.store.settle(&id, applied).await.map_err(|e| {
            metrics::settle_outcome(api.label(), "error");
            DecideError::from(e)
        })?;
        metrics::settle_outcome(api.label(), settled.status_label());
        let actual = match settled.status {
            SettleStatus::Unknown => return Err(DecideError::UnknownReservation(id.to_string())),
            SettleStatus::Expired => {
                return Err(DecideError::ExpiredReservation {
                    id: id.to_string(),
                    estimate: settled.estimate,
                });
            }
            SettleStatus::AlreadySettled { actual } => actual,
            // The usage as reported (the store applies at most `MAX_COST`,
            // above every capacity).
            SettleStatus::Settled => actual,
        };
        let mut tightest: Option<Verdict> = None;
        for v in &settled.verdicts {
            if tightest.is_none_or(|t| summary::tighter(true, v, true, &t)) {
                tightest = Some(*v);
            }
        }
        let refunded = settled.estimate.saturating_sub(actual);
        let charged = actual.saturating_sub(settled.estimate);
        let forgiven: u64 = settled.verdicts.iter().map(|v| v.forgiven).sum();
        if settled.status == SettleStatus::Settled {
            metrics::settled(api.label(), refunded, charged);
            metrics::forgiven(api.label(), forgiven);
            if let Some(t) = tightest.filter(|t| t.debt > 0) {
                self.top.record_debt(id.tenant(), "", t.debt);
            }
        }
        Ok(SettleAnswer {
            status: settled.status,
            estimate: settled.estimate,
            actual,
            refunded,
            charged,
            tightest: tightest.unwrap_or(Verdict::admitted()),
            forgiven,
        })
    }

    /// What the demand's buckets hold now, read in one store call without
    /// spending or writing anything, and without counting a decision (for
    /// the usage API): each line's verdict for a cost of nothing. A line
    /// whose store-unavailable policy answered is marked degraded in its
    /// item. The demand's quota lines are left in the period read
    /// ([`Limit::period`] of their allowance).
    pub async fn read(&self, demand: &mut Demand<'_>) -> Result<Answer, DecideError> {
        for item in &mut demand.items {
            item.cost = 0;
        }
        self.dry_run(demand).await
    }

    /// What the demand would get now, decided as a dry run (nothing spent
    /// or written) in one store call, and not counted anywhere: no metric,
    /// no top-limited entry, no recent decision.
    pub async fn dry_run(&self, demand: &mut Demand<'_>) -> Result<Answer, DecideError> {
        demand.op = Op::DRY;
        self.apply_demand(demand, &mut None).await
    }

    /// Decides a demand and, when the store itself admits it (not a
    /// fallback), writes what is attached: `attached` is left as it is, or
    /// `None` when nothing was written. The answer alone is returned (and
    /// the attachment kept by reference) so that it moves as few times as
    /// it can: it is hundreds of bytes.
    async fn decide_attached(
        &self,
        demand: &mut Demand<'_>,
        attached: &mut Option<Attachment>,
        span: &tracing::Span,
    ) -> Result<Answer, DecideError> {
        let result = self.apply_demand(demand, attached).await;
        match &result {
            Ok(answer) => self.record(demand, answer, span),
            Err(_) => refused(demand.api, demand.items.len().max(1), span),
        }
        result
    }

    /// [`Engine::decide_attached`] without the counting.
    async fn apply_demand(
        &self,
        demand: &mut Demand<'_>,
        attached: &mut Option<Attachment>,
    ) -> Result<Answer, DecideError> {
        // Filled in place: the merged charges are hundreds of bytes, and
        // every return by value would copy them.
        let mut merged = Merged::default();
        match self.prepare(demand, &mut merged) {
            Err(err) => Err(err),
            Ok(()) if merged.charges.is_empty() => {
                *attached = None;
                Ok(self.answer(demand, &merged, None))
            }
            Ok(()) => {
                if let Some(Attachment::Reservation(r)) = attached {
                    r.lines = merged.lines.iter().map(|&n| u64::from(n)).collect();
                }
                let request = merged.request(demand.op, attached.as_ref());
                match self.store.apply_now(request) {
                    Some(applied) => applied
                        .map(|a| self.answer_attached(demand, &merged, a, attached))
                        .map_err(Into::into),
                    None => {
                        // Boxed across the wait, so that this future (and
                        // every one above it) holds a pointer, not the
                        // merged charges, and they move into the box once.
                        let merged = Box::new(merged);
                        let applied = self
                            .store
                            .apply(merged.request(demand.op, attached.as_ref()))
                            .await;
                        applied
                            .map(|a| self.answer_attached(demand, &merged, a, attached))
                            .map_err(Into::into)
                    }
                }
            }
        }
    }

    /// The answer to a decision, dropping the attachment unless the store
    /// admitted it and wrote it: a reservation only when the backend
    /// itself answered; a lease also when the `local` fallback took it
    /// (it lives in the in-process store, where a release finds it).
    fn answer_attached(
        &self,
        demand: &Demand<'_>,
        merged: &Merged,
        applied: Applied,
        attached: &mut Option<Attachment>,
    ) -> Answer {
        let kept = applied.outcome.allowed
            && match attached {
                Some(Attachment::Lease(_)) => {
                    !applied.degraded
                        || merged.charges.iter().zip(&merged.policies).any(|(c, p)| {
                            c.limit.is_concurrency() && *p == OnStoreUnavailable::Local
                        })
                }
                _ => !applied.degraded,
            };
        if !kept {
            *attached = None;
        }
        self.answer(demand, merged, Some(applied))
    }

    /// Validates the demand and merges its lines into `merged`'s charges.
    fn prepare(&self, demand: &mut Demand<'_>, merged: &mut Merged) -> Result<(), DecideError> {
        caps::check_demand(demand)?;
        if demand.lines.iter().any(|l| l.calendar.is_some()) {
            let now = self.clock.now();
            for line in &mut demand.lines {
                if let (Some((period, cycle)), Allowance::Limited(limit)) =
                    (line.calendar, &mut line.allowance)
                {
                    *limit = limit.in_period(cycle.bounds(period, now));
                }
            }
        }
        if demand.shadow {
            for line in &mut demand.lines {
                line.enforce = false;
            }
        }
        if self.unmatched == Unmatched::Deny && demand.api == Api::Native {
            let unmatched = (0..demand.items.len())
                .find(|&i| !demand.lines.iter().any(|l| l.item == i))
                .map(|i| demand.items[i]);
            if let Some(item) = unmatched {
                return Err(DecideError::NoRule {
                    tenant: item.tenant.into(),
                    resource: item.resource.into(),
                });
            }
        }
        merge(demand, merged)
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
                        debt: 0,
                        forgiven: 0,
                        retry_after: Micros::MAX,
                        reset_after: window.max(1) - now % window.max(1),
                    },
                    _ => Verdict {
                        allowed: true,
                        remaining: u64::MAX,
                        debt: 0,
                        forgiven: 0,
                        retry_after: 0,
                        reset_after: 0,
                    },
                }
            })
            .collect();
        let mut answer = summary::summarise(demand, lines, degraded);
        answer.forgiven = outcome.map_or(0, |o| o.verdicts.iter().map(|v| v.forgiven).sum());
        answer
    }

    /// Counts the answer's items by outcome and deciding rule (one counter
    /// update per run of equal items), records rejections in the
    /// top-limited sketch, and fills the current span's outcome.
    fn record(&self, demand: &Demand<'_>, answer: &Answer, span: &tracing::Span) {
        self.record_quotas(demand, answer);
        if !demand.op.decides() {
            return self.record_charge(demand, answer, span);
        }
        let mut run: Option<(Outcome, &str, u64, u64)> = None;
        let now = self.clock.now();
        for (item, a) in demand.items.iter().zip(&answer.items) {
            let label = a.line.map_or("", |l| demand.lines[l].label);
            self.recent
                .record(item.tenant, item.key, now, a.outcome, label, item.cost);
            if !a.allowed {
                self.top.record(item.tenant, item.key, 1);
            }
            if a.debt > 0 {
                self.top.record_debt(item.tenant, item.key, a.debt);
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

impl Engine {
    /// Records how full each quota of the demand is, for the tenants
    /// nearest their quota ([`TopLimited::nearest_quota`]).
    fn record_quotas(&self, demand: &Demand<'_>, answer: &Answer) {
        for (line, verdict) in demand.lines.iter().zip(&answer.lines) {
            if line.calendar.is_none() {
                continue;
            }
            let Allowance::Limited(limit) = line.allowance else {
                continue;
            };
            let Some(period) = limit.period() else {
                continue;
            };
            let used = (limit.burst() - verdict.remaining.min(limit.burst())) + verdict.debt;
            let tenant = demand.items[line.item].tenant;
            self.top
                .record_quota(tenant, line.label, used, limit.burst(), period.end);
        }
    }

    /// Records usage charged after the fact (tokens charged and forgiven,
    /// and the tenants left in debt) or refunded (tokens given back).
    fn record_charge(&self, demand: &Demand<'_>, answer: &Answer, span: &tracing::Span) {
        let api = demand.api.label();
        let mut charged = 0u64;
        for (item, a) in demand.items.iter().zip(&answer.items) {
            // What the store applied: a cost is clamped to `MAX_COST`.
            charged = charged.saturating_add(item.cost.min(caps::MAX_COST));
            if a.debt > 0 {
                self.top.record_debt(item.tenant, item.key, a.debt);
            }
        }
        if matches!(demand.op, Op::Refund { .. }) {
            metrics::refunded(api, charged);
            if !span.is_disabled() {
                span.record("outcome", "refunded");
            }
            return;
        }
        metrics::charged(api, charged);
        metrics::forgiven(api, answer.forgiven);
        if !span.is_disabled() {
            span.record("outcome", "charged");
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
#[derive(Default)]
struct Merged {
    buckets: SmallVec<[BucketKey; INLINE]>,
    charges: SmallVec<[Charge; INLINE]>,
    policies: SmallVec<[OnStoreUnavailable; INLINE]>,
    /// For each charge, how many lines it merges.
    lines: SmallVec<[u32; INLINE]>,
    /// For each line, the charge it adds to (limited lines only).
    line_charge: SmallVec<[Option<usize>; INLINE]>,
}

impl Merged {
    fn request<'a>(&'a self, op: Op, attachment: Option<&'a Attachment>) -> Request<'a> {
        Request {
            buckets: &self.buckets,
            charges: &self.charges,
            policies: &self.policies,
            op,
            attachment,
        }
    }
}

/// Merges lines that share a bucket into one charge, adding their costs
/// (saturating, and clamped to [`caps::MAX_COST`], above every capacity),
/// and checks the bucket cap and each enforced cost against its capacity.
/// The lines' buckets move into the charges (a line's own is left empty).
/// The id of a record (a reservation's or a lease's) written beside
/// `demand`'s buckets: one that names its key when every bucket is that
/// key's own, so that a store spreading keys over slots files the record
/// with them; otherwise one filed with the tenant's buckets.
fn record_id<K: crate::store::record_id::RecordKind>(
    demand: &Demand<'_>,
    tenant: &str,
) -> crate::store::record_id::RecordId<K> {
    use crate::store::record_id::RecordId;
    let mut buckets = demand.lines.iter().map(|l| &l.bucket);
    match buckets.next() {
        Some(first)
            if first.is_per_key() && buckets.all(|b| b.is_per_key() && b.key() == first.key()) =>
        {
            RecordId::for_key(tenant, first.key())
        }
        _ => RecordId::new(tenant),
    }
}

fn merge(demand: &mut Demand<'_>, merged: &mut Merged) -> Result<(), DecideError> {
    let deciding = demand.op.decides();
    let mut index = summary::BucketIndex::default();
    for n in 0..demand.lines.len() {
        let line = &demand.lines[n];
        let item = &demand.items[line.item];
        let (limit, cost, need) = match line.allowance {
            // A concurrency cap: one slot per lease, whatever the tokens.
            Allowance::Limited(limit) if limit.is_concurrency() => (limit, 1, 1),
            Allowance::Limited(limit) => {
                let cost = item.cost.min(caps::MAX_COST);
                // An ask (a decision of nothing) needs a token where debt
                // is allowed: a caller in debt waits for the refill.
                let ask = deciding && cost == 0 && limit.debt() > 0;
                (limit, cost, if ask { 1 } else { cost })
            }
            // A limit of zero is a charge no bucket can hold: the store
            // denies it like any cost above a capacity, so the demand is
            // rejected in the same atomic step and nothing is spent.
            Allowance::Blocked { window } if deciding => {
                (Limit::blocking(window), caps::MAX_COST, caps::MAX_COST)
            }
            // Nothing to charge after the fact where nothing is admitted.
            Allowance::Blocked { .. } | Allowance::Unlimited => {
                merged.line_charge.push(None);
                continue;
            }
        };
        let at = match index.find(&merged.buckets, &line.bucket) {
            Some(c) => {
                let charge = &mut merged.charges[c];
                if !limit.is_concurrency() {
                    charge.cost = charge.cost.saturating_add(cost).min(caps::MAX_COST);
                    charge.need = charge.need.saturating_add(need).min(caps::MAX_COST);
                }
                merged.lines[c] += 1;
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
                    need,
                    enforce,
                });
                merged.policies.push(policy);
                merged.lines.push(1);
                merged.charges.len() - 1
            }
        };
        let line = &demand.lines[n];
        let charge = &merged.charges[at];
        if deciding
            && demand.over_capacity == OverCapacity::Invalid
            && matches!(line.allowance, Allowance::Limited(_))
            && charge.enforce
            && charge.need > limit.burst()
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
                cost: charge.need,
            });
        }
        merged.line_charge.push(Some(at));
    }
    Ok(())
}
