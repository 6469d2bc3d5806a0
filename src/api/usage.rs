//! Usage: each quota of a tenant in its current period, read through the
//! engine without spending, writing or counting a decision. The native
//! wing (`GetUsage`) and the admin port (`GET /v1/usage`) map it.

use crate::algorithm::Op;
use crate::algorithm::calendar::Bounds;
use crate::engine::caps;
use crate::engine::{
    Allowance, Api, BucketKey, DecideError, Demand, Engine, Item, Line, OverCapacity,
};
use crate::limits::table::{LimitsTable, PeriodFilter, PeriodRow};
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
    /// The period before, as recorded (`None` without a limits table to
    /// read it from).
    pub previous: Option<PreviousPeriod>,
}

/// The period before the current one, as the ledger recorded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreviousPeriod {
    /// Its first and last instants.
    pub bounds: Bounds,
    /// Its final count: `None` while it is not closed (or its count was
    /// lost); `Some(0)` when nothing counted there.
    pub used: Option<u64>,
    /// Its final count is written.
    pub closed: bool,
}

/// Why usage could not be read.
#[derive(Debug)]
pub enum UsageError {
    /// A field is bad: the message says which and what to fix.
    Invalid(DecideError),
    /// The store (or the limits database) did not answer; the figures are
    /// unknown.
    Unavailable,
}

/// Reads each quota that applies to `tenant` and `resource` (per-key ones
/// only for a `key`), in the order rules apply, in one store call.
pub async fn read(
    engine: &Engine,
    limits: &LiveLimits,
    table: Option<&LimitsTable>,
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
        demand
            .lines
            .push(Line::of_rule(&rules, 0, tenant, key, rule));
    }
    // The engine takes the lines' buckets: their names are kept here.
    let counters: Vec<BucketKey> = demand.lines.iter().map(|l| l.bucket.clone()).collect();
    let answer = engine
        .read(&mut demand)
        .await
        .map_err(UsageError::Invalid)?;
    if answer.items.iter().any(|i| i.degraded.is_some()) {
        return Err(UsageError::Unavailable);
    }
    let mut figures = Vec::with_capacity(quotas.len());
    for (((rule, line), verdict), counter) in quotas
        .iter()
        .zip(&demand.lines)
        .zip(&answer.lines)
        .zip(&counters)
    {
        let bounds = match line.allowance {
            Allowance::Limited(l) => l.period(),
            _ => None,
        }
        .unwrap_or(Bounds { start: 0, end: 0 });
        let limit = rule.limit.burst();
        let previous = match (table, rule.period()) {
            (Some(table), Some(period)) if bounds.start > 0 => {
                let before = cycle.bounds(period, bounds.start - 1);
                let row = table
                    .period(counter.as_str(), before.start)
                    .await
                    .map_err(|_| UsageError::Unavailable)?;
                Some(PreviousPeriod {
                    bounds: before,
                    used: row.as_ref().map_or(Some(0), |r| r.used),
                    closed: row.as_ref().is_none_or(|r| r.closed),
                })
            }
            _ => None,
        };
        figures.push(QuotaFigures {
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
            previous,
        });
    }
    Ok(figures)
}

/// Most periods one page of [`list`] holds.
pub const MAX_PAGE: usize = 10_000;

/// A page of recorded periods and the token of the next ('' after the
/// last).
pub async fn list(
    table: &LimitsTable,
    mut filter: PeriodFilter,
    page_token: &str,
) -> Result<(Vec<PeriodRow>, String), UsageError> {
    let invalid = |e: String| UsageError::Invalid(DecideError::InvalidField(e));
    if let Some(tenant) = &filter.tenant {
        check_label_named(tenant, || "tenant".into()).map_err(invalid)?;
    }
    if filter.limit == 0 {
        filter.limit = 1_000;
    }
    if filter.limit > MAX_PAGE {
        return Err(invalid(format!(
            "page_size is {}; at most {MAX_PAGE} periods fit a page",
            filter.limit
        )));
    }
    if !page_token.is_empty() {
        let mut parts = page_token.splitn(3, '/');
        let after = (|| {
            let tenant = parts.next()?.to_owned();
            let start = parts.next()?.parse().ok()?;
            Some((tenant, start, parts.next()?.to_owned()))
        })();
        filter.after = Some(after.ok_or_else(|| {
            invalid(format!(
                "page_token {page_token:?} is not one ListUsage returned; pass the last \
                 response's next_page_token, or '' for the first page"
            ))
        })?);
    }
    let rows = table
        .periods(&filter)
        .await
        .map_err(|_| UsageError::Unavailable)?;
    let next = match rows.last() {
        Some(r) if rows.len() == filter.limit => format!("{}/{}/{}", r.tenant, r.start, r.counter),
        _ => String::new(),
    };
    Ok((rows, next))
}
