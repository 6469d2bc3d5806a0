//! Concurrency caps through the native API, end to end: Acquire, Release,
//! Renew and Hold over real gRPC clients, against an in-process server (a
//! manual clock, so every figure is exact) and against three `tollgate
//! serve` processes sharing one Redis or a 3-node Redis Cluster.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::process::{ServeProcess, tollgate};
use common::redis::{RedisCluster, RedisServer, redis_cli};
use common::{TestServer, micros, row};
use tollgate::limits::LimitRow;
use tollgate::proto::v1::rate_limiter_client::RateLimiterClient;
use tollgate::proto::v1::{
    AcquireRequest, AcquireResponse, LeaseStatus, ReleaseRequest, RenewRequest,
};
use tonic::Code;
use tonic::transport::Channel;

fn cap(name: &str, tenant: &str, resource: &str, scope: &str, n: i64) -> LimitRow {
    LimitRow::from_request(
        tenant.into(),
        resource.into(),
        scope,
        n,
        "",
        "enforce",
        "allow",
        0,
        "concurrency",
        Some(name.into()),
    )
    .unwrap()
}

fn secs(s: i64) -> Option<prost_types::Duration> {
    Some(prost_types::Duration {
        seconds: s,
        nanos: 0,
    })
}

fn acquire_req(tenant: &str, key: &str, resource: &str, ttl: i64, cost: u64) -> AcquireRequest {
    AcquireRequest {
        key: key.into(),
        tenant: tenant.into(),
        resource: resource.into(),
        ttl: secs(ttl),
        cost,
    }
}

async fn acquire(client: &mut RateLimiterClient<Channel>, req: AcquireRequest) -> AcquireResponse {
    client.acquire(req).await.unwrap().into_inner()
}

async fn release(client: &mut RateLimiterClient<Channel>, lease: &str) -> LeaseStatus {
    let r = client
        .release(ReleaseRequest {
            lease: lease.into(),
        })
        .await
        .unwrap()
        .into_inner();
    LeaseStatus::try_from(r.status).unwrap()
}

