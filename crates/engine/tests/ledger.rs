//! The usage ledger against real components: instances (engines, each
//! with its own ledger) sharing a real Redis and one limits database
//! (SQLite, or a PostgreSQL server the test starts and stops). Each test
//! states one promise of `tollgate_engine::ledger`: a closed period's final
//! count is written once, whichever instance gets there first; it outlives
//! Redis; an instance that dies before recording loses nothing; nor does a
//! database that is down at the boundary.

#[allow(dead_code)]
#[path = "../../../tests/common/ports.rs"]
mod ports;
#[allow(dead_code)]
#[path = "../../../tests/common/postgres.rs"]
mod postgres;
#[allow(dead_code)]
#[path = "../../../tests/common/redis.rs"]
mod redis;

use std::sync::Arc;
use std::time::Duration;

use tollgate_engine::algorithm::Limit;
use tollgate_engine::algorithm::alerts::Alerts;
use tollgate_engine::algorithm::calendar::{Bounds, Cycle, Period};
use tollgate_engine::algorithm::{Micros, Op};
use tollgate_engine::clock::{Clock, ManualClock};
use tollgate_engine::engine::backend::{Backend, BackendOptions};
use tollgate_engine::engine::{
    Allowance, Api, BucketKey, BucketKind, Demand, Engine, Item, Line, OnStoreUnavailable,
    OverCapacity, RedisConfig, Unmatched,
};
use tollgate_engine::ledger::{Closing, Ledger, LedgerOptions};
use tollgate_engine::limits::table::{AlertWrite, LimitsTable, PeriodFilter, PeriodRow, alert_id};
use tollgate_engine::limits::watch::LiveLimits;
use tollgate_engine::telemetry::top::TopLimited;

const HOUR: Micros = 3_600_000_000;
/// Midnight UTC, 2026-03-01; the day after starts at D1.
const D0: Micros = 1_772_323_200_000_000;
const D1: Micros = D0 + 24 * HOUR;

/// One instance: an engine and its ledger, on its own clock.
struct Instance {
    engine: Engine,
    ledger: Arc<Ledger>,
    clock: Arc<ManualClock>,
}

async fn instance(redis: Option<&str>, table: &LimitsTable) -> Instance {
    let clock = Arc::new(ManualClock::new(D0 + 10 * HOUR));
    let dyn_clock: Arc<dyn Clock> = clock.clone();
    let options = BackendOptions {
        redis: redis.map(|url| RedisConfig {
            timeout: Duration::from_secs(5),
            ..RedisConfig::new(url)
        }),
        redis_uses_clock: true,
        max_buckets: 10_000,
        max_bucket_bytes: 1 << 24,
        max_records: 10_000,
        max_records_per_tenant: None,
        local_fraction: 0.5,
        deny_retry_after: 1_000_000,
        deny_cache: false,
        token_slices: false,
    };
    let backend = Backend::build(&options, &dyn_clock).unwrap();
    let top = Arc::new(TopLimited::new(
        16,
        Duration::from_secs(60),
        dyn_clock.clone(),
    ));
    let limits = Arc::new(LiveLimits::load(table, 1_000).await.unwrap());
    let ledger = backend.ledger(
        table.clone(),
        limits,
        dyn_clock.clone(),
        LedgerOptions {
            grace: Duration::from_secs(15),
            batch: 4,
            ..LedgerOptions::default()
        },
    );
    Instance {
        engine: backend.engine(dyn_clock, top, Unmatched::Allow),
        ledger: Arc::new(ledger),
        clock,
    }
}

fn counter(key: &str) -> BucketKey {
    let kind = BucketKind::Quota {
        per_key: true,
        shadow: false,
    };
    BucketKey::new("acme", kind, "exports", key)
}

/// Spends 1 from `key`'s daily quota of 3 (UTC days); true if admitted.
async fn spend(i: &Instance, key: &str) -> bool {
    spend_alerting(i, key, Alerts::NONE).await
}

