//! `tollgate bench`, the load tool, against real servers: its counts must
//! be exact, since every figure in BENCHMARKS.md comes from them.

mod common;

use std::collections::HashMap;
use tokio::time::Instant;

use common::process::{ServeProcess, stdout, tollgate};
use common::redis::RedisServer;

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

/// Runs `tollgate bench` for one second against `server` with `args` added;
/// returns its output and the figures of its summary.
fn bench(
    dir: &std::path::Path,
    server: &ServeProcess,
    args: &[&str],
) -> (String, HashMap<String, u64>) {
    let url = format!("http://{}", server.grpc);
    let mut all = vec!["bench", "--server", &url, "--duration", "1s", "--quiet"];
    all.extend_from_slice(args);
    let out = tollgate(dir, &all);
    assert!(out.status.success(), "{out:?}");
    let text = stdout(&out);
    let f = figures(&text);
    (text, f)
}

/// One key hammered by four workers for a second: the server's seeded
/// default (burst 30, 600/minute) admits 30 plus 10 per second, and the
/// tool reports exactly the calls, decisions and admissions it saw.
#[test]
fn counts_what_the_server_decided() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(dir.path(), &[]);
    server.wait_ready();
    let pid = server.child.id().to_string();
    let started = Instant::now();
    let (text, f) = bench(
        dir.path(),
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
    );
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
#[test]
fn counts_degraded_answers() {
    let dir = tempfile::tempdir().unwrap();
    let mut redis = RedisServer::start();
    let server = ServeProcess::start(
        dir.path(),
        &["--store", &redis.url(), "--store-timeout", "50ms"],
    );
    server.wait_ready();
    redis.kill();
    let (text, f) = bench(
        dir.path(),
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
    );
    assert_eq!(f["errors"], 0, "{text}");
    assert!(f["calls"] > 0, "{text}");
    assert_eq!(f["decisions"], f["calls"] * 10, "{text}");
    assert_eq!(f["degraded"], f["decisions"], "{text}");
    assert_eq!(f["allowed"], f["decisions"], "failed open: {text}");
}
