//! The explain view on the admin surfaces: `GET /v1/explain` (JSON, the
//! [`crate::api::explain`] model as it is) and `tollgate.v1.Admin/Explain`
//! (its protobuf mapping). Both need the admin token.

use std::sync::Arc;

use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use tonic::Status;

use super::AdminState;
use super::limits::bad;
use crate::algorithm::Micros;
use crate::api::explain::{
    self, BucketState, DryRun, EnvoyExplanation, ExplainError, Explanation, MAX_QUERY_DESCRIPTORS,
    Recent, RuleLimit,
};
use crate::api::{duration, status};
use crate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use crate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use crate::proto::v1;

/// What `GET /v1/explain` reads from its query string.
const USAGE: &str = "query parameters: tenant, key (required) and resource, cost (default 1); \
                     or domain and one descriptor=key=value[,key=value...] per descriptor \
                     ('\\' makes the next character literal), and hits (default 1)";

fn failed(err: ExplainError) -> Response {
    match err {
        ExplainError::Invalid(e) => {
            let status = status::from_decide_error(e);
            let code = match status.code() {
                tonic::Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
                _ => StatusCode::BAD_REQUEST,
            };
            (code, format!("{}\n", status.message())).into_response()
        }
        ExplainError::Unavailable(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the limits table cannot be read: {why}\n"),
        )
            .into_response(),
    }
}

/// `GET /v1/explain`.
pub(super) async fn http(State(state): State<Arc<AdminState>>, RawQuery(q): RawQuery) -> Response {
    let pairs: Vec<(String, String)> =
        match serde_urlencoded::from_str(q.as_deref().unwrap_or_default()) {
            Ok(p) => p,
            Err(e) => return bad(format!("{e}; {USAGE}")),
        };
    let one = |name: &str| {
        pairs
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map_or("", |(_, v)| v.as_str())
    };
    let number = |name: &str| match one(name) {
        "" => Ok(1),
        v => v
            .parse::<u64>()
            .map_err(|_| format!("{name} is {v:?}; send a whole number")),
    };
    if let Some((k, _)) = pairs.iter().find(|(k, _)| {
        !matches!(
            k.as_str(),
            "tenant" | "key" | "resource" | "cost" | "domain" | "descriptor" | "hits"
        )
    }) {
        return bad(format!("unknown parameter {k:?}; {USAGE}"));
    }
    let domain = one("domain");
    if domain.is_empty() {
        let cost = match number("cost") {
            Ok(c) => c,
            Err(why) => return bad(why),
        };
        return match state
            .explain
            .native(one("tenant"), one("key"), one("resource"), cost)
            .await
        {
            Ok(e) => axum::Json(e).into_response(),
            Err(e) => failed(e),
        };
    }
    let hits = match number("hits") {
        Ok(h) => h,
        Err(why) => return bad(why),
    };
    let texts: Vec<&str> = pairs
        .iter()
        .filter(|(k, _)| k == "descriptor")
        .map(|(_, v)| v.as_str())
        .collect();
    if texts.is_empty() {
        return bad(format!("domain without a descriptor; {USAGE}"));
    }
    if texts.len() > MAX_QUERY_DESCRIPTORS {
        return bad(format!(
            "{} descriptors; at most {MAX_QUERY_DESCRIPTORS} fit a query (the gRPC call takes more)",
            texts.len()
        ));
    }
    let mut descriptors = Vec::with_capacity(texts.len());
    for text in texts {
        match explain::parse_descriptor(text) {
            Ok(mut d) => {
                d.hits_addend = Some(hits);
                descriptors.push(d);
            }
            Err(e) => return bad(e),
        }
    }
    match state.explain.envoy(domain, &descriptors).await {
        Ok(e) => axum::Json(e).into_response(),
        Err(e) => failed(e),
    }
}