/// [`spend`], the quota alerting at `alerts`.
async fn spend_alerting(i: &Instance, key: &str, alerts: Alerts) -> bool {
    let utc = Cycle::default();
    let mut demand = Demand::new(Api::Native, Op::SPEND, OverCapacity::Invalid);
    demand.items.push(Item::new("acme", "exports", key, 1));
    demand.lines.push(Line {
        item: 0,
        bucket: counter(key),
        allowance: Allowance::Limited(
            Limit::quota(3, Bounds { start: 0, end: 1 })
                .unwrap()
                .with_alerts(alerts),
        ),
        enforce: true,
        on_store_unavailable: OnStoreUnavailable::Allow,
        label: "exports-per-day",
        calendar: Some((Period::Day, &utc)),
    });
    let answer = i.engine.decide(&mut demand, &tracing::Span::none()).await;
    answer.unwrap().items[0].allowed
}

async fn rows(table: &LimitsTable) -> Vec<PeriodRow> {
    table
        .periods(&PeriodFilter {
            limit: 1_000,
            ..PeriodFilter::default()
        })
        .await
        .unwrap()
}

/// The counter or gauge `name` with exactly `labels` in the process's
/// Prometheus text (0 when absent).
fn metric(name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = tollgate_engine::telemetry::metrics::handle().render();
    let want: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    text.lines()
        .filter_map(|l| l.strip_prefix(name))
        .filter(|rest| want.iter().all(|w| rest.contains(w.as_str())))
        .filter_map(|rest| rest.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Three instances race at the boundary: every period of the day before
/// is closed at its final count exactly once (by a journal event where a
/// decision moved the counter on, by reading the counter elsewhere), and
/// the figures stay after Redis forgets everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_close_each_period_once_and_the_figures_outlive_redis() {
    tollgate_engine::telemetry::metrics::handle();
    let server = redis::RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("limits.db");
    let path = path.to_str().unwrap();
    let mut instances = Vec::new();
    for _ in 0..3 {
        // Each instance has its own handle on the one database.
        let table = LimitsTable::open(path).await.unwrap();
        instances.push(instance(Some(&server.url()), &table).await);
    }
    let table = LimitsTable::open(path).await.unwrap();
    // Day 0: six keys, each spent twice, from different instances.
    for k in 0..6 {
        for n in 0..2 {
            assert!(spend(&instances[(k + n) % 3], &format!("k{k}")).await);
        }
    }
    for i in &instances {
        i.ledger.drain(false).await.unwrap();
    }
    let opened = rows(&table).await;
    assert_eq!(opened.len(), 6);
    assert!(opened.iter().all(|r| !r.closed && r.used.is_none()));
    assert_eq!(
        (
            opened[0].start,
            opened[0].end,
            opened[0].quota,
            opened[0].scope.as_str()
        ),
        (D0, D1, 3, "key")
    );
    // Too early to close: within the grace after the day's end.
    for i in &instances {
        i.clock.set(D1 + 14_000_000);
    }
    assert_eq!(
        instances[0].ledger.close_due().await.unwrap(),
        Closing::default()
    );
    // Day 1: k0 counts again, moving its counter on; then all three
    // instances close what is due at once.
    for i in &instances {
        i.clock.set(D1 + HOUR);
    }
    assert!(spend(&instances[1], "k0").await);
    let before = metric("tollgate_usage_periods_total", &[("step", "closed")]);
    let racing = instances.iter().map(|i| {
        let ledger = i.ledger.clone();
        async move {
            ledger.drain(false).await.unwrap();
            ledger.close_due().await.unwrap()
        }
    });
    let done = futures_util::future::join_all(racing).await;
    let closed: u64 = done.iter().map(|d| d.closed).sum();
    let closed_by_journal =
        metric("tollgate_usage_periods_total", &[("step", "closed")]) - before - closed as f64;
    assert_eq!(closed as f64 + closed_by_journal, 6.0, "{done:?}");
    assert!(done.iter().all(|d| d.lost == 0), "{done:?}");
    // Again: nothing more is written.
    for i in &instances {
        assert_eq!(i.ledger.close_due().await.unwrap().closed, 0);
    }
    assert_eq!(
        metric("tollgate_usage_periods_total", &[("step", "closed")]) - before,
        6.0
    );
    // Redis forgets everything; the figures stay.
    assert_eq!(redis::redis_cli(server.port, &["FLUSHALL"]).trim(), "OK");
    let all = rows(&table).await;
    let day0: Vec<_> = all.iter().filter(|r| r.start == D0).collect();
    assert_eq!(day0.len(), 6);
    for r in &day0 {
        assert!(r.closed, "{r:?}");
        assert_eq!(r.used, Some(2), "{r:?}");
        assert_eq!(
            (r.tenant.as_str(), r.resource.as_str()),
            ("acme", "exports")
        );
    }
    let day1: Vec<_> = all.iter().filter(|r| r.start == D1).collect();
    assert_eq!(day1.len(), 1);
    assert_eq!((day1[0].key.as_str(), day1[0].closed), ("k0", false));
}

/// An instance that decides and dies before its ledger records anything:
/// another instance finds its events with a sweep of every journal, and
/// records them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_of_an_instance_that_died_are_recorded_by_a_sweep() {
    let server = redis::RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("limits.db");
    let table = LimitsTable::open(path.to_str().unwrap()).await.unwrap();
    let dead = instance(Some(&server.url()), &table).await;
    assert!(spend(&dead, "alice").await);
    drop(dead);
    let survivor = instance(Some(&server.url()), &table).await;
    // It was never told: only a sweep finds the journal.
    assert_eq!(survivor.ledger.drain(false).await.unwrap(), 0);
    assert!(rows(&table).await.is_empty());
    assert_eq!(survivor.ledger.drain(true).await.unwrap(), 1);
    let recorded = rows(&table).await;
    assert_eq!(recorded.len(), 1);
    assert_eq!((recorded[0].key.as_str(), recorded[0].start), ("alice", D0));
    // The journal was trimmed: a second sweep finds nothing.
    assert_eq!(survivor.ledger.drain(true).await.unwrap(), 0);
}

