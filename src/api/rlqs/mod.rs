//! The quota wing: Envoy's Rate Limit Quota Service,
//! `envoy.service.rate_limit_quota.v3.RateLimitQuotaService`.
//!
//! Each Envoy with the `rate_limit_quota` filter sorts its requests into
//! buckets, enforces an assignment for each locally, and streams what it
//! allowed and denied every reporting interval. This wing maps a bucket id
//! to a tenant, resource and key ([`BucketMapping`]), builds the demand of
//! the limits-table rules that apply (as every API does), and lets
//! [`Engine::share`] settle the report and divide the tightest rule among
//! every Envoy reporting it, through whichever Tollgate instance. The
//! answer to each report carries each bucket's next assignment.
//!
//! A stream's first report of a bucket subscribes it; a bucket that
//! reports no requests for `--rlqs-abandon-after` is abandoned (Envoy
//! forgets it); the stream ending gives the Envoy's shares back.

mod caps;
mod mapping;
mod options;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;
use tonic::{Request, Response, Status, Streaming};

pub use mapping::{BucketMapping, Mapped};
pub use options::RlqsOptions;

use caps::{StreamSlot, Streams};

use crate::algorithm::Op;
use crate::connections::ConnectionHandle;
use crate::engine::shares::{Assignment, Member, Shared, Usage};
use crate::engine::{Api, Demand, Engine, Item, Line, OverCapacity};
use crate::limits::watch::LiveLimits;
use crate::proto::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
    rate_limit_quota_response::BucketAction,
    rate_limit_quota_response::bucket_action::{
        AbandonAction, BucketAction as Action, QuotaAssignmentAction,
    },
    rate_limit_quota_service_server::RateLimitQuotaService,
};
use crate::proto::envoy::r#type::v3::{
    RateLimitStrategy, TokenBucket, rate_limit_strategy::BlanketRule, rate_limit_strategy::Strategy,
};
use crate::telemetry::metrics;

use super::quota_view::{self, RlqsView};

pub use crate::proto::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaServiceServer;

/// Reports of one message decided at once (each a store call or two).
const CONCURRENT_REPORTS: usize = 32;

/// How often a bucket whose part waits for others to shrink asks again,
/// between its Envoy's reports, and gets its grown part pushed.
const REASK_EVERY: Duration = Duration::from_secs(1);

/// Longest domain name a stream may give.
const MAX_DOMAIN_BYTES: usize = 256;

/// The request metadata naming the Envoy, unique per Envoy (set with the
/// quota server's `grpc_service.initial_metadata`): a stream that carries
/// it holds its shares under that name, so that an Envoy reconnecting
/// through another instance takes its own shares over at once, even when
/// the instance it left died without giving them back.
pub const ENVOY_ID_METADATA: &str = "x-tollgate-envoy";

/// Longest Envoy name.
const MAX_ENVOY_ID_BYTES: usize = 256;

/// Serves the quota service through the [`Engine`].
pub struct RlqsService {
    wing: Arc<Wing>,
    next_stream: AtomicU64,
    streams: Arc<Streams>,
    stop: Option<tokio::sync::watch::Receiver<bool>>,
}

impl RlqsService {
    /// The service over `engine`, with the rules of `limits`, recording
    /// the buckets subscribed in `view` (which the admin port shows).
    pub fn new(
        engine: Arc<Engine>,
        limits: Arc<LiveLimits>,
        options: RlqsOptions,
        view: Arc<RlqsView>,
    ) -> Self {
        let mut instance = [0u8; 8];
        getrandom::fill(&mut instance).expect("the operating system's random number generator");
        Self {
            wing: Arc::new(Wing {
                engine,
                limits,
                mapping: BucketMapping::new(&options),
                options,
                view,
                instance: u64::from_le_bytes(instance),
            }),
            next_stream: AtomicU64::new(1),
            streams: Arc::default(),
            stop: None,
        }
    }

    /// Ends open streams once `stop` turns true (at shutdown): their
    /// Envoys reconnect to another instance.
    pub fn with_shutdown(mut self, stop: tokio::sync::watch::Receiver<bool>) -> Self {
        self.stop = Some(stop);
        self
    }
}

