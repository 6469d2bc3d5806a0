//! The load generator for the gRPC APIs.
//!
//! Closed loop: `concurrency` requests in flight, each sent as soon as the
//! previous answered; throughput is what the server sustains. Open loop:
//! requests are sent on a fixed schedule (`rate` per second) whatever the
//! answers do, and each latency is measured from the moment the request was
//! *due*, not when it was sent, so a stalled server shows up as latency
//! instead of silently lowering the load (coordinated omission).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use hdrhistogram::Histogram;
use parking_lot::Mutex;
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};

use tollgate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use tollgate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use tollgate::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use tollgate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tollgate::proto::v1::rate_limiter_client::RateLimiterClient;
use tollgate::proto::v1::{
    AcquireRequest, AcquireResponse, BatchItem, ChargeRequest, ChargeResponse, ReleaseRequest,
    ReleaseResponse, ReserveRequest, ReserveResponse, SettleRequest, SettleResponse,
    ShouldAllowBatchRequest, ShouldAllowRequest, StreamDecision,
};

use crate::verdicts::{self, BatchVerdicts, Verdict};

/// Which API to drive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Api {
    /// `tollgate.v1.RateLimiter/ShouldAllow`.
    Native,
    /// `tollgate.v1.RateLimiter/ShouldAllowBatch`, `batch` items per call.
    Batch,
    /// `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`.
    Envoy,
    /// `tollgate.v1.RateLimiter/ShouldAllowStream`: one long-lived stream per
    /// worker, one decision per message.
    Stream,
    /// `tollgate.v1.RateLimiter/Reserve` then `Settle` of what it reserved
    /// (at half the estimate): two calls per unit, each counted.
    Budget,
    /// `tollgate.v1.RateLimiter/Charge`: usage charged after the fact.
    Charge,
    /// `tollgate.v1.RateLimiter/Acquire` (a slot and a token) then
    /// `Release` of the lease: two calls per unit, each counted.
    Lease,
}

/// How keys are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Distribution {
    /// Every key equally likely.
    Uniform,
    /// Zipf with this exponent: a few hot keys, a long tail.
    Zipf(f64),
}

impl std::str::FromStr for Distribution {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once(':') {
            None if s == "uniform" => Ok(Self::Uniform),
            None if s == "zipf" => Ok(Self::Zipf(1.0)),
            Some(("zipf", e)) => e
                .parse::<f64>()
                .ok()
                .filter(|e| *e > 0.0)
                .map(Self::Zipf)
                .ok_or_else(|| format!("zipf exponent {e:?} must be a positive number")),
            _ => Err(format!("{s:?}: use uniform, zipf or zipf:EXPONENT")),
        }
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// `http://host:port` of the server.
    pub server: String,
    /// API.
    pub api: Api,
    /// Items per batch call.
    pub batch: usize,
    /// HTTP/2 connections; calls are spread over them.
    pub connections: usize,
    /// Closed loop: calls in flight.
    pub concurrency: usize,
    /// Open loop: calls per second (closed loop when `None`).
    pub rate: Option<u64>,
    /// How long to run.
    pub duration: Duration,
    /// Distinct keys.
    pub keys: u64,
    /// How keys are drawn.
    pub distribution: Distribution,
    /// Tenant of the native calls / domain of the Envoy calls; a
    /// comma-separated list spreads the workers over them.
    pub tenant: String,
    /// Resource of the native calls (empty: none).
    pub resource: String,
    /// Print a progress line every second (to stderr).
    pub progress: bool,
}

/// What a run measured.
#[derive(Debug, Clone)]
pub struct Summary {
    /// Calls answered.
    pub calls: u64,
    /// Decisions made (calls × batch size).
    pub decisions: u64,
    /// Calls that failed.
    pub errors: u64,
    /// Decisions allowed.
    pub allowed: u64,
    /// Decisions answered by a rule's store-unavailable policy instead of
    /// the store (the `degraded` field; the Envoy API does not report it).
    pub degraded: u64,
    /// Wall time of the run.
    pub elapsed: Duration,
    /// Latency percentiles in microseconds: p50, p90, p99, p99.9, max.
    pub latency_us: [u64; 5],
}

