//! Envoy's rate limit service API from the client side: building requests
//! and reading answers, shared by the Envoy API tests.

use std::path::Path;

use tollgate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use tollgate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use tollgate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tollgate::proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tonic::transport::Channel;

use super::TestServer;

/// A temporary configuration directory holding `edge.yaml`.
pub fn config_dir(text: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("edge.yaml"), text).unwrap();
    dir
}

/// A server loading the Envoy configuration in `dir`.
pub async fn start(dir: &Path, shadow: bool) -> TestServer {
    let dir = dir.to_owned();
    TestServer::launch(None, move |c| {
        c.envoy_config = Some(dir);
        c.envoy_options.shadow_mode = shadow;
    })
    .await
}

/// A client that can send and receive messages of up to 4 MiB, so that
/// the server's own limits are what a test meets.
pub fn client(channel: Channel) -> RateLimitServiceClient<Channel> {
    RateLimitServiceClient::new(channel)
        .max_encoding_message_size(4 << 20)
        .max_decoding_message_size(4 << 20)
}

pub fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect(),
        limit: None,
        hits_addend: None,
        is_negative_hits: false,
    }
}

/// A descriptor carrying a limit override.
pub fn with_limit(
    entries: &[(&str, &str)],
    requests_per_unit: u32,
    unit: i32,
) -> RateLimitDescriptor {
    RateLimitDescriptor {
        limit: Some(RateLimitOverride {
            requests_per_unit,
            unit,
        }),
        ..descriptor(entries)
    }
}

pub fn request_in(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend: 0,
    }
}

pub async fn ask(
    client: &mut RateLimitServiceClient<Channel>,
    r: RateLimitRequest,
) -> RateLimitResponse {
    client.should_rate_limit(r).await.unwrap().into_inner()
}

/// Sends `r` and expects INVALID_ARGUMENT.
pub async fn refused(
    client: &mut RateLimitServiceClient<Channel>,
    r: RateLimitRequest,
) -> tonic::Status {
    let status = client.should_rate_limit(r).await.unwrap_err();
    assert_eq!(
        status.code(),
        tonic::Code::InvalidArgument,
        "{}",
        status.message()
    );
    status
}

pub fn header<'a>(r: &'a RateLimitResponse, name: &str) -> Option<&'a str> {
    r.response_headers_to_add
        .iter()
        .find(|h| h.key == name)
        .map(|h| h.value.as_str())
}

/// The value of one exactly named series in Prometheus text.
pub fn sample(metrics: &str, series: &str) -> Option<u64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}
