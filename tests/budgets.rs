//! Costs known only after the work, through the native API and a real
//! server: Reserve, Settle and Charge, debt, their errors, their metrics
//! and the in-debt views; and a reservation settled on another instance
//! sharing a real Redis.

use crate::common;

use std::time::Duration;

use common::redis::RedisServer;
use common::{TestServer, ask, micros, req, row};
use tollgate::proto::v1::{ChargeRequest, ReserveRequest, SettleRequest, SettleStatus};
use tollgate::server::StoreSpec;

/// Tenant `llm`: per key 1 000 tokens, 1 000 an hour (one every 3.6 s),
/// up to 500 below zero; a tenant-wide ceiling of 5 000 without debt.
fn rules() -> Vec<tollgate::limits::LimitRow> {
    let mut per_key = row("llm-key", "llm", "", "key", 1000, "1000/hour");
    per_key.debt = 500;
    vec![
        per_key,
        row("llm-tenant", "llm", "", "tenant", 5000, "5000/hour"),
    ]
}

fn reserve(key: &str, estimate: u64, ttl: Option<Duration>) -> ReserveRequest {
    ReserveRequest {
        key: key.into(),
        estimate,
        tenant: "llm".into(),
        resource: String::new(),
        ttl: ttl.map(|d| prost_types::Duration {
            seconds: d.as_secs() as i64,
            nanos: d.subsec_nanos() as i32,
        }),
    }
}

fn settle(reservation: &str, actual: u64) -> SettleRequest {
    SettleRequest {
        reservation: reservation.into(),
        actual,
    }
}

