//! The empty server `tollgate bench` compares Tollgate against
//! (`tollgate bench-empty-server`).

use crate::proto::v1::{ShouldAllowBatchRequest, ShouldAllowRequest, ShouldAllowResponse};

/// A `tollgate.v1.RateLimiter` whose handlers do nothing: the ceiling the
/// real service is compared against, served by the same tonic stack.
pub struct EmptyRateLimiter;

#[tonic::async_trait]
impl crate::proto::v1::rate_limiter_server::RateLimiter for EmptyRateLimiter {
    async fn should_allow(
        &self,
        _: tonic::Request<ShouldAllowRequest>,
    ) -> Result<tonic::Response<ShouldAllowResponse>, tonic::Status> {
        Ok(tonic::Response::new(ShouldAllowResponse {
            allowed: true,
            ..Default::default()
        }))
    }

    type ShouldAllowStreamStream = std::pin::Pin<
        Box<
            dyn tokio_stream::Stream<Item = Result<crate::proto::v1::StreamDecision, tonic::Status>>
                + Send,
        >,
    >;

    async fn should_allow_stream(
        &self,
        request: tonic::Request<tonic::Streaming<ShouldAllowRequest>>,
    ) -> Result<tonic::Response<Self::ShouldAllowStreamStream>, tonic::Status> {
        use tokio_stream::StreamExt;
        let answers = request.into_inner().map(|m| {
            m.map(|_| crate::proto::v1::StreamDecision {
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
    ) -> Result<tonic::Response<crate::proto::v1::ShouldAllowBatchResponse>, tonic::Status> {
        let n = request.get_ref().items.len();
        Ok(tonic::Response::new(
            crate::proto::v1::ShouldAllowBatchResponse {
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
}

/// Serves [`EmptyRateLimiter`] on `listener` until the process ends: the
/// same accept path and socket options as `tollgate serve`, and none of its
/// layers (limits, timeout, metrics), whose cost counts against Tollgate.
pub async fn serve_empty(listener: tokio::net::TcpListener) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .add_service(crate::api::native::RateLimiterServer::new(EmptyRateLimiter))
        .serve_with_incoming(crate::server::accepted(listener))
        .await
}
