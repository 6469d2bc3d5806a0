//! What a hostile or careless Envoy caller sends, through the Envoy API,
//! against a real server: every request is held to the engine's caps, and
//! nothing it sends can admit more than the limit, grow the metric series,
//! or make one Redis script call larger than the cap.

use crate::common;

use std::time::Duration;

use common::TestServer;
use common::envoy::{ask, client, config_dir, descriptor, refused, request_in, start, with_limit};
use tollgate::engine::caps;
use tollgate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use tollgate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;

/// The test clock's T0 is 20 s into a minute, on a whole second.
const INTO_MINUTE: u64 = 20;

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
async fn oversized_values_and_too_many_descriptors_or_entries_are_invalid() {
    let dir = config_dir(CONFIG);
    let server = start(dir.path(), false).await;
    let mut client = client(server.channel().await);
    let big = "v".repeat(1_000_000);
    let status = refused(
        &mut client,
        request_in("edge", vec![descriptor(&[("remote_address", &big)])]),
    )
    .await;
    assert_eq!(
        status.message(),
        "descriptors[0].entries[0].value is 1000000 bytes; at most 256 are allowed (hash longer keys first)"
    );
    let status = refused(
        &mut client,
        request_in(
            "edge",
            vec![
                descriptor(&[("remote_address", "a")]),
                descriptor(&[(&"k".repeat(257), "a")]),
            ],
        ),
    )
    .await;
    assert_eq!(
        status.message(),
        "descriptors[1].entries[0].key is 257 bytes; at most 256 are allowed (hash longer keys first)"
    );
    // Short descriptors, so that 50 000 fit in one message.
    let many = vec![descriptor(&[("r", "1")]); 50_000];
    let status = refused(&mut client, request_in("edge", many)).await;
    assert_eq!(
        status.message(),
        "descriptors has 50000 entries; at most 1000 are allowed, so split the request"
    );
    let deep: Vec<(String, String)> = (0..17).map(|i| (format!("k{i}"), "v".into())).collect();
    let deep: Vec<(&str, &str)> = deep.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let status = refused(&mut client, request_in("edge", vec![descriptor(&deep)])).await;
    assert_eq!(
        status.message(),
        "descriptors[0].entries has 17 entries; at most 16 are allowed"
    );
    let status = refused(
        &mut client,
        request_in(
            &"d".repeat(129),
            vec![descriptor(&[("remote_address", "a")])],
        ),
    )
    .await;
    assert_eq!(
        status.message(),
        "domain is 129 bytes; at most 128 are allowed"
    );
    // Nothing above was charged: the address still has all 3.
    let r = ask(
        &mut client,
        request_in("edge", vec![descriptor(&[("remote_address", "a")])]),
    )
    .await;
    assert_eq!(r.statuses[0].limit_remaining, 2);
    server.stop().await;
}

#[tokio::test]
async fn hits_that_overflow_when_summed_are_never_admitted() {
    let dir = config_dir(CONFIG);
    let server = start(dir.path(), false).await;
    let mut client = client(server.channel().await);
    let with_hits = |hits: u64| RateLimitDescriptor {
        hits_addend: Some(hits),
        ..descriptor(&[("remote_address", "x")])
    };
    // Exhaust the key, then send hits that wrap to 0 when added in u64.
    for _ in 0..3 {
        ask(&mut client, request_in("edge", vec![with_hits(1)])).await;
    }
    let r = ask(
        &mut client,
        request_in("edge", vec![with_hits(u64::MAX), with_hits(1)]),
    )
    .await;
    assert_eq!(r.overall_code(), Code::OverLimit);
    assert_eq!(
        (r.statuses[0].code(), r.statuses[1].code()),
        (Code::OverLimit, Code::OverLimit)
    );
    // On a fresh key too: the sum is above any limit, so it is over the
    // limit, and nothing is spent.
    let fresh = |hits: u64| RateLimitDescriptor {
        hits_addend: Some(hits),
        ..descriptor(&[("remote_address", "y")])
    };
    let r = ask(
        &mut client,
        request_in("edge", vec![fresh(u64::MAX), fresh(1)]),
    )
    .await;
    assert_eq!(r.overall_code(), Code::OverLimit);
    let r = ask(&mut client, request_in("edge", vec![fresh(1)])).await;
    assert_eq!(
        (r.overall_code(), r.statuses[0].limit_remaining),
        (Code::Ok, 2)
    );
    server.stop().await;
}

