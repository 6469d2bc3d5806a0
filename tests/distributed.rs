//! One truth across instances: three `tollgate serve` processes share one
//! Redis (and, again, a 3-node Redis Cluster), a client sprays concurrent
//! requests across all three, and together they admit exactly what a single
//! bucket admits.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::process::{ServeProcess, tollgate};
use common::redis::{RedisCluster, RedisServer};
use common::refill;
use tokio::time::Instant;
use tollgate::proto::v1::rate_limiter_client::RateLimiterClient;
use tollgate::proto::v1::{
    BatchItem, ReserveRequest, SettleRequest, ShouldAllowBatchRequest, ShouldAllowRequest,
};

struct Fleet {
    instances: Vec<ServeProcess>,
    _dirs: Vec<tempfile::TempDir>,
}

/// Three instances on `store`, each with its own limits table holding the
/// same rules (`limits set` arguments).
fn fleet(store: &str, rules: &[&[&str]]) -> Fleet {
    fleet_with(store, rules, &[])
}

/// [`fleet`], each instance started with `extra` arguments too.
fn fleet_with(store: &str, rules: &[&[&str]], extra: &[&str]) -> Fleet {
    let mut instances = Vec::new();
    let mut dirs = Vec::new();
    for _ in 0..3 {
        let dir = tempfile::tempdir().unwrap();
        for rule in rules {
            let mut args = vec!["limits", "set", "--create"];
            args.extend_from_slice(rule);
            let out = tollgate(dir.path(), &args);
            assert!(out.status.success(), "{out:?}");
        }
        let mut args = vec!["--store", store, "--store-timeout", "2s"];
        args.extend_from_slice(extra);
        instances.push(ServeProcess::start(dir.path(), &args));
        dirs.push(dir);
    }
    Fleet {
        instances,
        _dirs: dirs,
    }
}

