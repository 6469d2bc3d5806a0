//! The admin port's view of the limits tables: pages of rows, plans, and
//! the edits (`POST /v1/limits`, plans, tenants' plans). Each edit is
//! applied to this instance at once (the others catch up by themselves).

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::AdminState;
use crate::algorithm::calendar::Cycle;
use crate::limits::table::{RowFilter, TableError};
use crate::limits::{LimitRow, StoredRow, check_label};

/// The most rows one page holds.
pub const MAX_PAGE: usize = 1000;

/// A row to add or change, as `POST /v1/limits` takes it.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RowRequest {
    #[serde(default)]
    tenant: String,
    #[serde(default)]
    plan: String,
    #[serde(default)]
    resource: String,
    #[serde(default = "crate::limits::column_default::scope")]
    scope: String,
    /// Capacity; for a concurrency rule, the most leases held at once.
    burst: i64,
    /// `N/unit` (omitted for a concurrency rule).
    #[serde(default)]
    rate: String,
    /// `rate` (default) or `concurrency`.
    #[serde(default = "crate::limits::column_default::kind")]
    kind: String,
    #[serde(default = "crate::limits::column_default::mode")]
    mode: String,
    #[serde(default = "crate::limits::column_default::on_store_unavailable")]
    on_store_unavailable: String,
    #[serde(default)]
    debt: i64,
    /// A quota's alert thresholds, `50,80,100`.
    #[serde(default)]
    alerts: String,
    name: Option<String>,
}

pub(super) fn bad(why: impl std::fmt::Display) -> Response {
    (StatusCode::BAD_REQUEST, format!("{why}\n")).into_response()
}

fn table_error(err: TableError) -> Response {
    match err {
        TableError::Conflict(why) => (StatusCode::CONFLICT, format!("{why}\n")).into_response(),
        TableError::NotFound(why) => (StatusCode::NOT_FOUND, format!("{why}\n")).into_response(),
        e => (StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n")).into_response(),
    }
}

async fn applied(state: &AdminState) {
    let _ = state.limits.catch_up(&state.table).await;
}

/// `GET /v1/limits` query.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PageQuery {
    #[serde(default)]
    tenant: String,
    #[serde(default)]
    plan: String,
    #[serde(default)]
    prefix: String,
    #[serde(default)]
    after: String,
    limit: Option<usize>,
}

/// A row as the admin port shows it.
pub fn row_json(r: &StoredRow) -> serde_json::Value {
    let rate = if r.kind == "concurrency" {
        format!("{} concurrent", r.burst)
    } else {
        format!("{}/{}", r.rate, r.rate_unit)
    };
    json!({
        "name": r.name,
        "tenant": r.tenant,
        "plan": r.plan,
        "resource": r.resource,
        "scope": r.scope,
        "kind": r.kind,
        "burst": r.burst,
        "rate": rate,
        "mode": r.mode,
        "on_store_unavailable": r.on_store_unavailable,
        "debt": r.debt,
        "alerts": r.alerts,
        "updated_at": r.updated_at,
    })
}

/// The limits status and one page of rows in name order; `next` is the
/// `after` of the next page (absent on the last).
pub(super) async fn list(
    State(state): State<Arc<AdminState>>,
    query: Result<Query<PageQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Query(q) = match query {
        Ok(q) => q,
        Err(e) => return bad(format!("{e}; use tenant, plan, prefix, after and limit")),
    };
    let limit = q.limit.unwrap_or(100);
    if limit == 0 || limit > MAX_PAGE {
        return bad(format!(
            "limit is {limit}; ask for 1 to {MAX_PAGE} rows a page"
        ));
    }
    for (what, value) in [("tenant", &q.tenant), ("plan", &q.plan)] {
        if let Err(e) = check_label(what, value) {
            return bad(e);
        }
    }
    if q.prefix.len() > crate::limits::MAX_NAME_LEN || q.after.len() > crate::limits::MAX_NAME_LEN {
        return bad(format!(
            "prefix and after are row names: at most {} bytes",
            crate::limits::MAX_NAME_LEN
        ));
    }
    let filter = RowFilter {
        tenant: q.tenant,
        plan: q.plan,
        prefix: q.prefix,
        after: q.after,
        limit,
    };
    match state.table.rows_page(&filter).await {
        Ok(rows) => {
            let next = (rows.len() == limit).then(|| rows.last().map(|r| r.name.clone()));
            let rules: Vec<_> = rows.iter().map(row_json).collect();
            Json(json!({ "status": state.limits.status(), "rules": rules, "next": next.flatten() }))
                .into_response()
        }
        Err(e) => table_error(e),
    }
}

