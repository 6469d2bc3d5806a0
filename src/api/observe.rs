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
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Observed<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let method = method_label(request.uri().path());
        let started = Instant::now();
        Observed {
            inner: self.inner.call(request),
            method,
            started,
        }
    }
}

pin_project_lite::pin_project! {
    /// The future of [`Observe`]: the inner call's, timed from when it was
    /// made until it is ready.
    pub struct Observed<F> {
        #[pin]
        inner: F,
        method: &'static str,
        started: Instant,
    }
}

impl<F: Future> Future for Observed<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let output = std::task::ready!(this.inner.poll(cx));
        metrics::grpc_request(this.method, this.started.elapsed());
        Poll::Ready(output)
    }
}

/// The bounded `method` label of a gRPC path: each method the gRPC port
/// serves has its own (anything else is `other`). Matched whole, as one
/// `match`: this runs for every request.
pub fn method_label(path: &str) -> &'static str {
    match path {
        "/tollgate.v1.RateLimiter/ShouldAllow" => "ShouldAllow",
        "/tollgate.v1.RateLimiter/ShouldAllowBatch" => "ShouldAllowBatch",
        "/tollgate.v1.RateLimiter/ShouldAllowStream" => "ShouldAllowStream",
        "/tollgate.v1.RateLimiter/Reserve" => "Reserve",
        "/tollgate.v1.RateLimiter/Settle" => "Settle",
        "/tollgate.v1.RateLimiter/Charge" => "Charge",
        "/tollgate.v1.RateLimiter/Acquire" => "Acquire",
        "/tollgate.v1.RateLimiter/Release" => "Release",
        "/tollgate.v1.RateLimiter/Renew" => "Renew",
        "/tollgate.v1.RateLimiter/Hold" => "Hold",
        "/tollgate.v1.RateLimiter/GetUsage" => "GetUsage",
        "/tollgate.v1.RateLimiter/ListUsage" => "ListUsage",
        "/tollgate.v1.Admin/TopLimited" => "TopLimited",
        "/tollgate.v1.Admin/LimitsStatus" => "LimitsStatus",
        "/tollgate.v1.Admin/Explain" => "Explain",
        "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit" => "ShouldRateLimit",
        "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas" => {
            "StreamRateLimitQuotas"
        }
        "/grpc.health.v1.Health/Check" => "HealthCheck",
        "/grpc.health.v1.Health/Watch" => "HealthWatch",
        p if p.starts_with("/grpc.reflection.") => "Reflection",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    /// Every method of every service the descriptors hold has a label of
    /// its own: a method added to a proto without one fails here.
    #[test]
    fn every_served_method_has_its_own_label() {
        let set =
            prost_types::FileDescriptorSet::decode(crate::proto::FILE_DESCRIPTOR_SET).unwrap();
        let mut seen = 0;
        for file in &set.file {
            for service in &file.service {
                let full = format!("{}.{}", file.package(), service.name());
                for method in &service.method {
                    let path = format!("/{full}/{}", method.name());
                    assert_eq!(method_label(&path), method.name(), "{path}");
                    seen += 1;
                }
            }
        }
        assert!(seen >= 13, "{seen} methods in the descriptors");
        assert_eq!(method_label("/tollgate.v1.RateLimiter/Nope"), "other");
        assert_eq!(method_label("/x.Y/ShouldAllow"), "other");
        assert_eq!(method_label("garbage"), "other");
    }
}
