//! The explain view as a support engineer uses it: `GET /v1/explain`,
//! `tollgate.v1.Admin/Explain` and `tollgate explain` against a real
//! server, for a tenant's key (limits-table rules: tenant row, plan,
//! default; rates, a concurrency cap, a quota, a shadow rule) and for an
//! Envoy domain's descriptors. It names every rule and the rows each won
//! over, reads each bucket's state, dry-runs a cost, lists the key's
//! recent decisions, writes nothing, counts nothing, and needs the admin
//! token.

use crate::common;

use serde_json::Value;
use tollgate::limits::LimitRow;
use tollgate::proto::v1::admin_client::AdminClient;
use tollgate::proto::v1::explain_descriptor::Entry;
use tollgate::proto::v1::{AcquireRequest, ExplainDescriptor, ExplainRequest};
use tonic::Code;

use common::envoy::{ask, config_dir, descriptor, request_in};
use common::{TestServer, req, row};

const TOKEN: &str = "s3cret-token";

fn kind(mut r: LimitRow, kind: &str, plan: &str, tenant: &str) -> LimitRow {
    r.kind = kind.parse().unwrap();
    r.plan = plan.into();
    r.tenant = tenant.into();
    r
}

/// The rows: acme's own per-key row over plan pro's and the default; a
/// default resource row with acme's shadow beside it; acme's ceiling;
/// plan pro's concurrency cap and monthly quota.
fn rows() -> Vec<LimitRow> {
    let mut shadow = row("exports-shadow", "acme", "exports", "key", 1, "1/hour");
    shadow.mode = "shadow".parse().unwrap();
    let slots = LimitRow::from_request(
        String::new(),
        String::new(),
        "tenant",
        3,
        "",
        "enforce",
        "allow",
        0,
        "concurrency",
        Some("pro-slots".into()),
    )
    .unwrap();
    let quota = LimitRow::from_request(
        String::new(),
        String::new(),
        "tenant",
        0,
        "1000/month",
        "enforce",
        "allow",
        0,
        "quota",
        Some("pro-monthly".into()),
    )
    .unwrap();
    vec![
        row("default-keys", "", "", "key", 100, "100/minute"),
        kind(
            row("pro-keys", "", "", "key", 10, "10/minute"),
            "rate",
            "pro",
            "",
        ),
        row("acme-keys", "acme", "", "key", 4, "4/minute"),
        row("exports", "", "exports", "key", 2, "2/hour"),
        shadow,
        row("acme-ceiling", "acme", "", "tenant", 50, "50/minute"),
        kind(slots, "concurrency", "pro", ""),
        kind(quota, "quota", "pro", ""),
    ]
}

async fn server_with_token(rows: &[LimitRow]) -> TestServer {
    server_on(rows, None).await
}

