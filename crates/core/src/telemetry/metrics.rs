//! Every metric Tollgate exports, registered in this one file.
//!
//! Labels stay bounded: API, outcome and rule names (one per row of the
//! limits table), never keys or tenants.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Once, OnceLock};
use std::time::Duration;

use metrics::{counter, describe_counter, describe_gauge, gauge};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Decisions, by `api`, `outcome` and `rule`.
pub const DECISIONS: &str = "tollgate_decisions_total";
/// Tokens asked for, by `api`, `outcome` and `rule`.
pub const TOKENS: &str = "tollgate_decision_tokens_total";
/// Limits table reloads, by `result` (`success`, `failure`).
pub const RELOADS: &str = "tollgate_limits_reloads_total";
/// Rules in force.
pub const RULES: &str = "tollgate_rules_loaded";
/// Limits rows rejected by validation and not fixed since.
pub const REJECTED_ROWS: &str = "tollgate_limits_rejected_rows";
/// Buckets held in memory.
pub const BUCKETS: &str = "tollgate_buckets";
/// The in-memory bucket cap.
pub const BUCKETS_MAX: &str = "tollgate_buckets_max";
/// Bytes of in-memory buckets, as counted against their cap.
pub const BUCKET_BYTES: &str = "tollgate_bucket_bytes";
/// The cap on bytes of in-memory buckets.
pub const BUCKET_BYTES_MAX: &str = "tollgate_bucket_bytes_max";
/// Threads running the service (`--worker-threads`).
pub const WORKER_THREADS: &str = "tollgate_worker_threads";
/// 1 when the runtime keeps tokio's LIFO slot (`--runtime-lifo-slot`, or a
/// build without `--cfg tokio_unstable`; see `tollgate::runtime`), 0 when
/// it is off.
pub const RUNTIME_LIFO_SLOT: &str = "tollgate_runtime_lifo_slot";
/// Buckets dropped from memory, by `reason` (`idle`: only full buckets are
/// ever dropped).
pub const EVICTIONS: &str = "tollgate_bucket_evictions_total";
/// Decisions refused because the in-memory store was at its cap.
pub const REFUSED_AT_CAPACITY: &str = "tollgate_bucket_capacity_refusals_total";

/// How a decision ended, as the `outcome` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Admitted.
    Allowed,
    /// Rejected by an enforced rule.
    Rejected,
    /// Admitted, but a shadow rule would have rejected.
    ShadowRejected,
    /// The store was down; the rule fails open.
    FailedOpen,
    /// The store was down; the rule fails closed.
    FailedClosed,
    /// The store was down; decided with in-process buckets.
    LocalFallback,
    /// Refused as invalid, or the store failed with no fallback.
    Error,
}

/// Decisions per outcome since start, for the status page (indexed like
/// [`Outcome::ALL`]).
static TOTALS: [AtomicU64; 7] = [const { AtomicU64::new(0) }; 7];

/// Decisions per outcome since start, in [`Outcome::ALL`] order.
pub fn totals() -> [u64; 7] {
    std::array::from_fn(|i| TOTALS[i].load(Ordering::Relaxed))
}

impl Outcome {
    /// Every outcome, in label order.
    pub const ALL: [Outcome; 7] = [
        Self::Allowed,
        Self::Rejected,
        Self::ShadowRejected,
        Self::FailedOpen,
        Self::FailedClosed,
        Self::LocalFallback,
        Self::Error,
    ];

    /// The `outcome` label value.
    pub fn label(self) -> &'static str {
        match self {
            Self::Allowed => "allowed",
            Self::Rejected => "rejected",
            Self::ShadowRejected => "shadow_rejected",
            Self::FailedOpen => "failed_open",
            Self::FailedClosed => "failed_closed",
            Self::LocalFallback => "local_fallback",
            Self::Error => "error",
        }
    }
}

/// How often histogram samples are folded into their buckets.
pub const UPKEEP_PERIOD: Duration = Duration::from_secs(1);