#[tokio::test]
async fn acquire_release_and_renew_over_grpc() {
    let server = TestServer::with_rows(&[
        cap("exports-slots", "acme", "exports", "tenant", 2),
        row("exports-rate", "acme", "exports", "key", 1, "1/hour"),
    ])
    .await;
    let mut client = server.client().await;

    // Two slots; cost 0 leaves the rate rule alone.
    let a = acquire(&mut client, acquire_req("acme", "alice", "exports", 30, 0)).await;
    assert!(a.granted);
    assert!(a.lease.starts_with("l1."), "{}", a.lease);
    assert_eq!((a.in_flight, a.limit), (1, 2));
    assert_eq!(micros(&a.ttl), 30_000_000);
    let d = a.decision.unwrap();
    assert_eq!(d.limit_name, "exports-slots");
    assert_eq!(
        (d.remaining, d.limit, d.rate.as_str()),
        (1, 2, "2 concurrent")
    );

    server.clock.advance(Duration::from_secs(5));
    let b = acquire(&mut client, acquire_req("acme", "bob", "exports", 60, 0)).await;
    assert!(b.granted);
    assert_eq!(b.in_flight, 2);

    // Full: refused until a's lease expires (25 s left), at the latest.
    let refused = acquire(&mut client, acquire_req("acme", "carol", "exports", 30, 0)).await;
    assert!(!refused.granted);
    assert_eq!(refused.lease, "");
    assert_eq!((refused.in_flight, refused.limit), (2, 2));
    let d = refused.decision.unwrap();
    assert_eq!(micros(&d.retry_after), 25_000_000);
    assert_eq!(micros(&d.reset_after), 60_000_000);
    assert_eq!(d.headers.get("Retry-After").map(String::as_str), Some("25"));

    // Release is idempotent; the slot is free at once.
    assert_eq!(release(&mut client, &a.lease).await, LeaseStatus::Done);
    assert_eq!(
        release(&mut client, &a.lease).await,
        LeaseStatus::AlreadyReleased
    );
    let c = acquire(&mut client, acquire_req("acme", "carol", "exports", 30, 0)).await;
    assert!(c.granted);

    // Renew: b now holds 120 s from now.
    let r = client
        .renew(RenewRequest {
            lease: b.lease.clone(),
            ttl: secs(120),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(micros(&r.ttl), 120_000_000);
    server.clock.advance(Duration::from_secs(61));
    // c expired at its ttl; b did not: one slot free.
    let d = acquire(&mut client, acquire_req("acme", "dave", "exports", 30, 0)).await;
    assert!(d.granted);
    assert_eq!(d.in_flight, 2);
    assert_eq!(release(&mut client, &c.lease).await, LeaseStatus::Expired);

    // Renewing what is gone says so, and how to fix it.
    let err = client
        .renew(RenewRequest {
            lease: a.lease.clone(),
            ttl: secs(10),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(
        err.message().contains("it was released"),
        "{}",
        err.message()
    );
    let unknown = tollgate_core::store::LeaseId::new("acme").to_string();
    let err = client
        .renew(RenewRequest {
            lease: unknown.clone(),
            ttl: secs(10),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    assert_eq!(release(&mut client, &unknown).await, LeaseStatus::Unknown);
    for bad in ["", "r1.000000000000000000000000000000ff.6162", "l1.zz"] {
        let err = client
            .release(ReleaseRequest { lease: bad.into() })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{bad:?}");
        assert!(err.message().contains("l1."), "{}", err.message());
    }
    for ttl in [0, 7200, -1] {
        let err = client
            .acquire(acquire_req("acme", "erin", "exports", ttl, 0))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "ttl {ttl}");
        assert!(err.message().contains("renew it"), "{}", err.message());
    }
    let err = client
        .renew(RenewRequest {
            lease: d.lease.clone(),
            ttl: secs(7200),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("one hour"), "{}", err.message());
    let err = client
        .acquire(acquire_req("acme", "", "exports", 10, 0))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);

    // A token and a slot together, all or nothing: the rate rule (burst 1)
    // admits one; the second acquire is refused by it and takes no slot.
    assert_eq!(release(&mut client, &d.lease).await, LeaseStatus::Done);
    let e = acquire(&mut client, acquire_req("acme", "erin", "exports", 30, 1)).await;
    assert!(e.granted);
    assert_eq!(e.in_flight, 2);
    assert_eq!(release(&mut client, &e.lease).await, LeaseStatus::Done);
    let f = acquire(&mut client, acquire_req("acme", "erin", "exports", 30, 1)).await;
    assert!(!f.granted);
    assert_eq!(f.decision.unwrap().limit_name, "exports-rate");
    assert_eq!(f.in_flight, 1, "b alone: the refused acquire took no slot");

    // Metrics: per rule, and per operation and status.
    let (_, metrics) = server.http_get("/metrics").await.unwrap();
    for line in [
        "tollgate_leases_acquired_total{rule=\"exports-slots\"} 5",
        "tollgate_leases_refused_total{rule=\"exports-slots\"} 1",
        "tollgate_lease_operations_total{op=\"release\",status=\"released\"} 3",
        "tollgate_lease_operations_total{op=\"release\",status=\"already_released\"} 1",
        "tollgate_lease_operations_total{op=\"release\",status=\"expired\"} 1",
        "tollgate_lease_operations_total{op=\"release\",status=\"unknown\"} 1",
        "tollgate_lease_operations_total{op=\"renew\",status=\"renewed\"} 1",
        "tollgate_lease_operations_total{op=\"renew\",status=\"unknown\"} 1",
        "tollgate_lease_operations_total{op=\"renew\",status=\"already_released\"} 1",
        // Three tokens that are no lease's, and a renew for two hours.
        "tollgate_lease_operations_total{op=\"release\",status=\"invalid\"} 3",
        "tollgate_lease_operations_total{op=\"renew\",status=\"invalid\"} 1",
        "tollgate_leases_held{rule=\"exports-slots\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} missing from\n{metrics}");
    }
    common::assert_promtool_accepts(&metrics);
    // Who holds the most slots, on the admin port.
    let (status, top) = server.http_get("/v1/top-limited").await.unwrap();
    assert_eq!(status, 200);
    let top: serde_json::Value = serde_json::from_str(&top).unwrap();
    assert_eq!(top["holding"][0]["tenant"], "acme");
    assert_eq!(top["holding"][0]["held"], 1);
}

#[tokio::test]
async fn shadow_caps_report_and_never_refuse() {
    let mut shadow = cap("slots-shadow", "acme", "", "key", 1);
    shadow.mode = tollgate::limits::Mode::Shadow;
    let server = TestServer::with_rows(&[shadow]).await;
    let mut client = server.client().await;
    let first = acquire(&mut client, acquire_req("acme", "k", "", 30, 0)).await;
    assert!(first.granted && !first.decision.unwrap().shadow);
    let second = acquire(&mut client, acquire_req("acme", "k", "", 30, 0)).await;
    assert!(second.granted, "a shadow cap never refuses");
    assert!(second.decision.unwrap().shadow, "but says it would have");
}

/// Opens `Hold` on a connection of its own: the request side, the
/// answers, and the first answer.
async fn hold(
    server: &TestServer,
    key: &str,
) -> (
    tokio::sync::mpsc::Sender<AcquireRequest>,
    tonic::Streaming<tollgate::proto::v1::HoldResponse>,
    AcquireResponse,
) {
    let channel = Channel::from_shared(server.url())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut holder = RateLimiterClient::new(channel);
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(acquire_req("acme", key, "", 30, 0)).await.unwrap();
    let mut answers = holder
        .hold(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let first = answers.message().await.unwrap().unwrap().acquired.unwrap();
    (tx, answers, first)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_stream_frees_its_slot_when_the_caller_goes_away() {
    let server = TestServer::with_rows(&[cap("one-at-a-time", "acme", "", "tenant", 1)]).await;
    let mut client = server.client().await;

    let (tx, mut answers, first) = hold(&server, "job-1").await;
    assert!(first.granted);
    let refused = acquire(&mut client, acquire_req("acme", "job-2", "", 30, 0)).await;
    assert!(!refused.granted, "the stream holds the only slot");

    // The caller ends its side: released at once, and told so. (The manual
    // clock never moves: only a release can free the slot.)
    drop(tx);
    let last = answers.message().await.unwrap().unwrap();
    assert_eq!(last.released, LeaseStatus::Done as i32);
    assert!(answers.message().await.unwrap().is_none());
    let job2 = acquire(&mut client, acquire_req("acme", "job-2", "", 30, 0)).await;
    assert!(job2.granted);
    assert_eq!(release(&mut client, &job2.lease).await, LeaseStatus::Done);

    // A client that dies while holding a stream (its runtime, and so its
    // connection, gone without ending the stream) frees its slot too.
    let url = server.url();
    let (granted_tx, granted_rx) = std::sync::mpsc::channel();
    let (die_tx, die_rx) = std::sync::mpsc::channel::<()>();
    let client_thread = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let mut holder = RateLimiterClient::connect(url).await.unwrap();
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            tx.send(acquire_req("acme", "job-3", "", 30, 0))
                .await
                .unwrap();
            let mut answers = holder
                .hold(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
                .unwrap()
                .into_inner();
            let first = answers.message().await.unwrap().unwrap();
            granted_tx.send(first.acquired.unwrap().granted).unwrap();
            // Hold until told to die, the stream still open.
            tokio::task::spawn_blocking(move || die_rx.recv())
                .await
                .unwrap()
                .unwrap();
            std::mem::forget((tx, answers, holder));
        });
        // Dropping the runtime closes every socket it owned.
        drop(runtime);
    });
    let granted = tokio::task::spawn_blocking(move || granted_rx.recv().unwrap());
    assert!(granted.await.unwrap());
    assert!(
        !acquire(&mut client, acquire_req("acme", "job-4", "", 30, 0))
            .await
            .granted
    );
    die_tx.send(()).unwrap();
    tokio::task::spawn_blocking(move || client_thread.join().unwrap())
        .await
        .unwrap();
    let mut freed = false;
    for _ in 0..100 {
        let probe = acquire(&mut client, acquire_req("acme", "job-4", "", 30, 0)).await;
        if probe.granted {
            freed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(freed, "the dead client's lease was released");

    // A held lease's ttl is its backstop: under a second is refused.
    let mut holder = server.client().await;
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let mut short = acquire_req("acme", "job-5", "", 0, 0);
    short.ttl = Some(prost_types::Duration {
        seconds: 0,
        nanos: 500_000_000,
    });
    tx.send(short).await.unwrap();
    let err = holder
        .hold(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("at least 1 s"), "{}", err.message());
    let (_, metrics) = server.http_get("/metrics").await.unwrap();
    assert!(
        metrics.contains("tollgate_leases_held{rule=\"one-at-a-time\"} 1"),
        "only job-4 is held:\n{metrics}"
    );
}

/// Three `tollgate serve` processes on `store`, each with the same rows.
fn fleet(store: &str, rows: &[&[&str]]) -> (Vec<ServeProcess>, Vec<tempfile::TempDir>) {
    let mut instances = Vec::new();
    let mut dirs = Vec::new();
    for _ in 0..3 {
        let dir = tempfile::tempdir().unwrap();
        for args in rows {
            let mut all = vec!["limits", "set", "--create"];
            all.extend_from_slice(args);
            let out = tollgate(dir.path(), &all);
            assert!(out.status.success(), "{out:?}");
        }
        instances.push(ServeProcess::start(
            dir.path(),
            &["--store", store, "--store-timeout", "2s"],
        ));
        dirs.push(dir);
    }
    (instances, dirs)
}

/// 500 acquirers spread over three instances, each holding its lease for
/// a random 1-8 ms: the test's own record of grant and release times never
/// shows more than `CAP` held at once, no acquirer is refused while a slot
/// is free, and every acquirer is served.
async fn five_hundred_acquirers(store: &str) {
    const CAP: usize = 8;
    let (instances, _dirs) = fleet(
        store,
        &[&[
            "--tenant",
            "race",
            "--scope",
            "tenant",
            "--concurrency",
            "8",
        ]],
    );
    let mut channels = Vec::new();
    for p in &instances {
        p.wait_ready();
        channels.push(
            Channel::from_shared(format!("http://{}", p.grpc))
                .unwrap()
                .connect()
                .await
                .unwrap(),
        );
    }
    let start = tokio::time::Instant::now();
    // Per grant: (acquire sent, grant answered, release sent, release
    // answered). Per refusal: (sent, answered).
    let intervals = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let refusals = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..500usize {
        let mut client = RateLimiterClient::new(channels[i % 3].clone());
        let (intervals, refusals) = (intervals.clone(), refusals.clone());
        tasks.push(tokio::spawn(async move {
            // Bounded: at most 20 000 attempts.
            for attempt in 0..20_000u64 {
                let sent = start.elapsed();
                let a = acquire(
                    &mut client,
                    acquire_req("race", &format!("w{i}"), "", 10, 0),
                )
                .await;
                let answered = start.elapsed();
                if a.granted {
                    let hold = 1 + (i as u64 * 7 + attempt) % 8;
                    tokio::time::sleep(Duration::from_millis(hold)).await;
                    let released = start.elapsed();
                    assert_eq!(release(&mut client, &a.lease).await, LeaseStatus::Done);
                    let done = start.elapsed();
                    intervals.lock().push((sent, answered, released, done));
                    return true;
                }
                refusals.lock().push((sent, answered));
                let wait = micros(&a.decision.unwrap().retry_after).min(3_000);
                tokio::time::sleep(Duration::from_micros(wait + (i as u64 % 5) * 200)).await;
            }
            false
        }));
    }
    let mut served = 0;
    for t in tasks {
        served += usize::from(t.await.unwrap());
    }
    assert_eq!(served, 500, "every acquirer is eventually served");
    // The most held at once, by the test's own bookkeeping: a grant counts
    // from its answer's arrival to the release's sending, inside the time
    // the store held it.
    let mut events: Vec<(Duration, i32)> = intervals
        .lock()
        .iter()
        .flat_map(|(_, g, r, _)| [(*g, 1), (*r, -1)])
        .collect();
    events.sort_by_key(|(at, delta)| (*at, *delta));
    let (mut now, mut most) = (0i32, 0i32);
    for (_, delta) in events {
        now += delta;
        most = most.max(now);
    }
    assert!(
        most as usize <= CAP,
        "{most} held at once, above the cap of {CAP}"
    );
    // A refusal means the store counted `CAP` leases when it decided,
    // some moment inside the refusal's (sent, answered). Each of those
    // leases was acquired before that moment and released after it, so
    // at least `CAP` grants' (acquire sent, release answered) overlap the
    // refusal's. A limiter refusing below the cap (say at 2 held) leaves
    // refusals that overlap fewer grants.
    let refusals = refusals.lock();
    assert!(!refusals.is_empty(), "the cap was contended");
    let intervals = intervals.lock();
    for (sent, answered) in refusals.iter() {
        let overlapping = intervals
            .iter()
            .filter(|(acquired, _, _, done)| acquired < answered && done > sent)
            .count();
        assert!(
            overlapping >= CAP,
            "refused in {sent:?}..{answered:?} while only {overlapping} leases could be held"
        );
    }
    println!("500 acquirers: at most {most} held at once (cap {CAP})");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_acquirers_over_three_instances_on_redis() {
    let redis = RedisServer::start();
    five_hundred_acquirers(&redis.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_acquirers_over_three_instances_on_a_cluster() {
    let cluster = RedisCluster::start();
    five_hundred_acquirers(&cluster.url()).await;
}

/// Leases held by an instance that is killed (and so by callers that never
/// release them) are freed at their time to live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_holders_free_their_slots() {
    let redis = RedisServer::start();
    let port: u16 = redis.url().rsplit(':').next().unwrap().parse().unwrap();
    let (mut instances, _dirs) = fleet(
        &redis.url(),
        &[&[
            "--tenant",
            "jobs",
            "--scope",
            "tenant",
            "--concurrency",
            "2",
        ]],
    );
    for p in &instances {
        p.wait_ready();
    }
    let client_of = |p: &ServeProcess| {
        let url = format!("http://{}", p.grpc);
        async move { RateLimiterClient::connect(url).await.unwrap() }
    };
    let slots_key = "tollgate:{jobs}:tc::";
    // Two plain leases of 2 s through the first instance; then the instance
    // is killed (SIGKILL: nothing is released).
    let mut first = client_of(&instances[0]).await;
    for job in ["a", "b"] {
        assert!(
            acquire(&mut first, acquire_req("jobs", job, "", 2, 0))
                .await
                .granted
        );
    }
    let killed_at = tokio::time::Instant::now();
    let mut victim = instances.remove(0);
    victim.child.kill().unwrap();
    victim.child.wait().unwrap();
    assert_eq!(redis_cli(port, &["ZCARD", slots_key]), "2");
    let mut second = client_of(&instances[0]).await;
    let refused = acquire(&mut second, acquire_req("jobs", "c", "", 2, 0)).await;
    assert!(!refused.granted);
    let wait = micros(&refused.decision.unwrap().retry_after);
    assert!(wait <= 2_000_000, "retry_after {wait} µs is within the ttl");
    tokio::time::sleep(Duration::from_micros(wait)).await;
    let c = acquire(&mut second, acquire_req("jobs", "c", "", 60, 0)).await;
    assert!(
        c.granted,
        "freed at the ttl, {:?} after the kill",
        killed_at.elapsed()
    );

    // A caller that takes a plain lease and goes away without releasing it
    // (its client dropped): the slot frees at the ttl, not before. (A ttl
    // of 5 s: a loaded machine can stall a second between two calls.)
    {
        let mut gone = client_of(&instances[1]).await;
        // c took the slot of the first of a and b to expire; the other
        // may still hold one for the few milliseconds between their
        // acquires: then e waits for it, which its retry-after says.
        let mut e = acquire(&mut gone, acquire_req("jobs", "e", "", 5, 0)).await;
        if !e.granted {
            let wait = micros(&e.decision.unwrap().retry_after);
            assert!(wait <= 2_000_000, "retry_after {wait} µs: b's ttl at most");
            tokio::time::sleep(Duration::from_micros(wait)).await;
            e = acquire(&mut gone, acquire_req("jobs", "e", "", 5, 0)).await;
        }
        assert!(e.granted, "a and b have expired");
    }
    let refused = acquire(&mut second, acquire_req("jobs", "f", "", 60, 0)).await;
    assert!(!refused.granted, "c and e hold both slots");
    let wait = micros(&refused.decision.unwrap().retry_after);
    assert!(
        (1..=5_000_000).contains(&wait),
        "retry_after {wait} µs: e's ttl"
    );
    tokio::time::sleep(Duration::from_micros(wait)).await;
    assert!(
        acquire(&mut second, acquire_req("jobs", "f", "", 60, 0))
            .await
            .granted
    );
}

fn sample(metrics: &str, series: &str) -> u64 {
    common::envoy::sample(metrics, series).unwrap_or(0)
}

/// Waits (bounded) until `series` on `server` reads `want`; returns what it
/// read last.
async fn wait_sample(server: &TestServer, series: &str, want: u64) -> u64 {
    let mut last = 0;
    for _ in 0..300 {
        let (_, metrics) = server.http_get("/metrics").await.unwrap();
        last = sample(&metrics, series);
        if last == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    last
}

/// In memory: a lease left to expire is counted once, and leaves this
/// instance's held gauge; a released one is not counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_leases_are_counted_in_memory() {
    let server = TestServer::launch(Some(&[cap("slots", "acme", "", "tenant", 5)]), |c| {
        c.sweep_interval = Duration::from_millis(20)
    })
    .await;
    let mut client = server.client().await;
    let kept = acquire(&mut client, acquire_req("acme", "a", "", 1, 0)).await;
    let freed = acquire(&mut client, acquire_req("acme", "b", "", 1, 0)).await;
    assert!(kept.granted && freed.granted);
    assert_eq!(release(&mut client, &freed.lease).await, LeaseStatus::Done);
    assert_eq!(
        wait_sample(&server, "tollgate_leases_held{rule=\"slots\"}", 1).await,
        1
    );
    server.clock.advance(Duration::from_secs(1));
    assert_eq!(
        wait_sample(&server, "tollgate_leases_expired_total", 1).await,
        1
    );
    assert_eq!(
        wait_sample(&server, "tollgate_leases_held{rule=\"slots\"}", 0).await,
        0
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (_, metrics) = server.http_get("/metrics").await.unwrap();
    assert_eq!(sample(&metrics, "tollgate_leases_expired_total"), 1);
}

/// On Redis: the instance that granted a lease counts it when it expires
/// unreleased; one released or renewed through another instance is not
/// counted (a renewed one is checked again at its new expiry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_leases_are_counted_once_on_redis() {
    let redis = RedisServer::start();
    let rows = [cap("slots", "acme", "", "tenant", 5)];
    let start = |url: String| {
        TestServer::launch(Some(&rows), move |c| {
            c.store = tollgate::server::StoreSpec::Redis(url);
            c.store_timeout = Duration::from_secs(2);
            c.sweep_interval = Duration::from_millis(50);
        })
    };
    let a = start(redis.url()).await;
    let b = start(redis.url()).await;
    let (mut ca, mut cb) = (a.client().await, b.client().await);
    // The abandoned lease lives 200 ms; the two that another instance
    // releases and renews live 2 s, so that those calls land in time on a
    // machine that stalls for a second.
    let abandoned = AcquireRequest {
        ttl: Some(prost_types::Duration {
            seconds: 0,
            nanos: 200_000_000,
        }),
        ..acquire_req("acme", "abandoned", "", 1, 0)
    };
    let granted_at = tokio::time::Instant::now();
    let abandoned = acquire(&mut ca, abandoned).await;
    let released = acquire(&mut ca, acquire_req("acme", "released", "", 2, 0)).await;
    let renewed = acquire(&mut ca, acquire_req("acme", "renewed", "", 2, 0)).await;
    assert!(abandoned.granted && released.granted && renewed.granted);
    assert_eq!(release(&mut cb, &released.lease).await, LeaseStatus::Done);
    let renewal = cb
        .renew(RenewRequest {
            lease: renewed.lease.clone(),
            ttl: secs(30),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(renewal.ttl, secs(30), "renewed for 30 s");
    assert_eq!(
        wait_sample(&a, "tollgate_leases_expired_total", 1).await,
        1,
        "the abandoned lease, counted by the instance that granted it"
    );
    // Past every check of the three (each a second after its expiry, and
    // a sweep every 50 ms). The two servers of this process share one
    // metrics registry: one count in all.
    tokio::time::sleep_until(granted_at + Duration::from_millis(3_300)).await;
    let (_, metrics) = a.http_get("/metrics").await.unwrap();
    assert_eq!(sample(&metrics, "tollgate_leases_expired_total"), 1);
    assert_eq!(release(&mut cb, &renewed.lease).await, LeaseStatus::Done);
}

/// A graceful shutdown releases the leases its streams hold (and tells
/// their callers) rather than leaving them to their ttl, and does not wait
/// for the callers to hang up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_releases_held_streams() {
    let server = TestServer::with_rows(&[cap("slots", "acme", "", "tenant", 2)]).await;
    let (_tx, mut answers, first) = hold(&server, "job-1").await;
    assert!(first.granted);
    let stopping = tokio::spawn(server.stop());
    let last = answers.message().await.unwrap().unwrap();
    assert_eq!(last.released, LeaseStatus::Done as i32);
    assert!(answers.message().await.unwrap().is_none());
    stopping.await.unwrap();
}
