//! envoyproxy/ratelimit's YAML, unchanged: `tests/fixtures/envoyproxy-ratelimit`
//! uses every documented feature of that format and none of Tollgate's own
//! keys, and each answer below is what that format's documentation says:
//! fixed windows aligned to the unit (a month is 30 days, a year 365), one
//! counter per value for value-less keys and (without `share_threshold`)
//! for wildcard values, the exact value before a value-less key, nested
//! descriptors walked entry by entry, `replaces` dropping the named rule,
//! `unlimited` and `shadow_mode` never answering OVER_LIMIT. The server's
//! clock stands at T0, so the time to each window's end is exact.

use crate::common;

use common::T0;
use common::envoy::{ask, client, descriptor, request_in, start};
use tollgate::proto::envoy::service::ratelimit::v3::RateLimitResponse;
use tollgate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use tollgate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tonic::transport::Channel;

const DIR: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/envoyproxy-ratelimit"
);

/// Seconds from T0 to the end of the window of `unit` seconds it falls in.
fn to_window_end(unit: u64) -> i64 {
    (unit - (T0 / 1_000_000) % unit) as i64
}

async fn send(
    c: &mut RateLimitServiceClient<Channel>,
    entries: &[&[(&str, &str)]],
) -> RateLimitResponse {
    let descriptors = entries.iter().map(|e| descriptor(e)).collect();
    ask(c, request_in("fixtures", descriptors)).await
}

/// Codes of `n` requests with one descriptor.
async fn codes(
    c: &mut RateLimitServiceClient<Channel>,
    entries: &[(&str, &str)],
    n: usize,
) -> Vec<Code> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(send(c, &[entries]).await.overall_code());
    }
    out
}

#[tokio::test]
async fn every_documented_feature_answers_as_envoyproxy_ratelimit_documents() {
    use Code::{Ok as OK, OverLimit as OVER};
    let server = start(std::path::Path::new(DIR), false).await;
    let mut c = client(server.channel().await);

    // Value-less key: 2 a second per value, each value its own counter.
    assert_eq!(
        codes(&mut c, &[("remote_address", "10.0.0.1")], 3).await,
        [OK, OK, OVER]
    );
    assert_eq!(
        codes(&mut c, &[("remote_address", "10.0.0.2")], 1).await,
        [OK]
    );
    let r = send(&mut c, &[&[("remote_address", "10.0.0.1")]]).await;
    let s = &r.statuses[0];
    assert_eq!(s.current_limit.as_ref().unwrap().requests_per_unit, 2);
    assert_eq!(
        s.duration_until_reset.as_ref().unwrap().seconds,
        to_window_end(1)
    );

    // Exact value, 3 a minute.
    assert_eq!(
        codes(&mut c, &[("plan", "free")], 4).await,
        [OK, OK, OK, OVER]
    );
    let s = send(&mut c, &[&[("plan", "free")]]).await.statuses[0].clone();
    assert_eq!(s.duration_until_reset.unwrap().seconds, to_window_end(60));
    // Another value of the same key has no rule.
    let r = send(&mut c, &[&[("plan", "pro")]]).await;
    assert_eq!(r.overall_code(), OK);
    assert!(r.statuses[0].current_limit.is_none());

    // `replaces`: beside user=vip, the exhausted free limit no longer applies.
    let r = send(&mut c, &[&[("plan", "free")], &[("user", "vip")]]).await;
    assert_eq!(r.overall_code(), OK, "{r:?}");
    assert_eq!(r.statuses[1].limit_remaining, 4);

    // Nested: 4 an hour per route under tenant=acme; the exact /export,
    // once a day, wins over the value-less route.
    let nested = [("tenant", "acme"), ("route", "/list")];
    assert_eq!(codes(&mut c, &nested, 5).await, [OK, OK, OK, OK, OVER]);
    let s = send(&mut c, &[&nested]).await.statuses[0].clone();
    assert_eq!(s.duration_until_reset.unwrap().seconds, to_window_end(3600));
    let export = [("tenant", "acme"), ("route", "/export")];
    assert_eq!(codes(&mut c, &export, 2).await, [OK, OVER]);
    let s = send(&mut c, &[&export]).await.statuses[0].clone();
    assert_eq!(s.current_limit.unwrap().requests_per_unit, 1);
    assert_eq!(
        s.duration_until_reset.unwrap().seconds,
        to_window_end(86_400)
    );
    // Another tenant has no route rule; the tenant entry alone has none.
    assert_eq!(
        codes(&mut c, &[("tenant", "other"), ("route", "/list")], 6).await,
        [OK; 6]
    );
    assert_eq!(codes(&mut c, &[("tenant", "acme")], 6).await, [OK; 6]);

    // Wildcard: 2 a month per matching value; other paths have no rule.
    assert_eq!(
        codes(&mut c, &[("path", "/api/users")], 3).await,
        [OK, OK, OVER]
    );
    assert_eq!(codes(&mut c, &[("path", "/api/orders")], 1).await, [OK]);
    assert_eq!(
        codes(&mut c, &[("path", "/web/home")], 3).await,
        [OK, OK, OK]
    );
    let s = send(&mut c, &[&[("path", "/api/users")]]).await.statuses[0].clone();
    assert_eq!(
        s.duration_until_reset.unwrap().seconds,
        to_window_end(30 * 86_400)
    );

    // Unlimited: never limited.
    assert_eq!(codes(&mut c, &[("internal", "batch")], 50).await, [OK; 50]);

    // Shadow mode: over its limit of 1 a year, still OK.
    assert_eq!(codes(&mut c, &[("beta", "x")], 3).await, [OK, OK, OK]);

    // detailed_metric changes metrics, not decisions: 1 a second.
    assert_eq!(codes(&mut c, &[("client", "c1")], 2).await, [OK, OVER]);

    // The year's window for the shadow rule.
    let s = send(&mut c, &[&[("beta", "y")]]).await.statuses[0].clone();
    assert_eq!(
        s.duration_until_reset.unwrap().seconds,
        to_window_end(365 * 86_400)
    );
    server.stop().await;
}