/// The process-wide Prometheus recorder, installed on first use, with its
/// upkeep thread (`start_upkeep(UPKEEP_PERIOD)`).
pub fn handle() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        // Latencies as histograms (not summaries) so that PromQL can
        // aggregate them across instances with histogram_quantile.
        let buckets = [
            0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
            0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
        ];
        let builder = || {
            PrometheusBuilder::new()
                .set_buckets(&buckets)
                .expect("non-empty buckets")
        };
        let handle = builder()
            .install_recorder()
            .unwrap_or_else(|_| builder().build_recorder().handle());
        describe_counter!(
            DECISIONS,
            "Rate-limit decisions, by API, outcome and deciding rule."
        );
        describe_counter!(
            TOKENS,
            "Tokens asked for, by API, outcome and deciding rule."
        );
        describe_counter!(
            RELOADS,
            "Batches of limits changes applied (success), and batches that rejected a row or reads of the table that failed (failure)."
        );
        describe_gauge!(RULES, "Rules in force.");
        describe_gauge!(
            REJECTED_ROWS,
            "Limits rows rejected by validation and not fixed since (each listed at /v1/limits)."
        );
        describe_gauge!(BUCKETS, "Buckets held in this process's memory.");
        describe_gauge!(BUCKETS_MAX, "The cap on buckets held in memory.");
        describe_gauge!(
            BUCKET_BYTES,
            "Bytes of buckets held in memory, each counted as 160 bytes plus its key."
        );
        describe_gauge!(BUCKET_BYTES_MAX, "The cap on bytes of buckets held in memory.");
        describe_gauge!(WORKER_THREADS, "Threads running the service.");
        describe_gauge!(
            RUNTIME_LIFO_SLOT,
            "1 if the runtime keeps its LIFO slot (--runtime-lifo-slot, or built without --cfg tokio_unstable), 0 if it is off."
        );
        describe_counter!(EVICTIONS, "Buckets dropped from memory, by reason.");
        describe_counter!(
            REFUSED_AT_CAPACITY,
            "Decisions that needed new in-memory buckets while the store was at its cap; answered by each rule's store-unavailable policy."
        );
        metrics::describe_histogram!(
            STORE_DURATION,
            metrics::Unit::Seconds,
            "Store call latency, by store and operation."
        );
        describe_counter!(STORE_ERRORS, "Store errors, by store and kind.");
        describe_counter!(
            STORE_DECISIONS,
            "Decisions sent to the shared store (several per call when coalescing)."
        );
        describe_gauge!(
            BREAKER_STATE,
            "Circuit breaker state: 0 closed, 1 open, 2 half-open."
        );
        describe_gauge!(
            NODE_BREAKER_STATE,
            "Each Redis primary's circuit breaker: 0 closed, 1 open, 2 half-open."
        );
        describe_counter!(
            NODE_ERRORS,
            "Failed calls to a Redis node, by node and kind."
        );
        describe_counter!(
            FAILOVERS,
            "Redis failovers seen: a replica took over a failed primary, or Sentinel named a new primary."
        );
        describe_counter!(
            TOPOLOGY_REFRESHES,
            "Reads of the Redis Cluster slot map or of Sentinel's primary, by result."
        );
        describe_counter!(
            REDIRECTS,
            "Redis Cluster redirects followed, by kind (moved, ask, tryagain)."
        );
        describe_counter!(
            SLICE_TAKES,
            "Token slices taken from the store (--token-slices), by result."
        );
        describe_counter!(
            SLICE_LOCAL_REFUSALS,
            "Decisions on a sliced bucket refused without the store."
        );
        describe_counter!(
            ENVOY_RELOADS,
            "Envoy configuration loads and reloads, by result."
        );
        metrics::describe_histogram!(
            GRPC_DURATION,
            metrics::Unit::Seconds,
            "gRPC request latency, by method."
        );
        describe_connections();
        describe_budgets();
        start_upkeep(UPKEEP_PERIOD);
        handle
    })
}

/// Folds histogram samples into their buckets every `period`, on a thread
/// of its own. The recorder keeps every sample until it is asked to: without
/// this, each decision's latency samples would pile up between scrapes, and
/// without bound (megabytes per second under load) where nobody scrapes.
/// The first call starts the thread; later calls do nothing.
pub fn start_upkeep(period: Duration) {
    static STARTED: Once = Once::new();
    STARTED.call_once(|| {
        let spawned = std::thread::Builder::new()
            .name("tollgate-metrics".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(period);
                    handle().run_upkeep();
                }
            });
        if let Err(err) = spawned {
            tracing::error!(%err, "cannot start the metrics upkeep thread; histograms grow until scraped");
        }
    });
}

/// Counts one decision.
///
/// The counter handles are registered once per (rule, api, outcome) and
/// cached, so the hot path neither builds label strings nor looks the
/// series up in the registry.
pub fn decision(api: &'static str, outcome: Outcome, rule: &str, tokens: u64) {
    decisions(api, outcome, rule, 1, tokens);
}

