//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`.
//!
//! Each request descriptor is matched against the configuration; the
//! matched limits become charges on the same limiter and stores as the
//! native API, decided in one atomic call. Unlike envoyproxy/ratelimit, a
//! request over the limit of one descriptor spends nothing from the others.

use std::collections::HashMap;
use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::LiveEnvoyConfig;
use super::config::{EnvoyRule, Match, RuleKind};
use crate::bucket::{Charge, Limit, Micros, Rate, RateUnit, Verdict};
use crate::grpc::duration;
use crate::grpc::proto::envoy::config::core::v3::HeaderValue;
use crate::grpc::proto::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit, rate_limit::Unit,
};
use crate::grpc::proto::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use crate::grpc::proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use crate::grpc::status::from_decide_error;
use crate::limiter::Limiter;
use crate::limits::OnStoreUnavailable;
use crate::store::BucketKey;
use crate::telemetry::metrics::{self, Outcome};
use crate::telemetry::top::TopLimited;
use crate::telemetry::traces;
use tracing::Instrument;

pub use crate::grpc::proto::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;

const API: &str = "envoy";

/// Service-wide options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnvoyOptions {
    /// Global shadow mode: count everything, never answer OVER_LIMIT.
    pub shadow_mode: bool,
    /// Add `RateLimit-*` (and, when over limit, `Retry-After`) to
    /// `response_headers_to_add`.
    pub response_headers: bool,
}

impl Default for EnvoyOptions {
    fn default() -> Self {
        Self {
            shadow_mode: false,
            response_headers: true,
        }
    }
}

/// Serves Envoy's rate limit service over a [`Limiter`].
pub struct EnvoyRateLimitService {
    limiter: Arc<Limiter>,
    config: Arc<LiveEnvoyConfig>,
    options: EnvoyOptions,
    top: Arc<TopLimited>,
}

impl EnvoyRateLimitService {
    /// The service; rejections are counted in `top` under the tenant
    /// `~DOMAIN`.
    pub fn new(
        limiter: Arc<Limiter>,
        config: Arc<LiveEnvoyConfig>,
        options: EnvoyOptions,
        top: Arc<TopLimited>,
    ) -> Self {
        Self {
            limiter,
            config,
            options,
            top,
        }
    }
}

/// How one request descriptor is decided.
enum Plan {
    /// No rule: OK, no limit reported.
    NoRule,
    /// A rule that needs no store: unlimited or blocked.
    Fixed(Arc<EnvoyRule>),
    /// A charge on the store.
    Charged(Arc<EnvoyRule>, usize),
}

#[tonic::async_trait]
impl RateLimitService for EnvoyRateLimitService {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let req = request.get_ref();
        if req.domain.is_empty() {
            return Err(Status::invalid_argument(
                "rate limit domain must not be empty",
            ));
        }
        if req.descriptors.is_empty() {
            return Err(Status::invalid_argument(
                "rate limit descriptor list must not be empty",
            ));
        }
        let span = traces::decision_span(
            "ShouldRateLimit",
            request.metadata(),
            &req.domain,
            u64::from(req.hits_addend.max(1)),
        );
        let config = self.config.snapshot();
        let request_hits = u64::from(req.hits_addend.max(1));

        // Match every descriptor.
        let mut matched: Vec<Option<(Match, u64)>> = Vec::with_capacity(req.descriptors.len());
        for d in &req.descriptors {
            let entries: Vec<(&str, &str)> = d
                .entries
                .iter()
                .map(|e| (e.key.as_str(), e.value.as_str()))
                .collect();
            let hits = d.hits_addend.unwrap_or(request_hits);
            let found = match &d.limit {
                Some(over) => {
                    override_rule(&req.domain, &entries, over.requests_per_unit, over.unit)
                }
                None => config.find(&req.domain, &entries),
            };
            matched.push(found.map(|m| (m, hits)));
        }
        // A matched rule that `replaces` another drops it from this request.
        let replaced: Vec<&str> = matched
            .iter()
            .flatten()
            .flat_map(|(m, _)| m.rule.replaces.iter().map(String::as_str))
            .collect();

