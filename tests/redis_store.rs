//! The Redis store beyond the shared contract: the Lua script against the
//! Rust arithmetic, one command per decision, NOSCRIPT, expiry, key format.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::T0;
use common::redis::{RedisCluster, RedisServer, evalsha_calls, redis_cli};
use redis::AsyncCommands;
use tollgate::algorithm::calendar::{Cycle, Period};
use tollgate::algorithm::{Algorithm, Charge, Limit, Micros, Op, Rate, State, plan};
use tollgate::clock::{Clock, ManualClock};
use tollgate_core::store::reservation::{Record, settle_plan};
use tollgate_core::store::{
    Attachment, BucketKey, BucketKind, RedisConfig, RedisStore, Request, Reservation,
    ReservationId, SettleStatus, Settled, Store, StoreError,
};

fn store(url: String, clock: &Arc<ManualClock>, margin: Duration) -> RedisStore {
    let config = RedisConfig {
        timeout: Duration::from_secs(5),
        expiry_margin: margin,
        ..RedisConfig::new(url)
    };
    let clock: Arc<dyn Clock> = clock.clone();
    RedisStore::new(config, Some(clock)).unwrap()
}

/// xorshift64*: a small deterministic generator, so a failure replays.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// How a differential run draws time and costs.
struct Sequence {
    seed: u64,
    limits: Vec<Limit>,
    /// Quotas, drawn like `limits`: each a quota's count and debt, and the
    /// period of `cycle` it counts in (at the step's instant).
    quotas: Vec<(Limit, Period)>,
    cycle: Cycle,
    /// The largest forward step of the clock, in µs.
    max_step: u64,
    /// One step in `jump_one_in` may move the clock by up to `max_jump` µs.
    jump_one_in: u64,
    max_jump: u64,
    /// One step in `tiny_one_in` moves the clock by 0 to 3 µs.
    tiny_one_in: u64,
    /// One cost in `zero_cost_one_in` is 0.
    zero_cost_one_in: u64,
    steps: usize,
}

/// The Lua script and the Rust arithmetic decide `sequence` identically,
/// verdict by verdict and stored state by stored state. Returns (steps
/// allowed, steps denied, steps where the clock went back).
async fn differential(sequence: Sequence) -> (u32, u32, u32) {
    let server = RedisServer::start();
    let clock = Arc::new(ManualClock::new(T0));
    // A long expiry margin: real time must not expire keys the simulated
    // clock still considers in use.
    let store = store(server.url(), &clock, Duration::from_secs(3600));
    let mut conn = connect(&server).await;
    let limits = &sequence.limits;
    let keys: Vec<BucketKey> = (0..4)
        .map(|i| BucketKey::new("diff", BucketKind::KEY, "", &format!("key{i}")))
        .collect();
    let mut states: HashMap<BucketKey, State> = HashMap::new();
    // Each bucket's algorithm when last written: how its state is stored.
    let mut written_as: HashMap<BucketKey, Algorithm> = HashMap::new();
    let quotas = &sequence.quotas;
    let mut rng = Rng(sequence.seed);
    let mut now: Micros = T0;
    let (mut allowed_steps, mut denied_steps, mut backwards_steps) = (0, 0, 0);
    let mut reservations: Vec<(ReservationId, Record, Vec<BucketKey>)> = Vec::new();
    let (mut settles, mut in_debt, mut forgiven) = (0, 0, 0);

    for step in 0..sequence.steps {
        // Time: mostly forward, sometimes by a few µs, sometimes back by up
        // to a second.
        if rng.below(20) == 0 {
            now -= rng.below(1_000_000);
            backwards_steps += 1;
        } else if rng.below(sequence.tiny_one_in) == 0 {
            now += rng.below(4);
        } else if rng.below(sequence.jump_one_in) == 0 {
            now += rng.below(sequence.max_jump);
        } else {
            now += rng.below(sequence.max_step);
        }
        clock.set(now);
        // 1 to 3 distinct buckets, each under a possibly different limit
        // than last time (limit changes), costs sometimes above the burst,
        // needs sometimes above the cost (an ask that spends less).
        let n = 1 + rng.below(3) as usize;
        let start = rng.below(4) as usize;
        let buckets: Vec<BucketKey> = (0..n).map(|i| keys[(start + i) % 4].clone()).collect();
        let op = match rng.below(20) {
            0..=1 => Step::Charge,
            2..=3 => Step::Reserve,
            4..=5 => Step::Settle,
            6 => Step::Decide(Op::DRY),
            // A refund of tokens charged up to two windows of the
            // longest limit ago (or, now and then, in the future).
            7 => Step::Decide(Op::Refund {
                since: now - rng.below(120_000_000) + rng.below(2_000_000),
            }),
            _ => Step::Decide(Op::SPEND),
        };
        let lines = 1 + rng.below(2);
        let charges: Vec<Charge> = buckets
            .iter()
            .map(|_| {
                let pick = rng.below((limits.len() + quotas.len()) as u64) as usize;
                let limit = match pick.checked_sub(limits.len()) {
                    None => limits[pick],
                    Some(q) => {
                        let (quota, period) = quotas[q];
                        quota.in_period(sequence.cycle.bounds(period, now))
                    }
                };
                let mut cost = if rng.below(sequence.zero_cost_one_in) == 0 {
                    0
                } else {
                    1 + rng.below(limit.burst() + 1)
                };
                if matches!(op, Step::Charge | Step::Decide(Op::Refund { .. })) {
                    // After the fact: anything up to several bursts, and
                    // now and then the largest cost there is.
                    cost = if rng.below(10) == 0 {
                        rng.below(1 << 53)
                    } else {
                        rng.below(3 * (limit.burst() + limit.debt()).min(1 << 40) + 2)
                    };
                }
                let need = if rng.below(4) == 0 {
                    cost + rng.below(3)
                } else {
                    cost
                };
                Charge {
                    limit,
                    cost,
                    need,
                    enforce: rng.below(5) != 0,
                }
            })
            .collect();
        let seed = sequence.seed;
        let before: Vec<Option<State>> = buckets.iter().map(|b| states.get(b).copied()).collect();
        let (touched, expected) = match op {
            Step::Decide(_) | Step::Charge => {
                let op = match op {
                    Step::Decide(op) => op,
                    _ => Op::Charge,
                };
                let expected = plan(&before, &charges, now, op);
                in_debt += expected.verdicts.iter().filter(|v| v.debt > 0).count();
                forgiven += expected.verdicts.iter().filter(|v| v.forgiven > 0).count();
                let got = store
                    .apply(Request::new(&buckets, &charges, op))
                    .await
                    .unwrap();
                assert_eq!(
                    (got.allowed, &got.verdicts),
                    (expected.allowed, &expected.verdicts),
                    "seed {seed:#x} step {step}: {op:?} of {charges:?} with {before:?}"
                );
                for ((bucket, charge), write) in buckets.iter().zip(&charges).zip(&expected.writes)
                {
                    if write.is_some() {
                        written_as.insert(bucket.clone(), charge.limit.algorithm());
                    }
                }
                (
                    buckets
                        .iter()
                        .cloned()
                        .zip(expected.writes)
                        .collect::<Vec<_>>(),
                    expected.allowed,
                )
            }
            Step::Reserve => {
                // A reservation: one estimate per line, `lines` lines per
                // bucket (rules sharing it).
                let estimate = charges[0].cost;
                let charges: Vec<Charge> = charges
                    .iter()
                    .map(|c| Charge {
                        cost: (lines * estimate).min(c.limit.burst() + 1),
                        need: (lines * estimate).min(c.limit.burst() + 1),
                        ..*c
                    })
                    .collect();
                let ttl = 1 + rng.below(sequence.max_step * 3);
                let reservation = Reservation {
                    id: ReservationId::new("diff"),
                    estimate,
                    lines: vec![lines; n],
                    ttl,
                };
                let expected = plan(&before, &charges, now, Op::SPEND);
                let got = store
                    .apply(
                        Request::new(&buckets, &charges, Op::SPEND)
                            .attach(&Attachment::Reservation(reservation.clone())),
                    )
                    .await
                    .unwrap();
                assert_eq!(
                    (got.allowed, &got.verdicts),
                    (expected.allowed, &expected.verdicts),
                    "seed {seed:#x} step {step}: reserve {charges:?} with {before:?}"
                );
                if expected.allowed {
                    let spent: Vec<usize> =
                        (0..n).filter(|&i| expected.verdicts[i].allowed).collect();
                    let record = Record {
                        reserved_at: now,
                        expires_at: now + ttl.min(tollgate_core::store::reservation::MAX_TTL),
                        estimate,
                        charges: spent.iter().map(|&i| charges[i]).collect(),
                        lines: vec![lines; spent.len()],
                        settled: None,
                    };
                    let held: Vec<BucketKey> = spent.iter().map(|&i| buckets[i].clone()).collect();
                    reservations.push((reservation.id.clone(), record, held));
                }
                for ((bucket, charge), write) in buckets.iter().zip(&charges).zip(&expected.writes)
                {
                    if write.is_some() {
                        written_as.insert(bucket.clone(), charge.limit.algorithm());
                    }
                }
                (
                    buckets.iter().cloned().zip(expected.writes).collect(),
                    expected.allowed,
                )
            }
            Step::Settle => {
                let actual = rng.below(2 * limits[0].burst() + 2);
                let pick = rng.below(reservations.len() as u64 + 1) as usize;
                let Some((id, record, held)) = reservations.get_mut(pick) else {
                    let unknown = store
                        .settle(&ReservationId::new("diff"), actual)
                        .await
                        .unwrap();
                    assert_eq!(unknown.status, SettleStatus::Unknown);
                    continue;
                };
                let got = store.settle(id, actual).await.unwrap();
                let status = match record.settled {
                    Some(actual) => SettleStatus::AlreadySettled { actual },
                    None if record.expires_at <= now => SettleStatus::Expired,
                    None => SettleStatus::Settled,
                };
                let mut touched = Vec::new();
                let mut verdicts = Vec::new();
                if status == SettleStatus::Settled {
                    let states_now: Vec<Option<State>> =
                        held.iter().map(|b| states.get(b).copied()).collect();
                    let (v, writes) = settle_plan(record, &states_now, actual, now);
                    verdicts = v;
                    for ((bucket, charge), write) in held.iter().zip(&record.charges).zip(&writes) {
                        if write.is_some() {
                            written_as.insert(bucket.clone(), charge.limit.algorithm());
                        }
                    }
                    touched = held.iter().cloned().zip(writes).collect();
                    record.settled = Some(actual);
                }
                assert_eq!(
                    got,
                    Settled {
                        status,
                        estimate: record.estimate,
                        verdicts,
                    },
                    "seed {seed:#x} step {step}: settle at {actual} of {record:?}"
                );
                settles += 1;
                (touched, true)
            }
        };
        for (bucket, write) in &touched {
            if let Some(state) = write {
                states.insert(bucket.clone(), *state);
            }
            let stored: Option<String> = conn.get(store.redis_key(bucket)).await.unwrap();
            let want = states.get(bucket).map(|s| match s {
                State::Tokens(s) => format!("{}:{}:{}", s.full_at, s.interval, s.burst),
                State::Window(w) if written_as.get(bucket) == Some(&Algorithm::Quota) => {
                    format!(
                        "q:{}:{}:{}",
                        w.start,
                        w.count,
                        tollgate::algorithm::window::quota_end(*w)
                    )
                }
                State::Window(w) => format!("w:{}:{}:{}", w.start, w.count, w.previous),
                State::Leases(_) => unreachable!("this sequence draws no concurrency caps"),
            });
            assert_eq!(
                stored, want,
                "seed {seed:#x} step {step}: stored state of {bucket:?}"
            );
        }
        if expected {
            allowed_steps += 1
        } else {
            denied_steps += 1
        }
    }
    // The sequence went into debt, hit debt floors and settled.
    assert!(
        settles > 20 && in_debt > 20 && forgiven > 20,
        "seed {:#x}: {settles} settles, {in_debt} verdicts in debt, {forgiven} with tokens forgiven",
        sequence.seed
    );
    (allowed_steps, denied_steps, backwards_steps)
}

