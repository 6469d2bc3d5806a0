//! The engine as every API sees it: demands in, answers out, over the
//! in-process store (and, for the store-unavailable policies, a Redis that
//! never answers). Each test states one rule of `engine::Engine` exactly:
//! how lines merge into charges, which bucket decides and what the headers
//! say, what is refused as invalid, reservations, leases, and what is
//! counted. `scripts/mutants engine` runs these against each mutant.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use tollgate_engine::algorithm::{Limit, Micros, Op};
use tollgate_engine::clock::{Clock, ManualClock};
use tollgate_engine::engine::backend::{Backend, BackendOptions, StoreHandle};
use tollgate_engine::engine::{
    Allowance, Answer, Api, BucketKey, BucketKind, DecideError, Demand, Engine, Item, LeaseOp,
    LeaseStatus, Line, OnStoreUnavailable, OverCapacity, RedisConfig, SettleStatus, Ttl, Unmatched,
};
use tollgate_engine::telemetry::metrics::Outcome;
use tollgate_engine::telemetry::top::TopLimited;

/// A time well after the epoch, 17 s past a whole minute.
const T0: Micros = 1_699_999_997_000_000;
const SECOND: Micros = 1_000_000;

struct Harness {
    engine: Engine,
    store: StoreHandle,
    clock: Arc<ManualClock>,
    top: Arc<TopLimited>,
    /// Holds the port of a Redis that never answers (store-unavailable
    /// harnesses only).
    _silent: Option<TcpListener>,
}

fn options() -> BackendOptions {
    BackendOptions {
        redis: None,
        redis_uses_clock: false,
        max_buckets: 10_000,
        max_bucket_bytes: 1 << 24,
        max_records: 10_000,
        max_records_per_tenant: None,
        local_fraction: 0.5,
        deny_retry_after: 7 * SECOND,
        deny_cache: false,
        token_slices: false,
    }
}

impl Harness {
    fn with(options: BackendOptions, unmatched: Unmatched, silent: Option<TcpListener>) -> Self {
        let clock = Arc::new(ManualClock::new(T0));
        let dyn_clock: Arc<dyn Clock> = clock.clone();
        let backend = Backend::build(&options, &dyn_clock).unwrap();
        let top = Arc::new(TopLimited::new(
            16,
            Duration::from_secs(60),
            dyn_clock.clone(),
        ));
        Self {
            store: backend.handle(),
            engine: backend.engine(dyn_clock, top.clone(), unmatched),
            clock,
            top,
            _silent: silent,
        }
    }

    fn memory() -> Self {
        Self::with(options(), Unmatched::Allow, None)
    }

    /// An engine whose shared store is a Redis that accepts connections
    /// and never answers: every call times out and the lines' policies
    /// decide.
    fn store_down() -> Self {
        let silent = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("redis://{}", silent.local_addr().unwrap());
        let redis = RedisConfig {
            timeout: Duration::from_millis(50),
            ..RedisConfig::new(url)
        };
        let options = BackendOptions {
            redis: Some(redis),
            ..options()
        };
        Self::with(options, Unmatched::Allow, Some(silent))
    }

    async fn decide(&self, demand: &mut Demand<'_>) -> Result<Answer, DecideError> {
        self.engine.decide(demand, &tracing::Span::none()).await
    }
}

fn rate(burst: u64, rate: &str) -> Limit {
    Limit::new(burst, rate.parse().unwrap()).unwrap()
}

fn bucket(tenant: &str, key: &str) -> BucketKey {
    BucketKey::new(tenant, BucketKind::KEY, "", key)
}

fn ceiling(tenant: &str) -> BucketKey {
    BucketKey::new(tenant, BucketKind::TENANT, "", "")
}

fn line(item: usize, bucket: BucketKey, allowance: Allowance) -> Line<'static> {
    Line {
        item,
        bucket,
        allowance,
        enforce: true,
        on_store_unavailable: OnStoreUnavailable::Allow,
        label: "per-key",
        calendar: None,
    }
}

fn limited(item: usize, bucket: BucketKey, limit: Limit) -> Line<'static> {
    line(item, bucket, Allowance::Limited(limit))
}

/// A native spending demand of one item of `cost` with `lines`.
fn spend<'a>(cost: u64, lines: Vec<Line<'a>>) -> Demand<'a> {
    let mut d = Demand::new(Api::Native, Op::SPEND, OverCapacity::Invalid);
    d.items.push(Item::new("acme", "", "alice", cost));
    d.lines.extend(lines);
    d
}

/// The counter or gauge `name` with exactly `labels` in the process's
/// Prometheus text (0 when absent).
fn metric(name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = tollgate_engine::telemetry::metrics::handle().render();
    let want: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    for l in text.lines() {
        let Some(rest) = l.strip_prefix(name) else {
            continue;
        };
        let (series, value) = rest.rsplit_once(' ').unwrap();
        let inner = series.trim_start_matches('{').trim_end_matches('}');
        let mut have: Vec<&str> = inner.split(',').filter(|s| !s.is_empty()).collect();
        have.sort_unstable();
        let mut wanted: Vec<&str> = want.iter().map(String::as_str).collect();
        wanted.sort_unstable();
        if (rest.starts_with('{') || rest.starts_with(' ')) && have == wanted {
            return value.parse().unwrap();
        }
    }
    0.0
}

/// Metrics are process-wide: tests that read them need nextest's process
/// per test.
fn own_process() {
    let mode = std::env::var("NEXTEST_EXECUTION_MODE").unwrap_or_default();
    assert!(
        mode == "process-per-test",
        "this test reads process-wide metrics and needs a process of its own: \
         run it with `cargo nextest run` (as scripts/test does), not `cargo test`"
    );
    tollgate_engine::telemetry::metrics::handle();
}

// ---- Lines into charges ----------------------------------------------

#[tokio::test]
async fn lines_sharing_a_bucket_add_their_costs_into_one_charge() {
    let h = Harness::memory();
    let l = rate(10, "1/hour");
    let mut d = spend(
        2,
        vec![
            limited(0, bucket("acme", "alice"), l),
            limited(0, bucket("acme", "alice"), l),
            limited(0, bucket("acme", "bob"), l),
        ],
    );
    let a = h.decide(&mut d).await.unwrap();
    assert!(a.allowed);
    let remaining: Vec<u64> = a.lines.iter().map(|v| v.remaining).collect();
    assert_eq!(
        remaining,
        [6, 6, 8],
        "the shared bucket is charged 2 + 2 once"
    );
    assert_eq!(a.items[0].remaining, 6, "the tighter bucket decides");
    assert_eq!(a.items[0].line, Some(0), "the first of equally tight lines");
}

