//! The admin wing: the admin HTTP port (health, metrics, the limits in
//! force, the status page) and the `tollgate.v1.Admin` gRPC service
//! ([`grpc`]).
//!
//! | path          | what                                                   |
//! |---------------|--------------------------------------------------------|
//! | `/`           | the status page (HTML)                                 |
//! | `/v1/status`  | JSON: store health, decisions per outcome and per second |
//! | `/healthz`    | 200 while the process runs                             |
//! | `/readyz`     | 200 once the limits are loaded and the server accepts  |
//! | `/metrics`    | Prometheus text format                                 |
//! | `/v1/limits`  | JSON: the limits status and one page of rows (`?tenant=&plan=&prefix=&after=&limit=`) |
//! | `/v1/plans`   | JSON: the plans, with their rules and tenants counted  |
//! | `/v1/envoy-config` | JSON: the Envoy configuration's reload status     |
//! | `/v1/rlqs` | JSON: the quota buckets subscribed on this instance, highest demand first (`?limit=`), with each one's share and assignment |
//! | `/v1/history` | JSON: the last hour, a point a second (`?seconds=`): decisions per second, store percentiles, top tenants' rejections, slots held, debt |
//! | `/assets/uplot.js`, `/assets/uplot.css` | the status page's charting library (vendored) |
//! | `/v1/top-limited` | JSON: most limited tenants and keys (`?tenants=&keys=`), the tenants seen in debt, and those holding the most concurrency slots |
//! | `POST /v1/limits`, `DELETE /v1/limits/{name}` | change the limits table (token required) |
//! | `POST /v1/plans`, `DELETE /v1/plans/{name}`, `PUT`/`DELETE /v1/tenants/{tenant}/plan` | plans and tenants' plans (token required) |
//! | `GET /v1/tenants/{tenant}`, `PUT /v1/tenants/{tenant}/cycle` | a tenant's plan and billing cycle; setting the cycle (token required) |
//! | `GET /v1/usage?tenant=T[&key=K][&resource=R]` | each quota of the tenant in its current period (as `GetUsage`) |
//! | `GET /v1/explain?tenant=T&key=K[&resource=R][&cost=N]`, `GET /v1/explain?domain=D&descriptor=k=v[,k=v]...[&hits=N]` | why a request gets its answer: rules, bucket state, a dry run, recent decisions (token required) |

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;

mod explain;
pub mod grpc;
mod history;
mod limits;

use subtle::ConstantTimeEq;

use crate::engine::BreakerState;
use crate::engine::backend::StoreHandle;
use crate::limits::table::LimitsTable;
use crate::limits::watch::LiveLimits;
use crate::telemetry::metrics;
use crate::telemetry::top::TopLimited;

/// What the admin handlers read.
pub struct AdminState {
    /// The rules in force.
    pub limits: Arc<LiveLimits>,
    /// The store's health and figures.
    pub store: StoreHandle,
    /// Rejections by tenant and key.
    pub top: Arc<TopLimited>,
    /// The Envoy configuration's reload status, as JSON.
    pub envoy_status: Box<dyn Fn() -> serde_json::Value + Send + Sync>,
    /// Starting, ready or stopping.
    pub ready: Readiness,
    /// The limits table, for the mutating endpoints.
    pub table: LimitsTable,
    /// Who may call what.
    pub access: AdminAccess,
    /// The gRPC port's requests in flight, for `/metrics`.
    pub grpc_in_flight: crate::connections::InFlightCap,
    /// The engine, to read usage.
    pub engine: Arc<crate::engine::Engine>,
    /// The quota buckets subscribed on this instance.
    pub rlqs: Arc<crate::api::quota_view::RlqsView>,
    /// The explain view.
    pub explain: Arc<crate::api::explain::Explainer>,
    /// The last hour, for the status page: its plots and its rates.
    pub history: history::History,
}

