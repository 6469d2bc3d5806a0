//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`.
//!
//! Proto mapping plus envoyproxy/ratelimit's rule lookup: each request
//! descriptor becomes one item of a [`Demand`], with one line for the rule
//! it matches; the engine decides them together in one atomic call. Unlike
//! envoyproxy/ratelimit, a request over the limit of one descriptor spends
//! nothing from the others.
//!
//! Two Tollgate extensions serve costs known only after the response (LLM
//! tokens), through a stock Envoy:
//!
//! - a descriptor whose `hits_addend` is an explicit 0 and whose rule
//!   allows debt *asks without spending*: it is admitted while the bucket
//!   holds at least one token (envoyproxy/ratelimit answers such an ask OK
//!   even at zero; so does Tollgate for rules without debt);
//! - a descriptor carrying the entry [`CHARGE_ENTRY`] (Envoy's
//!   `generic_key` action with that `descriptor_key`, on the rate limit
//!   applied `apply_on_stream_done`) is *charged after the fact*: its
//!   `hits_addend` is applied in full, into debt where the rule allows it,
//!   whatever the balance. The entry is dropped before matching.

use std::sync::Arc;

use tonic::{Request, Response, Status};
use tracing::Instrument;

use super::LiveEnvoyConfig;
use super::config::{EnvoyRule, Match, RuleKind};
use crate::algorithm::{Algorithm, Limit, Micros, Op, Rate, RateUnit};
use crate::api::{duration, status};
use crate::engine::{
    self, Allowance, Api, DecideError, Demand, Engine, Fields, Item, Line, OverCapacity, caps,
};
use crate::engine::{BucketKey, BucketKind};
use crate::limits::OnStoreUnavailable;
use crate::proto::envoy::config::core::v3::HeaderValue;
use crate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use crate::proto::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit, rate_limit::Unit,
};
use crate::proto::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use crate::proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use crate::telemetry::traces;

pub use crate::proto::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;

/// The metric label of every limit sent in a request (`limit` override):
/// request values never become label values.
pub const OVERRIDE_LABEL: &str = "override";

/// The descriptor entry key that marks usage to charge after the fact.
pub const CHARGE_ENTRY: &str = "tollgate.charge";

/// The descriptor entry key that says when a refund's tokens were charged
/// (Unix seconds, optionally with a fraction): a window or a quota gives
/// them back only while the window that counted them still counts. Dropped
/// before matching, like [`CHARGE_ENTRY`].
pub const SINCE_ENTRY: &str = "tollgate.since";

/// Service-wide options.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::Args)]
pub struct EnvoyOptions {
    /// Envoy API global shadow mode: count, but never answer OVER_LIMIT.
    #[arg(id = "envoy_shadow_mode", long = "envoy-shadow-mode", env = "TOLLGATE_ENVOY_SHADOW_MODE", action = clap::ArgAction::Set, num_args = 0..=1, default_value_t = false, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub shadow_mode: bool,
    /// Add the RateLimit header fields (as --rate-limit-headers says) and,
    /// when over the limit, Retry-After to Envoy's response_headers_to_add.
    #[arg(id = "envoy_response_headers", long = "envoy-response-headers", env = "TOLLGATE_ENVOY_RESPONSE_HEADERS", action = clap::ArgAction::Set, num_args = 0..=1, default_value_t = true, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub response_headers: bool,
}

impl Default for EnvoyOptions {
    fn default() -> Self {
        crate::options::defaults()
    }
}

/// Serves Envoy's rate limit service through the [`Engine`].
pub struct EnvoyRateLimitService {
    engine: Arc<Engine>,
    config: Arc<LiveEnvoyConfig>,
    options: EnvoyOptions,
}

