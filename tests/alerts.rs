//! Quota alerts as users run them: thresholds set on a quota row, alerts
//! detected by any instance, delivered to a real webhook receiver (the
//! Python one in `examples/webhook/receiver.py`, a process the test starts)
//! once per tenant, period and threshold, through a receiver that is down,
//! an instance killed before it delivered, and receivers that hang or fail.

use crate::common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::ports::free_port;
use common::process::{ServeProcess, fails, succeeds as run};
use common::redis::RedisServer;
use common::{TestServer, ask, req};
use tollgate::limits::LimitRow;
use tollgate::limits::table::LimitsTable;
use tollgate::server::StoreSpec;

const SECRET: &str = "s3cret-for-tests";

/// The example receiver, started on `port`, printing alerts to `out`.
struct Receiver {
    child: Child,
    out: std::path::PathBuf,
}

impl Receiver {
    fn start(port: u16, dir: &Path) -> Self {
        let out = dir.join(format!("received-{port}.jsonl"));
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/webhook/receiver.py");
        let child = Command::new("python3")
            .arg(script)
            .arg(port.to_string())
            .env("TOLLGATE_ALERT_SECRET", SECRET)
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3 runs the example receiver");
        // Dropped (killed and waited for) however this ends.
        let receiver = Self { child, out };
        for _ in 0..500 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return receiver;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("the receiver never listened on {port}");
    }