impl Summary {
    /// Calls per second.
    pub fn throughput(&self) -> f64 {
        self.calls as f64 / self.elapsed.as_secs_f64()
    }

    /// One line of figures.
    pub fn render(&self) -> String {
        let [p50, p90, p99, p999, max] = self.latency_us;
        format!(
            "calls {}  decisions {}  errors {}  degraded {}  allowed {} ({:.1}%)  throughput {:.0} calls/s ({:.0} decisions/s)\n\
             latency µs: p50 {p50}  p90 {p90}  p99 {p99}  p99.9 {p999}  max {max}",
            self.calls,
            self.decisions,
            self.errors,
            self.degraded,
            self.allowed,
            100.0 * self.allowed as f64 / self.decisions.max(1) as f64,
            self.throughput(),
            self.decisions as f64 / self.elapsed.as_secs_f64(),
        )
    }
}

/// Draws keys by the distribution.
struct Keys {
    cdf: Option<Arc<[f64]>>,
    n: u64,
    state: u64,
}

/// The cumulative distribution of a zipf draw over `n` keys (`None` for
/// uniform). Built once per run and shared by the workers: it is n floats.
fn key_cdf(n: u64, distribution: Distribution) -> Option<Arc<[f64]>> {
    match distribution {
        Distribution::Uniform => None,
        Distribution::Zipf(s) => {
            let mut acc = 0.0;
            let mut cdf: Vec<f64> = (1..=n.max(1))
                .map(|k| {
                    acc += 1.0 / (k as f64).powf(s);
                    acc
                })
                .collect();
            let total = acc;
            cdf.iter_mut().for_each(|c| *c /= total);
            Some(cdf.into())
        }
    }
}

impl Keys {
    fn new(n: u64, cdf: Option<Arc<[f64]>>, seed: u64) -> Self {
        Self {
            cdf,
            n: n.max(1),
            state: seed | 1,
        }
    }

    fn next_u64(&mut self) -> u64 {
        // xorshift64*
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        self.state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn next(&mut self) -> u64 {
        let r = self.next_u64();
        match &self.cdf {
            None => r % self.n,
            Some(cdf) => {
                let u = (r >> 11) as f64 / (1u64 << 53) as f64;
                cdf.partition_point(|c| *c < u) as u64
            }
        }
    }
}

/// One worker's connection to the API under test.
const SHOULD_ALLOW: &str = "/tollgate.v1.RateLimiter/ShouldAllow";
const SHOULD_ALLOW_BATCH: &str = "/tollgate.v1.RateLimiter/ShouldAllowBatch";
const RESERVE: &str = "/tollgate.v1.RateLimiter/Reserve";
const SETTLE: &str = "/tollgate.v1.RateLimiter/Settle";
const CHARGE: &str = "/tollgate.v1.RateLimiter/Charge";
const ACQUIRE: &str = "/tollgate.v1.RateLimiter/Acquire";
const RELEASE: &str = "/tollgate.v1.RateLimiter/Release";

enum Client {
    Native(tonic::client::Grpc<Channel>),
    Budget(tonic::client::Grpc<Channel>),
    Charge(tonic::client::Grpc<Channel>),
    Lease(tonic::client::Grpc<Channel>),
    /// With the items per call.
    Batch(tonic::client::Grpc<Channel>, usize),
    Envoy(RateLimitServiceClient<Channel>),
    /// The worker's own stream: requests in, decisions out.
    Stream(
        tokio::sync::mpsc::Sender<ShouldAllowRequest>,
        tonic::Streaming<StreamDecision>,
    ),
}

impl Client {
    /// A client of `api` on `channel`; for streams, opens the stream.
    async fn open(api: Api, channel: Channel, batch: usize) -> Result<Self, String> {
        Ok(match api {
            Api::Native => Self::Native(tonic::client::Grpc::new(channel)),
            Api::Budget => Self::Budget(tonic::client::Grpc::new(channel)),
            Api::Charge => Self::Charge(tonic::client::Grpc::new(channel)),
            Api::Lease => Self::Lease(tonic::client::Grpc::new(channel)),
            Api::Batch => Self::Batch(tonic::client::Grpc::new(channel), batch),
            Api::Envoy => Self::Envoy(RateLimitServiceClient::new(channel)),
            Api::Stream => {
                let (tx, rx) = tokio::sync::mpsc::channel(1);
                let responses = RateLimiterClient::new(channel)
                    .should_allow_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
                    .await
                    .map_err(|e| format!("cannot open a stream: {e}"))?
                    .into_inner();
                Self::Stream(tx, responses)
            }
        })
    }

