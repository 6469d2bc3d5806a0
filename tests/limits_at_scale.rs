//! Limits as data at scale: every instance reads only what changed, a
//! transaction applies whole, plans change many tenants in one edit, a bad
//! row is rejected alone, and edits made while PostgreSQL was away are
//! caught up. Real `tollgate serve` processes, real SQLite and PostgreSQL.

use crate::common;

use std::path::Path;
use std::time::Duration;

use common::postgres::Postgres;
use common::process::{ServeProcess, stdout, tollgate};
use common::{TestServer, row};
use tollgate::limits::table::LimitsTable;
use tollgate::proto::v1::rate_limiter_client::RateLimiterClient;
use tollgate::proto::v1::{BatchItem, ShouldAllowBatchRequest, ShouldAllowRequest};
use tonic::transport::Channel;

async fn client(grpc: &str) -> RateLimiterClient<Channel> {
    RateLimiterClient::connect(format!("http://{grpc}"))
        .await
        .unwrap()
}

/// The deciding rule and burst for `tenant`, asked without spending.
async fn limit_of(client: &mut RateLimiterClient<Channel>, tenant: &str) -> (String, u64) {
    let r = client
        .should_allow(ShouldAllowRequest {
            tenant: tenant.into(),
            key: "k".into(),
            cost: 1,
            dry_run: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    (r.limit_name, r.limit)
}

/// Waits (bounded: 10 s) until `tenant` is decided by `want` on `client`.
async fn eventually(client: &mut RateLimiterClient<Channel>, tenant: &str, want: (&str, u64)) {
    for _ in 0..500 {
        let got = limit_of(client, tenant).await;
        if (got.0.as_str(), got.1) == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!(
        "{tenant} never got {want:?}; has {:?}",
        limit_of(client, tenant).await
    );
}

fn admin_json(server: &ServeProcess, path: &str) -> serde_json::Value {
    let response = server.admin_get(path).unwrap();
    let body = response.split_once("\r\n\r\n").unwrap().1;
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

fn three_instances(dir: &Path, limits: &str) -> Vec<ServeProcess> {
    (0..3)
        .map(|_| {
            let p = ServeProcess::start(dir, &["--limits", limits, "--reload-interval", "200ms"]);
            p.wait_ready();
            p
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_sql_inserts_updates_and_deletes_reach_three_instances_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("limits.db");
    let path = path.to_str().unwrap();
    let table = LimitsTable::open(path).await.unwrap();
    let servers = three_instances(dir.path(), path);
    let mut clients = Vec::new();
    for s in &servers {
        clients.push(client(&s.grpc).await);
    }
    for c in &mut clients {
        assert_eq!(limit_of(c, "acme").await, ("default-per-key".into(), 30));
    }
    table
        .execute_sql(
            "INSERT INTO limits (name, tenant, burst, rate) VALUES ('acme-gold', 'acme', 500, 50)",
        )
        .await
        .unwrap();
    for c in &mut clients {
        eventually(c, "acme", ("acme-gold", 500)).await;
    }
    table
        .execute_sql("UPDATE limits SET burst = 600 WHERE name = 'acme-gold'")
        .await
        .unwrap();
    for c in &mut clients {
        eventually(c, "acme", ("acme-gold", 600)).await;
    }
    // A delete (which `updated_at` could never show) falls back to the
    // default rows.
    table
        .execute_sql("DELETE FROM limits WHERE name = 'acme-gold'")
        .await
        .unwrap();
    for c in &mut clients {
        eventually(c, "acme", ("default-per-key", 30)).await;
    }
    // Each instance applied the three edits as three batches after its
    // first load, reading one owner each time, and reached the version.
    let version = table.version().await.unwrap();
    for s in &servers {
        let status = &admin_json(s, "/v1/limits")["status"];
        assert_eq!(status["version"], version);
        assert_eq!(status["rules"], 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_of_a_hundred_thousand_rows_applies_whole() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    const N: usize = 100_000;
    // Decisions probe the first and the last tenant of the bulk edit in one
    // request (one snapshot) while it is written and applied.
    let probe = {
        let mut c = c.clone();
        tokio::spawn(async move {
            let mut answers = 0u64;
            loop {
                let r = c
                    .should_allow_batch(ShouldAllowBatchRequest {
                        items: ["t0", "t99999"]
                            .iter()
                            .map(|t| BatchItem {
                                key: "k".into(),
                                cost: 1,
                                tenant: (*t).into(),
                                resource: String::new(),
                            })
                            .collect(),
                        dry_run: true,
                    })
                    .await
                    .unwrap()
                    .into_inner();
                let names: Vec<&str> = r.results.iter().map(|x| x.limit_name.as_str()).collect();
                answers += 1;
                match names[..] {
                    ["default-per-key", "default-per-key"] => {}
                    ["bulk-t0", "bulk-t99999"] => return answers,
                    _ => panic!("a decision saw half of the bulk edit: {names:?}"),
                }
                if answers > 200_000 {
                    panic!("the bulk edit never applied");
                }
            }
        })
    };
    let mut sql = String::from("BEGIN;\n");
    for chunk in (0..N).collect::<Vec<_>>().chunks(5000) {
        sql.push_str("INSERT INTO limits (name, tenant, burst, rate) VALUES ");
        let values: Vec<String> = chunk
            .iter()
            .map(|i| format!("('bulk-t{i}', 't{i}', {}, 10)", 100 + i % 7))
            .collect();
        sql.push_str(&values.join(","));
        sql.push_str(";\n");
    }
    sql.push_str("COMMIT;");
    server.table.execute_sql(&sql).await.unwrap();
    let answers = probe.await.unwrap();
    assert!(answers >= 1);
    for i in [0, 1, 4242, N - 1] {
        assert_eq!(
            limit_of(&mut c, &format!("t{i}")).await,
            (format!("bulk-t{i}"), 100 + (i % 7) as u64)
        );
    }
    // The status follows the swap of the rules (on the idle thread, which
    // a busy machine may hold back for a moment): read until it has.
    let mut v = serde_json::Value::Null;
    for _ in 0..500 {
        let (_, body) = server.http_get("/v1/limits?limit=1").await.unwrap();
        v = serde_json::from_str(&body).unwrap();
        if v["status"]["rules"] == N + 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(v["status"]["rules"], N + 1);
    assert_eq!(v["status"]["tenants"], N);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_change_reaches_every_tenant_on_the_plan_and_a_move_is_one_row() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    let t = &server.table;
    t.create_plan("free", "the free tier").await.unwrap();
    t.create_plan("pro", "").await.unwrap();
    let plan_rule = |plan: &str, burst: i64| {
        let unnamed = tollgate::limits::LimitRow::from_request(
            String::new(),
            String::new(),
            "key",
            burst,
            "100/minute",
            "enforce",
            "allow",
            0,
            "rate",
            None,
        )
        .unwrap();
        unnamed.for_plan(plan.into(), false)
    };
    t.upsert(&plan_rule("free", 10)).await.unwrap();
    t.upsert(&plan_rule("pro", 1000)).await.unwrap();
    // 2 000 tenants on free, by plain SQL in one statement.
    let values: Vec<String> = (0..2000).map(|i| format!("('c{i}', 'free')")).collect();
    t.execute_sql(&format!(
        "INSERT INTO tenants (tenant, plan) VALUES {}",
        values.join(",")
    ))
    .await
    .unwrap();
    eventually(&mut c, "c1999", ("plan-free-any-key", 10)).await;
    // One edit of the plan's rule changes it for all of them.
    t.execute_sql("UPDATE limits SET burst = 20 WHERE plan = 'free'")
        .await
        .unwrap();
    eventually(&mut c, "c0", ("plan-free-any-key", 20)).await;
    for i in 0..2000 {
        assert_eq!(
            limit_of(&mut c, &format!("c{i}")).await,
            ("plan-free-any-key".into(), 20),
            "c{i}"
        );
    }
    // Moving one tenant is one row; a tenant's own row still wins.
    t.assign("c7", Some("pro")).await.unwrap();
    eventually(&mut c, "c7", ("plan-pro-any-key", 1000)).await;
    assert_eq!(
        limit_of(&mut c, "c8").await,
        ("plan-free-any-key".into(), 20)
    );
    t.upsert(&row("c7-own", "c7", "", "key", 3, "1/second"))
        .await
        .unwrap();
    eventually(&mut c, "c7", ("c7-own", 3)).await;
    // A plan that does not exist is refused.
    let err = t
        .assign("c8", Some("platinum"))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("plan \"platinum\" does not exist"), "{err}");
    // A plan with tenants is not deleted unless forced; then they get the
    // default rows and the status names the missing plan.
    let err = t.delete_plan("free", false).await.unwrap_err().to_string();
    assert!(
        err.starts_with("1999 tenants are on plan \"free\""),
        "{err}"
    );
    t.execute_sql("DELETE FROM plans WHERE name = 'free'")
        .await
        .unwrap();
    eventually(&mut c, "c8", ("default-per-key", 30)).await;
    let (_, body) = server.http_get("/v1/plans").await.unwrap();
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["missing"][0]["plan"], "free");
    assert_eq!(v["missing"][0]["tenants"], 1999);
    assert_eq!(v["plans"][0]["name"], "pro");
    assert_eq!(v["plans"][0]["tenants"], 1);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_row_amid_good_ones_is_rejected_alone_and_keeps_its_last_valid_version() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    let t = &server.table;
    t.upsert(&row("acme", "acme", "", "key", 7, "1/second"))
        .await
        .unwrap();
    eventually(&mut c, "acme", ("acme", 7)).await;
    // One transaction: a bad edit of acme's row amid good rows.
    let huge = "h".repeat(10 * 1024);
    t.execute_sql(&format!(
        "BEGIN; UPDATE limits SET rate_unit = 'fortnight' WHERE name = 'acme'; \
         INSERT INTO limits (name, tenant, burst, rate) VALUES ('globex', 'globex', 8, 1); \
         INSERT INTO limits (name, tenant, burst, rate) VALUES ('huge', '{huge}', 9, 1); \
         INSERT INTO limits (name, tenant, burst, rate) VALUES ('initech', 'initech', 10, 1); COMMIT;"
    ))
    .await
    .unwrap();
    eventually(&mut c, "initech", ("initech", 10)).await;
    assert_eq!(limit_of(&mut c, "globex").await, ("globex".into(), 8));
    // acme keeps its last valid version.
    assert_eq!(limit_of(&mut c, "acme").await, ("acme".into(), 7));
    let (_, body) = server.http_get("/v1/limits").await.unwrap();
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let rejected: Vec<&str> = v["status"]["rejected"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .collect();
    assert_eq!(rejected.len(), 2, "{rejected:?}");
    assert!(
        rejected[0].starts_with("row \"acme\" (tenant \"acme\""),
        "{rejected:?}"
    );
    assert!(rejected[0].contains("rate_unit is \"fortnight\""));
    // The 10 KB tenant is named by its start, not copied whole.
    assert!(rejected[1].contains("... (10240 bytes)"), "{rejected:?}");
    assert!(rejected[1].len() < 600);
    assert_eq!(v["status"]["rejected_rows"], 2);
    let (_, metrics) = server.http_get("/metrics").await.unwrap();
    assert!(
        metrics.contains("tollgate_limits_rejected_rows 2"),
        "{metrics}"
    );
    // Fixed: applies, and the list empties of it.
    t.execute_sql("UPDATE limits SET rate_unit = 'second', burst = 70 WHERE name = 'acme'")
        .await
        .unwrap();
    eventually(&mut c, "acme", ("acme", 70)).await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_behind_the_pruned_change_log_reads_everything_again() {
    let server = TestServer::start().await;
    let mut c = server.client().await;
    let t = &server.table;
    t.upsert(&row("a", "a", "", "key", 5, "1/second"))
        .await
        .unwrap();
    eventually(&mut c, "a", ("a", 5)).await;
    // A second handle on the table stands for an instance that was away:
    // edits are made and the log is pruned before it catches up.
    let away = tollgate::limits::watch::LiveLimits::load(t, 1000)
        .await
        .unwrap();
    t.upsert(&row("b", "b", "", "key", 6, "1/second"))
        .await
        .unwrap();
    t.execute_sql("DELETE FROM limits WHERE name = 'a'; UPDATE limits_changes SET at = at - 3600")
        .await
        .unwrap();
    let pruned = t
        .prune_changes(tollgate::limits::table::CHANGE_LOG_RETENTION)
        .await
        .unwrap();
    assert!(pruned >= 2, "{pruned}");
    assert!(away.catch_up(t).await.unwrap());
    let rules = away.snapshot();
    let names = |tenant: &str| -> Vec<String> {
        rules
            .applicable(tenant, "")
            .map(|r| r.name.to_string())
            .collect()
    };
    assert_eq!(names("a"), ["default-per-key"]);
    assert_eq!(names("b"), ["b"]);
    assert_eq!(away.status().rules, 2);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarted_while_edits_are_made_loses_no_edit_on_three_instances() {
    let mut pg = Postgres::start();
    let url = pg.url();
    let table = LimitsTable::open(&url).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let servers = three_instances(dir.path(), &url);
    let mut clients = Vec::new();
    for s in &servers {
        clients.push(client(&s.grpc).await);
    }
    table.create_plan("pro", "").await.unwrap();
    table
        .upsert(
            &row("plan-pro-any-key", "", "", "key", 100, "1/second").for_plan("pro".into(), true),
        )
        .await
        .unwrap();
    table.assign("early", Some("pro")).await.unwrap();
    for c in &mut clients {
        eventually(c, "early", ("plan-pro-any-key", 100)).await;
    }
    table.close().await;
    pg.kill();
    pg.restart();
    // Edits right after the restart, while the instances' listeners are
    // still reconnecting: their notifications reach nobody.
    let table = LimitsTable::open(&url).await.unwrap();
    for i in 0..30 {
        table
            .upsert(&row(
                &format!("r{i}"),
                &format!("t{i}"),
                "",
                "key",
                10 + i,
                "1/second",
            ))
            .await
            .unwrap();
    }
    table
        .execute_sql("UPDATE limits SET burst = 200 WHERE plan = 'pro'; DELETE FROM limits WHERE name = 'r3'")
        .await
        .unwrap();
    for c in &mut clients {
        eventually(c, "t29", ("r29", 39)).await;
        eventually(c, "early", ("plan-pro-any-key", 200)).await;
        for i in 0..30 {
            let want = if i == 3 {
                ("default-per-key".to_owned(), 30)
            } else {
                (format!("r{i}"), 10 + i)
            };
            eventually(c, &format!("t{i}"), (&want.0, want.1)).await;
        }
    }
    // TRUNCATE logs no rows: every instance reads the whole table again.
    table.execute_sql("TRUNCATE tenants").await.unwrap();
    for c in &mut clients {
        eventually(c, "early", ("default-per-key", 30)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_database_gone_in_the_middle_of_an_import_imports_nothing() {
    let mut pg = Postgres::start();
    let url = pg.url();
    let table = LimitsTable::open(&url).await.unwrap();
    let before = table.count().await.unwrap();
    table.close().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("rows.csv");
    let mut text = String::from("name,tenant,burst,rate\n");
    for i in 0..300_000 {
        text.push_str(&format!("n{i},t{i},5,1\n"));
    }
    std::fs::write(&file, text).unwrap();
    let mut import = std::process::Command::new(common::process::BIN)
        .args(["limits", "import", "--limits", &url, file.to_str().unwrap()])
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Kill the database once the import has staged rows (its progress on
    // standard error says so).
    let mut stderr = import.stderr.take().unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    while !String::from_utf8_lossy(&seen).contains("staged 10000/") {
        use std::io::Read;
        let n = stderr.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "the import ended first: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    pg.kill();
    let out = import.wait_with_output().unwrap();
    assert!(!out.status.success(), "{}", stdout_of(&out));
    let mut rest = String::new();
    use std::io::Read;
    stderr.read_to_string(&mut rest).unwrap();
    assert!(rest.contains("limits table:"), "{rest}");
    pg.restart();
    let table = LimitsTable::open(&url).await.unwrap();
    assert_eq!(table.count().await.unwrap(), before);
}

fn stdout_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_table_beyond_the_memory_bound_is_a_clear_start_up_error() {
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let t = LimitsTable::open(dir.path().join("limits.db").to_str().unwrap())
            .await
            .unwrap();
        for i in 0..10 {
            t.upsert(&row(
                &format!("r{i}"),
                &format!("t{i}"),
                "",
                "key",
                1,
                "1/second",
            ))
            .await
            .unwrap();
        }
    });
    let out = tollgate(
        dir.path(),
        &[
            "serve",
            "--limits",
            "limits.db",
            "--max-limit-rows",
            "5",
            "--grpc-addr",
            "127.0.0.1:0",
            "--admin-addr",
            "127.0.0.1:0",
        ],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "the limits and tenants tables hold 11 rows; this instance keeps at most 5 in memory"
        ),
        "{err}"
    );
    let _ = stdout(&out);
}

/// Rows are read in chunks of length-prefixed values: values holding the
/// characters a separator-based encoding would trip on (commas, digits,
/// U+001E, U+001F, multi-byte text) are read exactly, are rejected alone
/// when invalid, and never move into another row or tenant.
async fn awkward_values_are_read_exactly(limits: &str, table: &LimitsTable) {
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(
        dir.path(),
        &["--limits", limits, "--reload-interval", "100ms"],
    );
    server.wait_ready();
    let mut c = client(&server.grpc).await;
    table
        .upsert(&row("victim", "victim", "", "key", 5, "1/second"))
        .await
        .unwrap();
    eventually(&mut c, "victim", ("victim", 5)).await;
    // `3,victim` after a tenant's own length prefix would read as the next
    // value to a parser that trusted separators.
    table
        .execute_sql(
            "BEGIN; \
             INSERT INTO limits (name, tenant, burst, rate) VALUES ('12,3,victim', 'x,3,victim', 9, 1); \
             INSERT INTO limits (name, tenant, burst, rate) VALUES \
                 ('sep' || char(31) || '4,victim' || char(30), 'sep', 8, 1); \
             INSERT INTO limits (name, tenant, burst, rate) VALUES ('grüße,1,', 'grusse', 12, 1); \
             INSERT INTO limits (name, tenant, burst, rate) VALUES ('good', 'good', 13, 1); \
             COMMIT;"
                .replace("char(", if table.is_postgres() { "chr(" } else { "char(" })
                .as_str(),
        )
        .await
        .unwrap();
    eventually(&mut c, "good", ("good", 13)).await;
    assert_eq!(limit_of(&mut c, "victim").await, ("victim".into(), 5));
    let v = admin_json(&server, "/v1/limits?limit=1");
    let rejected: Vec<&str> = v["status"]["rejected"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .collect();
    // Each awkward row is rejected alone, named by its exact values.
    assert_eq!(
        rejected,
        [
            "row \"12,3,victim\" (tenant \"x,3,victim\", resource \"\", scope \"key\"): tenant \
             \"x,3,victim\" contains ','; use ASCII letters, digits, '.', '_' and '-'",
            "row \"sep\\u{1f}4,victim\\u{1e}\" (tenant \"sep\", resource \"\", scope \"key\"): name \
             \"sep\\u{1f}4,victim\\u{1e}\" contains '\\u{1f}'; use ASCII letters, digits, '.', '_' and '-'",
            "row \"grüße,1,\" (tenant \"grusse\", resource \"\", scope \"key\"): name \"grüße,1,\" \
             contains 'ü'; use ASCII letters, digits, '.', '_' and '-'",
        ]
    );
    assert_eq!(v["status"]["rejected_rows"], 3);
    // The default row, victim's and good's.
    assert_eq!(v["status"]["rules"], 3, "{v}");
    if !table.is_postgres() {
        // SQLite lets a number column hold text: the row is rejected,
        // naming the value.
        table
            .execute_sql("UPDATE limits SET burst = '7,many' WHERE name = 'good'")
            .await
            .unwrap();
        let version = table.version().await.unwrap();
        for _ in 0..500 {
            if admin_json(&server, "/v1/limits?limit=1")["status"]["version"] == version {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let v = admin_json(&server, "/v1/limits?limit=1");
        assert_eq!(v["status"]["version"], version);
        let rejected = v["status"]["rejected"][3].as_str().unwrap();
        assert!(
            rejected.starts_with("row \"good\" (tenant \"good\""),
            "{rejected}"
        );
        assert!(
            rejected.contains("the burst column holds \\\"7,many\\\", not a whole number"),
            "{rejected}"
        );
        // Its last valid version stays.
        assert_eq!(limit_of(&mut c, "good").await, ("good".into(), 13));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn awkward_values_are_read_exactly_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("limits.db");
    let limits = path.to_str().unwrap();
    let table = LimitsTable::open(limits).await.unwrap();
    awkward_values_are_read_exactly(limits, &table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn awkward_values_are_read_exactly_on_postgres() {
    let pg = Postgres::start();
    let url = pg.url();
    let table = LimitsTable::open(&url).await.unwrap();
    awkward_values_are_read_exactly(&url, &table).await;
}

/// A small edit is read and applied on the watcher's thread, at the
/// process's own priority, so that it comes into force within a second
/// however busy the decision threads are; a bulk edit (more than a
/// thousand changes) on the bulk thread, in the idle scheduling class, so
/// that it takes no core from a decision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_edits_apply_on_the_watcher_and_bulk_edits_on_the_idle_thread() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("limits.db");
    let limits = path.to_str().unwrap();
    let table = LimitsTable::open(limits).await.unwrap();
    let server = ServeProcess::start(
        dir.path(),
        &["--limits", limits, "--reload-interval", "100ms"],
    );
    server.wait_ready();
    let mut c = client(&server.grpc).await;
    table
        .upsert(&row("acme", "acme", "", "key", 7, "1/second"))
        .await
        .unwrap();
    eventually(&mut c, "acme", ("acme", 7)).await;
    // 1 001 changes in one transaction: the bulk thread's.
    let mut sql = String::from("BEGIN;");
    for i in 0..1001 {
        sql.push_str(&format!(
            "INSERT INTO limits (name, tenant, burst, rate) VALUES ('b{i}', 'b{i}', 11, 1);"
        ));
    }
    sql.push_str("COMMIT;");
    table.execute_sql(&sql).await.unwrap();
    eventually(&mut c, "b1000", ("b1000", 11)).await;
    // 500 changes: the watcher's.
    table
        .execute_sql("UPDATE limits SET burst = 12 WHERE name LIKE 'b%' AND id % 2 = 0")
        .await
        .unwrap();
    eventually(&mut c, "b999", ("b999", 12)).await;
    let (_, logs) = server.terminate();
    let applied: Vec<(String, String)> = logs
        .iter()
        .filter(|l| l.contains("limits applied"))
        .map(|l| {
            let field = |name: &str| {
                let at = l.find(&format!("{name}=")).unwrap() + name.len() + 1;
                l[at..].split_whitespace().next().unwrap().to_owned()
            };
            (field("rules"), field("thread").trim_matches('"').to_owned())
        })
        .collect();
    // acme's row, the 1 001 rows, the 500.
    assert_eq!(
        applied,
        [
            ("2".to_owned(), "limits-watch".to_owned()),
            ("1003".into(), "limits-bulk".into()),
            ("1003".into(), "limits-watch".into()),
        ],
        "{logs:#?}"
    );
}