/// Counts `n` decisions with the same outcome and rule, which spent
/// `tokens` together (a batch's items).
pub fn decisions(api: &'static str, outcome: Outcome, rule: &str, n: u64, tokens: u64) {
    TOTALS[outcome as usize].fetch_add(n, Ordering::Relaxed);
    let api_index = match api {
        "native" => 0,
        "envoy" => 1,
        _ => 2,
    };
    let cached = decision_handles()
        .get(rule)
        .and_then(|slots| slots[api_index][outcome as usize].clone());
    let (decisions, tokens_counter) = match cached {
        Some(handles) => handles,
        None => {
            let labels = [
                ("api", api.to_owned()),
                ("outcome", outcome.label().to_owned()),
                ("rule", rule.to_owned()),
            ];
            let handles = (
                counter!(DECISIONS, &labels),
                TokenCounter::new(counter!(TOKENS, &labels)),
            );
            decision_handles().entry(rule.to_owned()).or_default()[api_index][outcome as usize] =
                Some(handles.clone());
            handles
        }
    };
    decisions.increment(n);
    tokens_counter.add(tokens);
}

/// Metric handles by their labels, looked up on every decision: keyed with
/// foldhash (labels are rule names and fixed strings, never a caller's
/// bytes), which hashes a rule name in a fraction of SipHash's time.
type Handles<K, M> = dashmap::DashMap<K, M, foldhash::fast::RandomState>;

type DecisionSlots = [[Option<(metrics::Counter, TokenCounter)>; 7]; 3];

/// Counter handles by rule name, then API (native, envoy, rlqs) and
/// outcome.
fn decision_handles() -> &'static Handles<String, DecisionSlots> {
    static HANDLES: OnceLock<Handles<String, DecisionSlots>> = OnceLock::new();
    HANDLES.get_or_init(Handles::default)
}

/// Counts a batch of limits changes applied (`ok`: no row newly rejected)
/// or a failed read of the table (`ok` false), with the rules in force and
/// the rows rejected.
pub fn limits_reload(ok: bool, rules: usize, rejected_rows: usize) {
    counter!(RELOADS, "result" => if ok { "success" } else { "failure" }).increment(1);
    gauge!(RULES).set(rules as f64);
    gauge!(REJECTED_ROWS).set(rejected_rows as f64);
}

/// Publishes the in-memory store's figures (called when metrics are scraped).
pub fn memory_store(figures: &crate::store::MemoryFigures) {
    gauge!(BUCKETS).set(figures.buckets as f64);
    gauge!(BUCKETS_MAX).set(figures.max_buckets as f64);
    gauge!(BUCKET_BYTES).set(figures.bytes as f64);
    gauge!(BUCKET_BYTES_MAX).set(figures.max_bytes as f64);
    let (evicted_idle, refused) = (figures.evicted_idle, figures.refused_at_capacity);
    counter!(EVICTIONS, "reason" => "idle").absolute(evicted_idle);
    counter!(REFUSED_AT_CAPACITY).absolute(refused);
}

/// Publishes how many threads run the service and whether the runtime
/// keeps its LIFO slot (called once at start, from inside the runtime).
pub fn runtime(lifo_slot: bool) {
    let workers = tokio::runtime::Handle::current().metrics().num_workers();
    gauge!(WORKER_THREADS).set(workers as f64);
    gauge!(RUNTIME_LIFO_SLOT).set(f64::from(u8::from(lifo_slot)));
}

/// Store call latency, by `store` and `op`.
pub const STORE_DURATION: &str = "tollgate_store_duration_seconds";
/// Decisions sent to the store, by `store`.
pub const STORE_DECISIONS: &str = "tollgate_store_decisions_total";
/// Store errors, by `store` and `kind`.
pub const STORE_ERRORS: &str = "tollgate_store_errors_total";
/// Circuit breaker state by `store`: 0 closed, 1 open, 2 half-open.
pub const BREAKER_STATE: &str = "tollgate_store_circuit_state";

/// Store call durations in process, for the status page.
pub static STORE_LATENCY: super::latency::Latency = super::latency::Latency::new();

/// Records one store call's duration.
pub fn store_call(store: &'static str, op: &'static str, took: std::time::Duration) {
    STORE_LATENCY.record(took.as_micros() as u64);
    static HANDLES: OnceLock<Handles<(&str, &str), metrics::Histogram>> = OnceLock::new();
    cached(
        &HANDLES,
        (store, op),
        || metrics::histogram!(STORE_DURATION, "store" => store, "op" => op),
    )
    .record(took.as_secs_f64());
}

/// Decisions sent to the store, counted per script call: with Redis
/// coalescing on, `tollgate_store_decisions_total` divided by the count of
/// `tollgate_store_duration_seconds{op="decide"}` is the decisions per call.
pub fn store_decisions(store: &'static str, decisions: usize) {
    static HANDLES: OnceLock<Handles<&str, metrics::Counter>> = OnceLock::new();
    cached(
        &HANDLES,
        store,
        || counter!(STORE_DECISIONS, "store" => store),
    )
    .increment(decisions as u64);
}

