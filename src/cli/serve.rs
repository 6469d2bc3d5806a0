//! `tollgate serve`: its options, from flags, the environment and a config
//! file, filling one typed structure.
//!
//! [`ServeArgs`] is that structure: clap fills it from flags and the
//! environment, serde from the TOML file (same names, snake_case), every
//! field optional. [`ServeArgs::resolve`] layers them (flag, then
//! environment, then file) and fills what none of them set from the
//! defaults, which are written once: [`ServeConfig::default`] for the server
//! and [`Process::default`] for the process around it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use clap::builder::BoolishValueParser;
use serde::{Deserialize, Serialize};

use super::{parse_duration, parse_duration_or_zero, parse_fraction, parse_ratio};
use crate::api::admin::AdminAccess;
use crate::api::envoy::service::EnvoyOptions;
use crate::api::native::Unmatched;
use crate::server::{GrpcLimits, ServeConfig, StoreSpec, TlsFiles};
use crate::telemetry::LogFormat;

/// Most `--worker-threads`.
pub const MAX_WORKER_THREADS: u16 = 1024;

/// `tollgate serve`. Every option is optional here; see the module docs for
/// how the sources are layered.
#[derive(Debug, Clone, Default, Args, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeArgs {
    /// A TOML file with any of these options (same names, snake_case, e.g.
    /// `grpc_addr = "0.0.0.0:50051"`). Flags win over the environment,
    /// which wins over the file, which wins over the defaults.
    #[arg(long, env = "TOLLGATE_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// gRPC listen address (port 0 picks a free port).
    #[arg(long, env = "TOLLGATE_GRPC_ADDR")]
    pub grpc_addr: Option<SocketAddr>,
    /// Admin HTTP listen address: /healthz, /readyz, /metrics, /v1/limits.
    #[arg(long, env = "TOLLGATE_ADMIN_ADDR")]
    pub admin_addr: Option<SocketAddr>,
    /// The limits table: a SQLite file path or `sqlite:` URL, or a
    /// `postgres://` URL (created and seeded when missing).
    #[arg(long, env = "TOLLGATE_LIMITS")]
    pub limits: Option<String>,
    /// Where bucket state lives: `memory` (in this process),
    /// `redis://[user:password@]host:port[/db]`, `rediss://…` (TLS),
    /// `redis-cluster://[user:password@]host:port,host:port,…`, or
    /// `redis-sentinel://[user:password@]host:port,…/SERVICE[/db]` (also
    /// `rediss-cluster://`, `rediss-sentinel://`).
    #[arg(long, env = "TOLLGATE_STORE", hide_env_values = true)]
    pub store: Option<String>,
    /// PEM file of the CA that signed the Redis server's certificate (for
    /// rediss:// with a private CA).
    #[arg(long, env = "TOLLGATE_REDIS_CA_CERT")]
    pub redis_ca_cert: Option<PathBuf>,
    /// Prefix of every Redis key.
    #[arg(long, env = "TOLLGATE_REDIS_PREFIX")]
    pub redis_prefix: Option<String>,
    /// Most concurrent decisions sent to Redis in one script call (they
    /// are decided one after another, in arrival order, at one instant).
    /// 0 or 1 sends every decision in its own call.
    #[arg(long, env = "TOLLGATE_REDIS_COALESCE")]
    pub redis_coalesce: Option<usize>,
    /// Spread each tenant's per-key buckets over the Redis Cluster's slots
    /// (a hash tag per key) instead of one slot per tenant; use with
    /// --token-slices when rules have tenant-wide buckets.
    #[arg(long, env = "TOLLGATE_REDIS_SPREAD_KEYS", num_args = 0..=1, default_missing_value = "true", value_parser = BoolishValueParser::new())]
    pub redis_spread_keys: Option<bool>,
    /// Answer tenant-wide buckets from slices of tokens taken ahead from
    /// the store (exact; may refuse early by what other instances hold).
    #[arg(long, env = "TOLLGATE_TOKEN_SLICES", num_args = 0..=1, default_missing_value = "true", value_parser = BoolishValueParser::new())]
    pub token_slices: Option<bool>,
    /// Longest wait for one store call before the rule's store-unavailable
    /// policy decides instead.
    #[arg(long, env = "TOLLGATE_STORE_TIMEOUT", value_parser = parse_duration)]
    #[serde(default, with = "text_duration")]
    pub store_timeout: Option<Duration>,
    /// Consecutive failed calls to one Redis node that open its circuit
    /// breaker.
    #[arg(long, env = "TOLLGATE_BREAKER_THRESHOLD")]
    pub breaker_threshold: Option<u32>,
    /// How long the open breaker skips the store before probing it again.
    #[arg(long, env = "TOLLGATE_BREAKER_COOLDOWN", value_parser = parse_duration)]
    #[serde(default, with = "text_duration")]
    pub breaker_cooldown: Option<Duration>,
    /// While the store is down, the share of each limit that a rule with
    /// on_store_unavailable=local allows in this instance (e.g. 0.34 with
    /// three instances).
    #[arg(long, env = "TOLLGATE_LOCAL_FRACTION", value_parser = parse_fraction)]
    pub local_fraction: Option<f64>,
    /// Threads that run the service; 0 starts one per CPU this process may
    /// use. Fewer leave cores to neighbours (a sidecar, a local Redis).
    #[arg(
        long,
        env = "TOLLGATE_WORKER_THREADS",
        value_parser = clap::value_parser!(u16).range(0..=i64::from(MAX_WORKER_THREADS))
    )]
    pub worker_threads: Option<u16>,
    /// Keep tokio's LIFO slot (off by default): calls made one at a time
    /// are answered sooner (~30 µs in memory, ~40 µs on Redis), but under
    /// load each response costs a write of its own, about a third more CPU
    /// per decision.
    #[arg(long, env = "TOLLGATE_RUNTIME_LIFO_SLOT", num_args = 0..=1, default_missing_value = "true", value_parser = BoolishValueParser::new())]
    pub runtime_lifo_slot: Option<bool>,
    /// How often the limits table's version is read on SQLite (PostgreSQL
    /// notifies) and the Envoy configuration re-read (e.g. 1s, 500ms).
    #[arg(long, env = "TOLLGATE_RELOAD_INTERVAL", value_parser = parse_duration)]
    #[serde(default, with = "text_duration")]
    pub reload_interval: Option<Duration>,
    /// Most limits rows (rules) and plan assignments held in memory (about
    /// 170 and 80 bytes each); a larger table is a start-up error, and rows
    /// or assignments beyond it added later are rejected (listed at
    /// /v1/limits).
    #[arg(long, env = "TOLLGATE_MAX_LIMIT_ROWS")]
    pub max_limit_rows: Option<usize>,
    /// Most buckets held in memory. At the cap full buckets are dropped;
    /// if none is full, decisions needing new buckets get their rule's
    /// store-unavailable answer (a bucket still refilling is never dropped).
    #[arg(long, env = "TOLLGATE_MAX_BUCKETS")]
    pub max_buckets: Option<usize>,
    /// Most bytes of buckets held in memory, each counted as 160 bytes plus
    /// its key; at the cap, as at --max-buckets.
    #[arg(long, env = "TOLLGATE_MAX_BUCKET_BYTES")]
    pub max_bucket_bytes: Option<usize>,
    /// Most reservation and lease records held in memory, counted apart
    /// from buckets; one tenant may hold at most its fair share of them
    /// (this cap over one more than the tenants holding records).
    #[arg(long, env = "TOLLGATE_MAX_RECORDS")]
    pub max_records: Option<usize>,
    /// Most reservation and lease records one tenant may hold, in memory
    /// and on Redis (open ones, and settled or expired ones for ten minutes
    /// after their ttl); beyond it reserves and acquires answer
    /// RESOURCE_EXHAUSTED. Unset: no cap of its own (memory still holds each
    /// tenant to its fair share of --max-records).
    #[arg(long, env = "TOLLGATE_MAX_RECORDS_PER_TENANT")]
    pub max_records_per_tenant: Option<usize>,
    /// What to do with requests no rule applies to.
    #[arg(long, env = "TOLLGATE_UNMATCHED", value_enum)]
    pub unmatched: Option<Unmatched>,
    /// Log format.
    #[arg(long, env = "TOLLGATE_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
    /// Answer requests for buckets the store recently rejected from a local
    /// cache until their retry-after, without asking Redis (can reject more,
    /// never admit more; see BENCHMARKS.md).
    #[arg(long, env = "TOLLGATE_DENY_CACHE", num_args = 0..=1, default_missing_value = "true", value_parser = BoolishValueParser::new())]
    pub deny_cache: Option<bool>,
    /// Share of decisions traced when the caller's trace is not sampled
    /// (traces are exported only when OTEL_EXPORTER_OTLP_ENDPOINT is set).
    #[arg(long, env = "TOLLGATE_TRACE_SAMPLE_RATIO", value_parser = parse_ratio)]
    pub trace_sample_ratio: Option<f64>,
    /// TLS on the gRPC port: the server's certificate chain (PEM); needs
    /// --tls-key.
    #[arg(long, env = "TOLLGATE_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// TLS on the gRPC port: the server's private key (PEM); needs
    /// --tls-cert.
    #[arg(long, env = "TOLLGATE_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Mutual TLS: accept only clients with a certificate from this CA (PEM).
    #[arg(long, env = "TOLLGATE_TLS_CLIENT_CA")]
    pub tls_client_ca: Option<PathBuf>,
    /// Bearer token for the admin port's changing endpoints (POST/DELETE
    /// /v1/limits); without it they are disabled.
    #[arg(long, env = "TOLLGATE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Require the admin token for the read-only admin endpoints too
    /// (/healthz and /readyz stay open for probes).
    #[arg(long, env = "TOLLGATE_ADMIN_PROTECT_READS", num_args = 0..=1, default_missing_value = "true", value_parser = BoolishValueParser::new())]
    pub admin_protect_reads: Option<bool>,
    /// Serve the admin port without a token on a non-loopback address: only
    /// trusted hosts can reach it (refused otherwise, so that a missing or
    /// empty Secret never opens the limits table to a cluster network).
    #[arg(long, env = "TOLLGATE_ADMIN_TRUST_NETWORK", num_args = 0..=1, default_missing_value = "true", value_parser = BoolishValueParser::new())]
    pub admin_trust_network: Option<bool>,
    /// Largest gRPC request message, in bytes.
    #[arg(long, env = "TOLLGATE_GRPC_MAX_MESSAGE_BYTES")]
    pub grpc_max_message_bytes: Option<usize>,
    /// Concurrent HTTP/2 streams per gRPC connection.
    #[arg(long, env = "TOLLGATE_GRPC_MAX_CONCURRENT_STREAMS")]
    pub grpc_max_concurrent_streams: Option<u32>,
    /// Requests served at once per connection (more wait their turn).
    #[arg(long, env = "TOLLGATE_GRPC_CONNECTION_CONCURRENCY")]
    pub grpc_connection_concurrency: Option<usize>,
    /// Longest a gRPC request may take before it is cancelled.
    #[arg(long, env = "TOLLGATE_GRPC_REQUEST_TIMEOUT", value_parser = parse_duration)]
    #[serde(default, with = "text_duration")]
    pub grpc_request_timeout: Option<Duration>,
    /// Open gRPC connections at most; one more is closed as soon as it is
    /// accepted (and counted in tollgate_connections_refused_total).
    #[arg(long, env = "TOLLGATE_GRPC_MAX_CONNECTIONS")]
    pub grpc_max_connections: Option<usize>,
    /// gRPC requests in service at once across all connections; past it a
    /// request gets RESOURCE_EXHAUSTED at once. Bounds the memory requests
    /// can hold (with --grpc-max-message-bytes).
    #[arg(long, env = "TOLLGATE_GRPC_MAX_REQUESTS_IN_FLIGHT")]
    pub grpc_max_requests_in_flight: Option<usize>,
    /// Largest header block of one gRPC request, in bytes.
    #[arg(long, env = "TOLLGATE_GRPC_MAX_HEADER_BYTES")]
    pub grpc_max_header_bytes: Option<u32>,
    /// Request bytes one gRPC connection may have sent and the server not
    /// yet read (its HTTP/2 flow-control window).
    #[arg(long, env = "TOLLGATE_GRPC_CONNECTION_WINDOW_BYTES")]
    pub grpc_connection_window_bytes: Option<u32>,
    /// How often an HTTP/2 PING checks a quiet gRPC peer (0s: never; TCP
    /// keepalive probes after 60 s of quiet instead, at no cost per request).
    #[arg(long, env = "TOLLGATE_GRPC_KEEPALIVE_INTERVAL", value_parser = parse_duration_or_zero)]
    #[serde(default, with = "text_duration_or_zero")]
    pub grpc_keepalive_interval: Option<Duration>,
    /// How long the PING's answer may take before the connection is closed.
    #[arg(long, env = "TOLLGATE_GRPC_KEEPALIVE_TIMEOUT", value_parser = parse_duration)]
    #[serde(default, with = "text_duration")]
    pub grpc_keepalive_timeout: Option<Duration>,
    /// Close a connection (either port) with no request in flight for a
    /// whole period of this length, so one to two periods after its last
    /// request (0s: never).
    #[arg(long, env = "TOLLGATE_IDLE_TIMEOUT", value_parser = parse_duration_or_zero)]
    #[serde(default, with = "text_duration_or_zero")]
    pub idle_timeout: Option<Duration>,
    /// At shutdown, how long open connections and calls in flight may take
    /// before what remains is closed (an idle connection never delays the
    /// exit longer than this).
    #[arg(long, env = "TOLLGATE_SHUTDOWN_GRACE", value_parser = parse_duration)]
    #[serde(default, with = "text_duration")]
    pub shutdown_grace: Option<Duration>,
    /// A directory of envoyproxy/ratelimit YAML files (every *.yaml in it)
    /// for Envoy's rate limit service API; re-read every reload interval.
    #[arg(long, env = "TOLLGATE_ENVOY_CONFIG")]
    pub envoy_config: Option<PathBuf>,
    /// Envoy API global shadow mode: count, but never answer OVER_LIMIT.
    #[arg(long, env = "TOLLGATE_ENVOY_SHADOW_MODE", num_args = 0..=1, default_missing_value = "true", value_parser = BoolishValueParser::new())]
    pub envoy_shadow_mode: Option<bool>,
    /// Add RateLimit-* and Retry-After to Envoy's response_headers_to_add.
    #[arg(long, env = "TOLLGATE_ENVOY_RESPONSE_HEADERS", num_args = 0..=1, default_missing_value = "true", value_parser = BoolishValueParser::new())]
    pub envoy_response_headers: Option<bool>,
}