    /// One call; returns what it decided.
    async fn call(
        &mut self,
        tenant: &str,
        resource: &str,
        keys: &mut Keys,
    ) -> Result<Tally, tonic::Status> {
        let tally = |allowed: bool, degraded: i32| Tally {
            decisions: 1,
            allowed: u64::from(allowed),
            degraded: u64::from(degraded != 0),
        };
        let request = |keys: &mut Keys| ShouldAllowRequest {
            key: format!("k{}", keys.next()),
            cost: 1,
            tenant: tenant.to_owned(),
            resource: resource.to_owned(),
            dry_run: false,
        };
        match self {
            Self::Native(c) => {
                let r: Verdict = verdicts::unary(c, SHOULD_ALLOW, request(keys)).await?;
                Ok(tally(r.allowed, r.degraded))
            }
            Self::Budget(c) => {
                let reserve = ReserveRequest {
                    key: format!("k{}", keys.next()),
                    estimate: 2,
                    tenant: tenant.to_owned(),
                    resource: resource.to_owned(),
                    ttl: None,
                };
                let r: ReserveResponse = verdicts::unary(c, RESERVE, reserve).await?;
                let allowed = r.decision.as_ref().is_some_and(|d| d.allowed);
                if r.reservation.is_empty() {
                    return Ok(tally(allowed, 0));
                }
                let settle = SettleRequest {
                    reservation: r.reservation,
                    actual: 1,
                };
                let _: SettleResponse = verdicts::unary(c, SETTLE, settle).await?;
                Ok(Tally {
                    decisions: 2,
                    allowed: 2 * u64::from(allowed),
                    degraded: 0,
                })
            }
            Self::Lease(c) => {
                let acquire = AcquireRequest {
                    key: format!("k{}", keys.next()),
                    tenant: tenant.to_owned(),
                    resource: resource.to_owned(),
                    ttl: None,
                    cost: 1,
                };
                let r: AcquireResponse = verdicts::unary(c, ACQUIRE, acquire).await?;
                let degraded = r.decision.as_ref().map_or(0, |d| d.degraded);
                if r.lease.is_empty() {
                    return Ok(tally(r.granted, degraded));
                }
                let release = ReleaseRequest { lease: r.lease };
                let _: ReleaseResponse = verdicts::unary(c, RELEASE, release).await?;
                Ok(Tally {
                    decisions: 2,
                    allowed: 2 * u64::from(r.granted),
                    degraded: 2 * u64::from(degraded != 0),
                })
            }
            Self::Charge(c) => {
                let charge = ChargeRequest {
                    key: format!("k{}", keys.next()),
                    cost: 1,
                    tenant: tenant.to_owned(),
                    resource: resource.to_owned(),
                };
                let _: ChargeResponse = verdicts::unary(c, CHARGE, charge).await?;
                Ok(tally(true, 0))
            }
            Self::Batch(c, batch) => {
                let items = (0..*batch)
                    .map(|_| BatchItem {
                        key: format!("k{}", keys.next()),
                        cost: 1,
                        tenant: tenant.to_owned(),
                        resource: resource.to_owned(),
                    })
                    .collect();
                let request = ShouldAllowBatchRequest {
                    items,
                    dry_run: false,
                };
                let r: BatchVerdicts = verdicts::unary(c, SHOULD_ALLOW_BATCH, request).await?;
                Ok(r.results.iter().map(|v| tally(v.allowed, v.degraded)).sum())
            }
            Self::Envoy(c) => {
                let r = c
                    .should_rate_limit(RateLimitRequest {
                        domain: tenant.to_owned(),
                        descriptors: vec![RateLimitDescriptor {
                            entries: vec![Entry {
                                key: "api_key".into(),
                                value: format!("k{}", keys.next()),
                            }],
                            limit: None,
                            hits_addend: None,
                            is_negative_hits: false,
                        }],
                        hits_addend: 1,
                    })
                    .await?
                    .into_inner();
                Ok(Tally {
                    decisions: 1,
                    allowed: u64::from(r.overall_code == 1),
                    degraded: 0,
                })
            }
            Self::Stream(tx, rx) => {
                tx.send(request(keys))
                    .await
                    .map_err(|_| tonic::Status::unavailable("stream closed"))?;
                let answer = rx
                    .message()
                    .await?
                    .ok_or_else(|| tonic::Status::unavailable("stream ended"))?;
                Ok(answer.decision.as_ref().map_or(
                    Tally {
                        decisions: 1,
                        ..Tally::default()
                    },
                    |r| tally(r.allowed, r.degraded),
                ))
            }
        }
    }
}

/// What one call decided.
#[derive(Default)]
struct Tally {
    decisions: u64,
    allowed: u64,
    degraded: u64,
}

impl std::iter::Sum for Tally {
    fn sum<I: Iterator<Item = Self>>(iter: I) -> Self {
        iter.fold(Self::default(), |a, b| Self {
            decisions: a.decisions + b.decisions,
            allowed: a.allowed + b.allowed,
            degraded: a.degraded + b.degraded,
        })
    }
}

/// What the workers count, shared.
#[derive(Default)]
struct Counters {
    calls: AtomicU64,
    decisions: AtomicU64,
    allowed: AtomicU64,
    degraded: AtomicU64,
    errors: AtomicU64,
}

/// Latencies from 1 µs to 60 s at three significant digits.
fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid bounds")
}

