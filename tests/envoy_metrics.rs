//! The metrics of what a hostile Envoy caller sends: request values never
//! become label values, and refusals count as errors with no tokens. One
//! test in its own binary, so no other test's decisions share its counters.

use crate::common;

use common::envoy::{
    ask, client, config_dir, descriptor, refused, request_in, sample, start, with_limit,
};
use tollgate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;

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

#[tokio::test]
async fn overrides_never_create_series_and_refusals_count_as_errors() {
    let dir = config_dir(CONFIG);
    let server = start(dir.path(), false).await;
    let mut client = client(server.channel().await);
    let series = |metrics: &str| -> Vec<String> {
        metrics
            .lines()
            .filter(|l| l.starts_with("tollgate_decisions_total{api=\"envoy\""))
            .map(|l| l.rsplit_once(' ').unwrap().0.to_owned())
            .collect()
    };
    ask(
        &mut client,
        request_in("edge", vec![with_limit(&[("user", "first")], 5, 2)]),
    )
    .await;
    let (_, before) = server.http_get("/metrics").await.unwrap();
    // 20 000 distinct values, in 20 requests of 1000 descriptors.
    for round in 0..20 {
        let descriptors = (0..1000)
            .map(|i| with_limit(&[("user", &format!("u{round}-{i}"))], 5, 2))
            .collect();
        let r = ask(&mut client, request_in("edge", descriptors)).await;
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
    // However a value might be spelled in a label, 20 000 of them made no
    // series of any metric: the exposition names the same series after as
    // before.
    let every = |m: &str| -> std::collections::BTreeSet<String> {
        m.lines()
            .filter(|l| l.starts_with("tollgate_"))
            .filter_map(|l| l.rsplit_once(' ').map(|(name, _)| name.to_owned()))
            .collect()
    };
    let new: Vec<String> = every(&after).difference(&every(&before)).cloned().collect();
    assert!(new.is_empty(), "series that 20 000 values created: {new:?}");

    // Refusals count once per descriptor, with no tokens (a hostile sum
    // must not wrap the counter).
    let big = "v".repeat(1_000);
    refused(
        &mut client,
        request_in("edge", vec![descriptor(&[("remote_address", &big)])]),
    )
    .await;
    let mut huge = descriptor(&[("remote_address", "h")]);
    huge.hits_addend = Some(u64::MAX);
    refused(
        &mut client,
        request_in("edge", vec![huge.clone(), huge, descriptor(&[("k", &big)])]),
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