impl EnvoyRateLimitService {
    /// The service; rejections are counted in the top-limited views under
    /// the tenant `~DOMAIN` (characters outside `[A-Za-z0-9._-]`
    /// percent-encoded).
    pub fn new(engine: Arc<Engine>, config: Arc<LiveEnvoyConfig>, options: EnvoyOptions) -> Self {
        Self {
            engine,
            config,
            options,
        }
    }

    pub(super) fn engine(&self) -> &Engine {
        &self.engine
    }

    pub(super) fn config(&self) -> &LiveEnvoyConfig {
        &self.config
    }

    pub(super) fn options(&self) -> &EnvoyOptions {
        &self.options
    }
}

/// The rule each descriptor matched, after `replaces`, with its hits.
type Matched = Vec<Option<(Match, u64)>>;

#[tonic::async_trait]
impl RateLimitService for EnvoyRateLimitService {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let req = request.get_ref();
        let request_hits = u64::from(req.hits_addend.max(1));
        let domain_for_span = truncate(&req.domain, caps::MAX_DOMAIN_BYTES);
        let span = traces::decision_span(
            "ShouldRateLimit",
            request.metadata(),
            domain_for_span,
            request_hits,
        );
        let refuse = |err: DecideError| {
            engine::refused(Api::Envoy, req.descriptors.len(), &span);
            status::from_decide_error(err)
        };
        check(req).map_err(refuse)?;
        let charging = charging(req).map_err(refuse)?;
        let matched = self.matched(req, request_hits).map_err(refuse)?;
        let mut shares = shares(req, &matched).map_err(refuse)?;
        if charging {
            net(&matched, &mut shares);
        }
        // The tenant part of bucket names, and the tenant the top-limited
        // views count rejections under: `~DOMAIN`, percent-encoded.
        let tenant = encode_domain(&req.domain);
        // Refunds first, so the decision of the same request sees them.
        let refunded = match shares.iter().any(|s| s.refund) {
            true => {
                let since = refund_since(&shares).map_err(refuse)?;
                let op = Op::Refund { since };
                Some(self.decide(&tenant, &matched, &shares, op, &span).await?)
            }
            false => None,
        };
        let decided = match shares.iter().any(|s| !s.refund) {
            true => {
                let op = if charging { Op::Charge } else { Op::SPEND };
                Some(self.decide(&tenant, &matched, &shares, op, &span).await?)
            }
            false => None,
        };

        let (mut nth_refund, mut nth_decided) = (0, 0);
        let statuses = shares
            .iter()
            .zip(&matched)
            .map(|(share, found)| {
                let (answer, nth) = match share.refund {
                    true => (refunded.as_ref(), &mut nth_refund),
                    false => (decided.as_ref(), &mut nth_decided),
                };
                let a = answer.map(|(answer, _)| &answer.items[*nth]);
                *nth += 1;
                match (found, a) {
                    (Some((m, _)), Some(a)) => self.status(&m.rule, a),
                    _ => DescriptorStatus {
                        code: Code::Ok as i32,
                        ..Default::default()
                    },
                }
            })
            .collect();
        let fields = decided.as_ref().or(refunded.as_ref()).map(|(_, f)| f);
        let response_headers_to_add = fields
            .into_iter()
            .flatten()
            .map(|(key, value)| HeaderValue {
                key: (*key).into(),
                value: value.clone(),
                raw_value: Vec::new(),
            })
            .collect();
        let overall = if decided.as_ref().is_none_or(|(a, _)| a.allowed) {
            Code::Ok
        } else {
            Code::OverLimit
        };
        Ok(Response::new(RateLimitResponse {
            overall_code: overall as i32,
            statuses,
            response_headers_to_add,
            ..Default::default()
        }))
    }
}