/// What a differential step does.
#[derive(Debug, Clone, Copy)]
enum Step {
    Decide(Op),
    Charge,
    Reserve,
    Settle,
}

fn limits(specs: &[(u64, &str)]) -> Vec<Limit> {
    specs
        .iter()
        .map(|(b, r)| Limit::new(*b, r.parse::<Rate>().unwrap()).unwrap())
        .collect()
}

#[tokio::test]
async fn lua_and_rust_make_identical_decisions_on_random_sequences() {
    let mut everyday = limits(&[
        (5, "10/second"),
        (3, "1/second"),
        (30, "600/minute"),
        (2, "3000/second"),
        (7, "5/hour"),
    ]);
    // Windows too: fixed and sliding, per second and per minute.
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindow] {
        for rate in ["4/second", "9/minute"] {
            everyday.push(Limit::window(algorithm, rate.parse().unwrap()).unwrap());
        }
    }
    // And limits that allow debt, of every algorithm.
    let with_debt: Vec<Limit> = everyday
        .iter()
        .zip([7, 30, 1, 100, 2, 5, 50, 3, 20])
        .map(|(l, debt)| l.with_debt(debt).unwrap())
        .collect();
    everyday.extend(with_debt);
    let (allowed, denied, backwards) = differential(Sequence {
        seed: 0x9e37_79b9_7f4a_7c15,
        limits: everyday,
        quotas: Vec::new(),
        cycle: Cycle::default(),
        max_step: 2_000_000,
        jump_one_in: 100,
        max_jump: 3_600_000_000,
        tiny_one_in: 10,
        zero_cost_one_in: 50,
        steps: 3000,
    })
    .await;
    // The sequence exercised both outcomes and the backwards clock.
    assert!(
        allowed > 500 && denied > 500 && backwards > 50,
        "{allowed} {denied} {backwards}"
    );
}

/// The script's usual call (every request spends, every bucket a token
/// bucket without a debt floor) has a path of its own, which this sequence
/// takes at nearly every spend: single and multi-bucket requests, shadow
/// buckets that refuse beside enforced ones that admit, costs above the
/// burst, the clock stepping by a few µs and back.
#[tokio::test]
async fn lua_and_rust_agree_on_the_usual_call() {
    let (allowed, denied, backwards) = differential(Sequence {
        seed: 0x51_7cc1_b727_220a,
        limits: limits(&[
            (5, "10/second"),
            (3, "1/second"),
            (30, "600/minute"),
            (2, "3000/second"),
        ]),
        quotas: Vec::new(),
        cycle: Cycle::default(),
        max_step: 500_000,
        jump_one_in: 200,
        max_jump: 60_000_000,
        tiny_one_in: 5,
        zero_cost_one_in: 20,
        steps: 3000,
    })
    .await;
    assert!(
        allowed > 500 && denied > 500 && backwards > 50,
        "{allowed} {denied} {backwards}"
    );
}

