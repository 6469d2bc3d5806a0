//! `tollgate serve`: its flags and the server configuration they describe.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;

use super::{LimitsLocation, parse_duration, parse_fraction, parse_ratio};
use crate::api::native::Unmatched;
use crate::server::{ServeConfig, StoreSpec};
use crate::telemetry::LogFormat;

/// `tollgate serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// A TOML file with any of these options (same names, snake_case, e.g.
    /// `grpc_addr = "0.0.0.0:50051"`). Flags win over the environment,
    /// which wins over the file, which wins over the defaults.
    #[arg(long, env = "TOLLGATE_CONFIG")]
    pub config: Option<std::path::PathBuf>,
    /// gRPC listen address (port 0 picks a free port).
    #[arg(long, env = "TOLLGATE_GRPC_ADDR", default_value = "127.0.0.1:50051")]
    pub grpc_addr: SocketAddr,
    /// Admin HTTP listen address: /healthz, /readyz, /metrics, /v1/limits.
    #[arg(long, env = "TOLLGATE_ADMIN_ADDR", default_value = "127.0.0.1:8090")]
    pub admin_addr: SocketAddr,
    /// The limits table.
    #[command(flatten)]
    pub limits: LimitsLocation,
    /// Where bucket state lives: `memory` (in this process),
    /// `redis://[user:password@]host:port[/db]`, `rediss://…` (TLS), or
    /// `redis-cluster://[user:password@]host:port,host:port,…`.
    #[arg(
        long,
        env = "TOLLGATE_STORE",
        default_value = "memory",
        hide_env_values = true
    )]
    pub store: String,
    /// PEM file of the CA that signed the Redis server's certificate (for
    /// rediss:// with a private CA).
    #[arg(long, env = "TOLLGATE_REDIS_CA_CERT")]
    pub redis_ca_cert: Option<std::path::PathBuf>,
    /// Prefix of every Redis key.
    #[arg(long, env = "TOLLGATE_REDIS_PREFIX", default_value = "tollgate:")]
    pub redis_prefix: String,
    /// Most concurrent decisions sent to Redis in one script call (they
    /// are decided one after another, in arrival order, at one instant).
    /// 0 or 1 sends every decision in its own call.
    #[arg(long, env = "TOLLGATE_REDIS_COALESCE", default_value_t = 64)]
    pub redis_coalesce: usize,
    /// Longest wait for one store call before the rule's store-unavailable
    /// policy decides instead.
    #[arg(long, env = "TOLLGATE_STORE_TIMEOUT", default_value = "100ms", value_parser = parse_duration)]
    pub store_timeout: Duration,
    /// Consecutive store failures that open the circuit breaker.
    #[arg(long, env = "TOLLGATE_BREAKER_THRESHOLD", default_value_t = 5)]
    pub breaker_threshold: u32,
    /// How long the open breaker skips the store before probing it again.
    #[arg(long, env = "TOLLGATE_BREAKER_COOLDOWN", default_value = "1s", value_parser = parse_duration)]
    pub breaker_cooldown: Duration,
    /// While the store is down, the share of each limit that a rule with
    /// on_store_unavailable=local allows in this instance (e.g. 0.34 with
    /// three instances).
    #[arg(long, env = "TOLLGATE_LOCAL_FRACTION", default_value_t = 1.0, value_parser = parse_fraction)]
    pub local_fraction: f64,
    /// Threads that run the service; 0 starts one per CPU this process may
    /// use. Fewer leave cores to neighbours (a sidecar, a local Redis).
    #[arg(
        long,
        env = "TOLLGATE_WORKER_THREADS",
        default_value_t = 0,
        value_parser = clap::value_parser!(u16).range(0..=1024)
    )]
    pub worker_threads: u16,
    /// Keep tokio's LIFO slot (off by default): calls made one at a time
    /// are answered sooner (~30 µs in memory, ~40 µs on Redis), but under
    /// load each response costs a write of its own, about a third more CPU
    /// per decision.
    #[arg(long, env = "TOLLGATE_RUNTIME_LIFO_SLOT")]
    pub runtime_lifo_slot: bool,
    /// How often the limits table is re-read (e.g. 1s, 500ms).
    #[arg(long, env = "TOLLGATE_RELOAD_INTERVAL", default_value = "1s", value_parser = parse_duration)]
    pub reload_interval: Duration,
    /// Most buckets held in memory; beyond it idle buckets, then the ones
    /// closest to full, are dropped.
    #[arg(long, env = "TOLLGATE_MAX_BUCKETS", default_value_t = 1_000_000)]
    pub max_buckets: usize,
    /// What to do with requests no rule applies to.
    #[arg(long, env = "TOLLGATE_UNMATCHED", value_enum, default_value = "allow")]
    pub unmatched: Unmatched,
    /// Log format.
    #[arg(long, env = "TOLLGATE_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Answer requests for buckets the store recently rejected from a local
    /// cache until their retry-after, without asking Redis (can reject more,
    /// never admit more; see BENCHMARKS.md).
    #[arg(long, env = "TOLLGATE_DENY_CACHE")]
    pub deny_cache: bool,
    /// Share of decisions traced when the caller's trace is not sampled
    /// (traces are exported only when OTEL_EXPORTER_OTLP_ENDPOINT is set).
    #[arg(long, env = "TOLLGATE_TRACE_SAMPLE_RATIO", default_value_t = 0.01, value_parser = parse_ratio)]
    pub trace_sample_ratio: f64,
    /// TLS on the gRPC port: the server's certificate chain (PEM).
    #[arg(long, env = "TOLLGATE_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,
    /// TLS on the gRPC port: the server's private key (PEM).
    #[arg(long, env = "TOLLGATE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,
    /// Mutual TLS: accept only clients with a certificate from this CA (PEM).
    #[arg(long, env = "TOLLGATE_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<std::path::PathBuf>,
    /// Bearer token for the admin port's changing endpoints (POST/DELETE
    /// /v1/limits); without it they are disabled.
    #[arg(long, env = "TOLLGATE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Require the admin token for the read-only admin endpoints too
    /// (/healthz and /readyz stay open for probes).
    #[arg(long, env = "TOLLGATE_ADMIN_PROTECT_READS", requires = "admin_token")]
    pub admin_protect_reads: bool,
    /// Largest gRPC request message, in bytes.
    #[arg(long, env = "TOLLGATE_GRPC_MAX_MESSAGE_BYTES", default_value_t = 1024 * 1024)]
    pub grpc_max_message_bytes: usize,
    /// Concurrent HTTP/2 streams per gRPC connection.
    #[arg(
        long,
        env = "TOLLGATE_GRPC_MAX_CONCURRENT_STREAMS",
        default_value_t = 1024
    )]
    pub grpc_max_concurrent_streams: u32,
    /// Requests served at once per connection (more wait their turn).
    #[arg(
        long,
        env = "TOLLGATE_GRPC_CONNECTION_CONCURRENCY",
        default_value_t = 256
    )]
    pub grpc_connection_concurrency: usize,
    /// Longest a gRPC request may take before it is cancelled.
    #[arg(long, env = "TOLLGATE_GRPC_REQUEST_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub grpc_request_timeout: Duration,
    /// A directory of envoyproxy/ratelimit YAML files (every *.yaml in it)
    /// for Envoy's rate limit service API; re-read every reload interval.
    #[arg(long, env = "TOLLGATE_ENVOY_CONFIG")]
    pub envoy_config: Option<std::path::PathBuf>,
    /// Envoy API global shadow mode: count, but never answer OVER_LIMIT.
    #[arg(long, env = "TOLLGATE_ENVOY_SHADOW_MODE")]
    pub envoy_shadow_mode: bool,
    /// Add RateLimit-* and Retry-After to Envoy's response_headers_to_add.
    #[arg(long, env = "TOLLGATE_ENVOY_RESPONSE_HEADERS", default_value_t = true, action = clap::ArgAction::Set)]
    pub envoy_response_headers: bool,
}

