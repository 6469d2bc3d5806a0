//! The decision API through a real server and the generated client.

use crate::common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{TestServer, ask, micros, req, row};
use tollgate::proto::v1::{BatchItem, ShouldAllowBatchRequest, ShouldAllowRequest};

fn headers(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[tokio::test]
async fn default_limit_lets_a_burst_through_then_answers_an_honest_429() {
    let server = TestServer::start().await;
    let mut client = server.client().await;

    let first = ask(&mut client, req("acme", "alice")).await;
    assert!(first.allowed);
    assert_eq!(first.remaining, 29);
    assert_eq!(first.limit, 30);
    assert_eq!(first.limit_name, "default-per-key");
    assert_eq!(first.rate, "600/minute");
    assert!(!first.shadow);
    assert_eq!(micros(&first.retry_after), 0);
    assert_eq!(micros(&first.reset_after), 100_000);
    assert_eq!(
        first.headers,
        headers(&[
            ("RateLimit-Policy", "\"default-per-key\";q=30;w=3"),
            ("RateLimit", "\"default-per-key\";r=29;t=1")
        ])
    );

    for i in 1..30 {
        let r = ask(&mut client, req("acme", "alice")).await;
        assert!(r.allowed, "request {i}");
        assert_eq!(r.remaining, 29 - i);
    }
    let rejected = ask(&mut client, req("acme", "alice")).await;
    assert!(!rejected.allowed);
    assert_eq!(rejected.remaining, 0);
    assert_eq!(micros(&rejected.retry_after), 100_000);
    assert_eq!(micros(&rejected.reset_after), 3_000_000);
    assert_eq!(
        rejected.headers,
        headers(&[
            ("RateLimit-Policy", "\"default-per-key\";q=30;w=3"),
            ("RateLimit", "\"default-per-key\";r=0;t=3"),
            ("Retry-After", "1"),
        ])
    );

    // Another key and another tenant have their own buckets.
    assert_eq!(ask(&mut client, req("acme", "bob")).await.remaining, 29);
    assert_eq!(ask(&mut client, req("globex", "alice")).await.remaining, 29);

    // One microsecond early is still too early; exactly retry_after is not.
    server.clock.advance(Duration::from_micros(99_999));
    assert!(!ask(&mut client, req("acme", "alice")).await.allowed);
    server.clock.advance(Duration::from_micros(1));
    let r = ask(&mut client, req("acme", "alice")).await;
    assert!(r.allowed);
    assert_eq!(r.remaining, 0);
    server.stop().await;
}

#[tokio::test]
async fn cost_and_dry_run() {
    let server = TestServer::start().await;
    let mut client = server.client().await;
    let heavy = ShouldAllowRequest {
        cost: 25,
        dry_run: true,
        ..req("", "k")
    };
    let r = ask(&mut client, heavy.clone()).await;
    assert!(r.allowed);
    assert_eq!(
        r.remaining, 5,
        "dry run reports what a real request would leave"
    );
    // Nothing was spent.
    let r = ask(
        &mut client,
        ShouldAllowRequest {
            dry_run: false,
            ..heavy.clone()
        },
    )
    .await;
    assert_eq!(r.remaining, 5);
    let r = ask(
        &mut client,
        ShouldAllowRequest {
            cost: 6,
            ..req("", "k")
        },
    )
    .await;
    assert!(!r.allowed);
    assert_eq!(r.remaining, 5);
    assert_eq!(micros(&r.retry_after), 100_000);
    // cost 0 means 1.
    let r = ask(
        &mut client,
        ShouldAllowRequest {
            cost: 0,
            ..req("", "k")
        },
    )
    .await;
    assert_eq!(r.remaining, 4);
    server.stop().await;
}

#[tokio::test]
async fn tenant_ceiling_rejection_spends_nothing_from_the_key_bucket() {
    let server = TestServer::with_rows(&[
        row("per-key", "", "", "key", 10, "1/hour"),
        row("ceiling", "", "", "tenant", 3, "1/hour"),
    ])
    .await;
    let mut client = server.client().await;
    for key in ["a", "b", "c"] {
        let r = ask(&mut client, req("acme", key)).await;
        assert!(r.allowed);
    }
    // The ceiling is shared by the tenant's keys: the fourth key is refused
    // by it, and its own bucket is untouched.
    let r = ask(&mut client, req("acme", "d")).await;
    assert!(!r.allowed);
    assert_eq!(r.limit_name, "ceiling");
    assert_eq!(r.limit, 3);
    assert_eq!(micros(&r.retry_after), 3_600_000_000);
    let dry = ask(
        &mut client,
        ShouldAllowRequest {
            dry_run: true,
            ..req("other", "d")
        },
    )
    .await;
    assert_eq!(
        dry.limit_name, "ceiling",
        "another tenant: the tightest is its fresh ceiling"
    );
    server.clock.advance(Duration::from_secs(3600));
    let r = ask(&mut client, req("acme", "d")).await;
    assert!(r.allowed);
    assert_eq!(r.limit_name, "ceiling");
    assert_eq!(r.remaining, 0);
    let per_key = ask(
        &mut client,
        ShouldAllowRequest {
            dry_run: true,
            ..req("acme", "d")
        },
    )
    .await;
    assert!(!per_key.allowed, "ceiling empty again");
    server.stop().await;
}

#[tokio::test]
async fn resource_rules_apply_on_top_and_tenant_rows_override_defaults() {
    let server = TestServer::with_rows(&[
        row("default-key", "", "", "key", 30, "600/minute"),
        row("default-exports", "", "exports", "key", 2, "10/hour"),
        row("acme-key", "acme", "", "key", 100, "6000/minute"),
    ])
    .await;
    let mut client = server.client().await;
    let export = |tenant: &str| ShouldAllowRequest {
        resource: "exports".into(),
        ..req(tenant, "k")
    };
    let r = ask(&mut client, export("acme")).await;
    assert_eq!((r.limit_name.as_str(), r.remaining), ("default-exports", 1));
    // The export also counted against acme's own per-key rule.
    let r = ask(
        &mut client,
        ShouldAllowRequest {
            dry_run: true,
            ..req("acme", "k")
        },
    )
    .await;
    assert_eq!(
        (r.limit_name.as_str(), r.remaining, r.limit),
        ("acme-key", 98, 100)
    );
    ask(&mut client, export("acme")).await;
    let r = ask(&mut client, export("acme")).await;
    assert!(!r.allowed);
    assert_eq!(r.limit_name, "default-exports");
    assert_eq!(micros(&r.retry_after), 360_000_000);
    // Unknown tenants get the default rows.
    let r = ask(&mut client, req("unknown", "k")).await;
    assert_eq!((r.limit_name.as_str(), r.limit), ("default-key", 30));
    server.stop().await;
}

#[tokio::test]
async fn shadow_rule_never_rejects_but_says_it_would_have() {
    let mut shadow = row("trial", "", "", "key", 2, "1/hour");
    shadow.mode = tollgate::limits::Mode::Shadow;
    let server =
        TestServer::with_rows(&[row("per-key", "", "", "key", 100, "1/second"), shadow]).await;
    let mut client = server.client().await;
    for i in 0..2 {
        let r = ask(&mut client, req("t", "k")).await;
        assert!(r.allowed && !r.shadow, "request {i}");
    }
    for _ in 0..3 {
        let r = ask(&mut client, req("t", "k")).await;
        assert!(r.allowed);
        assert!(r.shadow);
        assert_eq!(r.limit_name, "per-key", "the enforced rule decides");
        assert!(!r.headers.contains_key("Retry-After"));
    }
    server.stop().await;
}

#[tokio::test]
async fn batch_charges_all_items_or_none() {
    let server = TestServer::with_rows(&[
        row("accounts", "", "login-account", "key", 5, "1/hour"),
        row("ips", "", "login-ip", "key", 2, "1/hour"),
    ])
    .await;
    let mut client = server.client().await;
    let login = |account: &str, ip: &str| ShouldAllowBatchRequest {
        items: vec![
            BatchItem {
                key: account.into(),
                cost: 1,
                tenant: String::new(),
                resource: "login-account".into(),
            },
            BatchItem {
                key: ip.into(),
                cost: 1,
                tenant: String::new(),
                resource: "login-ip".into(),
            },
        ],
        dry_run: false,
    };
    for _ in 0..2 {
        let r = client
            .should_allow_batch(login("alice", "10.0.0.1"))
            .await
            .unwrap()
            .into_inner();
        assert!(r.allowed);
    }
    // The IP is spent: the whole attempt is refused and alice's account
    // bucket is not charged.
    let r = client
        .should_allow_batch(login("alice", "10.0.0.1"))
        .await
        .unwrap()
        .into_inner();
    assert!(!r.allowed);
    assert_eq!(micros(&r.retry_after), 3_600_000_000);
    assert!(r.results[0].allowed, "the account alone would pass");
    assert_eq!(r.results[0].remaining, 3, "and still holds 3");
    assert!(!r.results[1].allowed);
    assert_eq!(r.results[1].limit_name, "ips");
    assert_eq!(r.results[1].headers["Retry-After"], "3600");
    // From a fresh IP alice still has 3 attempts.
    let r = client
        .should_allow_batch(login("alice", "10.0.0.2"))
        .await
        .unwrap()
        .into_inner();
    assert!(r.allowed);
    assert_eq!(r.results[0].remaining, 2);

    // Items that land in the same bucket add up.
    let same = ShouldAllowBatchRequest {
        items: vec![
            BatchItem {
                key: "x".into(),
                cost: 1,
                tenant: String::new(),
                resource: "login-ip".into(),
            },
            BatchItem {
                key: "x".into(),
                cost: 1,
                tenant: String::new(),
                resource: "login-ip".into(),
            },
        ],
        dry_run: false,
    };
    let r = client
        .should_allow_batch(same.clone())
        .await
        .unwrap()
        .into_inner();
    assert!(r.allowed);
    assert_eq!(r.results[1].remaining, 0);
    assert!(
        !client
            .should_allow_batch(same)
            .await
            .unwrap()
            .into_inner()
            .allowed
    );
    server.stop().await;
}

#[tokio::test]
async fn large_batches_merge_items_sharing_a_bucket() {
    // 60 items over 20 keys, each key three times, plus the tenant-wide
    // bucket every item shares: more buckets than the limiter scans
    // linearly, so the merging runs through its hash index too.
    let server = TestServer::with_rows(&[
        row("per-key", "", "", "key", 3, "1/hour"),
        row("tenant", "", "", "tenant", 1000, "1/hour"),
    ])
    .await;
    let mut client = server.client().await;
    let item = |k: usize| BatchItem {
        key: format!("k{k}"),
        cost: 1,
        tenant: "t".into(),
        resource: String::new(),
    };
    let batch = ShouldAllowBatchRequest {
        items: (0..60).map(|i| item(i % 20)).collect(),
        dry_run: false,
    };
    let r = client
        .should_allow_batch(batch.clone())
        .await
        .unwrap()
        .into_inner();
    assert!(r.allowed);
    for (i, result) in r.results.iter().enumerate() {
        assert_eq!(result.limit_name, "per-key", "item {i}");
        assert_eq!(
            result.remaining, 0,
            "item {i}: its key's three tokens are spent"
        );
    }
    let r = ask(&mut client, req("t", "k5")).await;
    assert!(!r.allowed, "k5 was charged three times by the batch");
    let r = ask(&mut client, req("t", "k20")).await;
    assert!(r.allowed);
    assert_eq!(r.limit_name, "per-key");
    assert_eq!(r.remaining, 2);

    // One key four times in a batch of 40 exceeds its capacity of 3: the
    // error names the shared bucket, and nothing is spent.
    let mut items: Vec<BatchItem> = (100..136).map(item).collect();
    items.extend((0..4).map(|_| item(200)));
    let err = client
        .should_allow_batch(ShouldAllowBatchRequest {
            items,
            dry_run: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message()
            .contains("the items sharing bucket \"t:k::k200\""),
        "{}",
        err.message()
    );
    let r = ask(&mut client, req("t", "k100")).await;
    assert_eq!(r.remaining, 2, "the refused batch spent nothing");
    server.stop().await;
}

/// Server and clients on a runtime of several threads, so that calls run
/// in parallel and race for the bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_hundred_concurrent_calls_at_a_fresh_bucket_of_one_hundred() {
    let server = TestServer::with_rows(&[row("hundred", "", "", "key", 100, "1/day")]).await;
    let mut tasks = Vec::new();
    let channels: Vec<_> = futures_channels(&server, 4).await;
    for i in 0..500 {
        let mut client = tollgate::proto::v1::rate_limiter_client::RateLimiterClient::new(
            channels[i % channels.len()].clone(),
        );
        tasks.push(tokio::spawn(async move {
            ask(&mut client, req("t", "hot")).await.allowed
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        admitted += usize::from(t.await.unwrap());
    }
    assert_eq!(admitted, 100);
    server.stop().await;
}

async fn futures_channels(server: &TestServer, n: usize) -> Vec<tonic::transport::Channel> {
    let mut channels = Vec::new();
    for _ in 0..n {
        channels.push(server.channel().await);
    }
    channels
}

#[tokio::test]
async fn no_rules_means_unlimited_by_default() {
    let server = TestServer::with_rows(&[row("acme-only", "acme", "", "key", 1, "1/hour")]).await;
    let mut client = server.client().await;
    for _ in 0..3 {
        let r = ask(&mut client, req("other", "k")).await;
        assert!(r.allowed);
        assert_eq!(r.limit_name, "");
        assert!(r.headers.is_empty());
    }
    server.stop().await;
}

#[tokio::test]
async fn health_and_reflection_work_without_the_proto_file() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;

    let server = TestServer::start().await;
    let mut health = HealthClient::new(server.channel().await);
    for service in ["", "tollgate.v1.RateLimiter"] {
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(status, ServingStatus::Serving as i32, "service {service:?}");
    }

    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let mut reflection = ServerReflectionClient::new(server.channel().await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut stream = reflection
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let response = stream.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        panic!("unexpected reflection answer");
    };
    let mut names: Vec<_> = list.service.into_iter().map(|s| s.name).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "envoy.service.rate_limit_quota.v3.RateLimitQuotaService",
            "envoy.service.ratelimit.v3.RateLimitService",
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "tollgate.v1.Admin",
            "tollgate.v1.RateLimiter"
        ]
    );
    server.stop().await;
}

#[tokio::test]
async fn admin_port_reports_health_limits_and_metrics() {
    let server = TestServer::start().await;
    let mut client = server.client().await;
    for _ in 0..31 {
        ask(&mut client, req("m", "k")).await;
    }
    assert_eq!(
        server.http_get("/healthz").await.unwrap(),
        (200, "ok\n".into())
    );
    assert_eq!(
        server.http_get("/readyz").await.unwrap(),
        (200, "ready\n".into())
    );
    let (status, body) = server.http_get("/v1/limits").await.unwrap();
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["rules"][0]["name"], "default-per-key");
    assert_eq!(v["rules"][0]["rate"], "600/minute");
    assert_eq!(v["rules"][0]["burst"], 30);
    assert_eq!(v["status"]["rules"], 1);
    let (status, metrics) = server.http_get("/metrics").await.unwrap();
    assert_eq!(status, 200);
    // Exact counts: the suite runs each test in a process of its own
    // (nextest), so no other test's decisions are in this recorder.
    let series = |name: &str| common::envoy::sample(&metrics, name);
    let decided = |outcome: &str| {
        series(&format!(
            r#"tollgate_decisions_total{{api="native",outcome="{outcome}",rule="default-per-key"}}"#
        ))
    };
    assert_eq!(decided("allowed"), Some(30), "{metrics}");
    assert_eq!(decided("rejected"), Some(1), "{metrics}");
    assert_eq!(series("tollgate_buckets"), Some(1), "{metrics}");
    assert_eq!(series("tollgate_rules_loaded"), Some(1), "{metrics}");
    server.stop().await;
}

