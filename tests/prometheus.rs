//! The dashboard and alerts against a real Prometheus: `promtool check
//! rules`, then Prometheus scrapes a running Tollgate under load (including
//! a Redis outage and rejected reloads) and every PromQL expression of
//! `deploy/grafana/tollgate.json` and `deploy/prometheus/alerts.yml` must
//! return data through the HTTP query API, and `promtool check metrics`
//! finds nothing to say about what Tollgate exposes.

use crate::common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::redis::{RedisServer, free_port};
use common::{TestServer, ask, req, row};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tollgate::server::StoreSpec;

const DEPLOY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy");

struct Prometheus(Child);

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn promtool_accepts_the_alert_rules() {
    let out = Command::new("promtool")
        .args(["check", "rules", &format!("{DEPLOY}/prometheus/alerts.yml")])
        .output()
        .expect("promtool runs (scripts/test installs Debian's prometheus)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("SUCCESS: 7 rules found"));
}

/// The alerts' unit tests (`deploy/prometheus/alerts_test.yml`): each alert
/// is quiet until its `for` has passed, then fires with its labels and
/// annotations, and clears when the condition does.
#[test]
fn promtool_unit_tests_of_the_alerts_pass() {
    let out = Command::new("promtool")
        .args(["test", "rules", "alerts_test.yml"])
        .current_dir(format!("{DEPLOY}/prometheus"))
        .output()
        .expect("promtool runs (scripts/test installs Debian's prometheus)");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("SUCCESS"));
}

/// Every expression: the dashboard's targets, and each alert's expression
/// without its threshold (the threshold only decides whether it fires).
fn expressions() -> Vec<String> {
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{DEPLOY}/grafana/tollgate.json")).unwrap(),
    )
    .unwrap();
    let mut exprs: Vec<String> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| {
            p["targets"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t["expr"].as_str().unwrap().to_owned())
        })
        .collect();
    let alerts = std::fs::read_to_string(format!("{DEPLOY}/prometheus/alerts.yml")).unwrap();
    for line in alerts.lines() {
        if let Some(expr) = line.trim().strip_prefix("expr: ") {
            let (lhs, _threshold) = expr.rsplit_once(" >").expect("alerts compare with >");
            exprs.push(lhs.trim_end_matches('=').trim().to_owned());
        }
    }
    exprs
}

