//! The gRPC surface: Tollgate's own `tollgate.v1.RateLimiter` service.
//!
//! Protobuf types stop here: requests become [`Item`]s, [`Decision`]s
//! become responses, errors become statuses in [`status`].

pub mod codec;
pub mod observe;
pub mod status;

use std::collections::HashMap;
use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::bucket::Micros;
use crate::limiter::{Decision, Item, Limiter};
use crate::limits::OnStoreUnavailable;
use crate::telemetry::metrics::{self, Outcome};
use crate::telemetry::top::TopLimited;
use crate::telemetry::traces;
use tracing::Instrument;

/// Code generated from `proto/`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod proto {
    /// `tollgate.v1`.
    pub mod v1 {
        tonic::include_proto!("tollgate.v1");
    }

    /// The subset of Envoy's API that its rate limit service needs.
    pub mod envoy {
        /// `envoy.config.*`.
        pub mod config {
            /// `envoy.config.core`.
            pub mod core {
                /// `envoy.config.core.v3`.
                pub mod v3 {
                    tonic::include_proto!("envoy.config.core.v3");
                }
            }
        }
        /// `envoy.extensions.*`.
        pub mod extensions {
            /// `envoy.extensions.common`.
            pub mod common {
                /// `envoy.extensions.common.ratelimit`.
                pub mod ratelimit {
                    /// `envoy.extensions.common.ratelimit.v3`.
                    pub mod v3 {
                        tonic::include_proto!("envoy.extensions.common.ratelimit.v3");
                    }
                }
            }
        }
        /// `envoy.service.*`.
        pub mod service {
            /// `envoy.service.ratelimit`.
            pub mod ratelimit {
                /// `envoy.service.ratelimit.v3`.
                pub mod v3 {
                    tonic::include_proto!("envoy.service.ratelimit.v3");
                }
            }
        }
        /// `envoy.type.*`.
        pub mod r#type {
            /// `envoy.type.v3`.
            pub mod v3 {
                include!(concat!(env!("OUT_DIR"), "/envoy.r#type.v3.rs"));
            }
        }
    }

    /// The encoded descriptors of every Tollgate proto, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("tollgate_descriptor");
}

use proto::v1::rate_limiter_server::RateLimiter;
use proto::v1::{
    ShouldAllowBatchRequest, ShouldAllowBatchResponse, ShouldAllowRequest, ShouldAllowResponse,
};

pub use proto::v1::admin_server::AdminServer;
pub use proto::v1::rate_limiter_server::RateLimiterServer;

/// The `api` label of decisions made through this service.
const API: &str = "native";

/// Implements `tollgate.v1.RateLimiter` over a [`Limiter`].
pub struct RateLimiterService {
    limiter: Arc<Limiter>,
    top: Arc<TopLimited>,
    stop: Option<tokio::sync::watch::Receiver<bool>>,
}

impl RateLimiterService {
    /// The service over `limiter`, counting rejections in `top`.
    pub fn new(limiter: Arc<Limiter>, top: Arc<TopLimited>) -> Self {
        Self {
            limiter,
            top,
            stop: None,
        }
    }

    /// Ends open decision streams once `stop` turns true (at shutdown), so
    /// that a graceful shutdown does not wait for sidecars to hang up.
    pub fn with_shutdown(mut self, stop: tokio::sync::watch::Receiver<bool>) -> Self {
        self.stop = Some(stop);
        self
    }

    fn record(&self, item: &Item<'_>, decision: &Decision) -> Outcome {
        let outcome = self.classify(item, decision);
        let rule = decision.rule.as_ref().map_or("", |r| r.name.as_str());
        metrics::decision(API, outcome, rule, item.cost.max(1));
        outcome
    }

    /// The decision's outcome; a rejection also counts toward the
    /// most-limited list.
    fn classify(&self, item: &Item<'_>, decision: &Decision) -> Outcome {
        let outcome = match (decision.degraded, decision.allowed, decision.shadow) {
            (Some(OnStoreUnavailable::Allow), ..) => Outcome::FailedOpen,
            (Some(OnStoreUnavailable::Deny), ..) => Outcome::FailedClosed,
            (Some(OnStoreUnavailable::Local), ..) => Outcome::LocalFallback,
            (None, false, _) => Outcome::Rejected,
            (None, true, true) => Outcome::ShadowRejected,
            (None, true, false) => Outcome::Allowed,
        };
        if !decision.allowed {
            self.top.record(item.tenant, item.key, item.cost.max(1));
        }
        outcome
    }

