//! Envoy's rate limit service API at the wire level, through a client
//! generated from the proto, against a real server loading
//! envoyproxy/ratelimit YAML.

use crate::common;

use std::time::Duration;

use common::TestServer;
use common::envoy::{ask, config_dir, descriptor, header, request_in, start};
use tollgate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use tollgate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use tollgate::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use tollgate::proto::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use tollgate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tonic::transport::Channel;

/// The test clock's T0 is 20 s into a minute.
const INTO_MINUTE: u64 = 20;

const CONFIG: &str = "
domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: plan
    value: free
    rate_limit: {unit: minute, requests_per_unit: 1, name: free-plan}
  - key: plan
    value: trial
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: path
    value: /api/*/export
    share_threshold: true
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: internal
    rate_limit: {unlimited: true}
  - key: banned
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: user
    value: vip
    rate_limit: {unit: minute, requests_per_unit: 100, name: vip, replaces: [{name: free-plan}]}
  - key: bucket
    rate_limit: {unit: second, requests_per_unit: 10, algorithm: token_bucket, burst: 2}
  - key: sliding
    rate_limit: {unit: minute, requests_per_unit: 2, algorithm: sliding_window}
  - key: monthly
    rate_limit: {unit: month, requests_per_unit: 2, algorithm: quota, time_zone: America/New_York, cycle_day: 15}
  - key: month_window
    rate_limit: {unit: month, requests_per_unit: 2}
";

fn request(descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    request_in("edge", descriptors)
}

async fn one(
    client: &mut RateLimitServiceClient<Channel>,
    entries: &[(&str, &str)],
) -> (Code, DescriptorStatus) {
    let r = ask(client, request(vec![descriptor(entries)])).await;
    (r.overall_code(), r.statuses[0].clone())
}

#[tokio::test]
async fn fixed_window_per_value_with_exact_remaining_and_reset() {
    let dir = config_dir(CONFIG);
    let server = start(dir.path(), false).await;
    let mut client = RateLimitServiceClient::new(server.channel().await);
    for left in [2, 1, 0] {
        let r = ask(
            &mut client,
            request(vec![descriptor(&[("remote_address", "10.0.0.1")])]),
        )
        .await;
        assert_eq!(r.overall_code(), Code::Ok);
        let s = &r.statuses[0];
        assert_eq!((s.code(), s.limit_remaining), (Code::Ok, left));
        let limit = s.current_limit.as_ref().unwrap();
        assert_eq!((limit.requests_per_unit, limit.unit), (3, 2 /* MINUTE */));
        assert_eq!(
            s.duration_until_reset.as_ref().unwrap().seconds as u64,
            60 - INTO_MINUTE
        );
        // draft-ietf-httpapi-ratelimit-headers-11, named by the rule.
        assert_eq!(
            header(&r, "RateLimit-Policy"),
            Some("\"edge.remote_address\";q=3;w=60")
        );
        assert_eq!(
            header(&r, "RateLimit"),
            Some(format!("\"edge.remote_address\";r={left};t={}", 60 - INTO_MINUTE).as_str())
        );
    }
    let r = ask(
        &mut client,
        request(vec![descriptor(&[("remote_address", "10.0.0.1")])]),
    )
    .await;
    assert_eq!(r.overall_code(), Code::OverLimit);
    assert_eq!(r.statuses[0].limit_remaining, 0);
    assert_eq!(header(&r, "Retry-After"), Some("40"));
    // Another address has its own counter; the next minute starts over.
    assert_eq!(
        one(&mut client, &[("remote_address", "10.0.0.2")]).await.0,
        Code::Ok
    );
    server.clock.advance(Duration::from_secs(60 - INTO_MINUTE));
    assert_eq!(
        one(&mut client, &[("remote_address", "10.0.0.1")])
            .await
            .1
            .limit_remaining,
        2
    );
    server.stop().await;
}