#[tokio::test]
async fn a_stream_of_decisions_answers_each_message_in_order() {
    use tollgate::proto::v1::StreamDecision;
    let server = TestServer::with_rows(&[row("per-key", "", "", "key", 3, "1/hour")]).await;
    let mut client = server.client().await;
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let mut answers = client
        .should_allow_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let mut next = async |request: ShouldAllowRequest| -> StreamDecision {
        tx.send(request).await.unwrap();
        answers.message().await.unwrap().unwrap()
    };
    for left in [2, 1] {
        let a = next(req("s", "k")).await;
        assert_eq!((a.error_code, a.decision.unwrap().remaining), (0, left));
    }
    // A bad message gets its error and the stream goes on.
    let bad = next(req("s", "")).await;
    assert_eq!(bad.error_code, tonic::Code::InvalidArgument as u32);
    assert!(
        bad.error_message.starts_with("key is empty"),
        "{}",
        bad.error_message
    );
    assert!(bad.decision.is_none());
    let a = next(req("s", "k")).await;
    assert_eq!(a.decision.as_ref().unwrap().remaining, 0);
    let a = next(req("s", "k")).await;
    let d = a.decision.unwrap();
    assert!(!d.allowed);
    assert_eq!(d.headers["Retry-After"], "3600");
    // The stream is still open: a graceful shutdown ends it rather than
    // waiting for the client to hang up.
    server.stop().await;
    // Ended by the server, cleanly: no more messages and an OK status.
    assert!(
        matches!(answers.message().await, Ok(None)),
        "the stream did not end cleanly"
    );
}