/// Prometheus with `dir/prometheus.yml`, once it says it is ready. A port
/// taken between choosing and binding it makes Prometheus exit: then another
/// one is tried.
async fn start_prometheus(dir: &std::path::Path) -> (Prometheus, u16) {
    for _ in 0..5 {
        let port = free_port(false);
        let mut prometheus = Prometheus(
            Command::new("prometheus")
                .arg(format!(
                    "--config.file={}",
                    dir.join("prometheus.yml").display()
                ))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.join(format!("data-{port}")).display()
                ))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("prometheus runs (scripts/test installs Debian's prometheus)"),
        );
        for _ in 0..600 {
            if prometheus.0.try_wait().unwrap().is_some() {
                break;
            }
            if common::http_ok(port, "/-/ready").await {
                return (prometheus, port);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    panic!("prometheus did not become ready on five free ports");
}

async fn http_get(port: u16, path: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: p\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut r = String::new();
    s.read_to_string(&mut r).await.unwrap();
    r.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default()
}

fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

async fn query(port: u16, q: &str) -> serde_json::Value {
    let body = http_get(port, &format!("/api/v1/query?query={}", encode(q))).await;
    let body = body.trim();
    // Chunked transfer: the JSON is between the first and last line.
    let json = body
        .find('{')
        .map(|i| &body[i..body.rfind('}').unwrap() + 1])
        .unwrap_or("{}");
    serde_json::from_str(json).unwrap_or(serde_json::Value::Null)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_and_alert_expression_returns_data() {
    let mut redis = RedisServer::start();
    let envoy_dir = tempfile::tempdir().unwrap();
    std::fs::write(
        envoy_dir.path().join("edge.yaml"),
        "domain: edge\ndescriptors: []\n",
    )
    .unwrap();
    let envoy_path = envoy_dir.path().to_owned();
    let url = redis.url();
    let server = TestServer::launch(
        Some(&[
            row("per-key", "", "", "key", 5, "1/second"),
            tollgate::limits::LimitRow::from_request(
                "slots".into(),
                String::new(),
                "tenant",
                1,
                "",
                "enforce",
                "allow",
                0,
                "concurrency",
                Some("one-slot".into()),
            )
            .unwrap(),
        ]),
        move |c| {
            c.store = StoreSpec::Redis(url);
            c.envoy_config = Some(envoy_path);
            c.store_timeout = Duration::from_millis(100);
            c.breaker_threshold = 2;
            c.breaker_cooldown = Duration::from_millis(200);
        },
    )
    .await;

    // Prometheus scraping the admin port every second.
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nrule_files: [{DEPLOY}/prometheus/alerts.yml]\nscrape_configs:\n  - job_name: tollgate\n    static_configs: [{{targets: ['{}']}}]\n",
        server.admin
    );
    std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
    let (_prometheus, prom_port) = start_prometheus(dir.path()).await;

    // Load of every kind: allowed and rejected decisions, a Redis outage
    // (degraded decisions, store errors, an open breaker), rejected reloads.
    let mut client = server.client().await;
    for i in 0..50 {
        ask(&mut client, req(&format!("tenant-{}", i % 3), "k")).await;
    }
    // A lease held (and kept), then acquires refused by its full cap.
    let acquire = tollgate::proto::v1::AcquireRequest {
        key: "job".into(),
        tenant: "slots".into(),
        resource: String::new(),
        ttl: Some(prost_types::Duration {
            seconds: 3600,
            nanos: 0,
        }),
        cost: 0,
    };
    let held = client.acquire(acquire.clone()).await.unwrap().into_inner();
    assert!(held.granted);
    assert!(
        !client
            .acquire(acquire.clone())
            .await
            .unwrap()
            .into_inner()
            .granted
    );
    redis.kill();
    for i in 0..20 {
        ask(&mut client, req("outage", &format!("k{i}"))).await;
    }
    server
        .table
        .execute_sql("INSERT INTO limits (name, tenant, burst, rate) VALUES ('bad', 'x', 0, 1)")
        .await
        .unwrap();
    std::fs::write(
        envoy_dir.path().join("edge.yaml"),
        "domain: edge\nbogus: 1\n",
    )
    .unwrap();
    server.wait_rejected_row().await;

    // Keep the load going while Prometheus scrapes, until every expression
    // answers (bounded: about a minute).
    let exprs = expressions();
    assert!(exprs.len() >= 22, "{exprs:#?}");
    let mut missing = exprs.clone();
    // The outage lasts until Prometheus has seen it: the store-down and
    // degraded-decisions alerts both pending (their `for` is minutes, so
    // pending is as far as a test goes; alerts_test.yml covers firing).
    let mut outage_alerts_pending = false;
    for _ in 0..120 {
        if !outage_alerts_pending {
            let pending = query(prom_port, "ALERTS{alertstate=\"pending\"}").await;
            let names: Vec<&str> = pending["data"]["result"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|r| r["metric"]["alertname"].as_str())
                .collect();
            if names.contains(&"TollgateStoreDown") && names.contains(&"TollgateDegradedDecisions")
            {
                outage_alerts_pending = true;
                redis.restart();
            }
        }
        for i in 0..20 {
            ask(&mut client, req(&format!("tenant-{}", i % 4), "hot")).await;
        }
        client.acquire(acquire.clone()).await.unwrap();
        let mut still = Vec::new();
        for e in &missing {
            let v = query(prom_port, e).await;
            let empty = v["data"]["result"].as_array().is_none_or(|r| r.is_empty());
            if v["status"] != "success" || empty {
                still.push(e.clone());
            }
        }
        missing = still;
        if missing.is_empty() && outage_alerts_pending {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        outage_alerts_pending,
        "the Redis outage never made TollgateStoreDown and TollgateDegradedDecisions pending"
    );
    assert!(missing.is_empty(), "expressions without data: {missing:#?}");

    // After all that, every series Tollgate exposes passes promtool's lint:
    // help text, units and suffixes as Prometheus names them.
    let (_, metrics) = server.http_get("/metrics").await.unwrap();
    common::assert_promtool_accepts(&metrics);
    server.stop().await;
}