/// The database is down across the boundary: the ledger's writes fail and
/// are retried, the journal keeps its events, and once the database is
/// back every figure is written, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_down_at_the_boundary_loses_nothing() {
    let server = redis::RedisServer::start();
    let mut pg = postgres::Postgres::start();
    let table = LimitsTable::open(&pg.url()).await.unwrap();
    let a = instance(Some(&server.url()), &table).await;
    for _ in 0..3 {
        assert!(spend(&a, "alice").await);
    }
    assert!(spend(&a, "bob").await);
    a.ledger.drain(false).await.unwrap();
    pg.kill();
    // Past the boundary: alice moves on; bob does not.
    a.clock.set(D1 + HOUR);
    assert!(spend(&a, "alice").await);
    assert!(a.ledger.drain(false).await.is_err());
    assert!(a.ledger.close_due().await.is_err());
    pg.spawn();
    // The failed journal is retried without being told again.
    let mut written = 0;
    for _ in 0..100 {
        match a.ledger.drain(false).await {
            Ok(n) => {
                written = n;
                break;
            }
            // The pool reconnects.
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    assert_eq!(written, 1);
    let closing = a.ledger.close_due().await.unwrap();
    assert_eq!(
        closing,
        Closing {
            closed: 1,
            lost: 0,
            waiting: 0
        }
    );
    let all = rows(&table).await;
    let figures: Vec<_> = all
        .iter()
        .map(|r| (r.key.as_str(), r.start, r.used, r.closed))
        .collect();
    assert_eq!(
        figures,
        [
            ("alice", D0, Some(3), true),
            ("bob", D0, Some(1), true),
            ("alice", D1, None, false),
        ]
    );
}

/// In process (the embedded default), the same: a period closes at its
/// counter's final count, and a later decision's event does not write it
/// twice.
#[tokio::test]
async fn in_memory_periods_close_at_their_final_count() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("limits.db");
    let table = LimitsTable::open(path.to_str().unwrap()).await.unwrap();
    let i = instance(None, &table).await;
    for _ in 0..4 {
        spend(&i, "alice").await;
    }
    assert_eq!(i.ledger.drain(false).await.unwrap(), 1);
    i.clock.set(D1 + 20_000_000);
    assert_eq!(i.ledger.close_due().await.unwrap().closed, 1);
    assert!(spend(&i, "alice").await);
    assert_eq!(i.ledger.drain(false).await.unwrap(), 1);
    let all = rows(&table).await;
    let figures: Vec<_> = all.iter().map(|r| (r.start, r.used, r.closed)).collect();
    assert_eq!(figures, [(D0, Some(3), true), (D1, None, false)]);
    let day0 = i.ledger.period(&counter("alice"), D0).await.unwrap();
    assert_eq!(day0.as_ref(), Some(&all[0]));
    assert_eq!(
        i.ledger.period(&counter("alice"), D0 + 1).await.unwrap(),
        None
    );
}