/// A batch's decisions are counted per item, by rule and outcome, with the
/// tokens they asked for, however its items interleave their rules. (The
/// rule names are this test's own, so other tests' decisions do not mix in.)
#[tokio::test]
async fn batch_decisions_are_counted_per_item_by_rule_and_outcome() {
    let server = TestServer::with_rows(&[
        row("count-a", "", "count-a", "key", 10, "1/hour"),
        row("count-b", "", "count-b", "key", 10, "1/hour"),
    ])
    .await;
    let mut client = server.client().await;
    let item = |resource: &str, key: &str, cost: u64| BatchItem {
        key: key.into(),
        cost,
        tenant: String::new(),
        resource: resource.into(),
    };
    let batch = |items| ShouldAllowBatchRequest {
        items,
        dry_run: false,
    };
    // a, a, b, a: three runs of one rule each.
    let r = client
        .should_allow_batch(batch(vec![
            item("count-a", "k1", 1),
            item("count-a", "k2", 2),
            item("count-b", "k1", 3),
            item("count-a", "k3", 1),
        ]))
        .await
        .unwrap()
        .into_inner();
    assert!(r.allowed);
    // b's bucket k1 holds 7: cost 8 is refused, and so is the whole batch;
    // the a item would have passed on its own and says so.
    let r = client
        .should_allow_batch(batch(vec![
            item("count-b", "k1", 8),
            item("count-a", "k1", 1),
            item("count-b", "k2", 1),
        ]))
        .await
        .unwrap()
        .into_inner();
    assert!(!r.allowed);
    let verdicts: Vec<bool> = r.results.iter().map(|r| r.allowed).collect();
    assert_eq!(verdicts, [false, true, true]);

    let (_, metrics) = server.http_get("/metrics").await.unwrap();
    let value = |name: &str, outcome: &str, rule: &str| -> u64 {
        let series = format!(r#"{name}{{api="native",outcome="{outcome}",rule="{rule}"}} "#);
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&series))
            .map_or(0, |v| v.parse().unwrap())
    };
    let decisions = "tollgate_decisions_total";
    let tokens = "tollgate_decision_tokens_total";
    assert_eq!(value(decisions, "allowed", "count-a"), 4, "{metrics}");
    assert_eq!(value(tokens, "allowed", "count-a"), 5);
    assert_eq!(value(decisions, "allowed", "count-b"), 2);
    assert_eq!(value(tokens, "allowed", "count-b"), 4);
    assert_eq!(value(decisions, "rejected", "count-b"), 1);
    assert_eq!(value(tokens, "rejected", "count-b"), 8);
    assert_eq!(value(decisions, "rejected", "count-a"), 0);
    server.stop().await;
}

