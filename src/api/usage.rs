//! Usage: each quota of a tenant in its current period, read through the
//! engine without spending, writing or counting a decision. The native
//! wing (`GetUsage`) and the admin port (`GET /v1/usage`) map it.

use crate::algorithm::Op;
use crate::algorithm::calendar::Bounds;
use crate::engine::caps;
use crate::engine::{
    Allowance, Api, BucketKey, DecideError, Demand, Engine, Item, Line, OverCapacity,
};
use crate::limits::watch::LiveLimits;
use crate::limits::{Kind, Mode, Scope, check_label_named};

/// One quota's figures in its current period.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaFigures {
    /// The quota's row name.
    pub rule: String,
    /// `key` or `tenant`.
    pub scope: &'static str,
    /// The resource it counts ('' for any).
    pub resource: String,
    /// `day`, `week`, `month` or `year`.
    pub period: &'static str,
    /// The period read.
    pub bounds: Bounds,
    /// Tokens counted in it (debt included).
    pub used: u64,
    /// The quota per period.
    pub limit: u64,
    /// `limit - used`, or 0.
    pub remaining: u64,
    /// How far usage charged after the work took it past the limit.
    pub debt: u64,
    /// A shadow quota.
    pub shadow: bool,
}

/// Why usage could not be read.
#[derive(Debug)]
pub enum UsageError {
    /// A field is bad: the message says which and what to fix.
    Invalid(DecideError),
    /// The store did not answer; the figures are unknown.
    Unavailable,
}

/// Reads each quota that applies to `tenant` and `resource` (per-key ones
/// only for a `key`), in the order rules apply, in one store call.
pub async fn read(
    engine: &Engine,
    limits: &LiveLimits,
    tenant: &str,
    key: &str,
    resource: &str,
) -> Result<Vec<QuotaFigures>, UsageError> {
    let invalid = |e: String| UsageError::Invalid(DecideError::InvalidField(e));
    if tenant.is_empty() {
        return Err(invalid(
            "tenant is empty; usage is read per tenant (the default rows' quotas count each \
             tenant apart)"
                .into(),
        ));
    }
    check_label_named(tenant, || "tenant".into()).map_err(invalid)?;
    check_label_named(resource, || "resource".into()).map_err(invalid)?;
    caps::check_key(|| "key".into(), key).map_err(UsageError::Invalid)?;
    let rules = limits.snapshot();
    let cycle = rules.cycle_of(tenant);
    let quotas: Vec<_> = rules
        .applicable(tenant, resource)
        .filter(|r| r.kind == Kind::Quota)
        .filter(|r| r.scope == Scope::Tenant || !key.is_empty())
        .cloned()
        .collect();
    let mut demand = Demand::new(Api::Native, Op::DRY, OverCapacity::Invalid);
    demand.items.push(Item::new(tenant, resource, key, 0));
    for rule in &quotas {
        let bucket_key = if rule.scope == Scope::Key { key } else { "" };
        demand.lines.push(Line {
            item: 0,
            bucket: BucketKey::new(tenant, rule.bucket_kind(), &rule.resource, bucket_key),
            allowance: Allowance::Limited(rule.limit),
            enforce: rule.mode == Mode::Enforce,
            on_store_unavailable: rule.on_store_unavailable,
            label: &rule.name,
            calendar: rule.period().map(|p| (p, cycle)),
        });
    }
    let answer = engine
        .read(&mut demand)
        .await
        .map_err(UsageError::Invalid)?;
    if answer.items.iter().any(|i| i.degraded.is_some()) {
        return Err(UsageError::Unavailable);
    }
    Ok(quotas
        .iter()
        .zip(&demand.lines)
        .zip(&answer.lines)
        .map(|((rule, line), verdict)| {
            let bounds = match line.allowance {
                Allowance::Limited(l) => l.period(),
                _ => None,
            }
            .unwrap_or(Bounds { start: 0, end: 0 });
            let limit = rule.limit.burst();
            QuotaFigures {
                rule: rule.name.to_string(),
                scope: rule.scope.as_str(),
                resource: rule.resource.to_string(),
                period: rule.period().map_or("", |p| p.as_str()),
                bounds,
                used: limit - verdict.remaining + verdict.debt,
                limit,
                remaining: verdict.remaining,
                debt: verdict.debt,
                shadow: rule.mode == Mode::Shadow,
            }
        })
        .collect())
}
