//! The admin HTTP port: health, metrics and the limits in force.
//!
//! | path          | what                                                   |
//! |---------------|--------------------------------------------------------|
//! | `/healthz`    | 200 while the process runs                             |
//! | `/readyz`     | 200 once the limits are loaded and the server accepts  |
//! | `/metrics`    | Prometheus text format                                 |
//! | `/v1/limits`  | JSON: the rules in force and the last reload's status  |
//! | `/v1/envoy-config` | JSON: the Envoy configuration's reload status     |

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

/// What the admin handlers read.
pub struct AdminState {
    /// The limiter, for its rules and store.
    pub limiter: Arc<Limiter>,
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
        .with_state(state)
}

async fn index() -> &'static str {
    "Tollgate admin port: /healthz /readyz /metrics /v1/limits /v1/envoy-config\n"
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
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        metrics::handle().render(),
    )
        .into_response()
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
