//! Token slices (`--token-slices`) and per-key buckets spread over slots
//! (`--redis-spread-keys`), on every store: in-process, Redis, and a
//! 3-node Redis Cluster (real servers, started per test).
//!
//! The properties, for several instances sharing one backend:
//! - every admission sequence the instances produce together conforms to
//!   each bucket: replayed against an exact bucket, each admission passes
//!   (never more than the limit allows);
//! - the same requests get the same answers on every backend (the Lua and
//!   Rust arithmetic agree, so the layer above them does too);
//! - refusals come early by at most what the slices hold.

// The workspace's test helpers for real Redis servers, shared by path with
// the root crate's integration tests.
#[allow(dead_code)]
#[path = "../../../tests/common/ports.rs"]
mod ports;
#[allow(dead_code)]
#[path = "../../../tests/common/redis.rs"]
mod redis_servers;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis_servers::{RedisCluster, RedisServer, redis_cli};
use tollgate_core::algorithm::{BucketState, Charge, Limit, Micros, Op, Rate, Verdict, decide};
use tollgate_core::clock::{Clock, ManualClock};
use tollgate_core::store::OnStoreUnavailable;
use tollgate_core::store::layer::Layer;
use tollgate_core::store::stack::{Layers, build};
use tollgate_core::store::{Attachment, BucketKind, Request};
use tollgate_core::store::{
    BucketKey, Lease, LeaseFuture, LeaseId, LeaseOp, LeaseStatus, MemoryStore, PingFuture,
    RedisConfig, RedisStore, Reservation, ReservationId, SettleFuture, SettleStatus, Store,
    StoreError, StoreFuture, StoreStatus,
};

/// A time well after the epoch, as the root crate's tests use.
const T0: u64 = 1_700_000_000_000_000;

/// Instances sharing one backend, each with its own stack.
struct Fleet {
    instances: Vec<Arc<dyn Layer>>,
    clock: Arc<ManualClock>,
    _redis: Option<RedisServer>,
    _cluster: Option<RedisCluster>,
}

fn stack(backend: Arc<dyn Store>, clock: &Arc<ManualClock>, slices: bool) -> Arc<dyn Layer> {
    let layers = Layers {
        fallback: None,
        deny_cache: None,
        slices: slices.then_some(1_000),
    };
    build(backend, layers, clock.clone())
}

fn redis_backend(url: String, clock: &Arc<ManualClock>, spread: bool) -> Arc<dyn Store> {
    let config = RedisConfig {
        timeout: Duration::from_secs(5),
        spread_keys: spread,
        ..RedisConfig::new(url)
    };
    let clock: Arc<dyn Clock> = clock.clone();
    Arc::new(RedisStore::new(config, Some(clock)).unwrap())
}

/// A backend whose calls take time, as a round trip to Redis does: the
/// clock moves `step` on the way to the backend and `step` again on the way
/// back, so the backend decides between the call's sending and its answer's
/// arrival. Whatever the slices derive from a take must count from its
/// sending: counted from the answer, a slice's tokens would be held one
/// way's `step` longer than the store's bucket allows.
struct Slow {
    inner: Arc<dyn Store>,
    clock: Arc<ManualClock>,
    step: Duration,
    /// Decisions sent to the backend.
    calls: AtomicU64,
}

impl Store for Slow {
    fn apply<'a>(&'a self, request: Request<'a>) -> StoreFuture<'a> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        Box::pin(async move {
            self.clock.advance(self.step);
            let decided = self.inner.apply(request).await;
            self.clock.advance(self.step);
            decided
        })
    }

    fn settle<'a>(&'a self, id: &'a ReservationId, actual: u64) -> SettleFuture<'a> {
        self.inner.settle(id, actual)
    }

    fn lease<'a>(&'a self, id: &'a LeaseId, op: LeaseOp) -> LeaseFuture<'a> {
        self.inner.lease(id, op)
    }

    fn ping(&self) -> PingFuture<'_> {
        self.inner.ping()
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn status(&self) -> StoreStatus {
        self.inner.status()
    }
}

impl Fleet {
    /// `n` sliced instances on one in-process store whose every call takes
    /// `step` of the clock.
    fn slow(n: usize, step: Duration) -> Self {
        let clock = Arc::new(ManualClock::new(T0));
        let memory: Arc<dyn Store> = Arc::new(MemoryStore::new(clock.clone(), 100_000));
        let store: Arc<dyn Store> = Arc::new(Slow {
            inner: memory,
            clock: clock.clone(),
            step,
            calls: AtomicU64::new(0),
        });
        Self {
            instances: (0..n).map(|_| stack(store.clone(), &clock, true)).collect(),
            clock,
            _redis: None,
            _cluster: None,
        }
    }

    fn memory(n: usize, slices: bool) -> Self {
        let clock = Arc::new(ManualClock::new(T0));
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new(clock.clone(), 100_000));
        Self {
            instances: (0..n)
                .map(|_| stack(store.clone(), &clock, slices))
                .collect(),
            clock,
            _redis: None,
            _cluster: None,
        }
    }

    fn redis(n: usize, spread: bool) -> Self {
        let server = RedisServer::start();
        Self::shared(n, server.url(), spread, Some(server), None)
    }

    fn cluster(n: usize) -> Self {
        let cluster = RedisCluster::start();
        Self::shared(n, cluster.url(), true, None, Some(cluster))
    }

    /// `n` instances, each with its own store client on `url`.
    fn shared(
        n: usize,
        url: String,
        spread: bool,
        redis: Option<RedisServer>,
        cluster: Option<RedisCluster>,
    ) -> Self {
        let clock = Arc::new(ManualClock::new(T0));
        Self {
            instances: (0..n)
                .map(|_| stack(redis_backend(url.clone(), &clock, spread), &clock, true))
                .collect(),
            clock,
            _redis: redis,
            _cluster: cluster,
        }
    }
}