/// `POST /v1/limits`: adds or changes a row.
pub(super) async fn set(State(state): State<Arc<AdminState>>, body: axum::body::Bytes) -> Response {
    let req: RowRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad(format!("the body must be a JSON row: {e}")),
    };
    let named = req.name.is_some();
    let row = match LimitRow::from_request(
        req.tenant,
        req.resource,
        &req.scope,
        req.burst,
        &req.rate,
        &req.mode,
        &req.on_store_unavailable,
        req.debt,
        &req.kind,
        req.name,
    ) {
        Ok(row) => match req.alerts.parse() {
            Ok(alerts) => row.with_alerts(alerts).for_plan(req.plan, named),
            Err(e) => return bad(e),
        },
        Err(e) => return bad(e),
    };
    if let Err(e) = row.validate() {
        return bad(e);
    }
    match state.table.upsert(&row).await {
        Ok(()) => {
            applied(&state).await;
            (StatusCode::OK, Json(json!({ "set": row.name }))).into_response()
        }
        Err(e) => table_error(e),
    }
}

/// `DELETE /v1/limits/{name}`.
pub(super) async fn delete(
    State(state): State<Arc<AdminState>>,
    Path(name): Path<String>,
) -> Response {
    match state.table.delete(&name).await {
        Ok(true) => {
            applied(&state).await;
            (StatusCode::OK, Json(json!({ "deleted": name }))).into_response()
        }
        Ok(false) => (
            StatusCode::NOT_FOUND,
            format!("no row is named {:?}\n", crate::limits::short(&name)),
        )
            .into_response(),
        Err(e) => table_error(e),
    }
}

/// `GET /v1/plans`.
pub(super) async fn plans(State(state): State<Arc<AdminState>>) -> Response {
    match state.table.plans().await {
        Ok(plans) => Json(json!({
            "plans": plans,
            "missing": state.limits.status().missing_plans,
        }))
        .into_response(),
        Err(e) => table_error(e),
    }
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PlanRequest {
    name: String,
    #[serde(default)]
    description: String,
}

/// The longest plan description, in bytes.
pub const MAX_DESCRIPTION_LEN: usize = 1024;

/// `POST /v1/plans`: creates a plan (or changes its description).
pub(super) async fn create_plan(
    State(state): State<Arc<AdminState>>,
    body: axum::body::Bytes,
) -> Response {
    let req: PlanRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return bad(format!(
                "the body must be {{\"name\": ..., \"description\": ...}}: {e}"
            ));
        }
    };
    if let Err(e) = check_plan_name(&req.name) {
        return bad(e);
    }
    if req.description.len() > MAX_DESCRIPTION_LEN {
        return bad(format!(
            "description is {} bytes; at most {MAX_DESCRIPTION_LEN} are allowed",
            req.description.len()
        ));
    }
    match state.table.create_plan(&req.name, &req.description).await {
        Ok(()) => {
            applied(&state).await;
            Json(json!({ "plan": req.name })).into_response()
        }
        Err(e) => table_error(e),
    }
}

/// A plan's name: a label that is not empty.
pub fn check_plan_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("the plan's name is empty".into());
    }
    check_label("plan", name)
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ForceQuery {
    #[serde(default)]
    force: bool,
}

/// `DELETE /v1/plans/{name}[?force=true]`: deletes a plan and its rules.
pub(super) async fn delete_plan(
    State(state): State<Arc<AdminState>>,
    Path(name): Path<String>,
    query: Result<Query<ForceQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(q)) = query else {
        return bad("the only parameter is force=true");
    };
    if let Err(e) = check_plan_name(&name) {
        return bad(e);
    }
    match state.table.delete_plan(&name, q.force).await {
        Ok(true) => {
            applied(&state).await;
            Json(json!({ "deleted": name })).into_response()
        }
        Ok(false) => (
            StatusCode::NOT_FOUND,
            format!("no plan is named {name:?}\n"),
        )
            .into_response(),
        Err(e) => table_error(e),
    }
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct AssignRequest {
    plan: String,
}

/// `PUT /v1/tenants/{tenant}/plan` with `{"plan": "pro"}`.
pub(super) async fn assign(
    State(state): State<Arc<AdminState>>,
    Path(tenant): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    let req: AssignRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad(format!("the body must be {{\"plan\": \"NAME\"}}: {e}")),
    };
    if let Err(e) = check_tenant_name(&tenant).and_then(|()| check_plan_name(&req.plan)) {
        return bad(e);
    }
    match state.table.assign(&tenant, Some(&req.plan)).await {
        Ok(before) => {
            applied(&state).await;
            Json(json!({ "tenant": tenant, "plan": req.plan, "was": before })).into_response()
        }
        Err(e) => table_error(e),
    }
}