/// True when `authorization` (a header's value) is `Bearer TOKEN` with
/// the admin `token`. Constant-time comparison: no timing hint about the
/// token. (A token is never empty: `validate` refuses one at start-up.)
pub fn bearer_matches(token: &str, authorization: &str) -> bool {
    let given = authorization.strip_prefix("Bearer ").unwrap_or("");
    !token.is_empty() && bool::from(given.as_bytes().ct_eq(token.as_bytes()))
}

/// Whether the service is ready: from the moment the store first answers
/// (a decision or a ping, whichever comes first) until shutdown begins.
#[derive(Debug, Default)]
pub struct Readiness(AtomicU8);

impl Readiness {
    const STARTING: u8 = 0;
    const READY: u8 = 1;
    const STOPPING: u8 = 2;

    /// True when ready; while starting, turns ready as soon as `store`
    /// reports an answer, without waiting for the next readiness ping.
    pub fn check(&self, store: &StoreHandle) -> bool {
        match self.0.load(Ordering::Acquire) {
            Self::READY => true,
            Self::STARTING if store.status().answered => {
                self.set_ready();
                self.0.load(Ordering::Acquire) == Self::READY
            }
            _ => false,
        }
    }

    /// The store answered.
    pub fn set_ready(&self) {
        let _ = self.0.compare_exchange(
            Self::STARTING,
            Self::READY,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    /// Shutdown began: never ready again.
    pub fn set_stopping(&self) {
        self.0.store(Self::STOPPING, Ordering::Release);
    }
}

/// Access to the admin port. Changing endpoints (`POST`/`DELETE
/// /v1/limits`) need `Authorization: Bearer TOKEN` and are disabled when no
/// token is configured; the read-only ones are open unless `protect_reads`
/// (except `/healthz` and `/readyz`, for probes). [`AdminAccess::validate`]
/// refuses settings that would open the port by accident.
#[derive(Debug, Clone, clap::Args)]
pub struct AdminAccess {
    /// Bearer token for the admin port's changing endpoints (POST/DELETE
    /// /v1/limits and plans); without it they are disabled. Never empty.
    #[arg(
        id = "admin_token",
        long = "admin-token",
        env = "TOLLGATE_ADMIN_TOKEN",
        hide_env_values = true
    )]
    pub token: Option<String>,
    /// Require the admin token for the read-only admin endpoints too
    /// (/healthz and /readyz stay open for probes).
    #[arg(id = "admin_protect_reads", long = "admin-protect-reads", env = "TOLLGATE_ADMIN_PROTECT_READS", action = clap::ArgAction::Set, num_args = 0..=1, default_value_t = false, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub protect_reads: bool,
    /// Serve the admin port without a token on a non-loopback address: only
    /// trusted hosts can reach it (refused otherwise, so that a missing or
    /// empty Secret never opens the limits table to a cluster network).
    #[arg(id = "admin_trust_network", long = "admin-trust-network", env = "TOLLGATE_ADMIN_TRUST_NETWORK", action = clap::ArgAction::Set, num_args = 0..=1, default_value_t = false, default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub trust_network: bool,
}

impl Default for AdminAccess {
    fn default() -> Self {
        crate::options::defaults()
    }
}

impl AdminAccess {
    /// Checks the settings against the address the admin port is bound to:
    /// an empty token is refused (it would be a token anyone can send), and
    /// so is a non-loopback address without a token, unless the network is
    /// declared trusted.
    pub fn validate(&self, bound: std::net::SocketAddr) -> Result<(), String> {
        if self.token.as_deref().is_some_and(|t| t.trim().is_empty()) {
            return Err("the admin token is empty; set a non-empty --admin-token \
                 (TOLLGATE_ADMIN_TOKEN, admin_token), or leave it unset to turn the \
                 changing endpoints off"
                .into());
        }
        if self.token.is_none() && !bound.ip().to_canonical().is_loopback() && !self.trust_network {
            return Err(format!(
                "the admin port is bound to {bound}, which is reachable from other hosts, \
                 and no admin token is set; set --admin-token (TOLLGATE_ADMIN_TOKEN), bind \
                 --admin-addr to 127.0.0.1, or pass --admin-trust-network if only trusted \
                 hosts can reach that address"
            ));
        }
        Ok(())
    }

