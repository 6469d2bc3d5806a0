//! Limits are data: edits to the table take effect on a running server.

use crate::common;

use common::{TestServer, ask, micros, req, row};
use tollgate::proto::v1::ShouldAllowRequest;

#[tokio::test]
async fn changing_a_tenants_tier_takes_effect_without_a_restart() {
    let server = TestServer::start().await;
    let mut client = server.client().await;
    let r = ask(&mut client, req("acme", "k")).await;
    assert_eq!((r.limit, r.remaining), (30, 29));

    // What `tollgate limits set --tenant acme --burst 300 --rate 6000/minute` does.
    server
        .table
        .upsert(&row("acme-pro", "acme", "", "key", 300, "6000/minute"))
        .await
        .unwrap();
    server.wait_generation(2).await;
    let r = ask(&mut client, req("acme", "k")).await;
    assert_eq!(r.limit_name, "acme-pro");
    assert_eq!(r.limit, 300);
    // The bucket keeps its debt: one token spent before, one now.
    assert_eq!(r.remaining, 298);
    // Other tenants keep the default.
    assert_eq!(ask(&mut client, req("globex", "k")).await.limit, 30);

    // A plain SQL edit works too.
    server
        .table
        .execute_sql(
            "UPDATE limits SET burst = 5, rate = 1, rate_unit = 'hour' WHERE name = 'acme-pro'",
        )
        .await
        .unwrap();
    server.wait_generation(3).await;
    // Two tokens were spent; they stay spent under the new limit, now at
    // one per hour: 5 - 2 = 3 left before this request, 2 after.
    let r = ask(&mut client, req("acme", "k")).await;
    assert_eq!((r.limit, r.remaining, r.rate.as_str()), (5, 2, "1/hour"));
    server.stop().await;
}

#[tokio::test]
async fn a_smaller_burst_clamps_existing_buckets() {
    let server = TestServer::with_rows(&[row("r", "", "", "key", 100, "1/second")]).await;
    let mut client = server.client().await;
    let r = ask(
        &mut client,
        ShouldAllowRequest {
            cost: 40,
            ..req("t", "k")
        },
    )
    .await;
    assert_eq!(r.remaining, 60);
    server
        .table
        .execute_sql("UPDATE limits SET burst = 10 WHERE name = 'r'")
        .await
        .unwrap();
    server.wait_generation(2).await;
    // 40 tokens owed exceed the new capacity of 10: the bucket is empty, not
    // 30 tokens in debt, and refills in 10 s.
    let r = ask(
        &mut client,
        ShouldAllowRequest {
            dry_run: true,
            ..req("t", "k")
        },
    )
    .await;
    assert!(!r.allowed);
    assert_eq!(r.limit, 10);
    assert_eq!(micros(&r.reset_after), 10_000_000);
    assert_eq!(micros(&r.retry_after), 1_000_000);
    server.stop().await;
}

#[tokio::test]
async fn an_invalid_row_is_named_and_rejected_alone() {
    let server = TestServer::start().await;
    let mut client = server.client().await;
    server
        .table
        .execute_sql(
            "INSERT INTO limits (name, tenant, scope, burst, rate, rate_unit) \
             VALUES ('broken', 'acme', 'key', 0, 10, 'second')",
        )
        .await
        .unwrap();
    let error = server.wait_rejected_row().await;
    assert_eq!(
        error,
        "row \"broken\" (tenant \"acme\", resource \"\", scope \"key\"): burst must be at least 1"
    );
    // The row is not in force (it never was valid); every other rule is.
    let r = ask(&mut client, req("acme", "k")).await;
    assert_eq!((r.limit_name.as_str(), r.limit), ("default-per-key", 30));
    let (_, body) = server.http_get("/v1/limits").await.unwrap();
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["status"]["rules"], 1);
    assert_eq!(v["status"]["rejected_rows"], 1);
    // The page lists the table's rows, the rejected one too.
    assert_eq!(v["rules"].as_array().unwrap().len(), 2);
    let (_, metrics) = server.http_get("/metrics").await.unwrap();
    assert!(
        metrics.contains(r#"tollgate_limits_reloads_total{result="failure"}"#),
        "{metrics}"
    );

    // Fixing the row applies it and clears the error.
    server
        .table
        .execute_sql("UPDATE limits SET burst = 7 WHERE name = 'broken'")
        .await
        .unwrap();
    // Generation 2 was the batch that rejected it.
    server.wait_generation(3).await;
    let r = ask(&mut client, req("acme", "k")).await;
    assert_eq!((r.limit_name.as_str(), r.limit), ("broken", 7));
    let (_, body) = server.http_get("/v1/limits").await.unwrap();
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["status"]["rejected_rows"], 0);
    assert!(v["status"]["rejected"].as_array().unwrap().is_empty());
    server.stop().await;
}