impl EnvoyRateLimitService {
    /// Decides, charges or refunds (as `op` says) the descriptors whose
    /// shares are refunds (for [`Op::Refund`]) or not (any other op), as
    /// one demand: one item per descriptor, in order. Answers with the
    /// header fields of the whole answer (none unless the options ask).
    async fn decide(
        &self,
        tenant: &str,
        matched: &Matched,
        shares: &[Share],
        op: Op,
        span: &tracing::Span,
    ) -> Result<(engine::Answer, Fields), Status> {
        let refund = matches!(op, Op::Refund { .. });
        let mut demand = Demand::new(Api::Envoy, op, OverCapacity::Reject);
        demand.shadow = self.options.shadow_mode;
        for (found, share) in matched.iter().zip(shares) {
            if share.refund != refund {
                continue;
            }
            let i = demand.items.len();
            let key = found.as_ref().map_or("", |(m, _)| m.counter.as_str());
            let key = truncate(key, caps::MAX_KEY_BYTES);
            demand.items.push(Item::new(tenant, "", key, share.cost));
            let Some((m, _)) = found else { continue };
            demand.lines.push(line(tenant, i, m));
        }
        let decided = self.engine.decide(&mut demand, span);
        // Log events inside belong to the decision's span when it is traced.
        let answer = if span.is_disabled() {
            decided.await
        } else {
            decided.instrument(span.clone()).await
        }
        .map_err(status::from_decide_error)?;
        let fields = match self.options.response_headers {
            true => self.engine.header_fields(&demand, &answer, None),
            false => Fields::new(),
        };
        Ok((answer, fields))
    }

    /// A matched descriptor's status.
    fn status(&self, rule: &EnvoyRule, a: &engine::ItemAnswer) -> DescriptorStatus {
        // In global shadow mode every descriptor that would be over still
        // says so, while the overall answer is OK.
        let over = !a.allowed || (self.options.shadow_mode && a.shadow);
        let code = if over { Code::OverLimit } else { Code::Ok };
        match rule.kind {
            RuleKind::Unlimited => DescriptorStatus {
                code: code as i32,
                limit_remaining: u32::MAX,
                ..Default::default()
            },
            _ => DescriptorStatus {
                code: code as i32,
                current_limit: Some(current_limit(rule)),
                limit_remaining: u32::try_from(a.remaining).unwrap_or(u32::MAX),
                duration_until_reset: Some(duration(self.reset_after(rule, a))),
                quota: None,
            },
        }
    }

    /// When the descriptor's limit resets. A fixed window that counts
    /// nothing yet (a request refused by another descriptor spent nothing
    /// in it) still ends with its unit, as envoyproxy/ratelimit reports.
    fn reset_after(&self, rule: &EnvoyRule, a: &engine::ItemAnswer) -> Micros {
        match rule.kind {
            RuleKind::Limited(limit)
                if a.reset_after == 0 && limit.algorithm() == Algorithm::FixedWindow =>
            {
                let window = rule.unit.micros();
                window - self.engine.now() % window
            }
            _ => a.reset_after,
        }
    }
    /// Looks each descriptor up as envoyproxy/ratelimit does; a matched
    /// rule that `replaces` another drops it from this request.
    fn matched(&self, req: &RateLimitRequest, request_hits: u64) -> Result<Matched, DecideError> {
        let config = self.config.snapshot();
        // envoyproxy/ratelimit looks the domain up first: in a domain that
        // is not configured, nothing is limited, overrides included.
        if !config.has_domain(&req.domain) {
            return Ok(vec![None; req.descriptors.len()]);
        }
        let mut matched: Matched = Vec::with_capacity(req.descriptors.len());
        for (i, d) in req.descriptors.iter().enumerate() {
            let entries: Vec<(&str, &str)> = d
                .entries
                .iter()
                .filter(|e| e.key != CHARGE_ENTRY && e.key != SINCE_ENTRY)
                .map(|e| (e.key.as_str(), e.value.as_str()))
                .collect();
            let hits = d.hits_addend.unwrap_or(request_hits);
            let found = match &d.limit {
                Some(over) => Some(override_rule(
                    i,
                    &entries,
                    over.requests_per_unit,
                    over.unit,
                )?),
                None => config.find(&req.domain, &entries),
            };
            matched.push(found.map(|m| (m, hits)));
        }
        let replaced: Vec<String> = matched
            .iter()
            .flatten()
            .flat_map(|(m, _)| m.rule.replaces.iter().cloned())
            .collect();
        if replaced.is_empty() {
            return Ok(matched);
        }
        for found in &mut matched {
            if found
                .as_ref()
                .is_some_and(|(m, _)| !m.rule.name.is_empty() && replaced.contains(&m.rule.name))
            {
                *found = None;
            }
        }
        Ok(matched)
    }
}