/// Three instances spend keys up to their quota of 3 with alerts at 50 and
/// 100 %: the outbox holds each key's two alerts once, however many
/// instances drained them or how often.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_threshold_is_recorded_once_across_instances() {
    let server = redis::RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("limits.db");
    let path = path.to_str().unwrap();
    let mut instances = Vec::new();
    for _ in 0..3 {
        let table = LimitsTable::open(path).await.unwrap();
        instances.push(instance(Some(&server.url()), &table).await);
    }
    let alerts: Alerts = "50,100".parse().unwrap();
    for k in 0..10 {
        for n in 0..4 {
            let admitted = spend_alerting(&instances[(k + n) % 3], &format!("k{k}"), alerts).await;
            assert_eq!(admitted, n < 3);
        }
    }
    for _ in 0..2 {
        for i in &instances {
            i.ledger.drain(true).await.unwrap();
        }
    }
    let table = LimitsTable::open(path).await.unwrap();
    let recorded = table.alerts(false, 100).await.unwrap();
    assert_eq!(recorded.len(), 20);
    let mut seen: Vec<(String, u16, u64)> = recorded
        .iter()
        .map(|a| (a.key.clone(), a.threshold, a.used))
        .collect();
    seen.sort();
    let mut want: Vec<(String, u16, u64)> = (0..10)
        .flat_map(|k| [(format!("k{k}"), 50, 2), (format!("k{k}"), 100, 3)])
        .collect();
    want.sort();
    assert_eq!(seen, want);
    let a = &recorded[0];
    assert_eq!(
        (
            a.tenant.as_str(),
            a.resource.as_str(),
            a.scope.as_str(),
            a.quota
        ),
        ("acme", "exports", "key", 3)
    );
    assert_eq!((a.start, a.end), (D0, D1));
    assert_eq!(a.id, alert_id(&a.counter, a.start, a.threshold));
    assert_eq!(a.id.len(), 32);
}

fn alert<'a>(counter: &'a str, threshold: u16) -> AlertWrite<'a> {
    AlertWrite {
        counter,
        tenant: "acme",
        scope: "tenant",
        resource: "",
        key: "",
        rule: "acme-monthly",
        start: D0,
        end: D1,
        threshold,
        used: 80,
        quota: 100,
        detected_at: D0 + HOUR,
    }
}