    fn check(
        &self,
        headers: &axum::http::HeaderMap,
        needs_token: bool,
    ) -> Result<(), Box<Response>> {
        if !needs_token && !self.protect_reads {
            return Ok(());
        }
        let Some(token) = &self.token else {
            return Err(Box::new(
                (
                StatusCode::FORBIDDEN,
                "this endpoint needs the admin token, and none is set: changing the limits and explaining decisions over the admin port are disabled; start tollgate with --admin-token (TOLLGATE_ADMIN_TOKEN)\n",
            )
                .into_response(),
            ));
        };
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if bearer_matches(token, given) {
            Ok(())
        } else {
            Err(Box::new(
                (
                    StatusCode::UNAUTHORIZED,
                    [(header::WWW_AUTHENTICATE, "Bearer")],
                    "send the admin token as: Authorization: Bearer TOKEN\n",
                )
                    .into_response(),
            ))
        }
    }
}

async fn guard(
    State(state): State<Arc<AdminState>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let path = request.uri().path();
    if path == "/healthz" || path == "/readyz" {
        return next.run(request).await;
    }
    // Changing endpoints, and the explain view (a key's state and its
    // recent decisions), need the token.
    let needs_token = path == "/v1/explain"
        || (request.method() != axum::http::Method::GET
            && request.method() != axum::http::Method::HEAD);
    match state.access.check(request.headers(), needs_token) {
        Ok(()) => next.run(request).await,
        Err(response) => *response,
    }
}

/// The admin router.
pub fn router(state: Arc<AdminState>) -> Router {
    Router::new()
        .route("/", get(index))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(render_metrics))
        .route("/v1/limits", get(limits::list).post(limits::set))
        .route("/v1/limits/{name}", axum::routing::delete(limits::delete))
        .route("/v1/plans", get(limits::plans).post(limits::create_plan))
        .route(
            "/v1/plans/{name}",
            axum::routing::delete(limits::delete_plan),
        )
        .route(
            "/v1/tenants/{tenant}/plan",
            axum::routing::put(limits::assign).delete(limits::unassign),
        )
        .route("/v1/tenants/{tenant}", get(limits::tenant))
        .route("/v1/usage", get(limits::usage))
        .route("/v1/usage/periods", get(limits::usage_periods))
        .route("/v1/alerts", get(limits::alerts))
        .route(
            "/v1/tenants/{tenant}/cycle",
            axum::routing::put(limits::set_cycle),
        )
        .route("/v1/envoy-config", get(envoy_config))
        .route("/v1/rlqs", get(rlqs))
        .route("/v1/top-limited", get(top_limited))
        .route("/v1/explain", get(explain::http))
        .route("/v1/history", get(history::http))
        .route("/assets/uplot.js", get(uplot_js))
        .route("/assets/uplot.css", get(uplot_css))
        .route("/v1/status", get(status))
        .layer(axum::middleware::from_fn_with_state(state.clone(), guard))
        .with_state(state)
}

/// The status page: decision rates, most limited tenants, store health and
/// the limits in force, from the JSON endpoints; self-contained.
async fn index() -> axum::response::Html<&'static str> {
    axum::response::Html(include_str!("status.html"))
}

/// The charting library the status page draws with, vendored (uPlot, MIT;
/// `vendor/uplot/README.md`): the page works offline.
async fn uplot_js() -> Response {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        include_str!("vendor/uplot/uPlot.iife.min.js"),
    )
        .into_response()
}

async fn uplot_css() -> Response {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        include_str!("vendor/uplot/uPlot.min.css"),
    )
        .into_response()
}

impl AdminState {
    /// Takes the status page's samples (the server calls this every
    /// second). The plots' time axis is the wall clock's, whatever clock
    /// decisions read (a test's stands still).
    pub fn sample(&self) {
        use crate::clock::Clock;
        let now = crate::clock::SystemClock.now() / 1_000_000;
        self.history.sample(&self.top, now);
    }
}

