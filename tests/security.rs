//! TLS and mutual TLS on the gRPC port, the admin token, the request size
//! limit, the request timeout, and the per-connection concurrency limit.

use crate::common;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::redis::RedisServer;
use common::{TestServer, ask, req};
use tollgate::api::admin::AdminAccess;
use tollgate::proto::v1::Degraded;
use tollgate::proto::v1::rate_limiter_client::RateLimiterClient;
use tollgate::server::{ServeConfig, StoreSpec, TlsFiles, TlsOptions};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

/// A TLS channel trusting the CA in `d`, presenting the client certificate
/// found in `identity` (made by `common::tls::certificates`), if any.
async fn tls_channel(
    server: &TestServer,
    d: &Path,
    identity: Option<&Path>,
) -> Result<Channel, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(
            std::fs::read(d.join("ca.pem")).unwrap(),
        ))
        .domain_name("localhost");
    if let Some(id) = identity {
        tls = tls.identity(Identity::from_pem(
            std::fs::read(id.join("client.pem")).unwrap(),
            std::fs::read(id.join("client.key")).unwrap(),
        ));
    }
    Channel::from_shared(format!("https://{}", server.grpc))
        .unwrap()
        .tls_config(tls)?
        .connect()
        .await
}

/// True when a call over TLS with `identity` fails, at the handshake or at
/// the call.
async fn refused(server: &TestServer, d: &Path, identity: Option<&Path>) -> bool {
    match tls_channel(server, d, identity).await {
        Err(_) => true,
        Ok(channel) => RateLimiterClient::new(channel)
            .should_allow(req("t", "k"))
            .await
            .is_err(),
    }
}

