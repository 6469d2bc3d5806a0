//! Redis in production: a dead shard stays one shard's problem, a replica
//! promoted (by the cluster or by Sentinel) is followed without a restart,
//! and slots moved under load lose nothing. Real redis-server clusters and
//! Sentinels on loopback, real gRPC calls; every call must be answered
//! (an error fails the test) and every admission is counted.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::redis::{RedisCluster, RedisServer, redis_cli};
use common::{TestServer, row};
use tokio::time::Instant;
use tollgate::limits::LimitRow;
use tollgate::proto::v1::rate_limiter_client::RateLimiterClient;
use tollgate::proto::v1::{Degraded, ShouldAllowRequest, ShouldAllowResponse};
use tollgate::server::StoreSpec;
use tonic::transport::Channel;

/// Every call must be answered within this deadline, far above the 100 ms
/// store timeout.
const DEADLINE: Duration = Duration::from_secs(3);

/// Tokens no test spends: with a refill of one an hour (less than one
/// token in a test), a bucket's remaining tokens plus what it admitted is
/// this, exactly.
const PLENTY: i64 = 100_000;

fn rule(tenant: &str, scope: &str, policy: &str) -> LimitRow {
    let mut r = row(
        &format!("{tenant}-{scope}"),
        tenant,
        "",
        scope,
        PLENTY,
        "1/hour",
    );
    r.on_store_unavailable = policy.parse().unwrap();
    r
}

async fn ask(
    client: &mut RateLimiterClient<Channel>,
    tenant: &str,
    key: &str,
    dry_run: bool,
) -> ShouldAllowResponse {
    let mut request = tonic::Request::new(ShouldAllowRequest {
        key: key.into(),
        cost: 1,
        tenant: tenant.into(),
        resource: String::new(),
        dry_run,
    });
    request.set_timeout(DEADLINE);
    client
        .should_allow(request)
        .await
        .expect("every call is answered, none with an error")
        .into_inner()
}

/// What one tenant's load saw.
#[derive(Default)]
struct Tally {
    decided: AtomicU64,
    degraded: AtomicU64,
    /// Admitted by Redis (not by a policy).
    admitted: AtomicU64,
    /// Decided after `mark` was set.
    decided_marked: AtomicU64,
    degraded_marked: AtomicU64,
    /// Microseconds, of calls answered by policy after `mark`.
    degraded_latencies: parking_lot::Mutex<Vec<u64>>,
    /// Microseconds, of calls answered by Redis.
    latencies: parking_lot::Mutex<Vec<u64>>,
}

