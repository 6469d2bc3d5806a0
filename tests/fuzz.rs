//! A fuzz harness for everything a caller or an operator feeds Tollgate:
//! native and Envoy request messages (arbitrary bytes through the real gRPC
//! decoder, and arbitrary well-formed messages through the real services),
//! envoyproxy/ratelimit YAML, the TOML config file and limits-table rows.
//!
//! Each case must end without a panic, with an answer a caller can act on
//! (never INTERNAL or UNKNOWN), and with the bytes allocated while handling
//! it bounded by a constant plus a multiple of its size (this binary counts
//! every allocation with `stats_alloc`).
//!
//! `TOLLGATE_FUZZ_CASES` sets the cases per target (default 500, what
//! `scripts/test` runs); a longer run:
//! `TOLLGATE_FUZZ_CASES=100000 cargo nextest run --release --test integration fuzz::`.

use crate::common;

use std::alloc::System;
use std::sync::OnceLock;

use common::{TestServer, raw, row};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestRunner};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use tollgate::api::envoy::config::EnvoyConfig;
use tollgate::cli::ServeArgs;
use tollgate::limits::StoredRow;
use tollgate::limits::watch::LiveLimits;
use tollgate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use tollgate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use tollgate::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use tollgate::proto::v1::{BatchItem, ShouldAllowBatchRequest, ShouldAllowRequest};
use tonic::Code;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Bytes any one case may allocate besides its share per input byte (the
/// gRPC calls' buffers, a fresh parse's tables).
const BASE_BYTES: usize = 8 << 20;
/// Bytes a case may allocate per byte of input.
const PER_INPUT_BYTE: usize = 64;

fn cases() -> u32 {
    std::env::var("TOLLGATE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(500)
}

fn runner() -> TestRunner {
    TestRunner::new(Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    })
}

/// Runs `f`, and fails when it allocated more than the bound for an input
/// of `input_len` bytes.
fn bounded<T>(what: &str, input_len: usize, f: impl FnOnce() -> T) -> T {
    let region = Region::new(GLOBAL);
    let out = f();
    let change = region.change();
    let allocated = change.bytes_allocated + change.bytes_reallocated.max(0) as usize;
    let bound = BASE_BYTES + PER_INPUT_BYTE * input_len;
    assert!(
        allocated <= bound,
        "{what}: {allocated} bytes allocated for {input_len} bytes of input (bound {bound})"
    );
    out
}

/// The codes a caller can act on; anything else means the server broke.
fn acceptable(code: Code) -> bool {
    matches!(
        code,
        Code::Ok
            | Code::InvalidArgument
            | Code::NotFound
            | Code::FailedPrecondition
            | Code::OutOfRange
            | Code::ResourceExhausted
    )
}

const ENVOY_YAML: &str = "\
domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: plan
    value: free
    rate_limit: {unit: minute, requests_per_unit: 1, name: free-plan}
  - key: path
    value: /api/*/export
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: internal
    rate_limit: {unlimited: true}
  - key: user
    value: vip
    rate_limit: {unit: minute, requests_per_unit: 100, name: vip, replaces: [{name: free-plan}]}
  - key: tenant
    descriptors:
      - key: route
        rate_limit: {unit: second, requests_per_unit: 5}
";

const TOML_CONFIG: &str = "\
grpc_addr = \"127.0.0.1:50051\"
store = \"memory\"
max_buckets = 5000
reload_interval = \"250ms\"
store_timeout = \"2s\"
deny_cache = true
idle_timeout = \"0s\"
grpc_max_requests_in_flight = 64
local_fraction = 0.5
unmatched = \"deny\"
";

/// One server for every gRPC target of this process, on its own runtime.
fn server() -> &'static (tokio::runtime::Runtime, TestServer) {
    static SERVER: OnceLock<(tokio::runtime::Runtime, TestServer)> = OnceLock::new();
    SERVER.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("edge.yaml"), ENVOY_YAML).unwrap();
        let path = dir.keep();
        let server = runtime.block_on(TestServer::launch(
            Some(&[
                row("acme-keys", "acme", "", "key", 10, "5/second"),
                row("acme-all", "acme", "", "tenant", 100, "50/second"),
                row("default", "", "", "key", 5, "1/minute"),
                tollgate::limits::LimitRow::from_request(
                    "acme".into(),
                    String::new(),
                    "key",
                    3,
                    "",
                    "enforce",
                    "allow",
                    0,
                    "concurrency",
                    Some("acme-slots".into()),
                )
                .unwrap(),
            ]),
            move |c| c.envoy_config = Some(path),
        ));
        (runtime, server)
    })
}

/// Random edits of `text`: inserted, deleted and replaced characters.
fn mutated(text: &'static str) -> impl Strategy<Value = String> {
    prop::collection::vec((any::<Index>(), any::<char>(), 0u8..3), 0..12).prop_map(move |edits| {
        let mut chars: Vec<char> = text.chars().collect();
        for (at, c, op) in edits {
            let i = at.index(chars.len() + 1);
            match op {
                0 => chars.insert(i, c),
                1 if i < chars.len() => {
                    chars.remove(i);
                }
                _ if i < chars.len() => chars[i] = c,
                _ => chars.push(c),
            }
        }
        chars.into_iter().collect()
    })
}

/// Text that stresses parsers and keys: any characters, long runs, the
/// separators Tollgate itself uses.
fn nasty_text() -> impl Strategy<Value = String> {
    prop_oneof![
        ".{0,40}",
        "[a-z:\\n\"{}~%_.*]{0,40}",
        (any::<char>(), 0usize..1200).prop_map(|(c, n)| std::iter::repeat_n(c, n).collect()),
        Just(String::new()),
    ]
}

/// Raw bytes as a gRPC message body on `path`, unary.
async fn raw_unary(path: &'static str, body: Vec<u8>) -> Code {
    let (_, server) = server();
    let mut grpc = tonic::client::Grpc::new(server.channel().await);
    grpc.ready().await.unwrap();
    match grpc
        .unary(
            tonic::Request::new(body),
            path.parse().unwrap(),
            raw::RawCodec,
        )
        .await
    {
        Ok(_) => Code::Ok,
        Err(status) => status.code(),
    }
}

#[test]
fn arbitrary_bytes_as_native_and_envoy_messages() {
    let (runtime, _) = server();
    let bytes = prop::collection::vec(any::<u8>(), 0..2048);
    runner()
        .run(&(bytes, 0usize..9), |(body, target)| {
            let path = [
                "/tollgate.v1.RateLimiter/ShouldAllow",
                "/tollgate.v1.RateLimiter/ShouldAllowBatch",
                "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
                "/tollgate.v1.RateLimiter/Reserve",
                "/tollgate.v1.RateLimiter/Settle",
                "/tollgate.v1.RateLimiter/Charge",
                "/tollgate.v1.RateLimiter/Acquire",
                "/tollgate.v1.RateLimiter/Release",
                "/tollgate.v1.RateLimiter/Renew",
            ][target];
            let len = body.len();
            let code = bounded(path, len, || runtime.block_on(raw_unary(path, body)));
            prop_assert!(acceptable(code), "{path}: {code:?}");
            Ok(())
        })
        .unwrap();
}

#[test]
fn arbitrary_bytes_on_a_stream_each_get_an_answer() {
    let (runtime, server) = server();
    let message = prop::collection::vec(any::<u8>(), 0..512);
    runner()
        .run(&prop::collection::vec(message, 1..8), |messages| {
            let n = messages.len();
            let len = messages.iter().map(Vec::len).sum();
            let answers = bounded("ShouldAllowStream", len, || {
                runtime.block_on(async {
                    raw::stream_decisions(server.channel().await, messages).await
                })
            });
            prop_assert_eq!(answers.len(), n);
            for a in answers {
                prop_assert!(acceptable(Code::from(a.error_code as i32)), "{a:?}");
            }
            Ok(())
        })
        .unwrap();
}

/// Well-formed lease calls with hostile fields: keys, tenants and
/// resources of any text, any time to live, any cost, and tokens that are
/// real, mangled or made up.
#[test]
fn arbitrary_well_formed_lease_calls() {
    use tollgate::proto::v1::{AcquireRequest, ReleaseRequest, RenewRequest};
    let (runtime, server) = server();
    let ttl = (prop_oneof![0i64..120, any::<i64>()], any::<i32>())
        .prop_map(|(seconds, nanos)| prost_types::Duration { seconds, nanos });
    runner()
        .run(
            &(
                native_request(),
                prop::option::of(ttl),
                nasty_text(),
                0u8..4,
            ),
            |(r, ttl, garbage, how)| {
                let len = r.key.len() + r.tenant.len() + r.resource.len() + garbage.len();
                let codes = bounded("Acquire", len, || {
                    runtime.block_on(async {
                        let mut client = server.client().await;
                        let acquired = client
                            .acquire(AcquireRequest {
                                key: r.key,
                                tenant: r.tenant,
                                resource: r.resource,
                                ttl,
                                cost: r.cost,
                            })
                            .await;
                        let lease = match (&acquired, how) {
                            (Ok(a), 0) => a.get_ref().lease.clone(),
                            (Ok(a), 1) => format!("{}{garbage}", a.get_ref().lease),
                            (_, 2) => tollgate_core::store::LeaseId::new("acme").to_string(),
                            _ => garbage,
                        };
                        let renewed = client
                            .renew(RenewRequest {
                                lease: lease.clone(),
                                ttl,
                            })
                            .await;
                        let released = client.release(ReleaseRequest { lease }).await;
                        [
                            acquired.map(|_| ()),
                            renewed.map(|_| ()),
                            released.map(|_| ()),
                        ]
                        .map(|r| r.map_or_else(|s| s.code(), |_| Code::Ok))
                    })
                });
                for code in codes {
                    prop_assert!(acceptable(code), "lease call: {code:?}");
                }
                Ok(())
            },
        )
        .unwrap();
}

fn native_request() -> impl Strategy<Value = ShouldAllowRequest> {
    (
        nasty_text(),
        prop_oneof![0u64..20, any::<u64>()],
        prop_oneof![Just("acme".to_owned()), nasty_text()],
        nasty_text(),
        any::<bool>(),
    )
        .prop_map(
            |(key, cost, tenant, resource, dry_run)| ShouldAllowRequest {
                key,
                cost,
                tenant,
                resource,
                dry_run,
            },
        )
}

#[test]
fn arbitrary_well_formed_native_requests() {
    let (runtime, server) = server();
    let batch = prop::collection::vec(native_request(), 0..40);
    runner()
        .run(
            &(native_request(), batch, 0usize..1100),
            |(one, items, pad)| {
                let len = one.key.len() + one.tenant.len() + one.resource.len();
                let code = bounded("ShouldAllow", len, || {
                    runtime.block_on(async {
                        let mut client = server.client().await;
                        client
                            .should_allow(one)
                            .await
                            .map_or_else(|s| s.code(), |_| Code::Ok)
                    })
                });
                prop_assert!(acceptable(code), "ShouldAllow: {code:?}");
                // Batches sometimes past the item cap.
                let mut items: Vec<BatchItem> = items
                    .into_iter()
                    .map(|r| BatchItem {
                        key: r.key,
                        cost: r.cost,
                        resource: r.resource,
                        tenant: r.tenant,
                    })
                    .collect();
                if pad > 1000 {
                    items.extend((0..pad).map(|i| BatchItem {
                        key: i.to_string(),
                        cost: 1,
                        resource: String::new(),
                        tenant: "acme".into(),
                    }));
                }
                let len = items
                    .iter()
                    .map(|i| i.key.len() + i.tenant.len() + 16)
                    .sum();
                let code = bounded("ShouldAllowBatch", len, || {
                    runtime.block_on(async {
                        let mut client = server.client().await;
                        client
                            .should_allow_batch(ShouldAllowBatchRequest {
                                items,
                                dry_run: false,
                            })
                            .await
                            .map_or_else(|s| s.code(), |_| Code::Ok)
                    })
                });
                prop_assert!(acceptable(code), "ShouldAllowBatch: {code:?}");
                Ok(())
            },
        )
        .unwrap();
}

/// Reserve, Settle and Charge with arbitrary fields: a reservation of
/// whatever the request says, a settle of it (or of arbitrary text) at any
/// amount, and a charge of any cost. Every answer is one a caller can act
/// on, and a settled reservation settles once.
#[test]
fn arbitrary_well_formed_budget_requests() {
    use tollgate::proto::v1::{ChargeRequest, ReserveRequest, SettleRequest};
    let (runtime, server) = server();
    let ttl = prop_oneof![
        Just(None),
        (any::<i64>(), any::<i32>())
            .prop_map(|(seconds, nanos)| Some(prost_types::Duration { seconds, nanos })),
        (0i64..4000).prop_map(|seconds| Some(prost_types::Duration { seconds, nanos: 0 })),
    ];
    runner()
        .run(
            &(native_request(), ttl, any::<u64>(), nasty_text()),
            |(r, ttl, actual, token)| {
                let len = r.key.len() + r.tenant.len() + r.resource.len() + token.len();
                let codes = bounded("Reserve/Settle/Charge", len, || {
                    runtime.block_on(async {
                        let mut client = server.client().await;
                        let code = |s: tonic::Status| s.code();
                        let reserved = client
                            .reserve(ReserveRequest {
                                key: r.key.clone(),
                                estimate: r.cost,
                                tenant: r.tenant.clone(),
                                resource: r.resource.clone(),
                                ttl,
                            })
                            .await;
                        let mut codes =
                            vec![reserved.as_ref().map_or_else(|s| s.code(), |_| Code::Ok)];
                        let reservation = reserved
                            .map(|r| r.into_inner().reservation)
                            .unwrap_or_default();
                        for t in [reservation.clone(), token] {
                            codes.push(
                                client
                                    .settle(SettleRequest {
                                        reservation: t,
                                        actual,
                                    })
                                    .await
                                    .map_or_else(code, |_| Code::Ok),
                            );
                        }
                        if !reservation.is_empty() {
                            let again = client
                                .settle(SettleRequest {
                                    reservation,
                                    actual: 0,
                                })
                                .await
                                .map(|r| r.into_inner());
                            codes.push(match again {
                                // Settled once: the second answers what the
                                // first did.
                                Ok(a) if a.status == 2 && a.actual == actual.min(1 << 53) => {
                                    Code::Ok
                                }
                                Ok(a) => {
                                    panic!(
                                        "a second settle answered {a:?} after a settle at {actual}"
                                    )
                                }
                                Err(s) => s.code(),
                            });
                        }
                        codes.push(
                            client
                                .charge(ChargeRequest {
                                    key: r.key,
                                    cost: r.cost,
                                    tenant: r.tenant,
                                    resource: r.resource,
                                })
                                .await
                                .map_or_else(code, |_| Code::Ok),
                        );
                        codes
                    })
                });
                for c in codes {
                    prop_assert!(acceptable(c), "{c:?}");
                }
                Ok(())
            },
        )
        .unwrap();
}

fn descriptor() -> impl Strategy<Value = RateLimitDescriptor> {
    let key = prop_oneof![
        Just("remote_address".to_owned()),
        Just("plan".to_owned()),
        Just("path".to_owned()),
        Just("user".to_owned()),
        Just("tenant".to_owned()),
        Just("route".to_owned()),
        nasty_text(),
    ];
    let entry = (key, nasty_text()).prop_map(|(key, value)| Entry { key, value });
    let limit =
        (any::<u32>(), any::<i32>()).prop_map(|(requests_per_unit, unit)| RateLimitOverride {
            requests_per_unit,
            unit,
        });
    (
        prop::collection::vec(entry, 0..20),
        prop::option::of(limit),
        prop::option::of(any::<u64>()),
        any::<bool>(),
    )
        .prop_map(
            |(entries, limit, hits_addend, is_negative_hits)| RateLimitDescriptor {
                entries,
                limit,
                hits_addend,
                is_negative_hits,
            },
        )
}

#[test]
fn arbitrary_well_formed_envoy_requests() {
    let (runtime, server) = server();
    let domain = prop_oneof![Just("edge".to_owned()), nasty_text()];
    let request = (
        domain,
        prop::collection::vec(descriptor(), 0..24),
        any::<u32>(),
    )
        .prop_map(|(domain, descriptors, hits_addend)| RateLimitRequest {
            domain,
            descriptors,
            hits_addend,
        });
    runner()
        .run(&request, |request| {
            let len = request.domain.len()
                + request
                    .descriptors
                    .iter()
                    .flat_map(|d| &d.entries)
                    .map(|e| e.key.len() + e.value.len() + 8)
                    .sum::<usize>();
            let code = bounded("ShouldRateLimit", len, || {
                runtime.block_on(async {
                    let mut client = common::envoy::client(server.channel().await);
                    client
                        .should_rate_limit(request)
                        .await
                        .map_or_else(|s| s.code(), |_| Code::Ok)
                })
            });
            prop_assert!(acceptable(code), "ShouldRateLimit: {code:?}");
            Ok(())
        })
        .unwrap();
}

#[test]
fn envoyproxy_ratelimit_yaml_never_panics() {
    let text = prop_oneof![mutated(ENVOY_YAML), nasty_text(), ".{0,400}"];
    runner()
        .run(&text, |text| {
            let len = text.len();
            let loaded = bounded("envoy yaml", len, || {
                EnvoyConfig::load(&[("fuzz.yaml".to_owned(), text)])
            });
            if let Err(e) = loaded {
                prop_assert!(!e.to_string().is_empty());
            }
            Ok(())
        })
        .unwrap();
    // The fixture itself loads, so the mutations start from a valid file.
    assert!(EnvoyConfig::load(&[("edge.yaml".into(), ENVOY_YAML.into())]).is_ok());
}

#[test]
fn the_toml_config_file_never_panics() {
    let text = prop_oneof![mutated(TOML_CONFIG), nasty_text(), ".{0,400}"];
    runner()
        .run(&text, |text| {
            let len = text.len();
            let resolved = bounded("toml config", len, || ServeArgs::from_toml(&text));
            if let Err(e) = resolved {
                prop_assert!(!e.is_empty());
            }
            Ok(())
        })
        .unwrap();
    let fixture = ServeArgs::from_toml(TOML_CONFIG);
    assert!(fixture.is_ok(), "{fixture:?}");
}

fn stored_row() -> impl Strategy<Value = StoredRow> {
    let word = |valid: &'static [&'static str]| {
        prop_oneof![
            prop::sample::select(valid).prop_map(str::to_owned),
            nasty_text()
        ]
    };
    (
        nasty_text(),
        prop_oneof![Just("acme".to_owned()), nasty_text()],
        nasty_text(),
        word(&["key", "tenant"]),
        prop_oneof![0i64..100, any::<i64>()],
        prop_oneof![0i64..100, any::<i64>()],
        word(&["second", "minute", "hour", "day", "week", "month", "year"]),
        word(&["enforce", "shadow"]),
        word(&["allow", "deny", "local"]),
        prop_oneof![0i64..100, any::<i64>()],
        word(&["rate", "concurrency"]),
    )
        .prop_map(
            |(name, tenant, resource, scope, burst, rate, rate_unit, mode, policy, debt, kind)| {
                // A third of the rows belong to a plan (some also name a
                // tenant, which is invalid).
                let plan = match burst.rem_euclid(3) {
                    0 => "pro".to_owned(),
                    _ => String::new(),
                };
                StoredRow {
                    id: 0,
                    name,
                    tenant,
                    plan,
                    resource,
                    scope,
                    burst,
                    rate,
                    rate_unit,
                    mode,
                    on_store_unavailable: policy,
                    debt,
                    kind,
                    alerts: String::new(),
                    updated_at: String::new(),
                }
            },
        )
}

#[test]
fn limits_table_rows_never_panic() {
    runner()
        .run(&prop::collection::vec(stored_row(), 0..20), |rows| {
            let len = rows
                .iter()
                .map(|r| r.name.len() + r.tenant.len() + r.resource.len() + 64)
                .sum();
            let n = rows.len();
            let loaded = bounded("limits rows", len, || LiveLimits::from_rows(rows));
            // Every row is either in force or rejected with a reason.
            let status = loaded.status();
            prop_assert_eq!(status.rules + status.rejected_rows, n);
            prop_assert!(status.rejected.iter().all(|e| !e.is_empty()));
            Ok(())
        })
        .unwrap();
}
