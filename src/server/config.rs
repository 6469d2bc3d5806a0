//! What `tollgate serve` runs with. Each option is declared once, here or in
//! the group it configures: a field with its flag, environment variable,
//! default and help. clap reads flags and the environment into these
//! structures, a `--config` file goes through the same parsers (see
//! `cli::serve`), and each group's `Default` is what an empty command line
//! gives ([`crate::options::defaults`]). The table in
//! `docs/configuration.md` is generated from these declarations
//! ([`crate::cli::serve::options_table`]) and a test keeps it in step.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use clap::builder::{BoolishValueParser, TypedValueParser};
use clap::{ArgAction, Args};

use crate::api::admin::AdminAccess;
use crate::api::envoy::service::EnvoyOptions;
use crate::api::envoy::xds::XdsOptions;
use crate::engine::backend::BackendOptions;
use crate::engine::{HeaderStyle, Unmatched};
use crate::engine::{RedisConfig, breaker, redact, redis};
use crate::ledger::LedgerOptions;
use crate::options::{defaults, parse_duration, parse_duration_or_zero, parse_fraction, text};

/// Largest accepted gRPC message: a full batch of maximal items fits.
pub const MAX_MESSAGE_BYTES: usize = 1024 * 1024;

/// Where bucket state lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreSpec {
    /// In this process.
    Memory,
    /// In Redis, a Redis Cluster or a Sentinel-managed Redis, at this URL.
    Redis(String),
}

impl FromStr for StoreSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "memory" {
            return Ok(Self::Memory);
        }
        let config = RedisConfig::new(s);
        config.validate().map_err(|e| {
            format!("{e}\n(--store takes `memory`, redis://, rediss://, redis-cluster://, rediss-cluster://, redis-sentinel:// or rediss-sentinel://)")
        })?;
        Ok(Self::Redis(s.to_owned()))
    }
}

impl StoreSpec {
    /// For logs: the kind, or the URL with its password hidden.
    pub fn describe(&self) -> String {
        match self {
            Self::Memory => "memory".into(),
            Self::Redis(url) => redact(url),
        }
    }
}

/// Parses `--store` without ever echoing the value: a URL may carry a
/// password, and clap's own message would print it.
#[derive(Clone)]
struct StoreParser;

impl TypedValueParser for StoreParser {
    type Value = StoreSpec;

