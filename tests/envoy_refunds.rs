//! Refunds through Envoy's rate limit service API: descriptors with
//! `is_negative_hits` give tokens back, only to rules that take refunds,
//! never more than a bucket holds; a stream-done call that refunds an
//! estimate and charges the actual usage applies the difference, as a
//! settle does. (`tests/envoy_llm.rs` runs the same through a real Envoy.)

use crate::common;

use common::envoy::{ask, descriptor, refused, request_in, sample};
use tollgate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use tollgate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use tollgate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tonic::transport::Channel;

const EDGE: &str = "
domain: edge
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 1, algorithm: token_bucket, burst: 100, debt: 50, refunds: true}
  - key: ip
    rate_limit: {unit: minute, requests_per_unit: 10, algorithm: token_bucket}
";

/// Every rule of this domain takes refunds: its window, of tokens charged
/// at a time the refund gives.
const LLM: &str = "
domain: llm
refunds: true
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 1, algorithm: token_bucket, burst: 10}
  - key: route
    rate_limit: {unit: minute, requests_per_unit: 10}
";

fn spend(entries: &[(&str, &str)], hits: u64) -> RateLimitDescriptor {
    RateLimitDescriptor {
        hits_addend: Some(hits),
        ..descriptor(entries)
    }
}

fn refund(entries: &[(&str, &str)], hits: u64) -> RateLimitDescriptor {
    RateLimitDescriptor {
        is_negative_hits: true,
        ..spend(entries, hits)
    }
}

/// A charge after the fact (the stream-done rate limit's marker entry).
fn charge(entries: &[(&str, &str)], hits: u64) -> RateLimitDescriptor {
    let mut all = entries.to_vec();
    all.push(("tollgate.charge", "usage"));
    spend(&all, hits)
}

/// Sends the descriptors to `domain`; answers each one's remaining.
async fn remaining(
    client: &mut RateLimitServiceClient<Channel>,
    domain: &str,
    descriptors: Vec<RateLimitDescriptor>,
) -> (Code, Vec<u32>) {
    let r = ask(client, request_in(domain, descriptors)).await;
    let left = r.statuses.iter().map(|s| s.limit_remaining).collect();
    (r.overall_code(), left)
}

/// What carol's bucket holds, asked without spending (`hits_addend` 0).
async fn carol(client: &mut RateLimitServiceClient<Channel>) -> u32 {
    remaining(client, "edge", vec![spend(&[("user", "carol")], 0)])
        .await
        .1[0]
}

