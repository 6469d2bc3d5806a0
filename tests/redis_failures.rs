//! When Redis fails, the limiter must not become the outage. A real
//! redis-server is killed, frozen (SIGSTOP) and restarted under a running
//! Tollgate; each rule's store-unavailable policy decides meanwhile, every
//! answer arrives before the client's deadline, and the service recovers by
//! itself.

use crate::common;

use std::time::Duration;

use common::redis::{RedisServer, free_port};
use common::{TestServer, row};
use tollgate::limits::LimitRow;
use tollgate::proto::v1::rate_limiter_client::RateLimiterClient;
use tollgate::proto::v1::{Degraded, ShouldAllowRequest, ShouldAllowResponse};
use tollgate::server::StoreSpec;
use tonic::transport::Channel;

/// Every call must be answered within this deadline, far above the 100 ms
/// store timeout: a hung Redis must never hang the caller.
const DEADLINE: Duration = Duration::from_secs(3);

/// `row` with its store-unavailable policy set to `policy`.
fn with(mut row: LimitRow, policy: &str) -> LimitRow {
    row.on_store_unavailable = policy.parse().unwrap();
    row
}

fn rules() -> Vec<LimitRow> {
    vec![
        with(row("open", "open", "", "key", 5, "1/hour"), "allow"),
        with(row("closed", "closed", "", "key", 5, "1/hour"), "deny"),
        with(row("local", "local", "", "key", 3, "1/hour"), "local"),
    ]
}

async fn start(redis_url: String) -> TestServer {
    TestServer::launch(Some(&rules()), |c| {
        c.store = StoreSpec::Redis(redis_url);
        c.store_timeout = Duration::from_millis(100);
        c.breaker_threshold = 3;
        c.breaker_cooldown = Duration::from_millis(300);
    })
    .await
}

async fn decide(
    client: &mut RateLimiterClient<Channel>,
    tenant: &str,
    key: &str,
) -> ShouldAllowResponse {
    let mut request = tonic::Request::new(ShouldAllowRequest {
        key: key.into(),
        cost: 1,
        tenant: tenant.into(),
        resource: String::new(),
        dry_run: false,
    });
    request.set_timeout(DEADLINE);
    client
        .should_allow(request)
        .await
        .expect("answered before the deadline")
        .into_inner()
}

/// A decision Redis itself answers, for the steps before and after an
/// outage: on a loaded machine one Redis call can stall past the 100 ms
/// store timeout, and then the rule's policy answers instead. Such an
/// answer is retried (bounded) on a fresh key, `PREFIX-N`, so that an
/// attempt Redis ran after its caller gave up is never counted twice.
/// Returns the answer and the key it was for.
async fn decide_on_redis(
    client: &mut RateLimiterClient<Channel>,
    tenant: &str,
    prefix: &str,
) -> (ShouldAllowResponse, String) {
    for i in 0..20 {
        let key = format!("{prefix}-{i}");
        let r = decide(client, tenant, &key).await;
        if r.degraded() == Degraded::None {
            return (r, key);
        }
    }
    panic!("Redis answered none of 20 decisions for {prefix}");
}

/// What a bucket holds, as Redis answers a dry run (retried, bounded, while
/// a stall makes the policy answer: a dry run spends nothing, so a retry
/// reads the same bucket).
async fn dry_run_on_redis(
    client: &mut RateLimiterClient<Channel>,
    tenant: &str,
    key: &str,
) -> ShouldAllowResponse {
    for _ in 0..20 {
        let mut request = tonic::Request::new(ShouldAllowRequest {
            key: key.into(),
            cost: 1,
            tenant: tenant.into(),
            resource: String::new(),
            dry_run: true,
        });
        request.set_timeout(DEADLINE);
        let r = client.should_allow(request).await.unwrap().into_inner();
        if r.degraded() == Degraded::None {
            return r;
        }
    }
    panic!("Redis answered none of 20 dry runs for {key}");
}