/// `workers` tasks deciding for `tenant` on keys `key-0..keys` until `stop`,
/// each as fast as it is answered or, with `pace`, on a schedule of one call
/// per `pace`: a worker answered late makes up the calls it missed as soon
/// as it can, so a stall of the machine costs it no calls, while a worker
/// whose every call waits (on a dead node, say) falls behind for good.
#[allow(clippy::too_many_arguments)]
fn load(
    server: &TestServer,
    tenant: &str,
    workers: usize,
    keys: u64,
    pace: Option<Duration>,
    tally: Arc<Tally>,
    mark: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let url = server.url();
    (0..workers)
        .map(|w| {
            let (tenant, tally, mark, stop, url) = (
                tenant.to_owned(),
                tally.clone(),
                mark.clone(),
                stop.clone(),
                url.clone(),
            );
            tokio::spawn(async move {
                let mut client = RateLimiterClient::connect(url).await.unwrap();
                let mut ticks = pace.map(|pace| {
                    let mut ticks = tokio::time::interval(pace);
                    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                    ticks
                });
                let mut i = w as u64;
                while !stop.load(Ordering::Relaxed) {
                    if let Some(ticks) = &mut ticks {
                        ticks.tick().await;
                    }
                    i += workers as u64;
                    let marked = mark.load(Ordering::Relaxed);
                    let started = Instant::now();
                    let r = ask(&mut client, &tenant, &format!("key-{}", i % keys), false).await;
                    let took = started.elapsed().as_micros() as u64;
                    tally.decided.fetch_add(1, Ordering::Relaxed);
                    if marked {
                        tally.decided_marked.fetch_add(1, Ordering::Relaxed);
                    }
                    if r.degraded() == Degraded::None {
                        tally.latencies.lock().push(took);
                        if r.allowed {
                            tally.admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    } else {
                        tally.degraded.fetch_add(1, Ordering::Relaxed);
                        if marked {
                            tally.degraded_marked.fetch_add(1, Ordering::Relaxed);
                            tally.degraded_latencies.lock().push(took);
                        }
                    }
                }
            })
        })
        .collect()
}

/// A server on `url` with `rules` and a store timeout.
async fn serve(rules: Vec<LimitRow>, url: String, timeout: Duration) -> TestServer {
    TestServer::launch(Some(&rules), move |c| {
        c.store = StoreSpec::Redis(url);
        c.store_timeout = timeout;
    })
    .await
}

/// Loads on several tenants at once.
struct Loads {
    tallies: Vec<Arc<Tally>>,
    mark: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Tally {
    /// Decisions Redis answered so far.
    fn redis_decided(&self) -> u64 {
        self.decided.load(Ordering::Relaxed) - self.degraded.load(Ordering::Relaxed)
    }
}

impl Loads {
    fn start(server: &TestServer, tenants: &[String], workers: usize, keys: u64) -> Self {
        Self::paced(server, tenants, workers, keys, None)
    }

    /// As [`Loads::start`], each worker making at most one call per `pace`.
    fn paced(
        server: &TestServer,
        tenants: &[String],
        workers: usize,
        keys: u64,
        pace: Option<Duration>,
    ) -> Self {
        let (mark, stop) = (Arc::default(), Arc::<AtomicBool>::default());
        let tallies: Vec<Arc<Tally>> = tenants.iter().map(|_| Arc::default()).collect();
        let tasks = tenants
            .iter()
            .zip(&tallies)
            .flat_map(|(tenant, tally)| {
                load(
                    server,
                    tenant,
                    workers,
                    keys,
                    pace,
                    tally.clone(),
                    Arc::clone(&mark),
                    stop.clone(),
                )
            })
            .collect();
        Self {
            tallies,
            mark,
            stop,
            tasks,
        }
    }

    /// Stops the loads; panics if any call failed.
    async fn finish(self) -> Vec<Arc<Tally>> {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await.expect("no call failed");
        }
        self.tallies
    }
}

fn p99(samples: &[u64]) -> u64 {
    let mut s = samples.to_vec();
    s.sort_unstable();
    s.get(s.len().saturating_sub(1) * 99 / 100)
        .copied()
        .unwrap_or(0)
}

fn status_node(status: &serde_json::Value, port: u16) -> &serde_json::Value {
    status["store"]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["address"] == format!("127.0.0.1:{port}"))
        .unwrap_or_else(|| panic!("node {port} in {status}"))
}

async fn status(server: &TestServer) -> serde_json::Value {
    let (code, body) = server.http_get("/v1/status").await.unwrap();
    assert_eq!(code, 200);
    serde_json::from_str(&body).unwrap()
}

async fn metrics(server: &TestServer) -> String {
    server.http_get("/metrics").await.unwrap().1
}

fn sample(metrics: &str, series: &str) -> u64 {
    common::envoy::sample(metrics, series).unwrap_or(0)
}

/// One of three masters killed (no replicas, `cluster-require-full-coverage
/// no` as the README advises): the other two masters' tenants go on being
/// decided by Redis; the dead master's breaker opens and its tenant is
/// answered by its policy, at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_master_is_only_its_own_shards_problem() {
    one_master_down(RedisServer::kill).await;
}

/// The same with a master frozen (SIGSTOP: connections open, nothing
/// answers, every call to it waits for the timeout): its breaker opens
/// after a few timeouts, and the other masters' calls never wait for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_master_is_only_its_own_shards_problem() {
    one_master_down(|node| node.freeze()).await;
}

