//! `tollgate-bench run`, the load tool, against real servers: its counts
//! must be exact, since every figure in BENCHMARKS.md comes from them. The
//! server runs in this process (`tollgate::server::run`, as the binary runs
//! it), so `--server-pid` is this process.

#[path = "../../tests/common/ports.rs"]
mod ports;
#[path = "../../tests/common/redis.rs"]
#[allow(dead_code)]
mod redis;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use redis::RedisServer;
use tokio::time::Instant;
use tollgate::clock::SystemClock;
use tollgate::server::{Listeners, ServeConfig, StoreSpec};

/// A server on loopback port 0 with its own limits table (seeded with the
/// default rule: burst 30, 600/minute); stopped when dropped.
struct Server {
    grpc: SocketAddr,
    admin: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    _dir: tempfile::TempDir,
}

impl Server {
    async fn start(configure: impl FnOnce(&mut ServeConfig)) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut config = ServeConfig {
            limits: dir.path().join("limits.db").display().to_string(),
            ..ServeConfig::default()
        };
        configure(&mut config);
        let listeners = Listeners::bind(
            "127.0.0.1:0".parse().unwrap(),
            "127.0.0.1:0".parse().unwrap(),
        )
        .await
        .unwrap();
        let (grpc, admin) = (
            listeners.grpc.local_addr().unwrap(),
            listeners.admin.local_addr().unwrap(),
        );
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(tollgate::server::run(
            config,
            listeners,
            Arc::new(SystemClock),
            async {
                let _ = stopped.await;
            },
        ));
        let server = Self {
            grpc,
            admin,
            stop: Some(stop),
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !server.ready() {
            assert!(Instant::now() < deadline, "the server never became ready");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        server
    }

    /// `GET /readyz` answers 200.
    fn ready(&self) -> bool {
        let Ok(mut tcp) = std::net::TcpStream::connect(self.admin) else {
            return false;
        };
        let _ = tcp.write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        let mut answer = String::new();
        let _ = tcp.read_to_string(&mut answer);
        answer.starts_with("HTTP/1.1 200")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// The `name value` pairs of the summary's first two lines.
fn figures(out: &str) -> HashMap<String, u64> {
    let mut figures = HashMap::new();
    for line in out.lines().take(2) {
        let words: Vec<&str> = line.split_whitespace().collect();
        for pair in words.windows(2) {
            if let Ok(n) = pair[1].parse::<u64>() {
                figures.insert(pair[0].to_owned(), n);
            }
        }
    }
    figures
}

/// Runs `tollgate-bench run` for one second against `server` with `args`
/// added; returns its output and the figures of its summary.
async fn bench(server: &Server, args: &[&str]) -> (String, HashMap<String, u64>) {
    let url = format!("http://{}", server.grpc);
    let mut all: Vec<String> = ["run", "--server", &url, "--duration", "1s", "--quiet"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    all.extend(args.iter().map(|s| s.to_string()));
    let out = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_tollgate-bench"))
            .args(&all)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let f = figures(&text);
    (text, f)
}

/// One key hammered by four workers for a second: the server's seeded
/// default (burst 30, 600/minute) admits 30 plus 10 per second, and the
/// tool reports exactly the calls, decisions and admissions it saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_what_the_server_decided() {
    let server = Server::start(|_| {}).await;
    let pid = std::process::id().to_string();
    let started = Instant::now();
    let (text, f) = bench(
        &server,
        &[
            "--concurrency",
            "4",
            "--connections",
            "2",
            "--keys",
            "1",
            "--server-pid",
            &pid,
        ],
    )
    .await;
    let wall = started.elapsed().as_secs_f64();
    assert_eq!(f["errors"], 0, "{text}");
    assert_eq!(f["degraded"], 0, "{text}");
    assert_eq!(f["decisions"], f["calls"], "{text}");
    let allowed = f["allowed"];
    assert!(
        (30..=30 + (10.0 * wall).ceil() as u64).contains(&allowed),
        "{allowed} admitted in {wall:.2} s: {text}"
    );
    assert!(
        f["calls"] > allowed,
        "the key was driven past its limit: {text}"
    );
    let p: Vec<u64> = ["p50", "p90", "p99", "p99.9", "max"]
        .iter()
        .map(|q| f[*q])
        .collect();
    assert!(p.windows(2).all(|w| w[0] <= w[1]), "{text}");
    assert!(text.contains("\nserver CPU: "), "{text}");
    assert!(text.contains("\nclient CPU: "), "{text}");
}

/// With Redis gone, every answer comes from the rule's store-unavailable
/// policy (the seeded default fails open): the tool counts each decision of
/// each batch item as degraded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_degraded_answers() {
    let mut redis = RedisServer::start();
    let url = redis.url();
    let server = Server::start(|c| {
        c.store = StoreSpec::Redis(url);
        c.store_timeout = Duration::from_millis(50);
    })
    .await;
    redis.kill();
    let (text, f) = bench(
        &server,
        &[
            "--concurrency",
            "2",
            "--connections",
            "1",
            "--api",
            "batch",
            "--batch",
            "10",
        ],
    )
    .await;
    assert_eq!(f["errors"], 0, "{text}");
    assert!(f["calls"] > 0, "{text}");
    assert_eq!(f["decisions"], f["calls"] * 10, "{text}");
    assert_eq!(f["degraded"], f["decisions"], "{text}");
    assert_eq!(f["allowed"], f["decisions"], "failed open: {text}");
}

/// `empty-server --answer-after-us`: every single decision, on both APIs,
/// is answered (allowed) and only after the answering thread's wait: the
/// median call takes at least half the wait (calls that join a batch
/// already sleeping wait less than all of it), and, each batch taking the
/// whole wait and each worker having one call in a batch, four workers
/// cannot complete more calls than the waits allow in the time the run
/// took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_waiting_empty_server_answers_every_call_after_its_wait() {
    use std::io::BufRead;
    let wait_us: u64 = 20_000;
    let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate-bench"))
        .args(["empty-server", "--grpc-addr", "127.0.0.1:0"])
        .args(["--answer-after-us", &wait_us.to_string()])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stderr.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr: SocketAddr = line
        .trim()
        .rsplit_once("grpc=")
        .map(|(_, a)| a.parse().unwrap())
        .unwrap_or_else(|| panic!("no address in {line:?}"));
    let url = format!("http://{addr}");
    for api in ["native", "envoy"] {
        let started = Instant::now();
        let args = [
            "run",
            "--server",
            &url,
            "--duration",
            "1s",
            "--quiet",
            "--concurrency",
            "4",
            "--connections",
            "1",
            "--api",
            api,
        ];
        let out = Command::new(env!("CARGO_BIN_EXE_tollgate-bench"))
            .args(args)
            .output()
            .unwrap();
        let wall = started.elapsed().as_secs_f64();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{out:?}");
        let f = figures(&text);
        assert_eq!(f["errors"], 0, "{api}: {text}");
        assert!(f["calls"] > 0, "{api}: {text}");
        assert_eq!(f["allowed"], f["decisions"], "{api}: {text}");
        assert!(f["p50"] >= wait_us / 2, "{api}: calls wait: {text}");
        let most = 4 * ((wall * 1e6 / wait_us as f64).floor() as u64 + 1);
        assert!(
            f["calls"] <= most,
            "{api}: at most {most} calls in {wall:.2} s: {text}"
        );
    }
    let _ = child.kill();
    let _ = child.wait();
}