/// Where Lua's doubles and Rust's integers could part: bursts and costs up
/// to the largest tolerance (100 years of µs, 3.15e15), 1 µs intervals,
/// year-long limits and windows, clock steps from 0 µs to two years, costs
/// of 0 and above the burst. Two seeds.
///
/// The clock stays within a few decades of T0 (2023): a full-at instant is
/// at most now + 100 years, and Lua's doubles hold integers exactly only up
/// to 2^53 µs after 1970 (the year 2255), so the two agree for clocks before
/// 2155. Letting this test's clock drift past that (1 500 steps of up to two
/// years) made them differ by 1 µs, which is how that limit was found.
#[tokio::test]
async fn lua_and_rust_agree_at_the_extremes() {
    let max = tollgate::algorithm::MAX_TOLERANCE;
    let mut extreme = limits(&[
        (max, "1000000/second"),
        (max / 2 + 1, "1000000/second"),
        (1, "1000000/second"),
        (100, "1/year"),
        (1, "1/year"),
        (3, "7/week"),
    ]);
    extreme
        .push(Limit::window(Algorithm::FixedWindow, "4000000000/year".parse().unwrap()).unwrap());
    extreme.push(Limit::window(Algorithm::FixedWindow, "1/year".parse().unwrap()).unwrap());
    extreme.push(Limit::window(Algorithm::SlidingWindow, "1000/day".parse().unwrap()).unwrap());
    // Debt floors at the largest refill time, and a sliding window's at
    // the largest exact weighting.
    extreme.push(
        limits(&[(max / 2, "1000000/second")])[0]
            .with_debt(max / 2)
            .unwrap(),
    );
    extreme.push(
        limits(&[(1, "1000000/second")])[0]
            .with_debt(max - 1)
            .unwrap(),
    );
    extreme.push(limits(&[(1, "1/year")])[0].with_debt(99).unwrap());
    let sliding = Limit::window(Algorithm::SlidingWindow, "1000/day".parse().unwrap()).unwrap();
    extreme.push(sliding.with_debt((1 << 52) / 86_400_000 - 1000).unwrap());
    for seed in [0x0123_4567_89ab_cdef_u64, 0xdead_beef_cafe_f00d] {
        let (allowed, denied, backwards) = differential(Sequence {
            seed,
            limits: extreme.clone(),
            quotas: Vec::new(),
            cycle: Cycle::default(),
            max_step: 3_600_000_000,
            jump_one_in: 50,
            max_jump: 2 * 365 * 86_400_000_000,
            tiny_one_in: 3,
            zero_cost_one_in: 10,
            steps: 1500,
        })
        .await;
        assert!(
            allowed > 100 && denied > 100 && backwards > 20,
            "seed {seed:#x}: {allowed} {denied} {backwards}"
        );
    }
}

/// Quotas on a billing cycle in New York, beside token buckets: days
/// (23 and 25 hours long across the DST changes the clock passes), weeks
/// from Wednesday and months from the 31st, with and without debt; steps of
/// up to ten minutes and jumps of up to three days, so periods turn often.
#[tokio::test]
async fn lua_and_rust_agree_on_quotas() {
    let quota = |count, debt| {
        let bounds = tollgate::algorithm::calendar::Bounds { start: 0, end: 1 };
        Limit::quota(count, bounds)
            .unwrap()
            .with_debt(debt)
            .unwrap()
    };
    let quotas = vec![
        (quota(40, 0), Period::Day),
        (quota(9, 5), Period::Day),
        (quota(200, 0), Period::Week),
        (quota(300, 60), Period::Month),
        (quota(1, 0), Period::Month),
    ];
    let (allowed, denied, backwards) = differential(Sequence {
        seed: 0x5151_7a7a_0101_2323,
        limits: limits(&[(5, "10/minute"), (20, "100/hour")])
            .into_iter()
            .map(|l| l.with_debt(10).unwrap())
            .collect(),
        quotas,
        cycle: Cycle::new("America/New_York", 31, 1, "wednesday").unwrap(),
        max_step: 600_000_000,
        jump_one_in: 40,
        max_jump: 3 * 86_400_000_000,
        tiny_one_in: 10,
        zero_cost_one_in: 50,
        steps: 3000,
    })
    .await;
    assert!(
        allowed > 500 && denied > 500 && backwards > 50,
        "{allowed} {denied} {backwards}"
    );
}

#[tokio::test]
async fn one_evalsha_per_decision_and_noscript_is_handled() {
    let server = RedisServer::start();
    let clock = Arc::new(ManualClock::new(T0));
    let store = store(server.url(), &clock, Duration::from_secs(1));
    let c = [Charge {
        limit: Limit::new(1000, "1/second".parse().unwrap()).unwrap(),
        cost: 1,
        need: 1,
        enforce: true,
    }];
    let b = [
        BucketKey::new("acme", BucketKind::KEY, "", "alice"),
        BucketKey::new("acme", BucketKind::TENANT, "", ""),
    ];
    let c2 = [c[0], c[0]];
    store.apply(Request::new(&b, &c2, Op::SPEND)).await.unwrap(); // loads the script
    redis_cli(server.port, &["CONFIG", "RESETSTAT"]);
    for _ in 0..100 {
        assert!(
            store
                .apply(Request::new(&b, &c2, Op::SPEND))
                .await
                .unwrap()
                .allowed
        );
    }
    let stats = redis_cli(server.port, &["INFO", "commandstats"]);
    assert!(stats.contains("cmdstat_evalsha:calls=100,"), "{stats}");
    assert!(
        !stats.contains("cmdstat_script"),
        "no SCRIPT LOAD on the hot path: {stats}"
    );

    // After SCRIPT FLUSH (as after a restart or failover) the next decision
    // reloads the script by itself.
    redis_cli(server.port, &["SCRIPT", "FLUSH"]);
    let o = store.apply(Request::new(&b, &c2, Op::SPEND)).await.unwrap();
    assert!(o.allowed);
    assert_eq!(o.verdicts[0].remaining, 1000 - 102);
}

#[tokio::test]
async fn keys_follow_the_documented_format_and_expire_when_full() {
    let server = RedisServer::start();
    let clock = Arc::new(ManualClock::new(T0));
    let config = RedisConfig {
        prefix: "rl:".into(),
        expiry_margin: Duration::from_millis(200),
        ..RedisConfig::new(server.url())
    };
    let pinned: Arc<dyn Clock> = clock.clone();
    let store = RedisStore::new(config, Some(pinned)).unwrap();
    let c = [Charge {
        limit: Limit::new(10, "10/second".parse().unwrap()).unwrap(),
        cost: 3,
        need: 3,
        enforce: true,
    }];
    store
        .apply(Request::new(
            &[BucketKey::new(
                "acme",
                BucketKind::KEY,
                "exports",
                "alice:1",
            )],
            &c,
            Op::SPEND,
        ))
        .await
        .unwrap();
    store
        .apply(Request::new(
            &[BucketKey::new("", BucketKind::TENANT, "", "")],
            &c,
            Op::SPEND,
        ))
        .await
        .unwrap();
    let mut keys: Vec<String> = redis_cli(server.port, &["KEYS", "*"])
        .lines()
        .map(str::to_owned)
        .collect();
    keys.sort();
    assert_eq!(keys, ["rl:{@default}:t::", "rl:{acme}:k:exports:alice:1"]);
    // Full again 300 ms after the spend, plus the 200 ms margin.
    let ttl: i64 = redis_cli(server.port, &["PTTL", "rl:{acme}:k:exports:alice:1"])
        .parse()
        .unwrap();
    assert!(ttl > 0 && ttl <= 500, "ttl {ttl}");
    let mut gone = false;
    for _ in 0..500 {
        if redis_cli(server.port, &["DBSIZE"]) == "0" {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(gone, "idle buckets expire");
}

#[tokio::test]
async fn a_cluster_refuses_one_call_across_tenants_but_not_a_single_redis() {
    let cluster = RedisCluster::start();
    let clock = Arc::new(ManualClock::new(T0));
    let on_cluster = store(cluster.url(), &clock, Duration::from_secs(1));
    let c = [Charge {
        limit: Limit::new(10, "1/second".parse().unwrap()).unwrap(),
        cost: 1,
        need: 1,
        enforce: true,
    }; 2];
    let b = [
        BucketKey::new("acme", BucketKind::KEY, "", "a"),
        BucketKey::new("globex", BucketKind::KEY, "", "a"),
    ];
    let err = on_cluster
        .apply(Request::new(&b, &c, Op::SPEND))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Unsupported(_)), "{err:?}");
    assert_eq!(
        err.to_string(),
        "on a Redis Cluster one call can only touch one tenant's buckets, but this one touches tenants \"acme\" and \"globex\"; send them in separate calls"
    );
    // Same tenant: one slot, fine.
    let same = [
        BucketKey::new("acme", BucketKind::KEY, "", "a"),
        BucketKey::new("acme", BucketKind::TENANT, "", ""),
    ];
    assert!(
        on_cluster
            .apply(Request::new(&same, &c, Op::SPEND))
            .await
            .unwrap()
            .allowed
    );

    let server = RedisServer::start();
    let single = store(server.url(), &clock, Duration::from_secs(1));
    assert!(
        single
            .apply(Request::new(&b, &c, Op::SPEND))
            .await
            .unwrap()
            .allowed
    );

    // Through gRPC, a batch across tenants on the cluster is the caller's
    // to split: INVALID_ARGUMENT with the same message, nothing charged,
    // and each tenant's part alone works.
    use tollgate::proto::v1::{BatchItem, ShouldAllowBatchRequest};
    let url = cluster.url();
    let served = common::TestServer::launch(None, move |c| {
        c.store = tollgate::server::StoreSpec::Redis(url);
        c.store_timeout = Duration::from_secs(2);
    })
    .await;
    served.wait_ready().await;
    let mut client = served.client().await;
    let item = |tenant: &str| BatchItem {
        key: "a".into(),
        cost: 1,
        resource: String::new(),
        tenant: tenant.into(),
    };
    let batch = |tenants: &[&str]| ShouldAllowBatchRequest {
        items: tenants.iter().map(|t| item(t)).collect(),
        dry_run: false,
    };
    let status = client
        .should_allow_batch(batch(&["acme", "globex"]))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert_eq!(
        status.message(),
        "on a Redis Cluster one call can only touch one tenant's buckets, but this one touches tenants \"acme\" and \"globex\"; send them in separate calls"
    );
    for tenant in ["acme", "globex"] {
        let r = client
            .should_allow_batch(batch(&[tenant]))
            .await
            .unwrap()
            .into_inner();
        assert!(r.allowed);
        // The default rule's burst of 30, less this one call: the refused
        // batch charged nothing.
        assert_eq!(r.results[0].remaining, 29, "{tenant}");
    }
    served.stop().await;
}