async fn one_master_down(outage: impl FnOnce(&mut RedisServer)) {
    let mut cluster = RedisCluster::start_with(
        0,
        &[
            "--cluster-node-timeout",
            "1000",
            "--cluster-require-full-coverage",
            "no",
        ],
    );
    let tenants: Vec<String> = (0..3).map(|n| cluster.tenant_on(n, "t")).collect();
    let rules: Vec<LimitRow> = tenants.iter().map(|t| rule(t, "key", "allow")).collect();
    // The control: the same load on a server of its own over a Redis the
    // outage does not touch. A stall of this shared machine (the test
    // process, or the Redis processes it waits on) slows it as it slows the
    // survivors; waiting on the dead node slows only the survivors.
    let control_redis = RedisServer::start();
    let control = serve(
        vec![rule("control", "key", "allow")],
        control_redis.url(),
        Duration::from_secs(1),
    )
    .await;
    // A timeout of a second: long enough that no surviving master's call
    // misses it while this shared machine stalls, so that every policy
    // answer and every node error below comes from the outage.
    let server = serve(rules, cluster.url(), Duration::from_secs(1)).await;
    // Paced, 2 callers × 50 a second per tenant, well below what this
    // machine keeps up with even with a second copy of the suite beside
    // this one (160 a second per tenant): what else runs here does not move
    // the rate, while a survivor whose calls waited on the dead node would
    // fall behind it (a call waiting 40 ms of every 20 ms it is due). (Unpaced, the dead shard's callers, answered at
    // once, would take the cores from the others.)
    let pace = Some(Duration::from_millis(20));
    let loads = Loads::paced(&server, &tenants, 2, 50, pace);
    let control_loads = Loads::paced(&control, &["control".to_owned()], 2, 50, pace);
    // Each tenant's decisions per second before the outage, warmed up.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let decided = |loads: &Loads| -> Vec<u64> {
        loads
            .tallies
            .iter()
            .map(|t| t.decided.load(Ordering::Relaxed))
            .collect()
    };
    let (from, counted, counted_control) =
        (Instant::now(), decided(&loads), decided(&control_loads));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rates = |now: Vec<u64>, then: &[u64]| -> Vec<f64> {
        now.iter()
            .zip(then)
            .map(|(to, from_count)| (to - from_count) as f64 / from.elapsed().as_secs_f64())
            .collect()
    };
    let before = rates(decided(&loads), &counted);
    let control_before = rates(decided(&control_loads), &counted_control)[0];
    let dead_port = cluster.nodes[2].port;
    outage(&mut cluster.nodes[2]);
    let killed = Instant::now();
    // Once the dead master's breaker is open, measure.
    let mut opened = None;
    while killed.elapsed() < Duration::from_secs(5) {
        let s = status(&server).await;
        if status_node(&s, dead_port)["breaker"] == "open" {
            opened = Some(killed.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let opened = opened.expect("the dead master's breaker opened");
    let errors_at_open = metrics(&server).await;
    loads.mark.store(true, Ordering::Relaxed);
    control_loads.mark.store(true, Ordering::Relaxed);
    let marked = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let marked_for = marked.elapsed().as_secs_f64();
    let tallies = loads.finish().await;
    let control_tally = control_loads.finish().await.remove(0);

    let s = status(&server).await;
    for n in 0..2 {
        assert_eq!(
            status_node(&s, cluster.nodes[n].port)["breaker"],
            "closed",
            "a surviving master's breaker stays closed: {s}"
        );
    }
    // Open, or half-open while a probe (every cooldown) is out.
    let dead_state = status_node(&s, dead_port)["breaker"].clone();
    assert!(dead_state == "open" || dead_state == "half-open", "{s}");
    assert!(status_node(&s, dead_port)["errors"].as_u64().unwrap() >= 5);
    assert_ne!(
        s["store"]["breaker"], "closed",
        "the store reports its worst node"
    );
    let m = metrics(&server).await;
    let dead_series =
        format!("tollgate_store_node_circuit_state{{node=\"127.0.0.1:{dead_port}\"}}");
    assert!(sample(&m, &dead_series) >= 1, "{m}");
    for n in 0..2 {
        let port = cluster.nodes[n].port;
        assert_eq!(
            sample(
                &m,
                &format!("tollgate_store_node_circuit_state{{node=\"127.0.0.1:{port}\"}}")
            ),
            0
        );
    }

    let dead = &tallies[2];
    assert_eq!(
        dead.degraded_marked.load(Ordering::Relaxed),
        dead.decided_marked.load(Ordering::Relaxed),
        "with its breaker open, the dead master's tenant is answered by its policy"
    );
    assert!(dead.decided_marked.load(Ordering::Relaxed) > 0);
    eprintln!(
        "breaker open {:?} after the kill; per tenant decisions per second before / during, degraded during, p99 by Redis / by policy (µs):",
        opened
    );
    let rate_during = |t: &Tally| t.decided_marked.load(Ordering::Relaxed) as f64 / marked_for;
    eprintln!(
        "  control on a Redis of its own: {control_before:.0} / {:.0}, p99 {}",
        rate_during(&control_tally),
        p99(&control_tally.latencies.lock())
    );
    for (n, t) in tallies.iter().enumerate() {
        eprintln!(
            "  master {n}: {:.0} / {:.0}, {} degraded, p99 {} / {}",
            before[n],
            rate_during(t),
            t.degraded_marked.load(Ordering::Relaxed),
            p99(&t.latencies.lock()),
            p99(&t.degraded_latencies.lock()),
        );
    }
    for (n, t) in tallies.iter().enumerate().take(2) {
        // No decision of a surviving master's tenant was answered by
        // policy, and none of its calls failed, from the start of the
        // outage on: a call that waited on the dead node (behind it in a
        // queue, on a shared connection or lock) would have missed the
        // timeout and shown here.
        assert_eq!(
            t.degraded.load(Ordering::Relaxed),
            0,
            "tenant on surviving master {n}: decisions answered by policy"
        );
        let port = cluster.nodes[n].port;
        let node = format!("node=\"127.0.0.1:{port}\"");
        let errors = |m: &str| -> u64 {
            m.lines()
                .filter(|l| l.starts_with("tollgate_store_node_errors_total{") && l.contains(&node))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
                .sum()
        };
        assert_eq!(
            errors(&errors_at_open),
            0,
            "calls to master {n} failed: {errors_at_open}"
        );
        assert_eq!(errors(&m), 0, "calls to master {n} failed: {m}");
        // And the survivors kept their pace: decisions per second during
        // the outage, against the same run's before it, as well as the
        // control on a Redis of its own kept its pace (a stall of this
        // shared machine slows that one too; waiting on the dead node
        // slows only the survivors), with a fifth of slack.
        let during = rate_during(t);
        let machine = (rate_during(&control_tally) / control_before).min(1.0);
        assert!(
            during >= 0.8 * machine * before[n],
            "tenant on surviving master {n}: {during:.0} decisions per second during the outage, \
             {:.0} before; the control on a Redis of its own kept {:.0} % of its pace",
            before[n],
            machine * 100.0
        );
    }
    server.stop().await;
    control.stop().await;
}

/// Callers driving a tenant through a failover.
const FAILOVER_CALLERS: usize = 4;

/// The least overshoot a failover can show: a call in flight when the
/// primary died may have been applied (and replicated) with its answer
/// lost, so the caller counts a refusal for tokens Redis spent: at most one
/// per caller.
const LOST_ANSWERS: i64 = -(FAILOVER_CALLERS as i64);

/// What a failover cost.
struct Failover {
    /// Admitted by Redis, all told.
    admitted: u64,
    /// The most admissions the kill can have taken with it: those of the
    /// replication gap at the kill (see [`gap_admissions`]).
    at_risk: u64,
    /// From the kill to the replica's `ROLE` saying master.
    promoted: Duration,
    /// From the kill to the first decision Redis answered again.
    back: Duration,
    tally: Arc<Tally>,
}

/// Runs `tenant`'s load until Redis answers again after `kill` (by
/// promoting the server on port `replica`), then a little longer.
async fn through_a_failover(
    server: &TestServer,
    tenant: &str,
    (master, replica): (u16, u16),
    kill: impl FnOnce(),
) -> Failover {
    let loads = Loads::start(server, &[tenant.to_owned()], FAILOVER_CALLERS, 1);
    let tally = loads.tallies[0].clone();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let from = (
        repl_offset(master, "master_repl_offset"),
        tally.redis_decided(),
    );
    // Redis answers before the kill (a call can still miss the 100 ms
    // timeout while this shared machine stalls).
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        tally.degraded.load(Ordering::Relaxed) * 100 <= tally.decided.load(Ordering::Relaxed),
        "Redis answers before the kill"
    );
    // Killed under load, replication running as it does: whatever the
    // replica had not received is lost with the master.
    let admitted_before = tally.admitted.load(Ordering::Relaxed);
    let to = (
        repl_offset(master, "master_repl_offset"),
        tally.redis_decided(),
    );
    let received = repl_offset(replica, "slave_repl_offset");
    kill();
    let killed = Instant::now();
    loads.mark.store(true, Ordering::Relaxed);
    let promotion = tokio::task::spawn_blocking(move || {
        while killed.elapsed() < Duration::from_secs(30) {
            if redis_cli(replica, &["ROLE"]).lines().next() == Some("master") {
                return Some(killed.elapsed());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        None
    });
    // Wait for the outage to show, then for Redis to answer again.
    while tally.degraded_marked.load(Ordering::Relaxed) == 0 {
        assert!(
            killed.elapsed() < Duration::from_secs(10),
            "the kill showed"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // Admissions answered since the offsets were read (the last of them
    // from the dead master's socket buffers; the replica is not yet
    // promoted, so none is a new decision): their writes may be lost too.
    let late = tally.admitted.load(Ordering::Relaxed) - admitted_before;
    let at_risk = gap_admissions(from, to, received) + late;
    let mut back = None;
    let mut client = server.client().await;
    while killed.elapsed() < Duration::from_secs(30) {
        if ask(&mut client, tenant, "probe", true).await.degraded() == Degraded::None {
            back = Some(killed.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let back = back.expect("decisions went back to Redis after the promotion");
    tokio::time::sleep(Duration::from_millis(500)).await;
    loads.finish().await;
    let promoted = promotion.await.unwrap().expect("the replica was promoted");
    Failover {
        admitted: tally.admitted.load(Ordering::Relaxed),
        at_risk,
        promoted,
        back,
        tally,
    }
}

/// A replication offset (`INFO replication`) of the server on `port`.
fn repl_offset(port: u16, field: &str) -> u64 {
    redis_cli(port, &["INFO", "replication"])
        .lines()
        .find_map(|l| {
            l.strip_prefix(field)?
                .strip_prefix(':')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

/// The admissions a replication gap holds: the bytes the master had
/// written (`to.0`) and the replica not yet received (`received`), at the
/// bytes one decision adds to the replication stream, measured on this run
/// from `from` to `to` (offset, decisions Redis answered). Rounded up, and
/// one more for a decision written while its bytes were counted.
fn gap_admissions(from: (u64, u64), to: (u64, u64), received: u64) -> u64 {
    let decisions = to.1.saturating_sub(from.1).max(1);
    let bytes_per_decision = (to.0.saturating_sub(from.0) / decisions).max(1);
    let gap = to.0.saturating_sub(received);
    eprintln!("replication gap at the kill: {gap} bytes, {bytes_per_decision} bytes per decision");
    gap.div_ceil(bytes_per_decision) + 1
}

/// What the bucket has left, by Redis.
async fn remaining(server: &TestServer, tenant: &str) -> i64 {
    let mut client = server.client().await;
    for _ in 0..50 {
        let r = ask(&mut client, tenant, "key-0", true).await;
        if r.degraded() == Degraded::None {
            // A dry run reports what would be left after it.
            return r.remaining as i64 + 1;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("Redis never answered a dry run");
}

/// A 3-master, 3-replica cluster; a master killed under load; its replica
/// is promoted and Tollgate follows without a restart. Admissions Redis
/// acknowledged but had not yet replicated are lost with the master: the
/// overshoot, measured here on one bucket, is at most the admissions of
/// the replication gap at the kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_promoted_under_load_is_followed() {
    let mut cluster = RedisCluster::start_with(1, &["--cluster-node-timeout", "1000"]);
    let masters = cluster.masters();
    assert_eq!(masters.len(), 3);
    let master = masters[0];
    let tenant = cluster.tenant_on(master, "f");
    let rules = vec![rule(&tenant, "key", "deny")];
    // A long timeout, so that no call misses it under a stall yet spends in
    // Redis (the overshoot count would be short by it); the dead master's
    // calls fail at once (refused connections) whatever the timeout.
    let server = serve(rules, cluster.url(), Duration::from_secs(1)).await;
    let dead_port = cluster.nodes[master].port;
    let replica = cluster.replicas_of(master);
    assert_eq!(replica.len(), 1);
    let replica_port = cluster.nodes[replica[0]].port;
    let f = through_a_failover(&server, &tenant, (dead_port, replica_port), || {
        cluster.nodes[master].kill();
    })
    .await;
    let admitted = f.admitted;
    let left = remaining(&server, &tenant).await;
    let overshoot = admitted as i64 + left - PLENTY;
    let m = metrics(&server).await;
    let s = status(&server).await;
    eprintln!(
        "replica promotion: promoted after {:?}, Redis again after {:?} ({:?} later); {} decisions, {} by policy (deny), {admitted} admitted by Redis, {left} left: overshoot {overshoot} (at most {})",
        f.promoted,
        f.back,
        f.back.saturating_sub(f.promoted),
        f.tally.decided.load(Ordering::Relaxed),
        f.tally.degraded.load(Ordering::Relaxed),
        f.at_risk,
    );
    assert_eq!(
        cluster.owner(cluster.slot_of(&tenant)),
        Some(replica[0]),
        "the replica serves the slot"
    );
    assert!(
        sample(&m, "tollgate_store_failovers_total") >= 1,
        "the failover was seen: {m}"
    );
    let new_master = cluster
        .owner(cluster.slot_of(&tenant))
        .expect("a new master");
    assert_ne!(new_master, master);
    let nodes = s["store"]["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 3, "three primaries: {s}");
    assert!(
        nodes
            .iter()
            .all(|n| n["address"] != format!("127.0.0.1:{dead_port}")),
        "the dead master left the map: {s}"
    );
    assert!(
        overshoot >= LOST_ANSWERS,
        "Redis never forgets more than it was told (but answers can be lost): {overshoot}"
    );
    // What the promoted replica forgot is what it had not received: a
    // follower that lost the bucket (or read another) would show every
    // admission before the kill as overshoot.
    assert!(
        overshoot <= f.at_risk as i64,
        "overshoot {overshoot} of {admitted} admissions, above the {} of the replication gap",
        f.at_risk
    );
    server.stop().await;
}

/// A primary, its replica and three Sentinels watching them (`mymaster`,
/// `down-after-milliseconds 500`), each Sentinel aware of the replica and
/// of the other two.
struct Watched {
    primary: RedisServer,
    replica: RedisServer,
    _sentinels: Vec<Sentinel>,
    url: String,
}

impl Watched {
    fn start() -> Self {
        let primary = RedisServer::start();
        let replica =
            RedisServer::start_with(&["--replicaof", "127.0.0.1", &primary.port.to_string()]);
        let sentinels: Vec<Sentinel> = (0..3).map(|_| Sentinel::start(primary.port)).collect();
        let mut watching = false;
        for _ in 0..1000 {
            let ready = sentinels.iter().all(|s| {
                let info = redis_cli(s.port, &["SENTINEL", "MASTER", "mymaster"]);
                let field = |name: &str| -> Option<u64> {
                    let lines: Vec<&str> = info.lines().collect();
                    let i = lines.iter().position(|l| *l == name)?;
                    lines.get(i + 1)?.parse().ok()
                };
                field("num-slaves") == Some(1) && field("num-other-sentinels") == Some(2)
            });
            let synced =
                redis_cli(replica.port, &["INFO", "replication"]).contains("master_link_status:up");
            if ready && synced {
                watching = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            redis_cli(replica.port, &["INFO", "replication"]).contains("master_link_status:up"),
            "the replica synced with its primary within 20 s"
        );
        // A test that went on without it would measure a failover the
        // Sentinels were not yet ready to make.
        assert!(
            watching,
            "within 20 s every Sentinel sees the replica and the two other Sentinels"
        );
        let hosts: Vec<String> = sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect();
        let url = format!("redis-sentinel://{}/mymaster", hosts.join(","));
        Self {
            primary,
            replica,
            _sentinels: sentinels,
            url,
        }
    }
}

/// A Sentinel-watched primary with one replica and three Sentinels;
/// `redis-sentinel://` names them; the primary is killed under load and
/// Tollgate follows the promoted replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_is_followed() {
    let mut watched = Watched::start();
    let tenant = "sentinel";
    let rules = vec![rule(tenant, "key", "deny")];
    // A long timeout, as for the cluster's failover.
    let server = serve(rules, watched.url.clone(), Duration::from_secs(1)).await;
    let s = status(&server).await;
    assert_eq!(status_node(&s, watched.primary.port)["breaker"], "closed");
    let replica = watched.replica.port;
    let primary = watched.primary.port;
    let f = through_a_failover(&server, tenant, (primary, replica), || {
        watched.primary.kill()
    })
    .await;
    let admitted = f.admitted;
    let left = remaining(&server, tenant).await;
    let overshoot = admitted as i64 + left - PLENTY;
    eprintln!(
        "Sentinel failover: promoted after {:?}, Redis again after {:?} ({:?} later); {} decisions, {} by policy (deny), {admitted} admitted by Redis, {left} left: overshoot {overshoot} (at most {})",
        f.promoted,
        f.back,
        f.back.saturating_sub(f.promoted),
        f.tally.decided.load(Ordering::Relaxed),
        f.tally.degraded.load(Ordering::Relaxed),
        f.at_risk,
    );
    let s = status(&server).await;
    let nodes = s["store"]["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 1);
    assert_eq!(nodes[0]["address"], format!("127.0.0.1:{replica}"), "{s}");
    assert_eq!(redis_cli(replica, &["ROLE"]).lines().next(), Some("master"));
    let m = metrics(&server).await;
    assert_eq!(sample(&m, "tollgate_store_failovers_total"), 1, "{m}");
    assert!(overshoot >= LOST_ANSWERS, "{overshoot}");
    assert!(
        overshoot <= f.at_risk as i64,
        "overshoot {overshoot} of {admitted} admissions, above the {} of the replication gap",
        f.at_risk
    );
    server.stop().await;
}

/// Slots moved by `redis-cli --cluster reshard` while four tenants (each
/// decision touching a per-key bucket and the tenant's ceiling) are under
/// load: no error, no decision lost or doubled (each ceiling's admissions
/// plus what it has left is its burst, exactly), and the redirects were
/// followed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reshard_under_load_loses_nothing() {
    let cluster = RedisCluster::start_with(0, &["--cluster-node-timeout", "2000"]);
    let ranges = cluster.slot_ranges();
    let (source, source_ranges) = ranges.iter().min_by_key(|(_, r)| r[0].0).unwrap();
    let (target, _) = ranges.iter().find(|(i, _)| i != source).unwrap();
    let first = source_ranges[0].0;
    const MOVED: u16 = 300;
    let tenants: Vec<String> = (0..200_000)
        .map(|i| format!("r{i}"))
        .filter(|t| (first..first + MOVED).contains(&cluster.slot_of(t)))
        .take(4)
        .collect();
    assert_eq!(tenants.len(), 4);
    let rules: Vec<LimitRow> = tenants
        .iter()
        .flat_map(|t| [rule(t, "key", "deny"), rule(t, "tenant", "deny")])
        .collect();
    // A long timeout: a call that missed it under a stall could still have
    // spent in Redis, and the count of admissions would be short by it.
    let server = serve(rules, cluster.url(), Duration::from_secs(1)).await;
    let loads = Loads::start(&server, &tenants, 2, 20);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (from, to) = (cluster.id(*source), cluster.id(*target));
    let entry = format!("127.0.0.1:{}", cluster.nodes[*source].port);
    let moved = tokio::task::spawn_blocking(move || {
        std::process::Command::new("redis-cli")
            .args(["--cluster", "reshard", &entry])
            .args(["--cluster-from", &from, "--cluster-to", &to])
            .args(["--cluster-slots", &MOVED.to_string(), "--cluster-yes"])
            .args(["--cluster-pipeline", "1"])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        moved.status.success(),
        "{}",
        String::from_utf8_lossy(&moved.stdout)
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let tallies = loads.finish().await;
    for tenant in &tenants {
        assert_eq!(
            cluster.owner(cluster.slot_of(tenant)),
            Some(*target),
            "{tenant}'s slot moved"
        );
    }
    let mut client = server.client().await;
    for (tenant, tally) in tenants.iter().zip(&tallies) {
        // The ceiling's tokens left, by Redis: admitted + left = burst. It
        // is the tightest bucket (every admission spent from it), and a
        // dry run reports what would be left after it.
        let r = ask(&mut client, tenant, "key-0", true).await;
        assert_eq!(r.degraded(), Degraded::None);
        assert_eq!(r.limit_name, format!("{tenant}-tenant"));
        let ceiling = r.remaining as i64 + 1;
        let admitted = tally.admitted.load(Ordering::Relaxed) as i64;
        let decided = tally.decided.load(Ordering::Relaxed);
        eprintln!(
            "{tenant}: {decided} decisions, {} by policy, {admitted} admitted, {ceiling} left",
            tally.degraded.load(Ordering::Relaxed)
        );
        assert_eq!(
            admitted + ceiling,
            PLENTY,
            "{tenant}: no admission lost or doubled"
        );
    }
    let m = metrics(&server).await;
    let redirects = sample(&m, "tollgate_store_redirects_total{kind=\"moved\"}")
        + sample(&m, "tollgate_store_redirects_total{kind=\"ask\"}");
    eprintln!(
        "redirects: moved {}, ask {}, tryagain {}",
        sample(&m, "tollgate_store_redirects_total{kind=\"moved\"}"),
        sample(&m, "tollgate_store_redirects_total{kind=\"ask\"}"),
        sample(&m, "tollgate_store_redirects_total{kind=\"tryagain\"}"),
    );
    assert!(redirects > 0, "the moves were seen under traffic: {m}");
    server.stop().await;
}

/// A `redis-server --sentinel` on a free port, watching `mymaster`.
struct Sentinel {
    port: u16,
    child: std::process::Child,
    _dir: tempfile::TempDir,
}

impl Sentinel {
    fn start(primary: u16) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let port = common::redis::free_port(false);
        let conf = dir.path().join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\nprotected-mode no\n\
                 sentinel monitor mymaster 127.0.0.1 {primary} 2\n\
                 sentinel down-after-milliseconds mymaster 500\n\
                 sentinel failover-timeout mymaster 5000\n\
                 sentinel parallel-syncs mymaster 1\n"
            ),
        )
        .unwrap();
        let child = std::process::Command::new("redis-server")
            .arg(&conf)
            .arg("--sentinel")
            .current_dir(dir.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("redis-server runs in Sentinel mode");
        let mut answered = false;
        for _ in 0..500 {
            if redis_cli(port, &["PING"]) == "PONG" {
                answered = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            answered,
            "the Sentinel on port {port} answers PING within 5 s"
        );
        Self {
            port,
            child,
            _dir: dir,
        }
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
