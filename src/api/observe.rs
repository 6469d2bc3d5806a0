//! A tower layer on the gRPC server that records each request's latency by
//! method, `tollgate_grpc_request_duration_seconds{method}`. Method labels
//! come from a fixed list, so an unknown path cannot create new series.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::time::Instant;
use tower::{Layer, Service};

use crate::telemetry::metrics;

/// The layer.
#[derive(Debug, Clone, Copy, Default)]
pub struct ObserveLayer;

impl<S> Layer<S> for ObserveLayer {
    type Service = Observe<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Observe { inner }
    }
}

/// The service the layer wraps around the server.
#[derive(Debug, Clone)]
pub struct Observe<S> {
    inner: S,
}

impl<S, B> Service<http::Request<B>> for Observe<S>
where
    S: Service<http::Request<B>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let method = method_label(request.uri().path());
        let started = Instant::now();
        let response = self.inner.call(request);
        Box::pin(async move {
            let result = response.await;
            metrics::grpc_request(method, started.elapsed());
            result
        })
    }
}

/// The bounded `method` label of a gRPC path.
pub fn method_label(path: &str) -> &'static str {
    match path {
        "/tollgate.v1.RateLimiter/ShouldAllow" => "ShouldAllow",
        "/tollgate.v1.RateLimiter/ShouldAllowBatch" => "ShouldAllowBatch",
        "/tollgate.v1.Admin/TopLimited" => "TopLimited",
        "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit" => "ShouldRateLimit",
        "/grpc.health.v1.Health/Check" => "HealthCheck",
        "/grpc.health.v1.Health/Watch" => "HealthWatch",
        p if p.starts_with("/grpc.reflection.") => "Reflection",
        _ => "other",
    }
}