    fn parse_ref(
        &self,
        _: &clap::Command,
        _: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<StoreSpec, clap::Error> {
        let refuse = |why: String| {
            clap::Error::raw(
                clap::error::ErrorKind::ValueValidation,
                format!("--store: {why}\n"),
            )
        };
        let text = value
            .to_str()
            .ok_or_else(|| refuse("not valid UTF-8".into()))?;
        text.parse().map_err(refuse)
    }
}

/// Everything `serve` needs besides listeners and a clock.
#[derive(Debug, Clone, Args)]
pub struct ServeConfig {
    /// The limits table: a SQLite file path or `sqlite:` URL, or a
    /// `postgres://` URL (created and seeded when missing).
    #[arg(long, env = "TOLLGATE_LIMITS", default_value = crate::limits::table::DEFAULT_LOCATION)]
    pub limits: String,
    /// Where bucket state lives: `memory` (in this process),
    /// `redis://[user:password@]host:port[/db]`, `rediss://…` (TLS),
    /// `redis-cluster://[user:password@]host:port,host:port,…`, or
    /// `redis-sentinel://[user:password@]host:port,…/SERVICE[/db]` (also
    /// `rediss-cluster://`, `rediss-sentinel://`). Passwords are never
    /// printed.
    #[arg(long, env = "TOLLGATE_STORE", hide_env_values = true, default_value = "memory", value_parser = StoreParser)]
    pub store: StoreSpec,
    /// How often the limits table's version is read on SQLite (PostgreSQL
    /// notifies) and the Envoy configuration re-read (e.g. 1s, 500ms).
    #[arg(long, env = "TOLLGATE_RELOAD_INTERVAL", value_parser = parse_duration, default_value = "500ms")]
    pub reload_interval: Duration,
    /// Most limits rows (rules) and plan assignments held in memory (about
    /// 170 and 80 bytes each); a larger table is a start-up error, and rows
    /// or assignments beyond it added later are rejected (listed at
    /// /v1/limits).
    #[arg(long, env = "TOLLGATE_MAX_LIMIT_ROWS", default_value_t = 2_000_000)]
    pub max_limit_rows: usize,
    /// How long after a quota period's end its final count is read from
    /// its counter and recorded in `usage_periods` (decisions of instances
    /// whose clocks run behind may still count in it until then).
    #[arg(long, env = "TOLLGATE_USAGE_GRACE", value_parser = parse_duration, default_value = "15s")]
    pub usage_grace: Duration,
    /// How often quota periods past their end and grace are closed.
    #[arg(long, env = "TOLLGATE_USAGE_CLOSE_EVERY", value_parser = parse_duration, default_value = "10s")]
    pub usage_close_every: Duration,
    /// How often every quota journal in the store is looked for, for
    /// events an instance left when it died (on Redis a SCAN of the
    /// keyspace; each instance also looks once at start).
    #[arg(long, env = "TOLLGATE_USAGE_SWEEP_EVERY", value_parser = parse_duration, default_value = "10m")]
    pub usage_sweep_every: Duration,
    /// Where quota alerts are POSTed (http:// or https://): each alert
    /// threshold a quota counter reaches, once per period, from the outbox
    /// in the limits database. Without it alerts are recorded and listed
    /// (`tollgate alerts list`, the status page), not sent.
    #[arg(long, env = "TOLLGATE_ALERT_WEBHOOK", value_parser = crate::alerts::parse_url)]
    pub alert_webhook: Option<http::Uri>,
    /// The key of the HMAC-SHA256 signature over each alert's body, sent in
    /// the `Tollgate-Signature` header (`sha256=` and hex). Prefer the
    /// environment variable: arguments are visible to other users.
    #[arg(long, env = "TOLLGATE_ALERT_SECRET", hide_env_values = true)]
    pub alert_secret: Option<String>,
    /// Longest wait for one alert delivery (connect, send, answer).
    #[arg(long, env = "TOLLGATE_ALERT_TIMEOUT", value_parser = parse_duration, default_value = "5s")]
    pub alert_timeout: Duration,
    /// Longest wait between two tries of an undelivered alert: waits double
    /// from a second up to this.
    #[arg(long, env = "TOLLGATE_ALERT_RETRY_MAX", value_parser = parse_duration, default_value = "5m")]
    pub alert_retry_max: Duration,
    /// How often idle in-memory buckets are dropped (not an option: tests
    /// shorten it).
    #[arg(skip = Duration::from_secs(10))]
    pub sweep_interval: Duration,
    /// Most buckets held in memory (also the local fallback's and the deny
    /// cache's). At the cap full buckets are dropped; if none is full,
    /// decisions needing new buckets get their rule's store-unavailable
    /// answer (a bucket still refilling is never dropped).
    #[arg(long, env = "TOLLGATE_MAX_BUCKETS", default_value_t = 1_000_000)]
    pub max_buckets: usize,
    /// Most bytes of buckets held in memory, each counted as 160 bytes plus
    /// its key; at the cap, as at --max-buckets.
    #[arg(long, env = "TOLLGATE_MAX_BUCKET_BYTES", default_value_t = 256 << 20)]
    pub max_bucket_bytes: usize,
    /// Most reservation and lease records held in memory, counted apart
    /// from buckets; one tenant may hold at most its fair share of them
    /// (this cap over one more than the tenants holding records).
    #[arg(long, env = "TOLLGATE_MAX_RECORDS", default_value_t = 1_000_000)]
    pub max_records: usize,
    /// Most reservation and lease records one tenant may hold, in memory
    /// and on Redis (open ones, and settled or expired ones for ten minutes
    /// after their ttl); beyond it reserves and acquires answer
    /// RESOURCE_EXHAUSTED. Unset: no cap of its own (memory still holds each
    /// tenant to its fair share of --max-records).
    #[arg(long, env = "TOLLGATE_MAX_RECORDS_PER_TENANT")]
    pub max_records_per_tenant: Option<usize>,
    /// What to do with requests no rule applies to: admit them, unlimited,
    /// or refuse them with FAILED_PRECONDITION.
    #[arg(long, env = "TOLLGATE_UNMATCHED", value_enum, default_value_t)]
    pub unmatched: Unmatched,
    /// Which RateLimit header fields answers carry (native answers' headers,
    /// and Envoy's response_headers_to_add): draft-11 (RateLimit-Policy and
    /// RateLimit, one member per rule), legacy (RateLimit-Limit, -Remaining
    /// and -Reset of the tightest rule) or both. Retry-After on every
    /// rejection either way.
    #[arg(long, env = "TOLLGATE_RATE_LIMIT_HEADERS", value_enum, default_value_t)]
    pub rate_limit_headers: HeaderStyle,
    /// Prefix of every Redis key.
    #[arg(long, env = "TOLLGATE_REDIS_PREFIX", default_value = redis::DEFAULT_PREFIX)]
    pub redis_prefix: String,
    /// Most concurrent decisions sent to Redis in one script call (they
    /// are decided one after another, in arrival order, at one instant).
    /// 0 or 1 sends every decision in its own call.
    #[arg(long, env = "TOLLGATE_REDIS_COALESCE", default_value_t = redis::DEFAULT_COALESCE)]
    pub redis_coalesce: usize,
    /// Spread each tenant's per-key buckets over the Redis Cluster's slots
    /// (a hash tag per key) instead of one slot per tenant; needs
    /// --token-slices, which decides a tenant's ceiling and its keys
    /// together.
    #[arg(long, env = "TOLLGATE_REDIS_SPREAD_KEYS", action = ArgAction::Set, num_args = 0..=1, default_value_t = false, default_missing_value = "true", value_parser = BoolishValueParser::new())]
    pub redis_spread_keys: bool,
    /// Answer tenant-wide buckets from slices of tokens taken ahead from
    /// the store (exact; may refuse early by what other instances hold).
    #[arg(long, env = "TOLLGATE_TOKEN_SLICES", action = ArgAction::Set, num_args = 0..=1, default_value_t = false, default_missing_value = "true", value_parser = BoolishValueParser::new())]
    pub token_slices: bool,
    /// Longest wait for a decision's store answer, time queued for a shared
    /// Redis call included, before the rule's store-unavailable policy
    /// decides instead (a shared call gets at least a fifth of it, so a
    /// decision queued until just before its deadline may wait up to 1.2×).
    #[arg(long, env = "TOLLGATE_STORE_TIMEOUT", value_parser = parse_duration, default_value = text(redis::DEFAULT_TIMEOUT))]
    pub store_timeout: Duration,
    /// Consecutive failed calls to one Redis node that open its circuit
    /// breaker.
    #[arg(long, env = "TOLLGATE_BREAKER_THRESHOLD", default_value_t = breaker::DEFAULT_THRESHOLD)]
    pub breaker_threshold: u32,
    /// How long an open breaker skips the store before probing it again;
    /// also the retry-after of requests a fail-closed rule refuses.
    #[arg(long, env = "TOLLGATE_BREAKER_COOLDOWN", value_parser = parse_duration, default_value = text(breaker::DEFAULT_COOLDOWN))]
    pub breaker_cooldown: Duration,
    /// While the store is down, the share of each limit that a rule with
    /// on_store_unavailable=local allows in this instance (e.g. 0.34 with
    /// three instances).
    #[arg(long, env = "TOLLGATE_LOCAL_FRACTION", value_parser = parse_fraction, default_value_t = 1.0)]
    pub local_fraction: f64,
    /// PEM file of the CA that signed the Redis server's certificate (for
    /// rediss:// with a private CA; unset: the web's roots).
    #[arg(long, env = "TOLLGATE_REDIS_CA_CERT")]
    pub redis_ca_cert: Option<PathBuf>,
    /// A directory of envoyproxy/ratelimit YAML files (every *.yaml in it)
    /// for Envoy's rate limit service API; re-read every reload interval.
    #[arg(long, env = "TOLLGATE_ENVOY_CONFIG")]
    pub envoy_config: Option<PathBuf>,
    /// The Envoy configuration from an xDS management server instead.
    #[command(flatten)]
    pub envoy_xds: XdsOptions,
    /// Options of the Envoy API.
    #[command(flatten)]
    pub envoy_options: EnvoyOptions,
    /// Options of Envoy's quota service (RLQS).
    #[command(flatten)]
    pub rlqs: crate::api::rlqs::RlqsOptions,
    /// Who may use the admin port.
    #[command(flatten)]
    pub admin_access: AdminAccess,
    /// TLS on the gRPC port.
    #[command(flatten)]
    pub tls: TlsOptions,
    /// Limits that keep one caller from starving the others.
    #[command(flatten)]
    pub grpc_limits: GrpcLimits,
    /// Answer requests for buckets the store recently rejected from a local
    /// cache until their retry-after, without asking Redis (can reject
    /// more, never admit more).
    #[arg(long, env = "TOLLGATE_DENY_CACHE", action = ArgAction::Set, num_args = 0..=1, default_value_t = false, default_missing_value = "true", value_parser = BoolishValueParser::new())]
    pub deny_cache: bool,
    /// Use the given clock for Redis decisions instead of Redis's own `TIME`
    /// (not an option: for tests that control time).
    #[arg(skip)]
    pub redis_uses_clock: bool,
    /// At shutdown, how long open connections and calls in flight may take
    /// before what remains is closed (an idle connection never delays the
    /// exit longer than this).
    #[arg(long, env = "TOLLGATE_SHUTDOWN_GRACE", value_parser = parse_duration, default_value = "10s")]
    pub shutdown_grace: Duration,
}

impl Default for ServeConfig {
    fn default() -> Self {
        defaults()
    }
}

impl ServeConfig {
    /// Refuses combinations of options that cannot work together.
    pub fn validate(&self) -> Result<(), String> {
        self.tls.files()?;
        if self.admin_access.protect_reads && self.admin_access.token.is_none() {
            return Err("--admin-protect-reads needs --admin-token".into());
        }
        self.grpc_limits.validate()?;
        self.rlqs.validate()?;
        if self.redis_spread_keys && !self.token_slices {
            // A per-key bucket and a tenant-wide one would then be on two
            // slots, and every decision with a ceiling would be refused.
            return Err(
                "--redis-spread-keys needs --token-slices: a tenant's ceiling and its \
                 keys' buckets are then on different slots, and only slices can decide \
                 them together"
                    .into(),
            );
        }
        if let (Some(_), Some(server)) = (&self.envoy_config, &self.envoy_xds.server) {
            return Err(format!(
                "--envoy-config and --envoy-xds {server} are exclusive: take the Envoy \
                 configuration from files or from an xDS management server"
            ));
        }
        if let Some(server) = &self.envoy_xds.server {
            crate::api::envoy::xds::endpoint(&self.envoy_xds, server).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// How the usage ledger paces itself.
    pub fn ledger(&self) -> LedgerOptions {
        LedgerOptions {
            grace: self.usage_grace,
            close_every: self.usage_close_every,
            sweep_every: self.usage_sweep_every,
            ..LedgerOptions::default()
        }
    }

    /// How quota alerts are delivered; `None` without a webhook.
    pub fn alerts(&self) -> Option<crate::alerts::AlertOptions> {
        self.alert_webhook
            .as_ref()
            .map(|url| crate::alerts::AlertOptions {
                timeout: self.alert_timeout,
                retry_max: self.alert_retry_max,
                ..crate::alerts::AlertOptions::new(url.clone(), self.alert_secret.clone())
            })
    }

    /// What the engine's stores are built from.
    pub fn backend(&self) -> BackendOptions {
        BackendOptions {
            redis: match &self.store {
                StoreSpec::Memory => None,
                StoreSpec::Redis(url) => Some(self.redis(url)),
            },
            redis_uses_clock: self.redis_uses_clock,
            max_buckets: self.max_buckets,
            max_bucket_bytes: self.max_bucket_bytes,
            max_records: self.max_records,
            max_records_per_tenant: self.max_records_per_tenant,
            local_fraction: self.local_fraction,
            deny_retry_after: self.breaker_cooldown.as_micros() as u64,
            deny_cache: self.deny_cache,
            token_slices: self.token_slices,
        }
    }

    /// The Redis store's configuration for `url`, from these options.
    pub fn redis(&self, url: &str) -> RedisConfig {
        let mut redis = RedisConfig::new(url);
        redis.prefix = self.redis_prefix.clone();
        redis.timeout = self.store_timeout;
        redis.ca_cert = self.redis_ca_cert.clone();
        redis.coalesce = self.redis_coalesce;
        redis.breaker_threshold = self.breaker_threshold;
        redis.breaker_cooldown = self.breaker_cooldown;
        redis.spread_keys = self.redis_spread_keys;
        redis.max_records_per_tenant = self.max_records_per_tenant;
        redis
    }
}

/// TLS on the gRPC port, as given.
#[derive(Debug, Clone, Default, PartialEq, Eq, Args)]
pub struct TlsOptions {
    /// TLS on the gRPC port: the server's certificate chain (PEM); needs
    /// --tls-key.
    #[arg(id = "tls_cert", long = "tls-cert", env = "TOLLGATE_TLS_CERT")]
    pub cert: Option<PathBuf>,
    /// TLS on the gRPC port: the server's private key (PEM); needs
    /// --tls-cert.
    #[arg(id = "tls_key", long = "tls-key", env = "TOLLGATE_TLS_KEY")]
    pub key: Option<PathBuf>,
    /// Mutual TLS: accept only clients with a certificate from this CA
    /// (PEM).
    #[arg(
        id = "tls_client_ca",
        long = "tls-client-ca",
        env = "TOLLGATE_TLS_CLIENT_CA"
    )]
    pub client_ca: Option<PathBuf>,
}

/// PEM files for TLS on the gRPC port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The server's certificate chain.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// When set, clients must present a certificate signed by this CA
    /// (mutual TLS).
    pub client_ca: Option<PathBuf>,
}