/// The open loop's schedule: a thread releases each call's scheduled instant
/// as it falls due, `rate` per second from `start` until `deadline`. It
/// sleeps on the OS's high-resolution timer, because tokio's timer wheel
/// would round every send up to the next millisecond. Idle workers take the
/// instants in order; one that finds every worker busy waits in the queue,
/// and that wait counts in its latency: queueing is measured, not hidden.
fn pace(rate: u64, start: Instant, deadline: Instant) -> flume::Receiver<Instant> {
    let every = Duration::from_secs_f64(1.0 / rate.max(1) as f64);
    let (tx, rx) = flume::unbounded::<Instant>();
    std::thread::spawn(move || {
        let mut due = start;
        while due < deadline {
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            let now = Instant::now();
            while due <= now && due < deadline {
                if tx.send(due).is_err() {
                    return;
                }
                due += every;
            }
        }
    });
    rx
}

/// Prints calls per second to stderr once a second until `done`.
fn spawn_progress(
    counters: Arc<Counters>,
    started: Instant,
    done: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut last = 0;
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.tick().await;
        while !done.load(Ordering::Relaxed) {
            tick.tick().await;
            let now = counters.calls.load(Ordering::Relaxed);
            eprintln!(
                "{:>6.1} s  {:>8} calls/s  {:>10} calls",
                started.elapsed().as_secs_f64(),
                now - last,
                now
            );
            last = now;
        }
    })
}

