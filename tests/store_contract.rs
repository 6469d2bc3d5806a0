//! One behaviour suite, run against every store: in-process, Redis, and a
//! 3-node Redis Cluster (real servers, started per test), the Redis ones
//! both with each decision in its own script call and with concurrent
//! decisions coalesced into shared calls.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::T0;
use common::redis::{RedisCluster, RedisServer};
use tollgate::algorithm::{Charge, Limit, Op, Rate};
use tollgate::clock::{Clock, ManualClock};
use tollgate::store::{BucketKey, MemoryStore, RedisConfig, RedisStore, Store};

struct Harness {
    store: Arc<dyn Store>,
    clock: Arc<ManualClock>,
    _redis: Option<RedisServer>,
    _cluster: Option<RedisCluster>,
}

impl Harness {
    fn memory() -> Self {
        let clock = Arc::new(ManualClock::new(T0));
        Self {
            store: Arc::new(MemoryStore::new(clock.clone(), 10_000)),
            clock,
            _redis: None,
            _cluster: None,
        }
    }

    fn redis_store(url: String, clock: &Arc<ManualClock>, coalesce: usize) -> Arc<dyn Store> {
        let config = RedisConfig {
            timeout: Duration::from_secs(5),
            coalesce,
            ..RedisConfig::new(url)
        };
        let clock: Arc<dyn Clock> = clock.clone();
        Arc::new(RedisStore::new(config, Some(clock)).unwrap())
    }

    fn redis(coalesce: usize) -> Self {
        let server = RedisServer::start();
        let clock = Arc::new(ManualClock::new(T0));
        Self {
            store: Self::redis_store(server.url(), &clock, coalesce),
            clock,
            _redis: Some(server),
            _cluster: None,
        }
    }

    fn cluster(coalesce: usize) -> Self {
        let cluster = RedisCluster::start();
        let clock = Arc::new(ManualClock::new(T0));
        Self {
            store: Self::redis_store(cluster.url(), &clock, coalesce),
            clock,
            _redis: None,
            _cluster: Some(cluster),
        }
    }
}

fn charge(burst: u64, rate: &str, cost: u64) -> Charge {
    Charge::new(
        Limit::new(burst, rate.parse::<Rate>().unwrap()).unwrap(),
        cost,
    )
}

fn key(tenant: &str, k: &str) -> BucketKey {
    BucketKey::new(tenant, "k", "", k)
}

async fn burst_then_exact_retry_after(h: &Harness) {
    let b = [key("acme", "alice")];
    let c = [charge(5, "1/second", 1)];
    for left in (0..5).rev() {
        let o = h.store.apply(&b, &c, Op::SPEND).await.unwrap();
        assert!(o.allowed);
        assert_eq!(o.verdicts[0].remaining, left);
        assert_eq!(o.verdicts[0].reset_after, (5 - left) * 1_000_000);
    }
    let o = h.store.apply(&b, &c, Op::SPEND).await.unwrap();
    assert!(!o.allowed);
    assert_eq!(o.verdicts[0].retry_after, 1_000_000);
    assert_eq!(o.verdicts[0].reset_after, 5_000_000);
    h.clock.advance(Duration::from_micros(999_999));
    assert!(!h.store.apply(&b, &c, Op::SPEND).await.unwrap().allowed);
    h.clock.advance(Duration::from_micros(1));
    let o = h.store.apply(&b, &c, Op::SPEND).await.unwrap();
    assert!(o.allowed);
    assert_eq!(o.verdicts[0].remaining, 0);
}

async fn all_or_nothing_across_buckets(h: &Harness) {
    let b = [key("acme", "account"), key("acme", "ip")];
    let c = [charge(10, "1/hour", 1), charge(1, "1/hour", 1)];
    assert!(h.store.apply(&b, &c, Op::SPEND).await.unwrap().allowed);
    let o = h.store.apply(&b, &c, Op::SPEND).await.unwrap();
    assert!(!o.allowed);
    assert!(o.verdicts[0].allowed, "the account alone would pass");
    assert_eq!(o.verdicts[0].remaining, 9, "and is not charged");
    assert_eq!(o.verdicts[1].retry_after, 3_600_000_000);
    let o = h.store.apply(&b[..1], &c[..1], Op::DRY).await.unwrap();
    assert_eq!(
        o.verdicts[0].remaining, 8,
        "dry run after: 9 held, 8 if spent"
    );
}

async fn dry_run_spends_nothing(h: &Harness) {
    let b = [key("t", "k")];
    let c = [charge(3, "1/hour", 2)];
    for _ in 0..3 {
        let o = h.store.apply(&b, &c, Op::DRY).await.unwrap();
        assert!(o.allowed);
        assert_eq!(o.verdicts[0].remaining, 1);
    }
}

async fn shadow_charges_never_reject(h: &Harness) {
    let b = [
        key("t", "enforced"),
        BucketKey::new("t", "ks", "", "shadow"),
    ];
    let c = [
        charge(10, "1/hour", 1),
        Charge {
            enforce: false,
            ..charge(1, "1/hour", 1)
        },
    ];
    assert!(h.store.apply(&b, &c, Op::SPEND).await.unwrap().allowed);
    let o = h.store.apply(&b, &c, Op::SPEND).await.unwrap();
    assert!(o.allowed, "the shadow bucket is empty but never rejects");
    assert!(!o.verdicts[1].allowed);
    assert_eq!(o.verdicts[0].remaining, 8);
}

