//! Envoy's Rate Limit Quota Service through real Envoy 1.40 processes with
//! `deploy/envoy/rlqs/envoy.yaml`: each Envoy enforces its assignment
//! locally and reports usage; Tollgate settles the reports and divides each
//! tenant's limit among the Envoys by demand.

use crate::common;

use std::time::Duration;

use common::TestServer;
use common::envoy_proxy::{Envoy, KeepAlive, get};
use common::redis::RedisServer;
use tollgate::server::StoreSpec;

/// A plain upstream answering 200.
async fn upstream() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let app = axum::Router::new().fallback(|| async { "ok" });
    tokio::spawn(async move { axum::serve(listener, app).await });
    port
}

/// An Envoy running the documented configuration in front of `upstream`,
/// reporting to every one of `servers`, named apart from every other.
async fn envoy(servers: &[&TestServer], upstream: u16) -> Envoy {
    let ports: Vec<u16> = servers.iter().map(|s| s.grpc.port()).collect();
    envoy_to(&ports, upstream).await
}

/// As [`envoy`], reporting to the Tollgate gRPC ports `ports`.
async fn envoy_to(ports: &[u16], upstream: u16) -> Envoy {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    let name = format!(
        "edge-{}",
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let file = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/envoy/rlqs/envoy.yaml");
    let template = std::fs::read_to_string(file).unwrap();
    let one = "\n              - endpoint:\n                  address:\n                    \
               socket_address: { address: 127.0.0.1, port_value: 50051 }";
    assert!(template.contains(one), "the Tollgate endpoint moved");
    let endpoints: String = ports
        .iter()
        .map(|p| one.replace("50051", &p.to_string()))
        .collect();
    Envoy::start(1, |listeners, admin| {
        template
            .replace(one, &endpoints)
            .replace(
                "port_value: 10000",
                &format!("port_value: {}", listeners[0]),
            )
            .replace("port_value: 8080", &format!("port_value: {upstream}"))
            .replace("port_value: 9901", &format!("port_value: {admin}"))
            .replace("value: edge-1", &format!("value: {name}"))
    })
    .await
}

/// Two instances on `redis` whose table holds one rule: `tenant`'s
/// tenant-wide bucket of `burst` refilling at `rate`.
async fn two_instances(
    redis: &RedisServer,
    tenant: &str,
    burst: i64,
    rate: &str,
) -> Vec<TestServer> {
    let rules = [common::row(tenant, tenant, "", "tenant", burst, rate)];
    let mut servers = Vec::new();
    for _ in 0..2 {
        let url = redis.url();
        servers.push(
            TestServer::launch(Some(&rules), move |c| {
                c.store = StoreSpec::Redis(url);
                // Every report must reach Redis: a stall of a loaded
                // machine must not leave one to a policy.
                c.store_timeout = Duration::from_secs(2);
            })
            .await,
        );
    }
    servers
}

/// The quota view of a server: `/v1/rlqs`.
async fn view(server: &TestServer) -> serde_json::Value {
    let (status, body) = server.http_get("/v1/rlqs?limit=100").await.unwrap();
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Waits until `server` has assigned `tenant`'s bucket `what`
/// (`token_bucket`, `deny_all`, ...).
async fn wait_assigned(server: &TestServer, tenant: &str, what: &str) -> serde_json::Value {
    for _ in 0..400 {
        let v = view(server).await;
        if let Some(row) = v["top"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["tenant"] == tenant && r["assignment"] == what)
        {
            return row.clone();
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("no {what} assignment for {tenant}: {}", view(server).await);
}

/// Feasibility, then exactness: a real Envoy subscribes a tenant's bucket
/// with its first request, enforces the token bucket Tollgate assigns, and
/// the tenant gets exactly its burst. The in-process store's clock is
/// frozen, so nothing refills: of 1 + 10 requests, exactly 5 pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_enforces_the_assigned_share_of_a_tenants_limit() {
    let rules = [common::row("acme", "acme", "", "tenant", 5, "1/hour")];
    let server = TestServer::with_rows(&rules).await;
    let up = upstream().await;
    let envoy = envoy(&[&server], up).await;
    let port = envoy.listeners[0];

    // The first request of a new bucket passes (no assignment yet) and
    // subscribes it.
    let first = get(port, "/", &[("x-tenant", "acme")]).await;
    assert_eq!(first.status, 200);
    let row = wait_assigned(&server, "acme", "token_bucket").await;
    // Alone, this Envoy holds the whole limit: what is left of the burst
    // after the first request, and the rule's rate (1 an hour).
    assert_eq!(row["share_ppm"], 1_000_000);
    assert_eq!(row["members"], 1);
    assert_eq!(row["max_tokens"], 4);
    assert_eq!(row["named"], true, "the Envoy names itself: {row}");
    assert!(
        (row["rate"].as_f64().unwrap() - 1.0 / 3600.0).abs() < 1e-9,
        "{row}"
    );

    let mut client = KeepAlive::new(port);
    let mut statuses = Vec::new();
    for _ in 0..10 {
        statuses.push(client.get("/", &[("x-tenant", "acme")]).await);
    }
    assert_eq!(statuses, [200, 200, 200, 200, 429, 429, 429, 429, 429, 429]);
    // A request without the header matches no bucket: not limited.
    assert_eq!(get(port, "/", &[]).await.status, 200);

    // The reports settle in the store: the tenant's bucket is spent, so a
    // native decision on it is refused too, and the refusals are counted.
    let mut client = server.client().await;
    for _ in 0..200 {
        let metrics = server.http_get("/metrics").await.unwrap().1;
        let rejected = common::envoy::sample(
            &metrics,
            "tollgate_decisions_total{api=\"rlqs\",outcome=\"rejected\",rule=\"acme\"}",
        );
        if rejected == Some(6) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let metrics = server.http_get("/metrics").await.unwrap().1;
    for (outcome, n) in [("allowed", 5), ("rejected", 6)] {
        let series =
            format!("tollgate_decisions_total{{api=\"rlqs\",outcome=\"{outcome}\",rule=\"acme\"}}");
        assert_eq!(
            common::envoy::sample(&metrics, &series),
            Some(n),
            "{series}"
        );
    }
    assert_eq!(
        common::envoy::sample(&metrics, "tollgate_rlqs_streams"),
        Some(1)
    );
    assert_eq!(
        common::envoy::sample(&metrics, "tollgate_rlqs_buckets"),
        Some(1)
    );
    let native = common::ask(&mut client, common::req("acme", "anyone")).await;
    assert!(!native.allowed, "the Envoy spent the tenant's burst");
    // The refusals show in the top-limited view.
    let (_, top) = server.http_get("/v1/top-limited").await.unwrap();
    assert!(top.contains("\"acme\""), "{top}");
    drop(envoy);
}

/// What a load saw: requests admitted and refused.
#[derive(Default)]
struct Seen {
    admitted: std::sync::atomic::AtomicU64,
    refused: std::sync::atomic::AtomicU64,
}

impl Seen {
    fn admitted(&self) -> u64 {
        self.admitted.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Requests sent and answered, admitted or not: the demand offered.
    fn sent(&self) -> u64 {
        self.admitted() + self.refused.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Offers `rate` requests per second of `tenant` to the Envoy on `port`
/// from `tasks` keep-alive connections until `stop` turns true (at most two
/// minutes), counting what it sees.
fn load(
    port: u16,
    tenant: &'static str,
    rate: u32,
    tasks: u32,
    stop: &tokio::sync::watch::Receiver<bool>,
) -> (std::sync::Arc<Seen>, Vec<tokio::task::JoinHandle<()>>) {
    use std::sync::atomic::Ordering;
    let seen = std::sync::Arc::new(Seen::default());
    let handles = (0..tasks)
        .map(|_| {
            let (seen, mut stop) = (seen.clone(), stop.clone());
            tokio::spawn(async move {
                let mut client = KeepAlive::new(port);
                let period = Duration::from_secs_f64(f64::from(tasks) / f64::from(rate));
                let mut tick = tokio::time::interval(period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                for _ in 0..(120 * rate / tasks) {
                    tokio::select! {
                        _ = stop.wait_for(|s| *s) => break,
                        _ = tick.tick() => {}
                    }
                    let counter = match client.get("/", &[("x-tenant", tenant)]).await {
                        200 => &seen.admitted,
                        429 => &seen.refused,
                        other => panic!("unexpected status {other}"),
                    };
                    counter.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    (seen, handles)
}

/// Stops a load after 8 more seconds and checks that all it admitted since
/// `started` is R·t + B (within [0.85, 1.1]) for rate `r` and burst `b`.
async fn admitted_within_the_limit(
    stop: tokio::sync::watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    seen: &Seen,
    started: tokio::time::Instant,
    (r, b): (f64, f64),
) {
    tokio::time::sleep(Duration::from_secs(8)).await;
    stop.send(true).unwrap();
    for t in tasks {
        t.await.unwrap();
    }
    let elapsed = started.elapsed().as_secs_f64();
    let admitted = seen.admitted() as f64;
    let expected = r * elapsed + b;
    eprintln!("admitted {admitted} in {elapsed:.1} s (R·t + B = {expected:.0})");
    assert!(
        admitted >= 0.85 * expected && admitted <= 1.1 * expected,
        "admitted {admitted}, not near {expected:.0}"
    );
}

/// The shares of `tenant`'s buckets `server` shows, in parts per million.
async fn shares_of(server: &TestServer, tenant: &str) -> Vec<u64> {
    view(server).await["top"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["tenant"] == tenant)
        .map(|r| r["share_ppm"].as_u64().unwrap())
        .collect()
}

/// Three Envoys, two Tollgate instances on one Redis (two Envoys on one
/// instance, one on the other), one tenant limited to R = 20 a second with
/// a burst of B = 20, offered load 1 : 2 : 4 (30, 60 and 120 a second) for
/// 30 s: the three together admit R·30 + B within [0.9, 1.05]; then the
/// busiest stops, and the others' shares grow to nearly all of the limit
/// within two reporting intervals (Envoy 1.40 reports every 5 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_envoys_through_two_instances_divide_one_limit_by_demand() {
    const R: u64 = 20;
    const B: u64 = 20;
    const SECONDS: u64 = 30;
    let redis = RedisServer::start();
    let servers = two_instances(&redis, "acme", B as i64, "20/second").await;
    let up = upstream().await;
    let envoys = [
        envoy(&[&servers[0]], up).await,
        envoy(&[&servers[0]], up).await,
        envoy(&[&servers[1]], up).await,
    ];

    let (stop, stopped) = tokio::sync::watch::channel(false);
    let (stop_busiest, busiest_stopped) = tokio::sync::watch::channel(false);
    let started = tokio::time::Instant::now();
    let (small, mut tasks) = load(envoys[0].listeners[0], "acme", 30, 2, &stopped);
    let (medium, more) = load(envoys[1].listeners[0], "acme", 60, 2, &stopped);
    tasks.extend(more);
    let (busiest, busy_tasks) = load(envoys[2].listeners[0], "acme", 120, 4, &busiest_stopped);
    tokio::time::sleep(Duration::from_secs(SECONDS)).await;
    stop_busiest.send(true).unwrap();
    for t in busy_tasks {
        t.await.unwrap();
    }
    let elapsed = started.elapsed().as_secs_f64();
    let each = [small.admitted(), medium.admitted(), busiest.admitted()];
    let admitted: u64 = each.iter().sum();
    let expected = R as f64 * elapsed + B as f64;
    eprintln!("admitted {each:?} = {admitted} in {elapsed:.1} s; R·t + B = {expected:.0}");
    assert!(
        admitted as f64 >= 0.9 * expected && admitted as f64 <= 1.05 * expected,
        "admitted {admitted} ({each:?}), not within [0.9, 1.05] × {expected:.0}"
    );
    // Demand decides: once every Envoy has reported twice, the shares
    // are those of the demand each offered, 1 : 2 : 4 when the loads keep
    // their rates (the first to arrive held it all until then). Measured
    // from what each load sent: on a busy machine a load may fall behind
    // its rate, and then its demand, and its share, is less.
    let sent = [small.sent(), medium.sent(), busiest.sent()];
    let total: u64 = sent.iter().sum();
    let mut shares = shares_of(&servers[0], "acme").await;
    shares.sort_unstable();
    shares.extend(shares_of(&servers[1], "acme").await);
    for (share, sent_here) in shares.iter().zip(sent) {
        let expected = 1e6 * sent_here as f64 / total as f64;
        assert!(
            (*share as f64 - expected).abs() <= 0.03e6,
            "shares {shares:?} are not those of the demand sent, {sent:?}"
        );
    }

    // The busiest's load stopped: the remaining two Envoys' shares grow to
    // nearly the whole limit within two reporting intervals.
    let stopped_at = tokio::time::Instant::now();
    let mut grown = None;
    for _ in 0..400 {
        let ppm: u64 = shares_of(&servers[0], "acme").await.iter().sum();
        if ppm >= 950_000 {
            grown = Some(stopped_at.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.send(true).unwrap();
    for t in tasks {
        t.await.unwrap();
    }
    let grown = grown.expect("the remaining Envoys' shares grew to 95 % of the limit");
    eprintln!("shares grew in {grown:?}");
    // Its next report may still count some of its load; the one after
    // shows none, and the others take the freed share at their next.
    assert!(
        grown <= Duration::from_secs(3 * 5 + 1),
        "shares grew within two reporting intervals of the report showing no load \
         (took {grown:?})"
    );
    drop(envoys);
}

use tollgate::proto::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
    rate_limit_quota_response::bucket_action::BucketAction as Action,
    rate_limit_quota_service_client::RateLimitQuotaServiceClient,
    rate_limit_quota_usage_reports::BucketQuotaUsage,
};
use tollgate::proto::envoy::r#type::v3::rate_limit_strategy::Strategy;

/// A quota stream opened by a real gRPC client, as Envoy opens one.
struct QuotaStream {
    send: tokio::sync::mpsc::Sender<RateLimitQuotaUsageReports>,
    answers: tonic::Streaming<RateLimitQuotaResponse>,
}

/// A usage report of one bucket.
fn usage(entries: &[(&str, &str)], allowed: u64, denied: u64, seconds: i64) -> BucketQuotaUsage {
    BucketQuotaUsage {
        bucket_id: Some(BucketId {
            bucket: entries
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }),
        time_elapsed: Some(prost_types::Duration { seconds, nanos: 0 }),
        num_requests_allowed: allowed,
        num_requests_denied: denied,
    }
}

impl QuotaStream {
    /// Opens a stream to `server` from the loopback address `from`.
    async fn open(server: &TestServer, from: &str) -> Result<Self, tonic::Status> {
        let channel = tonic::transport::Endpoint::from_shared(server.url())
            .unwrap()
            .local_address(Some(from.parse().unwrap()))
            .connect()
            .await
            .unwrap();
        Self::open_on(channel).await
    }

    async fn open_on(channel: tonic::transport::Channel) -> Result<Self, tonic::Status> {
        Self::open_as(channel, None).await
    }

    /// Opens a stream on `channel`, naming its Envoy `name` when given.
    async fn open_as(
        channel: tonic::transport::Channel,
        name: Option<&str>,
    ) -> Result<Self, tonic::Status> {
        let (send, receive) = tokio::sync::mpsc::channel(4);
        let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(receive));
        if let Some(name) = name {
            request.metadata_mut().insert(
                tollgate::api::rlqs::ENVOY_ID_METADATA,
                name.parse().unwrap(),
            );
        }
        let answers = RateLimitQuotaServiceClient::new(channel)
            .max_encoding_message_size(64 << 20)
            .stream_rate_limit_quotas(request)
            .await?
            .into_inner();
        Ok(Self { send, answers })
    }

    /// Sends one message of reports and reads the answer.
    async fn report(
        &mut self,
        domain: &str,
        usages: Vec<BucketQuotaUsage>,
    ) -> Result<RateLimitQuotaResponse, tonic::Status> {
        self.send
            .send(RateLimitQuotaUsageReports {
                domain: domain.into(),
                bucket_quota_usages: usages,
            })
            .await
            .unwrap();
        match tokio::time::timeout(Duration::from_secs(10), self.answers.message()).await {
            Ok(Ok(Some(answer))) => Ok(answer),
            Ok(Ok(None)) => Err(tonic::Status::unknown("the stream ended")),
            Ok(Err(status)) => Err(status),
            Err(_) => Err(tonic::Status::deadline_exceeded("no answer in 10 s")),
        }
    }
}

/// The strategy assigned to the only bucket of `answer`.
fn strategy(answer: &RateLimitQuotaResponse) -> Strategy {
    let [action] = answer.bucket_action.as_slice() else {
        panic!("one action expected: {answer:?}");
    };
    match &action.bucket_action {
        Some(Action::QuotaAssignmentAction(a)) => a.rate_limit_strategy.unwrap().strategy.unwrap(),
        other => panic!("an assignment expected: {other:?}"),
    }
}

/// Hostile quota clients hurt only themselves: a stream without a domain,
/// absurd usage figures, a bucket id of a megabyte, a message of a million
/// buckets, a stream subscribing too many buckets, ten thousand streams
/// from one peer: each gets a clear error or is ignored, memory stays
/// bounded by the caps, and a well-behaved Envoy on another address is
/// answered throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_quota_clients_only_hurt_themselves() {
    let rules = [
        common::row("acme", "acme", "", "tenant", 100, "10/second"),
        common::row("other", "other", "", "tenant", 100, "10/second"),
    ];
    let server = TestServer::launch(Some(&rules), |c| {
        c.rlqs.max_buckets_per_stream = 1_000;
        c.rlqs.max_streams_per_peer = 8;
        c.rlqs.max_buckets_per_peer = 1_500;
    })
    .await;
    let acme = [("tenant", "acme")];
    // The well-behaved Envoy, from 127.0.0.2.
    let mut good = QuotaStream::open(&server, "127.0.0.2").await.unwrap();
    let answer = good
        .report("api", vec![usage(&acme, 1, 0, 0)])
        .await
        .unwrap();
    assert!(matches!(strategy(&answer), Strategy::TokenBucket(_)));

    // No domain in the first message.
    let mut s = QuotaStream::open(&server, "127.0.0.1").await.unwrap();
    let err = s.report("", vec![usage(&acme, 1, 0, 0)]).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("no domain"), "{}", err.message());

    // Absurd figures: elapsed far in the future or negative, counts of
    // 2^64 - 1. Answered; the tenant's bucket is spent (clamped), and
    // another tenant's is untouched.
    let mut s = QuotaStream::open(&server, "127.0.0.1").await.unwrap();
    for seconds in [i64::MAX, -5] {
        let answer = s
            .report(
                "api",
                vec![usage(&[("tenant", "other")], u64::MAX, u64::MAX, seconds)],
            )
            .await
            .unwrap();
        match strategy(&answer) {
            Strategy::TokenBucket(b) => assert!(b.max_tokens >= 1, "{b:?}"),
            Strategy::BlanketRule(_) => panic!("a share of a limit expected"),
            other => panic!("{other:?}"),
        }
    }
    let mut client = server.client().await;
    assert!(
        !common::ask(&mut client, common::req("other", "k"))
            .await
            .allowed
    );
    assert!(
        common::ask(&mut client, common::req("acme", "k"))
            .await
            .allowed
    );

    // A bucket id of a megabyte: ignored (no assignment), counted.
    let big = "x".repeat(1_000_000);
    let answer = s
        .report(
            "api",
            vec![
                usage(&[("tenant", "acme"), ("key", &big)], 1, 0, 5),
                usage(&acme, 1, 0, 5),
            ],
        )
        .await
        .unwrap();
    assert_eq!(
        answer.bucket_action.len(),
        1,
        "only the valid bucket is answered"
    );
    assert_eq!(
        answer.bucket_action[0].bucket_id.as_ref().unwrap().bucket["tenant"],
        "acme"
    );

    // A million buckets in one message: over the message cap.
    let million: Vec<BucketQuotaUsage> = (0..1_000_000)
        .map(|i| usage(&[("tenant", "acme"), ("key", &i.to_string())], 1, 0, 5))
        .collect();
    let err = s.report("api", million).await.unwrap_err();
    assert!(
        matches!(
            err.code(),
            tonic::Code::OutOfRange | tonic::Code::ResourceExhausted
        ),
        "{err:?}"
    );

    // More buckets than one stream may subscribe, a batch at a time.
    let mut s = QuotaStream::open(&server, "127.0.0.1").await.unwrap();
    let mut refused = None;
    for batch in 0..3 {
        let usages = (0..500)
            .map(|i| {
                usage(
                    &[("tenant", "acme"), ("key", &format!("{batch}-{i}"))],
                    0,
                    1,
                    5,
                )
            })
            .collect();
        if let Err(err) = s.report("api", usages).await {
            refused = Some((batch, err));
            break;
        }
    }
    let (batch, err) = refused.expect("the stream is refused past its bucket cap");
    assert_eq!(batch, 2, "the first 1 000 buckets are subscribed");
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert!(
        err.message().contains("--rlqs-max-buckets-per-stream"),
        "{}",
        err.message()
    );

    // More buckets than one peer may subscribe over its streams: once the
    // streams that ended have given theirs back, two streams of 800 each.
    for _ in 0..200 {
        let metrics = server.http_get("/metrics").await.unwrap().1;
        if common::envoy::sample(&metrics, "tollgate_rlqs_buckets").unwrap_or(0) <= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let batch = |name: &str| -> Vec<BucketQuotaUsage> {
        (0..800)
            .map(|i| {
                usage(
                    &[("tenant", "acme"), ("key", &format!("{name}-{i}"))],
                    0,
                    1,
                    5,
                )
            })
            .collect()
    };
    let mut first = QuotaStream::open(&server, "127.0.0.1").await.unwrap();
    first.report("api", batch("first")).await.unwrap();
    let mut second = QuotaStream::open(&server, "127.0.0.1").await.unwrap();
    let err = second.report("api", batch("second")).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert!(
        err.message().contains("--rlqs-max-buckets-per-peer"),
        "{}",
        err.message()
    );
    drop((first, second));

    // Ten thousand streams from one peer: past 8 open, each is refused at
    // once; the ones held stay answered.
    let channel = tonic::transport::Endpoint::from_shared(server.url())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut held = Vec::new();
    let mut exhausted = 0;
    for _ in 0..10_000 {
        match QuotaStream::open_on(channel.clone()).await {
            Ok(stream) => held.push(stream),
            Err(err) => {
                assert_eq!(err.code(), tonic::Code::ResourceExhausted);
                assert!(
                    err.message().contains("--rlqs-max-streams-per-peer"),
                    "{}",
                    err.message()
                );
                exhausted += 1;
            }
        }
    }
    // Streams this peer opened above and still holds count too.
    assert!(
        held.len() <= 8 && held.len() + exhausted == 10_000,
        "{} held",
        held.len()
    );
    let metrics = server.http_get("/metrics").await.unwrap().1;
    assert!(common::envoy::sample(&metrics, "tollgate_rlqs_streams").unwrap() <= 9);
    let refused_streams = common::envoy::sample(
        &metrics,
        "tollgate_rlqs_refused_total{reason=\"streams_per_peer\"}",
    );
    assert_eq!(refused_streams, Some(exhausted as u64));
    assert!(
        common::envoy::sample(
            &metrics,
            "tollgate_rlqs_refused_total{reason=\"invalid_bucket_id\"}"
        )
        .unwrap()
            >= 1
    );

    // The well-behaved Envoy is answered all along.
    let answer = good
        .report("api", vec![usage(&acme, 1, 0, 5)])
        .await
        .unwrap();
    assert!(matches!(strategy(&answer), Strategy::TokenBucket(_)));
}

/// Redis down: each rule's store-unavailable policy decides the
/// assignment: `allow` assigns ALLOW_ALL, `deny` DENY_ALL, `local` a share
/// of in-process buckets (this instance's Envoys dividing the limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_store_down_each_rules_policy_decides_the_assignment() {
    let rule = |tenant: &str, policy: &str| {
        tollgate::limits::LimitRow::from_request(
            tenant.into(),
            String::new(),
            "tenant",
            100,
            "10/second",
            "enforce",
            policy,
            0,
            "rate",
            Some(tenant.into()),
        )
        .unwrap()
    };
    let rules = [
        rule("open", "allow"),
        rule("closed", "deny"),
        rule("near", "local"),
    ];
    let mut redis = RedisServer::start();
    let url = redis.url();
    let server = TestServer::launch(Some(&rules), move |c| {
        c.store = StoreSpec::Redis(url);
        c.store_timeout = Duration::from_millis(200);
        c.local_fraction = 0.5;
    })
    .await;
    let mut s = QuotaStream::open(&server, "127.0.0.1").await.unwrap();
    let tenants = ["open", "closed", "near"];
    // Store up: every tenant gets a token bucket (its whole limit).
    for tenant in tenants {
        let answer = s
            .report("api", vec![usage(&[("tenant", tenant)], 1, 0, 0)])
            .await
            .unwrap();
        assert!(
            matches!(strategy(&answer), Strategy::TokenBucket(_)),
            "{tenant}"
        );
    }
    redis.kill();
    let mut got = Vec::new();
    for tenant in tenants {
        let answer = s
            .report("api", vec![usage(&[("tenant", tenant)], 1, 0, 5)])
            .await
            .unwrap();
        got.push(strategy(&answer));
    }
    assert_eq!(got[0], Strategy::BlanketRule(0), "allow: ALLOW_ALL");
    assert_eq!(got[1], Strategy::BlanketRule(1), "deny: DENY_ALL");
    let Strategy::TokenBucket(local) = &got[2] else {
        panic!("local: a token bucket, got {:?}", got[2]);
    };
    // This instance's fraction of the limit (--local-fraction 0.5), all of
    // it to its only Envoy: 5 a second (150 every 30 s), and what the
    // in-process bucket (burst 50) has left after this report's request.
    assert_eq!(local.tokens_per_fill, Some(150));
    assert_eq!(local.fill_interval.unwrap().seconds, 30);
    assert_eq!(local.max_tokens, 49);
    let row = wait_assigned(&server, "near", "token_bucket").await;
    assert_eq!(row["degraded"], true);
}

/// An Envoy reporting to two instances on one Redis loses the one its
/// stream is on: it keeps enforcing its assignment, reconnects to the
/// other at its next report and is assigned there, well within the
/// assignment's time to live, and the tenant's limit holds throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_envoy_that_loses_its_instance_keeps_enforcing_and_moves_to_another() {
    const R: f64 = 10.0;
    const B: f64 = 10.0;
    let redis = RedisServer::start();
    let mut servers: Vec<Option<TestServer>> = two_instances(&redis, "acme", B as i64, "10/second")
        .await
        .into_iter()
        .map(Some)
        .collect();
    let up = upstream().await;
    let envoy = envoy(
        &[servers[0].as_ref().unwrap(), servers[1].as_ref().unwrap()],
        up,
    )
    .await;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let started = tokio::time::Instant::now();
    let (seen, tasks) = load(envoy.listeners[0], "acme", 40, 2, &stopped);
    // The instance holding the stream.
    let mut holder = None;
    for _ in 0..200 {
        for (i, s) in servers.iter().enumerate() {
            if view(s.as_ref().unwrap()).await["buckets"] == 1 {
                holder = Some(i);
            }
        }
        if holder.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let holder = holder.expect("one instance holds the Envoy's stream");
    tokio::time::sleep(Duration::from_secs(8)).await;
    let before = seen.admitted();
    let lost_at = tokio::time::Instant::now();
    servers[holder].take().unwrap().stop().await;
    // While no instance answers, the assignment in force holds: at most
    // its rate (the whole limit: this is the only Envoy) and what its
    // bucket held.
    let other = servers[1 - holder].as_ref().unwrap();
    let row = wait_assigned(other, "acme", "token_bucket").await;
    let moved = lost_at.elapsed();
    assert_eq!(row["share_ppm"], 1_000_000, "{row}");
    assert!(
        moved <= Duration::from_secs(15),
        "reassigned by the other instance within the time to live (took {moved:?})"
    );
    eprintln!("moved in {moved:?}; {before} admitted before the loss");
    admitted_within_the_limit(stop, tasks, &seen, started, (R, B)).await;
    drop(envoy);
}

/// An Envoy named by `x-tollgate-envoy` holds its shares under its name: a
/// second stream of the same Envoy, through another instance, takes its
/// share over at once (an unnamed newcomer gets nothing until the holders
/// report again), whether or not its first instance gave the share back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_envoy_takes_its_share_over_through_another_instance() {
    let redis = RedisServer::start();
    let servers = two_instances(&redis, "acme", 100, "10/second").await;
    let acme = [("tenant", "acme")];
    let channel = |s: &TestServer| {
        tonic::transport::Endpoint::from_shared(s.url())
            .unwrap()
            .connect_lazy()
    };
    let mut first = QuotaStream::open_as(channel(&servers[0]), Some("envoy-1"))
        .await
        .unwrap();
    let answer = first
        .report("api", vec![usage(&acme, 1, 0, 0)])
        .await
        .unwrap();
    assert!(matches!(strategy(&answer), Strategy::TokenBucket(_)));
    // Another Envoy arrives through the other instance: nothing is free.
    let mut other = QuotaStream::open_as(channel(&servers[1]), None)
        .await
        .unwrap();
    let answer = other
        .report("api", vec![usage(&acme, 1, 0, 0)])
        .await
        .unwrap();
    assert_eq!(strategy(&answer), Strategy::BlanketRule(1), "DENY_ALL");
    // The first Envoy again, through the other instance, its first stream
    // still open: its own share, at once.
    let mut again = QuotaStream::open_as(channel(&servers[1]), Some("envoy-1"))
        .await
        .unwrap();
    let answer = again
        .report("api", vec![usage(&acme, 1, 0, 0)])
        .await
        .unwrap();
    let Strategy::TokenBucket(bucket) = strategy(&answer) else {
        panic!("a share expected: {answer:?}");
    };
    // Half the weight now (the two report the same demand): 5 a second.
    assert_eq!(bucket.tokens_per_fill, Some(150));
    assert_eq!(bucket.fill_interval.unwrap().seconds, 30);
    // A name too long is refused with what to fix.
    let long = "e".repeat(300);
    let Err(err) = QuotaStream::open_as(channel(&servers[0]), Some(&long)).await else {
        panic!("a name of 300 bytes is refused");
    };
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message().contains("x-tollgate-envoy"),
        "{}",
        err.message()
    );
    drop((first, other));
}

/// The lifecycle of a subscription: a stream that ends gives its share
/// back at once; a bucket that reports no requests for
/// `--rlqs-abandon-after` is abandoned (Envoy forgets it) and its share
/// given back; a shadow rule's bucket and a bucket no rule applies to are
/// admitted (ALLOW_ALL), and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_give_shares_back_idle_buckets_are_abandoned_and_shadow_rules_allow() {
    let shadow = tollgate::limits::LimitRow::from_request(
        "trial".into(),
        String::new(),
        "tenant",
        1,
        "1/hour",
        "shadow",
        "allow",
        0,
        "rate",
        Some("trial".into()),
    )
    .unwrap();
    let rules = [
        common::row("acme", "acme", "", "tenant", 100, "10/second"),
        shadow,
    ];
    let server = TestServer::launch(Some(&rules), |c| {
        c.rlqs.abandon_after = Duration::from_millis(300);
    })
    .await;
    let acme = [("tenant", "acme")];
    let mut first = QuotaStream::open(&server, "127.0.0.1").await.unwrap();
    first
        .report("api", vec![usage(&acme, 1, 0, 0)])
        .await
        .unwrap();
    // A second Envoy gets nothing while the first holds the limit...
    let mut second = QuotaStream::open(&server, "127.0.0.1").await.unwrap();
    let answer = second
        .report("api", vec![usage(&acme, 1, 0, 0)])
        .await
        .unwrap();
    assert_eq!(strategy(&answer), Strategy::BlanketRule(1));
    // ...and all of it once the first stream ends: pushed within a second
    // or two, without a report (its part was waiting for the other's).
    drop(first);
    let pushed = tokio::time::timeout(Duration::from_secs(5), second.answers.message())
        .await
        .expect("an assignment is pushed between reports")
        .unwrap()
        .unwrap();
    let Strategy::TokenBucket(whole) = strategy(&pushed) else {
        panic!("a token bucket pushed: {pushed:?}");
    };
    assert_eq!(
        (whole.tokens_per_fill, whole.fill_interval.unwrap().seconds),
        (Some(100), 10),
        "the whole limit, 10 a second"
    );

    // Idle reports past --rlqs-abandon-after: abandoned.
    let answer = second
        .report("api", vec![usage(&acme, 0, 0, 1)])
        .await
        .unwrap();
    assert!(matches!(strategy(&answer), Strategy::TokenBucket(_)));
    tokio::time::sleep(Duration::from_millis(400)).await;
    let answer = second
        .report("api", vec![usage(&acme, 0, 0, 1)])
        .await
        .unwrap();
    assert!(
        matches!(
            answer.bucket_action[0].bucket_action,
            Some(Action::AbandonAction(_))
        ),
        "{answer:?}"
    );
    assert_eq!(view(&server).await["buckets"], 0);

    // A shadow rule never refuses: ALLOW_ALL, and its refusals-to-be are
    // still counted as reported. No rule at all: ALLOW_ALL.
    let answer = second
        .report("api", vec![usage(&[("tenant", "trial")], 5, 0, 1)])
        .await
        .unwrap();
    assert_eq!(strategy(&answer), Strategy::BlanketRule(0));
    let answer = second
        .report("api", vec![usage(&[("tenant", "nobody")], 5, 0, 1)])
        .await
        .unwrap();
    assert_eq!(strategy(&answer), Strategy::BlanketRule(0));
    let metrics = server.http_get("/metrics").await.unwrap().1;
    assert_eq!(
        common::envoy::sample(
            &metrics,
            "tollgate_rlqs_assignments_total{strategy=\"abandon\"}"
        ),
        Some(1)
    );
}

/// The body of `tollgate serve`'s `/v1/rlqs`, as JSON.
fn process_view(process: &common::process::ServeProcess) -> serde_json::Value {
    let response = process.admin_get("/v1/rlqs?limit=100").unwrap();
    let body = response.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or(serde_json::Value::Null)
}

/// Two `tollgate serve` processes on one Redis; the one holding the
/// Envoy's stream is killed with SIGKILL (it gives nothing back). The Envoy
/// keeps enforcing, reconnects to the other at its next report and, named
/// (`x-tollgate-envoy`), takes its own share over at once instead of
/// waiting for the dead instance's entry to expire; the limit holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_envoy_survives_its_instance_killed() {
    use common::process::{ServeProcess, succeeds};
    const R: f64 = 10.0;
    const B: f64 = 10.0;
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("limits.db");
    let db = db.to_str().unwrap();
    let edit = ["--limits", db, "--wait-for", "none"];
    succeeds(
        dir.path(),
        &[
            &["limits", "set", "--create"],
            &edit[..],
            &[
                "--tenant",
                "acme",
                "--scope",
                "tenant",
                "--burst",
                "10",
                "--rate",
                "10/second",
                "--name",
                "acme",
            ],
        ]
        .concat(),
    );
    succeeds(
        dir.path(),
        &[
            &["limits", "delete"],
            &edit[..],
            &["--name", "default-per-key"],
        ]
        .concat(),
    );
    let url = redis.url();
    let mut instances: Vec<Option<ServeProcess>> = (0..2)
        .map(|_| {
            Some(ServeProcess::start(
                dir.path(),
                &["--limits", db, "--store", &url],
            ))
        })
        .collect();
    for i in instances.iter().flatten() {
        i.wait_ready();
    }
    let port = |p: &ServeProcess| p.grpc.rsplit(':').next().unwrap().parse::<u16>().unwrap();
    let ports: Vec<u16> = instances.iter().flatten().map(port).collect();
    let up = upstream().await;
    let envoy = envoy_to(&ports, up).await;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let started = tokio::time::Instant::now();
    let (seen, tasks) = load(envoy.listeners[0], "acme", 40, 2, &stopped);
    let mut holder = None;
    for _ in 0..200 {
        holder = instances
            .iter()
            .position(|i| process_view(i.as_ref().unwrap())["buckets"] == 1);
        if holder.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let holder = holder.expect("one instance holds the Envoy's stream");
    tokio::time::sleep(Duration::from_secs(8)).await;
    let mut killed = instances[holder].take().unwrap();
    killed.child.kill().unwrap();
    killed.child.wait().unwrap();
    let lost_at = tokio::time::Instant::now();
    let other = instances[1 - holder].as_ref().unwrap();
    let mut taken = None;
    for _ in 0..400 {
        let v = process_view(other);
        if let Some(row) = v["top"].as_array().and_then(|rows| rows.first())
            && row["assignment"] == "token_bucket"
        {
            taken = Some((lost_at.elapsed(), row.clone()));
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let (moved, row) = taken.expect("the other instance assigns the Envoy's bucket");
    // Its own share, at once: the dead instance's entry was its own.
    assert_eq!(row["share_ppm"], 1_000_000, "{row}");
    assert!(row["named"] == true, "{row}");
    assert!(moved <= Duration::from_secs(15), "moved in {moved:?}");
    eprintln!("moved in {moved:?}");
    admitted_within_the_limit(stop, tasks, &seen, started, (R, B)).await;
    drop(envoy);
}

/// The README's quota-service Envoy configuration is the deploy file the
/// tests run (less its header comments).
#[test]
fn the_readme_shows_the_deploy_file_as_it_is() {
    let root = env!("CARGO_MANIFEST_DIR");
    let readme = std::fs::read_to_string(format!("{root}/README.md")).unwrap();
    let deploy = std::fs::read_to_string(format!("{root}/deploy/envoy/rlqs/envoy.yaml")).unwrap();
    let body: Vec<&str> = deploy.lines().filter(|l| !l.starts_with('#')).collect();
    let start = readme
        .find("<summary>deploy/envoy/rlqs/envoy.yaml</summary>")
        .expect("the README shows deploy/envoy/rlqs/envoy.yaml");
    let block = &readme[start..];
    let block = &block[block.find("```yaml\n").unwrap() + 8..];
    let block = &block[..block.find("\n```").unwrap()];
    assert_eq!(block.lines().collect::<Vec<_>>(), body);
}