#[test]
fn store_urls_are_checked_and_passwords_never_shown() {
    for (url, ok) in [
        ("redis://127.0.0.1:6379", true),
        ("rediss://user:secret@redis.example:6380/2", true),
        ("redis-cluster://10.0.0.1:7000,10.0.0.2:7000", true),
        ("rediss-cluster://:secret@a:7000,b:7000", true),
        (
            "redis-sentinel://10.0.0.1:26379,10.0.0.2:26379/mymaster",
            true,
        ),
        ("rediss-sentinel://user:secret@s1:26379/mymaster/3", true),
        ("redis-cluster://", false),
        ("redis-sentinel://10.0.0.1:26379", false),
        ("redis-sentinel:///mymaster", false),
        ("redis-sentinel://:secret@s1:notaport/mymaster", false),
        ("memcached://x:1", false),
    ] {
        let config = RedisConfig::new(url);
        assert_eq!(config.validate().is_ok(), ok, "{url}");
        assert!(!config.redacted_url().contains("secret"));
        if let Err(e) = config.validate() {
            assert!(!e.contains("secret"), "{e}");
        }
    }
    // What a wrong Sentinel URL says to fix.
    assert_eq!(
        RedisConfig::new("redis-sentinel://s1:26379").validate(),
        Err(
            "store URL \"redis-sentinel://s1:26379\": name the Sentinel service after the hosts: \
             redis-sentinel://host:port,host:port/mymaster"
                .into()
        )
    );
    assert_eq!(
        RedisConfig::new("redis://:secret@h:1").redacted_url(),
        "redis://:***@h:1"
    );
    // TLS without checking the server's certificate is refused, saying
    // what to give instead.
    let insecure = RedisStore::new(
        RedisConfig::new("rediss://:secret@127.0.0.1:6380/#insecure"),
        None,
    );
    assert_eq!(
        insecure.err().map(|e| e.to_string()),
        Some(
            "store configuration: rediss://:***@127.0.0.1:6380/#insecure: rediss:// with #insecure \
             is not supported: give the server's CA with --redis-ca-cert"
                .into()
        )
    );
}

/// A plain client connection to `server`, to look at keys or call the
/// script directly.
async fn connect(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// A store coalescing up to 64 decisions per script call, on a pinned clock.
fn coalescing_store(url: String) -> Arc<dyn Store> {
    coalescing_store_with_timeout(url, Duration::from_secs(5))
}

fn coalescing_store_with_timeout(url: String, timeout: Duration) -> Arc<dyn Store> {
    let config = RedisConfig {
        timeout,
        coalesce: 64,
        ..RedisConfig::new(url)
    };
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(T0));
    Arc::new(RedisStore::new(config, Some(clock)).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalesced_decisions_share_script_calls_and_stay_exact() {
    let server = RedisServer::start();
    let store = coalescing_store(server.url());
    let hot = Charge {
        limit: Limit::new(100, "1/day".parse().unwrap()).unwrap(),
        cost: 1,
        need: 1,
        enforce: true,
    };
    // Load the script, then race 500 decisions at a fresh bucket of 100
    // (each also charging a bucket of its own, so each call carries a mix).
    store
        .apply(Request::new(
            &[BucketKey::new("warm", BucketKind::KEY, "", "up")],
            &[hot],
            Op::SPEND,
        ))
        .await
        .unwrap();
    redis_cli(server.port, &["CONFIG", "RESETSTAT"]);
    let mut tasks = Vec::new();
    for i in 0..500 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let b = [
                BucketKey::new("race", BucketKind::KEY, "", "hot"),
                BucketKey::new("race", BucketKind::KEY, "", &format!("own-{i}")),
            ];
            store
                .apply(Request::new(&b, &[hot, hot], Op::SPEND))
                .await
                .unwrap()
        }));
    }
    let mut admitted = 0;
    let mut remaining_seen = Vec::new();
    for t in tasks {
        let o = t.await.unwrap();
        if o.allowed {
            admitted += 1;
            remaining_seen.push(o.verdicts[0].remaining);
            assert_eq!(o.verdicts[1].remaining, 99, "its own bucket is spent once");
        } else {
            assert_eq!(o.verdicts[0].remaining, 0);
            assert_eq!(
                o.verdicts[1].remaining, 100,
                "a refused decision spends nothing"
            );
        }
    }
    assert_eq!(admitted, 100);
    // Every admitted decision saw a distinct remaining count: 99 down to 0,
    // as if they had been made one at a time.
    remaining_seen.sort_unstable();
    assert_eq!(remaining_seen, (0..100).collect::<Vec<u64>>());
    let calls = evalsha_calls(server.port);
    assert!(
        calls < 500,
        "500 concurrent decisions went out in {calls} script calls; coalescing should share calls"
    );
    // Own buckets of refused decisions were never written.
    let written = redis_cli(
        server.port,
        &["--scan", "--pattern", "tollgate:{race}:k::own-*"],
    );
    assert_eq!(written.lines().count(), 100);
}