        let mut plans = Vec::with_capacity(matched.len());
        let (mut buckets, mut charges, mut policies) =
            (Vec::new(), Vec::<Charge>::new(), Vec::new());
        let mut counters: Vec<&str> = Vec::new();
        let mut index: HashMap<BucketKey, usize> = HashMap::new();
        let domain = encode_domain(&req.domain);
        for found in &matched {
            let plan = match found {
                None => Plan::NoRule,
                Some((m, _))
                    if !m.rule.name.is_empty() && replaced.contains(&m.rule.name.as_str()) =>
                {
                    Plan::NoRule
                }
                Some((m, hits)) => match m.rule.kind {
                    RuleKind::Unlimited | RuleKind::Block => Plan::Fixed(m.rule.clone()),
                    RuleKind::Limited(limit) => {
                        let bucket =
                            BucketKey::new(&domain, "e", limit.algorithm().as_str(), &m.counter);
                        let at = *index.entry(bucket.clone()).or_insert_with(|| {
                            buckets.push(bucket);
                            charges.push(Charge {
                                limit,
                                cost: 0,
                                enforce: !m.rule.shadow,
                            });
                            policies.push(m.rule.on_store_unavailable);
                            counters.push(&m.counter);
                            charges.len() - 1
                        });
                        charges[at].cost += hits;
                        Plan::Charged(m.rule.clone(), at)
                    }
                },
            };
            plans.push(plan);
        }

        let (outcome, degraded) = if charges.is_empty() {
            (None, false)
        } else {
            match self
                .limiter
                .apply(&buckets, &charges, &policies, true)
                .instrument(span.clone())
                .await
            {
                Ok((outcome, degraded)) => (Some(outcome), degraded),
                Err(err) => return Err(from_decide_error(err)),
            }
        };

        let mut over = false;
        let mut statuses = Vec::with_capacity(plans.len());
        let mut tightest: Option<(&EnvoyRule, Verdict)> = None;
        for plan in &plans {
            let status = match plan {
                Plan::NoRule => DescriptorStatus {
                    code: Code::Ok as i32,
                    ..Default::default()
                },
                Plan::Fixed(rule) => {
                    let blocked = rule.kind == RuleKind::Block && !rule.shadow;
                    over |= blocked;
                    record(rule, degraded, blocked, charges_cost(&matched, rule));
                    DescriptorStatus {
                        code: if blocked { Code::OverLimit } else { Code::Ok } as i32,
                        current_limit: (rule.kind == RuleKind::Block).then(|| current_limit(rule)),
                        limit_remaining: if rule.kind == RuleKind::Unlimited {
                            u32::MAX
                        } else {
                            0
                        },
                        ..Default::default()
                    }
                }
                Plan::Charged(rule, at) => {
                    let verdict = outcome.as_ref().map(|o| o.verdicts[*at]).expect("charged");
                    let rejected = !verdict.allowed && !rule.shadow;
                    over |= rejected;
                    if rejected {
                        self.top.record(
                            &format!("~{}", req.domain),
                            counters[*at],
                            charges[*at].cost,
                        );
                    }
                    record(rule, degraded, rejected, charges[*at].cost);
                    if tighter(&verdict, tightest.as_ref().map(|(_, v)| v)) {
                        tightest = Some((rule, verdict));
                    }
                    DescriptorStatus {
                        code: if rejected { Code::OverLimit } else { Code::Ok } as i32,
                        current_limit: Some(current_limit(rule)),
                        limit_remaining: u32::try_from(verdict.remaining).unwrap_or(u32::MAX),
                        duration_until_reset: Some(duration(verdict.reset_after)),
                        quota: None,
                    }
                }
            };
            statuses.push(status);
        }