#[tokio::test]
async fn a_rejected_descriptor_consumes_nothing_from_the_others() {
    let dir = config_dir(CONFIG);
    let server = start(dir.path(), false).await;
    let mut client = RateLimitServiceClient::new(server.channel().await);
    assert_eq!(one(&mut client, &[("plan", "free")]).await.0, Code::Ok);
    for _ in 0..3 {
        let r = ask(
            &mut client,
            request(vec![
                descriptor(&[("remote_address", "1.1.1.1")]),
                descriptor(&[("plan", "free")]),
            ]),
        )
        .await;
        assert_eq!(r.overall_code(), Code::OverLimit);
        assert_eq!(r.statuses[0].code(), Code::Ok);
        assert_eq!(
            r.statuses[0].limit_remaining, 3,
            "the address was not charged"
        );
        // Its window still ends with the minute, as envoyproxy/ratelimit
        // answers (nothing counted in it yet).
        assert_eq!(
            r.statuses[0].duration_until_reset,
            Some(prost_types::Duration {
                seconds: (60 - INTO_MINUTE) as i64,
                nanos: 0
            })
        );
        assert_eq!(r.statuses[1].code(), Code::OverLimit);
        assert_eq!(
            r.statuses[1].current_limit.as_ref().unwrap().name,
            "free-plan"
        );
    }
    // A limit of zero refuses; the other descriptor's window ends with its
    // hour (an hour window, 20 s in).
    let r = ask(
        &mut client,
        request(vec![
            descriptor(&[("banned", "x")]),
            descriptor(&[("path", "/api/v1/export")]),
        ]),
    )
    .await;
    assert_eq!(r.overall_code(), Code::OverLimit);
    assert_eq!(r.statuses[0].code(), Code::OverLimit);
    assert_eq!(r.statuses[1].limit_remaining, 2);
    let into_hour = (common::T0 / 1_000_000 % 3600) as i64;
    assert_eq!(
        r.statuses[1].duration_until_reset.map(|d| d.seconds),
        Some(3600 - into_hour)
    );
    server.stop().await;
}

#[tokio::test]
async fn unknown_domains_unmatched_descriptors_unlimited_and_blocked() {
    let dir = config_dir(CONFIG);
    let server = start(dir.path(), false).await;
    let mut client = RateLimitServiceClient::new(server.channel().await);
    let r = ask(
        &mut client,
        RateLimitRequest {
            domain: "nope".into(),
            ..request(vec![descriptor(&[("remote_address", "x")])])
        },
    )
    .await;
    assert_eq!(r.overall_code(), Code::Ok);
    assert_eq!(r.statuses[0].code(), Code::Ok);
    assert!(r.statuses[0].current_limit.is_none());
    let (code, s) = one(&mut client, &[("nothing", "here")]).await;
    assert_eq!(
        (code, s.current_limit.is_none(), s.limit_remaining),
        (Code::Ok, true, 0)
    );
    let (code, s) = one(&mut client, &[("internal", "svc")]).await;
    assert_eq!((code, s.limit_remaining), (Code::Ok, u32::MAX));
    let (code, s) = one(&mut client, &[("banned", "x")]).await;
    assert_eq!((code, s.code()), (Code::OverLimit, Code::OverLimit));
    // Empty domain or descriptor list: invalid.
    let err = client
        .should_rate_limit(RateLimitRequest {
            domain: String::new(),
            ..request(vec![descriptor(&[("a", "b")])])
        })
        .await
        .unwrap_err();
    assert_eq!(
        (err.code(), err.message()),
        (
            tonic::Code::InvalidArgument,
            "rate limit domain must not be empty"
        )
    );
    let err = client.should_rate_limit(request(vec![])).await.unwrap_err();
    assert_eq!(
        err.message(),
        "rate limit descriptor list must not be empty"
    );
    server.stop().await;
}