/// What `serve` runs with besides the server's own configuration: the
/// process around it.
#[derive(Debug, Clone, PartialEq)]
pub struct Process {
    /// gRPC listen address.
    pub grpc_addr: SocketAddr,
    /// Admin HTTP listen address.
    pub admin_addr: SocketAddr,
    /// Log format.
    pub log_format: LogFormat,
    /// Runtime threads; 0: one per CPU.
    pub worker_threads: u16,
    /// Keep tokio's LIFO slot.
    pub runtime_lifo_slot: bool,
    /// Share of unsampled callers' decisions traced.
    pub trace_sample_ratio: f64,
}

impl Default for Process {
    fn default() -> Self {
        Self {
            grpc_addr: SocketAddr::from(([127, 0, 0, 1], 50051)),
            admin_addr: SocketAddr::from(([127, 0, 0, 1], 8090)),
            log_format: LogFormat::Text,
            worker_threads: 0,
            runtime_lifo_slot: false,
            trace_sample_ratio: 0.01,
        }
    }
}

/// Everything `serve` runs with, resolved.
#[derive(Debug, Clone)]
pub struct Serve {
    /// The process around the server.
    pub process: Process,
    /// The server.
    pub config: ServeConfig,
}

impl ServeArgs {
    /// Reads the config file named by `--config`, if any, and layers it
    /// under these options (flags and environment win), then fills the
    /// rest from the defaults and validates.
    pub fn resolve(&self) -> Result<Serve, String> {
        let merged = match &self.config {
            None => self.clone(),
            Some(path) => {
                let file = Self::from_file(path)?;
                self.over(&file)
                    .map_err(|e| format!("config file {}: {e}", path.display()))?
            }
        };
        merged.build()
    }