#[tokio::test]
async fn past_sixteen_buckets_lines_still_find_their_shared_bucket() {
    let h = Harness::memory();
    let l = rate(100, "1/hour");
    let keys: Vec<String> = (0..40).map(|i| format!("k{i}")).collect();
    let mut lines = Vec::new();
    for round in 0..3 {
        for k in &keys {
            // Each bucket three times, the second and third time after the
            // index has grown past its linear scan.
            let _ = round;
            lines.push(limited(0, bucket("acme", k), l));
        }
    }
    let mut d = spend(1, lines);
    let a = h.decide(&mut d).await.unwrap();
    assert!(a.allowed);
    assert!(
        a.lines.iter().all(|v| v.remaining == 97),
        "every bucket charged 3 once: {:?}",
        a.lines.iter().map(|v| v.remaining).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn a_shared_bucket_is_enforced_when_any_of_its_lines_is() {
    let h = Harness::memory();
    let l = rate(3, "1/hour");
    let shadow = |b| Line {
        enforce: false,
        ..limited(0, b, l)
    };
    // Shadow then enforced on one bucket: 2 + 2 is above the burst of 3.
    let mut d = spend(
        2,
        vec![
            shadow(bucket("acme", "a")),
            limited(0, bucket("acme", "a"), l),
        ],
    );
    let e = h.decide(&mut d).await.unwrap_err();
    assert!(
        matches!(
            e,
            DecideError::CostExceedsCapacity {
                cost: 4,
                burst: 3,
                ..
            }
        ),
        "{e}"
    );
    // Both shadow: counted, never refused.
    let mut d = spend(
        2,
        vec![shadow(bucket("acme", "b")), shadow(bucket("acme", "b"))],
    );
    let a = h.decide(&mut d).await.unwrap();
    assert!(a.allowed && a.items[0].shadow);
    assert_eq!(a.items[0].outcome, Outcome::ShadowRejected);
    assert_eq!(a.lines[0].remaining, 3, "a refused charge spends nothing");
}

#[tokio::test]
async fn a_cost_above_a_capacity_names_the_request_the_item_or_the_items_sharing_it() {
    let h = Harness::memory();
    let l = rate(3, "1/hour");
    let mut d = spend(4, vec![limited(0, bucket("acme", "a"), l)]);
    assert_eq!(
        h.decide(&mut d).await.unwrap_err().to_string(),
        "cost 4 of the request exceeds the capacity (burst) 3 of rule \"per-key\"; it can \
         never be allowed, so lower the cost or raise the rule's burst"
    );

    let batch = |costs: [u64; 3], keys: [&'static str; 3]| {
        let mut d = Demand::new(Api::Native, Op::SPEND, OverCapacity::Invalid);
        for (i, (c, k)) in costs.iter().zip(keys).enumerate() {
            d.items.push(Item::new("acme", "", k, *c));
            d.lines.push(limited(i, bucket("acme", k), l));
        }
        d
    };
    let mut d = batch([1, 1, 4], ["a", "b", "c"]);
    let e = h.decide(&mut d).await.unwrap_err().to_string();
    assert!(e.starts_with("cost 4 of items[2] exceeds"), "{e}");
    let mut d = batch([1, 2, 2], ["a", "b", "b"]);
    let e = h.decide(&mut d).await.unwrap_err().to_string();
    assert!(
        e.starts_with("cost 4 of the items sharing bucket "),
        "items 1 and 2 together: {e}"
    );
    // Nothing was charged by the refused demands.
    let mut d = spend(3, vec![limited(0, bucket("acme", "b"), l)]);
    assert!(h.decide(&mut d).await.unwrap().allowed);
}

#[tokio::test]
async fn a_cost_above_a_capacity_is_a_rejection_where_the_api_asks_for_one() {
    let h = Harness::memory();
    let l = rate(3, "1/hour");
    let mut d = spend(4, vec![limited(0, bucket("acme", "a"), l)]);
    d.over_capacity = OverCapacity::Reject;
    let a = h.decide(&mut d).await.unwrap();
    assert!(!a.allowed);
    assert_eq!(a.items[0].retry_after, Micros::MAX, "never admitted");
    assert_eq!(a.retry_after, 0, "no finite wait among the items");
    assert_eq!(a.headers.unwrap().retry_after, None);
    // At exactly the capacity it is admitted.
    let mut d = spend(3, vec![limited(0, bucket("acme", "a"), l)]);
    assert!(h.decide(&mut d).await.unwrap().allowed);
    // Charged after the fact, any size is applied.
    let mut d = spend(4, vec![limited(0, bucket("acme", "c"), l)]);
    d.op = Op::Charge;
    let a = h.decide(&mut d).await.unwrap();
    assert_eq!(a.lines[0].remaining, 0);
}

#[tokio::test]
async fn one_decision_touches_at_most_two_thousand_buckets() {
    let h = Harness::memory();
    let l = rate(5, "1/hour");
    let lines = |n: usize| {
        (0..n)
            .map(|i| limited(0, bucket("acme", &format!("k{i}")), l))
            .collect::<Vec<_>>()
    };
    let mut d = spend(1, lines(2000));
    assert!(h.decide(&mut d).await.unwrap().allowed);
    let mut d = spend(1, lines(2001));
    assert_eq!(
        h.decide(&mut d).await.unwrap_err().to_string(),
        "the request touches more than 2000 buckets; one decision may touch at most 2000, so \
         split it into smaller batches"
    );
    let mut d = spend(1, lines(2001));
    d.api = Api::Envoy;
    assert!(
        h.decide(&mut d)
            .await
            .unwrap_err()
            .to_string()
            .ends_with("so split it (fewer descriptors)")
    );
}

#[tokio::test]
async fn demands_are_checked_for_items_keys_and_bucket_names() {
    let h = Harness::memory();
    let l = rate(5, "1/hour");
    let mut d = Demand::new(Api::Native, Op::SPEND, OverCapacity::Invalid);
    assert_eq!(
        h.decide(&mut d).await.unwrap_err().to_string(),
        "items is empty; send 1 to 1000 items"
    );
    let long = "k".repeat(257);
    let mut d = Demand::new(Api::Native, Op::SPEND, OverCapacity::Invalid);
    d.items.push(Item::new("acme", "", &long, 1));
    assert_eq!(
        h.decide(&mut d).await.unwrap_err().to_string(),
        "key is 257 bytes; at most 256 are allowed (hash longer keys first)"
    );
    let fits = "k".repeat(256);
    let mut d = spend(1, vec![limited(0, bucket("acme", &fits), l)]);
    assert!(h.decide(&mut d).await.unwrap().allowed);
    let huge = "b".repeat(tollgate_engine::engine::caps::MAX_BUCKET_BYTES);
    let mut d = spend(
        1,
        vec![limited(
            0,
            BucketKey::new("acme", BucketKind::KEY, &huge, "a"),
            l,
        )],
    );
    let e = h.decide(&mut d).await.unwrap_err().to_string();
    assert!(e.starts_with("a bucket name of "), "{e}");
    let mut d = Demand::new(Api::Native, Op::SPEND, OverCapacity::Invalid);
    for _ in 0..1001 {
        d.items.push(Item::new("acme", "", "a", 1));
    }
    assert_eq!(
        h.decide(&mut d).await.unwrap_err().to_string(),
        "items has 1001 entries; at most 1000 are allowed, so split the batch"
    );
}

#[tokio::test]
async fn the_caps_hold_at_their_bounds_exactly() {
    use tollgate_engine::engine::caps;
    let h = Harness::memory();
    let l = rate(5, "1/hour");
    // A thousand items pass.
    let mut d = Demand::new(Api::Native, Op::SPEND, OverCapacity::Invalid);
    for _ in 0..caps::MAX_ITEMS {
        d.items.push(Item::new("acme", "", "a", 0));
    }
    assert!(h.decide(&mut d).await.unwrap().allowed);
    assert_eq!(
        caps::check_items("descriptors", 1001)
            .unwrap_err()
            .to_string(),
        "descriptors has 1001 entries; at most 1000 are allowed, so split the request"
    );
    assert_eq!(
        caps::check_items("descriptors", 0).unwrap_err().to_string(),
        "descriptors is empty; send 1 to 1000 descriptors"
    );
    assert!(caps::check_items("descriptors", 1).is_ok());
    // A key of exactly 256 bytes passes.
    let longest = "k".repeat(caps::MAX_KEY_BYTES);
    let mut d = Demand::new(Api::Native, Op::SPEND, OverCapacity::Invalid);
    d.items.push(Item::new("acme", "", &longest, 1));
    assert!(h.decide(&mut d).await.unwrap().allowed);
    // The longest bucket name any API can build: three labels of at most
    // 128 bytes (an Envoy domain, or a tenant and resource), 32 bytes of
    // tags and separators, and 16 descriptor entries of a 256-byte key and
    // value and their two separators.
    assert_eq!(caps::MAX_BUCKET_BYTES, 3 * 128 + 32 + 16 * (2 * 256 + 2));
    assert_eq!(caps::MAX_BUCKET_BYTES, 8640);
    // A bucket name of exactly the longest allowed passes; one byte more
    // is refused.
    let base = BucketKey::new("acme", BucketKind::KEY, "", "a")
        .as_str()
        .len();
    let resource = "r".repeat(caps::MAX_BUCKET_BYTES - base);
    let at = BucketKey::new("acme", BucketKind::KEY, &resource, "a");
    assert_eq!(at.as_str().len(), caps::MAX_BUCKET_BYTES);
    let mut d = spend(1, vec![limited(0, at, l)]);
    assert!(h.decide(&mut d).await.unwrap().allowed);
    let over = BucketKey::new("acme", BucketKind::KEY, &resource, "ab");
    let mut d = spend(1, vec![limited(0, over, l)]);
    assert_eq!(
        h.decide(&mut d).await.unwrap_err().to_string(),
        format!(
            "a bucket name of {} bytes is longer than the {} allowed; shorten the keys",
            caps::MAX_BUCKET_BYTES + 1,
            caps::MAX_BUCKET_BYTES
        )
    );
}

#[tokio::test]
async fn a_bad_token_is_quoted_shortened_on_a_character_boundary() {
    let h = Harness::memory();
    // 63 ASCII bytes and then two-byte characters: byte 64 falls inside
    // one, so the quote stops at 63.
    let token = format!("{}{}", "a".repeat(63), "é".repeat(10));
    let e = h.engine.settle(Api::Native, &token, 1).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "reservation {:?} is not a token Reserve returned (they start with \"r1.\")",
            "a".repeat(63)
        )
    );
    let token = format!("{}{}", "a".repeat(62), "é".repeat(10));
    let e = h.engine.release(&token).await.unwrap_err();
    assert!(
        e.to_string().starts_with(&format!(
            "lease {:?} is not",
            format!("{}é", "a".repeat(62))
        )),
        "{e}"
    );
}

// ---- Rules without a bucket ------------------------------------------