/// A bucket a stream has subscribed.
struct Subscribed {
    /// The id as Envoy sent it, echoed in every action.
    id: BucketId,
    mapped: Mapped,
    member: String,
    last: Option<Assignment>,
    /// Since when its reports have counted no request.
    idle_since: Option<Instant>,
    /// When it last reported (Envoy's own time_elapsed is whole seconds
    /// only, a quarter off at a 5 s interval).
    reported_at: Option<Instant>,
    /// The demand of its last report, requests a second.
    demand: f64,
}

/// One stream's state.
struct Stream {
    service: Arc<Wing>,
    /// Its place under the caps, and its buckets', given back when the
    /// stream ends.
    slot: StreamSlot,
    domain: Option<String>,
    buckets: HashMap<u64, Subscribed>,
    /// The buckets whose part waits for others to shrink: asked for again
    /// every [`REASK_EVERY`].
    waiting: HashSet<u64>,
    number: u64,
    /// The longest reporting interval seen: the time to live covers three.
    interval: Duration,
    /// The hash of the Envoy's name, when the stream gave one.
    envoy: Option<u64>,
}

/// What every stream task needs of the service.
struct Wing {
    engine: Arc<Engine>,
    limits: Arc<LiveLimits>,
    options: RlqsOptions,
    mapping: BucketMapping,
    view: Arc<RlqsView>,
    /// This instance's name in share tables: members are unique across
    /// instances.
    instance: u64,
}