/// `--rate-limit-headers`: the current draft's fields list every enforced
/// rule that applies (a shadow rule is not advertised); the old fields
/// give the tightest rule; `both` gives both.
#[tokio::test]
async fn rate_limit_header_styles_list_every_rule_or_the_tightest() {
    use tollgate::engine::HeaderStyle;
    let mut shadow = row("trial", "acme", "", "key", 1, "1/hour");
    shadow.mode = tollgate::limits::Mode::Shadow;
    let rows = [
        row("per-user", "acme", "", "key", 10, "10/second"),
        row("acme-total", "acme", "", "tenant", 100, "100/minute"),
        shadow,
    ];
    let draft = "\"per-user\";q=10;w=1, \"acme-total\";q=100;w=60";
    let state = "\"per-user\";r=9;t=1, \"acme-total\";r=99;t=1";
    for (style, expected) in [
        (
            HeaderStyle::Draft11,
            headers(&[("RateLimit-Policy", draft), ("RateLimit", state)]),
        ),
        (
            HeaderStyle::Legacy,
            headers(&[
                ("RateLimit-Limit", "10"),
                ("RateLimit-Remaining", "9"),
                ("RateLimit-Reset", "1"),
            ]),
        ),
        (
            HeaderStyle::Both,
            headers(&[
                ("RateLimit-Policy", draft),
                ("RateLimit", state),
                ("RateLimit-Limit", "10"),
                ("RateLimit-Remaining", "9"),
                ("RateLimit-Reset", "1"),
            ]),
        ),
    ] {
        let server = TestServer::launch(Some(&rows), |c| c.rate_limit_headers = style).await;
        let mut client = server.client().await;
        let r = ask(&mut client, req("acme", "alice")).await;
        assert_eq!(r.headers, expected, "{style:?}");
        // Refused by the user's rule: Retry-After in every style.
        let r = ask(
            &mut client,
            ShouldAllowRequest {
                cost: 10,
                ..req("acme", "alice")
            },
        )
        .await;
        assert!(!r.allowed);
        assert_eq!(r.headers.get("Retry-After").map(String::as_str), Some("1"));
        server.stop().await;
    }
}
