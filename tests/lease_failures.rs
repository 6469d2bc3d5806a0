//! Concurrency caps while Redis fails: a real redis-server killed (with an
//! append-only file, so it comes back with what it held) and frozen
//! (SIGSTOP) under a running Tollgate. Each rule's store-unavailable policy
//! answers; a lease taken locally lives in memory only, and an acquire that
//! reaches Redis after its caller was answered takes nothing there, so no
//! lease is ever counted twice once Redis returns.

use crate::common;

use std::time::Duration;

use common::TestServer;
use common::redis::{RedisServer, redis_cli};
use tollgate::limits::LimitRow;
use tollgate::proto::v1::rate_limiter_client::RateLimiterClient;
use tollgate::proto::v1::{
    AcquireRequest, AcquireResponse, Degraded, LeaseStatus, ReleaseRequest, RenewRequest,
};
use tollgate::server::StoreSpec;
use tonic::Code;
use tonic::transport::Channel;

const DEADLINE: Duration = Duration::from_secs(3);

fn cap(tenant: &str, policy: &str) -> LimitRow {
    LimitRow::from_request(
        tenant.into(),
        String::new(),
        "tenant",
        2,
        "",
        "enforce",
        policy,
        0,
        "concurrency",
        Some(format!("{tenant}-slots")),
    )
    .unwrap()
}

async fn start(redis_url: String) -> TestServer {
    TestServer::launch(
        Some(&[
            cap("open", "allow"),
            cap("closed", "deny"),
            cap("local", "local"),
        ]),
        |c| {
            c.store = StoreSpec::Redis(redis_url);
            c.store_timeout = Duration::from_millis(100);
            c.breaker_threshold = 3;
            c.breaker_cooldown = Duration::from_millis(300);
        },
    )
    .await
}

async fn acquire(client: &mut RateLimiterClient<Channel>, tenant: &str) -> AcquireResponse {
    let mut request = tonic::Request::new(AcquireRequest {
        key: "job".into(),
        tenant: tenant.into(),
        resource: String::new(),
        ttl: Some(prost_types::Duration {
            seconds: 600,
            nanos: 0,
        }),
        cost: 0,
    });
    request.set_timeout(DEADLINE);
    client.acquire(request).await.unwrap().into_inner()
}

async fn release(
    client: &mut RateLimiterClient<Channel>,
    lease: &str,
) -> Result<LeaseStatus, tonic::Status> {
    let mut request = tonic::Request::new(ReleaseRequest {
        lease: lease.into(),
    });
    request.set_timeout(DEADLINE);
    client
        .release(request)
        .await
        .map(|r| LeaseStatus::try_from(r.into_inner().status).unwrap())
}

fn degraded(a: &AcquireResponse) -> Degraded {
    Degraded::try_from(a.decision.as_ref().unwrap().degraded).unwrap()
}

fn held(redis: &RedisServer, tenant: &str) -> String {
    redis_cli(
        redis.port,
        &["ZCARD", &format!("tollgate:{{{tenant}}}:tc::")],
    )
}