#[tokio::test]
async fn generous_zero_and_malformed_overrides() {
    let dir = config_dir(CONFIG);
    let server = start(dir.path(), false).await;
    let mut client = client(server.channel().await);
    // 200 000 a year is a limit like any other, not a block.
    let r = ask(
        &mut client,
        request_in("edge", vec![with_limit(&[("tier", "big")], 200_000, 6)]),
    )
    .await;
    assert_eq!(r.overall_code(), Code::Ok);
    assert_eq!(r.statuses[0].limit_remaining, 199_999);
    let limit = r.statuses[0].current_limit.as_ref().unwrap();
    assert_eq!(
        (limit.requests_per_unit, limit.unit),
        (200_000, 6 /* YEAR */)
    );

    // An unknown unit is refused, naming the field.
    for unit in [0, 8, -1] {
        let status = refused(
            &mut client,
            request_in("edge", vec![with_limit(&[("tier", "x")], 10, unit)]),
        )
        .await;
        assert_eq!(
            status.message(),
            format!(
                "descriptors[0].limit.unit is {unit}; use SECOND (1), MINUTE (2), HOUR (3), \
                 DAY (4), MONTH (5), YEAR (6) or WEEK (7)"
            )
        );
    }

    // A limit of zero: OVER_LIMIT with the limit and the time to the end
    // of the current unit window, as envoyproxy/ratelimit answers.
    let r = ask(
        &mut client,
        request_in("edge", vec![with_limit(&[("tier", "none")], 0, 2)]),
    )
    .await;
    assert_eq!(r.overall_code(), Code::OverLimit);
    let s = &r.statuses[0];
    assert_eq!((s.code(), s.limit_remaining), (Code::OverLimit, 0));
    let limit = s.current_limit.as_ref().unwrap();
    assert_eq!((limit.requests_per_unit, limit.unit), (0, 2 /* MINUTE */));
    assert_eq!(
        s.duration_until_reset,
        Some(prost_types::Duration {
            seconds: (60 - INTO_MINUTE) as i64,
            nanos: 0
        })
    );
    // The same for a configured zero, and the headers say so (no
    // Retry-After: waiting does not help).
    server.clock.advance(Duration::from_millis(250));
    let r = ask(
        &mut client,
        request_in("edge", vec![descriptor(&[("banned", "b")])]),
    )
    .await;
    let s = &r.statuses[0];
    assert_eq!(
        (r.overall_code(), s.code()),
        (Code::OverLimit, Code::OverLimit)
    );
    assert_eq!(
        s.duration_until_reset,
        Some(prost_types::Duration {
            seconds: 0,
            nanos: 750_000_000
        })
    );
    assert_eq!(s.current_limit.as_ref().unwrap().requests_per_unit, 0);
    let headers: Vec<(&str, &str)> = r
        .response_headers_to_add
        .iter()
        .map(|h| (h.key.as_str(), h.value.as_str()))
        .collect();
    assert_eq!(
        headers,
        [
            ("RateLimit-Policy", "\"edge.banned\";q=0;w=1"),
            ("RateLimit", "\"edge.banned\";r=0;t=1")
        ]
    );
    // A zero beside a limit with room: the other descriptor is not charged.
    let r = ask(
        &mut client,
        request_in(
            "edge",
            vec![
                descriptor(&[("remote_address", "z")]),
                descriptor(&[("closed", "c")]),
            ],
        ),
    )
    .await;
    assert_eq!(r.overall_code(), Code::OverLimit);
    assert_eq!(
        (r.statuses[0].code(), r.statuses[0].limit_remaining),
        (Code::Ok, 3)
    );
    assert_eq!(
        r.statuses[1].current_limit.as_ref().unwrap().name,
        "closed-for-now"
    );

    // An override in a domain that is not configured is ignored, as
    // envoyproxy/ratelimit ignores the whole domain.
    let r = ask(
        &mut client,
        request_in("elsewhere", vec![with_limit(&[("tier", "x")], 0, 1)]),
    )
    .await;
    assert_eq!(r.overall_code(), Code::Ok);
    assert_eq!(r.statuses[0].code(), Code::Ok);
    assert!(r.statuses[0].current_limit.is_none());
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_redis_script_call_never_carries_more_than_the_bucket_cap() {
    use common::redis::RedisServer;
    use tollgate::server::StoreSpec;
    let redis = RedisServer::start_with(&[
        "--slowlog-log-slower-than",
        "0",
        "--slowlog-max-len",
        "100000",
    ]);
    let dir = config_dir(CONFIG);
    let path = dir.path().to_owned();
    let url = redis.url();
    let server = TestServer::launch(None, move |c| {
        c.envoy_config = Some(path);
        c.store = StoreSpec::Redis(url);
        c.redis_uses_clock = true;
        // A large call on a loaded machine must not turn into a fail-open.
        c.store_timeout = Duration::from_secs(10);
    })
    .await;
    let mut client = client(server.channel().await);
    let many = |n: usize, tag: &str| {
        (0..n)
            .map(|i| descriptor(&[("remote_address", &format!("{tag}-{i}"))]))
            .collect::<Vec<_>>()
    };
    let flood = vec![descriptor(&[("r", "1")]); 50_000];
    let status = refused(&mut client, request_in("edge", flood)).await;
    assert!(
        status
            .message()
            .starts_with("descriptors has 50000 entries"),
        "{}",
        status.message()
    );
    // The most a request may carry goes through, in one call.
    let r = ask(
        &mut client,
        request_in("edge", many(caps::MAX_ITEMS, "full")),
    )
    .await;
    assert_eq!(r.overall_code(), Code::Ok);
    assert!(r.statuses.iter().all(|s| s.limit_remaining == 2));

    let mut conn = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let log: redis::Value = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(-1)
        .query_async(&mut conn)
        .await
        .unwrap();
    let redis::Value::Array(entries) = log else {
        panic!("{log:?}")
    };
    let mut widest = 0;
    for entry in entries {
        let redis::Value::Array(fields) = entry else {
            continue;
        };
        let Some(redis::Value::Array(args)) = fields.get(3) else {
            continue;
        };
        let text = |v: &redis::Value| match v {
            redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
            other => format!("{other:?}"),
        };
        if args
            .first()
            .map(text)
            .is_some_and(|c| c.eq_ignore_ascii_case("evalsha"))
        {
            let keys: usize = text(&args[2]).parse().unwrap();
            widest = widest.max(keys);
        }
    }
    assert!(
        widest >= caps::MAX_ITEMS,
        "the full request reached Redis in one call ({widest} keys at most)"
    );
    assert!(
        widest <= caps::MAX_BUCKETS,
        "one call carried {widest} keys"
    );
    server.stop().await;
}

/// A domain with a line feed in it (configured by an operator, so its
/// rejections reach the top-limited family) cannot forge samples:
/// `promtool check metrics` accepts the page, and no line starts with the
/// forged name.
#[tokio::test]
async fn a_line_feed_in_a_domain_cannot_forge_metric_lines() {
    let dir = config_dir(
        "domain: \"edge\\nfake_metric 1\"\ndescriptors:\n  - key: banned\n    rate_limit: {unit: second, requests_per_unit: 0}\n",
    );
    let server = start(dir.path(), false).await;
    let mut client = client(server.channel().await);
    let r = ask(
        &mut client,
        request_in("edge\nfake_metric 1", vec![descriptor(&[("banned", "b")])]),
    )
    .await;
    assert_eq!(r.overall_code(), Code::OverLimit);
    let (_, metrics) = server.http_get("/metrics").await.unwrap();
    assert!(
        metrics.contains(
            r#"tollgate_top_limited_rejections{tenant="~edge%0Afake_metric%201",rank="1"} 1"#
        ),
        "{metrics}"
    );
    assert!(
        !metrics.lines().any(|l| l.starts_with("fake_metric")),
        "{metrics}"
    );
    common::assert_promtool_accepts(&metrics);
    server.stop().await;
}