#[tokio::test]
async fn a_limit_of_zero_refuses_and_spends_nothing_elsewhere() {
    let h = Harness::memory();
    let l = rate(5, "1/hour");
    let window = 60 * SECOND;
    let mut d = spend(
        1,
        vec![
            limited(0, bucket("acme", "a"), l),
            line(0, ceiling("acme"), Allowance::Blocked { window }),
        ],
    );
    let a = h.decide(&mut d).await.unwrap();
    assert!(!a.allowed);
    assert_eq!(a.lines[0].remaining, 5, "the bucket, untouched");
    let blocked = a.lines[1];
    assert!(!blocked.allowed);
    assert_eq!(blocked.retry_after, Micros::MAX);
    assert_eq!(
        blocked.reset_after,
        43 * SECOND,
        "the minute ends 43 s after T0"
    );
    assert_eq!(a.items[0].line, Some(1));
    let headers = a.headers.unwrap();
    assert_eq!(
        (
            headers.limit,
            headers.remaining,
            headers.reset,
            headers.retry_after
        ),
        (0, 0, 43, None)
    );
    // Nothing was spent: the bucket alone still has 5.
    let mut d = spend(5, vec![limited(0, bucket("acme", "a"), l)]);
    assert!(h.decide(&mut d).await.unwrap().allowed);
    // Charged after the fact, the blocked line charges nothing and the
    // other line is charged.
    let mut d = spend(
        2,
        vec![
            line(0, ceiling("acme"), Allowance::Blocked { window }),
            limited(0, bucket("acme", "b"), l),
        ],
    );
    d.op = Op::Charge;
    let a = h.decide(&mut d).await.unwrap();
    assert_eq!(a.lines[1].remaining, 3);
    assert_eq!(
        h.store.status().local.unwrap().buckets,
        2,
        "the buckets of keys a and b; none for the limit of zero"
    );
    // The blocked line charged nothing: raised to a real limit, the
    // ceiling's bucket is full.
    let mut d = spend(1, vec![limited(0, ceiling("acme"), l)]);
    let a = h.decide(&mut d).await.unwrap();
    assert!(a.allowed);
    assert_eq!(a.lines[0].remaining, 4);
}

#[tokio::test]
async fn an_unlimited_line_admits_without_headers() {
    let h = Harness::memory();
    let mut d = spend(7, vec![line(0, bucket("acme", "a"), Allowance::Unlimited)]);
    let a = h.decide(&mut d).await.unwrap();
    assert!(a.allowed);
    assert_eq!(a.lines[0].remaining, u64::MAX);
    assert_eq!(a.lines[0].reset_after, 0);
    assert_eq!(a.items[0].line, Some(0));
    assert_eq!(a.items[0].headers, None);
    assert_eq!(a.headers, None);
    assert_eq!(a.items[0].outcome, Outcome::Allowed);
}

#[tokio::test]
async fn no_rule_is_refused_for_native_demands_only_when_the_server_says_so() {
    let deny = Harness::with(options(), Unmatched::Deny, None);
    let l = rate(5, "1/hour");
    let mut d = Demand::new(Api::Native, Op::SPEND, OverCapacity::Invalid);
    d.items.push(Item::new("acme", "", "a", 1));
    d.items.push(Item::new("globex", "exports", "b", 1));
    d.lines.push(limited(0, bucket("acme", "a"), l));
    assert_eq!(
        deny.decide(&mut d).await.unwrap_err().to_string(),
        "no limit applies to tenant \"globex\" (resource \"exports\") and this server refuses \
         unlimited requests; add a row for the tenant or a default row (tenant '') to the \
         limits table"
    );
    let mut envoy = Demand::new(Api::Envoy, Op::SPEND, OverCapacity::Reject);
    envoy.items.push(Item::new("acme", "", "a", 1));
    assert!(deny.decide(&mut envoy).await.unwrap().allowed);
    let allow = Harness::memory();
    let mut d = spend(1, vec![]);
    let a = allow.decide(&mut d).await.unwrap();
    assert!(a.allowed);
    assert_eq!(a.items[0].line, None);
    assert_eq!(a.headers, None);
}

// ---- Debt, asks, shadow ----------------------------------------------

#[tokio::test]
async fn an_ask_needs_a_token_only_where_debt_is_allowed() {
    let h = Harness::memory();
    let plain = rate(2, "1/hour");
    let debt = plain.with_debt(10).unwrap();
    for (k, l, admitted) in [("plain", plain, true), ("debt", debt, false)] {
        let mut d = spend(2, vec![limited(0, bucket("acme", k), l)]);
        assert!(h.decide(&mut d).await.unwrap().allowed);
        let mut ask = spend(0, vec![limited(0, bucket("acme", k), l)]);
        let a = h.decide(&mut ask).await.unwrap();
        assert_eq!(a.allowed, admitted, "{k}: an ask at zero tokens");
        assert_eq!(a.lines[0].remaining, 0, "{k}: an ask spends nothing");
    }
    // Charged after the fact, a cost of 0 charges nothing at all.
    let mut d = spend(0, vec![limited(0, bucket("acme", "debt"), debt)]);
    d.op = Op::Charge;
    let a = h.decide(&mut d).await.unwrap();
    assert_eq!((a.lines[0].remaining, a.lines[0].debt), (0, 0));
}

#[tokio::test]
async fn debt_is_reported_and_the_tenant_recorded() {
    let h = Harness::memory();
    let l = rate(2, "1/hour").with_debt(10).unwrap();
    let mut d = spend(5, vec![limited(0, bucket("acme", "alice"), l)]);
    d.op = Op::Charge;
    let a = h.decide(&mut d).await.unwrap();
    assert_eq!(a.items[0].debt, 3);
    let in_debt = h.top.in_debt(10);
    assert_eq!(in_debt.len(), 1);
    assert_eq!(
        (in_debt[0].tenant.as_str(), in_debt[0].debt),
        ("acme", 3),
        "{in_debt:?}"
    );
    // A decision on the key while it is still in debt is refused and
    // records the latest sighting: 1 token below zero, two refills later.
    h.clock.advance(Duration::from_secs(2 * 3600));
    let mut d = spend(1, vec![limited(0, bucket("acme", "alice"), l)]);
    let a = h.decide(&mut d).await.unwrap();
    assert!(!a.allowed);
    assert_eq!(a.items[0].debt, 1);
    assert_eq!(h.top.in_debt(10)[0].debt, 1);
}

#[tokio::test]
async fn global_shadow_admits_what_would_be_refused() {
    let h = Harness::memory();
    let l = rate(1, "1/hour");
    for n in 0..2 {
        let mut d = spend(1, vec![limited(0, bucket("acme", "a"), l)]);
        d.shadow = true;
        let a = h.decide(&mut d).await.unwrap();
        assert!(a.allowed, "decision {n}");
        assert_eq!(a.items[0].shadow, n == 1);
        let outcome = if n == 1 {
            Outcome::ShadowRejected
        } else {
            Outcome::Allowed
        };
        assert_eq!(a.items[0].outcome, outcome);
    }
    // The shadow demand charged the bucket: an enforced one is refused.
    let mut d = spend(1, vec![limited(0, bucket("acme", "a"), l)]);
    assert!(!h.decide(&mut d).await.unwrap().allowed);
}

// ---- The deciding bucket and the headers -----------------------------

#[tokio::test]
async fn the_tightest_bucket_decides_and_its_headers_are_answered() {
    let h = Harness::memory();
    let per_key = rate(10, "10/second");
    let ceiling_limit = rate(3, "1/second");
    let lines = || {
        vec![
            limited(0, bucket("acme", "alice"), per_key),
            Line {
                label: "ceiling",
                ..limited(0, ceiling("acme"), ceiling_limit)
            },
        ]
    };
    let mut d = spend(2, lines());
    let a = h.decide(&mut d).await.unwrap();
    assert_eq!(a.items[0].line, Some(1), "1 left beats 8 left");
    assert_eq!(a.items[0].remaining, 1);
    assert_eq!(a.items[0].reset_after, 2 * SECOND);
    let headers = a.headers.unwrap();
    assert_eq!(
        (
            headers.limit,
            headers.remaining,
            headers.reset,
            headers.retry_after
        ),
        (3, 1, 2, None)
    );
    let mut d = spend(2, lines());
    let a = h.decide(&mut d).await.unwrap();
    assert!(!a.allowed);
    assert_eq!(a.items[0].line, Some(1));
    assert_eq!(a.retry_after, SECOND, "one token short at one a second");
    assert_eq!(a.items[0].retry_after, SECOND);
    assert_eq!(a.items[0].outcome, Outcome::Rejected);
    assert_eq!(a.headers.unwrap().retry_after, Some(1));
    assert!(
        a.lines[0].allowed && a.lines[0].remaining == 8,
        "the key alone would pass and is not charged"
    );
    let pairs: Vec<(&str, String)> = a.headers.unwrap().pairs().collect();
    assert_eq!(
        pairs,
        [
            ("RateLimit-Limit", "3".to_owned()),
            ("RateLimit-Remaining", "1".to_owned()),
            ("RateLimit-Reset", "2".to_owned()),
            ("Retry-After", "1".to_owned()),
        ]
    );
}

#[tokio::test]
async fn among_admitting_buckets_equal_tokens_go_to_the_longer_time_to_full() {
    let h = Harness::memory();
    let fast = rate(5, "5/second");
    let slow = rate(5, "1/second");
    let mut d = spend(
        2,
        vec![
            limited(0, bucket("acme", "fast"), fast),
            limited(0, bucket("acme", "slow"), slow),
        ],
    );
    let a = h.decide(&mut d).await.unwrap();
    assert_eq!(a.items[0].line, Some(1));
    assert_eq!(a.items[0].reset_after, 2 * SECOND);
    let mut d = spend(
        2,
        vec![
            limited(0, bucket("acme", "slow2"), slow),
            limited(0, bucket("acme", "fast2"), fast),
        ],
    );
    assert_eq!(h.decide(&mut d).await.unwrap().items[0].line, Some(0));
}