#[tokio::test]
async fn the_script_refuses_a_malformed_request_list_and_writes_nothing() {
    let server = RedisServer::start();
    let mut conn = connect(&server).await;
    let script = redis::Script::new(tollgate_core::store::TOKEN_BUCKET_LUA);
    let args = |inv: &mut redis::ScriptInvocation| {
        inv.key("tollgate:{t}:k::a")
            .key("tollgate:{t}:k::b")
            .arg("")
            .arg("1s")
            .arg(1000);
        for _ in 0..2 {
            inv.arg("t").arg(1_000_000).arg(10).arg(1).arg("1");
        }
    };
    let mut inv = script.prepare_invoke();
    args(&mut inv);
    let err = inv.invoke_async::<Vec<i64>>(&mut conn).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("ARGV[2] 1s covers 1 keys, but the call has 2"),
        "{err}"
    );
    // Requests not separated by commas are one request with an argument,
    // here too few for two keys.
    let mut inv = script.prepare_invoke();
    inv.key("tollgate:{t}:k::a")
        .key("tollgate:{t}:k::b")
        .arg("")
        .arg("1s1s")
        .arg(1000);
    for _ in 0..2 {
        inv.arg("t1").arg("1000000:10").arg("1");
    }
    let err = inv.invoke_async::<Vec<i64>>(&mut conn).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("ARGV[2] 1s1s covers 1 keys, but the call has 2"),
        "{err}"
    );
    // The usual form naming a key, a limit or a cost the call lacks, or a
    // request of no buckets, writes nothing and says which.
    for plan in [
        &b"=\x01\x01\x03\x01\x00"[..],
        b"=\x01\x01\x01\x02\x00",
        b"=\x01\x01\x01\x01\x01",
        b"=\x01\x01\x01\x01",
        b"=\x01\x00",
    ] {
        let mut inv = script.prepare_invoke();
        inv.key("tollgate:{t}:k::a")
            .key("tollgate:{t}:k::b")
            .arg("")
            .arg(plan)
            .arg(1000)
            .arg("1000000:10");
        let err = inv.invoke_async::<Vec<i64>>(&mut conn).await.unwrap_err();
        let err = err.to_string();
        assert!(
            err.contains("ARGV[2] names a key, limit or cost the call does not have")
                || err.contains("a request in ARGV[2] has no buckets"),
            "{plan:?}: {err}"
        );
    }
    let keys: Vec<String> = conn.keys("tollgate:*").await.unwrap();
    assert!(keys.is_empty(), "{keys:?}");
}

/// Large requests are not merged into one long script call (Redis serves
/// nobody else while a script runs): eight concurrent batches of 1 000
/// buckets go out as exactly eight calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_batches_go_out_one_per_call() {
    let server = RedisServer::start();
    let store = coalescing_store(server.url());
    let charge = Charge {
        limit: Limit::new(1_000_000, "1/second".parse().unwrap()).unwrap(),
        cost: 1,
        need: 1,
        enforce: true,
    };
    store
        .apply(Request::new(
            &[BucketKey::new("warm", BucketKind::KEY, "", "up")],
            &[charge],
            Op::SPEND,
        ))
        .await
        .unwrap();
    redis_cli(server.port, &["CONFIG", "RESETSTAT"]);
    let mut tasks = Vec::new();
    for b in 0..8 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let keys: Vec<BucketKey> = (0..1000)
                .map(|i| BucketKey::new("big", BucketKind::KEY, "", &format!("b{b}-{i}")))
                .collect();
            store
                .apply(Request::new(&keys, &vec![charge; 1000], Op::SPEND))
                .await
                .unwrap()
        }));
    }
    for t in tasks {
        assert!(t.await.unwrap().allowed);
    }
    assert_eq!(evalsha_calls(server.port), 8);
    let mut conn = connect(&server).await;
    let keys: Vec<String> = conn.keys("tollgate:{big}:*").await.unwrap();
    assert_eq!(keys.len(), 8000);
}

/// One script call, three requests on one bucket of burst 2 (one token per
/// second) at a pinned instant: each sees what the earlier ones wrote, a dry
/// run spends nothing, and the third is refused with the wait for a token.
#[tokio::test]
async fn requests_of_one_call_see_what_earlier_ones_wrote() {
    let server = RedisServer::start();
    let mut conn = connect(&server).await;
    let script = redis::Script::new(tollgate_core::store::TOKEN_BUCKET_LUA);
    let now: i64 = 1_700_000_000_000_000;
    let mut inv = script.prepare_invoke();
    inv.arg(now).arg("1s,1d,1s,1s").arg(1000);
    for _ in 0..4 {
        inv.key("tollgate:{t}:k::same")
            .arg("t1")
            .arg("1000000:2")
            .arg(1);
    }
    let reply: Vec<i64> = inv.invoke_async(&mut conn).await.unwrap();
    // [now, then per key: 2 × remaining + allowed, retry, reset]
    assert_eq!(
        reply,
        vec![
            now,
            2 + 1,
            0,
            1_000_000, // spends the first token
            1,
            0,
            2_000_000, // dry run: answers as if it took the second, spends nothing
            1,
            0,
            2_000_000, // spends the second
            0,
            1_000_000,
            2_000_000, // empty: one second to wait
        ]
    );
    let stored: String = conn.get("tollgate:{t}:k::same").await.unwrap();
    assert_eq!(stored, format!("{}:1000000:2", now + 2_000_000));
}

/// The usual call (every request spends, every bucket a token bucket) sets
/// a key's expiry only when its full-again instant moves into another step
/// of half the expiry margin (counted from the epoch, on Redis's clock),
/// and keeps it otherwise. With a 60 s margin (30 s steps) and a token
/// every 10 s, four spends take the bucket to 10, 20, 30 and 40 s from the
/// first: a span of 30 s, so exactly one step boundary is crossed wherever
/// Redis's clock stands, and the expiry is set exactly twice. A pinned now
/// (as tests pass) is not the clock expiry runs on: every write sets it.
#[tokio::test]
async fn the_usual_call_sets_an_expiry_only_when_it_moves_a_step() {
    let server = RedisServer::start();
    let conn = connect(&server).await;
    let script = redis::Script::new(tollgate_core::store::TOKEN_BUCKET_LUA);
    let key = "tollgate:{t}:k::expiry";
    // The usual form: one key, one limit, one decision of one bucket at
    // cost 1.
    let spend = |now: &str, margin: u64| {
        let mut inv = script.prepare_invoke();
        inv.key(key)
            .arg(now)
            .arg(&b"=\x01\x01\x01\x01\x00"[..])
            .arg(margin);
        inv.arg("10000000:10");
        let mut conn = conn.clone();
        async move { inv.invoke_async::<Vec<i64>>(&mut conn).await.unwrap() }
    };
    let step = 30_000_000;
    redis_cli(server.port, &["CONFIG", "RESETSTAT"]);
    let mut full_at = Vec::new();
    for n in 1..=4 {
        let reply = spend("", 60_000).await;
        // [Redis's clock, 2 × reset_after + allowed]
        assert_eq!(reply.len(), 2);
        let reset = reply[1] >> 1;
        assert_eq!(
            (reply[1] & 1, (100_000_000 - reset) / 10_000_000),
            (1, 10 - n)
        );
        full_at.push(reply[0] + reset);
        let pttl: i64 = redis_cli(server.port, &["PTTL", key]).parse().unwrap();
        // Never shorter than the state with half the margin to spare.
        assert!(pttl >= reset / 1000 + 30_000, "{pttl} for {reply:?}");
    }
    assert_eq!(full_at[3] - full_at[0], step);
    let crossings = full_at
        .windows(2)
        .filter(|w| w[0] / step != w[1] / step)
        .count();
    assert_eq!(crossings, 1, "{full_at:?}");
    let stats = redis_cli(server.port, &["INFO", "commandstats"]);
    assert!(stats.contains("cmdstat_psetex:calls=2,"), "{stats}");
    assert!(stats.contains("cmdstat_set:calls=2,"), "{stats}");
    let stored: String = conn.clone().get(key).await.unwrap();
    assert_eq!(stored, format!("{}:10000000:10", full_at[3]));

    // A zero margin leaves no room, and a pinned now is not Redis's clock:
    // every write sets the expiry.
    redis_cli(server.port, &["CONFIG", "RESETSTAT"]);
    spend("", 0).await;
    let pinned = full_at[3].to_string();
    spend(&pinned, 60_000).await;
    spend(&pinned, 60_000).await;
    let stats = redis_cli(server.port, &["INFO", "commandstats"]);
    assert!(stats.contains("cmdstat_psetex:calls=3,"), "{stats}");
    assert!(!stats.contains("cmdstat_set:"), "{stats}");
}