#[tokio::test]
async fn deleting_a_tenants_row_falls_back_to_the_default() {
    let server = TestServer::with_rows(&[
        row("default-per-key", "", "", "key", 30, "600/minute"),
        row("acme", "acme", "", "key", 3, "1/hour"),
    ])
    .await;
    let mut client = server.client().await;
    assert_eq!(ask(&mut client, req("acme", "k")).await.limit_name, "acme");
    assert!(server.table.delete("acme").await.unwrap());
    server.wait_generation(2).await;
    assert_eq!(
        ask(&mut client, req("acme", "k")).await.limit_name,
        "default-per-key"
    );
    server.stop().await;
}

#[tokio::test]
async fn the_example_table_in_deploy_loads_and_decides() {
    let server = TestServer::start().await;
    let sql = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/limits-example.sql"
    ))
    .unwrap();
    server.table.execute_sql(&sql).await.unwrap();
    server.wait_generation(2).await;
    let mut client = server.client().await;
    let export = ShouldAllowRequest {
        resource: "exports".into(),
        ..req("globex", "k")
    };
    for left in [2, 1, 0] {
        let r = ask(&mut client, export.clone()).await;
        assert_eq!(
            (r.limit_name.as_str(), r.remaining),
            ("exports-per-key", left)
        );
    }
    let r = ask(&mut client, export).await;
    assert!(!r.allowed);
    assert_eq!(micros(&r.retry_after), 360_000_000);
    let r = ask(&mut client, req("acme", "k")).await;
    assert_eq!((r.limit_name.as_str(), r.limit), ("acme-per-key", 300));
    server.stop().await;
}

#[tokio::test]
async fn a_hostile_rule_name_is_rejected_and_never_reaches_a_terminal_raw() {
    let server = TestServer::start().await;
    let mut client = server.client().await;
    // A name with a terminal escape (clear screen), a right-to-left
    // override and a newline, written by plain SQL.
    server
        .table
        .execute_sql(
            "INSERT INTO limits (name, tenant, scope, burst, rate, rate_unit) \
             VALUES ('evil' || char(27) || '[2J' || char(8238) || char(10) || 'x', \
                     'acme', 'key', 5, 1, 'second')",
        )
        .await
        .unwrap();
    let error = server.wait_rejected_row().await;
    assert!(
        error.ends_with(
            r#"name "evil\u{1b}[2J\u{202e}\nx" contains '\u{1b}'; use ASCII letters, digits, '.', '_' and '-'"#
        ),
        "{error}"
    );
    assert!(
        !error.chars().any(|c| c.is_control() || c == '\u{202e}'),
        "{error:?}"
    );
    // Not in force: acme's decisions go by the default row, and no answer
    // carries the name.
    let r = ask(&mut client, req("acme", "k")).await;
    assert_eq!((r.limit_name.as_str(), r.limit), ("default-per-key", 30));
    // `tollgate limits list` shows it escaped.
    let filter = tollgate::limits::table::RowFilter {
        limit: 10,
        ..Default::default()
    };
    let rows = server.table.rows_page(&filter).await.unwrap();
    let shown = tollgate::cli::render_rows(&rows);
    assert!(shown.contains(r#""evil\u{1b}[2J\u{202e}\nx""#), "{shown}");
    assert!(
        !shown
            .chars()
            .any(|c| (c.is_control() && c != '\n') || c == '\u{202e}'),
        "{shown:?}"
    );
    assert_eq!(shown.lines().count(), 3, "{shown}");
    server.stop().await;
}