#[tokio::test]
async fn among_refusing_buckets_the_longest_wait_decides() {
    let h = Harness::memory();
    let short = rate(1, "1/second");
    let long = rate(1, "1/minute");
    for order in [
        [("short", short), ("long", long)],
        [("long", long), ("short", short)],
    ] {
        let lines = || {
            order
                .iter()
                .map(|(k, l)| limited(0, bucket("acme", &format!("{k}{:?}", order[0].0)), *l))
                .collect::<Vec<_>>()
        };
        let mut d = spend(1, lines());
        assert!(h.decide(&mut d).await.unwrap().allowed);
        let mut d = spend(1, lines());
        let a = h.decide(&mut d).await.unwrap();
        let at = order.iter().position(|(k, _)| *k == "long");
        assert_eq!(a.items[0].line, at);
        assert_eq!(a.retry_after, 60 * SECOND);
    }
    // Equal waits: the first line is reported.
    let lines = || {
        vec![
            limited(0, bucket("acme", "x"), short),
            limited(0, bucket("acme", "y"), short),
        ]
    };
    assert!(h.decide(&mut spend(1, lines())).await.unwrap().allowed);
    let a = h.decide(&mut spend(1, lines())).await.unwrap();
    assert!(!a.allowed);
    assert_eq!(a.items[0].line, Some(0));
}

#[tokio::test]
async fn an_enforced_bucket_decides_over_a_tighter_shadow_one() {
    let h = Harness::memory();
    let lines = || {
        vec![
            Line {
                enforce: false,
                label: "shadow",
                ..limited(0, bucket("acme", "s"), rate(1, "1/hour"))
            },
            limited(0, bucket("acme", "e"), rate(9, "1/hour")),
        ]
    };
    let mut d = spend(1, lines());
    let a = h.decide(&mut d).await.unwrap();
    assert_eq!(a.items[0].line, Some(1));
    let mut d = spend(1, lines());
    let a = h.decide(&mut d).await.unwrap();
    assert!(a.allowed, "the shadow line never refuses");
    assert!(a.items[0].shadow);
    assert_eq!(a.items[0].line, Some(1), "the enforced bucket is reported");
    assert_eq!(a.items[0].remaining, 7);
    assert_eq!(a.items[0].outcome, Outcome::ShadowRejected);
}

#[tokio::test]
async fn a_batch_answers_per_item_and_the_tightest_item_heads_the_answer() {
    let h = Harness::memory();
    let mut d = Demand::new(Api::Native, Op::SPEND, OverCapacity::Invalid);
    let limits = [
        rate(10, "1/second"),
        rate(4, "1/minute"),
        rate(6, "1/second"),
    ];
    for (i, k) in ["a", "b", "c"].into_iter().enumerate() {
        d.items.push(Item::new("acme", "", k, 3));
        d.lines.push(limited(i, bucket("acme", k), limits[i]));
    }
    let a = h.decide(&mut d).await.unwrap();
    assert!(a.allowed);
    let remaining: Vec<u64> = a.items.iter().map(|i| i.remaining).collect();
    assert_eq!(remaining, [7, 1, 3]);
    assert_eq!(a.headers.unwrap().remaining, 1, "item b is the tightest");
    assert_eq!(a.headers.unwrap().reset, 180);
    // Again: b cannot pay 3 and refuses the whole batch; the wait is b's.
    let mut again = d.clone();
    for (i, k) in ["a", "b", "c"].into_iter().enumerate() {
        again.lines[i].bucket = bucket("acme", k);
    }
    let a = h.decide(&mut again).await.unwrap();
    assert!(!a.allowed);
    let allowed: Vec<bool> = a.items.iter().map(|i| i.allowed).collect();
    assert_eq!(allowed, [true, false, true]);
    assert_eq!(a.retry_after, 120 * SECOND);
    assert_eq!(a.headers.unwrap().retry_after, Some(120));
    assert_eq!(
        a.items[0].retry_after, 0,
        "an admitted item waits for nothing"
    );
}

// ---- The store unavailable -------------------------------------------

#[tokio::test]
async fn with_the_store_unavailable_each_lines_policy_answers() {
    let h = Harness::store_down();
    let l = rate(4, "1/hour");
    for (policy, allowed, outcome) in [
        (OnStoreUnavailable::Allow, true, Outcome::FailedOpen),
        (OnStoreUnavailable::Deny, false, Outcome::FailedClosed),
        (OnStoreUnavailable::Local, true, Outcome::LocalFallback),
    ] {
        let mut d = spend(
            1,
            vec![Line {
                on_store_unavailable: policy,
                ..limited(0, bucket("acme", "a"), l)
            }],
        );
        let a = h.decide(&mut d).await.unwrap();
        assert_eq!(a.allowed, allowed, "{policy:?}");
        assert_eq!(a.items[0].degraded, Some(policy));
        assert_eq!(a.items[0].outcome, outcome);
        if policy == OnStoreUnavailable::Deny {
            assert_eq!(a.retry_after, 7 * SECOND, "the deny policy's retry-after");
        }
        if policy == OnStoreUnavailable::Local {
            // Half the burst of 4, one spent.
            assert_eq!(a.items[0].remaining, 1);
        }
    }
    assert!(h.store.ping().await.is_err(), "the store does not answer");
    assert!(Harness::memory().store.ping().await.is_ok());
    // A reservation is not recorded by a fallback.
    let mut d = spend(1, vec![limited(0, bucket("acme", "r"), l)]);
    let r = h
        .engine
        .reserve(&mut d, None, &tracing::Span::none())
        .await
        .unwrap();
    assert!(r.answer.allowed);
    assert_eq!(r.reservation, None);
}

#[tokio::test]
async fn with_the_store_unavailable_a_lease_is_kept_only_where_its_cap_decides_locally() {
    let h = Harness::store_down();
    let cap = Limit::concurrency(2).unwrap();
    let engine = &h.engine;
    let acquire = |policy| {
        let mut d = spend(
            1,
            vec![Line {
                on_store_unavailable: policy,
                label: "cap",
                ..limited(0, bucket("acme", "a"), cap)
            }],
        );
        async move {
            engine
                .acquire(&mut d, None, Ttl::Lease, &tracing::Span::none())
                .await
                .unwrap()
        }
    };
    let open = acquire(OnStoreUnavailable::Allow).await;
    assert!(open.answer.allowed);
    assert_eq!(open.lease, None, "failed open: nothing holds a slot");
    let local = acquire(OnStoreUnavailable::Local).await;
    assert!(local.answer.allowed);
    let id = local
        .lease
        .expect("decided locally: the in-process store holds it");
    assert_eq!(
        h.engine.lease(&id, LeaseOp::Release).await.unwrap().status,
        LeaseStatus::Done
    );
}

// ---- Reservations ----------------------------------------------------

#[tokio::test]
async fn a_settle_refunds_or_charges_the_difference_once() {
    let h = Harness::memory();
    let l = rate(10, "1/hour");
    let span = tracing::Span::none();
    let mut d = spend(5, vec![limited(0, bucket("acme", "alice"), l)]);
    let r = h.engine.reserve(&mut d, None, &span).await.unwrap();
    assert!(r.answer.allowed);
    assert_eq!(r.ttl, Ttl::DEFAULT);
    assert_eq!(r.answer.items[0].remaining, 5);
    let token = r.reservation.unwrap().to_string();
    let s = h.engine.settle(Api::Native, &token, 3).await.unwrap();
    assert_eq!(s.status, SettleStatus::Settled);
    assert_eq!(
        (s.estimate, s.actual, s.refunded, s.charged, s.forgiven),
        (5, 3, 2, 0, 0)
    );
    assert_eq!(s.tightest.remaining, 7);
    let again = h.engine.settle(Api::Native, &token, 9).await.unwrap();
    assert_eq!(again.status, SettleStatus::AlreadySettled { actual: 3 });
    assert_eq!((again.actual, again.refunded, again.charged), (3, 2, 0));

    let mut d = spend(4, vec![limited(0, bucket("acme", "alice"), l)]);
    let r = h.engine.reserve(&mut d, None, &span).await.unwrap();
    let token = r.reservation.unwrap().to_string();
    let s = h.engine.settle(Api::Native, &token, 6).await.unwrap();
    assert_eq!((s.refunded, s.charged), (0, 2));
    assert_eq!(s.tightest.remaining, 1, "7 - 6");
}

#[tokio::test]
async fn a_settle_gives_back_per_line_on_a_shared_bucket() {
    let h = Harness::memory();
    let l = rate(10, "1/hour");
    // Two rules on one bucket: the estimate of 3 is charged twice.
    let mut d = spend(
        3,
        vec![
            limited(0, bucket("acme", "alice"), l),
            limited(0, bucket("acme", "alice"), l),
        ],
    );
    let r = h
        .engine
        .reserve(&mut d, None, &tracing::Span::none())
        .await
        .unwrap();
    assert_eq!(r.answer.items[0].remaining, 4);
    let token = r.reservation.unwrap().to_string();
    let s = h.engine.settle(Api::Native, &token, 1).await.unwrap();
    assert_eq!((s.estimate, s.refunded), (3, 2));
    assert_eq!(s.tightest.remaining, 8, "2 per line given back: 10 - 2 × 1");
}