/// A bucket full again one microsecond from now is one microsecond short:
/// a spend leaves no whole token, and the next spend waits 1 µs (the usual
/// call's path counts the smallest debt too).
#[tokio::test]
async fn a_bucket_one_microsecond_from_full_is_not_full() {
    let server = RedisServer::start();
    let mut conn = connect(&server).await;
    let script = redis::Script::new(tollgate_core::store::TOKEN_BUCKET_LUA);
    let now: i64 = 1_700_000_000_000_000;
    let key = "tollgate:{t}:k::almost";
    let _: () = conn
        .set(key, format!("{}:1000000:2", now + 1))
        .await
        .unwrap();
    let mut inv = script.prepare_invoke();
    inv.key(key).arg(now).arg("1s").arg(1000);
    inv.arg("t1").arg("1000000:2").arg(1);
    let reply: Vec<i64> = inv.invoke_async(&mut conn).await.unwrap();
    assert_eq!(reply, [now, 1, 0, 1_000_001]);
    let mut inv = script.prepare_invoke();
    inv.key(key).arg(now).arg("1s").arg(1000);
    inv.arg("t1").arg("1000000:2").arg(1);
    let reply: Vec<i64> = inv.invoke_async(&mut conn).await.unwrap();
    assert_eq!(reply, [now, 0, 1, 1_000_001]);
}

/// In a coalesced call, a bucket shared by its decisions (the tenant's
/// ceiling beside each key's bucket) is written once, with what the last
/// decision left, and each decision still sees what the earlier ones
/// spent; a decision refused by its key's bucket spends nothing from the
/// ceiling and reports what the ceiling holds.
#[tokio::test]
async fn a_bucket_shared_by_a_calls_decisions_is_written_once() {
    let server = RedisServer::start();
    let mut conn = connect(&server).await;
    let script = redis::Script::new(tollgate_core::store::TOKEN_BUCKET_LUA);
    let now: i64 = 1_700_000_000_000_000;
    let ceiling = "tollgate:{t}:t::";
    // alice spends 1, bob 3 of a burst of 2 (refused, never fits), carol 1,
    // in the usual form: keys alice (1), the ceiling (2), bob (3), carol
    // (4); limits 1 000 000:2 (1) and 500 000:10 (2); cost 3 (1).
    let mut inv = script.prepare_invoke();
    for key in ["alice", "", "bob", "carol"] {
        match key {
            "" => inv.key(ceiling),
            key => inv.key(format!("tollgate:{{t}}:k::{key}")),
        };
    }
    #[rustfmt::skip]
    let plan = [
        b'=', 2,
        2, 1, 1, 0, 2, 2, 0,
        2, 3, 1, 1, 2, 2, 1,
        2, 4, 1, 0, 2, 2, 0,
    ];
    inv.arg(now).arg(&plan[..]).arg(1000);
    inv.arg("1000000:2").arg("500000:10").arg(3);
    redis_cli(server.port, &["CONFIG", "RESETSTAT"]);
    let reply: Vec<i64> = inv.invoke_async(&mut conn).await.unwrap();
    #[rustfmt::skip]
    assert_eq!(
        reply,
        vec![
            now,
            // alice: her bucket full again in 1 s (1 left), the ceiling in
            // 0.5 s (9 left).
            2 * 1_000_000 + 1, 2 * 500_000 + 1,
            // bob: never fits his burst (full now); the ceiling would
            // admit 3 and reports what it holds (full again in 0.5 s).
            0, 2 * 500_000 + 1,
            // carol: her bucket 1 left, the ceiling 8 left.
            2 * 1_000_000 + 1, 2 * 1_000_000 + 1,
        ]
    );
    let stored: String = conn.get(ceiling).await.unwrap();
    assert_eq!(stored, format!("{}:500000:10", now + 1_000_000));
    let keys: Vec<String> = conn.keys("tollgate:{t}:k::*").await.unwrap();
    assert_eq!(keys.len(), 2, "bob's bucket is not written: {keys:?}");
    let stats = redis_cli(server.port, &["INFO", "commandstats"]);
    assert!(stats.contains("cmdstat_psetex:calls=3,"), "{stats}");
}

/// A call of more keys than one MGET reads (4 000): the script reads them in
/// parts, and a bucket in the second part counts like one in the first.
#[tokio::test]
async fn a_call_larger_than_one_mget_reads_every_bucket() {
    let server = RedisServer::start();
    let mut conn = connect(&server).await;
    let now: i64 = 1_700_000_000_000_000;
    let key = |i: usize| format!("tollgate:{{t}}:k::k{i}");
    // Two empty buckets (burst 1, full again one second from now), one in
    // each part.
    let empty = format!("{}:1000000:1", now + 1_000_000);
    for i in [0, 4200] {
        let _: () = conn.set(key(i), &empty).await.unwrap();
    }
    let script = redis::Script::new(tollgate_core::store::TOKEN_BUCKET_LUA);
    let mut inv = script.prepare_invoke();
    inv.arg(now).arg("4500s").arg(1000);
    for i in 0..4500 {
        inv.key(key(i)).arg("t1").arg("1000000:1").arg(1);
    }
    let reply: Vec<i64> = inv.invoke_async(&mut conn).await.unwrap();
    assert_eq!(reply.len(), 1 + 4500 * 3);
    // Allowed and the balance in one value: 2 × remaining + allowed.
    let refused: Vec<usize> = (0..4500).filter(|i| reply[1 + i * 3] & 1 == 0).collect();
    assert_eq!(refused, vec![0, 4200], "two empty buckets refuse");
    // Refused as a whole: nothing was written.
    let keys: Vec<String> = conn.keys("tollgate:*").await.unwrap();
    assert_eq!(keys.len(), 2, "{keys:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_callers_do_not_stall_coalesced_decisions() {
    let server = RedisServer::start();
    let store = coalescing_store(server.url());
    let c = [Charge {
        limit: Limit::new(1_000_000, "1/second".parse().unwrap()).unwrap(),
        cost: 1,
        need: 1,
        enforce: true,
    }];
    // Rounds of 100 concurrent decisions, half of them abandoned by their
    // callers at various points (before sending, while leading a call,
    // while queued).
    for round in 0..20 {
        let mut tasks = Vec::new();
        for i in 0..100 {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                let b = [BucketKey::new(
                    "cancel",
                    BucketKind::KEY,
                    "",
                    &format!("k{i}"),
                )];
                store.apply(Request::new(&b, &c, Op::SPEND)).await
            }));
        }
        for (i, t) in tasks.iter().enumerate() {
            if i % 2 == round % 2 {
                t.abort();
            }
            if i % 7 == 0 {
                tokio::task::yield_now().await;
            }
        }
        for t in tasks {
            if let Ok(result) = t.await {
                assert!(result.unwrap().allowed, "round {round}");
            }
        }
    }
    // No slot was lost: decisions still go straight through, one by one.
    for i in 0..20 {
        let b = [BucketKey::new("cancel", BucketKind::KEY, "", "after")];
        let o = store.apply(Request::new(&b, &c, Op::SPEND)).await.unwrap();
        assert!(o.allowed);
        assert_eq!(o.verdicts[0].remaining, 1_000_000 - 1 - i);
    }
}