/// The metric handle for `labels`, registered on first use: the hot path
/// then neither builds a label list nor looks the series up. The recorder
/// is installed before the first handle is made, so none is a no-op.
fn cached<K, M>(handles: &OnceLock<Handles<K, M>>, labels: K, register: impl FnOnce() -> M) -> M
where
    K: std::hash::Hash + Eq,
    M: Clone,
{
    let handles = handles.get_or_init(|| {
        handle();
        Handles::default()
    });
    if let Some(found) = handles.get(&labels) {
        return found.clone();
    }
    handles.entry(labels).or_insert_with(register).clone()
}

/// Counts a store error.
pub fn store_error(store: &'static str, kind: &'static str) {
    counter!(STORE_ERRORS, "store" => store, "kind" => kind).increment(1);
}

/// Publishes the circuit breaker's state.
pub fn breaker_state(store: &'static str, state: u8) {
    gauge!(BREAKER_STATE, "store" => store).set(f64::from(state));
}

/// Each Redis primary's circuit breaker, by `node` (`host:port`): 0 closed,
/// 1 open, 2 half-open.
pub const NODE_BREAKER_STATE: &str = "tollgate_store_node_circuit_state";
/// Failed calls to a Redis node, by `node` and `kind`.
pub const NODE_ERRORS: &str = "tollgate_store_node_errors_total";
/// Redis failovers seen: a replica took over a failed primary's slots (or
/// Sentinel named a new primary).
pub const FAILOVERS: &str = "tollgate_store_failovers_total";
/// Reads of the Redis slot map (or of Sentinel's primary), by `result`
/// (`changed`, `unchanged`, `failed`).
pub const TOPOLOGY_REFRESHES: &str = "tollgate_store_topology_refreshes_total";
/// Redis Cluster redirects followed, by `kind` (`moved`, `ask`,
/// `tryagain`).
pub const REDIRECTS: &str = "tollgate_store_redirects_total";

/// Publishes a Redis node's breaker state.
pub fn node_breaker_state(node: &str, state: u8) {
    gauge!(NODE_BREAKER_STATE, "node" => node.to_owned()).set(f64::from(state));
}

/// Counts a failed call to a Redis node (`node` is bounded: the store
/// labels at most 64 nodes, the rest `other`).
pub fn node_error(node: &str, kind: &'static str) {
    counter!(NODE_ERRORS, "node" => node.to_owned(), "kind" => kind).increment(1);
}

/// Counts failovers.
pub fn failovers(count: u64) {
    counter!(FAILOVERS).increment(count);
}

/// Counts a slot-map (or Sentinel) read.
pub fn topology_refresh(result: &'static str) {
    counter!(TOPOLOGY_REFRESHES, "result" => result).increment(1);
}

/// Counts a redirect followed.
pub fn store_redirect(kind: &'static str) {
    counter!(REDIRECTS, "kind" => kind).increment(1);
}

/// Envoy configuration reloads, by `result`.
pub const ENVOY_RELOADS: &str = "tollgate_envoy_config_reloads_total";

/// Counts an Envoy configuration load or reload.
pub fn envoy_config_reload(ok: bool) {
    counter!(ENVOY_RELOADS, "result" => if ok { "success" } else { "failure" }).increment(1);
}

/// gRPC request latency, by `method`.
pub const GRPC_DURATION: &str = "tollgate_grpc_request_duration_seconds";

/// Records one gRPC request's latency.
pub fn grpc_request(method: &'static str, took: std::time::Duration) {
    static HANDLES: OnceLock<Handles<&'static str, metrics::Histogram>> = OnceLock::new();
    let handles = HANDLES.get_or_init(Handles::default);
    let histogram = match handles.get(method) {
        Some(h) => h.clone(),
        None => handles
            .entry(method)
            .or_insert_with(|| metrics::histogram!(GRPC_DURATION, "method" => method))
            .clone(),
    };
    histogram.record(took.as_secs_f64());
}

/// Rejections answered from the local deny cache, without the store.
pub const DENY_CACHE_HITS: &str = "tollgate_deny_cache_hits_total";

/// Token slices taken from the store (`--token-slices`), by `result`
/// (`granted`, `refused`).
pub const SLICE_TAKES: &str = "tollgate_slice_takes_total";

/// Decisions on a sliced bucket refused without the store: its last answer
/// proves the cost cannot pass yet.
pub const SLICE_LOCAL_REFUSALS: &str = "tollgate_slice_local_refusals_total";