#[tokio::test]
async fn a_settle_past_the_floor_forgives_and_records_the_debt() {
    let h = Harness::memory();
    let l = rate(4, "1/hour").with_debt(2).unwrap();
    let mut d = spend(4, vec![limited(0, bucket("acme", "alice"), l)]);
    let r = h
        .engine
        .reserve(&mut d, Some(30 * SECOND as i128), &tracing::Span::none())
        .await
        .unwrap();
    assert_eq!(r.ttl, 30 * SECOND);
    let token = r.reservation.unwrap().to_string();
    let s = h.engine.settle(Api::Native, &token, 10).await.unwrap();
    assert_eq!((s.charged, s.forgiven), (6, 4), "down to -2, 4 forgiven");
    assert_eq!(s.tightest.debt, 2);
    let in_debt = h.top.in_debt(10);
    assert_eq!(in_debt.len(), 1);
    assert_eq!((in_debt[0].tenant.as_str(), in_debt[0].debt), ("acme", 2));
}

#[tokio::test]
async fn a_settle_names_what_is_wrong_with_its_token() {
    let h = Harness::memory();
    let e = h.engine.settle(Api::Native, "nope", 1).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "reservation \"nope\" is not a token Reserve returned (they start with \"r1.\")"
    );
    let long = "x".repeat(100);
    let e = h.engine.settle(Api::Native, &long, 1).await.unwrap_err();
    assert!(
        e.to_string().contains(&format!("{:?}", "x".repeat(64))),
        "{e}"
    );
    // A well-formed token of a reservation never made.
    let l = rate(10, "1/hour");
    let mut d = spend(1, vec![limited(0, bucket("acme", "a"), l)]);
    let r = h
        .engine
        .reserve(&mut d, Some(SECOND as i128), &tracing::Span::none())
        .await
        .unwrap();
    let token = r.reservation.unwrap().to_string();
    let other = Harness::memory();
    assert!(matches!(
        other.engine.settle(Api::Native, &token, 1).await,
        Err(DecideError::UnknownReservation(_))
    ));
    h.clock.advance(Duration::from_secs(2));
    match h.engine.settle(Api::Native, &token, 1).await {
        Err(DecideError::ExpiredReservation { estimate, .. }) => assert_eq!(estimate, 1),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_reserve_records_nothing_when_refused_or_unlimited_and_checks_its_ttl() {
    let h = Harness::memory();
    let span = tracing::Span::none();
    let l = rate(2, "1/hour");
    let mut d = spend(2, vec![limited(0, bucket("acme", "a"), l)]);
    assert!(
        h.engine
            .reserve(&mut d, None, &span)
            .await
            .unwrap()
            .reservation
            .is_some()
    );
    let mut d = spend(1, vec![limited(0, bucket("acme", "a"), l)]);
    let r = h.engine.reserve(&mut d, None, &span).await.unwrap();
    assert!(!r.answer.allowed);
    assert_eq!(r.reservation, None);
    let mut d = spend(1, vec![line(0, bucket("acme", "u"), Allowance::Unlimited)]);
    let r = h.engine.reserve(&mut d, None, &span).await.unwrap();
    assert!(r.answer.allowed);
    assert_eq!(r.reservation, None, "nothing charged, nothing to settle");
    let mut d = spend(1, vec![limited(0, bucket("acme", "b"), l)]);
    let e = h.engine.reserve(&mut d, Some(0), &span).await.unwrap_err();
    assert!(e.to_string().starts_with("ttl is 0.000000 s;"), "{e}");
}

#[tokio::test]
async fn a_record_is_filed_with_its_key_only_when_every_bucket_is_that_keys() {
    let h = Harness::memory();
    let span = tracing::Span::none();
    let l = rate(10, "1/hour");
    let id = |lines| {
        let mut d = spend(1, lines);
        let engine = &h.engine;
        let span = &span;
        async move {
            engine
                .reserve(&mut d, None, span)
                .await
                .unwrap()
                .reservation
                .unwrap()
        }
    };
    let own = id(vec![
        limited(0, bucket("acme", "alice"), l),
        limited(
            0,
            BucketKey::new("acme", BucketKind::KEY, "exports", "alice"),
            l,
        ),
    ])
    .await;
    assert!(own.key_spread().is_some(), "{own}");
    let other_key = id(vec![
        limited(0, bucket("acme", "alice"), l),
        limited(0, bucket("acme", "bob"), l),
    ])
    .await;
    assert_eq!(other_key.key_spread(), None, "{other_key}");
    let with_ceiling = id(vec![
        limited(0, bucket("acme", "alice"), l),
        limited(0, ceiling("acme"), l),
    ])
    .await;
    assert_eq!(with_ceiling.key_spread(), None, "{with_ceiling}");
    let ceiling_first = id(vec![limited(0, ceiling("acme"), l)]).await;
    assert_eq!(ceiling_first.key_spread(), None);
}

// ---- Leases ----------------------------------------------------------

#[tokio::test]
async fn a_cap_grants_leases_up_to_its_size_and_frees_them_on_release() {
    let h = Harness::memory();
    let span = tracing::Span::none();
    let cap = Limit::concurrency(2).unwrap();
    let acquire = || {
        let mut d = spend(
            5,
            vec![Line {
                label: "cap",
                ..limited(0, bucket("acme", "a"), cap)
            }],
        );
        let engine = &h.engine;
        let span = &span;
        async move {
            engine
                .acquire(&mut d, Some(10 * SECOND as i128), Ttl::Lease, span)
                .await
                .unwrap()
        }
    };
    let first = acquire().await;
    assert_eq!(
        (first.in_flight, first.limit, first.ttl),
        (1, 2, 10 * SECOND)
    );
    let second = acquire().await;
    assert_eq!(second.in_flight, 2);
    let third = acquire().await;
    assert!(!third.answer.allowed);
    assert_eq!(third.lease, None);
    assert_eq!((third.in_flight, third.limit), (2, 2));
    let holding = h.top.holding(10);
    assert_eq!((holding[0].tenant.as_str(), holding[0].held), ("acme", 2));

    let token = first.lease.unwrap().to_string();
    assert_eq!(
        h.engine.release(&token).await.unwrap().status,
        LeaseStatus::Done
    );
    assert_eq!(
        acquire().await.in_flight,
        2,
        "the freed slot is taken again"
    );
    match h.engine.renew(&token, None).await {
        Err(DecideError::LeaseGone { why, .. }) => assert_eq!(why, "it was released"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_full_shadow_cap_admits_without_a_lease() {
    let h = Harness::memory();
    let cap = Limit::concurrency(1).unwrap();
    let acquire = || {
        let mut d = spend(
            1,
            vec![Line {
                enforce: false,
                label: "shadow-cap",
                ..limited(0, bucket("acme", "a"), cap)
            }],
        );
        let engine = &h.engine;
        async move {
            engine
                .acquire(&mut d, None, Ttl::Lease, &tracing::Span::none())
                .await
                .unwrap()
        }
    };
    let first = acquire().await;
    assert!(first.answer.allowed && first.lease.is_some());
    let second = acquire().await;
    assert!(second.answer.allowed, "a shadow cap never refuses");
    assert!(second.answer.items[0].shadow);
    assert_eq!(second.lease, None, "it holds no slot, so there is no lease");
    assert_eq!((second.in_flight, second.limit), (1, 1));
}

#[tokio::test]
async fn an_acquire_without_a_cap_spends_tokens_and_holds_nothing() {
    let h = Harness::memory();
    let mut d = spend(3, vec![limited(0, bucket("acme", "a"), rate(5, "1/hour"))]);
    let a = h
        .engine
        .acquire(&mut d, None, Ttl::Lease, &tracing::Span::none())
        .await
        .unwrap();
    assert!(a.answer.allowed);
    assert_eq!(a.answer.items[0].remaining, 2, "spent like a decision");
    assert_eq!((a.lease, a.in_flight, a.limit), (None, 0, 0));
    assert_eq!(a.ttl, Ttl::DEFAULT);
}

#[tokio::test]
async fn a_renew_extends_a_lease_and_names_why_it_cannot() {
    let h = Harness::memory();
    let cap = Limit::concurrency(1).unwrap();
    let mut d = spend(1, vec![limited(0, bucket("acme", "a"), cap)]);
    let a = h
        .engine
        .acquire(
            &mut d,
            Some(2 * SECOND as i128),
            Ttl::Lease,
            &tracing::Span::none(),
        )
        .await
        .unwrap();
    let token = a.lease.unwrap().to_string();
    h.clock.advance(Duration::from_secs(1));
    let renewed = h
        .engine
        .renew(&token, Some(5 * SECOND as i128))
        .await
        .unwrap();
    assert_eq!(renewed.status, LeaseStatus::Done);
    h.clock.advance(Duration::from_secs(4));
    assert_eq!(
        h.engine
            .renew(&token, Some(SECOND as i128))
            .await
            .unwrap()
            .status,
        LeaseStatus::Done,
        "held 5 s from the renewal, not 2 s from the acquire"
    );
    h.clock.advance(Duration::from_secs(2));
    match h.engine.renew(&token, None).await {
        Err(DecideError::LeaseGone { why, .. }) => {
            assert_eq!(why, "its time to live passed and its slots were freed")
        }
        other => panic!("{other:?}"),
    }
    let e = h.engine.renew(&token, Some(500)).await.unwrap_err();
    assert!(
        e.to_string()
            .starts_with("ttl is 0.000500 s; a lease lives"),
        "{e}"
    );
    let e = h.engine.release("l2.x").await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "lease \"l2.x\" is not a token Acquire returned (they start with \"l1.\")"
    );
    let elsewhere = Harness::memory();
    assert!(matches!(
        elsewhere.engine.renew(&token, None).await,
        Err(DecideError::UnknownLease(_))
    ));
    let released = elsewhere.engine.release(&token).await.unwrap();
    assert_eq!(
        released.status,
        LeaseStatus::Unknown,
        "a release never fails"
    );
}

#[tokio::test]
async fn a_renewal_is_clamped_to_an_hour() {
    let h = Harness::memory();
    let cap = Limit::concurrency(1).unwrap();
    let mut d = spend(1, vec![limited(0, bucket("acme", "a"), cap)]);
    let a = h
        .engine
        .acquire(&mut d, None, Ttl::Lease, &tracing::Span::none())
        .await
        .unwrap();
    let id = a.lease.unwrap();
    let renewed = h
        .engine
        .lease(
            &id,
            LeaseOp::Renew {
                ttl: 10 * 3600 * SECOND,
            },
        )
        .await
        .unwrap();
    assert_eq!(renewed.status, LeaseStatus::Done);
    h.clock.advance(Duration::from_secs(3600));
    let late = h.engine.lease(&id, LeaseOp::Renew { ttl: SECOND }).await;
    assert!(
        matches!(late, Err(DecideError::LeaseGone { .. })),
        "renewed for one hour, not ten: {late:?}"
    );
}

// ---- What is counted -------------------------------------------------

#[tokio::test]
async fn decisions_are_counted_per_outcome_and_rule_with_their_tokens() {
    own_process();
    let h = Harness::memory();
    let mut d = Demand::new(Api::Native, Op::SPEND, OverCapacity::Invalid);
    let l = rate(4, "1/hour");
    for (i, (k, cost)) in [("a", 1), ("b", 2), ("c", 5), ("d", 3)]
        .into_iter()
        .enumerate()
    {
        d.items.push(Item::new("acme", "", k, cost));
        let mut line = limited(i, bucket("acme", k), l);
        if k == "c" {
            line.enforce = false;
        }
        d.lines.push(line);
    }
    d.over_capacity = OverCapacity::Reject;
    let a = h.decide(&mut d).await.unwrap();
    assert!(a.allowed);
    let count = |outcome: &str| {
        metric(
            "tollgate_decisions_total",
            &[("api", "native"), ("outcome", outcome), ("rule", "per-key")],
        )
    };
    let tokens = |outcome: &str| {
        metric(
            "tollgate_decision_tokens_total",
            &[("api", "native"), ("outcome", outcome), ("rule", "per-key")],
        )
    };
    assert_eq!((count("allowed"), tokens("allowed")), (3.0, 6.0));
    assert_eq!(
        (count("shadow_rejected"), tokens("shadow_rejected")),
        (1.0, 5.0)
    );
    let mut bad = spend(9, vec![limited(0, bucket("acme", "x"), l)]);
    h.decide(&mut bad).await.unwrap_err();
    let long = "k".repeat(300);
    let mut batch = Demand::new(Api::Envoy, Op::SPEND, OverCapacity::Invalid);
    for _ in 0..3 {
        batch.items.push(Item::new("acme", "", &long, 1));
    }
    h.decide(&mut batch).await.unwrap_err();
    assert_eq!(
        metric(
            "tollgate_decisions_total",
            &[("api", "native"), ("outcome", "error"), ("rule", "")]
        ),
        1.0
    );
    assert_eq!(
        metric(
            "tollgate_decisions_total",
            &[("api", "envoy"), ("outcome", "error"), ("rule", "")]
        ),
        3.0,
        "a refused demand counts each of its items"
    );
    let top = h.top.top(10, 10);
    assert!(top.is_empty(), "nothing refused: {top:?}");
    let mut d = spend(5, vec![limited(0, bucket("acme", "a"), l)]);
    d.over_capacity = OverCapacity::Reject;
    assert!(!h.decide(&mut d).await.unwrap().allowed);
    let top = h.top.top(10, 10);
    assert_eq!((top[0].tenant.as_str(), top[0].rejections), ("acme", 1));
}

#[tokio::test]
async fn usage_charged_after_the_fact_is_counted_as_charged_and_forgiven() {
    own_process();
    let h = Harness::memory();
    let l = rate(4, "1/hour").with_debt(2).unwrap();
    let mut d = spend(10, vec![limited(0, bucket("acme", "a"), l)]);
    d.op = Op::Charge;
    let a = h.decide(&mut d).await.unwrap();
    assert_eq!(a.lines[0].forgiven, 4);
    let charged = metric(
        "tollgate_charged_tokens_total",
        &[("api", "native"), ("phase", "charge")],
    );
    let forgiven = metric("tollgate_forgiven_tokens_total", &[("api", "native")]);
    assert_eq!((charged, forgiven), (10.0, 4.0));
    assert_eq!(
        metric(
            "tollgate_decisions_total",
            &[
                ("api", "native"),
                ("outcome", "allowed"),
                ("rule", "per-key")
            ]
        ),
        0.0,
        "a charge is not a decision"
    );
}

#[tokio::test]
async fn settles_and_reservations_are_counted_by_status() {
    own_process();
    let h = Harness::memory();
    let span = tracing::Span::none();
    let l = rate(10, "1/hour");
    let mut d = spend(5, vec![limited(0, bucket("acme", "a"), l)]);
    let r = h.engine.reserve(&mut d, None, &span).await.unwrap();
    let token = r.reservation.unwrap().to_string();
    h.engine.settle(Api::Native, &token, 2).await.unwrap();
    h.engine.settle(Api::Native, &token, 2).await.unwrap();
    h.engine.settle(Api::Native, "bad", 2).await.unwrap_err();
    let settles = |status: &str| {
        metric(
            "tollgate_settles_total",
            &[("api", "native"), ("status", status)],
        )
    };
    assert_eq!(
        (
            settles("settled"),
            settles("already_settled"),
            settles("invalid")
        ),
        (1.0, 1.0, 1.0)
    );
    assert_eq!(
        metric("tollgate_reservations_total", &[("api", "native")]),
        1.0
    );
    assert_eq!(
        metric("tollgate_refunded_tokens_total", &[("api", "native")]),
        3.0,
        "refunded once, not again on the retry"
    );
}

#[tokio::test]
async fn leases_held_are_counted_per_rule_until_released_or_swept() {
    own_process();
    let h = Harness::memory();
    let span = tracing::Span::none();
    let cap = Limit::concurrency(3).unwrap();
    let mut tokens = Vec::new();
    for _ in 0..4 {
        let mut d = spend(
            1,
            vec![Line {
                label: "exports-cap",
                ..limited(0, bucket("acme", "a"), cap)
            }],
        );
        let a = h
            .engine
            .acquire(&mut d, Some(5 * SECOND as i128), Ttl::Lease, &span)
            .await
            .unwrap();
        tokens.extend(a.lease.map(|l| l.to_string()));
    }
    let held = || metric("tollgate_leases_held", &[("rule", "exports-cap")]);
    assert_eq!(tokens.len(), 3);
    assert_eq!(held(), 3.0);
    assert_eq!(
        metric("tollgate_leases_acquired_total", &[("rule", "exports-cap")]),
        3.0
    );
    assert_eq!(
        metric("tollgate_leases_refused_total", &[("rule", "exports-cap")]),
        1.0
    );
    h.engine.release(&tokens[0]).await.unwrap();
    assert_eq!(held(), 2.0);
    h.engine.release(&tokens[0]).await.unwrap();
    assert_eq!(held(), 2.0, "a second release frees nothing more");
    h.clock.advance(Duration::from_secs(3));
    h.engine
        .renew(&tokens[1], Some(10 * SECOND as i128))
        .await
        .unwrap();
    h.clock.advance(Duration::from_secs(2));
    h.engine.sweep_leases();
    assert_eq!(
        held(),
        1.0,
        "the unrenewed lease is swept at its time to live"
    );
    assert_eq!(
        metric(
            "tollgate_lease_operations_total",
            &[("op", "release"), ("status", "released")]
        ),
        1.0
    );
    h.clock.advance(Duration::from_secs(10));
    h.engine.sweep_leases();
    assert_eq!(held(), 0.0);
}

#[tokio::test]
async fn items_of_different_rules_are_counted_under_their_own_rule() {
    own_process();
    let h = Harness::memory();
    let mut d = Demand::new(Api::Native, Op::SPEND, OverCapacity::Invalid);
    let l = rate(4, "1/hour");
    for (i, (k, label)) in [("a", "first"), ("b", "second"), ("c", "second")]
        .into_iter()
        .enumerate()
    {
        d.items.push(Item::new("acme", "", k, 1));
        d.lines.push(Line {
            label,
            ..limited(i, bucket("acme", k), l)
        });
    }
    assert!(h.decide(&mut d).await.unwrap().allowed);
    let count = |rule: &str| {
        metric(
            "tollgate_decisions_total",
            &[("api", "native"), ("outcome", "allowed"), ("rule", rule)],
        )
    };
    assert_eq!((count("first"), count("second")), (1.0, 2.0));
}

#[tokio::test]
async fn debt_seen_stays_in_view_when_a_later_decision_is_out_of_debt() {
    let h = Harness::memory();
    let l = rate(4, "1/second").with_debt(10).unwrap();
    let mut d = spend(7, vec![limited(0, bucket("acme", "alice"), l)]);
    d.op = Op::Charge;
    assert_eq!(h.decide(&mut d).await.unwrap().items[0].debt, 3);
    h.clock.advance(Duration::from_secs(10));
    let mut d = spend(1, vec![limited(0, bucket("acme", "alice"), l)]);
    assert_eq!(h.decide(&mut d).await.unwrap().items[0].debt, 0);
    let mut d = spend(1, vec![limited(0, bucket("acme", "alice"), l)]);
    d.op = Op::Charge;
    assert_eq!(h.decide(&mut d).await.unwrap().items[0].debt, 0);
    let in_debt = h.top.in_debt(10);
    assert_eq!(in_debt.len(), 1, "{in_debt:?}");
    assert_eq!(in_debt[0].debt, 3, "the deepest sighting in the window");
    // The same through settles (recorded per tenant).
    let h = Harness::memory();
    let span = tracing::Span::none();
    let mut d = spend(4, vec![limited(0, bucket("globex", "bob"), l)]);
    let r = h.engine.reserve(&mut d, None, &span).await.unwrap();
    let token = r.reservation.unwrap().to_string();
    let s = h.engine.settle(Api::Native, &token, 6).await.unwrap();
    assert_eq!(s.tightest.debt, 2);
    h.clock.advance(Duration::from_secs(10));
    let mut d = spend(1, vec![limited(0, bucket("globex", "bob"), l)]);
    let r = h.engine.reserve(&mut d, None, &span).await.unwrap();
    let token = r.reservation.unwrap().to_string();
    let s = h.engine.settle(Api::Native, &token, 1).await.unwrap();
    assert_eq!(s.tightest.debt, 0);
    let seen: Vec<u64> = h.top.in_debt(10).iter().map(|d| d.debt).collect();
    assert_eq!(seen, [2]);
}

// ---- The decision's span ---------------------------------------------

/// Collects the fields recorded on spans.
struct Fields(Arc<parking_lot::Mutex<Vec<(String, String)>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Fields {
    fn on_record(
        &self,
        _: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        struct Visit<'a>(&'a mut Vec<(String, String)>);
        impl tracing::field::Visit for Visit<'_> {
            fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
                self.0.push((field.name().to_owned(), value.to_owned()));
            }
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                self.0.push((field.name().to_owned(), format!("{value:?}")));
            }
        }
        values.record(&mut Visit(&mut self.0.lock()));
    }
}

