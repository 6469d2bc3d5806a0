//! One behaviour suite, run against every store: in-process, Redis, and a
//! 3-node Redis Cluster (real servers, started per test), the Redis ones
//! both with each decision in its own script call and with concurrent
//! decisions coalesced into shared calls.
//!
//! It lives beside the stores, in `tollgate-core`, so that mutation testing
//! of the stores (`scripts/mutants stores`) runs it against each mutant.

// The workspace's test helpers for real Redis servers, shared by path with
// the root crate's integration tests.
#[allow(dead_code)]
#[path = "../../../tests/common/ports.rs"]
mod ports;
#[allow(dead_code)]
#[path = "../../../tests/common/redis.rs"]
mod redis_servers;

use std::sync::Arc;
use std::time::Duration;

use redis_servers::{RedisCluster, RedisServer};
use tollgate_core::algorithm::alerts::Alerts;
use tollgate_core::algorithm::calendar::Bounds;
use tollgate_core::algorithm::{Charge, Limit, Op, Rate};
use tollgate_core::clock::{Clock, ManualClock};
use tollgate_core::store::journal::{Closed, Entry, Journal, QuotaCount, QuotaEvent};
use tollgate_core::store::{
    Attachment, BucketKey, BucketKind, Lease, LeaseId, LeaseOp, LeaseStatus, MemoryStore,
    RedisConfig, RedisStore, Request, Reservation, ReservationId, SettleStatus, Share, ShareAsk,
    Store, shares,
};

/// A time well after the epoch, as the root crate's tests use.
const T0: u64 = 1_700_000_000_000_000;

struct Harness {
    store: Arc<dyn Store>,
    /// The store's quota journal.
    journal: Arc<dyn Journal>,
    /// Another instance on the same backend (in memory: the same store).
    other: Arc<dyn Store>,
    clock: Arc<ManualClock>,
    _redis: Option<RedisServer>,
    _cluster: Option<RedisCluster>,
}

impl Harness {
    /// Applies `charges` to `buckets` as one spending decision.
    async fn spend(
        &self,
        buckets: &[BucketKey],
        charges: &[Charge],
    ) -> tollgate_core::store::Verdicts {
        self.store
            .apply(Request::new(buckets, charges, Op::SPEND))
            .await
            .unwrap()
    }
}

impl Harness {
    fn memory() -> Self {
        let clock = Arc::new(ManualClock::new(T0));
        let memory = Arc::new(MemoryStore::new(clock.clone(), 10_000).with_journal());
        let store: Arc<dyn Store> = memory.clone();
        Self {
            other: store.clone(),
            journal: memory,
            store,
            clock,
            _redis: None,
            _cluster: None,
        }
    }

    fn redis_store(url: String, clock: &Arc<ManualClock>, coalesce: usize) -> Arc<RedisStore> {
        let config = RedisConfig {
            timeout: Duration::from_secs(5),
            coalesce,
            journal: true,
            ..RedisConfig::new(url)
        };
        let clock: Arc<dyn Clock> = clock.clone();
        Arc::new(RedisStore::new(config, Some(clock)).unwrap())
    }

    fn redis(coalesce: usize) -> Self {
        let server = RedisServer::start();
        let clock = Arc::new(ManualClock::new(T0));
        let store = Self::redis_store(server.url(), &clock, coalesce);
        Self {
            journal: store.clone(),
            store,
            other: Self::redis_store(server.url(), &clock, coalesce),
            clock,
            _redis: Some(server),
            _cluster: None,
        }
    }