/// A metric's value, 0 when absent.
fn sample(metrics: &str, series: &str) -> u64 {
    common::envoy::sample(metrics, series).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserve_settle_charge_and_debt_through_the_native_api() {
    let server = TestServer::launch(Some(&rules()), |c| {
        c.sweep_interval = Duration::from_millis(20)
    })
    .await;
    let mut client = server.client().await;

    // Reserve 300: both buckets are charged; the key's is the tightest.
    let r = client
        .reserve(reserve("carol", 300, None))
        .await
        .unwrap()
        .into_inner();
    let decision = r.decision.unwrap();
    assert!(decision.allowed);
    assert_eq!(
        (decision.remaining, decision.limit_name.as_str()),
        (700, "llm-key")
    );
    assert!(r.reservation.starts_with("r1."), "{}", r.reservation);
    assert_eq!(micros(&r.ttl), 60_000_000, "one minute unless asked");

    // It cost 120: 180 come back to both buckets.
    let s = client
        .settle(settle(&r.reservation, 120))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(s.status, SettleStatus::Settled as i32);
    assert_eq!(
        (
            s.estimate,
            s.actual,
            s.refunded,
            s.charged,
            s.remaining,
            s.debt
        ),
        (300, 120, 180, 0, 880, 0)
    );
    // A retried settle changes nothing and says which one counted.
    let again = client
        .settle(settle(&r.reservation, 999))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.status, SettleStatus::AlreadySettled as i32);
    assert_eq!((again.actual, again.refunded, again.charged), (120, 180, 0));
    assert_eq!(ask(&mut client, req("llm", "carol")).await.remaining, 879);

    // 1 500 used after the fact: the key's bucket goes from 879 to its
    // floor of -500 (121 forgiven); the ceiling, without debt, to 3 379.
    let c = client
        .charge(ChargeRequest {
            key: "carol".into(),
            cost: 1500,
            tenant: "llm".into(),
            resource: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (c.remaining, c.debt, c.forgiven, c.limit_name.as_str()),
        (0, 500, 121, "llm-key")
    );
    assert_eq!(micros(&c.reset_after), 1500 * 3_600_000);

    // In debt, requests wait until the refill has covered the debt and the
    // token they need: 501 tokens at 3.6 s, exactly (the clock stands still).
    let refused = ask(&mut client, req("llm", "carol")).await;
    assert!(!refused.allowed);
    assert_eq!(refused.debt, 500);
    assert_eq!(micros(&refused.retry_after), 501 * 3_600_000);
    assert_eq!(refused.headers["Retry-After"], "1804");
    let r = client
        .reserve(reserve("carol", 10, None))
        .await
        .unwrap()
        .into_inner();
    assert!(!r.decision.unwrap().allowed);
    assert_eq!(r.reservation, "", "nothing reserved, nothing to settle");
    // Other keys are untouched.
    assert!(ask(&mut client, req("llm", "dave")).await.allowed);

    // The in-debt views name her.
    let (_, top) = server.http_get("/v1/top-limited").await.unwrap();
    let top: serde_json::Value = serde_json::from_str(&top).unwrap();
    assert_eq!(top["in_debt"][0]["tenant"], "llm");
    assert_eq!(top["in_debt"][0]["key"], "carol");
    assert_eq!(top["in_debt"][0]["debt"], 500);

    // Bad settles get statuses that say what happened.
    let bad = client.settle(settle("not-a-token", 1)).await.unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    assert!(
        bad.message().contains("not a token Reserve returned"),
        "{bad:?}"
    );
    let unknown = format!("r1.{}.6c6c6d", "0".repeat(32));
    let bad = client.settle(settle(&unknown, 1)).await.unwrap_err();
    assert_eq!(bad.code(), tonic::Code::NotFound);
    assert!(bad.message().contains("is unknown"), "{bad:?}");
    let bad = client
        .reserve(reserve("erin", 10, Some(Duration::from_secs(7200))))
        .await
        .unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    assert!(
        bad.message().contains("at most") || bad.message().contains("one hour"),
        "{bad:?}"
    );
    let bad = client
        .reserve(reserve("erin", 5000, None))
        .await
        .unwrap_err();
    assert_eq!(
        bad.code(),
        tonic::Code::InvalidArgument,
        "above the burst: {bad:?}"
    );

    // A reservation past its time to live keeps its estimate charged.
    let r = client
        .reserve(reserve("erin", 40, Some(Duration::from_secs(1))))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.decision.unwrap().remaining, 960);
    server.clock.advance(Duration::from_secs(1));
    let late = client.settle(settle(&r.reservation, 0)).await.unwrap_err();
    assert_eq!(late.code(), tonic::Code::FailedPrecondition);
    assert!(
        late.message().contains("estimate of 40 stays charged"),
        "{late:?}"
    );
    assert_eq!(ask(&mut client, req("llm", "erin")).await.remaining, 959);

    // What happened, counted. (This test runs in a process of its own.)
    let mut metrics = String::new();
    for _ in 0..200 {
        metrics = server.http_get("/metrics").await.unwrap().1;
        if sample(&metrics, "tollgate_reservations_expired_total") == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for (series, want) in [
        ("tollgate_reservations_total{api=\"native\"}", 2),
        ("tollgate_reserved_tokens_total{api=\"native\"}", 340),
        ("tollgate_refunded_tokens_total{api=\"native\"}", 180),
        (
            "tollgate_charged_tokens_total{api=\"native\",phase=\"charge\"}",
            1500,
        ),
        ("tollgate_forgiven_tokens_total{api=\"native\"}", 121),
        (
            "tollgate_settles_total{api=\"native\",status=\"settled\"}",
            1,
        ),
        (
            "tollgate_settles_total{api=\"native\",status=\"already_settled\"}",
            1,
        ),
        (
            "tollgate_settles_total{api=\"native\",status=\"unknown\"}",
            1,
        ),
        (
            "tollgate_settles_total{api=\"native\",status=\"expired\"}",
            1,
        ),
        ("tollgate_reservations_expired_total", 1),
        ("tollgate_tenant_debt_tokens{tenant=\"llm\"}", 500),
    ] {
        assert_eq!(sample(&metrics, series), want, "{series}\n{metrics}");
    }
    common::assert_promtool_accepts(&metrics);
}

/// On Redis, a reservation made through one instance is settled exactly
/// through another: the refund is seen by both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_settles_on_another_instance() {
    let redis = RedisServer::start();
    let rules = rules();
    let launch = || {
        let url = redis.url();
        TestServer::launch(Some(&rules), move |c| {
            c.store = StoreSpec::Redis(url);
            c.redis_uses_clock = true;
            c.sweep_interval = Duration::from_millis(50);
            c.store_timeout = Duration::from_secs(2);
        })
    };
    let (a, b) = (launch().await, launch().await);
    let (mut ca, mut cb) = (a.client().await, b.client().await);
    let r = ca
        .reserve(reserve("carol", 400, Some(Duration::from_secs(600))))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.decision.unwrap().remaining, 600);
    let s = cb
        .settle(settle(&r.reservation, 650))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(s.status, SettleStatus::Settled as i32);
    assert_eq!((s.charged, s.remaining, s.debt), (250, 350, 0));
    let again = ca
        .settle(settle(&r.reservation, 1))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.status, SettleStatus::AlreadySettled as i32);
    assert_eq!(again.actual, 650);
    let mut asked = req("llm", "carol");
    asked.dry_run = true;
    assert_eq!(ask(&mut ca, asked.clone()).await.remaining, 349);
    assert_eq!(ask(&mut cb, asked).await.remaining, 349);

    // Reservations that reach their time to live unsettled are counted by
    // the instance that made them (a second after, by its own clock); a
    // settled one is not, even once its time to live has passed. The
    // settled one lives 2 s, so that its settle lands in time on a machine
    // that stalls for a second.
    let reserved_at = tokio::time::Instant::now();
    let abandoned = ca
        .reserve(reserve("erin", 5, Some(Duration::from_millis(100))))
        .await
        .unwrap()
        .into_inner();
    let finished = ca
        .reserve(reserve("erin", 5, Some(Duration::from_secs(2))))
        .await
        .unwrap()
        .into_inner();
    assert!(!abandoned.reservation.is_empty() && !finished.reservation.is_empty());
    let settled = cb
        .settle(settle(&finished.reservation, 5))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(settled.status, SettleStatus::Settled as i32);
    let expired = || async {
        let (_, metrics) = a.http_get("/metrics").await.unwrap();
        sample(&metrics, "tollgate_reservations_expired_total")
    };
    for _ in 0..300 {
        if expired().await > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(expired().await, 1, "the abandoned reservation");
    // Past the settled one's check (its ttl, a second, and a sweep every
    // 50 ms): still one.
    tokio::time::sleep_until(reserved_at + Duration::from_millis(3_300)).await;
    assert_eq!(expired().await, 1);
}