#[tokio::test]
async fn wildcards_hits_addend_overrides_and_replaces() {
    let dir = config_dir(CONFIG);
    let server = start(dir.path(), false).await;
    let mut client = RateLimitServiceClient::new(server.channel().await);
    // share_threshold: different paths matching the wildcard share 2/hour.
    assert_eq!(
        one(&mut client, &[("path", "/api/v1/export")])
            .await
            .1
            .limit_remaining,
        1
    );
    assert_eq!(
        one(&mut client, &[("path", "/api/v2/export")])
            .await
            .1
            .limit_remaining,
        0
    );
    assert_eq!(
        one(&mut client, &[("path", "/api/v3/export")]).await.0,
        Code::OverLimit
    );

    // hits_addend for the request, and per descriptor.
    let r = ask(
        &mut client,
        RateLimitRequest {
            hits_addend: 4,
            ..request(vec![descriptor(&[("user", "u1")])])
        },
    )
    .await;
    assert_eq!(r.statuses[0].limit_remaining, 6);
    let mut d = descriptor(&[("user", "u1")]);
    d.hits_addend = Some(5);
    let r = ask(
        &mut client,
        RateLimitRequest {
            hits_addend: 4,
            ..request(vec![d])
        },
    )
    .await;
    assert_eq!(r.statuses[0].limit_remaining, 1);

    // A limit override sent by Envoy.
    let mut d = descriptor(&[("anything", "x")]);
    d.limit = Some(RateLimitOverride {
        requests_per_unit: 2,
        unit: 1, /* SECOND */
    });
    for left in [1, 0] {
        assert_eq!(
            ask(&mut client, request(vec![d.clone()])).await.statuses[0].limit_remaining,
            left
        );
    }
    assert_eq!(
        ask(&mut client, request(vec![d])).await.overall_code(),
        Code::OverLimit
    );

    // `vip` replaces `free-plan` when both match one request.
    assert_eq!(one(&mut client, &[("plan", "free")]).await.0, Code::Ok);
    let r = ask(
        &mut client,
        request(vec![
            descriptor(&[("plan", "free")]),
            descriptor(&[("user", "vip")]),
        ]),
    )
    .await;
    assert_eq!(
        r.overall_code(),
        Code::Ok,
        "free-plan is empty but replaced"
    );
    assert!(r.statuses[0].current_limit.is_none());
    assert_eq!(r.statuses[1].limit_remaining, 99);
    server.stop().await;
}

