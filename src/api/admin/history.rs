//! The last hour in process, for the status page's plots: one point a
//! second (decisions that second allowed / rejected / degraded, store call
//! percentiles, the tenants with the most rejections that second, the
//! tenants holding the most slots and those deepest in debt), at most
//! [`POINTS`] of them, served columnar as `GET /v1/history`.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use axum::Json;
use axum::extract::{Query, State};
use parking_lot::Mutex;
use serde_json::{Value, json};

use super::AdminState;
use crate::telemetry::latency;
use crate::telemetry::metrics::{self, Outcome};
use crate::telemetry::top::TopLimited;

/// Points kept: an hour of seconds.
pub const POINTS: usize = 3600;
/// Tenants kept per point and per figure.
const TENANTS_PER_POINT: usize = 5;
/// Tenants drawn per figure: those with the largest sums over the range.
const TENANTS_DRAWN: usize = 8;

/// Tenants and their figures at one point.
type Figures = Vec<(Arc<str>, u64)>;

#[derive(Debug, Clone)]
struct Point {
    /// Unix seconds.
    t: u64,
    /// When it was taken, for rates.
    at: tokio::time::Instant,
    /// Decisions since the point before, per outcome (as [`Outcome::ALL`]).
    counts: [u64; 7],
    /// Store call p50, p90, p99 (us) in the second; `None` without calls.
    latency: Option<[u64; 3]>,
    rejections: Figures,
    held: Figures,
    debt: Figures,
}

#[derive(Default)]
struct Inner {
    points: VecDeque<Point>,
    /// The decision totals and store latency counts at the last sample
    /// (none yet: zero, as at start).
    last: Option<([u64; 7], Vec<u64>)>,
}

/// The ring of points.
#[derive(Default)]
pub struct History {
    inner: Mutex<Inner>,
}

/// `name` as the previous point holds it, so an hour of one tenant is one
/// allocation.
fn intern(previous: Option<&Point>, name: String) -> Arc<str> {
    previous
        .into_iter()
        .flat_map(|p| p.rejections.iter().chain(&p.held).chain(&p.debt))
        .find(|(n, _)| **n == *name)
        .map_or_else(|| Arc::from(name), |(n, _)| n.clone())
}

impl History {
    /// Takes a point (the server calls this every second); `now` is Unix
    /// seconds.
    pub fn sample(&self, top: &TopLimited, now: u64) {
        let totals = metrics::totals();
        let latency = metrics::STORE_LATENCY.snapshot();
        let rejections = top.take_interval(TENANTS_PER_POINT);
        let held = top.holding(TENANTS_PER_POINT);
        let debt = top.in_debt(TENANTS_PER_POINT);
        let mut inner = self.inner.lock();
        let (before, lat_before) = inner
            .last
            .replace((totals, latency.clone()))
            .unwrap_or(([0; 7], Vec::new()));
        let previous = inner.points.back().cloned();
        let point = Point {
            t: now,
            at: tokio::time::Instant::now(),
            counts: std::array::from_fn(|i| totals[i].saturating_sub(before[i])),
            latency: latency::quantiles(&lat_before, &latency, &[0.5, 0.9, 0.99])
                .map(|q| [q[0], q[1], q[2]]),
            rejections: rejections
                .into_iter()
                .map(|h| (intern(previous.as_ref(), h.name), h.count))
                .collect(),
            held: held
                .into_iter()
                .map(|h| (intern(previous.as_ref(), h.tenant), h.held))
                .collect(),
            debt: debt
                .into_iter()
                .map(|d| (intern(previous.as_ref(), d.tenant), d.debt))
                .collect(),
        };
        inner.points.push_back(point);
        while inner.points.len() > POINTS {
            inner.points.pop_front();
        }
    }