    /// Every alert received so far.
    fn received(&self) -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(&self.out).unwrap_or_default();
        text.lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// Waits (bounded: `within`, in steps of 100 ms) until `n` alerts
    /// were received.
    fn wait_for(&self, n: usize, within: Duration) -> Vec<serde_json::Value> {
        let steps = within.as_millis() / 100;
        for _ in 0..steps {
            let got = self.received();
            if got.len() >= n {
                return got;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        self.received()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A quota of 10 per month per tenant for every tenant (a default row),
/// alerting at 80 and 100 %.
fn monthly_alerting() -> LimitRow {
    LimitRow::from_request(
        String::new(),
        String::new(),
        "tenant",
        0,
        "10/month",
        "enforce",
        "allow",
        0,
        "quota",
        Some("monthly".into()),
    )
    .unwrap()
    .with_alerts("80,100".parse().unwrap())
}

fn metric_sum(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// 1 000 tenants cross 80 % and 100 % of their quota through three
/// instances while the receiver is down for the first 30 s: once it is up,
/// every one of the 2 000 alerts arrives, signed, exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_down_for_thirty_seconds_gets_every_alert_once() {
    common::own_process();
    #[allow(clippy::disallowed_methods)] // the receiver is down for real time
    let started = std::time::Instant::now();
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let shared = dir.path().join("limits.db").to_str().unwrap().to_owned();
    let table = LimitsTable::open(&shared).await.unwrap();
    table.upsert(&monthly_alerting()).await.unwrap();
    let port = free_port(false);
    let mut servers = Vec::new();
    for _ in 0..3 {
        let (shared, url) = (shared.clone(), redis.url());
        let server = TestServer::launch(None, move |c| {
            c.limits = shared;
            c.store = StoreSpec::Redis(url);
            c.alert_webhook = Some(format!("http://127.0.0.1:{port}/alerts").parse().unwrap());
            c.alert_secret = Some(SECRET.into());
            // Long enough that a loaded machine never cuts off a delivery
            // the receiver took (a try cut off is sent again, same id).
            c.alert_timeout = Duration::from_secs(20);
            c.alert_retry_max = Duration::from_secs(2);
        })
        .await;
        servers.push(server);
    }
    let mut clients = Vec::new();
    for s in &servers {
        clients.push(s.client().await);
    }
    for t in 0..1000 {
        let tenant = format!("t{t}");
        for (n, cost) in [8, 2].into_iter().enumerate() {
            let mut r = req(&tenant, "k");
            r.cost = cost;
            let client = &mut clients[(t + n) % 3];
            assert!(ask(client, r).await.allowed, "{tenant} spends {cost}");
        }
    }
    // Every alert is recorded while the receiver is down.
    let mut pending = 0;
    for _ in 0..300 {
        pending = table.alert_counts().await.unwrap().pending;
        if pending == 2000 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(pending, 2000);
    let down_for = Duration::from_secs(30).saturating_sub(started.elapsed());
    tokio::time::sleep(down_for).await;
    let failed_before_up = table.alerts(true, 10).await.unwrap();
    assert!(
        failed_before_up
            .iter()
            .all(|a| a.attempts >= 1 && a.last_error.contains("connecting to 127.0.0.1")),
        "{failed_before_up:?}"
    );
    let receiver = Receiver::start(port, dir.path());
    let got = tokio::task::spawn_blocking(move || {
        let got = receiver.wait_for(2000, Duration::from_secs(60));
        // A little longer: nothing more may come.
        std::thread::sleep(Duration::from_secs(3));
        (receiver.received(), got.len())
    })
    .await
    .unwrap();
    let (got, _) = got;
    assert_eq!(got.len(), 2000, "every alert once");
    assert!(got.iter().all(|a| a["repeat"] == false));
    let mut ids: Vec<&str> = got.iter().map(|a| a["id"].as_str().unwrap()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 2000);
    let t7: Vec<_> = got.iter().filter(|a| a["tenant"] == "t7").collect();
    let mut t7: Vec<(u64, u64)> = t7
        .iter()
        .map(|a| {
            (
                a["threshold"].as_u64().unwrap(),
                a["used"].as_u64().unwrap(),
            )
        })
        .collect();
    t7.sort_unstable();
    assert_eq!(t7, [(80, 8), (100, 10)]);
    let sample = got.iter().find(|a| a["tenant"] == "t7").unwrap();
    assert_eq!(sample["rule"], "monthly");
    assert_eq!(sample["limit"], 10);
    assert_eq!(sample["scope"], "tenant");
    assert!(
        sample["period_start"]
            .as_str()
            .unwrap()
            .ends_with("T00:00:00Z")
    );
    let counts = table.alert_counts().await.unwrap();
    assert_eq!((counts.pending, counts.delivered), (0, 2000));
    let metrics = tollgate::telemetry::metrics::handle().render();
    assert_eq!(
        metric_sum(
            &metrics,
            "tollgate_quota_alerts_total{",
            "result=\"detected\""
        ),
        2000.0
    );
    assert_eq!(
        metric_sum(
            &metrics,
            "tollgate_quota_alerts_total{",
            "result=\"delivered\""
        ),
        2000.0
    );
    assert!(
        metric_sum(
            &metrics,
            "tollgate_quota_alerts_total{",
            "result=\"failed\""
        ) >= 2000.0
    );
    for s in servers {
        s.stop().await;
    }
}

/// An instance records alerts and is killed (SIGKILL) before it delivers
/// any: another instance on the same database delivers them, once each.
#[test]
fn alerts_of_an_instance_killed_before_delivering_are_delivered_by_another() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let url = redis.url();
    let first = ServeProcess::start(d, &["--store", &url]);
    first.wait_ready();
    run(
        d,
        &[
            "limits", "set", "--quota", "10/month", "--scope", "tenant", "--alert", "50,100",
            "--name", "monthly",
        ],
    );
    let grpc = format!("http://{}", first.grpc);
    // The row reaches the server within its reload interval.
    std::thread::sleep(Duration::from_secs(1));
    for t in 0..3 {
        let tenant = format!("t{t}");
        for cost in ["5", "5"] {
            let out = run(
                d,
                &[
                    "check", "--server", &grpc, "--tenant", &tenant, "--key", "k", "--cost", cost,
                ],
            );
            assert!(out.starts_with("ALLOWED"), "{out}");
        }
    }
    let listed = (0..100)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(100));
            run(d, &["alerts", "list"])
        })
        .find(|out| out.starts_with("6 pending"))
        .expect("the six alerts are recorded");
    assert!(listed.contains("t1") && listed.contains("100%"), "{listed}");
    let mut first = first;
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    let port = free_port(false);
    let receiver = Receiver::start(port, d);
    let hook = format!("http://127.0.0.1:{port}/alerts");
    let second = ServeProcess::start_with_env(
        d,
        &["--store", &url, "--alert-webhook", &hook],
        &[("TOLLGATE_ALERT_SECRET", SECRET)],
    );
    second.wait_ready();
    let got = receiver.wait_for(6, Duration::from_secs(30));
    std::thread::sleep(Duration::from_secs(2));
    let got_all = receiver.received();
    assert_eq!(got.len(), 6);
    assert_eq!(got_all.len(), 6, "no repeat");
    let mut seen: Vec<(String, u64)> = got_all
        .iter()
        .map(|a| {
            (
                a["tenant"].as_str().unwrap().to_owned(),
                a["threshold"].as_u64().unwrap(),
            )
        })
        .collect();
    seen.sort();
    let want: Vec<(String, u64)> = (0..3)
        .flat_map(|t| [(format!("t{t}"), 100), (format!("t{t}"), 50)])
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(seen, want);
    assert!(run(d, &["alerts", "list"]).starts_with("0 pending, 6 delivered"));
}

/// A server that accepts connections and never answers, or answers 500:
/// each try ends at the timeout or the answer, the alert stays in the
/// outbox with its last error (listed by `tollgate alerts list` and
/// `/v1/alerts`), and tries come no faster than the backoff allows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_that_hangs_or_fails_keeps_its_alerts_and_retries_at_a_bounded_pace() {
    common::own_process();
    let hang = TcpListener::bind("127.0.0.1:0").unwrap();
    let hang_port = hang.local_addr().unwrap().port();
    // Accepts, reads, never answers (until the test ends).
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in hang.incoming().flatten() {
            held.push(stream);
        }
    });
    let failing = TcpListener::bind("127.0.0.1:0").unwrap();
    let failing_port = failing.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut stream in failing.incoming().flatten() {
            let mut buf = [0u8; 4096];
            let _ = stream.read(&mut buf);
            let _ = stream.write_all(
                b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
            );
        }
    });
    for (port, says) in [
        (hang_port, "no answer within 300ms (--alert-timeout)"),
        (
            failing_port,
            "the webhook answered 500 Internal Server Error",
        ),
    ] {
        let server = TestServer::launch(Some(&[monthly_alerting()]), move |c| {
            c.alert_webhook = Some(format!("http://127.0.0.1:{port}/").parse().unwrap());
            c.alert_timeout = Duration::from_millis(300);
            c.alert_retry_max = Duration::from_secs(1);
        })
        .await;
        let mut client = server.client().await;
        let mut r = req("acme", "k");
        r.cost = 10;
        assert!(ask(&mut client, r).await.allowed);
        #[allow(clippy::disallowed_methods)]
        let began = std::time::Instant::now();
        let mut alerts = serde_json::Value::Null;
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let (_, body) = server.http_get("/v1/alerts?pending=true").await.unwrap();
            alerts = serde_json::from_str(&body).unwrap();
            if alerts["alerts"][0]["attempts"].as_u64().unwrap_or(0) >= 3 {
                break;
            }
        }
        let elapsed = began.elapsed().as_secs_f64();
        assert_eq!(alerts["pending"], 2, "{alerts}");
        for a in alerts["alerts"].as_array().unwrap() {
            assert_eq!(a["last_error"], says, "{a}");
            assert!(a["delivered_at"].is_null());
            // Backoff: 1 s, then at most 1 s apart, less at most a fifth.
            let attempts = a["attempts"].as_u64().unwrap();
            assert!(
                attempts as f64 <= 2.0 + elapsed / 0.8,
                "{attempts} tries in {elapsed} s"
            );
        }
        let listed = run(
            server_dir(&server),
            &[
                "alerts",
                "list",
                "--pending",
                "--limits",
                &server.limits_path,
            ],
        );
        assert!(listed.starts_with("2 pending, 0 delivered"), "{listed}");
        assert!(listed.contains(says), "{listed}");
        server.stop().await;
    }
}