async fn status(State(state): State<Arc<AdminState>>) -> Json<serde_json::Value> {
    let totals = metrics::totals();
    let rates = state.history.per_second();
    let mut total = serde_json::Map::new();
    let mut per_second = serde_json::Map::new();
    for (i, outcome) in metrics::Outcome::ALL.iter().enumerate() {
        total.insert(outcome.label().into(), totals[i].into());
        per_second.insert(outcome.label().into(), rates[i].into());
    }
    let store = state.store.status();
    let name = |b: BreakerState| match b {
        BreakerState::Closed => "closed",
        BreakerState::Open => "open",
        BreakerState::HalfOpen => "half-open",
    };
    let breaker = store.breaker.map(name);
    let nodes: Vec<serde_json::Value> = store
        .nodes
        .iter()
        .map(|n| {
            json!({
                "address": n.address,
                "slots": n.slots,
                "replicas": n.replicas,
                "breaker": name(n.breaker),
                "connected": n.connected,
                "errors": n.errors,
            })
        })
        .collect();
    Json(json!({
        "ready": state.ready.check(&state.store),
        "store": {
            "kind": store.kind,
            "breaker": breaker,
            "nodes": nodes,
            "buckets_in_memory": store.local.map_or(0, |m| m.buckets),
        },
        "decisions_total": total,
        "decisions_per_second": per_second,
    }))
}

async fn readyz(State(state): State<Arc<AdminState>>) -> Response {
    if state.ready.check(&state.store) {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "starting\n").into_response()
    }
}

async fn render_metrics(State(state): State<Arc<AdminState>>) -> Response {
    let store = state.store.status();
    if let Some(m) = store.local {
        metrics::memory_store(&m);
    }
    if let Some(breaker) = store.breaker {
        metrics::breaker_state(store.kind, breaker as u8);
    }
    for node in &store.nodes {
        metrics::node_breaker_state(&node.address, node.breaker as u8);
    }
    metrics::grpc_in_flight(state.grpc_in_flight.in_flight());
    let mut text = metrics::handle().render();
    text.push_str(&crate::telemetry::top::render_metric(&state.top.top(10, 0)));
    text.push_str(&crate::telemetry::top::render_debt_metric(
        &state.top.in_debt(10),
    ));
    text.push_str(&crate::telemetry::top::render_holding_metric(
        &state.top.holding(10),
    ));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

#[derive(serde::Deserialize)]
struct TopQuery {
    tenants: Option<usize>,
    keys: Option<usize>,
}

async fn top_limited(
    State(state): State<Arc<AdminState>>,
    axum::extract::Query(q): axum::extract::Query<TopQuery>,
) -> Json<serde_json::Value> {
    let tenants = state.top.top(
        q.tenants.unwrap_or(10).min(100),
        q.keys.unwrap_or(5).min(100),
    );
    let in_debt = state.top.in_debt(q.tenants.unwrap_or(10).min(100));
    Json(json!({
        "window_seconds": state.top.window().as_secs(),
        "tenants": tenants,
        "in_debt": in_debt,
        "holding": state.top.holding(q.tenants.unwrap_or(10).min(100)),
        "nearest_quota": state.top.nearest_quota(q.tenants.unwrap_or(10).min(100)),
    }))
}

#[derive(Debug, serde::Deserialize)]
struct RlqsQuery {
    limit: Option<usize>,
}

async fn rlqs(
    State(state): State<Arc<AdminState>>,
    axum::extract::Query(q): axum::extract::Query<RlqsQuery>,
) -> Json<serde_json::Value> {
    let (top, buckets) = state.rlqs.top(q.limit.unwrap_or(20).min(1000));
    Json(json!({ "buckets": buckets, "top": top }))
}

async fn envoy_config(State(state): State<Arc<AdminState>>) -> Json<serde_json::Value> {
    Json(json!({ "status": (state.envoy_status)() }))
}
