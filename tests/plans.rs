//! Plans and big tables as a user drives them: `tollgate plans …`,
//! `limits set --plan`, `limits import` / `export`, paged `limits list`,
//! and the admin API's plan endpoints, with their bad input.

use crate::common;

use common::TestServer;
use common::process::{ServeProcess, fails, succeeds as run};
use tollgate::api::admin::AdminAccess;

/// The README's walk-through: a tenant moves from `free` to `pro`.
#[test]
fn a_tenant_moves_from_free_to_pro_on_a_running_server() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let server = ServeProcess::start(d, &["--reload-interval", "100ms"]);
    server.wait_ready();
    let url = format!("http://{}", server.grpc);
    run(
        d,
        &["plans", "create", "free", "--description", "the free tier"],
    );
    run(d, &["plans", "create", "pro"]);
    let out = run(
        d,
        &[
            "limits",
            "set",
            "--plan",
            "free",
            "--burst",
            "10",
            "--rate",
            "60/minute",
        ],
    );
    assert_eq!(out, "set plan-free-any-key (burst 10, 60/minute)\n");
    run(
        d,
        &[
            "limits",
            "set",
            "--plan",
            "pro",
            "--burst",
            "1000",
            "--rate",
            "6000/minute",
        ],
    );
    assert_eq!(
        run(
            d,
            &["plans", "assign", "--tenant", "acme", "--plan", "free"]
        ),
        "tenant acme: no plan -> free\n"
    );
    let check = |expect: &str| {
        for _ in 0..200 {
            let line = run(
                d,
                &[
                    "check",
                    "--server",
                    &url,
                    "--tenant",
                    "acme",
                    "--key",
                    "alice",
                    "--dry-run",
                ],
            );
            if line.contains(expect) {
                return line;
            }
            std::thread::sleep(std::time::Duration::from_millis(25));
        }
        panic!("never {expect}");
    };
    check("rule plan-free-any-key (60/minute)");
    assert_eq!(
        run(d, &["plans", "assign", "--tenant", "acme", "--plan", "pro"]),
        "tenant acme: plan free -> pro\n"
    );
    let line = check("rule plan-pro-any-key (6000/minute)");
    // A dry run shows what the request would leave.
    assert!(line.contains("remaining 999/1000"), "{line}");
    let list = run(d, &["plans", "list"]);
    let lines: Vec<&str> = list.lines().collect();
    assert_eq!(lines.len(), 3, "{list}");
    assert!(
        lines[1].starts_with("free") && lines[1].contains("the free tier"),
        "{list}"
    );
    assert!(lines[2].split_whitespace().eq(["pro", "1", "1"]), "{list}");

    // Bad input, each named.
    let err = fails(
        d,
        &["plans", "assign", "--tenant", "acme", "--plan", "gold"],
    );
    assert!(
        err.contains("plan \"gold\" does not exist; create it with `tollgate plans create gold`"),
        "{err}"
    );
    let err = fails(
        d,
        &[
            "limits", "set", "--plan", "gold", "--burst", "1", "--rate", "1/second",
        ],
    );
    assert!(err.contains("plan \"gold\" does not exist"), "{err}");
    let huge = "t".repeat(10 * 1024);
    let err = fails(d, &["plans", "assign", "--tenant", &huge, "--plan", "pro"]);
    assert!(
        err.contains("tenant is 10240 bytes; at most 128 are allowed"),
        "{err}"
    );
    assert!(
        err.len() < 1000,
        "the error does not echo 10 KB: {}",
        err.len()
    );
    let err = fails(d, &["plans", "delete", "pro"]);
    assert!(err.contains("1 tenants are on plan \"pro\""), "{err}");
    run(d, &["plans", "unassign", "--tenant", "acme"]);
    check("rule default-per-key (600/minute)");
    assert_eq!(
        run(d, &["plans", "delete", "pro"]),
        "deleted plan pro and its rules\n"
    );
    let _ = server.terminate();
}