fn server_dir(server: &TestServer) -> &Path {
    Path::new(&server.limits_path).parent().unwrap()
}

/// Thresholds out of range, on a row that is not a quota, or unreadable,
/// are refused with what to fix, from the command line and the admin API.
#[tokio::test]
async fn bad_thresholds_are_refused_saying_what_to_fix() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    run(d, &["limits", "list", "--create"]);
    for (alert, says) in [
        ("0", "alert threshold 0 % is out of range"),
        ("1000", "alert threshold 1000 % is out of range"),
        ("80,ninety", "\"ninety\" is not a whole percentage"),
        (
            "1,2,3,4,5,6,7",
            "7 alert thresholds given; a quota has at most 6",
        ),
    ] {
        let err = fails(
            d,
            &["limits", "set", "--quota", "10/month", "--alert", alert],
        );
        assert!(err.contains(says), "{alert}: {err}");
    }
    let err = fails(
        d,
        &[
            "limits", "set", "--burst", "5", "--rate", "5/second", "--alert", "80",
        ],
    );
    assert!(
        err.contains("alert thresholds apply to quotas only"),
        "{err}"
    );
    let server = TestServer::launch(None, |c| {
        c.admin_access.token = Some("t0ken".into());
    })
    .await;
    let token = Some("t0ken");
    for (body, says) in [
        (
            r#"{"burst": 0, "rate": "10/month", "kind": "quota", "alerts": "1000"}"#,
            "1000 % is out of range",
        ),
        (
            r#"{"burst": 5, "rate": "5/second", "alerts": "80"}"#,
            "alert thresholds apply to quotas only",
        ),
    ] {
        let (status, text) = server.http("POST", "/v1/limits", token, body).await;
        assert_eq!(status, 400, "{text}");
        assert!(text.contains(says), "{text}");
    }
    let row =
        r#"{"burst": 0, "rate": "10/month", "kind": "quota", "alerts": "50,100", "name": "m"}"#;
    let (status, text) = server.http("POST", "/v1/limits", token, row).await;
    assert_eq!(status, 200, "{text}");
    let (_, listed) = server.http_get("/v1/limits").await.unwrap();
    assert!(listed.contains("\"alerts\":\"50,100\""), "{listed}");
    server.stop().await;
}
