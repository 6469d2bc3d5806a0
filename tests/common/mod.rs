//! A real Tollgate server on loopback port 0, with a hand-driven clock and
//! its own SQLite limits table in a temporary directory.

#![allow(dead_code)]

pub mod envoy;
pub mod envoy_proxy;
pub mod hostile;
pub mod peers;
pub mod ports;
pub mod postgres;
pub mod process;
pub mod raw;
pub mod redis;
pub mod refill;
pub mod tls;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tollgate::clock::ManualClock;
use tollgate::engine::Unmatched;
use tollgate::limits::LimitRow;
use tollgate::limits::table::LimitsTable;
use tollgate::proto::v1::rate_limiter_client::RateLimiterClient;
use tollgate::proto::v1::{ShouldAllowRequest, ShouldAllowResponse};
use tollgate::server::{self, Listeners, ServeConfig, ServeError};
use tonic::transport::Channel;

/// 2023-11-14T22:13:20Z, in microseconds.
pub const T0: u64 = 1_700_000_000_000_000;

/// Refuses to go on unless this test runs in a process of its own.
///
/// Metrics are process-wide (one Prometheus recorder, as in production,
/// where a process is one instance), so a test that reads exact counts from
/// an in-process server counts every other test of the same process too.
/// `cargo nextest` (what `scripts/test` runs) gives each test a process;
/// `cargo test` runs them as threads of one, where these counts would be
/// wrong and the test would fail for a reason other than its own.
pub fn own_process() {
    let mode = std::env::var("NEXTEST_EXECUTION_MODE").unwrap_or_default();
    assert!(
        mode == "process-per-test",
        "this test reads process-wide metrics and needs a process of its own: \
         run it with `cargo nextest run` (as scripts/test does), not `cargo test`"
    );
}

pub struct TestServer {
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
    pub clock: Arc<ManualClock>,
    pub table: LimitsTable,
    pub limits_path: String,
    stop: Option<oneshot::Sender<()>>,
    task: parking_lot::Mutex<Option<JoinHandle<Result<(), ServeError>>>>,
    _dir: tempfile::TempDir,
}

/// A row with the defaults `tollgate limits set` uses.
pub fn row(
    name: &str,
    tenant: &str,
    resource: &str,
    scope: &str,
    burst: i64,
    rate: &str,
) -> LimitRow {
    LimitRow::from_request(
        tenant.into(),
        resource.into(),
        scope,
        burst,
        rate,
        "enforce",
        "allow",
        0,
        "rate",
        Some(name.into()),
    )
    .unwrap()
}

impl TestServer {
    /// A server with the seeded default table.
    pub async fn start() -> Self {
        Self::start_with(None, Unmatched::Allow, 1_000_000).await
    }

    /// A server whose table holds exactly `rows`.
    pub async fn with_rows(rows: &[LimitRow]) -> Self {
        Self::start_with(Some(rows), Unmatched::Allow, 1_000_000).await
    }

    pub async fn start_with(
        rows: Option<&[LimitRow]>,
        unmatched: Unmatched,
        max_buckets: usize,
    ) -> Self {
        Self::launch(rows, |config| {
            config.unmatched = unmatched;
            config.max_buckets = max_buckets;
        })
        .await
    }

    /// A server whose table holds `rows` (or the seeded default), with its
    /// configuration adjusted by `configure`. Returns once it is listening;
    /// `wait_ready` waits for the store.
    pub async fn launch_unready(
        rows: Option<&[LimitRow]>,
        configure: impl FnOnce(&mut ServeConfig),
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let limits_path = dir.path().join("limits.db").to_str().unwrap().to_owned();
        let table = LimitsTable::open(&limits_path).await.unwrap();
        if let Some(rows) = rows {
            table.execute_sql("DELETE FROM limits").await.unwrap();
            for r in rows {
                table.upsert(r).await.unwrap();
            }
        }
        let listeners = Listeners::bind(
            "127.0.0.1:0".parse().unwrap(),
            "127.0.0.1:0".parse().unwrap(),
        )
        .await
        .unwrap();
        let grpc = listeners.grpc.local_addr().unwrap();
        let admin = listeners.admin.local_addr().unwrap();
        let clock = Arc::new(ManualClock::new(T0));
        let mut config = ServeConfig {
            limits: limits_path.clone(),
            reload_interval: Duration::from_millis(50),
            ..ServeConfig::default()
        };
        configure(&mut config);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(server::run(config, listeners, clock.clone(), async move {
            let _ = stopped.await;
        }));
        let server = Self {
            grpc,
            admin,
            clock,
            table,
            limits_path,
            stop: Some(stop),
            task: parking_lot::Mutex::new(Some(task)),
            _dir: dir,
        };
        // Listening as soon as the admin port answers at all.
        let mut listening = false;
        for _ in 0..500 {
            if server.http_get("/healthz").await.is_ok() {
                listening = true;
                break;
            }
            server.panic_if_ended("listening").await;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            listening,
            "the server's admin port answers /healthz within 5 s"
        );
        server
    }

