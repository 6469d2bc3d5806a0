//! The empty server `tollgate-bench run` compares Tollgate against
//! (`tollgate-bench empty-server`): Tollgate's own API and Envoy's, with
//! handlers that do nothing.
//!
//! With `--answer-after-us N` the single-decision handlers (`ShouldAllow`,
//! Envoy's `ShouldRateLimit`) still do nothing, but their answers wait for
//! a thread outside the runtime, as Tollgate's wait for Redis: the thread
//! sleeps N µs from the first waiting call and then answers every call
//! that waits by then, in one batch (as one coalesced script call answers
//! its decisions). Against the plain empty server this measures what the
//! gRPC stack alone costs more per call when answers are not ready at once,
//! whatever the store and its client.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};
use tokio::sync::oneshot;

use tollgate::proto::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use tollgate::proto::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use tollgate::proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tollgate::proto::v1::{ShouldAllowBatchRequest, ShouldAllowRequest, ShouldAllowResponse};

/// Answers released in batches by a thread of their own, `after` from the
/// first call of each batch.
pub struct Delay {
    waiting: Mutex<Vec<oneshot::Sender<()>>>,
    arrived: Condvar,
    after: Duration,
}

impl Delay {
    /// Starts the answering thread.
    pub fn start(after: Duration) -> Arc<Delay> {
        let delay = Arc::new(Delay {
            waiting: Mutex::new(Vec::new()),
            arrived: Condvar::new(),
            after,
        });
        let answering = delay.clone();
        std::thread::Builder::new()
            .name("delayed-answers".into())
            .spawn(move || answering.answer_forever())
            .expect("spawning the answering thread");
        delay
    }

    fn answer_forever(&self) {
        loop {
            {
                let mut waiting = self.waiting.lock();
                while waiting.is_empty() {
                    self.arrived.wait(&mut waiting);
                }
            }
            std::thread::sleep(self.after);
            let due = std::mem::take(&mut *self.waiting.lock());
            for answer in due {
                let _ = answer.send(());
            }
        }
    }

    /// Resolves when the thread answers this call.
    async fn wait(&self) {
        let (answer, answered) = oneshot::channel();
        {
            let mut waiting = self.waiting.lock();
            waiting.push(answer);
            if waiting.len() == 1 {
                self.arrived.notify_one();
            }
        }
        let _ = answered.await;
    }
}

/// Waits for `delay`'s thread, when there is one.
async fn maybe_wait(delay: &Option<Arc<Delay>>) {
    if let Some(delay) = delay {
        delay.wait().await;
    }
}

/// A `tollgate.v1.RateLimiter` whose handlers do nothing: the ceiling the
/// real service is compared against, served by the same tonic stack.
pub struct EmptyRateLimiter {
    delay: Option<Arc<Delay>>,
}

#[tonic::async_trait]
impl tollgate::proto::v1::rate_limiter_server::RateLimiter for EmptyRateLimiter {
    async fn should_allow(
        &self,
        _: tonic::Request<ShouldAllowRequest>,
    ) -> Result<tonic::Response<ShouldAllowResponse>, tonic::Status> {
        maybe_wait(&self.delay).await;
        Ok(tonic::Response::new(ShouldAllowResponse {
            allowed: true,
            ..Default::default()
        }))
    }

    type ShouldAllowStreamStream = std::pin::Pin<
        Box<
            dyn tokio_stream::Stream<
                    Item = Result<tollgate::proto::v1::StreamDecision, tonic::Status>,
                > + Send,
        >,
    >;

    async fn should_allow_stream(
        &self,
        request: tonic::Request<tonic::Streaming<ShouldAllowRequest>>,
    ) -> Result<tonic::Response<Self::ShouldAllowStreamStream>, tonic::Status> {
        use tokio_stream::StreamExt;
        let answers = request.into_inner().map(|m| {
            m.map(|_| tollgate::proto::v1::StreamDecision {
                decision: Some(ShouldAllowResponse {
                    allowed: true,
                    ..Default::default()
                }),
                error_code: 0,
                error_message: String::new(),
            })
        });
        Ok(tonic::Response::new(Box::pin(answers)))
    }

    async fn should_allow_batch(
        &self,
        request: tonic::Request<ShouldAllowBatchRequest>,
    ) -> Result<tonic::Response<tollgate::proto::v1::ShouldAllowBatchResponse>, tonic::Status> {
        let n = request.get_ref().items.len();
        Ok(tonic::Response::new(
            tollgate::proto::v1::ShouldAllowBatchResponse {
                allowed: true,
                results: vec![
                    ShouldAllowResponse {
                        allowed: true,
                        ..Default::default()
                    };
                    n
                ],
                retry_after: None,
            },
        ))
    }