/// The line of a descriptor (item `item`) that matched `m`: the one
/// mapping of an Envoy rule to a bucket, for decisions and explanations.
pub(super) fn line<'a>(tenant: &str, item: usize, m: &'a Match) -> Line<'a> {
    let allowance = match m.rule.kind {
        RuleKind::Unlimited => Allowance::Unlimited,
        RuleKind::Block => Allowance::Blocked {
            window: m.rule.unit.micros(),
        },
        RuleKind::Limited(limit) => Allowance::Limited(limit),
    };
    let algorithm = match m.rule.kind {
        RuleKind::Limited(limit) => limit.algorithm(),
        _ => Algorithm::FixedWindow,
    };
    Line {
        item,
        bucket: BucketKey::new(
            tenant,
            BucketKind::Envoy {
                overridden: m.overridden,
            },
            algorithm.as_str(),
            &m.counter,
        ),
        allowance,
        enforce: !m.rule.shadow,
        on_store_unavailable: m.rule.on_store_unavailable,
        // A configured rule's key; overrides have none.
        label: if m.rule.full_key.is_empty() {
            OVERRIDE_LABEL
        } else {
            &m.rule.full_key
        },
        calendar: m.rule.calendar.as_ref().map(|(p, c)| (*p, &**c)),
    }
}

/// The request's shape against the caps, before any lookup.
pub(super) fn check(req: &RateLimitRequest) -> Result<(), DecideError> {
    if req.domain.is_empty() {
        return Err(DecideError::InvalidField(
            "rate limit domain must not be empty".into(),
        ));
    }
    if req.domain.len() > caps::MAX_DOMAIN_BYTES {
        return Err(DecideError::InvalidField(format!(
            "domain is {} bytes; at most {} are allowed",
            req.domain.len(),
            caps::MAX_DOMAIN_BYTES
        )));
    }
    if req.descriptors.is_empty() {
        return Err(DecideError::InvalidBatch(
            "rate limit descriptor list must not be empty".into(),
        ));
    }
    caps::check_items("descriptors", req.descriptors.len())?;
    for (i, d) in req.descriptors.iter().enumerate() {
        check_descriptor(i, d)?;
    }
    Ok(())
}

fn check_descriptor(i: usize, d: &RateLimitDescriptor) -> Result<(), DecideError> {
    if d.entries.len() > caps::MAX_ENTRIES {
        return Err(DecideError::InvalidField(format!(
            "descriptors[{i}].entries has {} entries; at most {} are allowed",
            d.entries.len(),
            caps::MAX_ENTRIES
        )));
    }
    for (j, e) in d.entries.iter().enumerate() {
        caps::check_key(|| format!("descriptors[{i}].entries[{j}].key"), &e.key)?;
        caps::check_key(|| format!("descriptors[{i}].entries[{j}].value"), &e.value)?;
    }
    Ok(())
}