/// The decisions every policy gives while the store is unreachable.
async fn assert_degraded_decisions(client: &mut RateLimiterClient<Channel>, key: &str) {
    for _ in 0..10 {
        let r = decide(client, "open", key).await;
        assert!(r.allowed, "fail open admits");
        assert_eq!(r.degraded(), Degraded::FailedOpen);
        assert_eq!(r.limit_name, "open");

        let r = decide(client, "closed", key).await;
        assert!(!r.allowed, "fail closed rejects");
        assert_eq!(r.degraded(), Degraded::FailedClosed);
        assert_eq!(
            common::micros(&r.retry_after),
            300_000,
            "retry after the breaker's cooldown"
        );
        assert_eq!(r.headers["Retry-After"], "1");
    }
    // Local: this instance's own bucket of 3.
    for i in 0..5 {
        let r = decide(client, "local", key).await;
        assert_eq!(r.degraded(), Degraded::Local);
        assert_eq!(r.allowed, i < 3, "local request {i}");
        assert_eq!(r.limit, 3);
    }
}

/// Polls (bounded) until decisions are made by Redis again.
async fn wait_recovered(client: &mut RateLimiterClient<Channel>) -> ShouldAllowResponse {
    for i in 0..200 {
        let r = decide(client, "open", &format!("recovery-{i}")).await;
        if r.degraded() == Degraded::None {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the service did not recover after Redis came back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_then_restarted() {
    let mut redis = RedisServer::start();
    let server = start(redis.url()).await;
    let mut client = server.client().await;
    let (r, _) = decide_on_redis(&mut client, "closed", "before").await;
    assert!(r.allowed);
    assert_eq!(r.remaining, 4);

    redis.kill();
    assert_degraded_decisions(&mut client, "during-kill").await;

    redis.restart();
    let r = wait_recovered(&mut client).await;
    assert!(r.allowed);
    let (r, _) = decide_on_redis(&mut client, "closed", "after").await;
    assert_eq!((r.allowed, r.remaining), (true, 4));

    let (_, metrics) = server.http_get("/metrics").await.unwrap();
    for outcome in ["failed_open", "failed_closed", "local_fallback"] {
        assert!(
            metrics.contains(&format!("outcome=\"{outcome}\"")),
            "{outcome} counted: {metrics}"
        );
    }
    assert!(
        metrics.contains("tollgate_store_errors_total{store=\"redis\""),
        "{metrics}"
    );
    assert_eq!(
        common::envoy::sample(&metrics, "tollgate_store_circuit_state{store=\"redis\"}"),
        Some(0),
        "closed again: {metrics}"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_frozen_then_thawed() {
    let redis = RedisServer::start();
    let server = start(redis.url()).await;
    let mut client = server.client().await;
    let (_, before) = decide_on_redis(&mut client, "open", "before").await;

    redis.freeze();
    assert_degraded_decisions(&mut client, "during-freeze").await;
    let (_, metrics) = server.http_get("/metrics").await.unwrap();
    assert!(
        metrics.contains("tollgate_store_errors_total{store=\"redis\",kind=\"timeout\"}"),
        "{metrics}"
    );

    redis.thaw();
    let r = wait_recovered(&mut client).await;
    assert!(r.allowed);
    // The bucket written before the freeze is still there: 4 held, 3 after
    // one more.
    let r = dry_run_on_redis(&mut client, "open", &before).await;
    assert_eq!(r.remaining, 3);
    server.stop().await;
}

/// Readiness follows the store's first answer, not the next readiness
/// ping: once a decision has reached Redis, /readyz says ready at once
/// (the ping's backoff has grown to seconds by the time Redis starts here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_as_soon_as_a_decision_reaches_redis() {
    let port = free_port(false);
    let server = TestServer::launch_unready(Some(&rules()), |c| {
        c.store = StoreSpec::Redis(format!("redis://127.0.0.1:{port}"));
        c.store_timeout = Duration::from_millis(500);
        c.breaker_cooldown = Duration::from_millis(50);
    })
    .await;
    let mut client = server.client().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(server.http_get("/readyz").await.unwrap().0, 503);

    let _redis = RedisServer::start_on(port);
    let mut reached = false;
    for _ in 0..1000 {
        if decide(&mut client, "open", "k").await.degraded() == Degraded::None {
            reached = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(reached, "no decision reached Redis");
    assert_eq!(server.http_get("/readyz").await.unwrap().0, 200);
    let (_, status) = server.http_get("/v1/status").await.unwrap();
    assert!(status.contains("\"ready\":true"), "{status}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_before_redis_is_reachable_and_becomes_ready_when_it_is() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;

    let port = free_port(false);
    let server = TestServer::launch_unready(Some(&rules()), |c| {
        c.store = StoreSpec::Redis(format!("redis://127.0.0.1:{port}"));
        c.store_timeout = Duration::from_millis(100);
        c.breaker_cooldown = Duration::from_millis(200);
    })
    .await;
    let mut health = HealthClient::new(server.channel().await);
    let status = |service: &str| HealthCheckRequest {
        service: service.into(),
    };
    assert_eq!(server.http_get("/readyz").await.unwrap().0, 503);
    for service in ["", "tollgate.v1.RateLimiter"] {
        let s = health
            .check(status(service))
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(
            s,
            ServingStatus::NotServing as i32,
            "{service:?} not serving yet"
        );
    }
    // Decisions already work, by policy.
    let mut client = server.client().await;
    assert_eq!(
        decide(&mut client, "open", "early").await.degraded(),
        Degraded::FailedOpen
    );

    let _redis = RedisServer::start_on(port);
    server.wait_ready().await;
    let s = health
        .check(status("tollgate.v1.RateLimiter"))
        .await
        .unwrap()
        .into_inner()
        .status;
    assert_eq!(s, ServingStatus::Serving as i32);
    let r = wait_recovered(&mut client).await;
    assert!(r.allowed);
    server.stop().await;
}

/// While Redis is down, a `local` rule allows `--local-fraction` of its
/// limit per instance; and a request that meets a `deny` rule beside a
/// `local` one is refused whole, without spending a local bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_fraction_and_a_deny_rule_beside_a_local_one_during_an_outage() {
    let rules = [
        with(row("local-10", "local", "", "key", 10, "1/hour"), "local"),
        with(row("mixed-key", "mixed", "", "key", 10, "1/hour"), "local"),
        with(
            row("mixed-all", "mixed", "", "tenant", 100, "1/hour"),
            "deny",
        ),
    ];
    let mut redis = RedisServer::start();
    let url = redis.url();
    let server = TestServer::launch(Some(&rules), move |c| {
        c.store = StoreSpec::Redis(url);
        c.store_timeout = Duration::from_millis(100);
        c.local_fraction = 0.5;
    })
    .await;
    server.wait_ready().await;
    let mut client = server.client().await;
    redis.kill();
    let buckets = || async {
        let (_, metrics) = server.http_get("/metrics").await.unwrap();
        common::envoy::sample(&metrics, "tollgate_buckets").unwrap()
    };

    // The deny rule beside the local one refuses the request whole, and no
    // local bucket comes into being for it.
    for _ in 0..5 {
        let r = decide(&mut client, "mixed", "k").await;
        assert!(!r.allowed);
        assert_eq!(r.degraded(), Degraded::FailedClosed);
        assert_eq!(r.limit_name, "mixed-all");
    }
    assert_eq!(buckets().await, 0, "a refused request spent a local bucket");

    // Half of 10 per instance: exactly 5 admitted.
    let admitted = {
        let mut n = 0;
        for _ in 0..8 {
            let r = decide(&mut client, "local", "k").await;
            assert_eq!(r.degraded(), Degraded::Local);
            n += u32::from(r.allowed);
        }
        n
    };
    assert_eq!(admitted, 5);
    assert_eq!(buckets().await, 1);
    server.stop().await;
}

/// Once the breaker opens, decisions skip Redis altogether until its
/// cooldown ends: with a threshold of 3 and Redis frozen, exactly 3 of 10
/// decisions are sent (and time out) and the other 7 are answered by their
/// policy at once, counted as `circuit_open`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_breaker_skips_redis_end_to_end() {
    let redis = RedisServer::start();
    let url = redis.url();
    let server = TestServer::launch(Some(&rules()), move |c| {
        c.store = StoreSpec::Redis(url);
        c.store_timeout = Duration::from_millis(100);
        c.breaker_threshold = 3;
        c.breaker_cooldown = Duration::from_secs(60);
    })
    .await;
    server.wait_ready().await;
    let mut client = server.client().await;
    decide_on_redis(&mut client, "open", "warm").await;
    let count = |metrics: &str, series: &str| common::envoy::sample(metrics, series).unwrap_or(0);

    redis.freeze();
    for i in 0..10 {
        let r = decide(&mut client, "open", &format!("k{i}")).await;
        assert_eq!(r.degraded(), Degraded::FailedOpen);
    }
    let (_, metrics) = server.http_get("/metrics").await.unwrap();
    assert_eq!(
        count(&metrics, "tollgate_store_decisions_total{store=\"redis\"}"),
        4,
        "{metrics}"
    );
    assert_eq!(
        count(
            &metrics,
            "tollgate_store_errors_total{store=\"redis\",kind=\"timeout\"}"
        ),
        3,
        "{metrics}"
    );
    assert_eq!(
        count(
            &metrics,
            "tollgate_store_errors_total{store=\"redis\",kind=\"circuit_open\"}"
        ),
        7,
        "{metrics}"
    );
    assert_eq!(
        count(&metrics, "tollgate_store_circuit_state{store=\"redis\"}"),
        1,
        "open"
    );
    redis.thaw();
    server.stop().await;
}

/// A Redis Cluster node killed under load and started again: no call fails,
/// decisions follow their policies while it is gone, and every tenant is
/// decided by the cluster again afterwards, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_node_killed_under_load_and_back() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let mut cluster = common::redis::RedisCluster::start();
    let url = cluster.url();
    let server = TestServer::launch(Some(&rules()), move |c| {
        c.store = StoreSpec::Redis(url);
        c.store_timeout = Duration::from_millis(100);
        c.breaker_cooldown = Duration::from_millis(200);
    })
    .await;
    server.wait_ready().await;
    let (degraded, decided, stop) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicBool::new(false)),
    );
    let mut load = Vec::new();
    for w in 0..4 {
        let mut client = server.client().await;
        let (degraded, decided, stop) = (degraded.clone(), decided.clone(), stop.clone());
        load.push(tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                // `decide` panics on any error or on a call past the deadline.
                let r = decide(&mut client, "open", &format!("w{w}-{}", i % 20)).await;
                decided.fetch_add(1, Ordering::Relaxed);
                if r.degraded() != Degraded::None {
                    degraded.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Kill the node that holds tenant "open"'s slot.
    let slot: u16 =
        common::redis::redis_cli(cluster.nodes[0].port, &["CLUSTER", "KEYSLOT", "{open}"])
            .trim()
            .parse()
            .unwrap();
    let owner = cluster
        .nodes
        .iter()
        .position(|n| {
            let nodes = common::redis::redis_cli(n.port, &["CLUSTER", "NODES"]);
            let me = nodes.lines().find(|l| l.contains("myself")).unwrap().to_owned();
            me.split_whitespace().skip(8).any(|range| {
                let (a, b) = range.split_once('-').unwrap_or((range, range));
                matches!((a.parse::<u16>(), b.parse::<u16>()), (Ok(a), Ok(b)) if (a..=b).contains(&slot))
            })
        })
        .expect("a node holds the slot");
    cluster.nodes[owner].kill();
    let before = degraded.load(Ordering::Relaxed);
    let mut saw_outage = false;
    for _ in 0..300 {
        if degraded.load(Ordering::Relaxed) > before {
            saw_outage = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(saw_outage, "no decision was degraded with a node gone");
    cluster.nodes[owner].restart();
    let mut client = server.client().await;
    let mut recovered = false;
    for i in 0..600 {
        // Keys spread over every node's slots (tenants are the hash tags).
        let mut all = true;
        for tenant in ["open", "closed", "local"] {
            let r = decide(&mut client, tenant, &format!("after-{i}")).await;
            all &= r.degraded() == Degraded::None;
        }
        if all {
            recovered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for task in load {
        task.await.expect("no call failed");
    }
    assert!(
        recovered,
        "the cluster never decided again after the node came back"
    );
    assert!(decided.load(Ordering::Relaxed) > degraded.load(Ordering::Relaxed));
    server.stop().await;
}

/// A call that reaches Redis after its caller was answered by policy
/// applies nothing: it carries its deadline on Redis's own clock. With a
/// `deny` rule and the Redis holding the tenant frozen, three decisions of
/// cost 10, a reserve of 10 and a charge of 10 are each answered by policy
/// while their script calls wait in the socket; after the thaw Redis runs
/// all five (its EVALSHA count shows it) and the bucket still holds all
/// 100 tokens, with no reservation record written.
async fn late_calls_apply_nothing(url: String, node: &RedisServer) {
    let rules = [with(
        row("closed", "closed", "", "key", 100, "1/hour"),
        "deny",
    )];
    let server = TestServer::launch(Some(&rules), move |c| {
        c.store = StoreSpec::Redis(url);
        c.store_timeout = Duration::from_millis(100);
        // Every call is sent, none refused by an open breaker.
        c.breaker_threshold = 1_000;
    })
    .await;
    server.wait_ready().await;
    let mut client = server.client().await;
    // The script loaded and the node's clock learnt.
    decide_on_redis(&mut client, "closed", "warm").await;
    let sent_before = common::redis::evalsha_calls(node.port);

    node.freeze();
    for _ in 0..3 {
        let mut request = tonic::Request::new(ShouldAllowRequest {
            cost: 10,
            ..common::req("closed", "victim")
        });
        request.set_timeout(DEADLINE);
        let r = client.should_allow(request).await.unwrap().into_inner();
        assert_eq!(
            (r.allowed, r.degraded()),
            (false, Degraded::FailedClosed),
            "{r:?}"
        );
    }
    let reserved = client
        .reserve(tollgate::proto::v1::ReserveRequest {
            key: "victim".into(),
            estimate: 10,
            tenant: "closed".into(),
            resource: String::new(),
            ttl: None,
        })
        .await
        .unwrap()
        .into_inner();
    let decision = reserved.decision.unwrap();
    assert_eq!(
        (decision.allowed, decision.degraded()),
        (false, Degraded::FailedClosed)
    );
    assert_eq!(reserved.reservation, "", "nothing to settle");
    let charged = client
        .charge(tollgate::proto::v1::ChargeRequest {
            key: "victim".into(),
            cost: 10,
            tenant: "closed".into(),
            resource: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (charged.forgiven, charged.degraded()),
        (10, Degraded::FailedClosed),
        "not recorded anywhere"
    );

    node.thaw();
    assert_eq!(
        common::redis::wait_evalsha_calls(node.port, sent_before, 5),
        5,
        "Redis ran the five late calls after the thaw"
    );
    assert_eq!(
        common::redis::redis_cli(node.port, &["GET", "tollgate:{closed}:k::victim"]),
        "",
        "the bucket was never written"
    );
    assert_eq!(
        common::redis::redis_cli(node.port, &["KEYS", "tollgate:{closed}:r:*"]),
        "",
        "no reservation record"
    );
    let r = dry_run_on_redis(&mut client, "closed", "victim").await;
    assert_eq!((r.allowed, r.remaining), (true, 99), "all 100 tokens held");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_redis_runs_after_its_caller_was_answered_applies_nothing() {
    let redis = RedisServer::start();
    late_calls_apply_nothing(redis.url(), &redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_a_cluster_node_runs_after_its_caller_was_answered_applies_nothing() {
    let cluster = common::redis::RedisCluster::start();
    let owner = cluster.owner(cluster.slot_of("closed")).unwrap();
    late_calls_apply_nothing(cluster.url(), &cluster.nodes[owner]).await;
}