async fn limit_change_keeps_debt_and_clamps(h: &Harness) {
    let b = [key("t", "k")];
    h.store
        .apply(&b, &[charge(100, "1/second", 40)], Op::SPEND)
        .await
        .unwrap();
    // Same rate, burst 10: 40 owed clamps to 10, so empty for 10 s.
    let o = h
        .store
        .apply(&b, &[charge(10, "1/second", 1)], Op::DRY)
        .await
        .unwrap();
    assert!(!o.allowed);
    assert_eq!(o.verdicts[0].reset_after, 10_000_000);
    assert_eq!(o.verdicts[0].retry_after, 1_000_000);
    // Faster refill, big burst: 40 tokens owed at 10/s is 4 s.
    let o = h
        .store
        .apply(&b, &[charge(100, "10/second", 1)], Op::DRY)
        .await
        .unwrap();
    assert_eq!(o.verdicts[0].remaining, 59);
}

async fn backwards_clock_creates_nothing(h: &Harness) {
    let b = [key("t", "k")];
    let c = [charge(2, "1/second", 1)];
    h.store.apply(&b, &c, Op::SPEND).await.unwrap();
    h.store.apply(&b, &c, Op::SPEND).await.unwrap();
    h.clock.set(T0 - 10_000_000);
    let o = h.store.apply(&b, &c, Op::SPEND).await.unwrap();
    assert!(!o.allowed);
    assert_eq!(o.verdicts[0].remaining, 0);
    assert_eq!(
        o.verdicts[0].retry_after, 11_000_000,
        "still owed as of T0, plus the 10 s back"
    );
    h.clock.set(T0 + 1_000_000);
    assert!(h.store.apply(&b, &c, Op::SPEND).await.unwrap().allowed);
}

async fn five_hundred_racers_admit_exactly_one_hundred(h: &Harness) {
    let c = [charge(100, "1/day", 1)];
    let mut tasks = Vec::new();
    for _ in 0..500 {
        let store = h.store.clone();
        tasks.push(tokio::spawn(async move {
            let b = [key("race", "hot")];
            store.apply(&b, &c, Op::SPEND).await.unwrap().allowed
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        admitted += usize::from(t.await.unwrap());
    }
    assert_eq!(admitted, 100);
}

async fn tenants_and_keys_are_separate_buckets(h: &Harness) {
    let c = [charge(1, "1/hour", 1)];
    for (tenant, k) in [("a", "x"), ("a", "y"), ("b", "x"), ("", "x")] {
        let o = h
            .store
            .apply(&[key(tenant, k)], &c, Op::SPEND)
            .await
            .unwrap();
        assert!(o.allowed, "{tenant}/{k}");
    }
    assert!(
        !h.store
            .apply(&[key("a", "x")], &c, Op::SPEND)
            .await
            .unwrap()
            .allowed
    );
}

async fn fixed_and_sliding_windows(h: &Harness) {
    use tollgate::algorithm::Algorithm;
    let minute = 1_700_000_040_000_000; // on a minute boundary
    h.clock.set(minute + 50_000_000);
    let window = |a| Charge {
        limit: Limit::window(a, "3/minute".parse().unwrap()).unwrap(),
        cost: 1,
        need: 1,
        enforce: true,
    };
    let fixed = [window(Algorithm::FixedWindow)];
    let sliding = [window(Algorithm::SlidingWindow)];
    let (bf, bs) = ([key("w", "fixed")], [key("w", "sliding")]);
    for left in [2, 1, 0] {
        assert_eq!(
            h.store
                .apply(&bf, &fixed, Op::SPEND)
                .await
                .unwrap()
                .verdicts[0]
                .remaining,
            left
        );
        assert_eq!(
            h.store
                .apply(&bs, &sliding, Op::SPEND)
                .await
                .unwrap()
                .verdicts[0]
                .remaining,
            left
        );
    }
    let o = h.store.apply(&bf, &fixed, Op::SPEND).await.unwrap();
    assert!(!o.allowed);
    assert_eq!(o.verdicts[0].retry_after, 10_000_000, "the next minute");
    // 15 s into the next minute the fixed window is fresh, while the sliding
    // window still counts 75% of the 3 (rounded up: 3).
    h.clock.set(minute + 75_000_000);
    assert!(h.store.apply(&bf, &fixed, Op::SPEND).await.unwrap().allowed);
    let o = h.store.apply(&bs, &sliding, Op::SPEND).await.unwrap();
    assert!(!o.allowed);
    // ceil(3 × (60 − e) / 60) ≤ 2 from e = 20 s.
    assert_eq!(o.verdicts[0].retry_after, 5_000_000);
}

macro_rules! contract {
    ($($test:ident),* $(,)?) => {
        mod memory {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() { super::$test(&super::Harness::memory()).await })*
        }
        mod redis {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() { super::$test(&super::Harness::redis(0)).await })*
        }
        mod redis_coalesced {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() { super::$test(&super::Harness::redis(64)).await })*
        }
        mod redis_cluster {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() { super::$test(&super::Harness::cluster(0)).await })*
        }
        mod redis_cluster_coalesced {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() { super::$test(&super::Harness::cluster(64)).await })*
        }
    };
}

contract!(
    burst_then_exact_retry_after,
    all_or_nothing_across_buckets,
    dry_run_spends_nothing,
    shadow_charges_never_reject,
    limit_change_keeps_debt_and_clamps,
    backwards_clock_creates_nothing,
    five_hundred_racers_admit_exactly_one_hundred,
    tenants_and_keys_are_separate_buckets,
    fixed_and_sliding_windows,
);