#[tonic::async_trait]
impl RateLimitQuotaService for RlqsService {
    type StreamRateLimitQuotasStream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<RateLimitQuotaResponse, Status>> + Send>,
    >;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Self::StreamRateLimitQuotasStream>, Status> {
        let peer = request
            .extensions()
            .get::<ConnectionHandle>()
            .map(|c| c.peer.ip());
        let envoy = match request.metadata().get(ENVOY_ID_METADATA) {
            None => None,
            Some(v) => match v.to_str() {
                Ok(id) if !id.is_empty() && id.len() <= MAX_ENVOY_ID_BYTES => {
                    Some(fnv(id.as_bytes()))
                }
                _ => {
                    return Err(Status::invalid_argument(format!(
                        "{ENVOY_ID_METADATA} must be 1 to {MAX_ENVOY_ID_BYTES} bytes of visible \
                         ASCII, unique per Envoy"
                    )));
                }
            },
        };
        let slot = self.streams.admit(peer, &self.wing.options)?;
        let mut inbound = request.into_inner();
        let mut stream = Stream {
            service: self.wing.clone(),
            slot,
            domain: None,
            buckets: HashMap::new(),
            waiting: HashSet::new(),
            number: self.next_stream.fetch_add(1, Ordering::Relaxed),
            interval: Duration::ZERO,
            envoy,
        };
        let mut stop = self.stop.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        tokio::spawn(async move {
            let stopping = async move {
                match stop.as_mut() {
                    Some(stop) => {
                        let _ = stop.wait_for(|s| *s).await;
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::pin!(stopping);
            let mut reask = tokio::time::interval(REASK_EVERY);
            reask.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let next = tokio::select! {
                    _ = &mut stopping => break,
                    _ = reask.tick() => {
                        if let Some(pushed) = stream.reask().await
                            && tx.send(Ok(pushed)).await.is_err()
                        {
                            break;
                        }
                        continue;
                    }
                    next = crate::api::codec::lenient(inbound.message()) => next,
                };
                let reports = match next {
                    Ok(Some(Ok(reports))) => reports,
                    Ok(Some(Err(status))) | Err(status) => {
                        let _ = tx.send(Err(status)).await;
                        break;
                    }
                    Ok(None) => break,
                };
                match stream.report(reports).await {
                    Ok(Some(response)) => {
                        if tx.send(Ok(response)).await.is_err() {
                            break;
                        }
                    }
                    Ok(None) => {}
                    Err(status) => {
                        let _ = tx.send(Err(status)).await;
                        break;
                    }
                }
            }
            stream.release().await;
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

impl Stream {
    /// Settles one message of reports and answers each reported bucket's
    /// assignment (`None`: nothing to answer). An error ends the stream.
    async fn report(
        &mut self,
        reports: RateLimitQuotaUsageReports,
    ) -> Result<Option<RateLimitQuotaResponse>, Status> {
        self.check_domain(&reports.domain)?;
        let now = Instant::now();
        let mut actions = Vec::new();
        let mut jobs = Vec::with_capacity(reports.bucket_quota_usages.len());
        for usage in reports.bucket_quota_usages {
            let Some(id) = usage.bucket_id else {
                metrics::rlqs_refused("no_bucket_id");
                continue;
            };
            let hash = mapping::hash_of(&id);
            if !self.buckets.contains_key(&hash) {
                let mapped = match self.service.mapping.map(&id) {
                    Ok(mapped) => mapped,
                    Err(why) => {
                        metrics::rlqs_refused("invalid_bucket_id");
                        tracing::debug!(stream = self.number, error = %why, "bucket id refused");
                        continue;
                    }
                };
                if self.buckets.len() >= self.service.options.max_buckets_per_stream {
                    metrics::rlqs_refused("buckets_per_stream");
                    return Err(Status::resource_exhausted(format!(
                        "this stream reports more than {} buckets, the most one stream may \
                         subscribe (--rlqs-max-buckets-per-stream); build bucket ids from \
                         fewer distinct values",
                        self.service.options.max_buckets_per_stream
                    )));
                }
                // Under the Envoy's name (with the domain: one Envoy may
                // report one bucket id for two domains), or this stream's.
                let member = match self.envoy {
                    Some(envoy) => {
                        let domain = fnv(self.domain.as_deref().unwrap_or_default().as_bytes());
                        format!("e{envoy:016x}.{domain:016x}.{hash:016x}")
                    }
                    None => format!(
                        "{:016x}.{:x}.{hash:016x}",
                        self.service.instance, self.number
                    ),
                };
                self.slot
                    .take_bucket(self.service.options.max_buckets_per_peer)?;
                self.buckets.insert(
                    hash,
                    Subscribed {
                        id,
                        mapped,
                        member,
                        last: None,
                        idle_since: None,
                        reported_at: None,
                        demand: 0.0,
                    },
                );
            }
            let elapsed = usage
                .time_elapsed
                .map(|d| d.seconds.clamp(0, 3600) as u64)
                .unwrap_or(0);
            let bucket = self.buckets.get_mut(&hash).expect("inserted above");
            let measured = bucket
                .reported_at
                .replace(now)
                .map(|at| now.duration_since(at));
            // The interval as measured here (what the Envoy says is trusted
            // only for the demand of a bucket's first report).
            if let Some(measured) = measured {
                self.interval = self.interval.max(measured);
            }
            let measured = measured.map(|d| d.as_micros() as u64);
            let usage = Usage {
                allowed: usage.num_requests_allowed,
                denied: usage.num_requests_denied,
                elapsed: measured.unwrap_or(elapsed * 1_000_000),
                demand: None,
            };
            if usage.allowed == 0 && usage.denied == 0 {
                let since = *bucket.idle_since.get_or_insert(now);
                if now.duration_since(since) >= self.service.options.abandon_after {
                    let gone = self.buckets.remove(&hash).expect("found above");
                    self.slot.give_buckets(1);
                    self.waiting.remove(&hash);
                    self.service.leave(&gone).await;
                    self.service.view.drop_bucket(self.number, hash);
                    metrics::rlqs_assignment("abandon");
                    actions.push(BucketAction {
                        bucket_id: Some(gone.id),
                        bucket_action: Some(Action::AbandonAction(AbandonAction {})),
                    });
                    continue;
                }
            } else {
                bucket.idle_since = None;
            }
            jobs.push((hash, usage));
        }
        // Three reporting intervals, within [--rlqs-assignment-ttl, four
        // times it]: a stream that reports rarely cannot reserve its
        // shares for longer.
        let ttl = self.ttl();
        actions.extend(self.settle_all(&jobs, ttl).await);
        if actions.is_empty() {
            return Ok(None);
        }
        Ok(Some(RateLimitQuotaResponse {
            bucket_action: actions,
        }))
    }

    /// Three reporting intervals, within [--rlqs-assignment-ttl, four
    /// times it]: a stream that reports rarely cannot reserve its shares
    /// for longer.
    fn ttl(&self) -> u64 {
        let o = &self.service.options;
        (3 * self.interval)
            .clamp(o.assignment_ttl, 4 * o.assignment_ttl)
            .as_secs()
    }

    /// Asks again for the buckets whose part waits for others to shrink,
    /// with the demand of their last report and nothing to charge: the
    /// grown assignments to push (`None`: none changed).
    async fn reask(&mut self) -> Option<RateLimitQuotaResponse> {
        let jobs: Vec<(u64, Usage)> = self
            .waiting
            .iter()
            .filter_map(|hash| {
                let usage = Usage {
                    allowed: 0,
                    denied: 0,
                    elapsed: 0,
                    demand: Some(self.buckets.get(hash)?.demand),
                };
                Some((*hash, usage))
            })
            .collect();
        if jobs.is_empty() {
            return None;
        }
        let before: HashMap<u64, Option<Assignment>> = jobs
            .iter()
            .map(|(h, _)| (*h, self.buckets[h].last))
            .collect();
        let actions: Vec<BucketAction> = self
            .settle_all(&jobs, self.ttl())
            .await
            .into_iter()
            .zip(&jobs)
            .filter(|(_, (hash, _))| {
                self.buckets.get(hash).map(|b| b.last) != before.get(hash).copied()
            })
            .map(|(action, _)| action)
            .collect();
        (!actions.is_empty()).then_some(RateLimitQuotaResponse {
            bucket_action: actions,
        })
    }

    /// Settles `jobs` (a bucket and its usage each), a few at a time, and
    /// answers each settled bucket's assignment for `ttl` seconds.
    async fn settle_all(&mut self, jobs: &[(u64, Usage)], ttl: u64) -> Vec<BucketAction> {
        let mut actions = Vec::with_capacity(jobs.len());
        let mut unsettled = 0usize;
        for chunk in jobs.chunks(CONCURRENT_REPORTS) {
            let decided = futures_util::future::join_all(chunk.iter().map(|(hash, usage)| {
                let bucket = &self.buckets[hash];
                self.service.share(bucket, *usage, ttl)
            }))
            .await;
            for ((hash, _), shared) in chunk.iter().zip(decided) {
                let Some(shared) = shared else {
                    unsettled += 1;
                    continue;
                };
                let bucket = self.buckets.get_mut(hash).expect("subscribed");
                bucket.last = Some(shared.assignment);
                if shared.waiting {
                    self.waiting.insert(*hash);
                } else {
                    self.waiting.remove(hash);
                }
                bucket.demand = shared.demand;
                self.service.view.record(
                    self.number,
                    *hash,
                    self.envoy.is_some(),
                    quota_view::Bucket {
                        tenant: &bucket.mapped.tenant,
                        resource: &bucket.mapped.resource,
                        key: &bucket.mapped.key,
                    },
                    &shared,
                );
                actions.push(assignment(bucket.id.clone(), &shared, ttl));
            }
        }
        if unsettled > 0 {
            tracing::warn!(
                stream = self.number,
                unsettled,
                of = jobs.len(),
                "quota reports not settled (the store failed); those buckets keep their \
                 assignments until they expire"
            );
        }
        actions
    }

    /// The first message names the domain; later ones name it again or
    /// not at all.
    fn check_domain(&mut self, domain: &str) -> Result<(), Status> {
        match &self.domain {
            None if domain.is_empty() => Err(Status::invalid_argument(
                "the stream's first report has no domain; set the filter's domain",
            )),
            None if domain.len() > MAX_DOMAIN_BYTES => Err(Status::invalid_argument(format!(
                "domain is {} bytes; at most {MAX_DOMAIN_BYTES}",
                domain.len()
            ))),
            None => {
                self.domain = Some(domain.to_owned());
                Ok(())
            }
            Some(d) if !domain.is_empty() && d != domain => Err(Status::invalid_argument(format!(
                "domain changed from {d:?} to {:?} on one stream; open a new stream for \
                 another domain",
                crate::limits::short(domain)
            ))),
            Some(_) => Ok(()),
        }
    }

    /// Gives back every share the stream holds (its Envoy is gone, or the
    /// instance is stopping). A named Envoy's shares stay until they
    /// expire: it may already report through another instance, under the
    /// same name.
    async fn release(&mut self) {
        let buckets: Vec<Subscribed> = self.buckets.drain().map(|(_, b)| b).collect();
        self.slot.give_buckets(buckets.len());
        self.waiting.clear();
        if self.envoy.is_some() {
            self.service.view.forget(self.number);
            return;
        }
        for chunk in buckets.chunks(CONCURRENT_REPORTS) {
            futures_util::future::join_all(chunk.iter().map(|b| self.service.leave(b))).await;
        }
        self.service.view.forget(self.number);
    }
}

impl Wing {
    /// Settles `usage` of `bucket` and answers its next assignment, for
    /// `ttl` seconds (`None`: not settled; the bucket keeps its assignment
    /// until it expires).
    async fn share(&self, bucket: &Subscribed, usage: Usage, ttl: u64) -> Option<Shared> {
        let m = &bucket.mapped;
        match self.settle(bucket, usage, ttl * 1_000_000).await {
            Ok(shared) => Some(shared),
            Err(err) => {
                // One warning per message counts them (settle_all).
                tracing::debug!(
                    tenant = %m.tenant,
                    key = %crate::limits::short(&m.key),
                    error = %err,
                    "quota report not settled"
                );
                None
            }
        }
    }

    /// Gives `bucket`'s share back.
    async fn leave(&self, bucket: &Subscribed) {
        let nothing = Usage {
            allowed: 0,
            denied: 0,
            elapsed: 0,
            demand: None,
        };
        let _ = self.settle(bucket, nothing, 0).await;
    }

    /// The engine's share for `bucket`: the demand of the rules that apply
    /// to its tenant, resource and key, as for every API.
    async fn settle(
        &self,
        bucket: &Subscribed,
        usage: Usage,
        ttl: crate::algorithm::Micros,
    ) -> Result<Shared, crate::engine::DecideError> {
        let rules = self.limits.snapshot();
        let m = &bucket.mapped;
        let mut demand = Demand::new(Api::Rlqs, Op::Charge, OverCapacity::Reject);
        demand
            .items
            .push(Item::new(&m.tenant, &m.resource, &m.key, 0));
        for rule in rules.applicable(&m.tenant, &m.resource) {
            demand
                .lines
                .push(Line::of_rule(&rules, 0, &m.tenant, &m.key, rule));
        }
        let member = Member {
            id: &bucket.member,
            ttl,
            last: bucket.last,
        };
        self.engine.share(&mut demand, usage, member).await
    }
}

/// The 64-bit FNV-1a hash of `bytes`.
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The action that assigns `shared` to bucket `id` for `ttl` seconds.
fn assignment(id: BucketId, shared: &Shared, ttl: u64) -> BucketAction {
    let strategy = match shared.assignment {
        Assignment::AllowAll => Strategy::BlanketRule(BlanketRule::AllowAll as i32),
        Assignment::DenyAll => Strategy::BlanketRule(BlanketRule::DenyAll as i32),
        Assignment::Bucket(b) => Strategy::TokenBucket(TokenBucket {
            max_tokens: b.max_tokens,
            tokens_per_fill: Some(b.tokens_per_fill),
            fill_interval: Some(prost_types::Duration {
                seconds: i64::from(b.fill_interval),
                nanos: 0,
            }),
        }),
    };
    metrics::rlqs_assignment(match shared.assignment {
        Assignment::AllowAll => "allow_all",
        Assignment::DenyAll => "deny_all",
        Assignment::Bucket(_) => "token_bucket",
    });
    BucketAction {
        bucket_id: Some(id),
        bucket_action: Some(Action::QuotaAssignmentAction(QuotaAssignmentAction {
            assignment_time_to_live: Some(prost_types::Duration {
                seconds: ttl as i64,
                nanos: 0,
            }),
            rate_limit_strategy: Some(RateLimitStrategy {
                strategy: Some(strategy),
            }),
        })),
    }
}