async fn start_tls(d: &Path, mutual: bool) -> TestServer {
    let files = TlsFiles {
        cert: d.join("server.pem"),
        key: d.join("server.key"),
        client_ca: mutual.then(|| d.join("ca.pem")),
    };
    TestServer::launch(None, move |c| c.tls = TlsOptions::with(files)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_and_mutual_tls_on_the_grpc_port() {
    let dir = tempfile::tempdir().unwrap();
    common::tls::certificates(dir.path());

    let server = start_tls(dir.path(), false).await;
    let mut client = RateLimiterClient::new(tls_channel(&server, dir.path(), None).await.unwrap());
    assert!(
        client
            .should_allow(req("t", "k"))
            .await
            .unwrap()
            .into_inner()
            .allowed
    );
    // Plaintext is refused.
    let plain = RateLimiterClient::connect(server.url()).await;
    let plaintext_refused = match plain {
        Err(_) => true,
        Ok(mut c) => c.should_allow(req("t", "k")).await.is_err(),
    };
    assert!(plaintext_refused, "plaintext must not work on a TLS port");
    server.stop().await;

    let server = start_tls(dir.path(), true).await;
    let mut client = RateLimiterClient::new(
        tls_channel(&server, dir.path(), Some(dir.path()))
            .await
            .unwrap(),
    );
    assert!(
        client
            .should_allow(req("t", "k"))
            .await
            .unwrap()
            .into_inner()
            .allowed
    );
    assert!(
        refused(&server, dir.path(), None).await,
        "a client without a certificate must be refused under mutual TLS"
    );
    // A certificate signed by another CA is refused too.
    let other = tempfile::tempdir().unwrap();
    common::tls::certificates(other.path());
    assert!(
        refused(&server, dir.path(), Some(other.path())).await,
        "a client certificate from another CA must be refused"
    );
    // The right one still gets in on a new connection.
    assert!(!refused(&server, dir.path(), Some(dir.path())).await);
    server.stop().await;
}

async fn http(
    server: &TestServer,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> (u16, String) {
    server.http(method, path, token, body).await
}

#[tokio::test]
async fn the_admin_port_changes_limits_only_with_the_token() {
    let row = r#"{"tenant":"acme","burst":300,"rate":"6000/minute"}"#;
    let open = TestServer::start().await;
    let (status, body) = http(&open, "POST", "/v1/limits", None, row).await;
    assert_eq!(status, 403);
    assert!(body.contains("start tollgate with --admin-token"), "{body}");
    open.stop().await;

    let access = AdminAccess {
        token: Some("s3cret".into()),
        protect_reads: false,
        trust_network: false,
    };
    let server = TestServer::launch(None, move |c| c.admin_access = access).await;
    assert_eq!(http(&server, "POST", "/v1/limits", None, row).await.0, 401);
    assert_eq!(
        http(&server, "POST", "/v1/limits", Some("wrong"), row)
            .await
            .0,
        401
    );
    let (status, body) = http(&server, "POST", "/v1/limits", Some("s3cret"), row).await;
    assert_eq!((status, body.as_str()), (200, r#"{"set":"acme-any-key"}"#));
    let mut client = server.client().await;
    assert_eq!(
        client
            .should_allow(req("acme", "k"))
            .await
            .unwrap()
            .into_inner()
            .limit,
        300,
        "in force at once"
    );
    let (status, body) = http(
        &server,
        "POST",
        "/v1/limits",
        Some("s3cret"),
        r#"{"tenant":"acme","burst":0,"rate":"1/second"}"#,
    )
    .await;
    assert_eq!(status, 400);
    assert!(body.contains("burst must be at least 1"), "{body}");
    assert_eq!(
        http(
            &server,
            "DELETE",
            "/v1/limits/acme-any-key",
            Some("s3cret"),
            ""
        )
        .await
        .0,
        200
    );
    assert_eq!(
        http(
            &server,
            "DELETE",
            "/v1/limits/acme-any-key",
            Some("s3cret"),
            ""
        )
        .await
        .0,
        404
    );
    // Reads stay open unless protected.
    assert_eq!(http(&server, "GET", "/v1/limits", None, "").await.0, 200);
    server.stop().await;

    let access = AdminAccess {
        token: Some("s3cret".into()),
        protect_reads: true,
        trust_network: false,
    };
    let server = TestServer::launch(None, move |c| c.admin_access = access).await;
    assert_eq!(http(&server, "GET", "/v1/limits", None, "").await.0, 401);
    assert_eq!(http(&server, "GET", "/metrics", None, "").await.0, 401);
    assert_eq!(
        http(&server, "GET", "/v1/limits", Some("s3cret"), "")
            .await
            .0,
        200
    );
    assert_eq!(
        http(&server, "GET", "/healthz", None, "").await.0,
        200,
        "probes stay open"
    );
    server.stop().await;
}

#[tokio::test]
async fn an_oversized_request_is_refused_with_a_clear_status() {
    let server = TestServer::launch(None, |c| c.grpc_limits.max_message_bytes = 4096).await;
    let mut client = server.client().await;
    let status = client
        .should_allow(req("t", &"k".repeat(10_000)))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::OutOfRange, "{status:?}");
    assert!(
        status.message().contains("message length too large"),
        "{}",
        status.message()
    );
    // The connection and the server carry on.
    assert!(
        client
            .should_allow(req("t", "k"))
            .await
            .unwrap()
            .into_inner()
            .allowed
    );
    server.stop().await;
}

/// A server on `redis` with the seeded default limits, configured further
/// by `configure`.
async fn on_redis(redis: &RedisServer, configure: impl FnOnce(&mut ServeConfig)) -> TestServer {
    let url = redis.url();
    TestServer::launch(None, move |c| {
        c.store = StoreSpec::Redis(url);
        configure(c);
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_stuck_on_a_hung_store_is_cut_off_by_the_request_timeout() {
    let redis = RedisServer::start();
    // A store timeout far beyond the request timeout: the request timeout
    // must be what answers.
    let server = on_redis(&redis, |c| {
        c.store_timeout = Duration::from_secs(30);
        c.grpc_limits.request_timeout = Duration::from_millis(300);
    })
    .await;
    let mut client = server.client().await;
    assert!(
        client
            .should_allow(req("t", "k"))
            .await
            .unwrap()
            .into_inner()
            .allowed
    );
    redis.freeze();
    let mut stuck = tonic::Request::new(req("t", "k"));
    stuck.set_timeout(Duration::from_secs(10));
    let status = client.should_allow(stuck).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Cancelled, "{status:?}");
    assert!(
        status.message().contains("Timeout expired"),
        "{}",
        status.message()
    );
    redis.thaw();
    assert!(
        client
            .should_allow(req("t", "k"))
            .await
            .unwrap()
            .into_inner()
            .allowed,
        "and the server carries on"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_connection_waits_its_turn_while_another_is_served() {
    // With the per-connection limit, exactly 4 of the flood are in service
    // at any moment, and the quiet connection is answered while most of the
    // flood still waits. The control run without it has all 100 in service
    // at once: the limit is what holds the other 96 back.
    let (pending, most_in_service) = quiet_request_against_a_flood(4).await;
    assert_eq!(most_in_service, 4);
    assert!(
        pending >= 50,
        "the quiet connection was answered only after {} of the 100 flooding requests",
        100 - pending
    );
    let (_, most_in_service) = quiet_request_against_a_flood(1000).await;
    assert_eq!(most_in_service, 100, "control: without the limit");
}

/// Floods one connection with 100 requests against a frozen Redis, waits
/// until the server has as many in service as the connection may have, then
/// asks once on another connection. Returns how many flooding requests were
/// still unanswered when that answer came, and how many requests the server
/// had in service once the flood arrived.
async fn quiet_request_against_a_flood(connection_concurrency: usize) -> (usize, u64) {
    let redis = RedisServer::start();
    // Every decision on the frozen Redis below waits the whole store
    // timeout (the breaker never opens), so the flood's requests stay in
    // flight long enough to be counted.
    let server = on_redis(&redis, |c| {
        c.store_timeout = Duration::from_millis(300);
        c.breaker_threshold = 1_000_000;
        c.grpc_limits.connection_concurrency = connection_concurrency;
    })
    .await;
    let flood = server.client().await;
    let mut quiet = server.client().await;
    assert!(ask(&mut quiet, req("t", "warm-up")).await.allowed);

    redis.freeze();
    let answered = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for i in 0..100 {
        let (mut client, answered) = (flood.clone(), answered.clone());
        tasks.push(tokio::spawn(async move {
            let mut request = tonic::Request::new(req("t", &format!("flood-{i}")));
            request.set_timeout(Duration::from_secs(60));
            let r = client.should_allow(request).await;
            answered.fetch_add(1, Ordering::SeqCst);
            r.map(|r| r.into_inner().degraded())
        }));
    }
    // The flood has reached the server when as many of its requests are in
    // service as the connection allows (the rest wait their turn).
    let in_service = connection_concurrency.min(100) as u64;
    let in_flight = || async {
        let (_, metrics) = server.http_get("/metrics").await.unwrap();
        common::envoy::sample(&metrics, "tollgate_grpc_requests_in_flight").unwrap()
    };
    // The first reading at or above that number is checked to be exactly
    // it: past the limit, it would jump straight to 100.
    let mut most = 0;
    for _ in 0..2000 {
        most = most.max(in_flight().await);
        if most >= in_service {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(
        most, in_service,
        "the flood never had {in_service} requests in service"
    );
    let r = ask(&mut quiet, req("t", "quiet")).await;
    let pending = 100 - answered.load(Ordering::SeqCst);
    assert_eq!(r.degraded(), Degraded::FailedOpen, "decided by its policy");
    redis.thaw();
    for t in tasks {
        assert!(
            t.await.unwrap().is_ok(),
            "every flooding request is answered in the end"
        );
    }
    server.stop().await;
    (pending, most)
}

/// A flood of fresh keys from one tenant at the in-memory cap never
/// resets another tenant's exhausted key: buckets still refilling are never
/// dropped, and the flood's new keys get their rule's store-unavailable
/// answer instead (the default row fails open, flagged as degraded).
#[tokio::test]
async fn a_key_flood_at_the_cap_leaves_a_bystanders_exhausted_key_exhausted() {
    use tollgate::proto::v1::{BatchItem, ShouldAllowBatchRequest};
    let rows = [
        common::row("calm", "calm", "", "key", 10, "10/second"),
        common::row("flood", "flood", "", "key", 10, "1/hour"),
    ];
    let server = TestServer::launch(Some(&rows), |c| c.max_buckets = 1_000).await;
    let mut client = server.client().await;
    for _ in 0..10 {
        assert!(ask(&mut client, req("calm", "user")).await.allowed);
    }
    assert!(!ask(&mut client, req("calm", "user")).await.allowed);
    // 12 batches of 100 fresh keys: 1 200 new buckets against a cap of 1 000.
    let mut degraded = 0;
    for round in 0..12 {
        let items = (0..100)
            .map(|i| BatchItem {
                key: format!("k{round}-{i}"),
                cost: 1,
                tenant: "flood".into(),
                resource: String::new(),
            })
            .collect();
        let r = client
            .should_allow_batch(ShouldAllowBatchRequest {
                items,
                dry_run: false,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(r.allowed);
        degraded += r
            .results
            .iter()
            .filter(|d| d.degraded() == Degraded::FailedOpen)
            .count();
    }
    assert_eq!(
        degraded, 300,
        "the batches past the cap, answered by the policy"
    );
    let r = ask(&mut client, req("calm", "user")).await;
    assert!(!r.allowed, "the bystander's key is still exhausted");
    assert_eq!(r.degraded(), Degraded::None);
    let (_, metrics) = server.http_get("/metrics").await.unwrap();
    assert!(
        metrics.contains("\ntollgate_bucket_capacity_refusals_total 3\n"),
        "{metrics}"
    );
    server.stop().await;
}
