//! Token budgets for LLM traffic through a stock Envoy: a real Envoy with
//! `deploy/envoy/llm/envoy.yaml` in front of a fake LLM upstream that
//! reports each response's usage in `x-usage-tokens`, three Tollgate
//! instances behind it sharing one real Redis. The request phase asks
//! without spending; the stream-done phase charges the reported usage.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue};
use common::TestServer;
use common::envoy_proxy::{Envoy, HttpResponse, get};
use common::redis::RedisServer;
use parking_lot::Mutex;
use tollgate::server::StoreSpec;

/// The rules of this test: `user` is slow to refill (1 000 tokens a day:
/// one every 86.4 s), so what the store holds can be read back exactly;
/// `user=tiny` refills 10 a second, to watch a debt being paid off.
const RULES: &str = "\
domain: llm
refunds: true
descriptors:
  - key: user
    rate_limit: {algorithm: token_bucket, unit: day, requests_per_unit: 1000, burst: 5000, debt: 50000}
  - key: user
    value: tiny
    rate_limit: {algorithm: token_bucket, unit: second, requests_per_unit: 10, burst: 10, debt: 100}
";

/// Microseconds per token of the `user` rule.
const SLOW_INTERVAL: u64 = 86_400_000;
const SLOW_BURST: u64 = 5000;

