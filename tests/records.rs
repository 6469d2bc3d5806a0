//! Reservation records have a bound of their own, shared fairly between
//! tenants: one tenant's many reservations never keep another tenant's
//! buckets (or its own fair share of records) out. In memory they are
//! counted apart from buckets; on Redis, `--max-records-per-tenant` caps
//! each tenant's records in the script.

use crate::common;

use std::time::Duration;

use common::redis::{RedisServer, redis_cli};
use common::{TestServer, ask, req, row};
use tollgate::proto::v1::rate_limiter_client::RateLimiterClient;
use tollgate::proto::v1::{Degraded, ReserveRequest, ReserveResponse, SettleRequest};
use tollgate::server::StoreSpec;
use tonic::Code;
use tonic::transport::Channel;

fn rules() -> Vec<tollgate::limits::LimitRow> {
    let mut hourly = row("hourly", "other", "", "key", 5, "5/hour");
    hourly.on_store_unavailable = "allow".parse().unwrap();
    vec![
        row("greedy", "greedy", "", "key", 100_000, "1/hour"),
        row("fair", "fair", "", "key", 100_000, "1/hour"),
        hourly,
    ]
}

async fn reserve(
    client: &mut RateLimiterClient<Channel>,
    tenant: &str,
    key: &str,
) -> Result<ReserveResponse, tonic::Status> {
    client
        .reserve(ReserveRequest {
            key: key.into(),
            estimate: 1,
            tenant: tenant.into(),
            resource: String::new(),
            ttl: None,
        })
        .await
        .map(|r| r.into_inner())
}

/// The case that once failed open: in memory with room for 1 000 buckets,
/// one key's reservations (well within its own burst) filled the bucket
/// cap, and from then on every new key of every tenant got its
/// store-unavailable answer (a 5-per-hour rule failing open admitted 20 of
/// 20). Now records have their own room: the greedy tenant is stopped at
/// its fair share, half of it, with RESOURCE_EXHAUSTED naming the bound;
/// another tenant's 5-per-hour key admits exactly 5 of 20, decided by the
/// store; and a third tenant still finds its own share of records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenants_reservations_never_keep_out_other_tenants_buckets_or_records() {
    let server = TestServer::launch(Some(&rules()), |c| {
        c.max_buckets = 1_000;
        c.max_records = 1_000;
    })
    .await;
    let mut client = server.client().await;
    let mut granted = 0;
    let refused = loop {
        match reserve(&mut client, "greedy", "one-key").await {
            Ok(r) => {
                assert!(!r.reservation.is_empty(), "{r:?}");
                granted += 1;
                assert!(granted <= 1_200, "never refused");
            }
            Err(status) => break status,
        }
    };
    assert_eq!(
        granted, 500,
        "a tenant alone holds at most half the records"
    );
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert!(
        refused.message().contains("tenant \"greedy\" holds 500")
            && refused.message().contains("fair share of 500")
            && refused.message().contains("--max-records"),
        "{}",
        refused.message()
    );

    // Buckets of other tenants are untouched by the records: decided by
    // the store, not by a policy.
    let mut admitted = 0;
    for _ in 0..20 {
        let r = ask(&mut client, req("other", "k")).await;
        assert_eq!(r.degraded(), Degraded::None, "{r:?}");
        admitted += u32::from(r.allowed);
    }
    assert_eq!(admitted, 5, "the 5-per-hour rule admits exactly 5");
    for i in 0..900 {
        let r = ask(&mut client, req("other", &format!("new-{i}"))).await;
        assert_eq!(
            (r.allowed, r.degraded()),
            (true, Degraded::None),
            "new key {i}"
        );
    }

    // A second tenant gets its share of what is left: a third of the cap.
    let mut fair = 0;
    while reserve(&mut client, "fair", "k").await.is_ok() {
        fair += 1;
        assert!(fair <= 1_000);
    }
    assert_eq!(fair, 333);
    // Settling frees nothing early (a settled record is kept to answer a
    // repeated settle) but spends nothing more either: the refusal above
    // took no token.
    let (_, metrics) = server.http_get("/metrics").await.unwrap();
    assert_eq!(
        common::envoy::sample(
            &metrics,
            "tollgate_store_errors_total{store=\"memory\",kind=\"too_many_records\"}"
        ),
        Some(2),
        "{metrics}"
    );
    server.stop().await;
}

/// On Redis, `--max-records-per-tenant` bounds what one tenant's records
/// take of Redis: the 51st open reservation of a tenant capped at 50 is
/// refused with RESOURCE_EXHAUSTED and spends nothing, another tenant is
/// not touched, and the set that counts them expires with its records.
async fn redis_caps_records_per_tenant(url: String, port_of: impl Fn(&str) -> u16) {
    let server = TestServer::launch(Some(&rules()), move |c| {
        c.store = StoreSpec::Redis(url);
        c.store_timeout = Duration::from_secs(2);
        c.max_records_per_tenant = Some(50);
    })
    .await;
    server.wait_ready().await;
    let mut client = server.client().await;
    let mut tokens = Vec::new();
    for i in 0..50 {
        let r = reserve(&mut client, "greedy", "k").await.unwrap();
        let decision = r.decision.unwrap();
        assert_eq!(
            (decision.allowed, decision.degraded()),
            (true, Degraded::None),
            "reserve {i}"
        );
        tokens.push(r.reservation);
    }
    let refused = reserve(&mut client, "greedy", "k").await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert!(
        refused.message().contains("tenant \"greedy\" holds 50")
            && refused.message().contains("the cap of 50 per tenant"),
        "{}",
        refused.message()
    );
    let port = port_of("greedy");
    assert_eq!(redis_cli(port, &["ZCARD", "tollgate:{greedy}:rq::"]), "50");
    let ttl: i64 = redis_cli(port, &["PTTL", "tollgate:{greedy}:rq::"])
        .parse()
        .unwrap();
    assert!(
        ttl > 600_000 && ttl <= 661_001 + 1_000,
        "the set lives as long as its records (ttl 1 min + 10 min): {ttl}"
    );
    // The refused reserve spent nothing: 50 of 100 000 spent.
    let dry = ask(
        &mut client,
        tollgate::proto::v1::ShouldAllowRequest {
            dry_run: true,
            ..req("greedy", "k")
        },
    )
    .await;
    assert_eq!(dry.remaining, 100_000 - 51);
    // A settled record still counts until it is gone.
    client
        .settle(SettleRequest {
            reservation: tokens[0].clone(),
            actual: 1,
        })
        .await
        .unwrap();
    assert_eq!(
        reserve(&mut client, "greedy", "k")
            .await
            .unwrap_err()
            .code(),
        Code::ResourceExhausted
    );
    // Another tenant has its own 50.
    for _ in 0..50 {
        let r = reserve(&mut client, "fair", "k").await.unwrap();
        assert!(r.decision.unwrap().allowed);
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_caps_each_tenants_records() {
    let redis = RedisServer::start();
    let port = redis.port;
    redis_caps_records_per_tenant(redis.url(), move |_| port).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_caps_each_tenants_records() {
    let cluster = common::redis::RedisCluster::start();
    let ports: Vec<u16> = cluster.nodes.iter().map(|n| n.port).collect();
    let owner = |tenant: &str| ports[cluster.owner(cluster.slot_of(tenant)).unwrap()];
    redis_caps_records_per_tenant(cluster.url(), owner).await;
}
