//! What an on-call engineer sees: the most limited tenants (JSON, gRPC,
//! metric family, `tollgate top`) and the gRPC latency histogram.

use crate::common;

use common::process::{ServeProcess, stdout, tollgate};
use common::{TestServer, ask, req, row};
use tollgate::proto::v1::TopLimitedRequest;
use tollgate::proto::v1::admin_client::AdminClient;

async fn hammer(server: &TestServer) {
    let mut client = server.client().await;
    // Each tenant's keys have a burst of 2: everything past it is rejected.
    // storm asks 2 tokens at a time: its first request takes both, and its
    // rejections count requests (19), not tokens (38).
    for (tenant, key, n, cost) in [
        ("scraper", "bot-1", 40, 1),
        ("scraper", "bot-2", 12, 1),
        ("storm", "client-9", 20, 2),
        ("calm", "k", 2, 1),
    ] {
        for _ in 0..n {
            let mut r = req(tenant, key);
            r.cost = cost;
            ask(&mut client, r).await;
        }
    }
}

#[tokio::test]
async fn the_most_limited_tenants_everywhere() {
    let server = TestServer::with_rows(&[row("per-key", "", "", "key", 2, "1/hour")]).await;
    hammer(&server).await;

    let (_, body) = server
        .http_get("/v1/top-limited?tenants=5&keys=2")
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["window_seconds"], 60);
    let tenants = v["tenants"].as_array().unwrap();
    assert_eq!(tenants.len(), 2, "calm was never rejected: {body}");
    assert_eq!(
        (
            tenants[0]["tenant"].as_str(),
            tenants[0]["rejections"].as_u64()
        ),
        (Some("scraper"), Some(38 + 10))
    );
    assert_eq!(tenants[0]["keys"][0]["name"], "bot-1");
    assert_eq!(tenants[0]["keys"][0]["count"], 38);
    assert_eq!(
        (
            tenants[1]["tenant"].as_str(),
            tenants[1]["rejections"].as_u64()
        ),
        (Some("storm"), Some(19))
    );

    let mut admin = AdminClient::new(server.channel().await);
    let top = admin
        .top_limited(TopLimitedRequest {
            tenants: 1,
            keys: 1,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(top.tenants.len(), 1);
    assert_eq!(
        (top.tenants[0].tenant.as_str(), top.tenants[0].rejections),
        ("scraper", 48)
    );
    assert_eq!(top.tenants[0].keys[0].key, "bot-1");
    assert_eq!(top.window.unwrap().seconds, 60);

    let (_, metrics) = server.http_get("/metrics").await.unwrap();
    assert!(
        metrics.contains("tollgate_top_limited_rejections{tenant=\"scraper\",rank=\"1\"} 48\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("tollgate_top_limited_rejections{tenant=\"storm\",rank=\"2\"} 19\n"),
        "{metrics}"
    );
    assert!(!metrics.contains("tollgate_top_limited_rejections{tenant=\"calm\""));
    assert!(
        metrics.contains(
            "tollgate_grpc_request_duration_seconds_bucket{method=\"ShouldAllow\",le=\"0.001\"}"
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains("tollgate_grpc_request_duration_seconds_count{method=\"TopLimited\"}"),
        "{metrics}"
    );
    server.stop().await;
}

#[test]
fn tollgate_top_prints_a_table() {
    let dir = tempfile::tempdir().unwrap();
    let out = tollgate(
        dir.path(),
        &[
            "limits", "set", "--create", "--tenant", "scraper", "--burst", "1", "--rate", "1/hour",
        ],
    );
    assert!(out.status.success());
    let out = tollgate(
        dir.path(),
        &[
            "limits", "set", "--tenant", "llm", "--burst", "100", "--rate", "100/day", "--debt",
            "1000",
        ],
    );
    assert!(out.status.success());
    let server = ServeProcess::start(dir.path(), &[]);
    let url = format!("http://{}", server.grpc);
    let out = tollgate(
        dir.path(),
        &[
            "check", "--server", &url, "--tenant", "scraper", "--key", "bot", "--repeat", "4",
        ],
    );
    assert!(out.status.success());
    // Usage after the fact: 250 tokens on a bucket of 100.
    let out = tollgate(
        dir.path(),
        &[
            "charge", "--server", &url, "--tenant", "llm", "--key", "ada", "--cost", "250",
        ],
    );
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        stdout(&out).trim(),
        "CHARGED   remaining 0  debt 150  forgiven 0  rule llm-any-key"
    );
    let out = tollgate(
        dir.path(),
        &[
            "top",
            "--server",
            &url,
            "--count",
            "2",
            "--interval",
            "100ms",
        ],
    );
    assert!(out.status.success(), "{out:?}");
    let text = stdout(&out);
    let tables: Vec<&str> = text
        .split("Most limited tenants on")
        .filter(|t| !t.is_empty())
        .collect();
    assert_eq!(tables.len(), 2, "two refreshes: {text}");
    let lines: Vec<&str> = tables[1].lines().collect();
    assert!(
        lines[0].ends_with("(rejections over the last 60-120 s)"),
        "{text}"
    );
    assert_eq!(
        lines[1].split_whitespace().collect::<Vec<_>>(),
        ["RANK", "TENANT", "REJECTIONS", "TOP", "KEYS"]
    );
    assert_eq!(
        lines[2].split_whitespace().collect::<Vec<_>>(),
        ["1", "scraper", "3", "bot", "(3)"]
    );
    assert_eq!(lines[3], "Tenants in debt (usage charged after the work)");
    assert_eq!(
        lines[4].split_whitespace().collect::<Vec<_>>(),
        ["TENANT", "KEY", "DEBT", "SEEN"]
    );
    assert_eq!(
        lines[5].split_whitespace().take(3).collect::<Vec<_>>(),
        ["llm", "ada", "150"]
    );
}

/// The sketch keeps nothing a hostile caller sends in bulk: keys of 100 KB
/// are refused before they reach it, and a tenant limited under names of
/// the largest allowed size shows them at most 256 bytes long, so
/// `/v1/top-limited` stays small.
#[tokio::test]
async fn top_limited_stays_small_whatever_names_callers_send() {
    let server = TestServer::with_rows(&[row("tight", "", "", "key", 1, "1/hour")]).await;
    let mut client = server.client().await;
    let huge = "x".repeat(100_000);
    for _ in 0..20 {
        let refused = client.should_allow(req("t", &huge)).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    }
    // Tenants may be 128 bytes, keys 256.
    let (tenant, key) = ("y".repeat(128), "y".repeat(250));
    for i in 0..40 {
        ask(&mut client, req(&tenant, &format!("{key}{i:06}"))).await;
    }
    let (status, body) = server
        .http_get("/v1/top-limited?tenants=100&keys=100")
        .await
        .unwrap();
    assert_eq!(status, 200);
    assert!(
        !body.contains(&"x".repeat(257)),
        "a refused key reached the sketch"
    );
    assert!(!body.contains(&"y".repeat(257)));
    assert!(body.len() < 64 * 1024, "{} bytes", body.len());
    server.stop().await;
}

/// A tenant that stops being limited leaves the top-limited series once its
/// rejections are older than two windows (the sketch's memory), and the
/// series of a tenant limited since then take its place.
#[tokio::test]
async fn stale_top_limited_series_leave_metrics() {
    let server = TestServer::with_rows(&[row("per-key", "", "", "key", 2, "1/hour")]).await;
    hammer(&server).await;
    let series = |metrics: &str, tenant: &str| {
        metrics
            .lines()
            .filter(|l| {
                l.starts_with(&format!(
                    "tollgate_top_limited_rejections{{tenant=\"{tenant}\""
                ))
            })
            .count()
    };
    let (_, metrics) = server.http_get("/metrics").await.unwrap();
    assert_eq!(series(&metrics, "scraper"), 1, "{metrics}");
    assert_eq!(series(&metrics, "storm"), 1, "{metrics}");

    // One window later the old rejections are still within memory.
    server.clock.advance(std::time::Duration::from_secs(61));
    let (_, metrics) = server.http_get("/metrics").await.unwrap();
    assert_eq!(series(&metrics, "scraper"), 1, "{metrics}");

    // Two windows later they are gone; a tenant limited now shows instead.
    server.clock.advance(std::time::Duration::from_secs(61));
    let mut client = server.client().await;
    for _ in 0..5 {
        ask(&mut client, req("newcomer", "k")).await;
    }
    let (_, metrics) = server.http_get("/metrics").await.unwrap();
    assert_eq!(series(&metrics, "scraper"), 0, "{metrics}");
    assert_eq!(series(&metrics, "storm"), 0, "{metrics}");
    assert!(
        metrics.contains("tollgate_top_limited_rejections{tenant=\"newcomer\",rank=\"1\"} 3\n"),
        "{metrics}"
    );
    server.stop().await;
}