    /// The options a TOML file sets. Unknown names are refused, listing the
    /// known ones.
    pub fn from_file(path: &std::path::Path) -> Result<Self, String> {
        let at = |e: &dyn std::fmt::Display| format!("config file {}: {e}", path.display());
        let text = std::fs::read_to_string(path).map_err(|e| at(&e))?;
        Self::from_toml(&text).map_err(|e| at(&e))
    }

    /// The options a TOML text sets (see [`ServeArgs::from_file`]), checked
    /// like flags by [`ServeArgs::check`].
    pub fn from_toml(text: &str) -> Result<Self, String> {
        let table: toml::Table = text.parse().map_err(|e: toml::de::Error| e.to_string())?;
        let known = Self::names();
        if let Some(key) = table.keys().find(|k| !known.contains(k)) {
            return Err(format!(
                "unknown option {key:?}; known options: {}",
                known.join(", ")
            ));
        }
        table.try_into().map_err(|e: toml::de::Error| e.to_string())
    }

    /// The settings these options resolve to, without reading a file they
    /// name: the checks a config file's values go through.
    pub fn check(&self) -> Result<Serve, String> {
        self.build()
    }

    /// The option names a config file may use, sorted.
    pub fn names() -> Vec<String> {
        let mut names: Vec<String> = match serde_json::to_value(Self::default()) {
            Ok(serde_json::Value::Object(map)) => map.keys().cloned().collect(),
            _ => Vec::new(),
        };
        names.sort_unstable();
        names
    }