#[tokio::test]
async fn refunds_follow_the_settle_rules_and_only_where_enabled() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("edge.yaml"), EDGE).unwrap();
    std::fs::write(dir.path().join("llm.yaml"), LLM).unwrap();
    let server = common::envoy::start(dir.path(), false).await;
    let mut client = RateLimitServiceClient::new(server.channel().await);
    let user = [("user", "carol")];

    // Given back at once, never above the burst.
    let spent = remaining(&mut client, "edge", vec![spend(&user, 80)]).await;
    assert_eq!(spent, (Code::Ok, vec![20]));
    let given = remaining(&mut client, "edge", vec![refund(&user, 50)]).await;
    assert_eq!(given, (Code::Ok, vec![70]));
    let given = remaining(&mut client, "edge", vec![refund(&user, 100)]).await;
    assert_eq!(given, (Code::Ok, vec![100]), "capped at the burst");

    // More than the bucket ever holds (burst 100 + debt 50), and a rule
    // that takes no refunds: refused, counted, nothing applied.
    for hits in [151, u64::MAX] {
        let status = refused(&mut client, request_in("edge", vec![refund(&user, hits)])).await;
        assert_eq!(
            status.message(),
            format!(
                "descriptors[0] gives back {hits} hits (is_negative_hits), more than rule \
                 edge.user ever holds (150: its burst plus its debt)"
            )
        );
    }
    assert_eq!(
        remaining(&mut client, "edge", vec![spend(&[("ip", "a")], 4)]).await,
        (Code::Ok, vec![6])
    );
    let status = refused(
        &mut client,
        request_in("edge", vec![spend(&user, 1), refund(&[("ip", "a")], 4)]),
    )
    .await;
    assert_eq!(
        status.message(),
        "descriptors[1] gives back 4 hits (is_negative_hits), but rule edge.ip takes no \
         refunds; set refunds: true on it, or in its domain, to allow them"
    );
    assert_eq!(
        carol(&mut client).await,
        100,
        "nothing of a refused request applied"
    );
    let ip = remaining(&mut client, "edge", vec![spend(&[("ip", "a")], 0)]).await;
    assert_eq!(ip, (Code::Ok, vec![6]));

    // Stream done: the estimate given back and the actual usage charged
    // in one call apply the difference. Actual below the estimate: 90
    // reserved, 30 used, 60 back.
    assert_eq!(
        remaining(&mut client, "edge", vec![spend(&user, 90)]).await,
        (Code::Ok, vec![10])
    );
    let settled = remaining(
        &mut client,
        "edge",
        vec![charge(&user, 30), refund(&user, 90)],
    )
    .await;
    assert_eq!(settled, (Code::Ok, vec![70, 70]));
    // Actual above the estimate: 60 reserved, 130 used, 70 more charged,
    // into debt down to the floor of -50 (10 forgiven).
    assert_eq!(
        remaining(&mut client, "edge", vec![spend(&user, 60)]).await,
        (Code::Ok, vec![10])
    );
    let settled = remaining(
        &mut client,
        "edge",
        vec![refund(&user, 60), charge(&user, 130)],
    )
    .await;
    assert_eq!(settled, (Code::Ok, vec![0, 0]));
    // In debt: refused until refunds (or the refill) pay it off.
    let asked = remaining(&mut client, "edge", vec![spend(&user, 1)]).await;
    assert_eq!(asked.0, Code::OverLimit);
    assert_eq!(
        remaining(&mut client, "edge", vec![refund(&user, 20)]).await,
        (Code::Ok, vec![0]),
        "a debt of 50 less 20"
    );
    assert_eq!(
        remaining(&mut client, "edge", vec![refund(&user, 40)]).await,
        (Code::Ok, vec![10])
    );
    // A refund that matches no rule gives back nothing, and is no error.
    let unmatched = remaining(&mut client, "edge", vec![refund(&[("nobody", "x")], 5)]).await;
    assert_eq!(unmatched.0, Code::Ok);

    // A domain's default: its token bucket takes refunds, its window not.
    let llm = [("user", "dan")];
    assert_eq!(
        remaining(&mut client, "llm", vec![spend(&llm, 8)]).await,
        (Code::Ok, vec![2])
    );
    assert_eq!(
        remaining(&mut client, "llm", vec![refund(&llm, 5)]).await,
        (Code::Ok, vec![7])
    );
    // A window: given back only while the window that counted the tokens
    // counts. The test clock stands 20 s into a minute (1 700 000 000 s).
    let route = [("route", "/chat")];
    let at = |entries: &[(&'static str, &'static str)], since: &'static str| {
        let mut all = entries.to_vec();
        all.push(("tollgate.since", since));
        all
    };
    assert_eq!(
        remaining(&mut client, "llm", vec![spend(&route, 4)]).await,
        (Code::Ok, vec![6])
    );
    let status = refused(&mut client, request_in("llm", vec![refund(&route, 3)])).await;
    assert_eq!(
        status.message(),
        "descriptors[0] gives back 3 hits (is_negative_hits) to rule llm.route, a \
         fixed_window, without the entry tollgate.since: give the time its tokens were charged \
         (Unix seconds), so that they come back only while the window that counted them still \
         counts"
    );
    let this_minute = refund(&at(&route, "1700000000.25"), 3);
    assert_eq!(
        remaining(&mut client, "llm", vec![this_minute]).await,
        (Code::Ok, vec![9])
    );
    let last_minute = refund(&at(&route, "1699999979"), 1);
    assert_eq!(
        remaining(&mut client, "llm", vec![last_minute]).await,
        (Code::Ok, vec![9]),
        "tokens of a window that no longer counts are not given back"
    );
    for (since, message) in [
        (
            "soon",
            "descriptors[0]: tollgate.since is \"soon\"; give the time the refunded tokens were \
             charged in Unix seconds, with at most 6 decimals (1733212345 or 1733212345.25)",
        ),
        (
            "1700000000.1234567",
            "descriptors[0]: tollgate.since is \"1700000000.1234567\"; give the time the refunded \
             tokens were charged in Unix seconds, with at most 6 decimals (1733212345 or \
             1733212345.25)",
        ),
    ] {
        let status = refused(
            &mut client,
            request_in("llm", vec![refund(&at(&route, since), 1)]),
        )
        .await;
        assert_eq!(status.message(), message);
    }
    let status = refused(
        &mut client,
        request_in(
            "llm",
            vec![
                refund(&at(&route, "1700000000"), 1),
                refund(&at(&llm, "1699999000"), 1),
            ],
        ),
    )
    .await;
    assert!(
        status.message().starts_with(
            "the refunds of one request give tollgate.since 1700000000 and 1699999000"
        ),
        "{}",
        status.message()
    );

    let (_, metrics) = server.http_get("/metrics").await.unwrap();
    let count = |series: &str| sample(&metrics, series).unwrap_or(0);
    assert_eq!(
        count("tollgate_refunds_refused_total{api=\"envoy\",reason=\"over_capacity\"}"),
        2
    );
    assert_eq!(
        count("tollgate_refunds_refused_total{api=\"envoy\",reason=\"not_enabled\"}"),
        1
    );
    assert_eq!(
        count("tollgate_refunds_refused_total{api=\"envoy\",reason=\"no_since\"}"),
        1
    );
    assert_eq!(
        count("tollgate_refunded_tokens_total{api=\"envoy\"}"),
        50 + 100 + 60 + 20 + 40 + 5 + 3 + 1,
        "tokens refunds gave back, as asked (none where no rule matched)"
    );
    assert_eq!(
        count("tollgate_charged_tokens_total{api=\"envoy\",phase=\"charge\"}"),
        70
    );
    assert_eq!(count("tollgate_forgiven_tokens_total{api=\"envoy\"}"), 10);
    server.stop().await;
}