/// Reservations whose time to live passed unsettled (a sign of callers
/// that crash between reserve and settle).
pub const RESERVATIONS_EXPIRED: &str = "tollgate_reservations_expired_total";
/// Reservations recorded, by API.
pub const RESERVATIONS: &str = "tollgate_reservations_total";
/// Tokens charged by reservations' estimates, by API.
pub const RESERVED_TOKENS: &str = "tollgate_reserved_tokens_total";
/// Settles, by API and status.
pub const SETTLES: &str = "tollgate_settles_total";
/// Tokens given back by settles that used less than the estimate and by
/// refunds (Envoy's `is_negative_hits`), by API.
pub const REFUNDED_TOKENS: &str = "tollgate_refunded_tokens_total";
/// Refunds refused, by API and `reason`: `not_enabled` (the rule does not
/// take refunds), `over_capacity` (more than the bucket can hold) or
/// `no_since` (a window's refund that does not say when its tokens were
/// charged).
pub const REFUNDS_REFUSED: &str = "tollgate_refunds_refused_total";
/// Tokens charged after the work, by API and `phase`: `settle` (what a
/// settle charged beyond its estimate) or `charge` (usage reported after
/// the fact).
pub const CHARGED_TOKENS: &str = "tollgate_charged_tokens_total";
/// Tokens of after-the-fact charges not applied because a bucket was at its
/// debt floor, by API.
pub const FORGIVEN_TOKENS: &str = "tollgate_forgiven_tokens_total";

/// Quota service streams open on this instance (one per Envoy filter
/// configuration).
pub const RLQS_STREAMS: &str = "tollgate_rlqs_streams";
/// Quota buckets subscribed on this instance, every stream's together.
pub const RLQS_BUCKETS: &str = "tollgate_rlqs_buckets";
/// Quota assignments sent, by `strategy`: `token_bucket`, `allow_all`,
/// `deny_all`, or `abandon` (the bucket was dropped).
pub const RLQS_ASSIGNMENTS: &str = "tollgate_rlqs_assignments_total";
/// Quota streams and bucket reports refused, by `reason`: `streams`,
/// `streams_per_peer`, `buckets_per_stream`, `buckets_per_peer` (the stream was refused or
/// ended), `invalid_bucket_id`, `no_bucket_id` (the report was ignored).
pub const RLQS_REFUSED: &str = "tollgate_rlqs_refused_total";

fn describe_rlqs() {
    describe_gauge!(RLQS_STREAMS, "Quota service streams open on this instance.");
    describe_gauge!(RLQS_BUCKETS, "Quota buckets subscribed on this instance.");
    describe_counter!(
        RLQS_ASSIGNMENTS,
        "Quota assignments sent, by strategy (token_bucket, allow_all, deny_all, abandon)."
    );
    describe_counter!(
        RLQS_REFUSED,
        "Quota streams and bucket reports refused, by reason (streams, streams_per_peer, buckets_per_stream, buckets_per_peer, invalid_bucket_id, no_bucket_id)."
    );
}

/// Sets the quota streams open.
pub fn rlqs_streams(n: usize) {
    gauge!(RLQS_STREAMS).set(n as f64);
}

/// Sets the quota buckets subscribed.
pub fn rlqs_buckets(n: usize) {
    gauge!(RLQS_BUCKETS).set(n as f64);
}

/// Counts a quota assignment sent.
pub fn rlqs_assignment(strategy: &'static str) {
    counter!(RLQS_ASSIGNMENTS, "strategy" => strategy).increment(1);
}

/// Counts a quota stream or report refused.
pub fn rlqs_refused(reason: &'static str) {
    counter!(RLQS_REFUSED, "reason" => reason).increment(1);
}

fn describe_budgets() {
    describe_rlqs();
    describe_leases();
    describe_ledger();
    describe_counter!(RESERVATIONS, "Reservations recorded, by API.");
    describe_counter!(
        RESERVED_TOKENS,
        "Tokens charged as reservations' estimates, by API."
    );
    describe_counter!(
        SETTLES,
        "Settles, by API and status (settled, already_settled, expired, unknown, error)."
    );
    describe_counter!(
        REFUNDED_TOKENS,
        "Tokens given back by settles whose actual cost was below the estimate and by refunds, by API."
    );
    describe_counter!(
        REFUNDS_REFUSED,
        "Refunds refused, by API and reason (not_enabled, over_capacity, no_since)."
    );
    describe_counter!(
        CHARGED_TOKENS,
        "Tokens charged after the work, by API and phase: settle (beyond the estimate) or charge (reported after the fact)."
    );
    describe_counter!(
        FORGIVEN_TOKENS,
        "Tokens of after-the-fact charges not applied because a bucket was at its debt floor, by API."
    );
    describe_counter!(
        RESERVATIONS_EXPIRED,
        "Reservations whose time to live passed unsettled; their estimates stay charged."
    );
}