#[tokio::test]
async fn shadow_mode_per_descriptor_and_global() {
    let dir = config_dir(CONFIG);
    let server = start(dir.path(), false).await;
    let mut client = RateLimitServiceClient::new(server.channel().await);
    for _ in 0..3 {
        let (code, s) = one(&mut client, &[("plan", "trial")]).await;
        assert_eq!(
            (code, s.code()),
            (Code::Ok, Code::Ok),
            "shadow_mode never limits"
        );
    }
    let (_, metrics) = server.http_get("/metrics").await.unwrap();
    assert!(metrics.contains(r#"tollgate_decisions_total{api="envoy",outcome="shadow_rejected",rule="edge.plan_trial"}"#), "{metrics}");
    server.stop().await;

    let dir = config_dir(CONFIG);
    let server = start(dir.path(), true).await;
    let mut client = RateLimitServiceClient::new(server.channel().await);
    one(&mut client, &[("plan", "free")]).await;
    let (code, s) = one(&mut client, &[("plan", "free")]).await;
    assert_eq!(code, Code::Ok, "global shadow mode answers OK");
    assert_eq!(
        s.code(),
        Code::OverLimit,
        "but says which descriptor is over"
    );
    // Counted as shadow rejections, as a rule in shadow mode is: nothing
    // was refused.
    let (_, metrics) = server.http_get("/metrics").await.unwrap();
    assert!(
        metrics.contains(r#"tollgate_decisions_total{api="envoy",outcome="shadow_rejected",rule="edge.plan_free"} 1"#),
        "{metrics}"
    );
    assert!(!metrics.contains(r#"outcome="rejected""#), "{metrics}");
    server.stop().await;
}

#[tokio::test]
async fn token_bucket_and_sliding_window_rules() {
    let dir = config_dir(CONFIG);
    let server = start(dir.path(), false).await;
    let mut client = RateLimitServiceClient::new(server.channel().await);
    // Burst 2, then one token every 100 ms.
    assert_eq!(
        one(&mut client, &[("bucket", "b")]).await.1.limit_remaining,
        1
    );
    assert_eq!(
        one(&mut client, &[("bucket", "b")]).await.1.limit_remaining,
        0
    );
    let r = ask(&mut client, request(vec![descriptor(&[("bucket", "b")])])).await;
    assert_eq!(r.overall_code(), Code::OverLimit);
    assert_eq!(header(&r, "Retry-After"), Some("1"));
    server.clock.advance(Duration::from_millis(100));
    assert_eq!(one(&mut client, &[("bucket", "b")]).await.0, Code::Ok);
    // Sliding window: 2 a minute, and the previous minute still counts.
    one(&mut client, &[("sliding", "s")]).await;
    one(&mut client, &[("sliding", "s")]).await;
    server
        .clock
        .advance(Duration::from_secs(60 - INTO_MINUTE + 10));
    assert_eq!(
        one(&mut client, &[("sliding", "s")]).await.0,
        Code::OverLimit,
        "10 s into the next minute, 2 × 50/60 rounds up to 2"
    );
    server.stop().await;
}

#[tokio::test]
async fn hot_reload_keeps_the_last_good_config_and_follows_configmap_symlink_swaps() {
    // A Kubernetes ConfigMap volume: files are links into ..data, which is a
    // link to a timestamped directory swapped atomically on update.
    let root = tempfile::tempdir().unwrap();
    let mount = root.path();
    let version = |name: &str, text: &str| {
        let dir = mount.join(name);
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("edge.yaml"), text).unwrap();
    };
    version(
        "..v1",
        "domain: edge\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 1}\n",
    );
    std::os::unix::fs::symlink("..v1", mount.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/edge.yaml", mount.join("edge.yaml")).unwrap();
    let server = start(mount, false).await;
    let mut client = RateLimitServiceClient::new(server.channel().await);
    let limit = |s: &DescriptorStatus| s.current_limit.as_ref().map(|l| l.requests_per_unit);
    assert_eq!(limit(&one(&mut client, &[("k", "a")]).await.1), Some(1));

    let swap = |to: &str| {
        std::os::unix::fs::symlink(to, mount.join("..data_tmp")).unwrap();
        std::fs::rename(mount.join("..data_tmp"), mount.join("..data")).unwrap();
    };
    version(
        "..v2",
        "domain: edge\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 50}\n",
    );
    swap("..v2");
    let mut reloaded = false;
    for _ in 0..300 {
        if limit(&one(&mut client, &[("k", "b")]).await.1) == Some(50) {
            reloaded = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(reloaded, "the swapped ConfigMap was not picked up");

    // A bad version: the last good config stays, and the reason is reported.
    version(
        "..v3",
        "domain: edge\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight, requests_per_unit: 5}\n",
    );
    swap("..v3");
    let mut reported = None;
    for _ in 0..300 {
        let (_, body) = server.http_get("/v1/envoy-config").await.unwrap();
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        if let Some(e) = v["status"]["last_error"].as_str() {
            reported = Some(e.to_owned());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let reported = reported.expect("the bad config was reported");
    assert!(
        reported.ends_with("edge.yaml: invalid rate limit unit 'fortnight'"),
        "{reported}"
    );
    assert_eq!(limit(&one(&mut client, &[("k", "c")]).await.1), Some(50));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_envoy_api_on_redis_and_on_a_cluster() {
    use common::redis::{RedisCluster, RedisServer};
    use tollgate::server::StoreSpec;
    let redis = RedisServer::start();
    let cluster = RedisCluster::start();
    for url in [redis.url(), cluster.url()] {
        let dir = config_dir(CONFIG);
        let path = dir.path().to_owned();
        let server = TestServer::launch(None, move |c| {
            c.envoy_config = Some(path);
            c.store = StoreSpec::Redis(url);
            c.redis_uses_clock = true;
        })
        .await;
        let mut client = RateLimitServiceClient::new(server.channel().await);
        for left in [2, 1, 0] {
            let (code, s) = one(&mut client, &[("remote_address", "10.9.9.9")]).await;
            assert_eq!((code, s.limit_remaining), (Code::Ok, left));
        }
        // Two descriptors, one over: decided atomically, the other not charged.
        one(&mut client, &[("plan", "free")]).await;
        let r = ask(
            &mut client,
            request(vec![
                descriptor(&[("user", "u")]),
                descriptor(&[("plan", "free")]),
            ]),
        )
        .await;
        assert_eq!(r.overall_code(), Code::OverLimit);
        assert_eq!(r.statuses[0].limit_remaining, 10);
        assert_eq!(
            one(&mut client, &[("remote_address", "10.9.9.9")]).await.0,
            Code::OverLimit
        );
        server.stop().await;
    }
}

/// The Envoy API follows each rule's `on_store_unavailable` while Redis is
/// down: `allow` admits, `deny` answers OVER_LIMIT, `local` decides with
/// this instance's own bucket at `--local-fraction` of the limit; and a
/// request meeting `deny` beside `local` is refused whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_envoy_api_follows_on_store_unavailable_while_redis_is_down() {
    use common::redis::RedisServer;
    use tollgate::server::StoreSpec;
    let dir = config_dir(
        "\
domain: edge
descriptors:
  - key: open
    rate_limit: {unit: hour, requests_per_unit: 2, on_store_unavailable: allow}
  - key: closed
    rate_limit: {unit: hour, requests_per_unit: 2, on_store_unavailable: deny}
  - key: local
    rate_limit: {unit: hour, requests_per_unit: 10, algorithm: token_bucket, on_store_unavailable: local}
",
    );
    let mut redis = RedisServer::start();
    let (path, url) = (dir.path().to_owned(), redis.url());
    let server = TestServer::launch(None, move |c| {
        c.envoy_config = Some(path);
        c.store = StoreSpec::Redis(url);
        c.store_timeout = Duration::from_millis(100);
        c.local_fraction = 0.5;
    })
    .await;
    server.wait_ready().await;
    let mut client = RateLimitServiceClient::new(server.channel().await);
    // Redis answers (bounded retries: a stall of a loaded machine past the
    // 100 ms store timeout makes the closed rule refuse instead).
    let mut answered = false;
    for i in 0..20 {
        if one(&mut client, &[("closed", &format!("x{i}"))]).await.0 == Code::Ok {
            answered = true;
            break;
        }
    }
    assert!(answered, "Redis answered none of 20 decisions");
    redis.kill();

    for _ in 0..5 {
        assert_eq!(one(&mut client, &[("open", "x")]).await.0, Code::Ok);
        assert_eq!(
            one(&mut client, &[("closed", "x")]).await.0,
            Code::OverLimit
        );
        // Refused whole: the local descriptor beside the closed one is not
        // spent (the 5 local admissions below prove it).
        let both = ask(
            &mut client,
            request(vec![
                descriptor(&[("local", "y")]),
                descriptor(&[("closed", "y")]),
            ]),
        )
        .await;
        assert_eq!(both.overall_code(), Code::OverLimit);
    }
    let mut admitted = 0;
    for _ in 0..8 {
        if one(&mut client, &[("local", "y")]).await.0 == Code::Ok {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 5, "half of 10 on this instance");
    server.stop().await;
}

/// `algorithm: quota` counts per calendar period of the cycle the YAML
/// gives: refused until the period ends, exactly; `unit: month` without it
/// stays envoyproxy/ratelimit's fixed window.
#[tokio::test]
async fn a_quota_descriptor_turns_on_its_billing_cycle() {
    let dir = config_dir(CONFIG);
    let server = start(dir.path(), false).await;
    let mut client = RateLimitServiceClient::new(server.channel().await);
    // 2026-03-15T03:59:59Z: a second before midnight on the 15th in New York.
    let midnight: u64 = 1_773_547_200_000_000;
    server.clock.set(midnight - 1_000_000);
    for left in [1, 0] {
        let (code, status) = one(&mut client, &[("monthly", "acme")]).await;
        assert_eq!((code, status.limit_remaining), (Code::Ok, left));
    }
    let r = ask(
        &mut client,
        request(vec![descriptor(&[("monthly", "acme")])]),
    )
    .await;
    assert_eq!(r.overall_code(), Code::OverLimit);
    let reset = r.statuses[0].duration_until_reset.as_ref().unwrap();
    assert_eq!((reset.seconds, reset.nanos), (1, 0));
    assert_eq!(header(&r, "Retry-After"), Some("1"));
    server.clock.set(midnight);
    let (code, status) = one(&mut client, &[("monthly", "acme")]).await;
    assert_eq!((code, status.limit_remaining), (Code::Ok, 1));
    // 15 April, midnight EDT: 31 days on.
    let reset = status.duration_until_reset.unwrap();
    assert_eq!(reset.seconds, 31 * 86_400);
    // The same instant, envoyproxy/ratelimit's month: a window aligned on
    // the epoch, untouched by any calendar.
    let (_, status) = one(&mut client, &[("month_window", "acme")]).await;
    let month = tollgate::algorithm::RateUnit::Month.micros() / 1_000_000;
    let into = (midnight / 1_000_000) % month;
    assert_eq!(
        status.duration_until_reset.unwrap().seconds as u64,
        month - into
    );
    server.stop().await;
}