/// A request header's value, empty when missing.
fn header_text(headers: &HeaderMap, name: &str) -> String {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// The fake LLM: answers with the usage the request asks for
/// (`x-want-tokens`) in `x-usage-tokens`, and records what it reported.
async fn llm_upstream() -> (u16, Arc<Mutex<Vec<(String, u64)>>>) {
    let reported: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
    let seen = reported.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let app = axum::Router::new().fallback(move |headers: HeaderMap| {
        let seen = seen.clone();
        async move {
            let text = |name: &str| header_text(&headers, name);
            let tokens: u64 = text("x-want-tokens").parse().unwrap_or(1);
            seen.lock().push((text("x-user"), tokens));
            let mut out = HeaderMap::new();
            out.insert("x-usage-tokens", HeaderValue::from(tokens));
            (out, "a completion")
        }
    });
    tokio::spawn(async move { axum::serve(listener, app).await });
    (port, reported)
}

/// Tokens charged after the fact by the three instances. (They run in this
/// test's process, which has one metrics registry: any instance's
/// `/metrics` counts all three.)
async fn charged(servers: &[TestServer]) -> u64 {
    let (_, metrics) = servers[0].http_get("/metrics").await.unwrap();
    common::envoy::sample(
        &metrics,
        "tollgate_charged_tokens_total{api=\"envoy\",phase=\"charge\"}",
    )
    .unwrap_or(0)
}

/// Waits until the instances have recorded `want` charged tokens (Envoy
/// sends the charge after the response, so it may land a moment later).
async fn charges_landed(servers: &[TestServer], want: u64) {
    for _ in 0..400 {
        if charged(servers).await == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "the instances recorded {} charged tokens, not {want}",
        charged(servers).await
    );
}

/// Redis's clock, in µs.
fn redis_now(conn: &mut redis::Connection) -> u64 {
    let (s, us): (u64, u64) = redis::cmd("TIME").query(conn).unwrap();
    s * 1_000_000 + us
}

/// The instant a user's bucket is full again, from its Redis key.
fn full_at(conn: &mut redis::Connection, user: &str) -> u64 {
    let value: String = redis::cmd("GET")
        .arg(format!("tollgate:{{~llm}}:e:token_bucket:user_{user}"))
        .query(conn)
        .unwrap();
    value.split(':').next().unwrap().parse().unwrap()
}

async fn ask(port: u16, user: &str, tokens: u64) -> HttpResponse {
    get(
        port,
        "/v1/chat/completions",
        &[("x-user", user), ("x-want-tokens", &tokens.to_string())],
    )
    .await
}

/// A real Envoy running `deploy/envoy/llm/FILE` with its ports replaced:
/// the Tollgate endpoint by every one of `servers`.
async fn envoy_before(servers: &[TestServer], file: &str, upstream_port: u16) -> Envoy {
    let deploy = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/envoy/llm");
    let endpoints: String = servers
        .iter()
        .map(|s| {
            format!(
                "\n              - endpoint:\n                  address:\n                    \
                 socket_address: {{ address: 127.0.0.1, port_value: {} }}",
                s.grpc.port()
            )
        })
        .collect();
    let template = std::fs::read_to_string(format!("{deploy}/{file}")).unwrap();
    let one_endpoint = "\n              - endpoint:\n                  address:\n                    \
                        socket_address: { address: 127.0.0.1, port_value: 50051 }";
    assert!(
        template.contains(one_endpoint),
        "the Tollgate endpoint moved"
    );
    Envoy::start(1, |listeners, admin| {
        template
            .replace(one_endpoint, &endpoints)
            .replace(
                "port_value: 10000",
                &format!("port_value: {}", listeners[0]),
            )
            .replace("port_value: 8080", &format!("port_value: {upstream_port}"))
            .replace("port_value: 9901", &format!("port_value: {admin}"))
            // A loaded machine must not let a decision time out into
            // failure_mode_deny: false (admitted, never charged).
            .replace("timeout: 0.25s", "timeout: 10s")
    })
    .await
}

/// `n` instances on `redis`, loading [`RULES`].
async fn instances(redis: &RedisServer, n: usize) -> (Vec<TestServer>, tempfile::TempDir) {
    let rules = tempfile::tempdir().unwrap();
    std::fs::write(rules.path().join("llm.yaml"), RULES).unwrap();
    let mut servers = Vec::new();
    for _ in 0..n {
        let (url, dir) = (redis.url(), rules.path().to_owned());
        servers.push(
            TestServer::launch(None, move |c| {
                c.store = StoreSpec::Redis(url);
                c.envoy_config = Some(dir);
                // Every charge must reach Redis: a stall of a loaded machine
                // must not leave one to a policy.
                c.store_timeout = Duration::from_secs(2);
            })
            .await,
        );
    }
    (servers, rules)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_charges_reported_usage_exactly_across_three_instances() {
    let deploy = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/envoy/llm");
    // The documented rules load, with their debt.
    let documented = std::fs::read_to_string(format!("{deploy}/ratelimit/llm.yaml")).unwrap();
    let loaded =
        tollgate::api::envoy::config::EnvoyConfig::load(&[("llm.yaml".into(), documented)])
            .unwrap();
    assert_eq!(loaded.rules(), 2);

    let redis = RedisServer::start();
    let (servers, _rules) = instances(&redis, 3).await;
    let (upstream_port, reported) = llm_upstream().await;
    let envoy = envoy_before(&servers, "envoy.yaml", upstream_port).await;
    let port = envoy.listeners[0];
    let mut conn = redis::Client::open(redis.url().as_str())
        .unwrap()
        .get_connection()
        .unwrap();

    // Carol works until her budget runs out: each request is admitted
    // while her bucket holds a token, and each response's usage is charged
    // in full when its stream ends, even past zero.
    let usage = [250, 731, 1200, 64, 999, 480, 1500, 333, 87, 2048, 640, 17];
    let (mut served, mut refused) = (0u64, None);
    for &tokens in &usage {
        let before = redis_now(&mut conn);
        let r = ask(port, "carol", tokens).await;
        let after = redis_now(&mut conn);
        if r.status == 200 {
            assert_eq!(r.body, "a completion");
            served += tokens;
            charges_landed(&servers, served).await;
            continue;
        }
        assert_eq!(r.status, 429, "{:?}", r.headers);
        refused = Some((r, before, after));
        break;
    }
    // She went over her burst of 5 000 with the request that was admitted
    // last (1 500 tokens, taking her from 3 724 to 5 224), into debt.
    assert_eq!(served, 250 + 731 + 1200 + 64 + 999 + 480 + 1500);
    let (r, before, after) = refused.expect("carol is refused once her budget is spent");
    // Every token the upstream reported is recorded in Redis, exactly: the
    // bucket is full again `served` tokens' refill after the first charge
    // (less than one token's refill has passed since).
    let full = full_at(&mut conn, "carol");
    let now = redis_now(&mut conn);
    assert_eq!((full - now).div_ceil(SLOW_INTERVAL), served);
    let upstream_total: u64 = reported
        .lock()
        .iter()
        .filter(|(u, _)| u == "carol")
        .map(|(_, t)| t)
        .sum();
    assert_eq!(
        upstream_total, served,
        "the refused request never reached the upstream"
    );
    // The 429's Retry-After is when her balance is back to one token: the
    // debt plus one token's refill, rounded up to whole seconds, as of the
    // instant Tollgate decided (between `before` and `after`).
    let wait_from =
        |t: u64| (full - t - SLOW_BURST * SLOW_INTERVAL + SLOW_INTERVAL).div_ceil(1_000_000);
    let retry: u64 = r
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .unwrap();
    assert!(
        (wait_from(after)..=wait_from(before)).contains(&retry),
        "Retry-After {retry} s, not within {}..={}",
        wait_from(after),
        wait_from(before)
    );
    let state = r.header("ratelimit").unwrap_or_default();
    assert!(state.starts_with("\"llm.user\";r=0;t="), "{state}");
    assert_eq!(r.header("x-envoy-ratelimited"), Some("true"));

    // Every instance took part: Envoy spread the calls round robin (its
    // admin port counts the requests each endpoint served).
    let clusters = common::envoy_proxy::get(envoy.admin, "/clusters", &[])
        .await
        .body;
    for s in &servers {
        let served = format!("tollgate::127.0.0.1:{}::rq_total::", s.grpc.port());
        let calls: u64 = clusters
            .lines()
            .find_map(|l| l.strip_prefix(&served))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0);
        assert!(
            calls >= 3,
            "instance {} served {calls} calls:\n{clusters}",
            s.grpc.port()
        );
    }

    // A user in debt recovers once the refill covers it: 25 tokens on a
    // bucket of 10 leave a debt of 15; one token more (16 at 10 a second)
    // is 1.6 s after the charge. Retry-After is that wait as of the instant
    // Tollgate decided (between `before` and `after` on Redis's clock),
    // rounded up to whole seconds: exactly, not "1 or 2".
    assert_eq!(ask(port, "tiny", 25).await.status, 200);
    charges_landed(&servers, served + 25).await;
    let before = redis_now(&mut conn);
    let r = ask(port, "tiny", 1).await;
    let after = redis_now(&mut conn);
    assert_eq!(r.status, 429);
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    const TINY_INTERVAL: u64 = 100_000;
    const TINY_BURST: u64 = 10;
    let value: String = redis::cmd("GET")
        .arg("tollgate:{~llm}:e:token_bucket:user_tiny")
        .query(&mut conn)
        .unwrap();
    let full: u64 = value.split(':').next().unwrap().parse().unwrap();
    let wait_from =
        |t: u64| (full - t - TINY_BURST * TINY_INTERVAL + TINY_INTERVAL).div_ceil(1_000_000);
    assert!(
        (wait_from(after)..=wait_from(before)).contains(&retry),
        "Retry-After {retry} s, not within {}..={}",
        wait_from(after),
        wait_from(before)
    );
    tokio::time::sleep(Duration::from_secs(retry)).await;
    let r = ask(port, "tiny", 3).await;
    assert_eq!(r.status, 200, "the debt is paid off after Retry-After");
    charges_landed(&servers, served + 25 + 3).await;
    drop(envoy);
}

/// An upstream that streams its answer (chunked) and reports the usage in
/// a trailer, as streamed LLM responses do: `x-want-tokens` says how much.
async fn streaming_upstream() -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let mut head = String::new();
                while !head.contains("\r\n\r\n") {
                    let Ok(n) = socket.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    head.push_str(&String::from_utf8_lossy(&buf[..n]));
                }
                let tokens = head
                    .lines()
                    .find_map(|l| {
                        let (k, v) = l.split_once(':')?;
                        k.eq_ignore_ascii_case("x-want-tokens")
                            .then(|| v.trim().to_owned())
                    })
                    .unwrap_or_else(|| "1".into());
                let answer = format!(
                    "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: x-usage-tokens\r\n\r\n\
                     6\r\nstream\r\n0\r\nx-usage-tokens: {tokens}\r\n\r\n"
                );
                let _ = socket.write_all(answer.as_bytes()).await;
                let _ = socket.shutdown().await;
            });
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_charges_usage_reported_in_a_trailer() {
    let redis = RedisServer::start();
    let (servers, _rules) = instances(&redis, 1).await;
    let envoy = envoy_before(&servers, "envoy.yaml", streaming_upstream().await).await;
    let mut total = 0;
    for tokens in [321, 45, 1000] {
        let r = ask(envoy.listeners[0], "frank", tokens).await;
        assert_eq!(r.status, 200);
        total += tokens;
        charges_landed(&servers, total).await;
    }
    let mut conn = redis::Client::open(redis.url().as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    let full = full_at(&mut conn, "frank");
    assert_eq!((full - redis_now(&mut conn)).div_ceil(SLOW_INTERVAL), total);
}

/// The fake LLM of the reserving deployment: answers with the usage the
/// request asks for (`x-want-tokens`) in `x-usage-tokens`; `x-fail` makes
/// it answer 502 with no usage. Requests of user `dave` are held until
/// `release` is notified (`held` counts them), so that they are all in
/// flight together.
struct Reserving {
    port: u16,
    held: Arc<std::sync::atomic::AtomicUsize>,
    release: Arc<tokio::sync::Semaphore>,
}

async fn reserving_upstream() -> Reserving {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let held = Arc::new(AtomicUsize::new(0));
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let (h, r) = (held.clone(), release.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let app = axum::Router::new().fallback(move |headers: HeaderMap| {
        let (held, release) = (h.clone(), r.clone());
        async move {
            let text = |name: &str| header_text(&headers, name);
            if text("x-user") == "dave" {
                held.fetch_add(1, Ordering::SeqCst);
                release.acquire().await.unwrap().forget();
            }
            let mut out = HeaderMap::new();
            if !text("x-fail").is_empty() {
                return (axum::http::StatusCode::BAD_GATEWAY, out, "upstream failed");
            }
            let tokens: u64 = text("x-want-tokens").parse().unwrap_or(1);
            out.insert("x-usage-tokens", HeaderValue::from(tokens));
            (axum::http::StatusCode::OK, out, "a completion")
        }
    });
    tokio::spawn(async move { axum::serve(listener, app).await });
    Reserving {
        port,
        held,
        release,
    }
}

/// A request through Envoy estimating `estimate` tokens and using `used`.
async fn reserve(port: u16, user: &str, estimate: u64, used: u64, fail: bool) -> HttpResponse {
    let (estimate, used) = (estimate.to_string(), used.to_string());
    let mut headers = vec![
        ("x-user", user),
        ("x-max-tokens", estimate.as_str()),
        ("x-want-tokens", used.as_str()),
    ];
    if fail {
        headers.push(("x-fail", "1"));
    }
    get(port, "/v1/chat/completions", &headers).await
}

/// Waits until the instances have given back `refunded` tokens and charged
/// `charged` after the fact, in all.
async fn settled(servers: &[TestServer], refunded: u64, charged: u64) {
    let totals = || async {
        let (_, metrics) = servers[0].http_get("/metrics").await.unwrap();
        let count = |series: &str| common::envoy::sample(&metrics, series).unwrap_or(0);
        (
            count("tollgate_refunded_tokens_total{api=\"envoy\"}"),
            count("tollgate_charged_tokens_total{api=\"envoy\",phase=\"charge\"}"),
        )
    };
    for _ in 0..1000 {
        if totals().await == (refunded, charged) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "refunded and charged {:?}, not {:?}",
        totals().await,
        (refunded, charged)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_reserves_estimates_and_settles_reported_usage_exactly() {
    let redis = RedisServer::start();
    let (servers, _rules) = instances(&redis, 3).await;
    let upstream = reserving_upstream().await;
    let envoy = envoy_before(&servers, "reserve.yaml", upstream.port).await;
    let port = envoy.listeners[0];
    let mut conn = redis::Client::open(redis.url().as_str())
        .unwrap()
        .get_connection()
        .unwrap();

    // One request at a time: each spends its estimate, and its stream's
    // end gives back the estimate and charges the usage; Tollgate applies
    // the difference. Usage below and above the estimate.
    let (mut refunded, mut charged, mut used_total) = (0, 0, 0);
    for (estimate, used) in [(1000, 250), (800, 731), (2000, 1200), (500, 900), (64, 64)] {
        let r = reserve(port, "erin", estimate, used, false).await;
        assert_eq!(r.status, 200, "{:?}", r.headers);
        refunded += estimate.saturating_sub(used);
        charged += used.saturating_sub(estimate);
        used_total += used;
        settled(&servers, refunded, charged).await;
    }
    // An upstream that fails reports no usage: the estimate comes back.
    let r = reserve(port, "erin", 700, 0, true).await;
    assert_eq!(r.status, 502);
    refunded += 700;
    settled(&servers, refunded, charged).await;
    // Tokens recorded in Redis equal the tokens reported, exactly.
    let full = full_at(&mut conn, "erin");
    assert_eq!(
        (full - redis_now(&mut conn)).div_ceil(SLOW_INTERVAL),
        used_total
    );
    // A request without an estimate is charged the default (1024), and a
    // client's own x-tollgate-admitted header changes nothing.
    let r = get(
        port,
        "/v1/chat/completions",
        &[
            ("x-user", "erin"),
            ("x-want-tokens", "10"),
            ("x-tollgate-admitted", "1"),
        ],
    )
    .await;
    assert_eq!(r.status, 200);
    refunded += 1024 - 10;
    settled(&servers, refunded, charged).await;
    used_total += 10;

    // Fifty concurrent requests of 400 tokens each (20 000 together) on a
    // bucket of 5 000: the estimates admit 12 while all are in flight, and
    // the other 38 are refused, and give nothing back.
    let calls: Vec<_> = (0..50)
        .map(|_| tokio::spawn(async move { reserve(port, "dave", 400, 100, false).await }))
        .collect();
    let mut answers = Vec::new();
    let mut pending = calls;
    for _ in 0..3000 {
        let (done, running): (Vec<_>, Vec<_>) = pending.into_iter().partition(|c| c.is_finished());
        pending = running;
        for call in done {
            answers.push(call.await.unwrap().status);
        }
        let held = upstream.held.load(std::sync::atomic::Ordering::SeqCst);
        if answers.len() + held == 50 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        upstream.held.load(std::sync::atomic::Ordering::SeqCst),
        12,
        "admitted while in flight"
    );
    assert_eq!(answers, vec![429; 38]);
    upstream.release.add_permits(12);
    for call in pending {
        assert_eq!(call.await.unwrap().status, 200);
    }
    refunded += 12 * 300;
    settled(&servers, refunded, charged).await;
    let full = full_at(&mut conn, "dave");
    assert_eq!(
        (full - redis_now(&mut conn)).div_ceil(SLOW_INTERVAL),
        12 * 100
    );
    let full = full_at(&mut conn, "erin");
    assert_eq!(
        (full - redis_now(&mut conn)).div_ceil(SLOW_INTERVAL),
        used_total
    );
    drop(envoy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_reserves_and_settles_usage_reported_in_a_trailer() {
    let redis = RedisServer::start();
    let (servers, _rules) = instances(&redis, 1).await;
    let envoy = envoy_before(&servers, "reserve.yaml", streaming_upstream().await).await;
    // Usage below, then above, the estimate; each reported in a trailer.
    let (mut refunded, mut charged, mut used_total) = (0, 0, 0);
    for (estimate, used) in [(500, 321), (100, 145)] {
        let r = reserve(envoy.listeners[0], "gina", estimate, used, false).await;
        assert_eq!(r.status, 200);
        refunded += estimate.saturating_sub(used);
        charged += used.saturating_sub(estimate);
        used_total += used;
        settled(&servers, refunded, charged).await;
    }
    let mut conn = redis::Client::open(redis.url().as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    let full = full_at(&mut conn, "gina");
    assert_eq!(
        (full - redis_now(&mut conn)).div_ceil(SLOW_INTERVAL),
        used_total
    );
}
