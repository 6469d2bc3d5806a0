//! The admin port's status page, loaded in headless Chromium (Debian's
//! `chromium`): after its scripts ran, the page shows the store's health,
//! decisions by outcome, the most limited tenants, the tenants in debt,
//! the tenants holding the most concurrency slots, those nearest their
//! quota, the quota alerts and the limits in force.

use crate::common;

use std::process::Command;

use common::{TestServer, ask, req, row};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chromium_renders_rates_top_tenants_store_health_and_limits() {
    let mut llm = row("llm", "llm", "", "key", 10, "1/hour");
    llm.debt = 50;
    let server = TestServer::with_rows(&[
        row("per-key", "", "", "key", 2, "1/hour"),
        row("exports", "", "exports", "key", 1, "1/day"),
        llm,
        tollgate::limits::LimitRow::from_request(
            "batch".into(),
            String::new(),
            "tenant",
            4,
            "",
            "enforce",
            "allow",
            0,
            "concurrency",
            Some("batch-slots".into()),
        )
        .unwrap(),
        tollgate::limits::LimitRow::from_request(
            "saas".into(),
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
        .with_alerts("80,100".parse().unwrap()),
        row("saas-keys", "saas", "", "key", 100, "100/second"),
    ])
    .await;
    let mut client = server.client().await;
    // 8 of the saas tenant's 10 a month: the 80 % alert, recorded (no
    // webhook: it waits).
    let mut saas = req("saas", "k");
    saas.cost = 8;
    assert!(ask(&mut client, saas).await.allowed);
    for _ in 0..100 {
        let (_, alerts) = server.http_get("/v1/alerts").await.unwrap();
        if alerts.contains("\"pending\":1") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    for _ in 0..7 {
        ask(&mut client, req("scraper", "bot-1")).await;
    }
    ask(&mut client, req("calm", "k")).await;
    // Usage charged after the fact: 30 tokens on a bucket of 10.
    client
        .charge(tollgate::proto::v1::ChargeRequest {
            key: "carol".into(),
            cost: 30,
            tenant: "llm".into(),
            resource: String::new(),
        })
        .await
        .unwrap();

    // Three of the batch tenant's four slots held.
    for job in ["a", "b", "c"] {
        let granted = client
            .acquire(tollgate::proto::v1::AcquireRequest {
                key: job.into(),
                tenant: "batch".into(),
                resource: String::new(),
                ttl: Some(prost_types::Duration {
                    seconds: 600,
                    nanos: 0,
                }),
                cost: 0,
            })
            .await
            .unwrap()
            .into_inner()
            .granted;
        assert!(granted);
    }

    let page = render(&server).await;
    let section = |id: &str| page.section(id);
    let store = section("store");
    assert!(store.contains("healthy"), "{store}");
    assert!(store.contains("store memory"), "{store}");
    assert!(store.contains("ready yes"), "{store}");
    let rates = section("rates");
    assert!(rates.contains("outcome per second total"), "{rates}");
    // Each outcome's row: its name, the rate of the last seconds (which
    // depends on when the page sampled) and the exact total since start.
    let words: Vec<&str> = rates.split(' ').collect();
    let total = |outcome: &str| -> u64 {
        let at = words
            .iter()
            .position(|w| *w == outcome)
            .unwrap_or_else(|| panic!("no {outcome} row in {rates}"));
        assert!(words[at + 1].parse::<f64>().is_ok(), "{rates}");
        words[at + 2].parse().unwrap()
    };
    // Four decisions and three acquires (an acquire is a decision too).
    assert_eq!(total("allowed"), 7, "{rates}");
    assert_eq!(total("rejected"), 5, "{rates}");
    for outcome in [
        "error",
        "failed_closed",
        "failed_open",
        "local_fallback",
        "shadow_rejected",
    ] {
        assert_eq!(total(outcome), 0, "{rates}");
    }
    let top = section("top");
    assert!(top.contains("scraper 5 bot-1 (5)"), "{top}");
    assert!(!top.contains("calm"), "{top}");
    let debt = section("debt");
    assert!(
        debt.contains("tenant key tokens below zero seen llm carol 20"),
        "{debt}"
    );
    let holding = section("holding");
    assert!(
        holding.contains("tenant key slots held all expire within batch c 3 600 s"),
        "{holding}"
    );
    let quotas = section("quotas");
    assert!(
        quotas.contains("tenant quota used limit share period ends in saas monthly 8 10 80 %"),
        "{quotas}"
    );
    let alerts = section("alerts");
    assert!(
        alerts.contains("Quota alerts (1 waiting, 0 delivered)"),
        "{alerts}"
    );
    assert!(
        alerts.contains("saas (tenant-wide) monthly 80 % 8 10 waiting, 0 tries"),
        "{alerts}"
    );
    let limits = section("limits");
    assert!(limits.contains("Limits in force (6)"), "{limits}");
    assert!(
        limits.contains("per-key rate (default) (any) key 2 1/hour 0 enforce allow"),
        "{limits}"
    );
    assert!(
        limits.contains("exports rate (default) exports key 1 1/day 0 enforce allow"),
        "{limits}"
    );
    assert!(
        limits.contains("llm rate llm (any) key 10 1/hour 50 enforce allow"),
        "{limits}"
    );
    assert!(
        limits
            .contains("batch-slots concurrency batch (any) tenant 4 4 concurrent 0 enforce allow"),
        "{limits}"
    );
    server.stop().await;
}

/// The page as headless Chromium leaves it after its scripts ran.
struct Page(String);

async fn render(server: &TestServer) -> Page {
    render_at(server, "/").await
}

/// The page at `path` (a fragment may follow), as Chromium leaves it.
async fn render_at(server: &TestServer, path: &str) -> Page {
    let profile = tempfile::tempdir().unwrap();
    let url = format!("http://{}{path}", server.admin);
    let out = tokio::task::spawn_blocking(move || {
        Command::new("chromium")
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--virtual-time-budget=10000",
                "--window-size=1400,2400",
                "--dump-dom",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg(url)
            .output()
            .expect("chromium runs (scripts/test installs Debian's chromium)")
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Page(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl Page {
    /// The JSON in attribute `data-NAME` of the element with `id`.
    fn data(&self, id: &str, name: &str) -> serde_json::Value {
        let dom = &self.0;
        let start = dom
            .find(&format!("id=\"{id}\""))
            .unwrap_or_else(|| panic!("no #{id} in {dom}"));
        let tag = &dom[start..start + dom[start..].find('>').unwrap()];
        let at = tag
            .find(&format!("data-{name}=\""))
            .unwrap_or_else(|| panic!("#{id} has no data-{name}: {tag}"));
        let value = &tag[at + name.len() + 7..];
        let value = &value[..value.find('"').unwrap()];
        serde_json::from_str(&value.replace("&quot;", "\"").replace("&amp;", "&")).unwrap()
    }

    /// A section's text, tags dropped, whitespace collapsed.
    fn section(&self, id: &str) -> String {
        let dom = &self.0;
        let start = dom
            .find(&format!("<section id=\"{id}\""))
            .unwrap_or_else(|| panic!("no #{id} in {dom}"));
        let end = dom[start..].find("</section>").unwrap() + start;
        let mut text = String::new();
        let mut in_tag = false;
        for c in dom[start..end].chars() {
            match c {
                '<' => in_tag = true,
                '>' => {
                    in_tag = false;
                    text.push(' ');
                }
                c if !in_tag => text.push(c),
                _ => {}
            }
        }
        text.split_whitespace().collect::<Vec<_>>().join(" ")
    }
}

/// On a Redis Cluster with one master dead, the store section lists every
/// primary with its slots and breaker: the dead one open, the others
/// closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chromium_shows_each_redis_nodes_state() {
    let mut cluster = common::redis::RedisCluster::start_with(
        0,
        &[
            "--cluster-node-timeout",
            "1000",
            "--cluster-require-full-coverage",
            "no",
        ],
    );
    let tenant = cluster.tenant_on(2, "t");
    let url = cluster.url();
    let server = TestServer::launch(
        Some(&[row("r", &tenant, "", "key", 10, "1/second")]),
        move |c| {
            c.store = tollgate::server::StoreSpec::Redis(url);
        },
    )
    .await;
    let mut client = server.client().await;
    ask(&mut client, req(&tenant, "k")).await;
    let ranges = cluster.slot_ranges();
    let counts: Vec<usize> = (0..3)
        .map(|i| {
            let mine = &ranges.iter().find(|(n, _)| *n == i).unwrap().1;
            mine.iter().map(|(a, b)| usize::from(b - a + 1)).sum()
        })
        .collect();
    let dead = cluster.nodes[2].port;
    cluster.nodes[2].kill();
    let mut open = false;
    for _ in 0..200 {
        ask(&mut client, req(&tenant, "k")).await;
        let (_, body) = server.http_get("/v1/status").await.unwrap();
        if body.contains("\"open\"") {
            open = true;
            break;
        }
    }
    assert!(open, "the dead master's breaker opened");
    // Store calls were timed: the history holds their percentiles once the
    // sampler has taken a point (one a second).
    for _ in 0..100 {
        let (_, body) = server.http_get("/v1/history").await.unwrap();
        let h: serde_json::Value = serde_json::from_str(&body).unwrap();
        if h["store_p50_us"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v.is_u64())
        {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let page = render(&server).await;
    assert_eq!(
        page.data("chart-latency", "series"),
        serde_json::json!(["p50", "p90", "p99"])
    );
    let sums = page.data("chart-latency", "sums");
    for q in ["p50", "p90", "p99"] {
        assert!(sums[q].as_u64().unwrap() > 0, "{sums}");
    }
    // Equal percentiles draw over each other: p99, drawn last, shows.
    let painted = page.data("chart-latency", "painted");
    assert!(painted["#b3261e"].as_u64().unwrap() > 0, "{painted}");
    let store = page.section("store");
    assert!(store.contains("degraded"), "{store}");
    assert!(store.contains("store redis"), "{store}");
    assert!(store.contains("circuit breaker open"), "{store}");
    assert!(
        store.contains("node slots replicas circuit breaker connected errors"),
        "{store}"
    );
    for (i, node) in cluster.nodes.iter().enumerate() {
        // A live node is connected once a call went to it.
        let state = if node.port == dead {
            "open no"
        } else {
            "closed"
        };
        let row = format!("127.0.0.1:{} {} - {state}", node.port, counts[i]);
        assert!(store.contains(&row), "{row} in {store}");
    }
    server.stop().await;
}

/// The plots show the traffic the test made: the decisions chart's
/// series sum to exactly the decisions made, the tenants chart draws the
/// limited tenant with its exact rejections and not the calm one, and the
/// canvas holds pixels of each drawn series' colour; the latency chart
/// says the in-process store is not timed. A tenant's link opens its
/// explain view.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chromium_plots_the_last_hour_and_opens_a_tenants_explain_view() {
    let server = TestServer::launch(Some(&[row("per-key", "", "", "key", 2, "1/hour")]), |c| {
        c.admin_access.token = Some("pl0t-token".into());
    })
    .await;
    let mut client = server.client().await;
    for _ in 0..7 {
        ask(&mut client, req("scraper", "bot-1")).await;
    }
    ask(&mut client, req("calm", "k")).await;
    // The sampler takes a point a second: wait (bounded) until the
    // history holds every decision.
    let sums = |h: &serde_json::Value, column: &str| -> u64 {
        h[column]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .sum()
    };
    for _ in 0..100 {
        let (_, body) = server.http_get("/v1/history").await.unwrap();
        let h: serde_json::Value = serde_json::from_str(&body).unwrap();
        if sums(&h, "allowed") == 3 && sums(&h, "rejected") == 5 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let page = render_at(&server, "/#explain/scraper/bot-1?token=pl0t-token").await;

    let decisions = page.data("chart-decisions", "sums");
    assert_eq!(decisions["allowed"], 3, "{decisions}");
    assert_eq!(decisions["rejected"], 5, "{decisions}");
    assert_eq!(decisions["degraded"], 0, "{decisions}");
    let tenants = page.data("chart-tenants", "sums");
    assert_eq!(tenants, serde_json::json!({"scraper": 5}));
    for chart in ["chart-decisions", "chart-tenants"] {
        let colors = page.data(chart, "colors");
        let painted = page.data(chart, "painted");
        for colour in colors.as_array().unwrap() {
            let n = painted[colour.as_str().unwrap()].as_u64().unwrap();
            assert!(n > 20, "{chart}: {n} pixels of {colour} in {painted}");
        }
    }
    assert_eq!(page.data("chart-latency", "series"), serde_json::json!([]));
    assert!(
        page.section("plots")
            .contains("no store call timed in the last hour"),
        "{}",
        page.section("plots")
    );
    // The top table links each tenant and key to its explain view.
    assert!(page.0.contains("href=\"#explain/scraper/bot-1\""));
    let explain = page.section("explain");
    assert!(
        explain.contains("a request of cost 1: refused by per-key, retry in 3600.0 s"),
        "{explain}"
    );
    assert!(
        explain.contains("per-key default rate key (any) enforce 2, 1/hour - 0 tokens"),
        "{explain}"
    );
    assert!(explain.contains("rejected per-key 1"), "{explain}");
    server.stop().await;
}
