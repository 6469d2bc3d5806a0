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

/// Every method the gRPC port serves, by service: the `method` label's
/// values (anything else is `other`).
const METHODS: &[(&str, &[&str])] = &[
    (
        "tollgate.v1.RateLimiter",
        &[
            "ShouldAllow",
            "ShouldAllowBatch",
            "ShouldAllowStream",
            "Reserve",
            "Settle",
            "Charge",
            "Acquire",
            "Release",
            "Renew",
            "Hold",
            "GetUsage",
            "ListUsage",
        ],
    ),
    (
        "tollgate.v1.Admin",
        &["TopLimited", "LimitsStatus", "Explain"],
    ),
    (
        "envoy.service.ratelimit.v3.RateLimitService",
        &["ShouldRateLimit"],
    ),
    (
        "envoy.service.rate_limit_quota.v3.RateLimitQuotaService",
        &["StreamRateLimitQuotas"],
    ),
];

/// The bounded `method` label of a gRPC path.
pub fn method_label(path: &str) -> &'static str {
    match path {
        "/grpc.health.v1.Health/Check" => return "HealthCheck",
        "/grpc.health.v1.Health/Watch" => return "HealthWatch",
        p if p.starts_with("/grpc.reflection.") => return "Reflection",
        _ => {}
    }
    let Some((service, method)) = path.strip_prefix('/').and_then(|p| p.split_once('/')) else {
        return "other";
    };
    METHODS
        .iter()
        .filter(|(s, _)| *s == service)
        .flat_map(|(_, methods)| methods.iter())
        .find(|m| **m == method)
        .copied()
        .unwrap_or("other")
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