    /// Counts a batch's decisions: one counter update per run of items with
    /// the same outcome and rule (usually one for the whole batch) instead
    /// of one per item.
    fn record_batch(&self, items: &[Item<'_>], decisions: &[Decision]) {
        let mut run: Option<(Outcome, &str, u64, u64)> = None;
        for (item, decision) in items.iter().zip(decisions) {
            let outcome = self.classify(item, decision);
            let rule = decision.rule.as_ref().map_or("", |r| r.name.as_str());
            let cost = item.cost.max(1);
            match &mut run {
                Some((o, r, n, tokens)) if *o == outcome && *r == rule => {
                    *n += 1;
                    *tokens += cost;
                }
                _ => {
                    if let Some((o, r, n, tokens)) = run {
                        metrics::decisions(API, o, r, n, tokens);
                    }
                    run = Some((outcome, rule, 1, cost));
                }
            }
        }
        if let Some((o, r, n, tokens)) = run {
            metrics::decisions(API, o, r, n, tokens);
        }
    }
}

/// Implements `tollgate.v1.Admin`.
pub struct AdminService {
    top: Arc<TopLimited>,
}

impl AdminService {
    /// The service reading `top`.
    pub fn new(top: Arc<TopLimited>) -> Self {
        Self { top }
    }
}

#[tonic::async_trait]
impl proto::v1::admin_server::Admin for AdminService {
    async fn top_limited(
        &self,
        request: Request<proto::v1::TopLimitedRequest>,
    ) -> Result<Response<proto::v1::TopLimitedResponse>, Status> {
        let r = request.get_ref();
        let pick = |n: u32, default: usize| {
            if n == 0 {
                default
            } else {
                (n as usize).min(100)
            }
        };
        let tenants = self.top.top(pick(r.tenants, 10), pick(r.keys, 5));
        Ok(Response::new(proto::v1::TopLimitedResponse {
            window: Some(duration(self.top.window().as_micros() as Micros)),
            tenants: tenants
                .into_iter()
                .map(|t| proto::v1::LimitedTenant {
                    tenant: t.tenant,
                    rejections: t.rejections,
                    error: t.error,
                    keys: t
                        .keys
                        .into_iter()
                        .map(|k| proto::v1::LimitedKey {
                            key: k.name,
                            rejections: k.count,
                            error: k.error,
                        })
                        .collect(),
                })
                .collect(),
        }))
    }
}

impl RateLimiterService {
    async fn decide_one(
        &self,
        req: &ShouldAllowRequest,
        metadata: &tonic::metadata::MetadataMap,
    ) -> Result<ShouldAllowResponse, Status> {
        let item = Item {
            key: &req.key,
            cost: req.cost,
            tenant: &req.tenant,
            resource: &req.resource,
        };
        let span = traces::decision_span("ShouldAllow", metadata, item.tenant, item.cost.max(1));
        match self
            .limiter
            .decide(item, req.dry_run)
            .instrument(span.clone())
            .await
        {
            Ok(decision) => {
                let outcome = self.record(&item, &decision);
                span.record(
                    "rule",
                    decision.rule.as_ref().map_or("", |r| r.name.as_str()),
                );
                span.record("outcome", outcome.label());
                Ok(to_response(&decision))
            }
            Err(err) => {
                metrics::decision(API, Outcome::Error, "", item.cost.max(1));
                span.record("outcome", Outcome::Error.label());
                Err(status::from_decide_error(err))
            }
        }
    }
}

#[tonic::async_trait]
impl RateLimiter for RateLimiterService {
    type ShouldAllowStreamStream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<proto::v1::StreamDecision, Status>> + Send>,
    >;