/// Runs the load and returns its summary.
///
/// Closed loop: every worker sends its next call when the last one is
/// answered. Open loop: workers send on the schedule of [`pace`], and each
/// latency counts from the call's scheduled instant.
pub async fn run(options: LoadOptions) -> Result<Summary, String> {
    let mut channels = Vec::new();
    for _ in 0..options.connections.max(1) {
        let channel = Endpoint::from_shared(options.server.clone())
            .map_err(|e| e.to_string())?
            .tcp_nodelay(true)
            .connect()
            .await
            .map_err(|e| format!("cannot reach {}: {e}", options.server))?;
        channels.push(channel);
    }
    let histogram = Arc::new(Mutex::new(latency_histogram()));
    let counters = Arc::new(Counters::default());
    let cdf = key_cdf(options.keys, options.distribution);
    let started = Instant::now();
    let deadline = started + options.duration;
    let done = Arc::new(AtomicBool::new(false));
    let progress = options
        .progress
        .then(|| spawn_progress(counters.clone(), started, done.clone()));
    let tickets = options.rate.map(|rate| pace(rate, started, deadline));

    let mut workers = Vec::new();
    for w in 0..options.concurrency.max(1) {
        let channel = channels[w % channels.len()].clone();
        let mut client = Client::open(options.api, channel, options.batch).await?;
        let (histogram, counters, tickets) = (histogram.clone(), counters.clone(), tickets.clone());
        let mut keys = Keys::new(options.keys, cdf.clone(), 0x9e37_79b9 + w as u64);
        // A list of tenants spreads the workers over them, in turn.
        let tenants: Vec<&str> = options.tenant.split(',').collect();
        let tenant = tenants[w % tenants.len()].to_owned();
        let resource = options.resource.clone();
        workers.push(tokio::spawn(async move {
            let mut local = latency_histogram();
            loop {
                let scheduled = match &tickets {
                    Some(tickets) => match tickets.recv_async().await {
                        Ok(at) => at,
                        Err(_) => break,
                    },
                    None => Instant::now(),
                };
                if scheduled >= deadline {
                    break;
                }
                match client.call(&tenant, &resource, &mut keys).await {
                    Ok(tally) => {
                        counters
                            .decisions
                            .fetch_add(tally.decisions, Ordering::Relaxed);
                        counters.allowed.fetch_add(tally.allowed, Ordering::Relaxed);
                        counters
                            .degraded
                            .fetch_add(tally.degraded, Ordering::Relaxed);
                    }
                    Err(_) => {
                        counters.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
                counters.calls.fetch_add(1, Ordering::Relaxed);
                let _ = local.record(scheduled.elapsed().as_micros().max(1) as u64);
            }
            histogram.lock().add(&local).expect("same bounds");
        }));
    }
    for worker in workers {
        worker.await.map_err(|e| e.to_string())?;
    }
    done.store(true, Ordering::Relaxed);
    if let Some(p) = progress {
        p.abort();
    }
    let h = histogram.lock();
    Ok(Summary {
        calls: counters.calls.load(Ordering::Relaxed),
        decisions: counters.decisions.load(Ordering::Relaxed),
        errors: counters.errors.load(Ordering::Relaxed),
        allowed: counters.allowed.load(Ordering::Relaxed),
        degraded: counters.degraded.load(Ordering::Relaxed),
        elapsed: started.elapsed(),
        latency_us: [
            h.value_at_quantile(0.5),
            h.value_at_quantile(0.9),
            h.value_at_quantile(0.99),
            h.value_at_quantile(0.999),
            h.max(),
        ],
    })
}

/// CPU time (user + system) a process has used so far, from `/proc/PID/stat`.
pub fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may contain spaces) start at ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // Linux reports in clock ticks of 1/100 s (USER_HZ).
    Some(Duration::from_millis(ticks * 10))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zipf_keys_favour_the_first_ones_and_stay_in_range() {
        let mut keys = Keys::new(1000, key_cdf(1000, Distribution::Zipf(1.1)), 7);
        let mut counts = vec![0u32; 1000];
        for _ in 0..100_000 {
            counts[keys.next() as usize] += 1;
        }
        assert!(
            counts[0] > counts[9] && counts[9] > counts[99],
            "{:?}",
            &counts[..10]
        );
        let mut uniform = Keys::new(10, key_cdf(10, Distribution::Uniform), 7);
        assert!((0..1000).all(|_| uniform.next() < 10));
        assert_eq!(
            "zipf:1.2".parse::<Distribution>(),
            Ok(Distribution::Zipf(1.2))
        );
        assert!("zipf:-1".parse::<Distribution>().is_err());
    }

    #[test]
    fn cpu_time_of_this_process_is_readable() {
        assert!(cpu_time(std::process::id()).is_some());
    }
}
