//! The admin HTTP port: health, metrics and the limits in force.
//!
//! | path          | what                                                   |
//! |---------------|--------------------------------------------------------|
//! | `/healthz`    | 200 while the process runs                             |
//! | `/readyz`     | 200 once the limits are loaded and the server accepts  |
//! | `/metrics`    | Prometheus text format                                 |
//! | `/v1/limits`  | JSON: the rules in force and the last reload's status  |
//! | `/v1/envoy-config` | JSON: the Envoy configuration's reload status     |
//! | `/v1/top-limited` | JSON: most limited tenants and keys (`?tenants=&keys=`) |

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;

use crate::envoy::LiveEnvoyConfig;
use crate::limiter::Limiter;
use crate::store::{MemoryStore, RedisStore};
use crate::telemetry::metrics;
use crate::telemetry::top::TopLimited;

/// What the admin handlers read.
pub struct AdminState {
    /// The limiter, for its rules and store.
    pub limiter: Arc<Limiter>,
    /// Rejections by tenant and key.
    pub top: Arc<TopLimited>,
    /// The Envoy configuration, for its status.
    pub envoy: Arc<LiveEnvoyConfig>,
    /// The in-process store (the store, or the local fallback), for its figures.
    pub memory: Option<Arc<MemoryStore>>,
    /// The Redis store, when in use, for its breaker state.
    pub redis: Option<Arc<RedisStore>>,
    /// Set once the gRPC server accepts requests.
    pub ready: AtomicBool,
}

/// The admin router.
pub fn router(state: Arc<AdminState>) -> Router {
    Router::new()
        .route("/", get(index))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(render_metrics))
        .route("/v1/limits", get(limits))
        .route("/v1/envoy-config", get(envoy_config))
        .route("/v1/top-limited", get(top_limited))
        .with_state(state)
}

async fn index() -> &'static str {
    "Tollgate admin port: /healthz /readyz /metrics /v1/limits /v1/envoy-config /v1/top-limited\n"
}

async fn readyz(State(state): State<Arc<AdminState>>) -> Response {
    if state.ready.load(Ordering::Acquire) {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "starting\n").into_response()
    }
}

async fn render_metrics(State(state): State<Arc<AdminState>>) -> Response {
    if let Some(memory) = &state.memory {
        let (idle, capacity) = memory.evictions();
        metrics::memory_store(memory.len(), memory.max_buckets(), idle, capacity);
    }
    if let Some(redis) = &state.redis {
        metrics::breaker_state("redis", redis.breaker_state() as u8);
    }
    let mut text = metrics::handle().render();
    text.push_str(&crate::telemetry::top::render_metric(&state.top.top(10, 0)));
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
    Json(json!({ "window_seconds": state.top.window().as_secs(), "tenants": tenants }))
}

async fn envoy_config(State(state): State<Arc<AdminState>>) -> Json<serde_json::Value> {
    Json(json!({ "status": state.envoy.status() }))
}

async fn limits(State(state): State<Arc<AdminState>>) -> Json<serde_json::Value> {
    let limits = state.limiter.limits();
    let rules: Vec<_> = limits
        .snapshot()
        .rules()
        .iter()
        .map(|r| {
            json!({
                "name": r.name,
                "tenant": r.tenant,
                "resource": r.resource,
                "scope": r.scope,
                "burst": r.limit.burst(),
                "rate": r.rate.to_string(),
                "mode": r.mode,
                "on_store_unavailable": r.on_store_unavailable,
            })
        })
        .collect();
    Json(json!({ "status": limits.status(), "rules": rules }))
}