/// Acquires on `tenant` until Redis itself answers (the breaker closed).
async fn acquire_on_redis(
    client: &mut RateLimiterClient<Channel>,
    tenant: &str,
) -> AcquireResponse {
    for _ in 0..300 {
        let a = acquire(client, tenant).await;
        if degraded(&a) == Degraded::None {
            return a;
        }
        if !a.lease.is_empty() {
            release(client, &a.lease).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("Redis never answered again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_each_policy_answers_and_nothing_is_counted_twice() {
    let mut redis = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let server = start(redis.url()).await;
    let mut client = server.client().await;
    let mut before = Vec::new();
    for tenant in ["open", "closed", "local"] {
        let a = acquire(&mut client, tenant).await;
        assert!(a.granted && !a.lease.is_empty());
        assert_eq!(degraded(&a), Degraded::None);
        before.push(a.lease);
        assert_eq!(held(&redis, tenant), "1");
    }

    redis.kill();
    // allow: admitted, holding nothing.
    let open = acquire(&mut client, "open").await;
    assert!(open.granted);
    assert_eq!(degraded(&open), Degraded::FailedOpen);
    assert_eq!(open.lease, "", "fail-open holds no lease");
    // deny: refused.
    let closed = acquire(&mut client, "closed").await;
    assert!(!closed.granted);
    assert_eq!(degraded(&closed), Degraded::FailedClosed);
    // local: this instance's own cap of two, in memory.
    let mut local = Vec::new();
    for _ in 0..2 {
        let a = acquire(&mut client, "local").await;
        assert!(a.granted);
        assert_eq!(degraded(&a), Degraded::Local);
        assert!(a.lease.starts_with("l1."));
        local.push(a.lease);
    }
    let third = acquire(&mut client, "local").await;
    assert!(!third.granted, "the local cap is full");
    assert_eq!(degraded(&third), Degraded::Local);
    // A local lease is released and renewed in memory while Redis is down.
    assert_eq!(
        release(&mut client, &local[0]).await.unwrap(),
        LeaseStatus::Done
    );
    let mut renew = tonic::Request::new(RenewRequest {
        lease: local[1].clone(),
        ttl: Some(prost_types::Duration {
            seconds: 30,
            nanos: 0,
        }),
    });
    renew.set_timeout(DEADLINE);
    let renewed = client.renew(renew).await.unwrap().into_inner();
    assert_eq!(renewed.ttl.map(|d| (d.seconds, d.nanos)), Some((30, 0)));
    assert!(
        acquire(&mut client, "local").await.granted,
        "its slot is free again"
    );
    assert!(
        !acquire(&mut client, "local").await.granted,
        "the renewed lease still holds its slot: the cap of two is full"
    );
    // A lease held in Redis cannot be released while Redis is down: the
    // caller is told, and the lease expires at its ttl.
    let err = release(&mut client, &before[2]).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");

    redis.restart();
    acquire_on_redis(&mut client, "closed").await;
    // Redis came back with what it held before the outage, and nothing
    // taken meanwhile: local leases live in memory only, fail-open ones
    // nowhere.
    assert_eq!(held(&redis, "open"), "1");
    assert_eq!(held(&redis, "closed"), "2", "the one before, and the probe");
    assert_eq!(held(&redis, "local"), "1");
    assert_eq!(
        release(&mut client, &before[2]).await.unwrap(),
        LeaseStatus::Done
    );
    assert_eq!(held(&redis, "local"), "0");
    // The local leases are still released where they live.
    assert_eq!(
        release(&mut client, &local[1]).await.unwrap(),
        LeaseStatus::Done
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_frozen_a_late_acquire_takes_nothing_there() {
    let redis = RedisServer::start();
    let server = start(redis.url()).await;
    let mut client = server.client().await;
    let first = acquire(&mut client, "local").await;
    assert_eq!(degraded(&first), Degraded::None);
    assert_eq!(held(&redis, "local"), "1");
    let sent_before = common::redis::evalsha_calls(redis.port);

    redis.freeze();
    // The acquires are sent, then time out: the local policy grants one in
    // memory, the others answer by their policies.
    let late = acquire(&mut client, "local").await;
    assert!(late.granted);
    assert_eq!(degraded(&late), Degraded::Local);
    let open = acquire(&mut client, "open").await;
    assert_eq!(degraded(&open), Degraded::FailedOpen);
    let closed = acquire(&mut client, "closed").await;
    assert_eq!(degraded(&closed), Degraded::FailedClosed);
    redis.thaw();

    // Thawed, Redis runs the three acquires it had received, each past its
    // deadline: none takes a slot.
    assert_eq!(
        common::redis::wait_evalsha_calls(redis.port, sent_before, 3),
        3,
        "the late acquires reached Redis"
    );
    assert_eq!(
        held(&redis, "local"),
        "1",
        "only the first lease is in Redis"
    );
    acquire_on_redis(&mut client, "closed").await;
    // The local lease is released once, from memory.
    assert_eq!(
        release(&mut client, &late.lease).await.unwrap(),
        LeaseStatus::Done
    );
    assert_eq!(
        release(&mut client, &late.lease).await.unwrap(),
        LeaseStatus::AlreadyReleased
    );
    assert_eq!(
        release(&mut client, &first.lease).await.unwrap(),
        LeaseStatus::Done
    );
    assert_eq!(held(&redis, "local"), "0");
}