/// A counter of tokens: a caller chooses the amounts (up to 2^64 − 1 each),
/// so it saturates at 2^64 − 1 instead of wrapping (which Prometheus would
/// read as a counter reset, and `rate()` as a spike).
#[derive(Clone)]
struct TokenCounter {
    counter: metrics::Counter,
    total: std::sync::Arc<AtomicU64>,
}

impl TokenCounter {
    fn new(counter: metrics::Counter) -> Self {
        Self {
            counter,
            total: std::sync::Arc::default(),
        }
    }

    fn add(&self, tokens: u64) {
        if tokens == 0 {
            return;
        }
        let before = self
            .total
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                Some(t.saturating_add(tokens))
            })
            .unwrap_or_else(|t| t);
        // `absolute` keeps the largest value set, so racing adds never
        // move the series back.
        self.counter.absolute(before.saturating_add(tokens));
    }
}

/// Adds `tokens` to the series `name{api, phase}` (no `phase` label when
/// empty), saturating.
fn add_tokens(name: &'static str, api: &'static str, phase: &'static str, tokens: u64) {
    static SERIES: OnceLock<Handles<(&'static str, &'static str, &'static str), TokenCounter>> =
        OnceLock::new();
    if tokens == 0 {
        return;
    }
    let series = SERIES.get_or_init(Handles::default);
    let counter = series
        .entry((name, api, phase))
        .or_insert_with(|| {
            TokenCounter::new(if phase.is_empty() {
                counter!(name, "api" => api)
            } else {
                counter!(name, "api" => api, "phase" => phase)
            })
        })
        .clone();
    counter.add(tokens);
}

/// Counts a reservation of `tokens`.
pub fn reserved(api: &'static str, tokens: u64) {
    counter!(RESERVATIONS, "api" => api).increment(1);
    add_tokens(RESERVED_TOKENS, api, "", tokens);
}

/// Counts a settle by its status.
pub fn settle_outcome(api: &'static str, status: &'static str) {
    counter!(SETTLES, "api" => api, "status" => status).increment(1);
}

/// Counts what a settle gave back or charged beyond its estimate.
pub fn settled(api: &'static str, refunded: u64, charged: u64) {
    add_tokens(REFUNDED_TOKENS, api, "", refunded);
    add_tokens(CHARGED_TOKENS, api, "settle", charged);
}

/// Counts tokens given back by a refund.
pub fn refunded(api: &'static str, tokens: u64) {
    add_tokens(REFUNDED_TOKENS, api, "", tokens);
}

/// Counts a refused refund.
pub fn refund_refused(api: &'static str, reason: &'static str) {
    counter!(REFUNDS_REFUSED, "api" => api, "reason" => reason).increment(1);
}

/// Counts usage charged after the fact.
pub fn charged(api: &'static str, tokens: u64) {
    add_tokens(CHARGED_TOKENS, api, "charge", tokens);
}

/// Counts tokens forgiven at a debt floor.
pub fn forgiven(api: &'static str, tokens: u64) {
    add_tokens(FORGIVEN_TOKENS, api, "", tokens);
}

/// Counts reservations found expired unsettled.
pub fn reservations_expired(n: u64) {
    if n > 0 {
        counter!(RESERVATIONS_EXPIRED).increment(n);
    }
}

/// Leases granted, by concurrency rule.
pub const LEASES_ACQUIRED: &str = "tollgate_leases_acquired_total";
/// Leases refused, by the concurrency rule that was full.
pub const LEASES_REFUSED: &str = "tollgate_leases_refused_total";
/// Releases and renewals, by operation and status.
pub const LEASE_OPS: &str = "tollgate_lease_operations_total";
/// Leases whose time to live passed unreleased.
pub const LEASES_EXPIRED: &str = "tollgate_leases_expired_total";
/// Leases held through this instance, by concurrency rule.
pub const LEASES_HELD: &str = "tollgate_leases_held";

fn describe_leases() {
    describe_counter!(
        LEASES_ACQUIRED,
        "Leases granted, by concurrency rule (one per rule whose cap took a slot)."
    );
    describe_counter!(
        LEASES_REFUSED,
        "Acquires refused because a concurrency rule's cap was full, by rule (shadow rules count what they would have refused)."
    );
    describe_counter!(
        LEASE_OPS,
        "Lease releases and renewals, by op (release, renew) and status (released, renewed, already_released, expired, unknown, error)."
    );
    describe_counter!(
        LEASES_EXPIRED,
        "Leases whose time to live passed before they were released (their holders died or forgot); counted by the instance that granted or last renewed them."
    );
    metrics::describe_gauge!(
        LEASES_HELD,
        "Leases granted through this instance and held now (not released through it, time to live not passed), by concurrency rule; per instance: sum across instances."
    );
}

/// Counts a lease granted (or refused) by a concurrency rule.
pub fn lease_decided(rule: &str, granted: bool) {
    let name = if granted {
        LEASES_ACQUIRED
    } else {
        LEASES_REFUSED
    };
    counter!(name, "rule" => rule.to_owned()).increment(1);
}

/// Counts a release or renewal by its status.
pub fn lease_op(op: &'static str, status: &'static str) {
    counter!(LEASE_OPS, "op" => op, "status" => status).increment(1);
}

/// Counts leases found expired unreleased.
pub fn leases_expired(n: u64) {
    if n > 0 {
        counter!(LEASES_EXPIRED).increment(n);
    }
}

/// Sets the leases held through this instance under a rule.
pub fn leases_held(rule: &str, held: u64) {
    metrics::gauge!(LEASES_HELD, "rule" => rule.to_owned()).set(held as f64);
}

/// Counts a rejection answered from the deny cache.
pub fn deny_cache_hit() {
    static HANDLE: OnceLock<metrics::Counter> = OnceLock::new();
    HANDLE
        .get_or_init(|| counter!(DENY_CACHE_HITS))
        .increment(1);
}

/// Counts a slice taken from the store, or refused.
pub fn slice_taken(granted: bool) {
    static HANDLES: OnceLock<[metrics::Counter; 2]> = OnceLock::new();
    let [granted_, refused] = HANDLES.get_or_init(|| {
        [
            counter!(SLICE_TAKES, "result" => "granted"),
            counter!(SLICE_TAKES, "result" => "refused"),
        ]
    });
    if granted { granted_ } else { refused }.increment(1);
}

/// Counts a decision on a sliced bucket refused without the store.
pub fn slice_refused_locally() {
    static HANDLE: OnceLock<metrics::Counter> = OnceLock::new();
    HANDLE
        .get_or_init(|| counter!(SLICE_LOCAL_REFUSALS))
        .increment(1);
}

/// Open connections, by `port` (`grpc`, `admin`).
pub const CONNECTIONS_OPEN: &str = "tollgate_connections_open";
/// Connections closed at once because the port was at its cap, by `port`.
pub const CONNECTIONS_REFUSED: &str = "tollgate_connections_refused_total";
/// Connections closed after their idle timeout, by `port`.
pub const CONNECTIONS_IDLE_CLOSED: &str = "tollgate_connections_idle_closed_total";
/// Counter: connections closed to give their slot to a new one, by port.
pub const CONNECTIONS_EVICTED: &str = "tollgate_connections_evicted_total";
/// Counter: connections closed for not completing their handshake in time,
/// by port.
pub const CONNECTIONS_HANDSHAKE_TIMEOUTS: &str = "tollgate_connections_handshake_timeouts_total";
/// Failed `accept` calls (each followed by a backoff), by `port`.
pub const ACCEPT_ERRORS: &str = "tollgate_accept_errors_total";
/// gRPC requests refused with RESOURCE_EXHAUSTED because the instance had
/// `--grpc-max-requests-in-flight` requests in flight.
pub const GRPC_OVERLOADED: &str = "tollgate_grpc_overload_refusals_total";

fn describe_connections() {
    describe_gauge!(CONNECTIONS_OPEN, "Open connections, by port.");
    describe_counter!(
        CONNECTIONS_REFUSED,
        "Connections closed as soon as accepted because the port was at its connection cap, by port."
    );
    describe_counter!(
        CONNECTIONS_IDLE_CLOSED,
        "Connections closed after their idle timeout with no request in flight, by port."
    );
    describe_counter!(
        CONNECTIONS_EVICTED,
        "Connections with no request in flight closed to make room for a new one at the port's \
         connection cap (or its per-peer cap), by port."
    );
    describe_counter!(
        CONNECTIONS_HANDSHAKE_TIMEOUTS,
        "Connections closed because they sent no HTTP/2 preface (gRPC port) or no complete first \
         request (admin port) within the handshake deadline, by port."
    );
    describe_counter!(
        ACCEPT_ERRORS,
        "Failed accept calls (out of file descriptors, ...), each followed by a backoff, by port."
    );
    describe_gauge!(
        GRPC_IN_FLIGHT,
        "gRPC requests in service now, of at most --grpc-max-requests-in-flight (a stream counts until it ends)."
    );
    describe_counter!(
        GRPC_OVERLOADED,
        "gRPC requests refused with RESOURCE_EXHAUSTED at the in-flight cap (--grpc-max-requests-in-flight)."
    );
}

/// gRPC requests in service now (read when metrics are scraped).
pub const GRPC_IN_FLIGHT: &str = "tollgate_grpc_requests_in_flight";

/// Publishes the gRPC requests in flight.
pub fn grpc_in_flight(n: usize) {
    gauge!(GRPC_IN_FLIGHT).set(n as f64);
}

/// Sets the open-connection gauge of `port` (at start-up).
pub fn connections_open(port: &'static str, open: usize) {
    gauge!(CONNECTIONS_OPEN, "port" => port).set(open as f64);
}

/// Counts a connection opened on `port`.
pub fn connection_opened(port: &'static str) {
    gauge!(CONNECTIONS_OPEN, "port" => port).increment(1.0);
}

/// Counts a connection closed on `port`.
pub fn connection_closed(port: &'static str) {
    gauge!(CONNECTIONS_OPEN, "port" => port).decrement(1.0);
}

/// Counts a connection refused at `port`'s cap.
pub fn connection_refused(port: &'static str) {
    counter!(CONNECTIONS_REFUSED, "port" => port).increment(1);
}

/// Counts a connection closed for idleness on `port`.
pub fn connection_idle_closed(port: &'static str) {
    counter!(CONNECTIONS_IDLE_CLOSED, "port" => port).increment(1);
}

/// Counts a connection on `port` closed to give its slot to a new one.
pub fn connection_evicted(port: &'static str) {
    counter!(CONNECTIONS_EVICTED, "port" => port).increment(1);
}

/// Counts a connection on `port` closed for a handshake not done in time.
pub fn connection_handshake_timeout(port: &'static str) {
    counter!(CONNECTIONS_HANDSHAKE_TIMEOUTS, "port" => port).increment(1);
}

/// Counts a failed accept on `port`.
pub fn accept_error(port: &'static str) {
    counter!(ACCEPT_ERRORS, "port" => port).increment(1);
}

/// Counts a gRPC request refused at the in-flight cap.
pub fn grpc_overloaded() {
    counter!(GRPC_OVERLOADED).increment(1);
}

/// Quota periods the usage ledger recorded, by step: `opened`, `closed`
/// (a final count written), `lost` (closed without one).
pub const USAGE_PERIODS: &str = "tollgate_usage_periods_total";
/// Steps of the usage ledger that failed and are retried, by step.
pub const LEDGER_ERRORS: &str = "tollgate_ledger_errors_total";

fn describe_ledger() {
    describe_counter!(
        USAGE_PERIODS,
        "Quota periods the usage ledger wrote to the limits database, by step: opened, closed (final count written; once per period across instances), lost (closed without a final count: its counter was gone from the store)."
    );
    describe_counter!(
        QUOTA_ALERTS,
        "Quota alert thresholds, by threshold (percent) and result: detected (recorded in the outbox; once per counter, period and threshold across instances), delivered (the webhook answered 2xx), failed (an attempt that is retried with backoff)."
    );
    metrics::describe_gauge!(
        QUOTA_ALERTS_PENDING,
        "Quota alerts in the outbox not delivered yet (read from the limits database by each instance's notifier)."
    );
    describe_counter!(
        LEDGER_ERRORS,
        "Usage ledger steps that failed and will be retried, by step (journal, database)."
    );
}

/// Quota alerts, by threshold (percent) and result: `detected` (recorded
/// in the outbox, once per counter, period and threshold), `delivered`,
/// `failed` (a delivery attempt that will be retried).
pub const QUOTA_ALERTS: &str = "tollgate_quota_alerts_total";
/// Quota alerts in the outbox not delivered yet.
pub const QUOTA_ALERTS_PENDING: &str = "tollgate_quota_alerts_pending";

/// Counts a quota alert's step.
pub fn quota_alert(threshold: u16, result: &'static str) {
    counter!(QUOTA_ALERTS, "threshold" => threshold.to_string(), "result" => result).increment(1);
}

/// Sets the alerts waiting for delivery.
pub fn quota_alerts_pending(n: u64) {
    metrics::gauge!(QUOTA_ALERTS_PENDING).set(n as f64);
}

/// Counts periods the ledger wrote.
pub fn usage_periods(step: &'static str, n: u64) {
    if n > 0 {
        counter!(USAGE_PERIODS, "step" => step).increment(n);
    }
}

/// Counts a ledger step that failed.
pub fn ledger_error(step: &'static str) {
    counter!(LEDGER_ERRORS, "step" => step).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_counter_saturates_instead_of_wrapping() {
        let c = TokenCounter::new(metrics::Counter::noop());
        c.add(1000);
        c.add(u64::MAX);
        assert_eq!(c.total.load(Ordering::Acquire), u64::MAX);
        c.add(u64::MAX);
        c.add(1);
        assert_eq!(c.total.load(Ordering::Acquire), u64::MAX);
    }
}