/// Runs `decide` with a span whose `outcome` and `rule` fields are
/// recorded, and returns what was recorded.
fn span_fields(decide: impl FnOnce(&tracing::Span)) -> Vec<(String, String)> {
    use tracing_subscriber::layer::SubscriberExt;
    let recorded = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let subscriber = tracing_subscriber::registry().with(Fields(recorded.clone()));
    tracing::subscriber::with_default(subscriber, || {
        let span = tracing::info_span!(
            "decision",
            outcome = tracing::field::Empty,
            rule = tracing::field::Empty
        );
        decide(&span);
    });
    recorded.lock().clone()
}

fn pairs(fields: &[(&str, &str)]) -> Vec<(String, String)> {
    fields
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

#[test]
fn the_span_is_given_the_outcome_and_the_deciding_rule() {
    let h = Harness::memory();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let l = rate(1, "1/hour");
    let run = |d: &mut Demand<'_>| {
        span_fields(|span| {
            let _ = runtime.block_on(h.engine.decide(d, span));
        })
    };
    // One item: its own outcome, shadow included.
    let shadow = |k| Line {
        enforce: false,
        label: "shadow-rule",
        ..limited(0, bucket("acme", k), l)
    };
    assert_eq!(
        run(&mut spend(1, vec![shadow("s")])),
        pairs(&[("outcome", "allowed"), ("rule", "shadow-rule")])
    );
    assert_eq!(
        run(&mut spend(1, vec![shadow("s")])),
        pairs(&[("outcome", "shadow_rejected"), ("rule", "shadow-rule")])
    );
    // A batch: allowed or rejected as a whole; the first item's rule.
    let batch = |keys: [&'static str; 2]| {
        let mut d = Demand::new(Api::Native, Op::SPEND, OverCapacity::Invalid);
        for (i, k) in keys.into_iter().enumerate() {
            d.items.push(Item::new("acme", "", k, 1));
            d.lines.push(Line {
                label: if i == 0 { "first" } else { "second" },
                ..limited(i, bucket("acme", k), l)
            });
        }
        d
    };
    assert_eq!(
        run(&mut batch(["a", "b"])),
        pairs(&[("outcome", "allowed"), ("rule", "first")])
    );
    assert_eq!(
        run(&mut batch(["c", "b"])),
        pairs(&[("outcome", "rejected"), ("rule", "first")])
    );
    // Usage charged after the fact, and a refused demand.
    let mut charge = spend(1, vec![limited(0, bucket("acme", "z"), l)]);
    charge.op = Op::Charge;
    assert_eq!(run(&mut charge), pairs(&[("outcome", "charged")]));
    assert_eq!(
        run(&mut spend(2, vec![limited(0, bucket("acme", "y"), l)])),
        pairs(&[("outcome", "error")])
    );
}

