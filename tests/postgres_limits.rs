//! PostgreSQL as the limits table: migrations at start-up, edits reach
//! every instance at once through LISTEN/NOTIFY, and a lost database keeps
//! the last good limits in force until it is back.

use crate::common;

use std::time::Duration;

use common::postgres::Postgres;
use common::{TestServer, ask, req, row};
use tollgate::limits::table::LimitsTable;

/// Two instances on one PostgreSQL. Their poll interval is a minute, so a
/// change seen within seconds can only have come through NOTIFY.
async fn two_instances(pg: &Postgres) -> (TestServer, TestServer) {
    let start = || {
        let url = pg.url();
        TestServer::launch(None, move |c| {
            c.limits = url;
            c.reload_interval = Duration::from_secs(60);
        })
    };
    let (a, b) = tokio::join!(start(), start());
    (a, b)
}

async fn limit_of(server: &TestServer, tenant: &str) -> (String, u64) {
    let mut client = server.client().await;
    let r = ask(
        &mut client,
        tollgate::proto::v1::ShouldAllowRequest {
            dry_run: true,
            ..req(tenant, "k")
        },
    )
    .await;
    (r.limit_name, r.limit)
}

async fn eventually(server: &TestServer, tenant: &str, want: (&str, u64)) {
    for _ in 0..250 {
        let (name, limit) = limit_of(server, tenant).await;
        if name == want.0 && limit == want.1 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!(
        "{tenant} never got {want:?}; has {:?}",
        limit_of(server, tenant).await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edits_reach_every_instance_through_notify() {
    let pg = Postgres::start();
    let (a, b) = two_instances(&pg).await;
    // Migrated and seeded once, although two instances started together.
    let table = LimitsTable::open(&pg.url()).await.unwrap();
    assert_eq!(table.rows().await.unwrap().len(), 1);
    assert_eq!(limit_of(&a, "acme").await, ("default-per-key".into(), 30));

    table
        .upsert(&row("acme-pro", "acme", "", "key", 300, "6000/minute"))
        .await
        .unwrap();
    eventually(&a, "acme", ("acme-pro", 300)).await;
    eventually(&b, "acme", ("acme-pro", 300)).await;

    // Plain SQL, and updated_at follows.
    let before = table.rows().await.unwrap()[1].updated_at.clone();
    table
        .execute_sql("UPDATE limits SET burst = 5 WHERE name = 'acme-pro'")
        .await
        .unwrap();
    eventually(&a, "acme", ("acme-pro", 5)).await;
    eventually(&b, "acme", ("acme-pro", 5)).await;
    let rows = table.rows().await.unwrap();
    assert!(
        rows[1].updated_at > before,
        "{} > {before}",
        rows[1].updated_at
    );
    assert!(rows[1].updated_at.ends_with('Z'));

    // An invalid row is rejected alone everywhere; the rest stay.
    table
        .execute_sql("INSERT INTO limits (name, tenant, burst, rate, rate_unit) VALUES ('bad', 'x', 1, 1, 'fortnight')")
        .await
        .unwrap();
    let error = b.wait_rejected_row().await;
    assert!(error.starts_with("row \"bad\""), "{error}");
    assert_eq!(limit_of(&b, "acme").await, ("acme-pro".into(), 5));
    table
        .execute_sql("DELETE FROM limits WHERE name = 'bad'")
        .await
        .unwrap();
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_database_keeps_the_last_good_limits_and_reconnects() {
    let mut pg = Postgres::start();
    let (a, b) = two_instances(&pg).await;
    let table = LimitsTable::open(&pg.url()).await.unwrap();
    table
        .upsert(&row("acme", "acme", "", "key", 7, "1/second"))
        .await
        .unwrap();
    eventually(&a, "acme", ("acme", 7)).await;
    eventually(&b, "acme", ("acme", 7)).await;
    table.close().await;

    pg.kill();
    // Decisions go on with the limits in force.
    let mut client = a.client().await;
    for left in (4..7).rev() {
        assert_eq!(ask(&mut client, req("acme", "kk")).await.remaining, left);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(limit_of(&b, "acme").await, ("acme".into(), 7));

    pg.restart();
    let table = LimitsTable::open(&pg.url()).await.unwrap();
    table
        .upsert(&row("acme", "acme", "", "key", 70, "1/second"))
        .await
        .unwrap();
    eventually(&a, "acme", ("acme", 70)).await;
    eventually(&b, "acme", ("acme", 70)).await;
    a.stop().await;
    b.stop().await;
}