/// The outbox: an alert recorded twice is kept once; a claim holds it for
/// its lease; a failure schedules the next try; a delivery ends it; and a
/// claim takes a page, whatever the outbox holds.
async fn the_outbox_claims_retries_and_delivers(table: &LimitsTable) {
    let counter = "acme:tq::";
    assert_eq!(
        table.record_alerts(&[alert(counter, 80)]).await.unwrap(),
        [true]
    );
    assert_eq!(
        table
            .record_alerts(&[alert(counter, 80), alert(counter, 100)])
            .await
            .unwrap(),
        [false, true]
    );
    let ids = [alert_id(counter, D0, 80), alert_id(counter, D0, 100)];
    // Due alerts are claimed oldest due first, then by id.
    let (first, second) = if ids[0] < ids[1] {
        (&ids[0], &ids[1])
    } else {
        (&ids[1], &ids[0])
    };
    let claimed = table.claim_alerts(1_000, 500, 1).await.unwrap();
    assert_eq!(claimed.len(), 1);
    assert_eq!((&claimed[0].id, claimed[0].attempts), (first, 1));
    // Held for its lease: the next claim takes the other alert only.
    let other = table.claim_alerts(1_200, 500, 10).await.unwrap();
    assert_eq!(other.len(), 1);
    assert_eq!(&other[0].id, second);
    assert!(table.claim_alerts(1_400, 500, 10).await.unwrap().is_empty());
    table
        .alert_failed(first, 5_000, "the webhook answered 500")
        .await
        .unwrap();
    table.alert_delivered(second, 1_450).await.unwrap();
    assert!(table.claim_alerts(4_999, 500, 10).await.unwrap().is_empty());
    let again = table.claim_alerts(5_000, 500, 10).await.unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!(
        (
            &again[0].id,
            again[0].attempts,
            again[0].last_error.as_str()
        ),
        (first, 2, "the webhook answered 500")
    );
    table.alert_delivered(first, 5_100).await.unwrap();
    assert!(
        table
            .claim_alerts(u64::MAX / 2, 500, 10)
            .await
            .unwrap()
            .is_empty()
    );
    let counts = table.alert_counts().await.unwrap();
    assert_eq!((counts.pending, counts.delivered), (0, 2));
    assert_eq!(table.pending_alerts().await.unwrap(), 0);
    let listed = table.alerts(false, 10).await.unwrap();
    assert_eq!(listed.len(), 2);
    assert!(
        listed
            .iter()
            .all(|a| a.delivered_at.is_some() && a.last_error.is_empty())
    );
    assert!(table.alerts(true, 10).await.unwrap().is_empty());
}

#[tokio::test]
async fn the_outbox_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("limits.db");
    let table = LimitsTable::open(path.to_str().unwrap()).await.unwrap();
    the_outbox_claims_retries_and_delivers(&table).await;
}

#[tokio::test]
async fn the_outbox_on_postgres() {
    let pg = postgres::Postgres::start();
    let table = LimitsTable::open(&pg.url()).await.unwrap();
    the_outbox_claims_retries_and_delivers(&table).await;
}

/// An outbox of a million undelivered alerts: a claim reads one page of
/// them (the notifier's memory is a page, not the outbox).
#[tokio::test]
async fn a_million_alerts_are_claimed_a_page_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("limits.db");
    let table = LimitsTable::open(path.to_str().unwrap()).await.unwrap();
    table
        .execute_sql(
            "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < 999999) \
             INSERT INTO quota_alerts (id, counter, period_start, period_end, threshold, tenant, \
             scope, resource, key, used, quota, detected_at) \
             SELECT printf('%032d', i), 't' || i || ':tq::', 0, 1, 100, 't' || i, 'tenant', '', '', \
             10, 10, i FROM n",
        )
        .await
        .unwrap();
    assert_eq!(table.alert_counts().await.unwrap().pending, 1_000_000);
    assert_eq!(table.pending_alerts().await.unwrap(), 1_000_000);
    let page = table.claim_alerts(10, 1_000, 64).await.unwrap();
    assert_eq!(page.len(), 64);
    assert_eq!(page[0].id, format!("{:032}", 0));
    let next = table.claim_alerts(10, 1_000, 64).await.unwrap();
    assert_eq!(next[0].id, format!("{:032}", 64));
}