fn limit(burst: u64, rate: &str) -> Limit {
    Limit::new(burst, rate.parse::<Rate>().unwrap()).unwrap()
}

fn ceiling(tenant: &str) -> BucketKey {
    BucketKey::new(tenant, BucketKind::TENANT, "", "")
}

fn per_key(tenant: &str, key: &str) -> BucketKey {
    BucketKey::new(tenant, BucketKind::KEY, "", key)
}

const POLICIES: [OnStoreUnavailable; 2] = [OnStoreUnavailable::Deny, OnStoreUnavailable::Deny];

/// One decision: the tenant's ceiling and one key's bucket.
async fn decide_on(
    instance: &Arc<dyn Layer>,
    buckets: &[BucketKey; 2],
    charges: &[Charge; 2],
) -> Result<(bool, Vec<Verdict>), StoreError> {
    let applied = instance
        .apply(Request {
            buckets,
            charges,
            policies: &POLICIES,
            op: Op::SPEND,
            attachment: None,
        })
        .await?;
    Ok((applied.outcome.allowed, applied.outcome.verdicts))
}

/// A small deterministic generator, so a failure can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Replays admissions against an exact bucket: each must pass.
fn conforms(limit: &Limit, admitted: &[(Micros, u64)]) -> Result<(), String> {
    let mut state: Option<BucketState> = None;
    for (n, &(at, cost)) in admitted.iter().enumerate() {
        let (verdict, next) = decide(state, limit, cost, at).unwrap();
        if !verdict.allowed {
            return Err(format!(
                "admission {n} (cost {cost} at +{} µs) is beyond the limit",
                at - T0
            ));
        }
        state = Some(next);
    }
    Ok(())
}

struct Run {
    /// Every answer: allowed, then each bucket's verdict.
    answers: Vec<(bool, Vec<Verdict>)>,
    admitted: u64,
}

const CEILING_BURST: u64 = 3_200;
const KEYS: u64 = 16;

/// A hot tenant: demand twice the ceiling's rate, spread over 16 keys
/// whose own limits bind now and then, from every instance in turn (in a
/// random order), with the clock moving 0 to 99 µs between decisions.
async fn hot_tenant(fleet: &Fleet, steps: usize, seed: u64) -> Run {
    let ceiling_limit = limit(CEILING_BURST, "20000/second");
    let key_limit = limit(100, "2000/second");
    let mut rng = Rng(seed);
    let mut answers = Vec::with_capacity(steps);
    let mut at_ceiling = Vec::new();
    let mut at_key: Vec<Vec<(Micros, u64)>> = vec![Vec::new(); KEYS as usize];
    for _ in 0..steps {
        fleet.clock.advance(Duration::from_micros(rng.below(100)));
        let instance = &fleet.instances[rng.below(fleet.instances.len() as u64) as usize];
        let k = rng.below(KEYS);
        let cost = 1 + rng.below(3);
        let buckets = [ceiling("hot"), per_key("hot", &format!("user-{k}"))];
        let charges = [
            Charge::new(ceiling_limit, cost),
            Charge::new(key_limit, cost),
        ];
        let (allowed, verdicts) = decide_on(instance, &buckets, &charges).await.unwrap();
        if allowed {
            let now = fleet.clock.now();
            at_ceiling.push((now, cost));
            at_key[k as usize].push((now, cost));
        } else {
            let retry = verdicts.iter().map(|v| v.retry_after).max().unwrap();
            assert!(retry > 0, "a refusal says when to retry: {verdicts:?}");
        }
        answers.push((allowed, verdicts));
    }
    conforms(&ceiling_limit, &at_ceiling).unwrap();
    for admitted in &at_key {
        conforms(&key_limit, admitted).unwrap();
    }
    let admitted = at_ceiling.iter().map(|(_, c)| c).sum();
    Run { answers, admitted }
}

const STEPS: usize = 6_000;
const SEED: u64 = 0x5eed_0f51_1ce5;

/// The same tenant through three instances with slices, and through the
/// exact path (no slices): the sliced fleet admits no more than the limit
/// and close to what the exact one does.
async fn hot_tenant_against_the_exact_answer(sliced: &Fleet) -> Run {
    let run = hot_tenant(sliced, STEPS, SEED).await;
    let exact = hot_tenant(&Fleet::memory(3, false), STEPS, SEED).await;
    eprintln!(
        "tokens admitted: sliced {}, exact {} ({:.2} %)",
        run.admitted,
        exact.admitted,
        100.0 * run.admitted as f64 / exact.admitted as f64
    );
    // Early refusals are bounded by what the slices hold: at most a
    // thirty-second of the burst per instance at a time, renewed as
    // they run out; within 5 % of the exact answer here.
    assert!(
        run.admitted * 100 >= exact.admitted * 95,
        "sliced {} against exact {}",
        run.admitted,
        exact.admitted
    );
    run
}