    async fn should_allow_stream(
        &self,
        request: Request<tonic::Streaming<ShouldAllowRequest>>,
    ) -> Result<Response<Self::ShouldAllowStreamStream>, Status> {
        let metadata = request.metadata().clone();
        let mut inbound = request.into_inner();
        let service = Self {
            limiter: self.limiter.clone(),
            top: self.top.clone(),
            stop: None,
        };
        let mut stop = self.stop.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        tokio::spawn(async move {
            let stopping = async {
                match stop.as_mut() {
                    Some(stop) => {
                        let _ = stop.wait_for(|s| *s).await;
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::pin!(stopping);
            // One at a time, in order: each answer is sent before the next
            // message is read. At shutdown the stream ends between messages.
            loop {
                let next = tokio::select! {
                    _ = &mut stopping => return,
                    next = inbound.message() => next,
                };
                let message = match next {
                    Ok(Some(message)) => message,
                    Ok(None) => return,
                    Err(status) => {
                        let _ = tx.send(Err(status)).await;
                        return;
                    }
                };
                let answer = match service.decide_one(&message, &metadata).await {
                    Ok(decision) => proto::v1::StreamDecision {
                        decision: Some(decision),
                        error_code: 0,
                        error_message: String::new(),
                    },
                    Err(status) => proto::v1::StreamDecision {
                        decision: None,
                        error_code: status.code() as u32,
                        error_message: status.message().to_owned(),
                    },
                };
                if tx.send(Ok(answer)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn should_allow(
        &self,
        request: Request<ShouldAllowRequest>,
    ) -> Result<Response<ShouldAllowResponse>, Status> {
        self.decide_one(request.get_ref(), request.metadata())
            .await
            .map(Response::new)
    }

    async fn should_allow_batch(
        &self,
        request: Request<ShouldAllowBatchRequest>,
    ) -> Result<Response<ShouldAllowBatchResponse>, Status> {
        let req = request.get_ref();
        let items: Vec<Item<'_>> = req
            .items
            .iter()
            .map(|i| Item {
                key: &i.key,
                cost: i.cost,
                tenant: &i.tenant,
                resource: &i.resource,
            })
            .collect();
        let tenant = items.first().map_or("", |i| i.tenant);
        let span = traces::decision_span(
            "ShouldAllowBatch",
            request.metadata(),
            tenant,
            items.len() as u64,
        );
        match self
            .limiter
            .decide_batch(&items, req.dry_run)
            .instrument(span.clone())
            .await
        {
            Ok(batch) => {
                span.record(
                    "outcome",
                    if batch.allowed { "allowed" } else { "rejected" },
                );
                self.record_batch(&items, &batch.items);
                Ok(Response::new(ShouldAllowBatchResponse {
                    allowed: batch.allowed,
                    results: batch.items.iter().map(to_response).collect(),
                    retry_after: Some(duration(batch.retry_after)),
                }))
            }
            Err(err) => {
                metrics::decision(API, Outcome::Error, "", items.len() as u64);
                Err(status::from_decide_error(err))
            }
        }
    }
}

fn degraded(decision: &Decision) -> proto::v1::Degraded {
    use proto::v1::Degraded;
    match decision.degraded {
        None => Degraded::None,
        Some(OnStoreUnavailable::Allow) => Degraded::FailedOpen,
        Some(OnStoreUnavailable::Deny) => Degraded::FailedClosed,
        Some(OnStoreUnavailable::Local) => Degraded::Local,
    }
}

/// Builds the response, including the HTTP header values.
pub fn to_response(decision: &Decision) -> ShouldAllowResponse {
    let Some(rule) = &decision.rule else {
        // No rule applied: unlimited, so there is no budget to report.
        return ShouldAllowResponse {
            allowed: decision.allowed,
            retry_after: Some(duration(0)),
            reset_after: Some(duration(0)),
            ..Default::default()
        };
    };
    ShouldAllowResponse {
        allowed: decision.allowed,
        remaining: decision.remaining,
        retry_after: Some(duration(decision.retry_after)),
        reset_after: Some(duration(decision.reset_after)),
        limit: rule.limit.burst(),
        limit_name: rule.name.clone(),
        shadow: decision.shadow,
        headers: headers(decision, rule.limit.burst()),
        rate: rule.rate_text.clone(),
        degraded: degraded(decision) as i32,
    }
}

/// `RateLimit-*` and `Retry-After` values. Seconds round up, so a caller
/// that waits what the header says is never early.
pub fn headers(decision: &Decision, limit: u64) -> HashMap<String, String> {
    let number = |n: u64| itoa::Buffer::new().format(n).to_owned();
    let mut headers = HashMap::with_capacity(4);
    headers.insert("RateLimit-Limit".to_owned(), number(limit));
    headers.insert("RateLimit-Remaining".to_owned(), number(decision.remaining));
    headers.insert(
        "RateLimit-Reset".to_owned(),
        number(whole_seconds(decision.reset_after)),
    );
    if !decision.allowed {
        headers.insert(
            "Retry-After".to_owned(),
            number(whole_seconds(decision.retry_after)),
        );
    }
    headers
}

fn whole_seconds(us: Micros) -> u64 {
    us.div_ceil(1_000_000)
}

/// Microseconds as a protobuf Duration.
pub fn duration(us: Micros) -> prost_types::Duration {
    prost_types::Duration {
        seconds: (us / 1_000_000) as i64,
        nanos: ((us % 1_000_000) * 1_000) as i32,
    }
}