#[test]
fn import_export_and_paged_lists_of_a_big_table() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut csv = String::from("name,tenant,resource,scope,burst,rate,rate_unit\n");
    for i in 0..5000 {
        csv.push_str(&format!("row-{i:05},t{i},,key,{},60,minute\n", 10 + i % 3));
    }
    std::fs::write(d.join("rows.csv"), &csv).unwrap();
    let out = run(d, &["limits", "import", "--create", "rows.csv"]);
    assert_eq!(out, "imported 5000 rows from rows.csv in one transaction\n");
    // Pages in name order, filters.
    let page = run(
        d,
        &[
            "limits", "list", "--prefix", "row-", "--limit", "2", "--json",
        ],
    );
    let rows: serde_json::Value = serde_json::from_str(&page).unwrap();
    assert_eq!(rows[0]["name"], "row-00000");
    assert_eq!(rows[1]["name"], "row-00001");
    let page = run(
        d,
        &[
            "limits",
            "list",
            "--after",
            "row-00001",
            "--limit",
            "1",
            "--json",
        ],
    );
    let rows: serde_json::Value = serde_json::from_str(&page).unwrap();
    assert_eq!(rows[0]["name"], "row-00002");
    let page = run(d, &["limits", "list", "--tenant", "t4999", "--json"]);
    let rows: serde_json::Value = serde_json::from_str(&page).unwrap();
    assert_eq!(rows.as_array().unwrap().len(), 1);
    assert_eq!(
        (rows[0]["name"].as_str(), rows[0]["burst"].as_i64()),
        (Some("row-04999"), Some(11))
    );

    // A bad line imports nothing and names its number.
    let mut bad = csv.replace("row-00000,t0,,key,10", "row-00000,t0,,key,20");
    bad.push_str("row-x,tx,,key,0,60,minute\n");
    std::fs::write(d.join("bad.csv"), &bad).unwrap();
    let err = fails(d, &["limits", "import", "bad.csv"]);
    assert!(
        err.contains("bad.csv: line 5002: row \"row-x\" (tenant \"tx\", resource \"\", scope \"key\"): burst must be at least 1; nothing was imported"),
        "{err}"
    );
    let page = run(d, &["limits", "list", "--tenant", "t0", "--json"]);
    let rows: serde_json::Value = serde_json::from_str(&page).unwrap();
    assert_eq!(
        rows[0]["burst"], 10,
        "the good lines of a bad file are not imported either"
    );
    // A name clash with another owner's row, found by the database.
    std::fs::write(
        d.join("clash.jsonl"),
        "{\"name\":\"row-00001\",\"tenant\":\"other\",\"burst\":1,\"rate\":1}\n",
    )
    .unwrap();
    let err = fails(d, &["limits", "import", "clash.jsonl"]);
    assert!(
        err.contains("line 1: name \"row-00001\" already belongs to a row of tenant \"t1\""),
        "{err}"
    );

    // Export, then import into a new table: the same rows.
    run(d, &["limits", "export", "--output", "all.jsonl"]);
    let exported = std::fs::read_to_string(d.join("all.jsonl")).unwrap();
    assert_eq!(exported.lines().count(), 5001);
    let out = run(
        d,
        &[
            "limits",
            "import",
            "--create",
            "--limits",
            "copy.db",
            "all.jsonl",
        ],
    );
    assert_eq!(
        out,
        "imported 5001 rows from all.jsonl in one transaction\n"
    );
    run(
        d,
        &[
            "limits", "export", "--limits", "copy.db", "--output", "copy.csv",
        ],
    );
    run(d, &["limits", "export", "--output", "all.csv"]);
    assert_eq!(
        std::fs::read_to_string(d.join("copy.csv")).unwrap(),
        std::fs::read_to_string(d.join("all.csv")).unwrap()
    );
}

