//! The admin HTTP port: health, metrics and the limits in force.
//!
//! | path          | what                                                   |
//! |---------------|--------------------------------------------------------|
//! | `/`           | the status page (HTML)                                 |
//! | `/v1/status`  | JSON: store health, decisions per outcome and per second |
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
    /// Decision rates for the status page.
    pub rates: Rates,
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
        .route("/v1/status", get(status))
        .with_state(state)
}

/// The status page: decision rates, most limited tenants, store health and
/// the limits in force, from the JSON endpoints; self-contained.
async fn index() -> axum::response::Html<&'static str> {
    axum::response::Html(include_str!("status.html"))
}

async fn status(State(state): State<Arc<AdminState>>) -> Json<serde_json::Value> {
    let totals = metrics::totals();
    let rates = state.rates.per_second(totals);
    let mut total = serde_json::Map::new();
    let mut per_second = serde_json::Map::new();
    for (i, outcome) in metrics::Outcome::ALL.iter().enumerate() {
        total.insert(outcome.label().into(), totals[i].into());
        per_second.insert(outcome.label().into(), rates[i].into());
    }
    let breaker = state.redis.as_ref().map(|r| match r.breaker_state() {
        crate::store::breaker::BreakerState::Closed => "closed",
        crate::store::breaker::BreakerState::Open => "open",
        crate::store::breaker::BreakerState::HalfOpen => "half-open",
    });
    Json(json!({
        "ready": state.ready.load(Ordering::Acquire),
        "store": {
            "kind": state.limiter.store().kind(),
            "breaker": breaker,
            "buckets_in_memory": state.memory.as_ref().map_or(0, |m| m.len()),
        },
        "decisions_total": total,
        "decisions_per_second": per_second,
    }))
}

/// Decision totals sampled every second, for per-second rates over the last
/// ten seconds.
#[derive(Default)]
pub struct Rates {
    samples: parking_lot::Mutex<std::collections::VecDeque<(tokio::time::Instant, [u64; 7])>>,
}

impl Rates {
    /// Takes a sample (the server calls this every second).
    pub fn sample(&self) {
        let mut samples = self.samples.lock();
        samples.push_back((tokio::time::Instant::now(), metrics::totals()));
        while samples.len() > 11 {
            samples.pop_front();
        }
    }

    fn per_second(&self, now_totals: [u64; 7]) -> [f64; 7] {
        let samples = self.samples.lock();
        let Some((then, old)) = samples.front() else {
            return [0.0; 7];
        };
        let secs = then.elapsed().as_secs_f64();
        if secs < 0.5 {
            return [0.0; 7];
        }
        std::array::from_fn(|i| now_totals[i].saturating_sub(old[i]) as f64 / secs)
    }
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