/// Hostile or careless inputs to Reserve, Settle and Charge get a status
/// that says what to fix, and change nothing; extreme amounts are clamped,
/// never wrapped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_budget_requests_get_clear_errors_and_extremes_are_clamped() {
    let server = TestServer::launch(Some(&rules()), |_| {}).await;
    let mut client = server.client().await;
    let empty_key = client.reserve(reserve("", 1, None)).await.unwrap_err();
    assert_eq!(empty_key.code(), tonic::Code::InvalidArgument);
    assert!(
        empty_key.message().contains("key is empty"),
        "{empty_key:?}"
    );
    let huge = client
        .reserve(reserve("k", u64::MAX, None))
        .await
        .unwrap_err();
    assert_eq!(huge.code(), tonic::Code::InvalidArgument);
    assert!(huge.message().contains("exceeds the capacity"), "{huge:?}");
    let mut negative = reserve("k", 1, None);
    negative.ttl = Some(prost_types::Duration {
        seconds: -5,
        nanos: 0,
    });
    let negative = client.reserve(negative).await.unwrap_err();
    assert_eq!(negative.code(), tonic::Code::InvalidArgument);
    for token in [
        String::new(),
        "r1.".into(),
        format!("r1.{}.3a", "0".repeat(32)),
        format!("r1.{}.{}", "f".repeat(32), "61".repeat(300)),
        "r1.".repeat(10_000),
    ] {
        let bad = client.settle(settle(&token, 1)).await.unwrap_err();
        assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{token:.40}");
        assert!(
            bad.message().len() < 300,
            "the message quotes at most 64 bytes"
        );
    }
    // Counted once each, where they belong: the five tokens as invalid
    // settles; the empty key, the huge estimate and the negative ttl as
    // refused decisions.
    let (_, metrics) = server.http_get("/metrics").await.unwrap();
    assert_eq!(
        sample(
            &metrics,
            r#"tollgate_settles_total{api="native",status="invalid"}"#
        ),
        5
    );
    assert_eq!(
        sample(
            &metrics,
            r#"tollgate_decisions_total{api="native",outcome="error",rule=""}"#
        ),
        3
    );
    // Nothing above was charged.
    assert_eq!(ask(&mut client, req("llm", "k")).await.remaining, 999);

    // The largest amounts are clamped to 2^53: a settle of u64::MAX charges
    // the excess into debt down to the floor (the ceiling, without debt,
    // down to zero); a charge of u64::MAX likewise, the rest forgiven.
    let r = client
        .reserve(reserve("j", 10, None))
        .await
        .unwrap()
        .into_inner();
    let s = client
        .settle(settle(&r.reservation, u64::MAX))
        .await
        .unwrap()
        .into_inner();
    // The store applied 2^53 (above every capacity); the answer echoes
    // the actual given.
    assert_eq!((s.remaining, s.debt, s.actual), (0, 500, u64::MAX));
    assert_eq!(
        s.forgiven,
        ((1u64 << 53) - 10 - 1490) + ((1u64 << 53) - 10 - 4989)
    );
    let c = client
        .charge(ChargeRequest {
            key: "k".into(),
            cost: u64::MAX,
            tenant: "llm".into(),
            resource: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((c.remaining, c.debt), (0, 500));
    assert_eq!(c.forgiven, ((1u64 << 53) - 1499) + (1u64 << 53));
}

/// While Redis does not answer, budgets behave as the README's table says:
/// a reserve is answered by the rule's policy and reserves nothing (an
/// empty token); a charge under `local` lands in the instance's own bucket,
/// under `allow` it is not recorded (reported all forgiven, degraded); a
/// settle fails with UNAVAILABLE and succeeds when retried once Redis is
/// back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budgets_while_redis_does_not_answer() {
    use tollgate::proto::v1::Degraded;
    let redis = RedisServer::start();
    let mut open = row("open-key", "open", "", "key", 1000, "1000/hour");
    open.debt = 500;
    let mut local = row("local-key", "local", "", "key", 1000, "1000/hour");
    local.debt = 500;
    local.on_store_unavailable = "local".parse().unwrap();
    let rules = [open, local];
    let url = redis.url();
    let server = TestServer::launch(Some(&rules), move |c| {
        c.store = StoreSpec::Redis(url);
        c.redis_uses_clock = true;
        c.store_timeout = Duration::from_millis(200);
        c.breaker_threshold = 1000;
    })
    .await;
    let mut client = server.client().await;
    let charge = |tenant: &str, cost| ChargeRequest {
        key: "k".into(),
        cost,
        tenant: tenant.into(),
        resource: String::new(),
    };
    // Reserved while Redis answers.
    let mut early = None;
    for attempt in 0..20 {
        let mut request = reserve(
            &format!("early-{attempt}"),
            100,
            Some(Duration::from_secs(600)),
        );
        request.tenant = "open".into();
        let r = client.reserve(request).await.unwrap().into_inner();
        if !r.reservation.is_empty() {
            early = Some((r.reservation, format!("early-{attempt}")));
            break;
        }
    }
    let (early, early_key) = early.expect("Redis answered a reserve");

    redis.freeze();
    let mut open_reserve = reserve("k", 10, None);
    open_reserve.tenant = "open".into();
    let r = client.reserve(open_reserve).await.unwrap().into_inner();
    let decision = r.decision.unwrap();
    assert!(decision.allowed, "fail open");
    assert_eq!(decision.degraded(), Degraded::FailedOpen);
    assert_eq!(r.reservation, "", "nothing reserved, nothing to settle");

    let c = client
        .charge(charge("open", 40))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((c.degraded(), c.forgiven), (Degraded::FailedOpen, 40));
    let c = client
        .charge(charge("local", 1200))
        .await
        .unwrap()
        .into_inner();
    // This instance's own bucket of 1 000 takes it, 200 into its debt.
    assert_eq!(
        (c.degraded(), c.forgiven, c.remaining, c.debt),
        (Degraded::Local, 0, 0, 200)
    );

    let failed = client.settle(settle(&early, 30)).await.unwrap_err();
    assert_eq!(failed.code(), tonic::Code::Unavailable);

    redis.thaw();
    let mut settled = None;
    for _ in 0..50 {
        match client.settle(settle(&early, 30)).await {
            Ok(s) => {
                settled = Some(s.into_inner());
                break;
            }
            Err(e) => assert_eq!(e.code(), tonic::Code::Unavailable),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let s = settled.expect("the settle went through once Redis was back");
    // The settle that timed out may have run when Redis came back (it was
    // sent before the freeze was noticed): then the retry finds it settled.
    // Either way it counted once, at 30.
    assert!(
        s.status == SettleStatus::Settled as i32 || s.status == SettleStatus::AlreadySettled as i32,
        "{s:?}"
    );
    assert_eq!((s.estimate, s.actual, s.refunded), (100, 30, 70));
    let mut asked = req("open", &early_key);
    asked.dry_run = true;
    let r = ask(&mut client, asked).await;
    assert_eq!(r.remaining, 1000 - 30 - 1, "refunded once: 970 held");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_counters_count_what_was_applied_and_settle_echoes_the_actual() {
    let server = TestServer::launch(Some(&rules()), |_| {}).await;
    let mut client = server.client().await;
    // Charged to a tenant of its own, so the reserve below is not in debt.
    let charge = |cost| ChargeRequest {
        key: "dave".into(),
        cost,
        tenant: "other".into(),
        resource: String::new(),
    };
    let series = r#"tollgate_charged_tokens_total{api="native",phase="charge"}"#;
    client.charge(charge(1000)).await.unwrap();
    let (_, metrics) = server.http_get("/metrics").await.unwrap();
    assert_eq!(sample(&metrics, series), 1000);
    // Two charges of 2^64 - 1: each applies at most 2^53 (above every
    // capacity), and the counter counts that, never wrapping back.
    for _ in 0..2 {
        client.charge(charge(u64::MAX)).await.unwrap();
    }
    let (_, metrics) = server.http_get("/metrics").await.unwrap();
    assert_eq!(sample(&metrics, series), 1000 + 2 * (1 << 53));

    // A settle echoes the actual usage it was given.
    let r = client
        .reserve(reserve("erin", 10, None))
        .await
        .unwrap()
        .into_inner();
    let s = client
        .settle(settle(&r.reservation, u64::MAX))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(s.actual, u64::MAX);
    assert_eq!(s.status(), SettleStatus::Settled);
}

/// Reserves and settles racing over three instances on one key: 3 × 4
/// callers, each reserving on one instance and settling on the next, with
/// actual costs below, at and above the estimate. The bucket's consumption
/// is the sum of the actual costs the settles report, exactly (the rule's
/// refill of two tokens an hour adds less than a token during the test,
/// and whole tokens are reported). Then one reservation settled by nine callers
/// at once, three per instance: settled once, the other eight told it was
/// already settled at the first settle's cost, and the bucket charged once.
async fn reserves_and_settles_race_over_three_instances(url: String) {
    // A million tokens refilled at two an hour (a limit must refill within
    // a century): under a token of refill while the test runs.
    let mut per_key = row("race-key", "race", "", "key", 1_000_000, "2/hour");
    per_key.debt = 100_000;
    let rules = vec![per_key];
    let mut instances = Vec::new();
    for _ in 0..3 {
        let url = url.clone();
        instances.push(
            TestServer::launch(Some(&rules), move |c| {
                c.store = StoreSpec::Redis(url);
                c.store_timeout = Duration::from_secs(2);
            })
            .await,
        );
    }
    let mut clients = Vec::new();
    for i in &instances {
        clients.push(i.client().await);
    }
    let request = |estimate: u64| ReserveRequest {
        tenant: "race".into(),
        ..reserve("k", estimate, Some(Duration::from_secs(600)))
    };
    let mut tasks = Vec::new();
    for t in 0..12u64 {
        let (mut here, mut there) = (
            clients[t as usize % 3].clone(),
            clients[(t as usize + 1) % 3].clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut settled = 0u64;
            for j in 0..20u64 {
                let estimate = 10 + (t * 7 + j) % 20;
                // 0 to 39: refunds, exact settles and excesses alike.
                let actual = (t * 13 + j * 5) % 40;
                let r = here.reserve(request(estimate)).await.unwrap().into_inner();
                assert!(
                    !r.reservation.is_empty(),
                    "reserve {t}/{j} was recorded: {r:?}"
                );
                let s = there
                    .settle(settle(&r.reservation, actual))
                    .await
                    .unwrap()
                    .into_inner();
                assert_eq!(s.status, SettleStatus::Settled as i32);
                assert_eq!((s.estimate, s.actual), (estimate, actual));
                assert_eq!(
                    (s.refunded, s.charged),
                    (
                        estimate.saturating_sub(actual),
                        actual.saturating_sub(estimate)
                    )
                );
                settled += s.actual;
            }
            settled
        }));
    }
    let mut consumed = 0;
    for task in tasks {
        consumed += task.await.unwrap();
    }
    let mut asked = req("race", "k");
    asked.dry_run = true;
    // A dry run answers what a request of one token would leave.
    let left = ask(&mut clients[0], asked.clone()).await.remaining + 1;
    assert_eq!(
        1_000_000 - left,
        consumed,
        "the bucket spent exactly what the settles reported"
    );

    let r = clients[1].reserve(request(50)).await.unwrap().into_inner();
    let mut racers = Vec::new();
    for n in 0..9 {
        let mut client = clients[n % 3].clone();
        let token = r.reservation.clone();
        racers.push(tokio::spawn(async move {
            client
                .settle(settle(&token, 70 + n as u64))
                .await
                .unwrap()
                .into_inner()
        }));
    }
    let mut answers = Vec::new();
    for racer in racers {
        answers.push(racer.await.unwrap());
    }
    let firsts: Vec<_> = answers
        .iter()
        .filter(|s| s.status == SettleStatus::Settled as i32)
        .collect();
    assert_eq!(firsts.len(), 1, "settled exactly once: {answers:?}");
    let first = firsts[0].actual;
    for s in &answers {
        assert_eq!(
            s.actual, first,
            "every answer gives the first settle's cost"
        );
    }
    let now_left = ask(&mut clients[2], asked).await.remaining + 1;
    assert_eq!(left - now_left, first, "the bucket was charged once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserves_and_settles_race_over_three_instances_on_redis() {
    let redis = RedisServer::start();
    reserves_and_settles_race_over_three_instances(redis.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserves_and_settles_race_over_three_instances_on_a_cluster() {
    let cluster = common::redis::RedisCluster::start();
    reserves_and_settles_race_over_three_instances(cluster.url()).await;
}