#[tokio::test]
async fn a_cap_with_room_in_a_refused_acquire_grants_and_counts_nothing() {
    own_process();
    let h = Harness::memory();
    let cap = Limit::concurrency(5).unwrap();
    let l = rate(1, "1/hour");
    let span = tracing::Span::none();
    for n in 0..2 {
        let mut d = spend(
            1,
            vec![
                Line {
                    label: "cap",
                    ..limited(0, bucket("acme", "a"), cap)
                },
                limited(0, ceiling("acme"), l),
            ],
        );
        let a = h
            .engine
            .acquire(&mut d, None, Ttl::Lease, &span)
            .await
            .unwrap();
        assert_eq!(a.answer.allowed, n == 0);
        assert_eq!(a.lease.is_some(), n == 0);
    }
    // The second acquire was refused by the rate, not the cap.
    assert_eq!(
        metric("tollgate_leases_acquired_total", &[("rule", "cap")]),
        1.0
    );
    assert_eq!(
        metric("tollgate_leases_refused_total", &[("rule", "cap")]),
        0.0
    );
    assert_eq!(metric("tollgate_leases_held", &[("rule", "cap")]), 1.0);
}

#[tokio::test]
async fn the_lease_book_holds_at_most_a_hundred_thousand_leases() {
    own_process();
    let options = BackendOptions {
        max_buckets: 200_000,
        max_bucket_bytes: 1 << 30,
        max_records: 400_000,
        ..options()
    };
    let h = Harness::with(options, Unmatched::Allow, None);
    let cap = Limit::concurrency(1).unwrap();
    let span = tracing::Span::none();
    let keys: Vec<String> = (0..100_001).map(|i| format!("k{i}")).collect();
    for k in &keys {
        let mut d = spend(1, vec![limited(0, bucket("acme", k), cap)]);
        let a = h
            .engine
            .acquire(&mut d, None, Ttl::Lease, &span)
            .await
            .unwrap();
        assert!(a.lease.is_some(), "{k}: {a:?}");
    }
    // Granted all; the instance's book (behind the gauge) stops at its
    // bound, so a flood of leases cannot grow it without end.
    assert_eq!(
        metric("tollgate_leases_acquired_total", &[("rule", "per-key")]),
        100_001.0
    );
    assert_eq!(
        metric("tollgate_leases_held", &[("rule", "per-key")]),
        100_000.0
    );
}

/// A quota's line counts in the period of its billing cycle that holds the
/// decision's instant: refused until that period ends, exactly, with the
/// period's end as the reset, and admitted again from the next period.
#[tokio::test]
async fn a_quota_counts_in_the_period_that_holds_the_decisions_instant() {
    use tollgate_engine::algorithm::calendar::{Bounds, Cycle, Period};
    let h = Harness::memory();
    let cycle = Cycle::new("America/New_York", 15, 1, "monday").unwrap();
    let template = Limit::quota(2, Bounds { start: 0, end: 1 }).unwrap();
    let quota = |key| Line {
        label: "monthly",
        calendar: Some((Period::Month, &cycle)),
        ..limited(0, bucket("acme", key), template)
    };
    // 2026-03-15T03:00:00Z: 23:00 on the 14th in New York, an hour before
    // the period that began on 15 February ends.
    let end_of_february_period: Micros = 1_773_547_200_000_000;
    let now = end_of_february_period - 3600 * SECOND;
    h.clock.set(now);
    for left in [1, 0] {
        let a = h.decide(&mut spend(1, vec![quota("alice")])).await.unwrap();
        assert!(a.allowed);
        assert_eq!(a.lines[0].remaining, left);
        assert_eq!(a.lines[0].reset_after, 3600 * SECOND);
    }
    let a = h.decide(&mut spend(1, vec![quota("alice")])).await.unwrap();
    assert!(!a.allowed);
    assert_eq!(a.retry_after, 3600 * SECOND);
    let headers = a.headers.unwrap();
    assert_eq!(
        (
            headers.limit,
            headers.remaining,
            headers.reset,
            headers.retry_after
        ),
        (2, 0, 3600, Some(3600))
    );
    // A microsecond before the period ends: still refused.
    h.clock.set(end_of_february_period - 1);
    let a = h.decide(&mut spend(1, vec![quota("alice")])).await.unwrap();
    assert_eq!((a.allowed, a.retry_after), (false, 1));
    // At its end the next period starts, with the whole quota.
    h.clock.set(end_of_february_period);
    let a = h.decide(&mut spend(2, vec![quota("alice")])).await.unwrap();
    assert!(a.allowed);
    assert_eq!(a.lines[0].remaining, 0);
    // It ends on 15 April, midnight in New York: 31 days on (both ends in
    // EDT; the clocks changed on 8 March).
    assert_eq!(a.lines[0].reset_after, 31 * 24 * 3600 * SECOND);
}