/// Whether the request charges usage after the fact: every descriptor
/// that is not a refund carries [`CHARGE_ENTRY`], or none does.
fn charging(req: &RateLimitRequest) -> Result<bool, DecideError> {
    let marked = |d: &RateLimitDescriptor| d.entries.iter().any(|e| e.key == CHARGE_ENTRY);
    let adding = req.descriptors.iter().filter(|d| !d.is_negative_hits);
    let (n, of) = adding.fold((0, 0), |(n, of), d| (n + usize::from(marked(d)), of + 1));
    if n != 0 && n != of {
        return Err(DecideError::InvalidBatch(format!(
            "{n} of {of} descriptors carry the {CHARGE_ENTRY} entry: a request either charges usage \
             after the fact (every descriptor carries it, as the rate limit applied on stream done) \
             or is decided (none does), not both"
        )));
    }
    Ok(n != 0)
}

/// A refund's `since` when no descriptor gives one ([`SINCE_ENTRY`]): only
/// token buckets, which need no time, take such a refund.
const UNKNOWN_SINCE: Micros = 0;

/// What one descriptor asks of its bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Share {
    /// Tokens to decide, charge or give back.
    cost: u64,
    /// Given back (`is_negative_hits`).
    refund: bool,
    /// A refund's [`SINCE_ENTRY`].
    since: Option<Micros>,
}