    /// These options, with `under`'s filling what these leave unset.
    fn over(&self, under: &Self) -> Result<Self, String> {
        let (serde_json::Value::Object(mut top), serde_json::Value::Object(bottom)) = (
            serde_json::to_value(self).map_err(|e| e.to_string())?,
            serde_json::to_value(under).map_err(|e| e.to_string())?,
        ) else {
            return Err("options are not a map".into());
        };
        for (key, value) in bottom {
            let slot = top.entry(key).or_insert(serde_json::Value::Null);
            if slot.is_null() {
                *slot = value;
            }
        }
        let mut merged: Self =
            serde_json::from_value(serde_json::Value::Object(top)).map_err(|e| e.to_string())?;
        merged.config = self.config.clone();
        Ok(merged)
    }

    /// The resolved settings: each option as given, else its default.
    fn build(&self) -> Result<Serve, String> {
        let d = ServeConfig::default();
        let p = Process::default();
        // Values from a file skip clap's parsers: check them here too.
        let local_fraction = match self.local_fraction {
            Some(f) => parse_fraction(&f.to_string()).map_err(|e| format!("local_fraction {e}"))?,
            None => d.local_fraction,
        };
        let trace_sample_ratio = match self.trace_sample_ratio {
            Some(r) => {
                parse_ratio(&r.to_string()).map_err(|e| format!("trace_sample_ratio {e}"))?
            }
            None => p.trace_sample_ratio,
        };
        let worker_threads = self.worker_threads.unwrap_or(p.worker_threads);
        if worker_threads > MAX_WORKER_THREADS {
            return Err(format!(
                "worker_threads {worker_threads} is not in 0..={MAX_WORKER_THREADS}"
            ));
        }
        let tls = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some(TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: self.tls_client_ca.clone(),
            }),
            (None, None) if self.tls_client_ca.is_none() => None,
            (None, None) => return Err("--tls-client-ca needs --tls-cert and --tls-key".into()),
            _ => return Err("--tls-cert and --tls-key go together; give both".into()),
        };
        let protect_reads = self
            .admin_protect_reads
            .unwrap_or(d.admin_access.protect_reads);
        if protect_reads && self.admin_token.is_none() {
            return Err("--admin-protect-reads needs --admin-token".into());
        }
        let or = |v: Option<Duration>, d: Duration| v.unwrap_or(d);
        let config = ServeConfig {
            limits: self.limits.clone().unwrap_or(d.limits),
            // Parsed here rather than by clap so that a password in the URL
            // never reaches an error message.
            store: match &self.store {
                Some(s) => s.parse::<StoreSpec>()?,
                None => d.store,
            },
            reload_interval: or(self.reload_interval, d.reload_interval),
            max_limit_rows: self.max_limit_rows.unwrap_or(d.max_limit_rows),
            sweep_interval: d.sweep_interval,
            max_buckets: self.max_buckets.unwrap_or(d.max_buckets),
            max_bucket_bytes: self.max_bucket_bytes.unwrap_or(d.max_bucket_bytes),
            max_records: self.max_records.unwrap_or(d.max_records),
            max_records_per_tenant: self.max_records_per_tenant.or(d.max_records_per_tenant),
            unmatched: self.unmatched.unwrap_or(d.unmatched),
            redis_prefix: self.redis_prefix.clone().unwrap_or(d.redis_prefix),
            redis_coalesce: self.redis_coalesce.unwrap_or(d.redis_coalesce),
            redis_spread_keys: self.redis_spread_keys.unwrap_or(d.redis_spread_keys),
            token_slices: self.token_slices.unwrap_or(d.token_slices),
            store_timeout: or(self.store_timeout, d.store_timeout),
            breaker_threshold: self.breaker_threshold.unwrap_or(d.breaker_threshold),
            breaker_cooldown: or(self.breaker_cooldown, d.breaker_cooldown),
            local_fraction,
            redis_ca_cert: self.redis_ca_cert.clone().or(d.redis_ca_cert),
            envoy_config: self.envoy_config.clone().or(d.envoy_config),
            envoy_options: EnvoyOptions {
                shadow_mode: self
                    .envoy_shadow_mode
                    .unwrap_or(d.envoy_options.shadow_mode),
                response_headers: self
                    .envoy_response_headers
                    .unwrap_or(d.envoy_options.response_headers),
            },
            admin_access: AdminAccess {
                token: self.admin_token.clone().or(d.admin_access.token),
                protect_reads,
                trust_network: self
                    .admin_trust_network
                    .unwrap_or(d.admin_access.trust_network),
            },
            tls,
            grpc_limits: GrpcLimits {
                max_message_bytes: self
                    .grpc_max_message_bytes
                    .unwrap_or(d.grpc_limits.max_message_bytes),
                max_concurrent_streams: self
                    .grpc_max_concurrent_streams
                    .unwrap_or(d.grpc_limits.max_concurrent_streams),
                connection_concurrency: self
                    .grpc_connection_concurrency
                    .unwrap_or(d.grpc_limits.connection_concurrency),
                request_timeout: or(self.grpc_request_timeout, d.grpc_limits.request_timeout),
                max_connections: self
                    .grpc_max_connections
                    .unwrap_or(d.grpc_limits.max_connections),
                max_requests_in_flight: self
                    .grpc_max_requests_in_flight
                    .unwrap_or(d.grpc_limits.max_requests_in_flight),
                max_header_bytes: self
                    .grpc_max_header_bytes
                    .unwrap_or(d.grpc_limits.max_header_bytes),
                connection_window_bytes: self
                    .grpc_connection_window_bytes
                    .unwrap_or(d.grpc_limits.connection_window_bytes),
                keepalive_interval: or(
                    self.grpc_keepalive_interval,
                    d.grpc_limits.keepalive_interval,
                ),
                keepalive_timeout: or(self.grpc_keepalive_timeout, d.grpc_limits.keepalive_timeout),
                idle_timeout: or(self.idle_timeout, d.grpc_limits.idle_timeout),
            },
            deny_cache: self.deny_cache.unwrap_or(d.deny_cache),
            redis_uses_clock: d.redis_uses_clock,
            shutdown_grace: or(self.shutdown_grace, d.shutdown_grace),
        };
        config.grpc_limits.validate()?;
        if config.redis_spread_keys && !config.token_slices {
            // A per-key bucket and a tenant-wide one would then be on two
            // slots, and every decision with a ceiling would be refused.
            return Err(
                "--redis-spread-keys needs --token-slices: a tenant's ceiling and its \
                        keys' buckets are then on different slots, and only slices can decide \
                        them together"
                    .into(),
            );
        }
        Ok(Serve {
            process: Process {
                grpc_addr: self.grpc_addr.unwrap_or(p.grpc_addr),
                admin_addr: self.admin_addr.unwrap_or(p.admin_addr),
                log_format: self.log_format.unwrap_or(p.log_format),
                worker_threads,
                runtime_lifo_slot: self.runtime_lifo_slot.unwrap_or(p.runtime_lifo_slot),
                trace_sample_ratio,
            },
            config,
        })
    }

    /// The defaults as options, for `--help` (the inverse of `build`
    /// applied to nothing).
    pub fn defaults() -> Self {
        let (d, p) = (ServeConfig::default(), Process::default());
        Self {
            config: None,
            grpc_addr: Some(p.grpc_addr),
            admin_addr: Some(p.admin_addr),
            limits: Some(d.limits),
            store: Some(d.store.describe()),
            redis_ca_cert: d.redis_ca_cert,
            redis_prefix: Some(d.redis_prefix),
            redis_coalesce: Some(d.redis_coalesce),
            redis_spread_keys: Some(d.redis_spread_keys),
            token_slices: Some(d.token_slices),
            store_timeout: Some(d.store_timeout),
            breaker_threshold: Some(d.breaker_threshold),
            breaker_cooldown: Some(d.breaker_cooldown),
            local_fraction: Some(d.local_fraction),
            worker_threads: Some(p.worker_threads),
            runtime_lifo_slot: Some(p.runtime_lifo_slot),
            reload_interval: Some(d.reload_interval),
            max_limit_rows: Some(d.max_limit_rows),
            max_buckets: Some(d.max_buckets),
            max_bucket_bytes: Some(d.max_bucket_bytes),
            max_records: Some(d.max_records),
            max_records_per_tenant: d.max_records_per_tenant,
            unmatched: Some(d.unmatched),
            log_format: Some(p.log_format),
            deny_cache: Some(d.deny_cache),
            trace_sample_ratio: Some(p.trace_sample_ratio),
            tls_cert: None,
            tls_key: None,
            tls_client_ca: None,
            admin_token: None,
            admin_protect_reads: Some(d.admin_access.protect_reads),
            admin_trust_network: Some(d.admin_access.trust_network),
            grpc_max_message_bytes: Some(d.grpc_limits.max_message_bytes),
            grpc_max_concurrent_streams: Some(d.grpc_limits.max_concurrent_streams),
            grpc_connection_concurrency: Some(d.grpc_limits.connection_concurrency),
            grpc_request_timeout: Some(d.grpc_limits.request_timeout),
            grpc_max_connections: Some(d.grpc_limits.max_connections),
            grpc_max_requests_in_flight: Some(d.grpc_limits.max_requests_in_flight),
            grpc_max_header_bytes: Some(d.grpc_limits.max_header_bytes),
            grpc_connection_window_bytes: Some(d.grpc_limits.connection_window_bytes),
            grpc_keepalive_interval: Some(d.grpc_limits.keepalive_interval),
            grpc_keepalive_timeout: Some(d.grpc_limits.keepalive_timeout),
            idle_timeout: Some(d.grpc_limits.idle_timeout),
            shutdown_grace: Some(d.shutdown_grace),
            envoy_config: d.envoy_config,
            envoy_shadow_mode: Some(d.envoy_options.shadow_mode),
            envoy_response_headers: Some(d.envoy_options.response_headers),
        }
    }
}