impl TlsOptions {
    /// TLS with these files.
    pub fn with(files: TlsFiles) -> Self {
        Self {
            cert: Some(files.cert),
            key: Some(files.key),
            client_ca: files.client_ca,
        }
    }

    /// The files TLS is served with, if any; certificate and key go
    /// together, and a client CA needs both.
    pub fn files(&self) -> Result<Option<TlsFiles>, String> {
        match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => Ok(Some(TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: self.client_ca.clone(),
            })),
            (None, None) if self.client_ca.is_none() => Ok(None),
            (None, None) => Err("--tls-client-ca needs --tls-cert and --tls-key".into()),
            _ => Err("--tls-cert and --tls-key go together; give both".into()),
        }
    }
}

/// Protection of the gRPC server against one caller starving the others, and
/// the bounds that make its memory finite (see [`GrpcLimits::worst_case_bytes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Args)]
pub struct GrpcLimits {
    /// Largest gRPC request message, in bytes.
    #[arg(id = "grpc_max_message_bytes", long = "grpc-max-message-bytes", env = "TOLLGATE_GRPC_MAX_MESSAGE_BYTES", default_value_t = MAX_MESSAGE_BYTES)]
    pub max_message_bytes: usize,
    /// Concurrent HTTP/2 streams per gRPC connection.
    #[arg(
        id = "grpc_max_concurrent_streams",
        long = "grpc-max-concurrent-streams",
        env = "TOLLGATE_GRPC_MAX_CONCURRENT_STREAMS",
        default_value_t = 128
    )]
    pub max_concurrent_streams: u32,
    /// Requests served at once per gRPC connection; more wait their turn,
    /// so one connection cannot take every worker.
    #[arg(
        id = "grpc_connection_concurrency",
        long = "grpc-connection-concurrency",
        env = "TOLLGATE_GRPC_CONNECTION_CONCURRENCY",
        default_value_t = 128
    )]
    pub connection_concurrency: usize,
    /// Longest a gRPC request may take before it is cancelled (to within a
    /// twentieth more); also how long a ShouldAllowStream may wait for its
    /// first message.
    #[arg(id = "grpc_request_timeout", long = "grpc-request-timeout", env = "TOLLGATE_GRPC_REQUEST_TIMEOUT", value_parser = parse_duration, default_value = "10s")]
    pub request_timeout: Duration,
    /// Open gRPC connections at most (half from one peer address); at the
    /// cap an idle one makes room, else one more is closed as soon as it
    /// is accepted (and counted in tollgate_connections_refused_total).
    #[arg(
        id = "grpc_max_connections",
        long = "grpc-max-connections",
        env = "TOLLGATE_GRPC_MAX_CONNECTIONS",
        default_value_t = 1024
    )]
    pub max_connections: usize,
    /// gRPC requests in service at once across all connections; past it a
    /// request gets RESOURCE_EXHAUSTED at once. Bounds the memory requests
    /// can hold (with --grpc-max-message-bytes).
    #[arg(
        id = "grpc_max_requests_in_flight",
        long = "grpc-max-requests-in-flight",
        env = "TOLLGATE_GRPC_MAX_REQUESTS_IN_FLIGHT",
        default_value_t = 1024
    )]
    pub max_requests_in_flight: usize,
    /// Largest header block of one gRPC request, in bytes (HTTP/2
    /// SETTINGS_MAX_HEADER_LIST_SIZE).
    #[arg(id = "grpc_max_header_bytes", long = "grpc-max-header-bytes", env = "TOLLGATE_GRPC_MAX_HEADER_BYTES", default_value_t = 16 * 1024)]
    pub max_header_bytes: u32,
    /// Request bytes one gRPC connection may have sent and the server not
    /// yet read (its HTTP/2 flow-control window; each stream gets a
    /// quarter).
    #[arg(id = "grpc_connection_window_bytes", long = "grpc-connection-window-bytes", env = "TOLLGATE_GRPC_CONNECTION_WINDOW_BYTES", default_value_t = 256 * 1024)]
    pub connection_window_bytes: u32,
    /// How often an HTTP/2 PING checks a quiet gRPC peer (0s: never; TCP
    /// keepalive probes after 60 s of quiet instead, at no cost per
    /// request: HTTP/2 keepalive reads the clock and takes a lock on every
    /// frame received).
    #[arg(id = "grpc_keepalive_interval", long = "grpc-keepalive-interval", env = "TOLLGATE_GRPC_KEEPALIVE_INTERVAL", value_parser = parse_duration_or_zero, default_value = "0s")]
    pub keepalive_interval: Duration,
    /// How long the PING's answer may take before the connection is closed.
    #[arg(id = "grpc_keepalive_timeout", long = "grpc-keepalive-timeout", env = "TOLLGATE_GRPC_KEEPALIVE_TIMEOUT", value_parser = parse_duration, default_value = "20s")]
    pub keepalive_timeout: Duration,
    /// Close a connection (either port) with no request in flight for a
    /// whole period of this length, so one to two periods after its last
    /// request (0s: never).
    #[arg(id = "idle_timeout", long = "idle-timeout", env = "TOLLGATE_IDLE_TIMEOUT", value_parser = parse_duration_or_zero, default_value = "300s")]
    pub idle_timeout: Duration,
}

