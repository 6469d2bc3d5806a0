//! Quotas as users run them: `tollgate limits set --quota`, and three
//! instances sharing one quota on Redis and on a Redis Cluster across a
//! period boundary, with clocks injected per instance.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::process::{ServeProcess, fails, succeeds as run};
use common::redis::{RedisCluster, RedisServer};
use common::{TestServer, ask, micros, req};
use tollgate::algorithm::calendar::Cycle;
use tollgate::limits::LimitRow;
use tollgate::server::StoreSpec;

/// Midnight UTC, 2023-11-15: the end of the day T0 falls in.
const MIDNIGHT: u64 = 1_700_006_400_000_000;

/// A user sets a daily quota on a plan and spends it: the fourth call of a
/// quota of three is refused until the next UTC midnight.
#[test]
fn a_plan_quota_set_from_the_command_line_is_enforced() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let server = ServeProcess::start(d, &["--reload-interval", "100ms"]);
    server.wait_ready();
    let url = format!("http://{}", server.grpc);
    run(d, &["plans", "create", "pro"]);
    assert_eq!(
        run(d, &["limits", "set", "--plan", "pro", "--quota", "3/day"]),
        "set plan-pro-any-key-quota (quota 3/day)\n"
    );
    run(d, &["plans", "assign", "--tenant", "acme", "--plan", "pro"]);
    let check = |key: &str| {
        run(
            d,
            &["check", "--server", &url, "--tenant", "acme", "--key", key],
        )
    };
    // Applied within the reload interval: wait for the quota to decide.
    let mut first = String::new();
    for _ in 0..400 {
        first = check("alice");
        if first.contains("plan-pro-any-key-quota") {
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    assert!(first.starts_with("ALLOWED"), "{first}");
    assert!(first.contains("remaining 2/3"), "{first}");
    assert!(check("alice").contains("remaining 1/3"));
    assert!(check("alice").contains("remaining 0/3"));
    // Per key: bob has a quota of his own.
    assert!(check("bob").contains("remaining 2/3"));
    #[allow(clippy::disallowed_methods)] // the server runs on the wall clock
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let refused = check("alice");
    #[allow(clippy::disallowed_methods)]
    let after = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(refused.starts_with("REJECTED"), "{refused}");
    // retry_after is the time to the next UTC midnight, as the server saw
    // it between `before` and `after`.
    let retry: f64 = refused
        .split("retry_after ")
        .nth(1)
        .and_then(|r| r.split('s').next())
        .and_then(|r| r.parse().ok())
        .unwrap();
    // `tollgate usage` reads the same figures, spending nothing.
    let usage = run(
        d,
        &[
            "usage", "--server", &url, "--tenant", "acme", "--key", "alice",
        ],
    );
    let lines: Vec<Vec<&str>> = usage
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        lines[0],
        [
            "QUOTA",
            "PERIOD",
            "FROM",
            "TO",
            "USED",
            "LIMIT",
            "REMAINING",
            "PREVIOUS"
        ],
        "{usage}"
    );
    assert_eq!(lines.len(), 2, "{usage}");
    let q = &lines[1];
    assert_eq!((q[0], q[1]), ("plan-pro-any-key-quota", "day"), "{usage}");
    assert!(
        q[2].ends_with("T00:00:00Z") && q[3].ends_with("T00:00:00Z"),
        "{usage}"
    );
    // Nothing was counted yesterday: 0, as recorded.
    assert_eq!(&q[4..], ["3", "3", "0", "0"], "{usage}");
    // The period is recorded, open, as soon as it counts.
    let mut listed = String::new();
    for _ in 0..100 {
        listed = run(d, &["usage", "--server", &url, "--periods"]);
        if listed.lines().count() == 2 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let row: Vec<&str> = listed
        .lines()
        .nth(1)
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    // (The resource column is empty: any resource.)
    assert_eq!(
        (row[0], row[1], row[2], row[5], row[6]),
        ("acme", "alice", "plan-pro-any-key-quota", "open", "3"),
        "{listed}"
    );
    assert_eq!(
        run(d, &["usage", "--server", &url, "--periods", "--closed"])
            .lines()
            .count(),
        1,
        "only the header: no period has closed"
    );
    assert_eq!(
        run(d, &["usage", "--server", &url, "--tenant", "acme"]),
        "no quota applies to tenant acme\n",
        "a per-key quota is read only for a key"
    );
    let midnight = (before / 86_400.0).floor() * 86_400.0 + 86_400.0;
    assert!(
        retry <= midnight - before + 0.001 && retry >= midnight - after - 0.001,
        "retry_after {retry} s; midnight is {} to {} s away",
        midnight - after,
        midnight - before
    );
}

/// A period boundary three instances turn: the quota's tenant's billing
/// cycle, the quota, the boundary's instant and the length of the period it
/// starts.
struct Boundary {
    cycle: Cycle,
    quota: LimitRow,
    at: u64,
    next: u64,
}

/// Three instances, each with a clock of its own, share one quota of 10
/// through `store`. Across the boundary, with the instances' clocks turning
/// the period at different moments, each period admits exactly 10, and a
/// refusal waits exactly until its period ends.
async fn three_instances_admit_exactly_the_quota_per_period(store: StoreSpec, b: Boundary) {
    let rules = [b.quota];
    let mut servers = Vec::new();
    for _ in 0..3 {
        let store = store.clone();
        let server = TestServer::launch(Some(&rules), move |c| {
            c.store = store;
            c.redis_uses_clock = true;
            c.store_timeout = Duration::from_secs(5);
        })
        .await;
        // Each instance reads its own copy of the table.
        server.table.set_cycle("acme", &b.cycle).await.unwrap();
        server.wait_generation(2).await;
        servers.push(server);
    }
    // A burst from all three, each call from each instance, until every
    // instance has been refused: the period's ten and no more.
    async fn period(servers: &[TestServer]) -> u64 {
        let admitted = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for (n, server) in servers.iter().enumerate() {
            let mut client = server.client().await;
            let admitted = admitted.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0..8 {
                    let r = ask(&mut client, req("acme", &format!("k{n}-{i}"))).await;
                    if r.allowed {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        admitted.load(Ordering::Relaxed)
    }
    for s in &servers {
        s.clock.set(b.at - 60_000_000);
    }
    assert_eq!(period(&servers).await, 10, "the period before the boundary");
    // A refusal waits exactly until the boundary.
    let mut client = servers[0].client().await;
    let r = ask(&mut client, req("acme", "late")).await;
    assert!(!r.allowed);
    assert_eq!(micros(&r.retry_after), 60_000_000);
    // One instance turns the period first; the others, a second behind,
    // still name the old one: their decisions count in the new period,
    // never in a second copy of the old.
    servers[0].clock.set(b.at + 5);
    servers[1].clock.set(b.at - 1_000_000);
    servers[2].clock.set(b.at - 1_000_000);
    let mut first = servers[0].client().await;
    let r = ask(&mut first, req("acme", "early")).await;
    assert!(r.allowed);
    assert_eq!(micros(&r.reset_after), b.next - 5, "the new period's end");
    assert_eq!(
        period(&servers).await,
        9,
        "the new period, one spent already"
    );
    // The lagging instances are refused until the new period ends; their
    // clock, behind the period counted, is taken as its first instant (as
    // a window takes a clock that stepped back).
    let mut lagging = servers[1].client().await;
    let r = ask(&mut lagging, req("acme", "lagging")).await;
    assert!(!r.allowed);
    assert_eq!(micros(&r.retry_after), b.next);
    for s in servers {
        s.stop().await;
    }
}

/// Microseconds of an RFC 3339 instant.
fn at(s: &str) -> u64 {
    let t: jiff::Timestamp = s.parse().unwrap();
    t.as_microsecond() as u64
}

const HOUR: u64 = 3_600_000_000;

fn quota(rate: &str) -> LimitRow {
    LimitRow::from_request(
        "acme".into(),
        String::new(),
        "tenant",
        0,
        rate,
        "enforce",
        "allow",
        0,
        "quota",
        None,
    )
    .unwrap()
}

/// The day New York's clocks spring forward: 23 hours from midnight EST
/// to midnight EDT.
fn new_york_spring_day() -> Boundary {
    Boundary {
        cycle: Cycle::new("America/New_York", 1, 1, "monday").unwrap(),
        quota: quota("10/day"),
        at: at("2026-03-08T05:00:00Z"),
        next: 23 * HOUR,
    }
}

/// A month anchored on the 31st in Tokyo turns on 29 February in a leap
/// year, and the next period runs to 31 March.
fn tokyo_leap_february() -> Boundary {
    Boundary {
        cycle: Cycle::new("Asia/Tokyo", 31, 1, "monday").unwrap(),
        quota: quota("10/month"),
        at: at("2028-02-28T15:00:00Z"),
        next: 31 * 24 * HOUR,
    }
}

/// Midnight UTC on the default cycle.
fn utc_midnight() -> Boundary {
    Boundary {
        cycle: Cycle::default(),
        quota: quota("10/day"),
        at: MIDNIGHT,
        next: 24 * HOUR,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_three_instances_turn_midnight_utc_exactly() {
    let redis = RedisServer::start();
    three_instances_admit_exactly_the_quota_per_period(
        StoreSpec::Redis(redis.url()),
        utc_midnight(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_three_instances_turn_a_23_hour_day_in_new_york_exactly() {
    let redis = RedisServer::start();
    three_instances_admit_exactly_the_quota_per_period(
        StoreSpec::Redis(redis.url()),
        new_york_spring_day(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_three_instances_turn_a_month_on_29_february_exactly() {
    let redis = RedisServer::start();
    three_instances_admit_exactly_the_quota_per_period(
        StoreSpec::Redis(redis.url()),
        tokyo_leap_february(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_three_instances_turn_a_23_hour_day_in_new_york_exactly() {
    let cluster = RedisCluster::start();
    three_instances_admit_exactly_the_quota_per_period(
        StoreSpec::Redis(cluster.url()),
        new_york_spring_day(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_memory_an_instance_turns_a_month_on_29_february_exactly() {
    // One instance in memory (its own store): the same arithmetic.
    let b = tokyo_leap_february();
    let server = TestServer::launch(Some(&[b.quota]), |_| {}).await;
    server.table.set_cycle("acme", &b.cycle).await.unwrap();
    server.wait_generation(2).await;
    server.clock.set(b.at - 1);
    let mut client = server.client().await;
    let mut admitted = 0;
    for i in 0..12 {
        admitted += u64::from(
            ask(&mut client, req("acme", &format!("k{i}")))
                .await
                .allowed,
        );
    }
    assert_eq!(admitted, 10);
    let r = ask(&mut client, req("acme", "late")).await;
    assert_eq!((r.allowed, micros(&r.retry_after)), (false, 1));
    server.clock.set(b.at);
    let r = ask(&mut client, req("acme", "new")).await;
    assert!(r.allowed);
    assert_eq!(micros(&r.reset_after), b.next);
    server.stop().await;
}

/// `tollgate tenants cycle` sets where a tenant's periods turn, `show`
/// prints it beside the plan, and bad cycles are refused naming the fix.
#[test]
fn a_tenants_billing_cycle_is_set_and_shown_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    run(d, &["limits", "list", "--create"]);
    assert_eq!(
        run(
            d,
            &[
                "tenants",
                "cycle",
                "--tenant",
                "acme",
                "--time-zone",
                "America/New_York",
                "--day",
                "15",
            ]
        ),
        "tenant acme: billing cycle America/New_York, day 15, month 1, monday\n"
    );
    run(d, &["plans", "create", "pro"]);
    run(d, &["plans", "assign", "--tenant", "acme", "--plan", "pro"]);
    assert_eq!(
        run(d, &["tenants", "show", "--tenant", "acme"]),
        "tenant acme: plan pro; billing cycle America/New_York, day 15, month 1, monday\n"
    );
    assert_eq!(
        run(d, &["tenants", "show", "--tenant", "globex"]),
        "tenant globex: no plan; billing cycle UTC, day 1, month 1, monday\n"
    );
    let cycle = |extra: &[&str]| {
        let mut args = vec!["tenants", "cycle", "--tenant", "acme"];
        args.extend_from_slice(extra);
        fails(d, &args)
    };
    let err = cycle(&["--time-zone", "Mars/Olympus_Mons"]);
    assert!(
        err.contains(
            "time zone \"Mars/Olympus_Mons\" is not an IANA time zone name; use one such as \
             America/New_York, Europe/Berlin or UTC"
        ),
        "{err}"
    );
    for day in ["0", "32"] {
        let err = cycle(&["--day", day]);
        assert!(
            err.contains(&format!(
                "anchor day {day}: use 1 to 31 (31 means the last day of shorter months)"
            )),
            "{err}"
        );
    }
    let err = cycle(&["--month", "13"]);
    assert!(
        err.contains("anchor month 13: use 1 (January) to 12 (December)"),
        "{err}"
    );
    let err = cycle(&["--weekday", "someday"]);
    assert!(err.contains("anchor weekday \"someday\""), "{err}");
    // Nothing changed.
    assert!(run(d, &["tenants", "show", "--tenant", "acme"]).contains("America/New_York, day 15"));
}

/// The admin API reads and sets a tenant's billing cycle (the token
/// required to set it), refuses bad cycles naming the fix, and the cycle is
/// in force on this instance when the answer comes.
#[tokio::test]
async fn the_admin_api_sets_a_tenants_billing_cycle() {
    use tollgate::api::admin::AdminAccess;
    let access = AdminAccess {
        token: Some("s3cret".into()),
        protect_reads: false,
        trust_network: false,
    };
    let b = new_york_spring_day();
    let server = TestServer::launch(Some(&[b.quota]), move |c| c.admin_access = access).await;
    let t = Some("s3cret");
    let body = r#"{"time_zone":"America/New_York"}"#;
    assert_eq!(
        server
            .http("PUT", "/v1/tenants/acme/cycle", None, body)
            .await
            .0,
        401
    );
    let (status, answer) = server.http("PUT", "/v1/tenants/acme/cycle", t, body).await;
    assert_eq!(
        (status, answer.as_str()),
        (
            200,
            r#"{"cycle":{"day":1,"month":1,"time_zone":"America/New_York","weekday":"monday"},"tenant":"acme"}"#
        )
    );
    let (status, answer) = server.http_get("/v1/tenants/acme").await.unwrap();
    assert_eq!(
        (status, answer.as_str()),
        (
            200,
            r#"{"cycle":{"day":1,"month":1,"time_zone":"America/New_York","weekday":"monday"},"plan":null,"tenant":"acme"}"#
        )
    );
    // In force: a refusal just before New York's midnight waits until it.
    server.clock.set(b.at - 1_000_000);
    let mut client = server.client().await;
    for i in 0..10 {
        assert!(
            ask(&mut client, req("acme", &format!("k{i}")))
                .await
                .allowed
        );
    }
    let r = ask(&mut client, req("acme", "late")).await;
    assert_eq!((r.allowed, micros(&r.retry_after)), (false, 1_000_000));
    // Bad input, each named; nothing changes.
    for (body, says) in [
        (
            r#"{"time_zone":"Mars/Olympus_Mons"}"#,
            "is not an IANA time zone name",
        ),
        (r#"{"day":0}"#, "anchor day 0: use 1 to 31"),
        (r#"{"day":32}"#, "anchor day 32: use 1 to 31"),
        (r#"{"month":13}"#, "anchor month 13"),
        (r#"{"weekday":"someday"}"#, "anchor weekday \"someday\""),
        (r#"{"day":300}"#, "the body must be"),
        (r#"{"zone":"UTC"}"#, "the body must be"),
    ] {
        let (status, answer) = server.http("PUT", "/v1/tenants/acme/cycle", t, body).await;
        assert_eq!(status, 400, "{body}: {answer}");
        assert!(answer.contains(says), "{body}: {answer}");
    }
    let huge = format!("/v1/tenants/{}/cycle", "t".repeat(200));
    let (status, answer) = server.http("PUT", &huge, t, "{}").await;
    assert_eq!(status, 400, "{answer}");
    assert!(answer.contains("at most 128"), "{answer}");
    let (_, answer) = server.http_get("/v1/tenants/acme").await.unwrap();
    assert!(answer.contains("America/New_York"), "{answer}");
    server.stop().await;
}

/// `GetUsage` reads each quota's current period without spending or
/// counting a decision: per-tenant quotas always, per-key ones for a key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_usage_reads_each_quota_of_the_period_without_spending() {
    use tollgate::proto::v1::GetUsageRequest;
    common::own_process();
    let redis = RedisServer::start();
    let monthly = quota("100/month");
    let daily = LimitRow {
        scope: tollgate::limits::Scope::Key,
        name: "acme-any-key-quota".into(),
        ..quota("5/day")
    };
    let rate = common::row("acme-rate", "acme", "", "key", 1000, "1000/second");
    let url = redis.url();
    let server = TestServer::launch(Some(&[monthly, daily, rate]), move |c| {
        c.store = StoreSpec::Redis(url);
        c.redis_uses_clock = true;
        c.store_timeout = Duration::from_millis(300);
    })
    .await;
    let ny = Cycle::new("America/New_York", 15, 1, "monday").unwrap();
    server.table.set_cycle("acme", &ny).await.unwrap();
    server.wait_generation(2).await;
    // 2026-03-20T12:00:00Z: in New York's period from 15 March to 15 April.
    server.clock.set(at("2026-03-20T12:00:00Z"));
    let mut client = server.client().await;
    for _ in 0..3 {
        assert!(ask(&mut client, req("acme", "alice")).await.allowed);
    }
    let mut bob = req("acme", "bob");
    bob.cost = 4;
    assert!(ask(&mut client, bob).await.allowed);
    let usage = |key: &str| {
        let mut client = client.clone();
        let request = GetUsageRequest {
            tenant: "acme".into(),
            key: key.into(),
            resource: String::new(),
        };
        async move { client.get_usage(request).await.unwrap().into_inner().quotas }
    };
    let decisions = || async {
        let (_, m) = server.http_get("/metrics").await.unwrap();
        m.lines()
            .filter(|l| l.starts_with("tollgate_decisions_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    let counted = decisions().await;
    let tenant_only = usage("").await;
    assert_eq!(tenant_only.len(), 1, "{tenant_only:?}");
    let m = &tenant_only[0];
    assert_eq!(
        (m.rule.as_str(), m.scope.as_str(), m.period.as_str()),
        ("acme-any-tenant-quota", "tenant", "month")
    );
    assert_eq!((m.used, m.limit, m.remaining, m.debt), (7, 100, 93, 0));
    let seconds = |t: &Option<prost_types::Timestamp>| t.as_ref().unwrap().seconds as u64;
    assert_eq!(
        seconds(&m.period_start),
        at("2026-03-15T04:00:00Z") / 1_000_000
    );
    assert_eq!(
        seconds(&m.period_end),
        at("2026-04-15T04:00:00Z") / 1_000_000
    );
    // Per key first, as rules apply.
    let alice = usage("alice").await;
    let names: Vec<&str> = alice.iter().map(|q| q.rule.as_str()).collect();
    assert_eq!(names, ["acme-any-key-quota", "acme-any-tenant-quota"]);
    assert_eq!(
        (alice[0].used, alice[0].remaining, alice[0].scope.as_str()),
        (3, 2, "key")
    );
    assert_eq!(alice[1].used, 7);
    // The day is New York's: it began at 04:00 UTC on the 20th.
    assert_eq!(
        seconds(&alice[0].period_start),
        at("2026-03-20T04:00:00Z") / 1_000_000
    );
    assert_eq!(
        seconds(&alice[0].period_end),
        at("2026-03-21T04:00:00Z") / 1_000_000
    );
    assert_eq!(usage("bob").await[0].used, 4);
    // The top-limited view shows the tenant by its fullest quota: bob's
    // day at 4 of 5.
    let (_, body) = server.http_get("/v1/top-limited").await.unwrap();
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let near = &v["nearest_quota"][0];
    assert_eq!(
        (
            near["tenant"].as_str(),
            near["rule"].as_str(),
            near["used"].as_u64(),
            near["limit"].as_u64()
        ),
        (Some("acme"), Some("acme-any-key-quota"), Some(4), Some(5)),
        "{body}"
    );
    // Until New York's midnight: 16 hours on.
    assert_eq!(
        near["resets_in_us"].as_u64(),
        Some(16 * 3_600_000_000),
        "{body}"
    );
    // The admin port reads the same.
    let (status, body) = server
        .http_get("/v1/usage?tenant=acme&key=alice")
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["tenant"], "acme");
    let q = &v["quotas"][0];
    assert_eq!(
        (
            q["rule"].as_str(),
            q["used"].as_u64(),
            q["remaining"].as_u64()
        ),
        (Some("acme-any-key-quota"), Some(3), Some(2))
    );
    assert_eq!(q["period_start"], "2026-03-20T04:00:00Z");
    assert_eq!(v["quotas"][1]["period_end"], "2026-04-15T04:00:00Z");
    for (query, says) in [
        ("", "tenant is empty"),
        (
            "?tenant=acme&bogus=1",
            "query parameters: tenant (required), key, resource",
        ),
        ("?tenant=ac%20me", "contains ' '"),
    ] {
        let (status, body) = server.http_get(&format!("/v1/usage{query}")).await.unwrap();
        assert_eq!(status, 400, "{query}: {body}");
        assert!(body.contains(says), "{query}: {body}");
    }
    // Reading spent nothing and counted no decision.
    assert_eq!(usage("").await[0].used, 7);
    assert_eq!(decisions().await, counted);
    // Bad input, named.
    for (tenant, key, says) in [
        ("", "", "tenant is empty"),
        ("ac me", "", "tenant \"ac me\" contains ' '"),
        ("acme", &"k".repeat(5000)[..], "key is 5000 bytes"),
    ] {
        let err = client
            .get_usage(GetUsageRequest {
                tenant: tenant.into(),
                key: key.into(),
                resource: String::new(),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
        assert!(err.message().contains(says), "{err:?}");
    }
    // With the store down, the figures cannot be read.
    drop(redis);
    let err = client
        .get_usage(GetUsageRequest {
            tenant: "acme".into(),
            key: String::new(),
            resource: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    let (status, body) = server.http_get("/v1/usage?tenant=acme").await.unwrap();
    assert_eq!(status, 503, "{body}");
    server.stop().await;
}

/// A period that turns while Redis is down: each quota's policy answers
/// meanwhile (`deny` refuses, `allow` admits), and once Redis is back the
/// new period counts from nothing, once: its quota and no more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_period_that_turns_while_redis_is_down_counts_once_when_it_returns() {
    let mut redis = RedisServer::start();
    let closed = LimitRow {
        on_store_unavailable: tollgate::limits::OnStoreUnavailable::Deny,
        ..quota("3/day")
    };
    let open = LimitRow {
        tenant: "globex".into(),
        name: "globex-daily".into(),
        ..quota("3/day")
    };
    let url = redis.url();
    let server = TestServer::launch(Some(&[closed, open]), move |c| {
        c.store = StoreSpec::Redis(url);
        c.redis_uses_clock = true;
        c.store_timeout = Duration::from_millis(300);
    })
    .await;
    let mut client = server.client().await;
    server.clock.set(MIDNIGHT - 60_000_000);
    for tenant in ["acme", "globex"] {
        for _ in 0..3 {
            assert!(ask(&mut client, req(tenant, "k")).await.allowed);
        }
        assert!(!ask(&mut client, req(tenant, "k")).await.allowed);
    }
    // Redis goes; the day turns.
    redis.kill();
    server.clock.set(MIDNIGHT + 60_000_000);
    use tollgate::proto::v1::Degraded;
    let r = ask(&mut client, req("acme", "k")).await;
    assert_eq!((r.allowed, r.degraded()), (false, Degraded::FailedClosed));
    let r = ask(&mut client, req("globex", "k")).await;
    assert_eq!((r.allowed, r.degraded()), (true, Degraded::FailedOpen));
    // Back, empty (no persistence): the new day counts from nothing, once.
    redis.restart();
    for tenant in ["acme", "globex"] {
        let mut admitted = 0;
        for _ in 0..200 {
            let r = ask(&mut client, req(tenant, "k")).await;
            if r.degraded() == Degraded::None && r.allowed {
                admitted += 1;
            }
            if r.degraded() == Degraded::None && !r.allowed {
                assert_eq!(micros(&r.retry_after), 86_400_000_000 - 60_000_000);
                break;
            }
            // Until the breaker lets calls through again (bounded: 20 s).
            if r.degraded() != Degraded::None {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        assert_eq!(admitted, 3, "{tenant}: the new day's quota, once");
        assert!(!ask(&mut client, req(tenant, "k")).await.allowed);
    }
    server.stop().await;
}

/// On Redis's own clock (as in production): the deciding instance names
/// the period, so a Redis whose clock jumps a day ahead or behind neither
/// turns the period nor repeats it. Its clock only measures the wait,
/// taken inside the period named: from its last instant when Redis runs
/// ahead of it, from its first when Redis runs behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_clock_that_jumps_neither_turns_nor_repeats_a_period() {
    use common::redis::ShiftedRedis;
    use tollgate::proto::v1::Degraded;
    let redis = ShiftedRedis::start();
    let url = redis.server.url();
    let server = TestServer::launch(Some(&[quota("2/day")]), move |c| {
        c.store = StoreSpec::Redis(url);
        c.store_timeout = Duration::from_secs(2);
    })
    .await;
    // The instance's clock at Redis's time: the day is today's, UTC.
    let now = redis.time();
    server.clock.set(now);
    let day = 86_400_000_000;
    let end = (now / day + 1) * day;
    let mut client = server.client().await;
    for _ in 0..2 {
        let r = ask(&mut client, req("acme", "k")).await;
        assert_eq!((r.allowed, r.degraded()), (true, Degraded::None));
    }
    let r = ask(&mut client, req("acme", "k")).await;
    assert!(!r.allowed);
    let wait = micros(&r.retry_after);
    // Up to the end of today, on Redis's clock (a little after `now`).
    assert!(wait <= end - now && wait + 5_000_000 > end - now, "{wait}");
    // Redis a day ahead: still today's period, still spent; the wait is
    // measured from the period's last instant.
    redis.shift(day as i64);
    let r = ask(&mut client, req("acme", "k")).await;
    assert_eq!((r.allowed, micros(&r.retry_after)), (false, 1));
    // A day behind: still today's period, never a fresh one; the wait is
    // the whole day, from its first instant.
    redis.shift(-(day as i64));
    let r = ask(&mut client, req("acme", "k")).await;
    assert_eq!((r.allowed, micros(&r.retry_after)), (false, day));
    // The instance's clock turns the day: the next one has its quota.
    redis.shift(0);
    server.clock.set(end);
    let r = ask(&mut client, req("acme", "k")).await;
    assert!(r.allowed);
    server.stop().await;
}

/// A day ends: within the ledger's pace the period is recorded closed at
/// its final count; GetUsage shows it as the previous period, ListUsage
/// and `GET /v1/usage/periods` page through the records, and bad requests
/// are refused with what to fix.
#[tokio::test]
async fn a_closed_day_is_recorded_and_listed_page_by_page() {
    use tollgate::proto::v1::{GetUsageRequest, ListUsageRequest};
    common::own_process();
    let daily = LimitRow {
        scope: tollgate::limits::Scope::Key,
        name: "acme-daily".into(),
        ..quota("5/day")
    };
    let server = TestServer::launch(Some(&[daily]), |c| {
        c.usage_grace = Duration::from_secs(1);
        c.usage_close_every = Duration::from_millis(50);
    })
    .await;
    let midnight = at("2026-03-02T00:00:00Z");
    server.clock.set(midnight - 60_000_000);
    let mut client = server.client().await;
    for (key, n) in [("alice", 2), ("bob", 1), ("carol", 3)] {
        for _ in 0..n {
            assert!(ask(&mut client, req("acme", key)).await.allowed);
        }
    }
    // The next day, past the grace: alice counts again; bob and carol do
    // not, and are closed from their counters.
    server.clock.set(midnight + 2_000_000);
    assert!(ask(&mut client, req("acme", "alice")).await.allowed);
    let list = |tenant: &str, closed_only: bool, page_size: u32, page_token: String| {
        let mut client = client.clone();
        let request = ListUsageRequest {
            tenant: tenant.into(),
            closed_only,
            page_size,
            page_token,
            ..ListUsageRequest::default()
        };
        async move { client.list_usage(request).await.map(|r| r.into_inner()) }
    };
    let mut closed = Vec::new();
    for _ in 0..200 {
        closed = list("acme", true, 0, String::new()).await.unwrap().periods;
        if closed.len() == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let figures: Vec<(&str, Option<u64>)> = closed
        .iter()
        .map(|p| (p.key.as_str(), p.figure.as_ref().unwrap().used))
        .collect();
    assert_eq!(
        figures,
        [("alice", Some(2)), ("bob", Some(1)), ("carol", Some(3))]
    );
    let first = &closed[0];
    assert_eq!(
        (
            first.tenant.as_str(),
            first.scope.as_str(),
            first.rule.as_str(),
            first.limit
        ),
        ("acme", "key", "acme-daily", 5)
    );
    let f = first.figure.as_ref().unwrap();
    let seconds = |t: &Option<prost_types::Timestamp>| t.as_ref().unwrap().seconds as u64;
    assert_eq!(
        seconds(&f.period_start),
        (midnight - 86_400_000_000) / 1_000_000
    );
    assert_eq!(seconds(&f.period_end), midnight / 1_000_000);
    // Page by page, every period (alice's new day too), in order.
    let mut pages = Vec::new();
    let mut token = String::new();
    loop {
        let page = list("", false, 2, token).await.unwrap();
        pages.push(
            page.periods
                .iter()
                .map(|p| (p.key.clone(), p.figure.as_ref().unwrap().closed))
                .collect::<Vec<_>>(),
        );
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    let k = |s: &str, c: bool| (s.to_owned(), c);
    assert_eq!(
        pages,
        [
            vec![k("alice", true), k("bob", true)],
            vec![k("carol", true), k("alice", false)],
            vec![],
        ]
    );
    // GetUsage: today's figure, and yesterday's as recorded.
    let usage = server
        .client()
        .await
        .get_usage(GetUsageRequest {
            tenant: "acme".into(),
            key: "alice".into(),
            resource: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .quotas;
    assert_eq!(usage[0].used, 1);
    let previous = usage[0].previous.as_ref().unwrap();
    assert_eq!((previous.used, previous.closed), (Some(2), true));
    assert_eq!(seconds(&previous.period_end), midnight / 1_000_000);
    // The admin port lists the same.
    let (status, body) = server
        .http_get("/v1/usage/periods?tenant=acme&closed=true&page_size=1")
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["periods"][0]["key"], "alice");
    assert_eq!(body["periods"][0]["used"], 2);
    assert_eq!(body["periods"][0]["period_end"], "2026-03-02T00:00:00Z");
    assert!(!body["next_page_token"].as_str().unwrap().is_empty());
    // Bad requests say what to fix.
    let err = list("acme", false, 10_001, String::new())
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("at most 10000"), "{}", err.message());
    let err = list("acme", false, 0, "nonsense".into()).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message().contains("next_page_token"),
        "{}",
        err.message()
    );
    let err = list("ac me", false, 0, String::new()).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    let (status, body) = server
        .http_get("/v1/usage/periods?since=yesterday")
        .await
        .unwrap();
    assert_eq!(status, 400);
    assert!(
        body.contains("since") && body.contains("RFC 3339"),
        "{body}"
    );
    server.stop().await;
}