    fn cluster(coalesce: usize) -> Self {
        let cluster = RedisCluster::start();
        let clock = Arc::new(ManualClock::new(T0));
        let store = Self::redis_store(cluster.url(), &clock, coalesce);
        Self {
            journal: store.clone(),
            store,
            other: Self::redis_store(cluster.url(), &clock, coalesce),
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
    BucketKey::new(tenant, BucketKind::KEY, "", k)
}

async fn burst_then_exact_retry_after(h: &Harness) {
    let b = [key("acme", "alice")];
    let c = [charge(5, "1/second", 1)];
    for left in (0..5).rev() {
        let o = h.spend(&b, &c).await;
        assert!(o.allowed);
        assert_eq!(o.verdicts[0].remaining, left);
        assert_eq!(o.verdicts[0].reset_after, (5 - left) * 1_000_000);
    }
    let o = h.spend(&b, &c).await;
    assert!(!o.allowed);
    assert_eq!(o.verdicts[0].retry_after, 1_000_000);
    assert_eq!(o.verdicts[0].reset_after, 5_000_000);
    h.clock.advance(Duration::from_micros(999_999));
    assert!(!h.spend(&b, &c).await.allowed);
    h.clock.advance(Duration::from_micros(1));
    let o = h.spend(&b, &c).await;
    assert!(o.allowed);
    assert_eq!(o.verdicts[0].remaining, 0);
}

async fn all_or_nothing_across_buckets(h: &Harness) {
    let b = [key("acme", "account"), key("acme", "ip")];
    let c = [charge(10, "1/hour", 1), charge(1, "1/hour", 1)];
    assert!(h.spend(&b, &c).await.allowed);
    let o = h.spend(&b, &c).await;
    assert!(!o.allowed);
    assert!(o.verdicts[0].allowed, "the account alone would pass");
    assert_eq!(o.verdicts[0].remaining, 9, "and is not charged");
    assert_eq!(o.verdicts[1].retry_after, 3_600_000_000);
    let o = h
        .store
        .apply(Request::new(&b[..1], &c[..1], Op::DRY))
        .await
        .unwrap();
    assert_eq!(
        o.verdicts[0].remaining, 8,
        "dry run after: 9 held, 8 if spent"
    );
}

async fn dry_run_spends_nothing(h: &Harness) {
    let b = [key("t", "k")];
    let c = [charge(3, "1/hour", 2)];
    for _ in 0..3 {
        let o = h.store.apply(Request::new(&b, &c, Op::DRY)).await.unwrap();
        assert!(o.allowed);
        assert_eq!(o.verdicts[0].remaining, 1);
    }
}

async fn shadow_charges_never_reject(h: &Harness) {
    let b = [
        key("t", "enforced"),
        BucketKey::new(
            "t",
            BucketKind::Rule {
                per_key: true,
                concurrency: false,
                shadow: true,
            },
            "",
            "shadow",
        ),
    ];
    let c = [
        charge(10, "1/hour", 1),
        Charge {
            enforce: false,
            ..charge(1, "1/hour", 1)
        },
    ];
    assert!(h.spend(&b, &c).await.allowed);
    let o = h.spend(&b, &c).await;
    assert!(o.allowed, "the shadow bucket is empty but never rejects");
    assert!(!o.verdicts[1].allowed);
    assert_eq!(o.verdicts[0].remaining, 8);
}

async fn limit_change_keeps_debt_and_clamps(h: &Harness) {
    let b = [key("t", "k")];
    h.store
        .apply(Request::new(&b, &[charge(100, "1/second", 40)], Op::SPEND))
        .await
        .unwrap();
    // Same rate, burst 10: 40 owed clamps to 10, so empty for 10 s.
    let o = h
        .store
        .apply(Request::new(&b, &[charge(10, "1/second", 1)], Op::DRY))
        .await
        .unwrap();
    assert!(!o.allowed);
    assert_eq!(o.verdicts[0].reset_after, 10_000_000);
    assert_eq!(o.verdicts[0].retry_after, 1_000_000);
    // Faster refill, big burst: 40 tokens owed at 10/s is 4 s.
    let o = h
        .store
        .apply(Request::new(&b, &[charge(100, "10/second", 1)], Op::DRY))
        .await
        .unwrap();
    assert_eq!(o.verdicts[0].remaining, 59);
}

async fn backwards_clock_creates_nothing(h: &Harness) {
    let b = [key("t", "k")];
    let c = [charge(2, "1/second", 1)];
    h.spend(&b, &c).await;
    h.spend(&b, &c).await;
    h.clock.set(T0 - 10_000_000);
    let o = h.spend(&b, &c).await;
    assert!(!o.allowed);
    assert_eq!(o.verdicts[0].remaining, 0);
    assert_eq!(
        o.verdicts[0].retry_after, 11_000_000,
        "still owed as of T0, plus the 10 s back"
    );
    h.clock.set(T0 + 1_000_000);
    assert!(h.spend(&b, &c).await.allowed);
}

async fn five_hundred_racers_admit_exactly_one_hundred(h: &Harness) {
    let c = [charge(100, "1/day", 1)];
    let mut tasks = Vec::new();
    for _ in 0..500 {
        let store = h.store.clone();
        tasks.push(tokio::spawn(async move {
            let b = [key("race", "hot")];
            store
                .apply(Request::new(&b, &c, Op::SPEND))
                .await
                .unwrap()
                .allowed
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
            .apply(Request::new(&[key(tenant, k)], &c, Op::SPEND))
            .await
            .unwrap();
        assert!(o.allowed, "{tenant}/{k}");
    }
    assert!(
        !h.store
            .apply(Request::new(&[key("a", "x")], &c, Op::SPEND))
            .await
            .unwrap()
            .allowed
    );
}

async fn fixed_and_sliding_windows(h: &Harness) {
    use tollgate_core::algorithm::Algorithm;
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
                .apply(Request::new(&bf, &fixed, Op::SPEND))
                .await
                .unwrap()
                .verdicts[0]
                .remaining,
            left
        );
        assert_eq!(
            h.store
                .apply(Request::new(&bs, &sliding, Op::SPEND))
                .await
                .unwrap()
                .verdicts[0]
                .remaining,
            left
        );
    }
    let o = h
        .store
        .apply(Request::new(&bf, &fixed, Op::SPEND))
        .await
        .unwrap();
    assert!(!o.allowed);
    assert_eq!(o.verdicts[0].retry_after, 10_000_000, "the next minute");
    // 15 s into the next minute the fixed window is fresh, while the sliding
    // window still counts 75% of the 3 (rounded up: 3).
    h.clock.set(minute + 75_000_000);
    assert!(
        h.store
            .apply(Request::new(&bf, &fixed, Op::SPEND))
            .await
            .unwrap()
            .allowed
    );
    let o = h
        .store
        .apply(Request::new(&bs, &sliding, Op::SPEND))
        .await
        .unwrap();
    assert!(!o.allowed);
    // ceil(3 × (60 − e) / 60) ≤ 2 from e = 20 s.
    assert_eq!(o.verdicts[0].retry_after, 5_000_000);
}

fn with_debt(burst: u64, rate: &str, debt: u64) -> Charge {
    Charge::new(
        Limit::new(burst, rate.parse::<Rate>().unwrap())
            .unwrap()
            .with_debt(debt)
            .unwrap(),
        0,
    )
}

/// Usage charged after the fact goes into debt down to the floor, the part
/// beyond is forgiven, and while in debt a request waits exactly until the
/// refill covers the debt and its need; an ask (cost 0, need 1) too.
async fn charges_go_into_debt_down_to_the_floor(h: &Harness) {
    let b = [key("llm", "carol")];
    let rule = with_debt(10, "1/second", 5);
    let c = |cost| {
        [Charge {
            cost,
            need: cost,
            ..rule
        }]
    };
    let o = h
        .store
        .apply(Request::new(&b, &c(12), Op::Charge))
        .await
        .unwrap();
    assert!(o.allowed);
    assert_eq!(
        (
            o.verdicts[0].remaining,
            o.verdicts[0].debt,
            o.verdicts[0].forgiven
        ),
        (0, 2, 0)
    );
    assert_eq!(o.verdicts[0].reset_after, 12_000_000);
    // Past the floor of -5: 3 of 6 are applied, 3 forgiven.
    let o = h
        .store
        .apply(Request::new(&b, &c(6), Op::Charge))
        .await
        .unwrap();
    assert_eq!((o.verdicts[0].debt, o.verdicts[0].forgiven), (5, 3));
    // In debt every request waits: an ask needs one token, 6 s away.
    let ask = [Charge {
        cost: 0,
        need: 1,
        ..rule
    }];
    let o = h
        .store
        .apply(Request::new(&b, &ask, Op::SPEND))
        .await
        .unwrap();
    assert!(!o.allowed);
    assert_eq!(
        (o.verdicts[0].debt, o.verdicts[0].retry_after),
        (5, 6_000_000)
    );
    h.clock.advance(Duration::from_micros(5_999_999));
    assert!(
        !h.store
            .apply(Request::new(&b, &ask, Op::SPEND))
            .await
            .unwrap()
            .allowed
    );
    h.clock.advance(Duration::from_micros(1));
    let o = h
        .store
        .apply(Request::new(&b, &ask, Op::SPEND))
        .await
        .unwrap();
    assert!(o.allowed, "one token back");
    assert_eq!(o.verdicts[0].remaining, 1, "and the ask spent none of it");
    // Another instance sees the same balance.
    let o = h
        .other
        .apply(Request::new(&b, &c(1), Op::SPEND))
        .await
        .unwrap();
    assert!(o.allowed);
    assert_eq!(o.verdicts[0].remaining, 0);
}

/// Reserve charges the estimate on every bucket and records it; a settle
/// from another instance refunds the difference or charges the excess on
/// all of them; a second settle changes nothing and says so; an unknown
/// reservation and an expired one are told apart, and an expired one keeps
/// its estimate charged.
async fn reserve_and_settle_across_instances(h: &Harness) {
    let b = [
        key("llm", "dave"),
        BucketKey::new("llm", BucketKind::TENANT, "", ""),
    ];
    let rules = [with_debt(100, "1/hour", 50), with_debt(1000, "1/hour", 0)];
    let c = |estimate| {
        rules.map(|r| Charge {
            cost: estimate,
            need: estimate,
            ..r
        })
    };
    let reservation = |estimate, ttl| Reservation {
        id: ReservationId::new("llm"),
        estimate,
        lines: vec![1, 1],
        ttl,
    };
    let held =
        |o: &tollgate_core::store::Verdicts| (o.verdicts[0].remaining, o.verdicts[1].remaining);
    // Reserve 40 with a minute to live: both buckets are charged 40.
    let r1 = reservation(40, 60_000_000);
    let o = h
        .store
        .apply(Request::new(&b, &c(40), Op::SPEND).attach(&Attachment::Reservation(r1.clone())))
        .await
        .unwrap();
    assert!(o.allowed);
    assert_eq!(held(&o), (60, 960));
    // It used 10: the other instance gives 30 back to both.
    let s = h.other.settle(&r1.id, 10).await.unwrap();
    assert_eq!(s.status, SettleStatus::Settled);
    assert_eq!(s.estimate, 40);
    assert_eq!(
        s.verdicts.iter().map(|v| v.remaining).collect::<Vec<_>>(),
        [90, 990]
    );
    // Settling again changes nothing, and says what counted.
    let again = h.store.settle(&r1.id, 500).await.unwrap();
    assert_eq!(again.status, SettleStatus::AlreadySettled { actual: 10 });
    assert!(again.verdicts.is_empty());
    let o = h
        .store
        .apply(Request::new(&b, &c(0), Op::DRY))
        .await
        .unwrap();
    assert_eq!(held(&o), (90, 990));
    // Reserve 50 and use 150: the excess of 100 takes the first bucket from
    // 40 to its floor of -50 (10 forgiven), the second from 940 to 840.
    let r2 = reservation(50, 60_000_000);
    assert!(
        h.store
            .apply(Request::new(&b, &c(50), Op::SPEND).attach(&Attachment::Reservation(r2.clone())))
            .await
            .unwrap()
            .allowed
    );
    let s = h.other.settle(&r2.id, 150).await.unwrap();
    assert_eq!(s.status, SettleStatus::Settled);
    assert_eq!(
        s.verdicts
            .iter()
            .map(|v| (v.remaining, v.debt, v.forgiven))
            .collect::<Vec<_>>(),
        [(0, 50, 10), (840, 0, 0)]
    );
    // In debt: a reserve is refused and records nothing.
    let r3 = reservation(1, 60_000_000);
    assert!(
        !h.store
            .apply(Request::new(&b, &c(1), Op::SPEND).attach(&Attachment::Reservation(r3.clone())))
            .await
            .unwrap()
            .allowed
    );
    assert_eq!(
        h.store.settle(&r3.id, 0).await.unwrap().status,
        SettleStatus::Unknown
    );
    // Unknown tokens, and a reservation past its time to live.
    assert_eq!(
        h.other
            .settle(&ReservationId::new("llm"), 1)
            .await
            .unwrap()
            .status,
        SettleStatus::Unknown
    );
    let erin = [key("llm", "erin")];
    let one = |estimate| {
        [Charge {
            cost: estimate,
            need: estimate,
            ..rules[0]
        }]
    };
    let r4 = Reservation {
        lines: vec![1],
        ..reservation(70, 1_000_000)
    };
    assert!(
        h.store
            .apply(
                Request::new(&erin, &one(70), Op::SPEND)
                    .attach(&Attachment::Reservation(r4.clone()))
            )
            .await
            .unwrap()
            .allowed
    );
    h.clock.advance(Duration::from_secs(1));
    let late = h.other.settle(&r4.id, 0).await.unwrap();
    assert_eq!(late.status, SettleStatus::Expired);
    assert_eq!(late.estimate, 70);
    let o = h
        .store
        .apply(Request::new(&erin, &one(0), Op::DRY))
        .await
        .unwrap();
    assert_eq!(o.verdicts[0].remaining, 30, "the estimate stays charged");
}

fn cap(n: u64) -> Charge {
    Charge::new(Limit::concurrency(n).unwrap(), 1)
}

fn slots(tenant: &str, k: &str) -> BucketKey {
    BucketKey::new(
        tenant,
        BucketKind::Rule {
            per_key: true,
            concurrency: true,
            shadow: false,
        },
        "",
        k,
    )
}

fn lease(tenant: &str, secs: u64) -> Lease {
    Lease {
        id: LeaseId::new(tenant),
        ttl: secs * 1_000_000,
    }
}

/// Leases held in a cap of `n`, read with a dry run.
async fn held(h: &Harness, b: &BucketKey, n: u64) -> u64 {
    let o = h
        .store
        .apply(Request::new(std::slice::from_ref(b), &[cap(n)], Op::DRY))
        .await
        .unwrap();
    n - o.verdicts[0].remaining
}

async fn leases_fill_expire_release_and_renew(h: &Harness) {
    let b = [slots("acme", "exports")];
    let c = [cap(2)];
    let a = lease("acme", 10);
    let o = h
        .store
        .apply(Request::new(&b, &c, Op::SPEND).attach(&Attachment::Lease(a.clone())))
        .await
        .unwrap();
    assert!(o.allowed);
    assert_eq!(o.verdicts[0].remaining, 1);
    assert_eq!(o.verdicts[0].reset_after, 10_000_000);
    h.clock.advance(Duration::from_secs(2));
    let bee = lease("acme", 5);
    let o = h
        .store
        .apply(Request::new(&b, &c, Op::SPEND).attach(&Attachment::Lease(bee.clone())))
        .await
        .unwrap();
    assert!(o.allowed);
    assert_eq!(o.verdicts[0].remaining, 0);
    assert_eq!(o.verdicts[0].reset_after, 8_000_000, "until a's expiry");
    // Full: refused until the earliest lease (bee's, at +7 s) expires.
    let o = h
        .store
        .apply(Request::new(&b, &c, Op::SPEND).attach(&Attachment::Lease(lease("acme", 5).clone())))
        .await
        .unwrap();
    assert!(!o.allowed);
    assert_eq!(o.verdicts[0].remaining, 0);
    assert_eq!(o.verdicts[0].retry_after, 5_000_000);
    assert_eq!(o.verdicts[0].reset_after, 8_000_000);
    // Released through another instance: the slot is free at once, and a
    // second release changes nothing.
    let r = h.other.lease(&bee.id, LeaseOp::Release).await.unwrap();
    assert_eq!(r.status, LeaseStatus::Done);
    let r = h.store.lease(&bee.id, LeaseOp::Release).await.unwrap();
    assert_eq!(r.status, LeaseStatus::AlreadyReleased);
    assert_eq!(held(h, &b[0], 2).await, 1);
    let cee = lease("acme", 3);
    assert!(
        h.store
            .apply(Request::new(&b, &c, Op::SPEND).attach(&Attachment::Lease(cee.clone())))
            .await
            .unwrap()
            .allowed
    );
    assert_eq!(held(h, &b[0], 2).await, 2);
    // Renewed: a holds 20 s from now (+2 s), beyond its first expiry.
    let r = h
        .other
        .lease(&a.id, LeaseOp::Renew { ttl: 20_000_000 })
        .await
        .unwrap();
    assert_eq!((r.status, r.expires_in), (LeaseStatus::Done, 20_000_000));
    // cee expires at +5 s by itself; a does not at +10 s.
    h.clock.advance(Duration::from_secs(3));
    assert_eq!(held(h, &b[0], 2).await, 1, "cee expired at its ttl");
    h.clock.advance(Duration::from_secs(6));
    assert_eq!(held(h, &b[0], 2).await, 1, "a was renewed");
    let r = h.store.lease(&cee.id, LeaseOp::Release).await.unwrap();
    assert_eq!(r.status, LeaseStatus::Expired);
    let r = h
        .store
        .lease(&cee.id, LeaseOp::Renew { ttl: 1_000_000 })
        .await
        .unwrap();
    assert_eq!(
        r.status,
        LeaseStatus::Expired,
        "an expired lease is not renewed"
    );
    assert_eq!(held(h, &b[0], 2).await, 1);
    let r = h
        .store
        .lease(&bee.id, LeaseOp::Renew { ttl: 1_000_000 })
        .await
        .unwrap();
    assert_eq!(r.status, LeaseStatus::AlreadyReleased);
    let r = h
        .store
        .lease(&LeaseId::new("acme"), LeaseOp::Release)
        .await
        .unwrap();
    assert_eq!(r.status, LeaseStatus::Unknown);
    h.clock.advance(Duration::from_secs(13));
    assert_eq!(held(h, &b[0], 2).await, 0, "a expired at its renewed ttl");
}

async fn acquire_takes_tokens_and_slots_all_or_nothing(h: &Harness) {
    let b = [key("acme", "alice"), slots("acme", "alice")];
    // A token bucket of one and a cap of five: the second acquire is
    // refused by the bucket, and takes no slot.
    let c = [charge(1, "1/hour", 1), cap(5)];
    assert!(
        h.store
            .apply(
                Request::new(&b, &c, Op::SPEND)
                    .attach(&Attachment::Lease(lease("acme", 60).clone()))
            )
            .await
            .unwrap()
            .allowed
    );
    let o = h
        .store
        .apply(
            Request::new(&b, &c, Op::SPEND).attach(&Attachment::Lease(lease("acme", 60).clone())),
        )
        .await
        .unwrap();
    assert!(!o.allowed);
    assert!(!o.verdicts[0].allowed);
    assert!(o.verdicts[1].allowed);
    assert_eq!(o.verdicts[1].remaining, 4, "what the cap holds now");
    assert_eq!(held(h, &b[1], 5).await, 1);
    // A cap of one and a bucket of ten: the cap refuses, and no token is
    // spent.
    let b = [key("acme", "bob"), slots("acme", "bob")];
    let c = [charge(10, "1/hour", 1), cap(1)];
    assert!(
        h.store
            .apply(
                Request::new(&b, &c, Op::SPEND)
                    .attach(&Attachment::Lease(lease("acme", 60).clone()))
            )
            .await
            .unwrap()
            .allowed
    );
    let o = h
        .store
        .apply(
            Request::new(&b, &c, Op::SPEND).attach(&Attachment::Lease(lease("acme", 60).clone())),
        )
        .await
        .unwrap();
    assert!(!o.allowed);
    assert_eq!(o.verdicts[0].remaining, 9, "the bucket is not charged");
    assert_eq!(o.verdicts[1].retry_after, 60_000_000);
    let o = h
        .store
        .apply(Request::new(&b[..1], &c[..1], Op::DRY))
        .await
        .unwrap();
    assert_eq!(o.verdicts[0].remaining, 8);
}

async fn shadow_caps_never_refuse(h: &Harness) {
    let b = [slots("acme", "enforced"), slots("acme", "shadow")];
    let shadow = Charge {
        enforce: false,
        ..cap(1)
    };
    let c = [cap(3), shadow];
    assert!(
        h.store
            .apply(
                Request::new(&b, &c, Op::SPEND)
                    .attach(&Attachment::Lease(lease("acme", 60).clone()))
            )
            .await
            .unwrap()
            .allowed
    );
    let o = h
        .store
        .apply(
            Request::new(&b, &c, Op::SPEND).attach(&Attachment::Lease(lease("acme", 60).clone())),
        )
        .await
        .unwrap();
    assert!(o.allowed, "a full shadow cap does not refuse");
    assert!(!o.verdicts[1].allowed, "but says it would have");
    assert_eq!(held(h, &b[0], 3).await, 2);
    assert_eq!(held(h, &b[1], 1).await, 1, "and takes no slot");
}

async fn five_hundred_acquirers_take_exactly_the_cap(h: &Harness) {
    let c = [cap(100)];
    let mut tasks = Vec::new();
    for i in 0..500 {
        let store = if i % 2 == 0 {
            h.store.clone()
        } else {
            h.other.clone()
        };
        tasks.push(tokio::spawn(async move {
            let b = [slots("race", "hot")];
            let l = lease("race", 3600);
            store
                .apply(Request::new(&b, &c, Op::SPEND).attach(&Attachment::Lease(l.clone())))
                .await
                .unwrap()
                .allowed
        }));
    }
    let mut granted = 0;
    for t in tasks {
        granted += usize::from(t.await.unwrap());
    }
    assert_eq!(granted, 100);
    assert_eq!(held(h, &slots("race", "hot"), 100).await, 100);
}

/// Every entry waiting in `h`'s journals (with `sweep`, also those other
/// instances left), each journal trimmed after it is read.
async fn entries(h: &Harness, sweep: bool) -> Vec<Entry> {
    let mut entries = Vec::new();
    let mut journals = h.journal.pending(sweep).await.unwrap();
    journals.sort();
    for journal in journals {
        let read = h.journal.read(&journal, 100).await.unwrap();
        h.journal.trim(&journal, read.len()).await.unwrap();
        entries.extend(
            read.into_iter()
                .map(|e| e.expect("a line this build wrote")),
        );
    }
    entries
}

/// The period openings among `h`'s journal entries.
async fn journaled(h: &Harness, sweep: bool) -> Vec<QuotaEvent> {
    let entries = entries(h, sweep).await;
    entries
        .into_iter()
        .map(|e| match e {
            Entry::Opened(e) => e,
            Entry::Crossed(c) => panic!("no alerts here: {c:?}"),
        })
        .collect()
}

/// A quota of 10 with alerts at 50, 80 and 100 %: each fires once, on the
/// decision, charge or settle whose count reaches it, and again in the next
/// period; a dry run, a refusal and a refund fire nothing.
async fn alert_thresholds_fire_once_each_per_period(h: &Harness) {
    const DAY: u64 = 86_400_000_000;
    let alerts: Alerts = "50,80,100".parse().unwrap();
    let quota = |cost, day: u64| {
        let start = T0 + day * DAY;
        let bounds = Bounds {
            start,
            end: start + DAY,
        };
        Charge::new(Limit::quota(10, bounds).unwrap().with_alerts(alerts), cost)
    };
    let kind = BucketKind::Quota {
        per_key: false,
        shadow: false,
    };
    let b = [BucketKey::new("acme", kind, "", "")];
    let crossed = |entries: Vec<Entry>| -> Vec<(u16, u64)> {
        entries
            .into_iter()
            .filter_map(|e| match e {
                Entry::Crossed(c) => {
                    assert_eq!((c.end - c.start, c.quota, &c.bucket), (DAY, 10, &b[0]));
                    Some((c.percent, c.used))
                }
                Entry::Opened(_) => None,
            })
            .collect()
    };
    assert!(h.spend(&b, &[quota(4, 0)]).await.allowed);
    assert_eq!(crossed(entries(h, false).await), []);
    assert!(h.spend(&b, &[quota(1, 0)]).await.allowed);
    assert_eq!(crossed(entries(h, false).await), [(50, 5)]);
    let dry = [quota(5, 0)];
    assert!(
        h.store
            .apply(Request::new(&b, &dry, Op::DRY))
            .await
            .unwrap()
            .allowed
    );
    assert!(!h.spend(&b, &[quota(6, 0)]).await.allowed);
    assert_eq!(crossed(entries(h, false).await), []);
    // A reservation of 3 reaches 80 %; settled at 1 it gives 2 back (a
    // refund fires nothing), then a charge after the fact (counted up to
    // the quota: it has no debt) reaches 80 % a second time (the ledger's
    // outbox keeps one per threshold) and 100 %.
    let r = Reservation {
        id: ReservationId::new("acme"),
        estimate: 3,
        lines: vec![1],
        ttl: 60_000_000,
    };
    let reserve = [quota(3, 0)];
    let attached = Attachment::Reservation(r.clone());
    let reserved = h
        .store
        .apply(Request::new(&b, &reserve, Op::SPEND).attach(&attached))
        .await
        .unwrap();
    assert!(reserved.allowed);
    assert_eq!(crossed(entries(h, false).await), [(80, 8)]);
    let settled = h.other.settle(&r.id, 1).await.unwrap();
    assert_eq!(settled.status, SettleStatus::Settled);
    assert_eq!(crossed(entries(h, true).await), []);
    let charge = [quota(5, 0)];
    h.store
        .apply(Request::new(&b, &charge, Op::Charge))
        .await
        .unwrap();
    assert_eq!(crossed(entries(h, false).await), [(80, 10), (100, 10)]);
    // The next day starts over: one decision reaches all three.
    h.clock.advance(Duration::from_micros(DAY));
    assert!(h.spend(&b, &[quota(10, 1)]).await.allowed);
    assert_eq!(
        crossed(entries(h, false).await),
        [(50, 10), (80, 10), (100, 10)]
    );
}

async fn quota_periods_are_journaled_once_each(h: &Harness) {
    const DAY: u64 = 86_400_000_000;
    let quota = |count, day: u64| {
        let start = T0 + day * DAY;
        Charge::new(
            Limit::quota(
                count,
                Bounds {
                    start,
                    end: start + DAY,
                },
            )
            .unwrap(),
            1,
        )
    };
    let kind = BucketKind::Quota {
        per_key: true,
        shadow: false,
    };
    let b = [BucketKey::new("acme", kind, "exports", "a key")];
    // The counter's first write enters its first period: one event.
    assert!(h.spend(&b, &[quota(3, 0)]).await.allowed);
    assert!(h.spend(&b, &[quota(3, 0)]).await.allowed);
    let opened = QuotaEvent {
        bucket: b[0].clone(),
        start: T0,
        end: T0 + DAY,
        quota: 3,
        previous: None,
    };
    assert_eq!(journaled(h, false).await, [opened]);
    // A dry run, a refusal and further spends in the period journal nothing.
    let march = [quota(3, 0)];
    let dry = Request::new(&b, &march, Op::DRY);
    assert!(h.store.apply(dry).await.unwrap().allowed);
    assert!(h.spend(&b, &[quota(3, 0)]).await.allowed);
    assert!(!h.spend(&b, &[quota(3, 0)]).await.allowed);
    assert_eq!(journaled(h, false).await, []);
    assert_eq!(
        h.journal.count(&b[0]).await.unwrap(),
        Some(QuotaCount {
            start: T0,
            count: 3
        })
    );
    // The next period, entered by another instance: its event names the
    // period it replaced and that period's final count, and a sweep finds
    // it though this instance was never told.
    h.clock.advance(Duration::from_micros(DAY + 1));
    assert!(
        h.other
            .apply(Request::new(&b, &[quota(5, 1)], Op::SPEND))
            .await
            .unwrap()
            .allowed
    );
    let turned = QuotaEvent {
        bucket: b[0].clone(),
        start: T0 + DAY,
        end: T0 + 2 * DAY,
        quota: 5,
        previous: Some(Closed {
            start: T0,
            end: T0 + DAY,
            count: 3,
        }),
    };
    assert_eq!(journaled(h, true).await, [turned]);
    assert_eq!(journaled(h, true).await, []);
    assert_eq!(
        h.journal.count(&b[0]).await.unwrap(),
        Some(QuotaCount {
            start: T0 + DAY,
            count: 1
        })
    );
    // A counter that never held anything counts nothing.
    let never = BucketKey::new("acme", kind, "exports", "nobody");
    assert_eq!(h.journal.count(&never).await.unwrap(), None);
}

/// Reports `weight` for `member` to `table` through `store`.
async fn share(
    store: &Arc<dyn Store>,
    table: &BucketKey,
    member: &str,
    weight: u64,
    ttl: u64,
) -> Share {
    store
        .share(ShareAsk {
            table,
            member,
            weight,
            ttl,
        })
        .await
        .unwrap()
}

/// Members reporting through two instances divide one limit: grants follow
/// the weights, grow only into what the others leave, never add up to more
/// than the whole, and members leave by expiring or on purpose.
async fn share_tables_divide_a_limit_across_instances(h: &Harness) {
    let table = key("acme", "alice");
    let ttl = 10_000_000;
    let a = share(&h.store, &table, "a", 100, ttl).await;
    assert_eq!(
        a,
        Share {
            ppm: shares::PPM,
            members: 1,
            full: false,
            waiting: false,
        }
    );
    // b reports through the other instance: a still holds everything.
    let b = share(&h.other, &table, "b", 300, ttl).await;
    assert_eq!((b.ppm, b.members, b.waiting), (0, 2, true));
    assert_eq!(share(&h.store, &table, "a", 100, ttl).await.ppm, 250_000);
    assert_eq!(share(&h.other, &table, "b", 300, ttl).await.ppm, 750_000);
    // A weight within a tenth keeps the grant as it is.
    assert_eq!(share(&h.other, &table, "b", 280, ttl).await.ppm, 750_000);
    // Another bucket's table is apart.
    let other = share(&h.store, &key("acme", "bob"), "a", 1, ttl).await;
    assert_eq!((other.ppm, other.members), (shares::PPM, 1));
    // a leaves on purpose; b grows into its part.
    assert_eq!(share(&h.store, &table, "a", 100, 0).await.members, 1);
    assert_eq!(
        share(&h.other, &table, "b", 300, ttl).await.ppm,
        shares::PPM
    );
    // c arrives and b's entry expires: c takes everything.
    assert_eq!(share(&h.store, &table, "c", 50, ttl).await.ppm, 0);
    h.clock.advance(Duration::from_micros(ttl));
    let c = share(&h.store, &table, "c", 50, ttl).await;
    assert_eq!(
        c,
        Share {
            ppm: shares::PPM,
            members: 1,
            full: false,
            waiting: false,
        }
    );

    // The same grants as the Rust arithmetic, for random weights and
    // members, and the grants in force never exceed the whole.
    let table = key("acme", "random");
    let mut held = std::collections::HashMap::new();
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for _ in 0..200 {
        let member = format!("m{}", next() % 6);
        let weight = 1 + next() % shares::MAX_WEIGHT;
        let total: u64 = weight
            + held
                .iter()
                .filter(|(m, _)| **m != member)
                .map(|(_, (w, _))| *w)
                .sum::<u64>();
        let others: u64 = held
            .iter()
            .filter(|(m, _)| **m != member)
            .map(|(_, (_, p))| *p)
            .sum();
        let current = held.get(&member).map(|(_, p)| *p);
        let store = if next() % 2 == 0 { &h.store } else { &h.other };
        let got = share(store, &table, &member, weight, ttl).await;
        assert_eq!(got.ppm, shares::grant(current, weight, total, others));
        let fair = shares::fair(weight, total);
        assert_eq!(
            got.waiting,
            shares::waiting(got.ppm, fair),
            "{got:?} of fair {fair}"
        );
        held.insert(member, (weight, got.ppm));
        assert!(held.values().map(|(_, p)| p).sum::<u64>() <= shares::PPM);
    }
}

/// A table holds at most `MAX_MEMBERS`; a newcomer to a full one is
/// granted nothing and the members keep theirs.
async fn a_full_share_table_grants_a_newcomer_nothing(h: &Harness) {
    let table = key("acme", "crowd");
    for i in 0..shares::MAX_MEMBERS {
        assert!(
            !share(&h.store, &table, &format!("m{i}"), 1, 10_000_000)
                .await
                .full
        );
    }
    let late = share(&h.other, &table, "late", 1_000, 10_000_000).await;
    assert_eq!(
        late,
        Share {
            ppm: 0,
            members: shares::MAX_MEMBERS as u64,
            full: true,
            waiting: false,
        }
    );
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
    charges_go_into_debt_down_to_the_floor,
    reserve_and_settle_across_instances,
    leases_fill_expire_release_and_renew,
    acquire_takes_tokens_and_slots_all_or_nothing,
    shadow_caps_never_refuse,
    five_hundred_acquirers_take_exactly_the_cap,
    quota_periods_are_journaled_once_each,
    alert_thresholds_fire_once_each_per_period,
    share_tables_divide_a_limit_across_instances,
    a_full_share_table_grants_a_newcomer_nothing,
);