#[tokio::test]
async fn memory_three_instances_stay_within_the_limit() {
    let run = hot_tenant_against_the_exact_answer(&Fleet::memory(3, true)).await;
    assert!(
        run.answers.iter().any(|(allowed, _)| !allowed),
        "the tenant was hot"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_answers_exactly_as_memory_does() {
    let memory = hot_tenant(&Fleet::memory(3, true), STEPS, SEED).await;
    for spread in [false, true] {
        let redis = hot_tenant_against_the_exact_answer(&Fleet::redis(3, spread)).await;
        assert_eq!(redis.admitted, memory.admitted, "spread keys: {spread}");
        for (n, (r, m)) in redis.answers.iter().zip(&memory.answers).enumerate() {
            assert_eq!(r, m, "answer {n} differs (spread keys: {spread})");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_answers_exactly_as_memory_does_with_keys_on_every_master() {
    let fleet = Fleet::cluster(3);
    let memory = hot_tenant(&Fleet::memory(3, true), STEPS, SEED).await;
    let cluster = hot_tenant_against_the_exact_answer(&fleet).await;
    assert_eq!(cluster.admitted, memory.admitted);
    for (n, (c, m)) in cluster.answers.iter().zip(&memory.answers).enumerate() {
        assert_eq!(c, m, "answer {n} differs (cluster, memory)");
    }
    // The tenant's 16 keys live on every master, its ceiling on one.
    let cluster_ = fleet._cluster.as_ref().unwrap();
    let nodes = &cluster_.nodes;
    let calls: Vec<u64> = nodes
        .iter()
        .map(|n| redis_servers::evalsha_calls(n.port))
        .collect();
    let home = cluster_.owner(cluster_.slot_of("hot")).unwrap();
    eprintln!("script calls per master: {calls:?}; the ceiling is on master {home}");
    // Every decision made one call for its key's bucket (a dry run when
    // the ceiling refused here); the ceiling's master saw only the takes.
    let takes = calls.iter().sum::<u64>() - STEPS as u64;
    assert!(
        takes < STEPS as u64 / 10,
        "{takes} slices taken for {STEPS} decisions"
    );
    let keys: Vec<u64> = nodes
        .iter()
        .map(|n| redis_cli(n.port, &["DBSIZE"]).parse().unwrap())
        .collect();
    assert_eq!(keys.iter().sum::<u64>(), KEYS + 1, "{keys:?}");
    assert!(keys.iter().all(|&n| n >= 2), "keys per master: {keys:?}");
}

/// A quiet tenant: a fifth of its ceiling's rate, over 16 keys far below
/// their own limits, from three instances on a cluster. Nothing may be
/// refused, and the ceiling's master sees the slices taken, not the
/// decisions: near a full bucket a slice runs down as the store refills
/// (50 ms for a slice of 1 000 here), and the instances answer from it
/// meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_tenants_ceiling_is_taken_in_slices_not_per_decision() {
    let fleet = Fleet::cluster(3);
    let ceiling_limit = limit(32_000, "20000/second");
    let key_limit = limit(100, "2000/second");
    let steps = 3_000;
    let mut rng = Rng(SEED);
    let mut admitted = Vec::with_capacity(steps);
    for n in 0..steps {
        // 1 000 µs and 2 tokens on average: 2 000 tokens a second.
        fleet.clock.advance(Duration::from_micros(rng.below(1_000)));
        let instance = &fleet.instances[rng.below(3) as usize];
        let cost = 1 + rng.below(3);
        let k = rng.below(KEYS);
        let buckets = [ceiling("quiet"), per_key("quiet", &format!("user-{k}"))];
        let charges = [
            Charge::new(ceiling_limit, cost),
            Charge::new(key_limit, cost),
        ];
        let (allowed, verdicts) = decide_on(instance, &buckets, &charges).await.unwrap();
        assert!(allowed, "decision {n} refused: {verdicts:?}");
        admitted.push((fleet.clock.now(), cost));
    }
    conforms(&ceiling_limit, &admitted).unwrap();
    let cluster = fleet._cluster.as_ref().unwrap();
    let calls: Vec<u64> = cluster
        .nodes
        .iter()
        .map(|n| redis_servers::evalsha_calls(n.port))
        .collect();
    // One call per decision for its key; the rest are the slices taken.
    let takes = calls.iter().sum::<u64>() - steps as u64;
    let home = cluster.owner(cluster.slot_of("quiet")).unwrap();
    eprintln!("script calls per master: {calls:?} (ceiling on {home}); {takes} slices taken");
    assert!(
        takes * 10 < steps as u64,
        "{takes} slices taken for {steps} decisions"
    );
}

/// Many callers at once on three instances, no refill: together they
/// admit at most the burst, and at least the burst less what four slices
/// can hold (one per instance, and one left in the store).
async fn racers_take_at_most_the_burst(fleet: &Fleet) {
    let burst = 1_000;
    let ceiling_limit = limit(burst, "1/hour");
    let key_limit = limit(10, "1/hour");
    let admitted = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for (n, instance) in fleet.instances.iter().enumerate() {
        for t in 0..8 {
            let (instance, admitted) = (instance.clone(), admitted.clone());
            tasks.push(tokio::spawn(async move {
                for i in 0..200 {
                    let buckets = [ceiling("race"), per_key("race", &format!("k{n}-{t}-{i}"))];
                    let charges = [Charge::new(ceiling_limit, 1), Charge::new(key_limit, 1)];
                    if decide_on(&instance, &buckets, &charges).await.unwrap().0 {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    let admitted = admitted.load(Ordering::Relaxed);
    eprintln!("4 800 requests, burst {burst}: {admitted} admitted");
    assert!(
        admitted <= burst,
        "{admitted} admitted of a burst of {burst}"
    );
    // At most a slice held by each instance, and less than one slice left
    // in the store that no instance would take alone.
    assert!(
        admitted >= burst - 4 * (burst / 32),
        "{admitted} admitted: more refused early than four slices hold"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_racers() {
    racers_take_at_most_the_burst(&Fleet::memory(3, true)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_racers() {
    racers_take_at_most_the_burst(&Fleet::redis(3, true)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_racers() {
    racers_take_at_most_the_burst(&Fleet::cluster(3)).await;
}

/// What the store itself says the tenant's ceiling holds (a dry run goes
/// past the slices).
async fn store_balance(instance: &Arc<dyn Layer>, tenant: &str, ceiling_limit: Limit) -> u64 {
    let applied = instance
        .apply(Request {
            buckets: &[ceiling(tenant)],
            charges: &[Charge::new(ceiling_limit, 1)],
            policies: &POLICIES[..1],
            op: Op::DRY,
            attachment: None,
        })
        .await
        .unwrap();
    let v = applied.outcome.verdicts[0];
    if v.allowed { v.remaining + 1 } else { 0 }
}

/// One spending decision on `bucket` alone: whether it was admitted.
async fn spend_alone(instance: &Arc<dyn Layer>, bucket: &BucketKey, charge: Charge) -> bool {
    instance
        .apply(Request {
            buckets: std::slice::from_ref(bucket),
            charges: &[charge],
            policies: &POLICIES[..1],
            op: Op::SPEND,
            attachment: None,
        })
        .await
        .unwrap()
        .outcome
        .allowed
}

/// `n` decisions of cost 1 on `tenant`'s ceiling, each with a key of its
/// own; returns how many were admitted.
async fn admit(
    instance: &Arc<dyn Layer>,
    tenant: &str,
    ceiling_limit: Limit,
    keys: std::ops::Range<u64>,
) -> u64 {
    let key_limit = limit(10, "1/hour");
    let mut admitted = 0;
    for n in keys {
        let buckets = [ceiling(tenant), per_key(tenant, &format!("k{n}"))];
        let charges = [Charge::new(ceiling_limit, 1), Charge::new(key_limit, 1)];
        admitted += u64::from(decide_on(instance, &buckets, &charges).await.unwrap().0);
    }
    admitted
}

/// What a take leaves usable is counted from when the take was sent, not
/// from when its answer came: with every store call taking 400 µs of the
/// clock each way (eight refills of the ceiling), three sliced instances
/// under the hot tenant's load still admit nothing an exact bucket would
/// refuse.
#[tokio::test]
async fn slices_count_from_when_a_take_was_sent() {
    let slow = Fleet::slow(3, Duration::from_micros(400));
    let run = hot_tenant(&slow, STEPS, SEED).await;
    assert!(
        run.admitted > CEILING_BURST,
        "the ceiling refilled and was taken again"
    );
}

/// Where it shows: one sliced instance whose store calls take 30 ms each
/// way (three refills of the ceiling) takes ever larger slices from a
/// nearly full bucket, where what a slice may still use is bounded by the
/// take's debt; the moment it has taken one, a second instance, whose calls
/// take no time, takes everything the store holds; then the first spends
/// every token it still holds. Replayed against an exact bucket, every
/// admission passes: held plus stored never exceeded the burst. (Counted
/// from a take's answer instead of its sending, a slice would be held one
/// round trip too long: six tokens the bucket does not have.)
#[tokio::test]
async fn held_and_stored_never_exceed_the_burst_when_calls_take_time() {
    let ceiling_limit = limit(3_200, "100/second");
    let clock = Arc::new(ManualClock::new(T0));
    let memory: Arc<dyn Store> = Arc::new(MemoryStore::new(clock.clone(), 100_000));
    let slow: Arc<dyn Store> = Arc::new(Slow {
        inner: memory.clone(),
        clock: clock.clone(),
        step: Duration::from_millis(30),
        calls: AtomicU64::new(0),
    });
    let sliced = stack(slow, &clock, true);
    let direct = stack(memory, &clock, false);
    // Decisions on the ceiling alone: one answered from a slice makes no
    // store call, so it takes no time.
    let spend = |instance: &Arc<dyn Layer>, cost: u64| {
        let instance = instance.clone();
        async move {
            instance
                .apply(Request {
                    buckets: &[ceiling("rt")],
                    charges: &[Charge::new(ceiling_limit, cost)],
                    policies: &POLICIES[..1],
                    op: Op::SPEND,
                    attachment: None,
                })
                .await
                .unwrap()
                .outcome
                .allowed
        }
    };
    let mut admitted: Vec<(Micros, u64)> = Vec::new();
    let mut spent_from_slices = 0;
    for _ in 0..4 {
        // The sliced instance decides until its slices have grown.
        for _ in 0..40 {
            if spend(&sliced, 1).await {
                admitted.push((clock.now(), 1));
            }
        }
        // The other instance takes all the store holds, at once.
        let stored = store_balance(&direct, "rt", ceiling_limit).await;
        assert!(spend(&direct, stored).await, "the store held {stored}");
        admitted.push((clock.now(), stored));
        // The sliced instance spends what it still holds, at this instant.
        let at = clock.now();
        for _ in 0..300 {
            let allowed = spend(&sliced, 1).await;
            if clock.now() != at {
                // It asked the store: whatever came after is not held.
                if allowed {
                    admitted.push((clock.now(), 1));
                }
                break;
            }
            if !allowed {
                break;
            }
            admitted.push((at, 1));
            spent_from_slices += 1;
        }
        clock.advance(Duration::from_secs(40)); // the bucket full again
    }
    assert!(spent_from_slices > 0, "the slices held tokens to spend");
    admitted.sort_by_key(|(at, _)| *at);
    conforms(&ceiling_limit, &admitted).unwrap();
}

/// A refusal's retry-after is never early through slices: the same request
/// asked a microsecond before it is refused, asked at it is admitted, on
/// one instance alone (no other instance can take what the refill brings).
async fn a_sliced_refusal_is_never_early(fleet: &Fleet) {
    let ceiling_limit = limit(320, "100/second");
    let key_limit = limit(1_000, "1000/second");
    let instance = &fleet.instances[0];
    let ask = |n: u64| {
        let buckets = [ceiling("late"), per_key("late", &format!("k{}", n % 7))];
        let charges = [Charge::new(ceiling_limit, 3), Charge::new(key_limit, 3)];
        async move { decide_on(instance, &buckets, &charges).await.unwrap() }
    };
    let mut n = 0;
    let retry = loop {
        let (allowed, verdicts) = ask(n).await;
        n += 1;
        if !allowed {
            break verdicts.iter().map(|v| v.retry_after).max().unwrap();
        }
        assert!(n < 1_000, "the ceiling refuses once spent");
    };
    assert!(retry > 0);
    let refused_at = fleet.clock.now();
    fleet.clock.set(refused_at + retry - 1);
    let (early, verdicts) = ask(n).await;
    assert!(!early, "admitted 1 µs before its retry-after: {verdicts:?}");
    fleet.clock.set(refused_at + retry);
    let (on_time, verdicts) = ask(n + 1).await;
    assert!(
        on_time,
        "refused at its retry-after ({retry} µs): {verdicts:?}"
    );
}

#[tokio::test]
async fn a_sliced_refusal_is_never_early_in_memory() {
    a_sliced_refusal_is_never_early(&Fleet::memory(1, true)).await;
}

#[tokio::test]
async fn a_sliced_refusal_is_never_early_on_redis() {
    a_sliced_refusal_is_never_early(&Fleet::redis(1, false)).await;
}

/// An instance that dies holding a slice costs at most that slice, once:
/// the bucket refills as usual and the others are answered exactly.
#[tokio::test]
async fn an_instance_that_dies_holding_a_slice_loses_only_its_slice() {
    let mut fleet = Fleet::memory(2, true);
    let ceiling_limit = limit(320, "100/second");
    let cap = 320 / 32;
    // Instance 0 drains the bucket: all of it but at most one slice, which
    // it waits to refill before it takes again.
    let first = admit(&fleet.instances[0], "gone", ceiling_limit, 0..400).await;
    assert!((320 - cap..=320).contains(&first), "{first} of 320");
    fleet.clock.advance(Duration::from_millis(500)); // 50 tokens refill
    assert_eq!(
        admit(&fleet.instances[0], "gone", ceiling_limit, 1_000..1_001).await,
        1
    );
    // Instance 0 holds the rest of its new slice, and dies.
    fleet.instances.remove(0);
    let left = store_balance(&fleet.instances[0], "gone", ceiling_limit).await;
    let second = admit(&fleet.instances[0], "gone", ceiling_limit, 2_000..2_100).await;
    // 370 tokens in all: the first instance's, the dead slice (at most
    // one), the survivor's (all the store holds but at most one slice).
    assert!(
        320 - first + 50 - 1 - left < cap,
        "the dead slice held less than one slice"
    );
    assert!(
        (left.saturating_sub(cap)..=left).contains(&second),
        "{second} of {left}"
    );
    // A full refill later the bucket is whole again: nothing stays lost.
    fleet.clock.advance(Duration::from_secs(4));
    assert_eq!(
        store_balance(&fleet.instances[0], "gone", ceiling_limit).await,
        320
    );
    let third = admit(&fleet.instances[0], "gone", ceiling_limit, 3_000..3_400).await;
    assert!((320 - cap..=320).contains(&third), "{third} of 320");
}

/// A smaller limit or a clock that steps back drops what a slice holds:
/// tokens taken under the old limit are not spent under the new one.
#[tokio::test]
async fn a_new_limit_or_a_clock_step_back_drops_the_slice() {
    let fleet = Fleet::memory(1, true);
    let instance = &fleet.instances[0];
    let (old, new) = (limit(640, "10/second"), limit(100, "10/second"));
    assert_eq!(admit(instance, "tier", old, 0..100).await, 100);
    assert!(
        store_balance(instance, "tier", old).await <= 540,
        "the slice was spent in the store"
    );
    // The tier drops to 100: the 100 tokens spent (and the slice's) leave
    // nothing, whatever the old slice still held here.
    assert_eq!(admit(instance, "tier", new, 100..101).await, 0);
    // Three seconds refill 30 tokens of the 100 to 120 owed: what the store
    // holds is what is admitted, less at most one slice (3 tokens).
    fleet.clock.advance(Duration::from_secs(3));
    let held = store_balance(instance, "tier", new).await;
    assert!((10..=20).contains(&held), "{held}");
    let admitted = admit(instance, "tier", new, 200..240).await;
    assert!(
        (held - 3..=held).contains(&admitted),
        "{admitted} of {held}"
    );
    // A clock step back: the slice's deadline cannot be trusted, so it is
    // dropped; nothing is admitted that the store would not admit.
    fleet.clock.set(fleet.clock.now() - 5_000_000);
    assert_eq!(store_balance(instance, "tier", new).await, 0);
    assert_eq!(admit(instance, "tier", new, 300..310).await, 0);
}

/// With spread keys, a decision that spends must touch one key's buckets:
/// across keys it is refused with a message that says what to do; a dry
/// run across keys is answered slot by slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spread_keys_refuse_a_spend_across_keys_and_answer_a_dry_run() {
    let cluster = RedisCluster::start();
    let clock = Arc::new(ManualClock::new(T0));
    let store = redis_backend(cluster.url(), &clock, true);
    let key_limit = limit(10, "1/hour");
    let buckets: Vec<BucketKey> = (0..8)
        .map(|k| per_key("spread", &format!("u{k}")))
        .collect();
    let charges = vec![Charge::new(key_limit, 4); 8];
    let err = store
        .apply(Request::new(&buckets, &charges, Op::SPEND))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Unsupported(_)), "{err:?}");
    assert!(err.to_string().contains("one key's buckets"), "{err}");
    // One key spends 4 of its 10; the dry run sees 6 left there, 10 elsewhere.
    let one = store
        .apply(Request::new(&buckets[3..4], &charges[3..4], Op::SPEND))
        .await
        .unwrap();
    assert!(one.allowed);
    let dry = store
        .apply(Request::new(&buckets, &charges, Op::DRY))
        .await
        .unwrap();
    assert!(dry.allowed);
    let left: Vec<u64> = dry.verdicts.iter().map(|v| v.remaining).collect();
    assert_eq!(
        left,
        [6, 6, 6, 2, 6, 6, 6, 6],
        "what a spend of 4 would leave"
    );
    // A reservation and a lease on one key's buckets live on that key's
    // slot (their ids carry the key's spread) and settle and release there.
    let dave = [per_key("spread", "dave")];
    let reservation = Reservation {
        id: ReservationId::for_key("spread", "dave"),
        estimate: 6,
        lines: vec![1],
        ttl: 60_000_000,
    };
    let reserved = store
        .apply(
            Request::new(&dave, &[Charge::new(key_limit, 6)], Op::SPEND)
                .attach(&Attachment::Reservation(reservation.clone())),
        )
        .await
        .unwrap();
    assert!(reserved.allowed);
    let settled = store.settle(&reservation.id, 2).await.unwrap();
    assert_eq!(settled.status, SettleStatus::Settled);
    assert_eq!(settled.verdicts[0].remaining, 8, "10 less the 2 it used");
    let slots = [BucketKey::new(
        "spread",
        BucketKind::Rule {
            per_key: true,
            concurrency: true,
            shadow: false,
        },
        "",
        "dave",
    )];
    let cap = [Charge::new(Limit::concurrency(1).unwrap(), 1)];
    let lease = Lease {
        id: LeaseId::for_key("spread", "dave"),
        ttl: 60_000_000,
    };
    assert!(
        store
            .apply(Request::new(&slots, &cap, Op::SPEND).attach(&Attachment::Lease(lease.clone())))
            .await
            .unwrap()
            .allowed
    );
    let answer = store.lease(&lease.id, LeaseOp::Release).await.unwrap();
    assert_eq!(answer.status, LeaseStatus::Done);
    // One that mixes the key's bucket and the tenant's cannot be atomic.
    let mixed = [per_key("spread", "erin"), ceiling("spread")];
    let other = Reservation {
        id: ReservationId::new("spread"),
        ..reservation.clone()
    };
    let err = store
        .apply(
            Request::new(&mixed, &[Charge::new(key_limit, 1); 2], Op::SPEND)
                .attach(&Attachment::Reservation(other.clone())),
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("cannot mix them"), "{err}");

    // Charges across keys apply on each slot.
    let charged = store
        .apply(Request::new(&buckets, &charges, Op::Charge))
        .await
        .unwrap();
    assert!(charged.allowed);
    let after = store
        .apply(Request::new(&buckets, &charges, Op::DRY))
        .await
        .unwrap();
    assert!(!after.allowed);
    assert_eq!(after.verdicts[0].remaining, 2, "6 left, less the 4 asked");
}

/// Where a whole slice is more than the store holds, a take asks again for
/// exactly the decision's cost; a take the store refuses answers with the
/// store's balance and debt, not what this instance holds; a decision of
/// nothing takes nothing. One sliced instance and one exact one share an
/// in-process store; the sliced one's takes double (1, 2, 4, 8 tokens) as
/// it spends them, at decisions 0, 1, 3 and 7.
#[tokio::test]
async fn a_take_the_store_cannot_fill_asks_for_the_cost_alone() {
    let clock = Arc::new(ManualClock::new(T0));
    let memory: Arc<dyn Store> = Arc::new(MemoryStore::new(clock.clone(), 100_000));
    let counted = Arc::new(Slow {
        inner: memory.clone(),
        clock: clock.clone(),
        step: Duration::ZERO,
        calls: AtomicU64::new(0),
    });
    let sliced = stack(counted.clone(), &clock, true);
    let exact = stack(memory, &clock, false);
    let ceiling_limit = limit(3_200, "1/hour").with_debt(10).unwrap();
    let key_limit = limit(1_000, "1/hour");
    let spend_exactly = |tenant: &'static str, cost: u64, op: Op| {
        let exact = exact.clone();
        async move {
            exact
                .apply(Request {
                    buckets: &[ceiling(tenant)],
                    charges: &[Charge::new(ceiling_limit, cost)],
                    policies: &POLICIES[..1],
                    op,
                    attachment: None,
                })
                .await
                .unwrap()
                .outcome
        }
    };
    let keys = AtomicU64::new(0);
    // One decision through the sliced instance: (allowed, the ceiling's
    // verdict, store calls made).
    let decide = |tenant: &'static str, cost: u64| {
        let (sliced, counted) = (sliced.clone(), counted.clone());
        let key = format!("k{}", keys.fetch_add(1, Ordering::Relaxed));
        async move {
            let buckets = [ceiling(tenant), per_key(tenant, &key)];
            let charges = [
                Charge::new(ceiling_limit, cost),
                Charge::new(key_limit, cost),
            ];
            let before = counted.calls.load(Ordering::Relaxed);
            let (allowed, verdicts) = decide_on(&sliced, &buckets, &charges).await.unwrap();
            (
                allowed,
                verdicts[0],
                counted.calls.load(Ordering::Relaxed) - before,
            )
        }
    };
    let leave = |tenant: &'static str, n: u64| {
        let exact = exact.clone();
        async move {
            let balance = store_balance(&exact, tenant, ceiling_limit).await;
            assert!(spend_exactly(tenant, balance - n, Op::SPEND).await.allowed);
            assert_eq!(store_balance(&exact, tenant, ceiling_limit).await, n);
        }
    };
    // Eight decisions of 1: the last took 8, and holds 7.
    for tenant in ["a", "e"] {
        for n in 0..8 {
            let (allowed, _, calls) = decide(tenant, 1).await;
            assert!(allowed);
            let took = [0, 1, 3, 7].contains(&n);
            assert_eq!(calls, if took { 2 } else { 1 }, "{tenant}: decision {n}");
        }
    }
    // a spends what it holds; 5 are left in the store. A slice of 16 is
    // refused, and the cost of 3 alone granted.
    for _ in 0..7 {
        assert_eq!(decide("a", 1).await.2, 1, "answered from the slice");
    }
    leave("a", 5).await;
    let (allowed, _, calls) = decide("a", 3).await;
    assert!(allowed);
    assert_eq!(calls, 3, "the key, the slice, the cost alone");
    assert_eq!(store_balance(&exact, "a", ceiling_limit).await, 2);
    // e holds 2 and the store 1: a decision of 3 takes, is refused, and
    // reports the store's 1.
    for _ in 0..5 {
        assert_eq!(decide("e", 1).await.2, 1);
    }
    leave("e", 1).await;
    let (allowed, ceiling_verdict, calls) = decide("e", 3).await;
    assert!(!allowed);
    assert_eq!(calls, 2, "the key, then one take");
    assert_eq!((ceiling_verdict.remaining, ceiling_verdict.debt), (1, 0));
    // In debt: refused, with the store's debt.
    assert!(spend_exactly("c", 3_205, Op::Charge).await.allowed);
    let (allowed, ceiling_verdict, _) = decide("c", 1).await;
    assert!(!allowed);
    assert_eq!((ceiling_verdict.remaining, ceiling_verdict.debt), (0, 5));
    // A decision of nothing takes no slice, even where slices are taken.
    for tenant in ["a", "d"] {
        let before = store_balance(&exact, tenant, ceiling_limit).await;
        let (allowed, _, calls) = decide(tenant, 0).await;
        assert!(allowed);
        assert_eq!(calls, 1, "{tenant}: one call, for the key and the ceiling");
        assert_eq!(store_balance(&exact, tenant, ceiling_limit).await, before);
    }
}

/// A backend that is down: every call fails as unavailable.
struct Down;

impl Store for Down {
    fn apply<'a>(&'a self, _: Request<'a>) -> StoreFuture<'a> {
        Box::pin(std::future::ready(Err(StoreError::Unavailable(
            "down".into(),
        ))))
    }

    fn settle<'a>(&'a self, _: &'a ReservationId, _: u64) -> SettleFuture<'a> {
        Box::pin(std::future::ready(Err(StoreError::Unavailable(
            "down".into(),
        ))))
    }

    fn lease<'a>(&'a self, _: &'a LeaseId, _: LeaseOp) -> LeaseFuture<'a> {
        Box::pin(std::future::ready(Err(StoreError::Unavailable(
            "down".into(),
        ))))
    }

    fn ping(&self) -> PingFuture<'_> {
        Box::pin(std::future::ready(Err(StoreError::Unavailable(
            "down".into(),
        ))))
    }

    fn kind(&self) -> &'static str {
        "down"
    }

    fn status(&self) -> StoreStatus {
        StoreStatus {
            kind: "down",
            breaker: None,
            nodes: Vec::new(),
            local: None,
            answered: false,
        }
    }
}

/// With the store down, a decision answered by the policies says so,
/// whether its sliced bucket alone or with others was decided by them.
#[tokio::test]
async fn a_policys_answer_through_the_slices_is_marked_degraded() {
    let clock = Arc::new(ManualClock::new(T0));
    let local = Arc::new(MemoryStore::new(clock.clone(), 1_000));
    let layers = Layers {
        fallback: Some(tollgate_core::store::fallback::Fallback {
            local,
            local_fraction: 1.0,
            deny_retry_after: 1_000_000,
        }),
        deny_cache: None,
        slices: Some(1_000),
    };
    let layer = build(Arc::new(Down), layers, clock.clone());
    let ceiling_limit = limit(3_200, "1/hour");
    let allow = [OnStoreUnavailable::Allow, OnStoreUnavailable::Allow];
    for with_key in [true, false] {
        let buckets = [ceiling("acme"), per_key("acme", "k")];
        let charges = [Charge::new(ceiling_limit, 1), Charge::new(ceiling_limit, 1)];
        let n = if with_key { 2 } else { 1 };
        let applied = layer
            .apply(Request {
                buckets: &buckets[..n],
                charges: &charges[..n],
                policies: &allow[..n],
                op: Op::SPEND,
                attachment: None,
            })
            .await
            .unwrap();
        assert!(applied.outcome.allowed);
        assert!(applied.degraded, "with the key's bucket: {with_key}");
    }
}

/// A decision on two sliced buckets takes from each, and is refused by
/// the second when the first admits (the first's token goes back to the
/// instance's slice).
#[tokio::test]
async fn every_sliced_bucket_of_a_decision_is_taken_from() {
    let fleet = Fleet::memory(2, true);
    let (instance, other) = (&fleet.instances[0], &fleet.instances[1]);
    let ceiling_limit = limit(10, "1/hour");
    let buckets = [ceiling("a"), ceiling("b")];
    // Another instance empties b's ceiling.
    assert!(spend_alone(other, &buckets[1], Charge::new(ceiling_limit, 10)).await);
    let (allowed, verdicts) = decide_on(
        instance,
        &buckets,
        &[Charge::new(ceiling_limit, 1), Charge::new(ceiling_limit, 1)],
    )
    .await
    .unwrap();
    assert!(!allowed, "{verdicts:?}");
    assert!(!verdicts[1].allowed);
    // a's token, taken from the store, went back to this instance's slice:
    // the next decision on a alone spends it without a store call.
    assert_eq!(store_balance(instance, "a", ceiling_limit).await, 9);
    assert!(spend_alone(instance, &buckets[0], Charge::new(ceiling_limit, 1)).await);
    assert_eq!(store_balance(instance, "a", ceiling_limit).await, 9);
}

/// Only spending decisions without a record attached go through the
/// slices; the rest reach the store as they are, synchronously where the
/// store answers so, and a reservation on a sliced bucket is recorded.
#[tokio::test]
async fn what_is_not_a_plain_spend_passes_the_slices_by() {
    let fleet = Fleet::memory(1, true);
    let instance = &fleet.instances[0];
    let ceiling_limit = limit(100, "1/hour");
    let on = |bucket: BucketKey, op: Op| (bucket, op);
    for ((bucket, op), sync) in [
        (on(ceiling("a"), Op::SPEND), false),
        (on(ceiling("a"), Op::DRY), true),
        (on(per_key("a", "k"), Op::SPEND), true),
    ] {
        let request = Request {
            buckets: std::slice::from_ref(&bucket),
            charges: &[Charge::new(ceiling_limit, 1)],
            policies: &POLICIES[..1],
            op,
            attachment: None,
        };
        assert_eq!(
            instance.apply_now(request).is_some(),
            sync,
            "{bucket:?} {op:?}"
        );
    }
    // Two reservations of 5 on the sliced ceiling, one made synchronously
    // and one awaited; each is recorded, and settles at 2.
    let reservation = || Reservation {
        id: ReservationId::new("a"),
        estimate: 5,
        lines: vec![1],
        ttl: 60_000_000,
    };
    let (now, later) = (reservation(), reservation());
    for (r, sync) in [(&now, true), (&later, false)] {
        let attachment = Attachment::Reservation(r.clone());
        let request = Request {
            buckets: &[ceiling("a")],
            charges: &[Charge::new(ceiling_limit, 5)],
            policies: &POLICIES[..1],
            op: Op::SPEND,
            attachment: Some(&attachment),
        };
        let applied = if sync {
            instance.apply_now(request).unwrap().unwrap()
        } else {
            instance.apply(request).await.unwrap()
        };
        assert!(applied.outcome.allowed);
        let settled = instance.settle(&r.id, 2).await.unwrap();
        assert_eq!(settled.status, SettleStatus::Settled, "sync: {sync}");
    }
    assert_eq!(store_balance(instance, "a", ceiling_limit).await, 96);
}