    /// Decisions per second and outcome over the last ten points (about
    /// ten seconds), for `/v1/status`; zeros until two points are taken.
    pub fn per_second(&self) -> [f64; 7] {
        let inner = self.inner.lock();
        let n = inner.points.len();
        if n < 2 {
            return [0.0; 7];
        }
        // Each point counts what happened since the one before it.
        let from = n.saturating_sub(11);
        let secs = inner.points[n - 1]
            .at
            .duration_since(inner.points[from].at)
            .as_secs_f64();
        if secs < 0.5 {
            return [0.0; 7];
        }
        let mut sums = [0u64; 7];
        for p in inner.points.range(from + 1..) {
            for (sum, c) in sums.iter_mut().zip(p.counts) {
                *sum += c;
            }
        }
        sums.map(|s| s as f64 / secs)
    }

    /// The last `seconds` of points, columnar (for uPlot): `t`, the
    /// decisions counted since the point before (about a second),
    /// the percentiles (null where no store call was timed), and per
    /// figure the tenants drawn with one value per point (rejections: 0
    /// where not among the top; held and debt: null where not seen).
    pub fn json(&self, seconds: usize) -> Value {
        let inner = self.inner.lock();
        let skip = inner.points.len().saturating_sub(seconds);
        let points: Vec<&Point> = inner.points.iter().skip(skip).collect();
        let column =
            |f: &dyn Fn(&Point) -> Value| -> Vec<Value> { points.iter().map(|p| f(p)).collect() };
        let tenants = |pick: &dyn Fn(&Point) -> &Figures, missing: Value| {
            let mut sums: BTreeMap<&str, u64> = BTreeMap::new();
            for p in &points {
                for (name, n) in pick(p) {
                    *sums.entry(name).or_default() += n;
                }
            }
            let mut ranked: Vec<(&str, u64)> = sums.into_iter().collect();
            ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
            ranked.truncate(TENANTS_DRAWN);
            let mut out = serde_json::Map::new();
            for (name, _) in ranked {
                let series: Vec<Value> = points
                    .iter()
                    .map(|p| {
                        pick(p)
                            .iter()
                            .find(|(n, _)| &**n == name)
                            .map_or(missing.clone(), |(_, v)| json!(v))
                    })
                    .collect();
                out.insert(
                    if name.is_empty() { "(default)" } else { name }.into(),
                    series.into(),
                );
            }
            Value::Object(out)
        };
        let quantile = |i: usize| column(&|p| p.latency.map_or(Value::Null, |l| json!(l[i])));
        json!({
            "interval_seconds": 1,
            "t": column(&|p| json!(p.t)),
            "allowed": column(&|p| json!(count(p, &[Outcome::Allowed, Outcome::ShadowRejected]))),
            "rejected": column(&|p| json!(count(p, &[Outcome::Rejected]))),
            "degraded": column(&|p| json!(count(p, &[Outcome::FailedOpen, Outcome::FailedClosed, Outcome::LocalFallback]))),
            "store_p50_us": quantile(0),
            "store_p90_us": quantile(1),
            "store_p99_us": quantile(2),
            "rejections": tenants(&|p| &p.rejections, json!(0)),
            "held": tenants(&|p| &p.held, Value::Null),
            "debt": tenants(&|p| &p.debt, Value::Null),
        })
    }
}

/// A point's decisions of `outcomes`.
fn count(p: &Point, outcomes: &[Outcome]) -> u64 {
    Outcome::ALL
        .iter()
        .zip(p.counts)
        .filter(|(o, _)| outcomes.contains(o))
        .map(|(_, c)| c)
        .sum()
}

#[derive(Debug, serde::Deserialize)]
pub(super) struct HistoryQuery {
    seconds: Option<usize>,
}

/// `GET /v1/history[?seconds=N]` (default and at most an hour).
pub(super) async fn http(
    State(state): State<Arc<AdminState>>,
    Query(q): Query<HistoryQuery>,
) -> Json<Value> {
    Json(state.history.json(q.seconds.unwrap_or(POINTS).min(POINTS)))
}