/// `DELETE /v1/tenants/{tenant}/plan`: the tenant leaves its plan.
pub(super) async fn unassign(
    State(state): State<Arc<AdminState>>,
    Path(tenant): Path<String>,
) -> Response {
    if let Err(e) = check_tenant_name(&tenant) {
        return bad(e);
    }
    match state.table.assign(&tenant, None).await {
        Ok(before) => {
            applied(&state).await;
            Json(json!({ "tenant": tenant, "plan": null, "was": before })).into_response()
        }
        Err(e) => table_error(e),
    }
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct CycleRequest {
    #[serde(default = "utc")]
    time_zone: String,
    #[serde(default = "first")]
    day: u8,
    #[serde(default = "first")]
    month: u8,
    #[serde(default = "monday")]
    weekday: String,
}

fn utc() -> String {
    "UTC".into()
}

fn first() -> u8 {
    1
}

fn monday() -> String {
    "monday".into()
}

fn cycle_json(cycle: &Cycle) -> serde_json::Value {
    json!({
        "time_zone": cycle.zone(),
        "day": cycle.day(),
        "month": cycle.month(),
        "weekday": cycle.weekday(),
    })
}

/// `PUT /v1/tenants/{tenant}/cycle` with `{"time_zone": "America/New_York",
/// "day": 15}` (`month` and `weekday` too; each defaults to the default
/// cycle's).
pub(super) async fn set_cycle(
    State(state): State<Arc<AdminState>>,
    Path(tenant): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    let req: CycleRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return bad(format!(
                "the body must be {{\"time_zone\": \"America/New_York\", \"day\": 15, \
                 \"month\": 1, \"weekday\": \"monday\"}} (each optional): {e}"
            ));
        }
    };
    if let Err(e) = check_tenant_name(&tenant) {
        return bad(e);
    }
    let cycle = match Cycle::new(&req.time_zone, req.day, req.month, &req.weekday) {
        Ok(c) => c,
        Err(e) => return bad(e),
    };
    match state.table.set_cycle(&tenant, &cycle).await {
        Ok(()) => {
            applied(&state).await;
            Json(json!({ "tenant": tenant, "cycle": cycle_json(&cycle) })).into_response()
        }
        Err(e) => table_error(e),
    }
}