#[tokio::test]
async fn the_admin_api_manages_plans_and_refuses_bad_input() {
    let access = AdminAccess {
        token: Some("s3cret".into()),
        protect_reads: false,
        trust_network: false,
    };
    let server = TestServer::launch(None, move |c| c.admin_access = access).await;
    let t = Some("s3cret");
    assert_eq!(
        server
            .http("POST", "/v1/plans", None, r#"{"name":"pro"}"#)
            .await
            .0,
        401
    );
    assert_eq!(
        server
            .http("POST", "/v1/plans", t, r#"{"name":"pro"}"#)
            .await,
        (200, r#"{"plan":"pro"}"#.into())
    );
    let (status, body) = server
        .http(
            "POST",
            "/v1/limits",
            t,
            r#"{"plan":"pro","burst":500,"rate":"50/second"}"#,
        )
        .await;
    assert_eq!(
        (status, body.as_str()),
        (200, r#"{"set":"plan-pro-any-key"}"#)
    );
    let (status, body) = server
        .http("PUT", "/v1/tenants/acme/plan", t, r#"{"plan":"pro"}"#)
        .await;
    assert_eq!(
        (status, body.as_str()),
        (200, r#"{"plan":"pro","tenant":"acme","was":null}"#)
    );
    // Applied on this instance before the answer.
    let mut client = server.client().await;
    let r = common::ask(&mut client, common::req("acme", "k")).await;
    assert_eq!((r.limit_name.as_str(), r.limit), ("plan-pro-any-key", 500));

    let (status, body) = server
        .http("PUT", "/v1/tenants/acme/plan", t, r#"{"plan":"gold"}"#)
        .await;
    assert_eq!(status, 404);
    assert!(body.starts_with("plan \"gold\" does not exist"), "{body}");
    let huge = "t".repeat(10 * 1024);
    let (status, body) = server
        .http(
            "PUT",
            &format!("/v1/tenants/{huge}/plan"),
            t,
            r#"{"plan":"pro"}"#,
        )
        .await;
    assert_eq!(status, 400);
    assert_eq!(body, "tenant is 10240 bytes; at most 128 are allowed\n");
    let (status, body) = server
        .http(
            "POST",
            "/v1/limits",
            t,
            &format!(r#"{{"tenant":"{huge}","burst":1,"rate":"1/second"}}"#),
        )
        .await;
    assert_eq!(status, 400);
    assert!(
        body.len() < 600 && body.contains("tenant is 10240 bytes"),
        "{body}"
    );
    let (status, body) = server
        .http(
            "POST",
            "/v1/limits",
            t,
            r#"{"tenant":"a","plan":"pro","burst":1,"rate":"1/second"}"#,
        )
        .await;
    assert_eq!(status, 400);
    assert!(
        body.contains("a row belongs to a tenant or to a plan, not both"),
        "{body}"
    );
    let (status, body) = server.http("DELETE", "/v1/plans/pro", t, "").await;
    assert_eq!(status, 409);
    assert!(body.starts_with("1 tenants are on plan \"pro\""), "{body}");
    assert_eq!(
        server
            .http("DELETE", "/v1/plans/pro?force=true", t, "")
            .await
            .0,
        200
    );
    let r = common::ask(&mut client, common::req("acme", "k")).await;
    assert_eq!(r.limit_name, "default-per-key");
    // Pages of rows: bounded, and a bad query is named.
    let (status, body) = server.http("GET", "/v1/limits?limit=5000", None, "").await;
    assert_eq!(
        (status, body.as_str()),
        (400, "limit is 5000; ask for 1 to 1000 rows a page\n")
    );
    let (status, body) = server.http("GET", "/v1/limits?tier=x", None, "").await;
    assert_eq!(status, 400);
    assert!(body.contains("unknown field `tier`"), "{body}");
    let (status, body) = server.http("GET", "/v1/limits?limit=1", None, "").await;
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["rules"].as_array().unwrap().len(), 1);
    assert_eq!(v["next"], "default-per-key");
    server.stop().await;
}