/// The server on the in-process store, or on the Redis at `redis`.
async fn server_on(rows: &[LimitRow], redis: Option<String>) -> TestServer {
    let (plan, own): (Vec<LimitRow>, Vec<LimitRow>) =
        rows.iter().cloned().partition(|r| !r.plan.is_empty());
    let server = TestServer::launch(Some(&own), |c| {
        c.admin_access.token = Some(TOKEN.into());
        if let Some(url) = redis {
            c.store = tollgate::server::StoreSpec::Redis(url);
            c.redis_uses_clock = true;
        }
    })
    .await;
    server.table.create_plan("pro", "").await.unwrap();
    for r in &plan {
        server.table.upsert(r).await.unwrap();
    }
    server.table.assign("acme", Some("pro")).await.unwrap();
    // The reload picks the plan up: acme's slots come from plan pro.
    for _ in 0..500 {
        let (_, body) = explain_http(&server, "tenant=acme&key=k").await;
        if body.contains("pro-slots") {
            return server;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("the server did not apply the plan assignment");
}

async fn explain_http(server: &TestServer, query: &str) -> (u16, String) {
    server
        .http("GET", &format!("/v1/explain?{query}"), Some(TOKEN), "")
        .await
}

async fn explain_json(server: &TestServer, query: &str) -> Value {
    let (status, body) = explain_http(server, query).await;
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

fn authorized<T>(message: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.metadata_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    r
}

fn native(tenant: &str, key: &str, resource: &str, cost: u64) -> ExplainRequest {
    ExplainRequest {
        tenant: tenant.into(),
        key: key.into(),
        resource: resource.into(),
        cost,
        ..Default::default()
    }
}

/// Spends acme/alice on exports three times (2 admitted: the second
/// shadow-refused; the third refused by `exports`) and takes two of plan
/// pro's slots for bob.
async fn traffic(server: &TestServer) {
    let mut client = server.client().await;
    for _ in 0..3 {
        let mut r = req("acme", "alice");
        r.resource = "exports".into();
        client.should_allow(r).await.unwrap();
    }
    for _ in 0..2 {
        let a = client
            .acquire(AcquireRequest {
                key: "bob".into(),
                tenant: "acme".into(),
                resource: String::new(),
                ttl: Some(prost_types::Duration {
                    seconds: 30,
                    nanos: 0,
                }),
                cost: 0,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(a.granted);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_names_each_rule_its_owner_and_its_bucket_and_writes_nothing() {
    explains_and_writes_nothing(server_with_token(&rows()).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_reads_the_same_state_from_redis() {
    let redis = common::redis::RedisServer::start();
    explains_and_writes_nothing(server_on(&rows(), Some(redis.url())).await).await;
}

async fn explains_and_writes_nothing(server: TestServer) {
    traffic(&server).await;
    let (_, before) = server.http_get("/v1/status").await.unwrap();
    let e = explain_json(&server, "tenant=acme&key=alice&resource=exports&cost=1").await;
    assert_eq!(e["plan"], "pro");
    let rules = e["rules"].as_array().unwrap();
    let summary: Vec<(&str, &str, &str, &str)> = rules
        .iter()
        .map(|r| {
            (
                r["name"].as_str().unwrap(),
                r["owner"].as_str().unwrap(),
                r["kind"].as_str().unwrap(),
                r["mode"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            ("acme-keys", "tenant", "rate", "enforce"),
            ("exports", "default", "rate", "enforce"),
            ("exports-shadow", "tenant", "rate", "shadow"),
            ("acme-ceiling", "tenant", "rate", "enforce"),
            ("pro-slots", "plan", "concurrency", "enforce"),
            ("pro-monthly", "plan", "quota", "enforce"),
        ],
        "{e:#}"
    );
    // acme's own row won its slot over plan pro's and the default's.
    let over: Vec<(&str, &str)> = rules[0]["won_over"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| (o["name"].as_str().unwrap(), o["owner"].as_str().unwrap()))
        .collect();
    assert_eq!(over, [("pro-keys", "plan"), ("default-keys", "default")]);
    assert_eq!(rules[0]["limit"]["burst"], 4);
    assert_eq!(rules[0]["limit"]["rate"], "4/minute");
    // Two of the three requests were admitted: 2 of acme-keys' 4 left;
    // exports is empty, one token back in 30 minutes (the clock stands).
    let state = |n: usize| &rules[n]["state"];
    assert_eq!(state(0)["bucket"], "acme:k::alice");
    assert_eq!(state(0)["remaining"], 2);
    assert_eq!(state(0)["would_admit"], true);
    // All or nothing: exports refuses, so nothing is spent here either.
    assert_eq!(state(0)["remaining_after"], 2);
    assert_eq!(state(1)["remaining"], 0);
    assert_eq!(state(1)["would_admit"], false);
    assert_eq!(state(1)["retry_after_us"], 1_800_000_000u64);
    assert_eq!(state(3)["remaining"], 48);
    // Bob holds two of the tenant's three slots, for 30 s.
    assert_eq!(state(4)["held"], 2);
    assert_eq!(state(4)["remaining"], 1);
    assert_eq!(state(4)["full_in_us"], 30_000_000u64);
    assert_eq!(state(4)["would_admit"], true);
    // The quota counted both admitted requests this month.
    assert_eq!(state(5)["used"], 2);
    assert_eq!(state(5)["remaining"], 998);
    assert!(state(5)["period_end"].as_str().unwrap().ends_with("Z"));
    // What ShouldAllow of cost 1 would answer now.
    let dry = &e["dry_run"];
    assert_eq!(dry["allowed"], false);
    assert_eq!(dry["rule"], "exports");
    assert_eq!(dry["retry_after_us"], 1_800_000_000u64);
    assert_eq!(dry["headers"]["Retry-After"], "1800");
    // Recent decisions, newest first: every refusal, the admission.
    let recent: Vec<(&str, u64)> = e["recent"]["decisions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["outcome"].as_str().unwrap(), d["cost"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        recent,
        [("rejected", 1), ("shadow_rejected", 1), ("allowed", 1)]
    );
    assert_eq!(e["recent"]["decisions"][0]["rule"], "exports");
    assert_eq!(e["recent"]["decisions"][1]["rule"], "exports");

    // Nothing written, nothing counted: the same state again, the same
    // decision totals, no new recent decision.
    let again = explain_json(&server, "tenant=acme&key=alice&resource=exports&cost=1").await;
    assert_eq!(again["rules"], e["rules"]);
    assert_eq!(again["recent"], e["recent"]);
    let (_, after) = server.http_get("/v1/status").await.unwrap();
    let totals = |s: &str| serde_json::from_str::<Value>(s).unwrap()["decisions_total"].clone();
    assert_eq!(totals(&after), totals(&before));

    // A cost no bucket can hold: refused for ever, not an error.
    let big = explain_json(&server, "tenant=acme&key=carol&cost=5").await;
    assert_eq!(big["dry_run"]["allowed"], false);
    assert_eq!(big["dry_run"]["rule"], "acme-keys");
    assert!(big["dry_run"]["retry_after_us"].is_null());
    assert_eq!(big["rules"][0]["state"]["remaining"], 4);

    // The gRPC call answers the same.
    let mut admin = AdminClient::new(server.channel().await);
    let g = admin
        .explain(authorized(native("acme", "alice", "exports", 1)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(g.plan, "pro");
    let names: Vec<(&str, &str)> = g.rules.iter().map(|r| (&*r.name, &*r.owner)).collect();
    assert_eq!(names[0], ("acme-keys", "tenant"));
    assert_eq!(g.rules.len(), 6);
    assert_eq!(g.rules[0].won_over[0].name, "pro-keys");
    let s4 = g.rules[4].state.as_ref().unwrap();
    assert_eq!((s4.held, s4.remaining), (Some(2), 1));
    let s5 = g.rules[5].state.as_ref().unwrap();
    assert_eq!(s5.used, Some(2));
    let dry = g.dry_run.unwrap();
    assert_eq!((dry.allowed, dry.rule.as_str()), (false, "exports"));
    assert_eq!(common::micros(&dry.retry_after), 1_800_000_000);
    assert_eq!(dry.headers["Retry-After"], "1800");
    let recent = g.recent.unwrap();
    assert_eq!(recent.decisions.len(), 3);
    assert_eq!(recent.decisions[0].outcome, "rejected");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_needs_the_admin_token_and_says_what_to_fix() {
    let server = server_with_token(&rows()).await;
    // HTTP: no token, a wrong one.
    let (status, _) = server
        .http("GET", "/v1/explain?tenant=acme&key=a", None, "")
        .await;
    assert_eq!(status, 401);
    let (status, _) = server
        .http("GET", "/v1/explain?tenant=acme&key=a", Some("nope"), "")
        .await;
    assert_eq!(status, 401);
    // Bad input, with the token: what to fix.
    for (query, says) in [
        ("tenant=acme", "key is empty"),
        ("tenant=ac%20me&key=a", "tenant \"ac me\" contains ' '"),
        ("tenant=acme&key=a&cost=many", "cost is \"many\""),
        (
            "tenant=acme&key=a&colour=red",
            "unknown parameter \"colour\"",
        ),
        ("domain=edge", "domain without a descriptor"),
        ("domain=edge&descriptor=a=1,,b=2", "an entry without a key"),
    ] {
        let (status, body) = explain_http(&server, query).await;
        assert_eq!(status, 400, "{query}: {body}");
        assert!(body.contains(says), "{query}: {body}");
    }
    let many = (0..17)
        .map(|i| format!("descriptor=k={i}"))
        .collect::<Vec<_>>();
    let (status, body) = explain_http(&server, &format!("domain=edge&{}", many.join("&"))).await;
    assert_eq!(status, 400);
    assert!(body.contains("at most 16"), "{body}");

    // gRPC: no token, a wrong one, a bad field.
    let mut admin = AdminClient::new(server.channel().await);
    let err = admin.explain(native("acme", "a", "", 1)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    let mut wrong = tonic::Request::new(native("acme", "a", "", 1));
    wrong
        .metadata_mut()
        .insert("authorization", "Bearer nope".parse().unwrap());
    assert_eq!(
        admin.explain(wrong).await.unwrap_err().code(),
        Code::Unauthenticated
    );
    let err = admin
        .explain(authorized(native("acme", "", "", 1)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("key is empty"), "{}", err.message());
    // Hostile sizes: a key past the cap, far too many descriptors.
    let err = admin
        .explain(authorized(native("acme", &"k".repeat(100_000), "", 1)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("at most 256"), "{}", err.message());
    let many = ExplainRequest {
        domain: "edge".into(),
        descriptors: vec![
            ExplainDescriptor {
                entries: vec![Entry {
                    key: "k".into(),
                    value: "v".into(),
                }],
                ..Default::default()
            };
            100_000
        ],
        ..Default::default()
    };
    let err = admin.explain(authorized(many)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{}", err.message());
    assert!(err.message().contains("descriptors"), "{}", err.message());
    let mut stray = native("acme", "a", "", 1);
    stray.descriptors.push(ExplainDescriptor::default());
    let err = admin.explain(authorized(stray)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("set domain"), "{}", err.message());
    server.stop().await;

    // A server without an admin token explains nothing.
    let open = TestServer::with_rows(&[row("keys", "", "", "key", 5, "5/minute")]).await;
    let (status, body) = open
        .http("GET", "/v1/explain?tenant=acme&key=a", None, "")
        .await;
    assert_eq!(status, 403);
    assert!(body.contains("--admin-token"), "{body}");
    let mut admin = AdminClient::new(open.channel().await);
    let err = admin
        .explain(authorized(native("acme", "a", "", 1)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(err.message().contains("--admin-token"), "{}", err.message());
    open.stop().await;
}

const ENVOY: &str = "
domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: plan
    value: free
    rate_limit: {unit: minute, requests_per_unit: 1, name: free-plan}
  - key: user
    value: vip
    rate_limit: {unit: minute, requests_per_unit: 100, name: vip, replaces: [{name: free-plan}]}
  - key: path
    descriptors:
      - key: method
        value: GET
        rate_limit: {unit: second, requests_per_unit: 5}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_an_envoy_request_rule_by_rule() {
    let dir = config_dir(ENVOY);
    let path = dir.path().to_owned();
    let server = TestServer::launch(None, move |c| {
        c.envoy_config = Some(path);
        c.admin_access.token = Some(TOKEN.into());
    })
    .await;
    let mut envoy = common::envoy::client(server.channel().await);
    for _ in 0..2 {
        ask(
            &mut envoy,
            request_in("edge", vec![descriptor(&[("remote_address", "10.0.0.1")])]),
        )
        .await;
    }
    let e = explain_json(
        &server,
        "domain=edge&descriptor=remote_address=10.0.0.1&descriptor=path=/x\
         &descriptor=path=/x,method=POST&descriptor=nope=1",
    )
    .await;
    assert_eq!(e["domain_known"], true);
    let d = e["descriptors"].as_array().unwrap();
    assert_eq!(d[0]["rule"]["key"], "edge.remote_address", "{e:#}");
    assert_eq!(d[0]["rule"]["limit"], "3/minute");
    assert_eq!(d[0]["rule"]["counter"], "remote_address_10.0.0.1");
    assert_eq!(d[0]["state"]["remaining"], 1);
    assert_eq!(d[0]["state"]["would_admit"], true);
    assert_eq!(d[0]["state"]["remaining_after"], 0);
    // Two admissions at one instant: the first recorded, one sampled out.
    assert_eq!(d[0]["recent"]["decisions"][0]["outcome"], "allowed");
    assert_eq!(d[0]["recent"]["admissions_not_shown"], 1);
    assert!(d[1]["rule"].is_null());
    assert!(
        d[1]["why"].as_str().unwrap().contains("has no rate_limit"),
        "{}",
        d[1]["why"]
    );
    assert_eq!(
        d[2]["why"],
        "entry 2 (method=POST) matches no descriptor under path=/x"
    );
    assert_eq!(
        d[3]["why"],
        "the first entry (nope=1) matches no descriptor at the top of domain \"edge\""
    );
    assert_eq!(e["dry_run"]["allowed"], true);

    // gRPC: `replaces`, a limit override, an unknown domain.
    let mut admin = AdminClient::new(server.channel().await);
    let entry = |k: &str, v: &str| Entry {
        key: k.into(),
        value: v.into(),
    };
    let g = admin
        .explain(authorized(ExplainRequest {
            domain: "edge".into(),
            descriptors: vec![
                ExplainDescriptor {
                    entries: vec![entry("plan", "free")],
                    ..Default::default()
                },
                ExplainDescriptor {
                    entries: vec![entry("user", "vip")],
                    ..Default::default()
                },
                ExplainDescriptor {
                    entries: vec![entry("remote_address", "10.0.0.9")],
                    requests_per_unit: 0,
                    unit: 1,
                    hits_addend: Some(2),
                },
            ],
            ..Default::default()
        }))
        .await
        .unwrap()
        .into_inner();
    assert!(g.descriptors[0].rule.is_none());
    assert_eq!(
        g.descriptors[0].why,
        "its rule edge.plan_free is replaced by edge.user_vip, which descriptor 2 matches"
    );
    assert_eq!(g.descriptors[1].rule.as_ref().unwrap().name, "vip");
    assert_eq!(g.descriptors[1].state.as_ref().unwrap().remaining, 100);
    let over = &g.descriptors[2];
    assert!(over.rule.as_ref().unwrap().overridden);
    assert_eq!(over.hits, 2);
    assert!(over.why.contains("always OVER_LIMIT"), "{}", over.why);
    let dry = g.dry_run.unwrap();
    assert!(!dry.allowed);
    let unknown = admin
        .explain(authorized(ExplainRequest {
            domain: "elsewhere".into(),
            descriptors: vec![ExplainDescriptor {
                entries: vec![entry("remote_address", "1")],
                ..Default::default()
            }],
            ..Default::default()
        }))
        .await
        .unwrap()
        .into_inner();
    assert!(!unknown.domain_known);
    assert!(
        unknown.descriptors[0]
            .why
            .contains("not in the configuration"),
        "{}",
        unknown.descriptors[0].why
    );
    assert!(unknown.dry_run.unwrap().allowed);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tollgate_explain_prints_the_rules_the_state_and_the_history() {
    let server = server_with_token(&rows()).await;
    traffic(&server).await;
    let run = |args: Vec<String>, token: &str| {
        std::process::Command::new(common::process::BIN)
            .args(args)
            .env("TOLLGATE_ADMIN_TOKEN", token)
            .output()
            .unwrap()
    };
    let url = server.url();
    let args: Vec<String> = [
        "explain",
        "--server",
        &url,
        "--tenant",
        "acme",
        "--key",
        "alice",
        "--resource",
        "exports",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let out = run(args.clone(), TOKEN);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{text}");
    for line in [
        "a request of cost 1: REFUSED by exports, retry in 1800.0 s",
        "  acme-keys (tenant row): rate per key, any resource, burst 4, 4/minute",
        "    won over pro-keys (plan row)",
        "    won over default-keys (default row)",
        "      acme:k::alice: 2 tokens, full in 30.0 s",
        "      cost 1: admitted here, but refused by another rule: nothing spent",
        "  pro-slots (plan row): concurrency per tenant, any resource, burst 3, 3 concurrent",
        "      one more lease: admitted, 1 left",
        "recent decisions (newest first; 0 admissions sampled out):",
    ] {
        assert!(text.lines().any(|l| l == line), "{line:?} in:\n{text}");
    }
    assert!(
        text.contains("rejected         cost 1       exports"),
        "{text}"
    );
    // An Envoy request: this server has no Envoy configuration.
    let envoy: Vec<String> = [
        "explain",
        "--server",
        &url,
        "--domain",
        "edge",
        "--descriptor",
        "remote_address=10.0.0.1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let out = run(envoy, TOKEN);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{text}");
    for line in [
        "the request: ALLOWED, 0 left",
        "descriptor 1 (remote_address=10.0.0.1), 1 hits:",
        "  no rule applies",
        "  domain \"edge\" is not in the configuration: nothing in it is limited, limit overrides included",
    ] {
        assert!(text.lines().any(|l| l == line), "{line:?} in:\n{text}");
    }
    assert!(
        text.starts_with("domain \"edge\" (not configured), at "),
        "{text}"
    );
    let out = run(args, "wrong");
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("Unauthenticated"), "{err}");
    server.stop().await;
}