/// `tollgate.v1.Admin/Explain`, once the token is checked.
pub(super) async fn grpc(
    explainer: &explain::Explainer,
    r: v1::ExplainRequest,
) -> Result<v1::ExplainResponse, Status> {
    let err = |e: ExplainError| match e {
        ExplainError::Invalid(e) => status::from_decide_error(e),
        ExplainError::Unavailable(why) => {
            Status::unavailable(format!("the limits table cannot be read: {why}"))
        }
    };
    if r.domain.is_empty() {
        if !r.descriptors.is_empty() {
            return Err(Status::invalid_argument(
                "descriptors without a domain; set domain to explain an Envoy request, or send \
                 tenant, key and resource for a native one",
            ));
        }
        let e = explainer
            .native(&r.tenant, &r.key, &r.resource, r.cost)
            .await
            .map_err(err)?;
        return Ok(native(e));
    }
    let descriptors: Vec<RateLimitDescriptor> = r
        .descriptors
        .into_iter()
        .map(|d| RateLimitDescriptor {
            entries: d
                .entries
                .into_iter()
                .map(|e| Entry {
                    key: e.key,
                    value: e.value,
                })
                .collect(),
            limit: (d.unit != 0).then_some(RateLimitOverride {
                requests_per_unit: d.requests_per_unit,
                unit: d.unit,
            }),
            hits_addend: d.hits_addend.map(u64::from),
            is_negative_hits: false,
        })
        .collect();
    let e = explainer
        .envoy(&r.domain, &descriptors)
        .await
        .map_err(err)?;
    Ok(envoy(e))
}

fn wait(us: Option<Micros>) -> Option<prost_types::Duration> {
    us.map(duration)
}

fn limit(l: RuleLimit) -> Option<v1::RuleLimit> {
    Some(v1::RuleLimit {
        burst: l.burst,
        rate: l.rate,
        debt: l.debt,
    })
}

fn state(s: BucketState) -> v1::BucketState {
    v1::BucketState {
        bucket: s.bucket,
        remaining: s.remaining,
        debt: s.debt,
        full_in: Some(duration(s.full_in_us)),
        held: s.held,
        next_free_in: wait(s.next_free_in_us),
        used: s.used,
        period_end: s.period_end.unwrap_or_default(),
        degraded: s.degraded,
        would_admit: s.would_admit,
        remaining_after: s.remaining_after,
        retry_after: wait(s.retry_after_us),
    }
}

fn dry(d: DryRun) -> v1::ExplainedDryRun {
    v1::ExplainedDryRun {
        allowed: d.allowed,
        rule: d.rule,
        remaining: d.remaining,
        retry_after: wait(d.retry_after_us.filter(|us| *us > 0)),
        shadow: d.shadow,
        degraded: d.degraded.unwrap_or_default().into(),
        headers: d.headers.into_iter().collect(),
    }
}

fn recent(r: Recent) -> v1::RecentDecisions {
    v1::RecentDecisions {
        decisions: r
            .decisions
            .into_iter()
            .map(|d| v1::RecentDecision {
                at: d.at,
                outcome: d.outcome.into(),
                rule: d.rule,
                cost: d.cost,
                ago: Some(duration(d.ago_us)),
            })
            .collect(),
        admissions_not_shown: r.admissions_not_shown,
    }
}

fn native(e: Explanation) -> v1::ExplainResponse {
    v1::ExplainResponse {
        at: e.at,
        plan: e.plan,
        rules: e
            .rules
            .into_iter()
            .map(|r| v1::ExplainedRule {
                name: r.name,
                owner: r.owner.into(),
                kind: r.kind.into(),
                scope: r.scope.into(),
                resource: r.resource,
                mode: r.mode.into(),
                limit: limit(r.limit),
                won_over: r
                    .won_over
                    .into_iter()
                    .map(|o| v1::OutrankedRow {
                        name: o.name,
                        owner: o.owner.into(),
                        limit: limit(o.limit),
                    })
                    .collect(),
                state: Some(state(r.state)),
            })
            .collect(),
        dry_run: Some(dry(e.dry_run)),
        recent: Some(recent(e.recent)),
        domain_known: false,
        descriptors: Vec::new(),
    }
}

fn envoy(e: EnvoyExplanation) -> v1::ExplainResponse {
    v1::ExplainResponse {
        at: e.at,
        plan: String::new(),
        rules: Vec::new(),
        dry_run: Some(dry(e.dry_run)),
        recent: None,
        domain_known: e.domain_known,
        descriptors: e
            .descriptors
            .into_iter()
            .map(|d| v1::ExplainedDescriptor {
                entries: d.entries,
                hits: d.hits,
                rule: d.rule.map(|r| v1::EnvoyRuleView {
                    key: r.key,
                    name: r.name,
                    limit: r.limit,
                    algorithm: r.algorithm,
                    shadow: r.shadow,
                    overridden: r.overridden,
                    counter: r.counter,
                }),
                why: d.why,
                state: d.state.map(state),
                recent: d.recent.map(recent),
            })
            .collect(),
    }
}