        let mut response_headers_to_add = Vec::new();
        if let (true, Some((rule, v))) = (self.options.response_headers, tightest) {
            let limit = match rule.kind {
                RuleKind::Limited(limit) => limit.burst(),
                _ => 0,
            };
            let mut add = |k: &str, v: String| {
                response_headers_to_add.push(HeaderValue {
                    key: k.into(),
                    value: v,
                    raw_value: Vec::new(),
                })
            };
            add("RateLimit-Limit", limit.to_string());
            add("RateLimit-Remaining", v.remaining.to_string());
            add(
                "RateLimit-Reset",
                v.reset_after.div_ceil(1_000_000).to_string(),
            );
            if over && !v.allowed && v.retry_after != Micros::MAX {
                add("Retry-After", v.retry_after.div_ceil(1_000_000).to_string());
            }
        }
        let overall = if over && !self.options.shadow_mode {
            Code::OverLimit
        } else {
            Code::Ok
        };
        span.record("outcome", if over { "rejected" } else { "allowed" });
        if let Some((rule, _)) = tightest {
            span.record("rule", rule.full_key.as_str());
        }
        Ok(Response::new(RateLimitResponse {
            overall_code: overall as i32,
            statuses,
            response_headers_to_add,
            ..Default::default()
        }))
    }
}

/// The descriptor's hits for a rule decided without the store.
fn charges_cost(matched: &[Option<(Match, u64)>], rule: &EnvoyRule) -> u64 {
    matched
        .iter()
        .flatten()
        .find(|(m, _)| std::ptr::eq(m.rule.as_ref(), rule))
        .map_or(1, |(_, hits)| *hits)
}

fn record(rule: &EnvoyRule, degraded: bool, rejected: bool, hits: u64) {
    let outcome = match (degraded, rule.on_store_unavailable, rejected, rule.shadow) {
        (true, OnStoreUnavailable::Allow, ..) => Outcome::FailedOpen,
        (true, OnStoreUnavailable::Deny, ..) => Outcome::FailedClosed,
        (true, OnStoreUnavailable::Local, ..) => Outcome::LocalFallback,
        (false, _, true, _) => Outcome::Rejected,
        (false, _, false, true) => Outcome::ShadowRejected,
        (false, _, false, false) => Outcome::Allowed,
    };
    metrics::decision(API, outcome, &rule.full_key, hits);
}

/// The tightest verdict: a rejection with the longest wait, else the fewest
/// tokens left.
fn tighter(v: &Verdict, than: Option<&Verdict>) -> bool {
    let Some(t) = than else { return true };
    match (v.allowed, t.allowed) {
        (false, true) => true,
        (true, false) => false,
        (false, false) => v.retry_after > t.retry_after,
        (true, true) => v.remaining < t.remaining,
    }
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
/// envoyproxy/ratelimit treats it, never in shadow mode.
fn override_rule(
    domain: &str,
    entries: &[(&str, &str)],
    requests_per_unit: u32,
    unit: i32,
) -> Option<Match> {
    let unit = match unit {
        1 => RateUnit::Second,
        2 => RateUnit::Minute,
        3 => RateUnit::Hour,
        4 => RateUnit::Day,
        5 => RateUnit::Month,
        6 => RateUnit::Year,
        7 => RateUnit::Week,
        _ => return None,
    };
    let counter: Vec<String> = entries
        .iter()
        .map(|(k, v)| {
            if v.is_empty() {
                k.to_string()
            } else {
                format!("{k}_{v}")
            }
        })
        .collect();
    let counter = counter.join(".");
    let kind = match Limit::window(
        crate::bucket::Algorithm::FixedWindow,
        Rate {
            count: u64::from(requests_per_unit),
            unit,
        },
    ) {
        Ok(limit) => RuleKind::Limited(limit),
        Err(_) => RuleKind::Block,
    };
    Some(Match {
        rule: Arc::new(EnvoyRule {
            full_key: format!("{domain}.{counter}"),
            name: String::new(),
            replaces: Vec::new(),
            kind,
            requests_per_unit,
            unit,
            shadow: false,
            detailed_metric: false,
            on_store_unavailable: OnStoreUnavailable::Allow,
        }),
        counter: format!("override:{counter}"),
    })
}

/// A domain as the tenant part of a bucket name: characters outside
/// `[A-Za-z0-9._-]` are percent-encoded, so any domain is safe as a Redis
/// hash tag and in `tenant:scope:resource:key`.
fn encode_domain(domain: &str) -> String {
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
