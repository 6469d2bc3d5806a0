//! The metrics of what a hostile Envoy caller sends: request values never
//! become label values, and refusals count as errors with no tokens. One
//! test in its own binary, so no other test's decisions share its counters.

mod common;

use std::path::Path;

use common::TestServer;
use tollgate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use tollgate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use tollgate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use tollgate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tollgate::proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tonic::transport::Channel;

const CONFIG: &str = "
domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: banned
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: closed
    rate_limit: {unit: hour, requests_per_unit: 0, name: closed-for-now}
";

async fn start(dir: &Path) -> TestServer {
    let dir = dir.to_owned();
    TestServer::launch(None, move |c| c.envoy_config = Some(dir)).await
}

fn config_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("edge.yaml"), CONFIG).unwrap();
    dir
}

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
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
    }
}

fn with_limit(entries: &[(&str, &str)], requests_per_unit: u32, unit: i32) -> RateLimitDescriptor {
    RateLimitDescriptor {
        limit: Some(RateLimitOverride {
            requests_per_unit,
            unit,
        }),
        ..descriptor(entries)
    }
}

fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend: 0,
    }
}

async fn ask(
    client: &mut RateLimitServiceClient<Channel>,
    r: RateLimitRequest,
) -> RateLimitResponse {
    client.should_rate_limit(r).await.unwrap().into_inner()
}

async fn refused(
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

fn client_for(channel: Channel) -> RateLimitServiceClient<Channel> {
    RateLimitServiceClient::new(channel)
        .max_encoding_message_size(4 << 20)
        .max_decoding_message_size(4 << 20)
}

/// The value of one exactly named series.
fn sample(metrics: &str, series: &str) -> Option<u64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

#[tokio::test]
async fn overrides_never_create_series_and_refusals_count_as_errors() {
    let dir = config_dir();
    let server = start(dir.path()).await;
    let mut client = client_for(server.channel().await);
    let series = |metrics: &str| -> Vec<String> {
        metrics
            .lines()
            .filter(|l| l.starts_with("tollgate_decisions_total{api=\"envoy\""))
            .map(|l| l.rsplit_once(' ').unwrap().0.to_owned())
            .collect()
    };
    ask(
        &mut client,
        request("edge", vec![with_limit(&[("user", "first")], 5, 2)]),
    )
    .await;
    let (_, before) = server.http_get("/metrics").await.unwrap();
    // 20 000 distinct values, in 20 requests of 1000 descriptors.
    for round in 0..20 {
        let descriptors = (0..1000)
            .map(|i| with_limit(&[("user", &format!("u{round}-{i}"))], 5, 2))
            .collect();
        let r = ask(&mut client, request("edge", descriptors)).await;
        assert_eq!(r.overall_code(), Code::Ok);
    }
    let (_, after) = server.http_get("/metrics").await.unwrap();
    let overrides = |m: &str| {
        series(m)
            .into_iter()
            .filter(|s| s.contains("rule=\"override\""))
            .collect::<Vec<_>>()
    };
    assert_eq!(overrides(&before), overrides(&after));
    assert_eq!(
        sample(
            &after,
            r#"tollgate_decisions_total{api="envoy",outcome="allowed",rule="override"}"#
        ),
        Some(20_001)
    );
    for s in series(&after) {
        assert!(!s.contains("user_u"), "a request value became a label: {s}");
    }

    // Refusals count once per descriptor, with no tokens (a hostile sum
    // must not wrap the counter).
    let big = "v".repeat(1_000);
    refused(
        &mut client,
        request("edge", vec![descriptor(&[("remote_address", &big)])]),
    )
    .await;
    let mut huge = descriptor(&[("remote_address", "h")]);
    huge.hits_addend = Some(u64::MAX);
    refused(
        &mut client,
        request("edge", vec![huge.clone(), huge, descriptor(&[("k", &big)])]),
    )
    .await;
    let (_, metrics) = server.http_get("/metrics").await.unwrap();
    assert_eq!(
        sample(
            &metrics,
            r#"tollgate_decisions_total{api="envoy",outcome="error",rule=""}"#
        ),
        Some(4)
    );
    assert_eq!(
        sample(
            &metrics,
            r#"tollgate_decision_tokens_total{api="envoy",outcome="error",rule=""}"#
        ),
        Some(0)
    );
    server.stop().await;
}