/// An optional duration as text (`100ms`, `1s`, `2m`), as the flags take it.
mod text_duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            None => s.serialize_none(),
            Some(d) if d.subsec_millis() == 0 && d.subsec_nanos() == 0 => {
                s.serialize_str(&format!("{}s", d.as_secs()))
            }
            Some(d) => s.serialize_str(&format!("{}ms", d.as_millis())),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        match Option::<String>::deserialize(d)? {
            None => Ok(None),
            Some(text) => super::parse_duration(&text)
                .map(Some)
                .map_err(serde::de::Error::custom),
        }
    }
}

/// As [`text_duration`], where `0s` means "never".
mod text_duration_or_zero {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer};

    pub use super::text_duration::serialize;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        match Option::<String>::deserialize(d)? {
            None => Ok(None),
            Some(text) => super::parse_duration_or_zero(&text)
                .map(Some)
                .map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_given_is_the_defaults_and_the_defaults_round_trip() {
        let resolved = ServeArgs::default().resolve().unwrap();
        assert_eq!(resolved.process, Process::default());
        let d = ServeConfig::default();
        assert_eq!(resolved.config.store_timeout, d.store_timeout);
        assert_eq!(resolved.config.grpc_limits, d.grpc_limits);
        // The defaults written as options resolve to the same settings.
        let again = ServeArgs::defaults().resolve().unwrap();
        assert_eq!(again.process, resolved.process);
        assert_eq!(
            format!("{:?}", again.config),
            format!("{:?}", resolved.config)
        );
    }

    #[test]
    fn a_file_fills_only_what_flags_left_unset_and_is_checked_like_flags() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.toml");
        std::fs::write(
            &path,
            "max_buckets = 5000\nreload_interval = \"250ms\"\nstore_timeout = \"2s\"\ndeny_cache = true\n",
        )
        .unwrap();
        let flags = ServeArgs {
            config: Some(path.clone()),
            store_timeout: Some(Duration::from_millis(50)),
            ..ServeArgs::default()
        };
        let s = flags.resolve().unwrap();
        assert_eq!(s.config.max_buckets, 5000);
        assert_eq!(s.config.reload_interval, Duration::from_millis(250));
        assert_eq!(
            s.config.store_timeout,
            Duration::from_millis(50),
            "the flag wins"
        );
        assert!(s.config.deny_cache);

        std::fs::write(&path, "local_fraction = 1.5\n").unwrap();
        assert_eq!(
            flags.resolve().unwrap_err(),
            "local_fraction \"1.5\" must be a number greater than 0 and at most 1"
        );
        std::fs::write(&path, "worker_threads = 5000\n").unwrap();
        assert_eq!(
            flags.resolve().unwrap_err(),
            "worker_threads 5000 is not in 0..=1024"
        );
        std::fs::write(&path, "reload_interval = \"soon\"\n").unwrap();
        let err = flags.resolve().unwrap_err();
        assert!(
            err.contains("\"soon\" must look like 500ms, 1s, 2m or 1h"),
            "{err}"
        );
        std::fs::write(&path, "tls_cert = \"a.pem\"\n").unwrap();
        assert_eq!(
            flags.resolve().unwrap_err(),
            "--tls-cert and --tls-key go together; give both"
        );
        std::fs::write(&path, "redis_spread_keys = true\n").unwrap();
        let err = flags.resolve().unwrap_err();
        assert!(
            err.starts_with("--redis-spread-keys needs --token-slices"),
            "{err}"
        );
        std::fs::write(&path, "redis_spread_keys = true\ntoken_slices = true\n").unwrap();
        let s = flags.resolve().unwrap();
        assert!(s.config.redis_spread_keys && s.config.token_slices);
    }
}
