//! Quotas as users run them: `tollgate limits set --quota`, and three
//! instances sharing one quota on Redis and on a Redis Cluster across a
//! period boundary, with clocks injected per instance.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::process::{ServeProcess, stdout, tollgate};
use common::redis::{RedisCluster, RedisServer};
use common::{TestServer, ask, micros, req};
use tollgate::limits::LimitRow;
use tollgate::server::StoreSpec;

fn run(dir: &std::path::Path, args: &[&str]) -> String {
    let out = tollgate(dir, args);
    assert!(
        out.status.success(),
        "tollgate {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout(&out)
}

/// A quota of `count` a day for tenant `tenant`, shared by all its keys.
fn daily(tenant: &str, count: u64) -> LimitRow {
    LimitRow::from_request(
        tenant.into(),
        String::new(),
        "tenant",
        0,
        &format!("{count}/day"),
        "enforce",
        "allow",
        0,
        "quota",
        None,
    )
    .unwrap()
}

/// Midnight UTC, 2023-11-15: the end of the day T0 falls in.
const MIDNIGHT: u64 = 1_700_006_400_000_000;

/// A user sets a daily quota on a plan and spends it: the fourth call of a
/// quota of three is refused until the next UTC midnight.
#[test]
fn a_plan_quota_set_from_the_command_line_is_enforced() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let server = ServeProcess::start(d, &["--reload-interval", "100ms"]);
    server.wait_ready();
    let url = format!("http://{}", server.grpc);
    run(d, &["plans", "create", "pro"]);
    assert_eq!(
        run(d, &["limits", "set", "--plan", "pro", "--quota", "3/day"]),
        "set plan-pro-any-key-quota (quota 3/day)\n"
    );
    run(d, &["plans", "assign", "--tenant", "acme", "--plan", "pro"]);
    let check = |key: &str| {
        run(
            d,
            &["check", "--server", &url, "--tenant", "acme", "--key", key],
        )
    };
    // Applied within the reload interval: wait for the quota to decide.
    let mut first = String::new();
    for _ in 0..400 {
        first = check("alice");
        if first.contains("plan-pro-any-key-quota") {
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    assert!(first.starts_with("ALLOWED"), "{first}");
    assert!(first.contains("remaining 2/3"), "{first}");
    assert!(check("alice").contains("remaining 1/3"));
    assert!(check("alice").contains("remaining 0/3"));
    // Per key: bob has a quota of his own.
    assert!(check("bob").contains("remaining 2/3"));
    #[allow(clippy::disallowed_methods)] // the server runs on the wall clock
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let refused = check("alice");
    #[allow(clippy::disallowed_methods)]
    let after = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(refused.starts_with("REJECTED"), "{refused}");
    // retry_after is the time to the next UTC midnight, as the server saw
    // it between `before` and `after`.
    let retry: f64 = refused
        .split("retry_after ")
        .nth(1)
        .and_then(|r| r.split('s').next())
        .and_then(|r| r.parse().ok())
        .unwrap();
    let midnight = (before / 86_400.0).floor() * 86_400.0 + 86_400.0;
    assert!(
        retry <= midnight - before + 0.001 && retry >= midnight - after - 0.001,
        "retry_after {retry} s; midnight is {} to {} s away",
        midnight - after,
        midnight - before
    );
}

/// Three instances, each with a clock of its own, share one daily quota
/// of 10 through `store`. Across midnight, with the instances' clocks
/// turning it at different moments, each day admits exactly 10.
async fn three_instances_admit_exactly_the_quota_per_day(store: StoreSpec) {
    let rules = [daily("acme", 10)];
    let mut servers = Vec::new();
    for _ in 0..3 {
        let store = store.clone();
        servers.push(
            TestServer::launch(Some(&rules), move |c| {
                c.store = store;
                c.redis_uses_clock = true;
                c.store_timeout = Duration::from_secs(5);
            })
            .await,
        );
    }
    // A burst from all three, each call from each instance, until every
    // instance has been refused: the day's ten and no more.
    async fn day(servers: &[TestServer]) -> u64 {
        let admitted = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for (n, server) in servers.iter().enumerate() {
            let mut client = server.client().await;
            let admitted = admitted.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0..8 {
                    let r = ask(&mut client, req("acme", &format!("k{n}-{i}"))).await;
                    if r.allowed {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        admitted.load(Ordering::Relaxed)
    }
    for s in &servers {
        s.clock.set(MIDNIGHT - 60_000_000);
    }
    assert_eq!(day(&servers).await, 10, "the first day");
    // A refusal waits exactly until midnight.
    let mut client = servers[0].client().await;
    let r = ask(&mut client, req("acme", "late")).await;
    assert!(!r.allowed);
    assert_eq!(micros(&r.retry_after), 60_000_000);
    // One instance turns the day first; the others, a second behind, still
    // name the old day: their decisions count in the new one, never in a
    // second copy of the old.
    servers[0].clock.set(MIDNIGHT + 5);
    servers[1].clock.set(MIDNIGHT - 1_000_000);
    servers[2].clock.set(MIDNIGHT - 1_000_000);
    let mut first = servers[0].client().await;
    assert!(ask(&mut first, req("acme", "early")).await.allowed);
    assert_eq!(day(&servers).await, 9, "the second day, one spent already");
    // The lagging instances are refused until the new day ends; their
    // clock, behind the day counted, is taken as its first instant (as a
    // window takes a clock that stepped back).
    let mut lagging = servers[1].client().await;
    let r = ask(&mut lagging, req("acme", "lagging")).await;
    assert!(!r.allowed);
    assert_eq!(micros(&r.retry_after), 86_400_000_000);
    for s in servers {
        s.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_three_instances_admit_exactly_the_quota_per_day() {
    let redis = RedisServer::start();
    three_instances_admit_exactly_the_quota_per_day(StoreSpec::Redis(redis.url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_three_instances_admit_exactly_the_quota_per_day() {
    let cluster = RedisCluster::start();
    three_instances_admit_exactly_the_quota_per_day(StoreSpec::Redis(cluster.url())).await;
}