impl Default for GrpcLimits {
    fn default() -> Self {
        defaults()
    }
}

/// Bytes an open connection holds besides its streams (buffers of the
/// socket, TLS-less HTTP/2 state), measured: see the README's "Memory".
pub const CONNECTION_OVERHEAD_BYTES: usize = 64 * 1024;
/// Bytes one open stream holds besides its headers (HTTP/2 stream state,
/// the request, its future and decode buffer), measured likewise.
pub const STREAM_OVERHEAD_BYTES: usize = 16 * 1024;

impl GrpcLimits {
    /// TCP keepalive for accepted connections: on when HTTP/2 PINGs are off,
    /// probing after 60 s of quiet.
    pub fn tcp_keepalive(&self) -> Option<Duration> {
        self.keepalive_interval
            .is_zero()
            .then_some(Duration::from_secs(60))
    }

    /// Refuses settings that would turn every caller away.
    pub fn validate(&self) -> Result<(), String> {
        let zero = |name: &str| Err(format!("{name} must be at least 1"));
        if self.max_connections == 0 {
            return zero("--grpc-max-connections");
        }
        if self.max_requests_in_flight == 0 {
            return zero("--grpc-max-requests-in-flight");
        }
        if self.max_concurrent_streams == 0 {
            return zero("--grpc-max-concurrent-streams");
        }
        if self.connection_concurrency == 0 {
            return zero("--grpc-connection-concurrency");
        }
        if self.max_message_bytes < 64 {
            return Err(
                "--grpc-max-message-bytes must be at least 64 (a ShouldAllow request takes \
                 tens of bytes; the default is 1048576)"
                    .into(),
            );
        }
        if self.max_header_bytes < 1024 {
            return Err("--grpc-max-header-bytes must be at least 1024".into());
        }
        if self.connection_window_bytes < 65_535 {
            return Err(
                "--grpc-connection-window-bytes must be at least 65535 (HTTP/2's minimum)".into(),
            );
        }
        Ok(())
    }

    /// The most memory gRPC connections and requests can hold at once,
    /// whatever callers send: every connection open, every stream open with
    /// a full header block, every connection's window full of unread body,
    /// and every request in service holding a largest message.
    pub fn worst_case_bytes(&self) -> usize {
        let per_stream = STREAM_OVERHEAD_BYTES + self.max_header_bytes as usize;
        let per_connection = CONNECTION_OVERHEAD_BYTES
            + self.connection_window_bytes as usize
            + self.max_concurrent_streams as usize * per_stream;
        self.max_connections * per_connection + self.max_requests_in_flight * self.max_message_bytes
    }
}