/// A frozen Redis holds every script call: decisions in flight and those
/// queued behind them (300, arriving over 0.8 s; 64 per call, 2 calls in
/// flight) are each answered "unavailable" by their own deadline (at worst
/// a fifth of the timeout after it), not a timeout after the call that
/// finally carries them started, and once Redis answers again no
/// coalescing slot was lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_queued_behind_a_frozen_redis_are_answered_by_their_deadline() {
    let server = RedisServer::start();
    let timeout = Duration::from_secs(1);
    let store = coalescing_store_with_timeout(server.url(), timeout);
    let c = [Charge {
        limit: Limit::new(1_000_000, "1/second".parse().unwrap()).unwrap(),
        cost: 1,
        need: 1,
        enforce: true,
    }];
    let b = [BucketKey::new("frozen", BucketKind::KEY, "", "warm")];
    assert!(
        store
            .apply(Request::new(&b, &c, Op::SPEND))
            .await
            .unwrap()
            .allowed
    );

    server.freeze();
    let mut tasks = Vec::new();
    for i in 0..300 {
        if i % 30 == 29 {
            tokio::time::sleep(Duration::from_millis(80)).await;
        }
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let b = [BucketKey::new(
                "frozen",
                BucketKind::KEY,
                "",
                &format!("k{i}"),
            )];
            let asked = tokio::time::Instant::now();
            let result = store.apply(Request::new(&b, &c, Op::SPEND)).await;
            (result, asked.elapsed())
        }));
    }
    let mut slowest = Duration::ZERO;
    for t in tasks {
        let (result, took) = t.await.unwrap();
        let err = result.expect_err("a frozen Redis admits nothing");
        assert!(
            matches!(err, StoreError::Unavailable(_)),
            "unavailable, so the rule's policy decides: {err}"
        );
        slowest = slowest.max(took);
    }
    // Sent with a timeout from when their call started, the first queued
    // would wait two timeouts (the frozen calls ahead of them, then their
    // own).
    assert!(
        slowest < timeout + timeout * 3 / 5,
        "every decision answered about its deadline, the slowest after {slowest:?}"
    );

    server.thaw();
    for i in 0..20 {
        let b = [BucketKey::new("frozen", BucketKind::KEY, "", "after")];
        let o = loop {
            // The breaker the timeouts opened refuses until its cooldown
            // passes (a refused call spends nothing).
            match store.apply(Request::new(&b, &c, Op::SPEND)).await {
                Ok(o) => break o,
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        assert!(o.allowed);
        assert_eq!(o.verdicts[0].remaining, 1_000_000 - 1 - i);
    }
}

/// Readiness loads the decision script on a single Redis, so the first
/// decision after it is one EVALSHA that finds the script (no NOSCRIPT and
/// reload on a caller's clock).
#[tokio::test]
async fn ready_means_the_script_is_loaded() {
    let server = RedisServer::start();
    let url = server.url();
    let served = common::TestServer::launch(None, move |c| {
        c.store = tollgate::server::StoreSpec::Redis(url);
    })
    .await;
    served.wait_ready().await;
    let stats = redis_cli(server.port, &["INFO", "commandstats"]);
    assert!(stats.contains("cmdstat_script|load:calls="), "{stats}");
    assert!(!stats.contains("cmdstat_evalsha"), "{stats}");
    let mut client = served.client().await;
    let r = common::ask(&mut client, common::req("t", "first")).await;
    assert_eq!(r.degraded(), tollgate::proto::v1::Degraded::None);
    let stats = redis_cli(server.port, &["INFO", "commandstats"]);
    let evalsha = stats
        .lines()
        .find(|l| l.starts_with("cmdstat_evalsha:"))
        .unwrap_or_else(|| panic!("{stats}"));
    assert!(
        evalsha.contains("calls=1,") && evalsha.contains("failed_calls=0"),
        "{evalsha}"
    );
    served.stop().await;
}

/// A reservation's record lives beside its tenant's buckets, under the same
/// hash tag, and expires by itself: its time to live, plus the ten minutes
/// in which a late settle is answered "expired", plus the margin. Settling
/// it keeps that expiry.
#[tokio::test]
async fn reservation_records_expire_by_themselves() {
    let server = RedisServer::start();
    let clock = Arc::new(ManualClock::new(T0));
    let store = store(server.url(), &clock, Duration::from_secs(1));
    let charge = Charge::new(Limit::new(10, "1/hour".parse().unwrap()).unwrap(), 2);
    let id = ReservationId::new("acme");
    let reservation = Reservation {
        id: id.clone(),
        estimate: 2,
        lines: vec![1],
        ttl: 30_000_000,
    };
    let bucket = [BucketKey::new("acme", BucketKind::KEY, "", "alice")];
    assert!(
        store
            .apply(
                Request::new(&bucket, &[charge], Op::SPEND)
                    .attach(&Attachment::Reservation(reservation.clone()))
            )
            .await
            .unwrap()
            .allowed
    );
    let record = store.redis_key(&id.record_name());
    assert!(record.starts_with("tollgate:{acme}:r::"), "{record}");
    let pttl = |port| -> i64 { redis_cli(port, &["PTTL", &record]).trim().parse().unwrap() };
    let lives = 30_000 + 600_000 + 1_000;
    let left = pttl(server.port);
    assert!(left > lives - 5_000 && left <= lives, "{left} ms");
    store.settle(&id, 1).await.unwrap();
    let left = pttl(server.port);
    assert!(
        left > lives - 5_000 && left <= lives,
        "kept by the settle: {left} ms"
    );
}

/// Leases, Lua against Rust: the same random sequence of acquires (with a
/// token bucket beside caps of random sizes, some shadow), releases, renews,
/// dry checks and clock steps (back too) through the in-process store,
/// which runs `src/algorithm/concurrency.rs`, and through Redis, which runs
/// the script. Every verdict and every lease answer must be the same.
#[tokio::test]
async fn leases_agree_between_lua_and_rust() {
    use tollgate_core::store::{Lease, LeaseId, LeaseOp, MemoryStore};
    let server = RedisServer::start();
    for seed in [0x5eed_1ea5_u64, 0xc0ff_ee00, 0x0dd5_1075] {
        let clock = Arc::new(ManualClock::new(T0));
        let redis = store(server.url(), &clock, Duration::from_secs(1));
        let memory = MemoryStore::new(clock.clone(), 100_000);
        let tenant = format!("lease{seed:x}");
        let sets: Vec<BucketKey> = (0..3)
            .map(|i| {
                BucketKey::new(
                    &tenant,
                    BucketKind::Rule {
                        per_key: true,
                        concurrency: true,
                        shadow: false,
                    },
                    "",
                    &format!("set{i}"),
                )
            })
            .collect();
        let bucket = BucketKey::new(&tenant, BucketKind::KEY, "", "tokens");
        let tokens = Limit::new(4, "2/second".parse::<Rate>().unwrap()).unwrap();
        let mut rng = Rng(seed);
        let mut leases: Vec<LeaseId> = Vec::new();
        let (mut granted, mut refused, mut released, mut expired) = (0, 0, 0, 0);
        for step in 0..1500 {
            match rng.below(10) {
                // Acquire on one to three caps, with or without a token.
                0..=4 => {
                    let n = 1 + rng.below(3) as usize;
                    let mut buckets = Vec::new();
                    let mut charges = Vec::new();
                    if rng.below(2) == 0 {
                        buckets.push(bucket.clone());
                        charges.push(Charge::new(tokens, 1));
                    }
                    for set in sets.iter().take(n) {
                        buckets.push(set.clone());
                        charges.push(Charge {
                            enforce: rng.below(5) != 0,
                            ..Charge::new(Limit::concurrency(1 + rng.below(4)).unwrap(), 1)
                        });
                    }
                    let lease = Lease {
                        id: LeaseId::new(&tenant),
                        ttl: 1_000 + rng.below(3_000_000),
                    };
                    let want = memory
                        .apply(
                            Request::new(&buckets, &charges, Op::SPEND)
                                .attach(&Attachment::Lease(lease.clone())),
                        )
                        .await
                        .unwrap();
                    let got = redis
                        .apply(
                            Request::new(&buckets, &charges, Op::SPEND)
                                .attach(&Attachment::Lease(lease.clone())),
                        )
                        .await
                        .unwrap();
                    assert_eq!(got, want, "seed {seed:#x} step {step}: acquire");
                    if want.allowed {
                        granted += 1;
                        leases.push(lease.id);
                    } else {
                        refused += 1;
                    }
                }
                // Release or renew a lease seen (or one never granted).
                5..=7 if !leases.is_empty() => {
                    let id = if rng.below(10) == 0 {
                        LeaseId::new(&tenant)
                    } else {
                        leases[rng.below(leases.len() as u64) as usize].clone()
                    };
                    let op = if rng.below(3) == 0 {
                        LeaseOp::Renew {
                            ttl: 1_000 + rng.below(3_000_000),
                        }
                    } else {
                        LeaseOp::Release
                    };
                    let want = memory.lease(&id, op).await.unwrap();
                    let got = redis.lease(&id, op).await.unwrap();
                    assert_eq!(got, want, "seed {seed:#x} step {step}: {op:?}");
                    match want.status {
                        tollgate_core::store::LeaseStatus::Done if op == LeaseOp::Release => {
                            released += 1
                        }
                        tollgate_core::store::LeaseStatus::Expired => expired += 1,
                        _ => {}
                    }
                }
                // What every cap holds, as a dry run.
                8 => {
                    let charges: Vec<Charge> = sets
                        .iter()
                        .map(|_| Charge::new(Limit::concurrency(3).unwrap(), 1))
                        .collect();
                    let want = memory
                        .apply(Request::new(&sets, &charges, Op::DRY))
                        .await
                        .unwrap();
                    let got = redis
                        .apply(Request::new(&sets, &charges, Op::DRY))
                        .await
                        .unwrap();
                    assert_eq!(got, want, "seed {seed:#x} step {step}: occupancy");
                }
                // The clock: mostly forward, sometimes back.
                _ => {
                    if rng.below(8) == 0 {
                        clock.set(clock.now().saturating_sub(rng.below(500_000)));
                    } else {
                        clock.advance(Duration::from_micros(rng.below(800_000)));
                    }
                }
            }
        }
        println!(
            "seed {seed:#x}: {granted} granted, {refused} refused, {released} released, {expired} found expired"
        );
        assert!(granted > 100 && refused > 100 && released > 15 && expired > 10);
    }
}

/// On a cluster, `count` tenants whose keys one master serves, and that
/// master's index.
fn tenants_on_one_master(cluster: &RedisCluster, count: usize) -> (usize, Vec<String>) {
    let master = cluster.owner(cluster.slot_of("batch-0")).unwrap();
    let tenants = (0..)
        .map(|i| format!("batch-{i}"))
        .filter(|t| cluster.owner(cluster.slot_of(t)) == Some(master))
        .take(count)
        .collect();
    (master, tenants)
}

/// `name`'s count in `INFO` text: `name:N`, or the first figure of
/// `name:count=N,…` and `name:calls=N,…`.
fn info_count(info: &str, name: &str) -> u64 {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(|v| v.split(',').next().unwrap_or_default())
        .map(|v| v.rsplit('=').next().unwrap_or_default().trim().to_owned())
        .map_or(0, |v| v.parse().unwrap())
}

/// What one master counted while a batch went out.
struct Counted {
    /// Reads of its clients' sockets, less those that read the store's
    /// slot-map queries (`CLUSTER NODES`, which its refresher may send
    /// meanwhile).
    reads: u64,
    evalsha: u64,
    noscript: u64,
}

/// Holds a cluster master frozen while two decisions of `tenants[0]` are
/// in flight to it (so every coalescing slot of its node is taken) and two
/// decisions of every tenant queue behind them; `while_frozen` runs once
/// the two are written, before the rest are asked. The thaw answers the
/// two, and the queue goes out as one batch: one script call per tenant.
/// Checks that of each tenant's two, from a bucket of 1 a day, the first
/// is admitted and the second refused, and returns what the master
/// counted from the freeze to the end (its reads include the `INFO` that
/// reads the counts).
async fn a_batch_behind_a_frozen_master(
    cluster: &RedisCluster,
    master: usize,
    tenants: &[String],
    while_frozen: impl FnOnce(),
) -> Counted {
    let port = cluster.nodes[master].port;
    let store = coalescing_store_with_timeout(cluster.url(), Duration::from_secs(10));
    let c = [Charge {
        limit: Limit::new(1, "1/day".parse().unwrap()).unwrap(),
        cost: 1,
        need: 1,
        enforce: true,
    }];
    let decide = |tenant: &str, key: &str| {
        let store = store.clone();
        let b = [BucketKey::new(tenant, BucketKind::KEY, "", key)];
        tokio::spawn(async move { store.apply(Request::new(&b, &c, Op::SPEND)).await })
    };
    // Every tenant's first call loads the script and learns the clock.
    for tenant in tenants {
        assert!(decide(tenant, "warm").await.unwrap().unwrap().allowed);
    }
    let count = || {
        let info = redis_cli(port, &["INFO", "stats", "commandstats", "errorstats"]);
        [
            "total_reads_processed",
            "cmdstat_evalsha",
            "errorstat_NOSCRIPT",
            "cmdstat_cluster|nodes",
        ]
        .map(|name| info_count(&info, name))
    };
    let before = count();
    cluster.nodes[master].freeze();
    let in_flight = [
        decide(&tenants[0], "ahead-0"),
        decide(&tenants[0], "ahead-1"),
    ];
    tokio::time::sleep(Duration::from_millis(200)).await;
    while_frozen();
    let queued: Vec<_> = tenants
        .iter()
        .flat_map(|t| [t; 2])
        .map(|t| (t.clone(), decide(t, "hot")))
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    cluster.nodes[master].thaw();
    for t in in_flight {
        assert!(t.await.unwrap().unwrap().allowed);
    }
    let mut admitted: HashMap<String, Vec<u64>> = HashMap::new();
    for (tenant, t) in queued {
        let o = t.await.unwrap().expect("every queued decision is decided");
        let seen = admitted.entry(tenant).or_default();
        if o.allowed {
            seen.push(o.verdicts[0].remaining);
        } else {
            assert_eq!(o.verdicts[0].remaining, 0, "refused: the bucket is empty");
        }
    }
    for tenant in tenants {
        assert_eq!(admitted[tenant], [0], "{tenant}: the first of two admitted");
    }
    let after = count();
    let [reads, evalsha, noscript, slot_maps] = [0, 1, 2, 3].map(|i| after[i] - before[i]);
    Counted {
        reads: reads - slot_maps,
        evalsha,
        noscript,
    }
}

/// On a cluster, the script calls of one coalesced batch that are bound for
/// one master (one call per tenant) go in one write, which Redis reads at
/// once, and every decision is as exact as when sent alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_tenants_on_one_master_is_one_write() {
    let cluster = RedisCluster::start();
    let (master, tenants) = tenants_on_one_master(&cluster, 30);
    let counted = a_batch_behind_a_frozen_master(&cluster, master, &tenants, || {}).await;
    eprintln!(
        "{} reads for {} script calls",
        counted.reads, counted.evalsha
    );
    // Two in flight, then the batch: thirty calls of two decisions each.
    assert_eq!(counted.evalsha, 2 + 30);
    // The two in flight (one read, or two), the batch's one write, the
    // INFO. Written one by one, the batch's calls take Redis several reads.
    assert!(
        counted.reads <= 4,
        "{} reads for {} script calls",
        counted.reads,
        counted.evalsha
    );
    assert_eq!(counted.noscript, 0);
}