    async fn reserve(
        &self,
        _: tonic::Request<tollgate::proto::v1::ReserveRequest>,
    ) -> Result<tonic::Response<tollgate::proto::v1::ReserveResponse>, tonic::Status> {
        Ok(tonic::Response::new(tollgate::proto::v1::ReserveResponse {
            decision: Some(ShouldAllowResponse {
                allowed: true,
                ..Default::default()
            }),
            ..Default::default()
        }))
    }

    async fn settle(
        &self,
        _: tonic::Request<tollgate::proto::v1::SettleRequest>,
    ) -> Result<tonic::Response<tollgate::proto::v1::SettleResponse>, tonic::Status> {
        Ok(tonic::Response::new(Default::default()))
    }

    async fn charge(
        &self,
        _: tonic::Request<tollgate::proto::v1::ChargeRequest>,
    ) -> Result<tonic::Response<tollgate::proto::v1::ChargeResponse>, tonic::Status> {
        Ok(tonic::Response::new(Default::default()))
    }

    async fn acquire(
        &self,
        _: tonic::Request<tollgate::proto::v1::AcquireRequest>,
    ) -> Result<tonic::Response<tollgate::proto::v1::AcquireResponse>, tonic::Status> {
        Ok(tonic::Response::new(tollgate::proto::v1::AcquireResponse {
            granted: true,
            ..Default::default()
        }))
    }

    async fn release(
        &self,
        _: tonic::Request<tollgate::proto::v1::ReleaseRequest>,
    ) -> Result<tonic::Response<tollgate::proto::v1::ReleaseResponse>, tonic::Status> {
        Ok(tonic::Response::new(Default::default()))
    }

    async fn renew(
        &self,
        _: tonic::Request<tollgate::proto::v1::RenewRequest>,
    ) -> Result<tonic::Response<tollgate::proto::v1::RenewResponse>, tonic::Status> {
        Ok(tonic::Response::new(Default::default()))
    }

    type HoldStream = std::pin::Pin<
        Box<
            dyn tokio_stream::Stream<
                    Item = Result<tollgate::proto::v1::HoldResponse, tonic::Status>,
                > + Send,
        >,
    >;

    async fn hold(
        &self,
        _: tonic::Request<tonic::Streaming<tollgate::proto::v1::AcquireRequest>>,
    ) -> Result<tonic::Response<Self::HoldStream>, tonic::Status> {
        Err(tonic::Status::unimplemented(
            "the empty server holds no leases",
        ))
    }

    async fn get_usage(
        &self,
        _: tonic::Request<tollgate::proto::v1::GetUsageRequest>,
    ) -> Result<tonic::Response<tollgate::proto::v1::GetUsageResponse>, tonic::Status> {
        // No rules, so no quota applies.
        Ok(tonic::Response::new(Default::default()))
    }

    async fn list_usage(
        &self,
        _: tonic::Request<tollgate::proto::v1::ListUsageRequest>,
    ) -> Result<tonic::Response<tollgate::proto::v1::ListUsageResponse>, tonic::Status> {
        // No quotas, so no periods were recorded.
        Ok(tonic::Response::new(Default::default()))
    }
}

/// Envoy's `RateLimitService` whose handler does nothing: every descriptor
/// OK, so `run --api envoy` has the same ceiling to compare against.
pub struct EmptyEnvoy {
    delay: Option<Arc<Delay>>,
}

#[tonic::async_trait]
impl RateLimitService for EmptyEnvoy {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        let n = request.get_ref().descriptors.len();
        maybe_wait(&self.delay).await;
        Ok(tonic::Response::new(RateLimitResponse {
            overall_code: Code::Ok as i32,
            statuses: vec![
                DescriptorStatus {
                    code: Code::Ok as i32,
                    ..Default::default()
                };
                n
            ],
            ..Default::default()
        }))
    }
}

/// Serves [`EmptyRateLimiter`] and [`EmptyEnvoy`] on `listener` until the process ends: the
/// same accept path and socket options as `tollgate serve`, and none of its
/// layers (limits, timeout, metrics), whose cost counts against Tollgate.
/// With `answer_after`, single decisions are answered through a [`Delay`].
pub async fn serve_empty(
    listener: tokio::net::TcpListener,
    answer_after: Option<Duration>,
) -> Result<(), tonic::transport::Error> {
    let delay = answer_after.map(Delay::start);
    tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .add_service(tollgate::api::native::RateLimiterServer::new(
            EmptyRateLimiter {
                delay: delay.clone(),
            },
        ))
        .add_service(RateLimitServiceServer::new(EmptyEnvoy { delay }))
        .serve_with_incoming(tollgate::server::accepted(listener))
        .await
}