/// With the store down and the quota failing open, the answer says the
/// quota is counted afresh when its period ends.
#[tokio::test]
async fn a_quota_failing_open_resets_when_its_period_ends() {
    use tollgate_engine::algorithm::calendar::{Bounds, Cycle, Period};
    let h = Harness::store_down();
    let cycle = Cycle::default();
    let template = Limit::quota(100, Bounds { start: 0, end: 1 }).unwrap();
    let line = Line {
        calendar: Some((Period::Day, &cycle)),
        ..limited(0, bucket("acme", "alice"), template)
    };
    // 2023-11-14T22:13:17Z: the UTC day ends 1 h 46 min 43 s on.
    let a = h.decide(&mut spend(3, vec![line])).await.unwrap();
    assert!(a.allowed);
    assert_eq!(a.lines[0].remaining, 97);
    assert_eq!(a.lines[0].reset_after, (3600 + 46 * 60 + 43) * SECOND);
}

mod shares {
    //! `Engine::share`: a data plane's report settled, and its next
    //! assignment.

    use super::*;
    use tollgate_engine::engine::shares::{Assignment, Member, ShareBucket, Usage};

    /// A report of `acme` on `lines`.
    fn report<'a>(lines: Vec<Line<'a>>) -> Demand<'a> {
        let mut d = Demand::new(Api::Rlqs, Op::Charge, OverCapacity::Reject);
        d.items.push(Item::new("acme", "", "", 0));
        d.lines.extend(lines);
        d
    }

    fn usage(allowed: u64, denied: u64) -> Usage {
        Usage {
            allowed,
            denied,
            elapsed: SECOND,
            demand: None,
        }
    }

    fn member(id: &str, last: Option<Assignment>) -> Member<'_> {
        Member {
            id,
            ttl: 15 * SECOND,
            last,
        }
    }

    /// The bucket of a token-bucket assignment.
    fn bucket_of(a: Assignment) -> ShareBucket {
        match a {
            Assignment::Bucket(b) => b,
            other => panic!("a token bucket expected, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_report_is_charged_and_the_assignment_holds_the_share_of_what_is_left() {
        let h = Harness::memory();
        let limit = rate(10, "10/second");
        let lines = || vec![limited(0, ceiling("acme"), limit)];
        let first = h
            .engine
            .share(&mut report(lines()), usage(2, 0), member("a", None))
            .await
            .unwrap();
        // Alone: the whole rate (100 tokens every 10 s) and the 8 tokens
        // left after the report's 2.
        let b = bucket_of(first.assignment);
        assert_eq!(
            b,
            ShareBucket {
                max_tokens: 8,
                tokens_per_fill: 100,
                fill_interval: 10
            }
        );
        assert_eq!((first.ppm, first.members), (1_000_000, 1));
        // The store was charged: a native decision sees 8 left.
        let mut ask = spend(1, lines());
        assert_eq!(h.decide(&mut ask).await.unwrap().items[0].remaining, 7);

        // Nothing moved: the same assignment (Envoy keeps its bucket).
        let again = h
            .engine
            .share(
                &mut report(lines()),
                usage(0, 0),
                member("a", Some(first.assignment)),
            )
            .await
            .unwrap();
        assert_eq!(again.assignment, first.assignment);
        // Refilled to the full 10: more than a tenth above 8, a new bucket.
        h.clock.advance(Duration::from_secs(1));
        let grown = h
            .engine
            .share(
                &mut report(lines()),
                usage(0, 0),
                member("a", Some(again.assignment)),
            )
            .await
            .unwrap();
        assert_eq!(bucket_of(grown.assignment).max_tokens, 10);

        // A second member, through the same store, gets nothing until the
        // first gives some back at its next report.
        let b2 = h
            .engine
            .share(&mut report(lines()), usage(30, 0), member("b", None))
            .await
            .unwrap();
        assert_eq!(b2.assignment, Assignment::DenyAll);
        assert_eq!((b2.ppm, b2.members), (0, 2));
        let a2 = h
            .engine
            .share(
                &mut report(lines()),
                usage(10, 0),
                member("a", Some(grown.assignment)),
            )
            .await
            .unwrap();
        // Demand 10 against 30: a quarter, 2.5 a second (150 every 60 s).
        assert_eq!(a2.ppm, 250_000);
        let b = bucket_of(a2.assignment);
        assert_eq!((b.tokens_per_fill, b.fill_interval), (150, 60));
        // The requests it refused are counted in the top-limited view.
        h.engine
            .share(
                &mut report(lines()),
                usage(0, 7),
                member("a", Some(a2.assignment)),
            )
            .await
            .unwrap();
        assert!(h.top.top(10, 0).iter().any(|t| t.tenant == "acme"));
    }

    #[tokio::test]
    async fn a_fill_interval_change_alone_changes_the_capacity_too() {
        // Envoy 1.40 compares a fill interval's nanoseconds only: an
        // assignment differing from the last in whole seconds alone would be
        // taken for the same, so the capacity moves by one.
        let h = Harness::memory();
        let lines = vec![limited(0, ceiling("acme"), rate(10, "10/second"))];
        let last = Assignment::Bucket(ShareBucket {
            max_tokens: 10,
            tokens_per_fill: 100,
            fill_interval: 20,
        });
        let shared = h
            .engine
            .share(&mut report(lines), usage(0, 0), member("a", Some(last)))
            .await
            .unwrap();
        assert_eq!(
            bucket_of(shared.assignment),
            ShareBucket {
                max_tokens: 11,
                tokens_per_fill: 100,
                fill_interval: 10
            }
        );
    }

    #[tokio::test]
    async fn blocked_shadow_and_unmatched_buckets_get_blanket_rules() {
        let h = Harness::memory();
        let blocked = line(0, ceiling("acme"), Allowance::Blocked { window: SECOND });
        let shared = h
            .engine
            .share(&mut report(vec![blocked]), usage(1, 0), member("a", None))
            .await
            .unwrap();
        assert_eq!(shared.assignment, Assignment::DenyAll);
        let mut shadow = limited(0, ceiling("acme"), rate(1, "1/hour"));
        shadow.enforce = false;
        let shared = h
            .engine
            .share(&mut report(vec![shadow]), usage(5, 0), member("a", None))
            .await
            .unwrap();
        assert_eq!(shared.assignment, Assignment::AllowAll);
        let shared = h
            .engine
            .share(&mut report(vec![]), usage(5, 0), member("a", None))
            .await
            .unwrap();
        assert_eq!(shared.assignment, Assignment::AllowAll);
        let deny = Harness::with(options(), Unmatched::Deny, None);
        let shared = deny
            .engine
            .share(&mut report(vec![]), usage(5, 0), member("a", None))
            .await
            .unwrap();
        assert_eq!(shared.assignment, Assignment::DenyAll);
    }

    #[tokio::test]
    async fn with_the_store_down_the_tightest_rules_policy_decides() {
        let h = Harness::store_down();
        let with = |policy| {
            let mut l = limited(0, ceiling("acme"), rate(100, "10/second"));
            l.on_store_unavailable = policy;
            vec![l]
        };
        let open = h
            .engine
            .share(
                &mut report(with(OnStoreUnavailable::Allow)),
                usage(1, 0),
                member("a", None),
            )
            .await
            .unwrap();
        assert_eq!(open.assignment, Assignment::AllowAll);
        assert_eq!(open.degraded, Some(OnStoreUnavailable::Allow));
        let closed = h
            .engine
            .share(
                &mut report(with(OnStoreUnavailable::Deny)),
                usage(1, 0),
                member("a", None),
            )
            .await
            .unwrap();
        assert_eq!(closed.assignment, Assignment::DenyAll);
        let local = h
            .engine
            .share(
                &mut report(with(OnStoreUnavailable::Local)),
                usage(1, 0),
                member("a", None),
            )
            .await
            .unwrap();
        // Half the limit (local_fraction 0.5): 5 a second, and the local
        // bucket's 49 of 50 left.
        assert_eq!(
            bucket_of(local.assignment),
            ShareBucket {
                max_tokens: 49,
                tokens_per_fill: 150,
                fill_interval: 30
            }
        );
        assert_eq!(local.degraded, Some(OnStoreUnavailable::Local));
    }
}