/// A descriptor's [`SINCE_ENTRY`] as µs since the epoch: `SECONDS` or
/// `SECONDS.FRACTION` (up to 6 digits).
fn since_of(i: usize, d: &RateLimitDescriptor) -> Result<Option<Micros>, DecideError> {
    let Some(e) = d.entries.iter().find(|e| e.key == SINCE_ENTRY) else {
        return Ok(None);
    };
    let (whole, fraction) = match e.value.split_once('.') {
        Some((whole, fraction)) => (whole, Some(fraction)),
        None => (e.value.as_str(), None),
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let seconds = whole.parse::<u64>().ok().filter(|_| digits(whole));
    let micros = match (seconds, fraction) {
        (Some(s), None) => s.checked_mul(1_000_000),
        (Some(s), Some(f)) if f.len() <= 6 && digits(f) => {
            let scale = 10u64.pow(6 - f.len() as u32);
            let part: u64 = f.parse().unwrap_or(0);
            s.checked_mul(1_000_000)
                .and_then(|m| m.checked_add(part * scale))
        }
        _ => None,
    };
    micros.map(Some).ok_or_else(|| {
        DecideError::InvalidField(format!(
            "descriptors[{i}]: {SINCE_ENTRY} is {:?}; give the time the refunded tokens were \
             charged in Unix seconds, with at most 6 decimals (1733212345 or 1733212345.25)",
            truncate(&e.value, 64)
        ))
    })
}

/// The `since` of a request's refunds: the one time its refunds give, or
/// [`UNKNOWN_SINCE`].
fn refund_since(shares: &[Share]) -> Result<Micros, DecideError> {
    let mut times = shares.iter().filter_map(|s| s.since);
    let first = times.next();
    if let Some(other) = times.find(|&t| Some(t) != first) {
        return Err(DecideError::InvalidBatch(format!(
            "the refunds of one request give {SINCE_ENTRY} {} and {}: send refunds of tokens \
             charged at different times in requests of their own",
            first.unwrap_or_default() as f64 / 1e6,
            other as f64 / 1e6
        )));
    }
    Ok(first.unwrap_or(UNKNOWN_SINCE))
}

/// Each descriptor's share. A refund must reach a rule that takes refunds
/// and give back no more than its bucket can hold; one that matches no
/// rule, or a rule without a bucket (unlimited, or a limit of zero), gives
/// back nothing and is no error.
fn shares(req: &RateLimitRequest, matched: &Matched) -> Result<Vec<Share>, DecideError> {
    let mut shares = Vec::with_capacity(matched.len());
    for (i, (d, found)) in req.descriptors.iter().zip(matched).enumerate() {
        let cost = found
            .as_ref()
            .map_or(u64::from(req.hits_addend.max(1)), |(_, hits)| *hits);
        let refund = d.is_negative_hits;
        let since = if refund { since_of(i, d)? } else { None };
        let nothing = Share {
            cost: 0,
            refund,
            since,
        };
        if refund && found.is_none() {
            shares.push(nothing);
            continue;
        }
        if let (true, Some((m, _))) = (refund, found) {
            let RuleKind::Limited(limit) = m.rule.kind else {
                shares.push(nothing);
                continue;
            };
            let rule = if m.rule.full_key.is_empty() {
                "the limit sent with it".to_owned()
            } else {
                format!("rule {}", m.rule.full_key)
            };
            if !m.rule.refunds {
                crate::telemetry::metrics::refund_refused(Api::Envoy.label(), "not_enabled");
                return Err(DecideError::InvalidField(format!(
                    "descriptors[{i}] gives back {cost} hits (is_negative_hits), but {rule} takes \
                     no refunds; set refunds: true on it, or in its domain, to allow them"
                )));
            }
            if since.is_none() && limit.algorithm() != Algorithm::TokenBucket {
                crate::telemetry::metrics::refund_refused(Api::Envoy.label(), "no_since");
                return Err(DecideError::InvalidField(format!(
                    "descriptors[{i}] gives back {cost} hits (is_negative_hits) to {rule}, a {}, \
                     without the entry {SINCE_ENTRY}: give the time its tokens were charged (Unix \
                     seconds), so that they come back only while the window that counted them \
                     still counts",
                    limit.algorithm().as_str()
                )));
            }
            let capacity = limit.burst().saturating_add(limit.debt());
            if cost > capacity {
                crate::telemetry::metrics::refund_refused(Api::Envoy.label(), "over_capacity");
                return Err(DecideError::InvalidField(format!(
                    "descriptors[{i}] gives back {cost} hits (is_negative_hits), more than {rule} \
                     ever holds ({capacity}: its burst plus its debt)"
                )));
            }
        }
        shares.push(Share {
            cost,
            refund,
            since,
        });
    }
    Ok(shares)
}

/// Nets a charge after the fact: on each bucket that a request both
/// charges and refunds (the estimate given back, the actual usage charged,
/// as Envoy sends them when the stream ends), only the difference is
/// applied, as a settle applies it: the larger side keeps the difference,
/// the other side is zeroed, and all are applied in the larger side's
/// call.
fn net(matched: &Matched, shares: &mut [Share]) {
    let bucket = |i: usize| {
        matched[i]
            .as_ref()
            .filter(|(m, _)| matches!(m.rule.kind, RuleKind::Limited(_)))
            .map(|(m, _)| (m.counter.as_str(), m.overridden))
    };
    for i in 0..shares.len() {
        let Some(this) = bucket(i) else { continue };
        if !shares[i].refund || (0..i).any(|j| bucket(j) == Some(this) && shares[j].refund) {
            continue;
        }
        // The first refund of this bucket: net every share of it.
        let same: Vec<usize> = (0..shares.len())
            .filter(|&j| bucket(j) == Some(this))
            .collect();
        let sum = |refund: bool| -> u64 {
            same.iter()
                .filter(|&&j| shares[j].refund == refund)
                .fold(0u64, |t, &j| t.saturating_add(shares[j].cost))
        };
        let (given, charged) = (sum(true), sum(false));
        let (mut give, mut charge) = (given.saturating_sub(charged), charged.saturating_sub(given));
        for &j in &same {
            let left = if shares[j].refund {
                &mut give
            } else {
                &mut charge
            };
            shares[j].cost = shares[j].cost.min(*left);
            *left -= shares[j].cost;
            // Every share of the bucket in the one call that applies the
            // difference, so each answers what the bucket holds after it.
            shares[j].refund = given > charged;
        }
    }
}

/// `s` cut to at most `max` bytes, at a character boundary.
pub(super) fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn current_limit(rule: &EnvoyRule) -> RateLimit {
    RateLimit {
        name: rule.name.clone(),
        requests_per_unit: rule.requests_per_unit,
        unit: match rule.unit {
            RateUnit::Second => Unit::Second,
            RateUnit::Minute => Unit::Minute,
            RateUnit::Hour => Unit::Hour,
            RateUnit::Day => Unit::Day,
            RateUnit::Week => Unit::Week,
            RateUnit::Month => Unit::Month,
            RateUnit::Year => Unit::Year,
        } as i32,
    }
}

/// A limit sent by Envoy in the descriptor: a fixed window, as
/// envoyproxy/ratelimit treats it, never in shadow mode; a limit of zero
/// blocks. Its metrics are labelled [`OVERRIDE_LABEL`].
pub(super) fn override_rule(
    i: usize,
    entries: &[(&str, &str)],
    requests_per_unit: u32,
    unit: i32,
) -> Result<Match, DecideError> {
    let unit = match unit {
        1 => RateUnit::Second,
        2 => RateUnit::Minute,
        3 => RateUnit::Hour,
        4 => RateUnit::Day,
        5 => RateUnit::Month,
        6 => RateUnit::Year,
        7 => RateUnit::Week,
        other => {
            return Err(DecideError::InvalidField(format!(
                "descriptors[{i}].limit.unit is {other}; use SECOND (1), MINUTE (2), HOUR (3), \
                 DAY (4), MONTH (5), YEAR (6) or WEEK (7)"
            )));
        }
    };
    let counter = entries
        .iter()
        .map(|(k, v)| {
            if v.is_empty() {
                k.to_string()
            } else {
                format!("{k}_{v}")
            }
        })
        .collect::<Vec<_>>()
        .join(".");
    let kind = if requests_per_unit == 0 {
        RuleKind::Block
    } else {
        let rate = Rate {
            count: u64::from(requests_per_unit),
            unit,
        };
        let limit = Limit::window(Algorithm::FixedWindow, rate)
            .map_err(|e| DecideError::InvalidField(format!("descriptors[{i}].limit: {e}")))?;
        RuleKind::Limited(limit)
    };
    Ok(Match {
        rule: Arc::new(EnvoyRule {
            full_key: String::new(),
            name: String::new(),
            replaces: Vec::new(),
            kind,
            requests_per_unit,
            unit,
            shadow: false,
            detailed_metric: false,
            on_store_unavailable: OnStoreUnavailable::Allow,
            calendar: None,
            refunds: false,
        }),
        counter,
        overridden: true,
    })
}

/// A domain as the tenant part of a bucket name: characters outside
/// `[A-Za-z0-9._-]` are percent-encoded, so any domain is safe as a Redis
/// hash tag and in `tenant:scope:resource:key`.
pub(super) fn encode_domain(domain: &str) -> String {
    let mut out = String::with_capacity(domain.len() + 2);
    out.push('~'); // keeps Envoy domains apart from native tenants
    for b in domain.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;

    fn since(value: &str) -> Result<Option<Micros>, DecideError> {
        let d = RateLimitDescriptor {
            entries: vec![Entry {
                key: SINCE_ENTRY.into(),
                value: value.into(),
            }],
            ..Default::default()
        };
        since_of(0, &d)
    }

    #[test]
    fn since_reads_unix_seconds_with_up_to_six_decimals() {
        for (text, micros) in [
            ("1700000000", 1_700_000_000_000_000),
            ("1700000000.25", 1_700_000_000_250_000),
            ("1.5", 1_500_000),
            ("1.000001", 1_000_001),
            ("1.123456", 1_123_456),
            ("0", 0),
        ] {
            assert_eq!(since(text).unwrap(), Some(micros), "{text}");
        }
        for bad in [
            "",
            "1.",
            ".5",
            "1.2a",
            "a",
            "+1",
            "-1",
            "1.1234567",
            "18446744073710",
        ] {
            assert!(since(bad).is_err(), "{bad:?}");
        }
        assert_eq!(since_of(0, &RateLimitDescriptor::default()).unwrap(), None);
    }
}