    /// As `launch_unready`, then waits until ready.
    pub async fn launch(
        rows: Option<&[LimitRow]>,
        configure: impl FnOnce(&mut ServeConfig),
    ) -> Self {
        let server = Self::launch_unready(rows, configure).await;
        server.wait_ready().await;
        server
    }

    pub async fn wait_ready(&self) {
        for _ in 0..1500 {
            if matches!(self.http_get("/readyz").await, Ok((200, _))) {
                return;
            }
            self.panic_if_ended("ready").await;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("server did not become ready");
    }

    /// Fails the test with the server's own error when it has stopped.
    async fn panic_if_ended(&self, before: &str) {
        let ended = {
            let mut task = self.task.lock();
            match task.as_ref() {
                Some(t) if t.is_finished() => task.take(),
                _ => None,
            }
        };
        if let Some(ended) = ended {
            panic!(
                "the server stopped before it was {before}: {:?}",
                ended.await
            );
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.grpc)
    }

    pub async fn client(&self) -> RateLimiterClient<Channel> {
        RateLimiterClient::connect(self.url()).await.unwrap()
    }

    pub async fn channel(&self) -> Channel {
        Channel::from_shared(self.url())
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    /// A GET on the admin port: (status, body).
    pub async fn http_get(&self, path: &str) -> std::io::Result<(u16, String)> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        if path.starts_with("/metrics") {
            own_process();
        }
        let mut stream = tokio::net::TcpStream::connect(self.admin).await?;
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            self.admin
        );
        stream.write_all(request.as_bytes()).await?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await?;
        let status = response
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let body = response
            .split_once("\r\n\r\n")
            .map_or("", |(_, b)| b)
            .to_owned();
        Ok((status, body))
    }

    /// `METHOD path` on the admin port with a JSON `body` and, when given,
    /// `Authorization: Bearer TOKEN`: the status and the body.
    pub async fn http(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: &str,
    ) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        if path.starts_with("/metrics") {
            own_process();
        }
        let mut s = tokio::net::TcpStream::connect(self.admin).await.unwrap();
        let auth = token
            .map(|t| format!("Authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: a\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(request.as_bytes()).await.unwrap();
        let mut r = String::new();
        s.read_to_string(&mut r).await.unwrap();
        let status = r
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = r.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        (status, body.to_owned())
    }

    /// Waits (bounded) until the server reports a limits generation of at
    /// least `generation`, i.e. it has picked up an edit.
    pub async fn wait_generation(&self, generation: u64) {
        for _ in 0..500 {
            let (_, body) = self.http_get("/v1/limits").await.unwrap();
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            if v["status"]["generation"].as_u64().unwrap() >= generation {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("limits were not reloaded to generation {generation}");
    }

    /// Waits (bounded) until /v1/limits lists a rejected row; returns the
    /// first one's message.
    pub async fn wait_rejected_row(&self) -> String {
        for _ in 0..500 {
            let (_, body) = self.http_get("/v1/limits").await.unwrap();
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            if let Some(e) = v["status"]["rejected"][0].as_str() {
                return e.to_owned();
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("no rejected row was reported");
    }

    pub async fn stop(mut self) {
        // A server that stopped by itself has dropped the receiver; its
        // result says why.
        let _ = self.stop.take().unwrap().send(());
        let task = self.task.get_mut().take().expect("running");
        task.await.unwrap().unwrap();
    }
}

pub fn req(tenant: &str, key: &str) -> ShouldAllowRequest {
    ShouldAllowRequest {
        key: key.into(),
        cost: 1,
        tenant: tenant.into(),
        resource: String::new(),
        dry_run: false,
    }
}

pub async fn ask(
    client: &mut RateLimiterClient<Channel>,
    request: ShouldAllowRequest,
) -> ShouldAllowResponse {
    client.should_allow(request).await.unwrap().into_inner()
}

/// A protobuf Duration in microseconds.
pub fn micros(d: &Option<prost_types::Duration>) -> u64 {
    let d = d.as_ref().expect("duration present");
    d.seconds as u64 * 1_000_000 + d.nanos as u64 / 1_000
}

/// Fails unless `promtool check metrics` accepts `metrics` (Prometheus text).
pub fn assert_promtool_accepts(metrics: &str) {
    use std::io::Write as _;
    use std::process::{Command, Stdio};
    let mut lint = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool runs (scripts/test installs Debian's prometheus)");
    lint.stdin
        .take()
        .unwrap()
        .write_all(metrics.as_bytes())
        .unwrap();
    let lint = lint.wait_with_output().unwrap();
    assert!(
        lint.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&lint.stdout),
        String::from_utf8_lossy(&lint.stderr)
    );
}

/// True when `GET path` on loopback `port` answers 200 (for readiness
/// endpoints of the servers tests start).
pub async fn http_ok(port: u16, path: &str) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return false;
    };
    let request = format!("GET {path} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
    if s.write_all(request.as_bytes()).await.is_err() {
        return false;
    }
    let mut r = String::new();
    let _ = s.read_to_string(&mut r).await;
    r.starts_with("HTTP/1.1 200")
}