/// A batch's shared write that finds the script gone (a `SCRIPT FLUSH`, as
/// after a restart or failover) has every call of it answered `NOSCRIPT`
/// once: each loads the script and is asked again on its own, and nothing
/// is lost or counted twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_write_finds_the_script_gone_loads_it_and_decides() {
    use std::io::{Read, Write};
    let cluster = RedisCluster::start();
    let (master, tenants) = tenants_on_one_master(&cluster, 30);
    // Connected before the freeze, so that its FLUSH, written while the
    // master is frozen, is read right after the two calls in flight (Redis
    // serves sockets in the order they became readable) and before the
    // batch that follows their answers.
    let mut flusher =
        std::net::TcpStream::connect(("127.0.0.1", cluster.nodes[master].port)).unwrap();
    let counted = a_batch_behind_a_frozen_master(&cluster, master, &tenants, || {
        flusher.write_all(b"SCRIPT FLUSH\r\n").unwrap();
    })
    .await;
    let mut ok = [0; 5];
    flusher.read_exact(&mut ok).unwrap();
    assert_eq!(&ok, b"+OK\r\n");
    assert_eq!(counted.noscript, 30, "each call of the batch, once");
    // The two in flight, the batch's thirty refused, then each again.
    assert_eq!(counted.evalsha, 2 + 30 + 30);
}