impl ServeArgs {
    /// The server configuration these flags describe. (The store is parsed
    /// here rather than by clap so that a password in its URL never reaches
    /// an error message.)
    pub fn config(&self) -> Result<ServeConfig, String> {
        Ok(ServeConfig {
            limits: self.limits.limits.clone(),
            store: self.store.parse::<StoreSpec>()?,
            reload_interval: self.reload_interval,
            max_buckets: self.max_buckets,
            unmatched: self.unmatched,
            redis_prefix: self.redis_prefix.clone(),
            redis_coalesce: self.redis_coalesce,
            store_timeout: self.store_timeout,
            breaker_threshold: self.breaker_threshold,
            breaker_cooldown: self.breaker_cooldown,
            local_fraction: self.local_fraction,
            redis_ca_cert: self.redis_ca_cert.clone(),
            deny_cache: self.deny_cache,
            envoy_config: self.envoy_config.clone(),
            admin_access: crate::api::admin::AdminAccess {
                token: self.admin_token.clone(),
                protect_reads: self.admin_protect_reads,
            },
            tls: self
                .tls_cert
                .clone()
                .zip(self.tls_key.clone())
                .map(|(cert, key)| crate::server::TlsFiles {
                    cert,
                    key,
                    client_ca: self.tls_client_ca.clone(),
                }),
            grpc_limits: crate::server::GrpcLimits {
                max_message_bytes: self.grpc_max_message_bytes,
                max_concurrent_streams: self.grpc_max_concurrent_streams,
                connection_concurrency: self.grpc_connection_concurrency,
                request_timeout: self.grpc_request_timeout,
            },
            envoy_options: crate::api::envoy::service::EnvoyOptions {
                shadow_mode: self.envoy_shadow_mode,
                response_headers: self.envoy_response_headers,
            },
            ..ServeConfig::default()
        })
    }
}