/// Sends `per_loop` requests from `loops` concurrent loops per instance.
/// `key_of(i)` names the key of request i. Returns (admitted, elapsed µs
/// from the first send to the last answer, µs from the first answer to the
/// last send).
async fn spray(
    fleet: &Fleet,
    tenant: &str,
    loops: usize,
    per_loop: usize,
    key_of: fn(usize) -> String,
) -> (u64, u64, u64) {
    let admitted = Arc::new(AtomicU64::new(0));
    let first_answer = Arc::new(parking_lot::Mutex::new(None::<Instant>));
    let last_send = Arc::new(parking_lot::Mutex::new(None::<Instant>));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (n, instance) in fleet.instances.iter().enumerate() {
        for l in 0..loops {
            let url = format!("http://{}", instance.grpc);
            let (admitted, first_answer, last_send) =
                (admitted.clone(), first_answer.clone(), last_send.clone());
            let tenant = tenant.to_owned();
            tasks.push(tokio::spawn(async move {
                let mut client = RateLimiterClient::connect(url).await.unwrap();
                for i in 0..per_loop {
                    let request = ShouldAllowRequest {
                        key: key_of((n * loops + l) * per_loop + i),
                        cost: 1,
                        tenant: tenant.clone(),
                        resource: String::new(),
                        dry_run: false,
                    };
                    *last_send.lock() = Some(Instant::now());
                    let r = client.should_allow(request).await.unwrap().into_inner();
                    first_answer.lock().get_or_insert_with(Instant::now);
                    assert_eq!(r.degraded, 0, "decided by Redis");
                    if r.allowed {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    let outer = started.elapsed().as_micros() as u64;
    let inner = last_send
        .lock()
        .unwrap()
        .saturating_duration_since(first_answer.lock().unwrap())
        .as_micros() as u64;
    (admitted.load(Ordering::Relaxed), outer, inner)
}

async fn one_key_admits_exactly_its_burst(store: &str) {
    let f = fleet(
        store,
        &[&["--tenant", "dist", "--burst", "200", "--rate", "1/hour"]],
    );
    let (admitted, _, _) = spray(&f, "dist", 4, 100, |_| "hot".into()).await;
    // 1,200 requests across three instances; one token per hour of refill.
    assert_eq!(admitted, 200);
}

async fn a_tenant_ceiling_is_shared_by_all_keys_and_instances(store: &str) {
    let f = fleet(
        store,
        &[&[
            "--tenant", "ceil", "--scope", "tenant", "--burst", "100", "--rate", "1/hour",
        ]],
    );
    let (admitted, _, _) = spray(&f, "ceil", 4, 50, |i| format!("key-{i}")).await;
    assert_eq!(admitted, 100, "600 requests from 600 keys");
}

async fn with_refill_never_more_than_burst_plus_rate_times_elapsed(store: &str) {
    // 100/second: one token every 10 ms.
    let f = fleet(
        store,
        &[&["--tenant", "flow", "--burst", "50", "--rate", "100/second"]],
    );
    refills_within_bounds(&f, "flow", 50, 1, |_| "hot".into()).await;
}

/// Sprays `tenant` (burst `burst`, 100/second) and checks the admissions
/// against what the refill allows: never more than burst + rate × elapsed,
/// and, measured where no refill can be lost to a full bucket, the refills
/// at the full rate, within `slack` tokens.
async fn refills_within_bounds(
    f: &Fleet,
    tenant: &str,
    burst: u64,
    slack: u64,
    key_of: fn(usize) -> String,
) {
    let (admitted, outer, _) = spray(f, tenant, 4, 250, key_of).await;
    // Redis decided every request between the first send and the last
    // answer, so at most burst + elapsed / interval can have been admitted.
    let most = burst + outer / 10_000;
    eprintln!("admitted {admitted}; at most {most} in {outer} µs");
    assert!(
        admitted <= most,
        "overshoot: {admitted} admitted, at most {most} allowed in {outer} µs"
    );
    refills_at_the_full_rate(f, tenant, burst, slack, key_of).await;
}

/// Empties the bucket through one instance, waits 300 ms (30 refills at
/// 100/second, fewer than the burst), and empties it again: the second
/// drain admits one token per 10 ms of the span between the refusals,
/// within `slack` (under one token held at each refusal; with slices, a
/// slice more, since an instance waits for a whole slice). A limiter
/// refilling at half the rate admits 15 where this asks for about 30.
async fn refills_at_the_full_rate(
    f: &Fleet,
    tenant: &str,
    burst: u64,
    slack: u64,
    key_of: fn(usize) -> String,
) {
    let url = format!("http://{}", f.instances[0].grpc);
    let client = RateLimiterClient::connect(url).await.unwrap();
    let ask = |i: usize| {
        let mut client = client.clone();
        let request = ShouldAllowRequest {
            key: key_of(1_000_000 + i),
            cost: 1,
            tenant: tenant.into(),
            resource: String::new(),
            dry_run: false,
        };
        async move {
            let r = client.should_allow(request).await.unwrap().into_inner();
            (r.degraded == 0).then_some(r.allowed)
        }
    };
    refill::measure(ask, Duration::from_millis(300))
        .await
        .assert_rate(10_000, burst, slack);
}

/// `--token-slices --redis-spread-keys`: the ceiling answered from slices,
/// each key's bucket on a slot of its own. No refill: together the three
/// instances admit at most the ceiling, and at least the ceiling less what
/// three slices can hold (a thirty-second of it each) and less than one
/// slice left in the store (an instance waits for a whole slice).
async fn sliced_ceiling_and_spread_keys_stay_exact(store: &str) {
    let f = fleet_with(
        store,
        &[
            &[
                "--tenant", "sl", "--scope", "tenant", "--burst", "640", "--rate", "1/hour",
            ],
            &["--tenant", "sl", "--burst", "3", "--rate", "1/hour"],
            &["--tenant", "pk", "--burst", "10", "--rate", "1/hour"],
        ],
        &["--token-slices", "--redis-spread-keys"],
    );
    // What cannot be decided on one slot is refused with a message that
    // says what to send instead: a batch across keys, and a reservation on
    // a key and the ceiling (spending nothing). Once this instance knows
    // the ceiling cannot pass, it answers such a batch with that refusal.
    let url = format!("http://{}", f.instances[0].grpc);
    let mut client = RateLimiterClient::connect(url).await.unwrap();
    let item = |key: &str| BatchItem {
        key: key.into(),
        cost: 1,
        tenant: "sl".into(),
        resource: String::new(),
    };
    let batch = ShouldAllowBatchRequest {
        items: vec![item("a"), item("b")],
        dry_run: false,
    };
    let err = client.should_allow_batch(batch).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("one key's buckets"),
        "{}",
        err.message()
    );
    let reserve = ReserveRequest {
        key: "a".into(),
        estimate: 1,
        tenant: "sl".into(),
        resource: String::new(),
        ttl: None,
    };
    let err = client.reserve(reserve).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    // A tenant with only per-key rules reserves on one instance and
    // settles on another: the reservation lives on its key's slot.
    let reserve = ReserveRequest {
        key: "dave".into(),
        estimate: 6,
        tenant: "pk".into(),
        resource: String::new(),
        ttl: None,
    };
    let reserved = client.reserve(reserve).await.unwrap().into_inner();
    assert!(reserved.decision.unwrap().allowed);
    let url = format!("http://{}", f.instances[1].grpc);
    let mut other = RateLimiterClient::connect(url).await.unwrap();
    let settle = SettleRequest {
        reservation: reserved.reservation,
        actual: 2,
    };
    let settled = other.settle(settle).await.unwrap().into_inner();
    assert_eq!((settled.refunded, settled.remaining), (4, 8), "{settled:?}");
    // The same batch as a dry run is answered, key by key.
    let dry = ShouldAllowBatchRequest {
        items: vec![item("a"), item("b")],
        dry_run: true,
    };
    let answer = client.should_allow_batch(dry).await.unwrap().into_inner();
    assert_eq!(answer.results.len(), 2, "{answer:?}");
    // 1,200 requests on 300 keys, four each: every key admits at most 3.
    let (admitted, _, _) = spray(&f, "sl", 4, 100, |i| format!("key-{}", i % 300)).await;
    assert!(admitted <= 640, "{admitted} admitted of a ceiling of 640");
    assert!(
        admitted >= 640 - 4 * 20,
        "{admitted}: more refused early than four slices"
    );
    // The rest of the tenant's ceiling, with fresh keys (one request each).
    let (more, _, _) = spray(&f, "sl", 4, 100, |i| format!("fresh-{i}")).await;
    assert!(
        admitted + more <= 640,
        "{admitted} + {more} admitted of 640"
    );
    assert!(admitted + more >= 640 - 4 * 20, "{admitted} + {more}");
}

/// With refill, through slices: never more than burst + rate × elapsed.
async fn sliced_ceiling_with_refill(store: &str) {
    let f = fleet_with(
        store,
        &[&[
            "--tenant",
            "sf",
            "--scope",
            "tenant",
            "--burst",
            "64",
            "--rate",
            "100/second",
        ]],
        &["--token-slices", "--redis-spread-keys"],
    );
    // A slice here is 2 tokens (a thirty-second of the burst).
    refills_within_bounds(&f, "sf", 64, 3, |i| format!("k{i}")).await;
}

mod redis {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sliced_ceiling_across_three_instances() {
        let redis = RedisServer::start();
        sliced_ceiling_and_spread_keys_stay_exact(&redis.url()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sliced_refill_across_three_instances() {
        let redis = RedisServer::start();
        sliced_ceiling_with_refill(&redis.url()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_key_across_three_instances() {
        let redis = RedisServer::start();
        one_key_admits_exactly_its_burst(&redis.url()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tenant_ceiling_across_three_instances() {
        let redis = RedisServer::start();
        a_tenant_ceiling_is_shared_by_all_keys_and_instances(&redis.url()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn refill_across_three_instances() {
        let redis = RedisServer::start();
        with_refill_never_more_than_burst_plus_rate_times_elapsed(&redis.url()).await;
    }
}

mod redis_cluster {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sliced_ceiling_across_three_instances() {
        let cluster = RedisCluster::start();
        sliced_ceiling_and_spread_keys_stay_exact(&cluster.url()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sliced_refill_across_three_instances() {
        let cluster = RedisCluster::start();
        sliced_ceiling_with_refill(&cluster.url()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_key_across_three_instances() {
        let cluster = RedisCluster::start();
        one_key_admits_exactly_its_burst(&cluster.url()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tenant_ceiling_across_three_instances() {
        let cluster = RedisCluster::start();
        a_tenant_ceiling_is_shared_by_all_keys_and_instances(&cluster.url()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn refill_across_three_instances() {
        let cluster = RedisCluster::start();
        with_refill_never_more_than_burst_plus_rate_times_elapsed(&cluster.url()).await;
    }
}