/// `GET /v1/tenants/{tenant}`: its plan and billing cycle.
pub(super) async fn tenant(
    State(state): State<Arc<AdminState>>,
    Path(tenant): Path<String>,
) -> Response {
    if let Err(e) = check_tenant_name(&tenant) {
        return bad(e);
    }
    match state.table.tenant(&tenant).await {
        Ok(found) => {
            let (plan, cycle) = found.unwrap_or_default();
            let plan = (!plan.is_empty()).then_some(plan);
            Json(json!({ "tenant": tenant, "plan": plan, "cycle": cycle_json(&cycle) }))
                .into_response()
        }
        Err(e) => table_error(e),
    }
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct UsageQuery {
    #[serde(default)]
    tenant: String,
    #[serde(default)]
    key: String,
    #[serde(default)]
    resource: String,
}

/// `GET /v1/usage?tenant=acme[&key=alice][&resource=exports]`: each quota
/// of the tenant in its current period (as the gRPC `GetUsage`).
pub(super) async fn usage(
    State(state): State<Arc<AdminState>>,
    query: Result<Query<UsageQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    use crate::api::usage;
    let Ok(Query(q)) = query else {
        return bad("query parameters: tenant (required), key, resource");
    };
    let read = usage::read(
        &state.engine,
        &state.limits,
        Some(&state.table),
        &q.tenant,
        &q.key,
        &q.resource,
    );
    match read.await {
        Ok(figures) => {
            let quotas: Vec<serde_json::Value> = figures
                .iter()
                .map(|f| {
                    json!({
                        "rule": f.rule,
                        "scope": f.scope,
                        "resource": f.resource,
                        "period": f.period,
                        "period_start": crate::algorithm::calendar::rfc3339(f.bounds.start),
                        "period_end": crate::algorithm::calendar::rfc3339(f.bounds.end),
                        "used": f.used,
                        "limit": f.limit,
                        "remaining": f.remaining,
                        "debt": f.debt,
                        "shadow": f.shadow,
                        "previous": f.previous.as_ref().map(|p| json!({
                            "period_start": crate::algorithm::calendar::rfc3339(p.bounds.start),
                            "period_end": crate::algorithm::calendar::rfc3339(p.bounds.end),
                            "used": p.used,
                            "closed": p.closed,
                        })),
                    })
                })
                .collect();
            Json(json!({ "tenant": q.tenant, "quotas": quotas })).into_response()
        }
        Err(e) => usage_error(e),
    }
}

fn usage_error(e: crate::api::usage::UsageError) -> Response {
    match e {
        crate::api::usage::UsageError::Invalid(e) => bad(e.to_string()),
        crate::api::usage::UsageError::Unavailable => (
            StatusCode::SERVICE_UNAVAILABLE,
            "the store or the limits database is unavailable: usage cannot be read until it \
             answers again\n",
        )
            .into_response(),
    }
}

#[derive(serde::Deserialize)]
pub(super) struct PeriodsQuery {
    #[serde(default)]
    tenant: String,
    /// RFC 3339 instants.
    since: Option<String>,
    until: Option<String>,
    #[serde(default)]
    closed: bool,
    #[serde(default)]
    page_size: usize,
    #[serde(default)]
    page_token: String,
}

/// `GET /v1/usage/periods?[tenant=acme][&since=…][&until=…][&closed=true]
/// [&page_size=N][&page_token=…]`: recorded quota periods, a page at a
/// time (as the gRPC `ListUsage`).
pub(super) async fn usage_periods(
    State(state): State<Arc<AdminState>>,
    query: Result<Query<PeriodsQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(q)) = query else {
        return bad(
            "query parameters: tenant, since, until (RFC 3339), closed (true or false), \
                    page_size, page_token",
        );
    };
    let instant = |field: &str, v: &Option<String>| -> Result<Option<u64>, String> {
        let Some(v) = v else { return Ok(None) };
        crate::algorithm::calendar::parse_rfc3339(v)
            .map(Some)
            .map_err(|e| format!("{field}: {e}"))
    };
    let (since, until) = match (instant("since", &q.since), instant("until", &q.until)) {
        (Ok(s), Ok(u)) => (s, u),
        (Err(e), _) | (_, Err(e)) => return bad(e),
    };
    let filter = crate::limits::table::PeriodFilter {
        tenant: (!q.tenant.is_empty()).then(|| q.tenant.clone()),
        since,
        until,
        closed_only: q.closed,
        after: None,
        limit: q.page_size,
    };
    match crate::api::usage::list(&state.table, filter, &q.page_token).await {
        Ok((rows, next)) => {
            let periods: Vec<serde_json::Value> = rows
                .iter()
                .map(|r| {
                    json!({
                        "tenant": r.tenant,
                        "scope": r.scope,
                        "resource": r.resource,
                        "key": r.key,
                        "rule": r.rule,
                        "shadow": r.shadow,
                        "limit": r.quota,
                        "period_start": crate::algorithm::calendar::rfc3339(r.start),
                        "period_end": crate::algorithm::calendar::rfc3339(r.end),
                        "used": r.used,
                        "closed": r.closed,
                    })
                })
                .collect();
            Json(json!({ "periods": periods, "next_page_token": next })).into_response()
        }
        Err(e) => usage_error(e),
    }
}

/// A tenant's name as plans take it: a label that is not empty.
pub fn check_tenant_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err(
            "the tenant is empty; the default rows apply to every tenant without a plan".into(),
        );
    }
    check_label("tenant", name)
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct AlertsQuery {
    #[serde(default)]
    pending: bool,
    limit: Option<usize>,
}

/// `GET /v1/alerts[?pending=true][&limit=N]`: the quota alert outbox's
/// counts and its newest alerts (at most 1 000), as `tollgate alerts list`.
pub(super) async fn alerts(
    State(state): State<Arc<AdminState>>,
    query: Result<Query<AlertsQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(q)) = query else {
        return bad("query parameters: pending (true or false), limit (at most 1000)");
    };
    let limit = q.limit.unwrap_or(50);
    if limit > 1_000 {
        return bad(format!("limit is {limit}; at most 1000 alerts are listed"));
    }
    let read = async {
        let rows = state.table.alerts(q.pending, limit).await?;
        let counts = state.table.alert_counts().await?;
        Ok::<_, TableError>((rows, counts))
    };
    match read.await {
        Ok((rows, counts)) => Json(json!({
            "pending": counts.pending,
            "delivered": counts.delivered,
            "alerts": rows.iter().map(crate::cli::alert_json).collect::<Vec<_>>(),
        }))
        .into_response(),
        Err(e) => table_error(e),
    }
}
