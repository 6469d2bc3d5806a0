//! The command line: `serve`, `limits` and `check`.
//!
//! Every `serve` flag also reads an environment variable (`TOLLGATE_…`);
//! a flag given on the command line wins over the environment, which wins
//! over the built-in default.

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::grpc::proto::v1::ShouldAllowRequest;
use crate::grpc::proto::v1::rate_limiter_client::RateLimiterClient;
use crate::limiter::Unmatched;
use crate::limits::LimitRow;
use crate::limits::table::LimitsTable;
use crate::server::{ServeConfig, StoreSpec};
use crate::telemetry::LogFormat;

/// Tollgate: a rate-limit decision service.
#[derive(Debug, Parser)]
#[command(name = "tollgate", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the decision service.
    Serve(Box<ServeArgs>),
    /// Manage the limits table.
    #[command(subcommand)]
    Limits(LimitsCommand),
    /// Ask a running server for a decision and print it.
    Check(CheckArgs),
    /// Show the most limited tenants of a running server, refreshing in place.
    Top(TopArgs),
    /// Drive a running server with load and report throughput and latency.
    Bench(BenchArgs),
    /// Serve a RateLimiter whose handlers do nothing: the ceiling `bench`
    /// compares the real service against.
    #[command(hide = true)]
    BenchEmptyServer {
        /// gRPC listen address.
        #[arg(long, default_value = "127.0.0.1:50052")]
        grpc_addr: std::net::SocketAddr,
    },
    /// Ask a running server's gRPC health service; exit 0 when serving (for
    /// container health checks).
    Health {
        /// The server's gRPC address.
        #[arg(
            long,
            env = "TOLLGATE_SERVER",
            default_value = "http://127.0.0.1:50051"
        )]
        server: String,
        /// The service to ask about ('' for the whole server).
        #[arg(long, default_value = "tollgate.v1.RateLimiter")]
        service: String,
    },
}

/// `tollgate bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// The server's gRPC address.
    #[arg(
        long,
        env = "TOLLGATE_SERVER",
        default_value = "http://127.0.0.1:50051"
    )]
    pub server: String,
    /// Which API to drive.
    #[arg(long, value_enum, default_value = "native")]
    pub api: crate::bench::Api,
    /// Items per call with --api batch.
    #[arg(long, default_value_t = 100)]
    pub batch: usize,
    /// HTTP/2 connections to spread the calls over.
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// Calls in flight (closed loop), or workers sending on schedule (open loop).
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Open loop: this many calls per second on a fixed schedule; latency is
    /// measured from each call's scheduled time.
    #[arg(long)]
    pub rate: Option<u64>,
    /// How long to run.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Distinct keys.
    #[arg(long, default_value_t = 10_000)]
    pub keys: u64,
    /// Key distribution: uniform, zipf or zipf:EXPONENT.
    #[arg(long, default_value = "uniform")]
    pub distribution: crate::bench::Distribution,
    /// Tenant (native) or domain (Envoy) of the calls.
    #[arg(long, default_value = "bench")]
    pub tenant: String,
    /// Resource of the native, batch and stream calls (none by default).
    #[arg(long, default_value = "")]
    pub resource: String,
    /// PID of the server, to report its CPU time per decision.
    #[arg(long)]
    pub server_pid: Option<u32>,
    /// No per-second progress line.
    #[arg(long)]
    pub quiet: bool,
}

/// Runs `bench`.
pub async fn bench(args: BenchArgs) -> anyhow::Result<()> {
    let server_before = args.server_pid.and_then(crate::bench::cpu_time);
    let client_before = crate::bench::cpu_time(std::process::id());
    let summary = crate::bench::run(crate::bench::LoadOptions {
        server: args.server.clone(),
        api: args.api,
        batch: args.batch,
        connections: args.connections,
        concurrency: args.concurrency,
        rate: args.rate,
        duration: args.duration,
        keys: args.keys,
        distribution: args.distribution,
        tenant: args.tenant.clone(),
        resource: args.resource.clone(),
        progress: !args.quiet,
    })
    .await
    .map_err(anyhow::Error::msg)?;
    println!("{}", summary.render());
    let cpu_line = |who: &str, before: Option<Duration>, after: Option<Duration>| {
        if let (Some(before), Some(after)) = (before, after) {
            let cpu = after.saturating_sub(before).as_secs_f64();
            println!(
                "{who} CPU: {cpu:.2} s  = {:.2} µs per call, {:.3} µs per decision",
                cpu * 1e6 / summary.calls.max(1) as f64,
                cpu * 1e6 / summary.decisions.max(1) as f64
            );
        }
    };
    cpu_line(
        "server",
        server_before,
        args.server_pid.and_then(crate::bench::cpu_time),
    );
    cpu_line(
        "client",
        client_before,
        crate::bench::cpu_time(std::process::id()),
    );
    Ok(())
}

/// `tollgate top`.
#[derive(Debug, Args)]
pub struct TopArgs {
    /// The server's gRPC address.
    #[arg(
        long,
        env = "TOLLGATE_SERVER",
        default_value = "http://127.0.0.1:50051"
    )]
    pub server: String,
    /// Tenants to show.
    #[arg(long, default_value_t = 10)]
    pub tenants: u32,
    /// Keys to show per tenant.
    #[arg(long, default_value_t = 3)]
    pub keys: u32,
    /// Time between refreshes.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub interval: Duration,
    /// Stop after this many refreshes (default: until Ctrl-C).
    #[arg(long)]
    pub count: Option<u32>,
}

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
    #[arg(long, env = "TOLLGATE_WORKER_THREADS", default_value_t = 0)]
    pub worker_threads: usize,
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
            admin_access: crate::admin::AdminAccess {
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
            envoy_options: crate::envoy::service::EnvoyOptions {
                shadow_mode: self.envoy_shadow_mode,
                response_headers: self.envoy_response_headers,
            },
            ..ServeConfig::default()
        })
    }
}

/// Where the limits table is.
#[derive(Debug, Args)]
pub struct LimitsLocation {
    /// The limits table: a SQLite file path or `sqlite:` URL, or a
    /// `postgres://` URL (created and seeded when missing).
    #[arg(long, env = "TOLLGATE_LIMITS", default_value = "tollgate-limits.db")]
    pub limits: String,
}

/// `tollgate limits …`.
#[derive(Debug, Subcommand)]
pub enum LimitsCommand {
    /// Print every row.
    List {
        /// The limits table.
        #[command(flatten)]
        location: LimitsLocation,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Add a row, or change the row with the same tenant, resource, scope
    /// and mode.
    Set(SetArgs),
    /// Delete a row by name.
    Delete {
        /// The limits table.
        #[command(flatten)]
        location: LimitsLocation,
        /// The row's name.
        #[arg(long)]
        name: String,
    },
}

/// `tollgate limits set`.
#[derive(Debug, Args)]
pub struct SetArgs {
    /// The limits table.
    #[command(flatten)]
    pub location: LimitsLocation,
    /// Tenant ('' or omitted: the default rows).
    #[arg(long, default_value = "")]
    pub tenant: String,
    /// Resource ('' or omitted: any resource).
    #[arg(long, default_value = "")]
    pub resource: String,
    /// `key` (one bucket per key) or `tenant` (one ceiling for all keys).
    #[arg(long, default_value = "key")]
    pub scope: String,
    /// Capacity: the largest burst.
    #[arg(long)]
    pub burst: i64,
    /// Sustained rate as N/unit, e.g. 600/minute.
    #[arg(long)]
    pub rate: String,
    /// `enforce` or `shadow`.
    #[arg(long, default_value = "enforce")]
    pub mode: String,
    /// When the shared store is down: `allow`, `deny` or `local`.
    #[arg(long, default_value = "allow")]
    pub on_store_unavailable: String,
    /// The row's name (default: TENANT-RESOURCE-SCOPE, plus -shadow).
    #[arg(long)]
    pub name: Option<String>,
}

/// `tollgate check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// The server's gRPC address.
    #[arg(
        long,
        env = "TOLLGATE_SERVER",
        default_value = "http://127.0.0.1:50051"
    )]
    pub server: String,
    /// Tenant.
    #[arg(long, default_value = "")]
    pub tenant: String,
    /// Key.
    #[arg(long)]
    pub key: String,
    /// Cost in tokens.
    #[arg(long, default_value_t = 1)]
    pub cost: u64,
    /// Resource.
    #[arg(long, default_value = "")]
    pub resource: String,
    /// Decide without spending.
    #[arg(long)]
    pub dry_run: bool,
    /// Ask this many times in a row, one line each.
    #[arg(long, default_value_t = 1)]
    pub repeat: u32,
}

/// Parses a ratio in [0, 1].
pub fn parse_ratio(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(format!("{s:?} must be a number from 0 to 1")),
    }
}

/// Parses a fraction in (0, 1].
pub fn parse_fraction(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
        _ => Err(format!(
            "{s:?} must be a number greater than 0 and at most 1"
        )),
    }
}

/// Parses `1s`, `250ms`, `2m`, `1h`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("{s:?} must look like 500ms, 1s, 2m or 1h"))?;
    Ok(match unit {
        "ms" => Duration::from_millis(n),
        "s" | "" => Duration::from_secs(n),
        "m" => Duration::from_secs(n * 60),
        "h" => Duration::from_secs(n * 3600),
        _ => return Err(format!("{s:?}: unit must be ms, s, m or h")),
    })
    .and_then(|d| {
        if d.is_zero() {
            Err(format!("{s:?} must be more than zero"))
        } else {
            Ok(d)
        }
    })
}

/// Runs a `limits` subcommand, printing to stdout.
pub async fn limits(command: LimitsCommand) -> anyhow::Result<()> {
    match command {
        LimitsCommand::List { location, json } => {
            let table = LimitsTable::open(&location.limits).await?;
            let rows = table.rows().await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                print!("{}", render_rows(&rows));
            }
            for row in &rows {
                if let Err(err) = row.validate() {
                    eprintln!("warning: {err}");
                }
            }
        }
        LimitsCommand::Set(args) => {
            let row = LimitRow::from_request(
                args.tenant,
                args.resource,
                args.scope,
                args.burst,
                &args.rate,
                args.mode,
                args.on_store_unavailable,
                args.name,
            )
            .map_err(anyhow::Error::msg)?;
            let rule = row.validate()?;
            let table = LimitsTable::open(&args.location.limits).await?;
            table.upsert(&row).await?;
            println!("set {rule}");
        }
        LimitsCommand::Delete { location, name } => {
            let table = LimitsTable::open(&location.limits).await?;
            if !table.delete(&name).await? {
                anyhow::bail!("no row is named {name:?}; `tollgate limits list` shows the names");
            }
            println!("deleted {name}");
        }
    }
    Ok(())
}

/// Renders rows as an aligned table.
pub fn render_rows(rows: &[LimitRow]) -> String {
    let mut lines = vec![[
        "NAME".to_owned(),
        "TENANT".into(),
        "RESOURCE".into(),
        "SCOPE".into(),
        "BURST".into(),
        "RATE".into(),
        "MODE".into(),
        "STORE_DOWN".into(),
        "UPDATED_AT".into(),
    ]];
    let or = |s: &str, d: &str| {
        if s.is_empty() {
            d.to_owned()
        } else {
            s.to_owned()
        }
    };
    for r in rows {
        lines.push([
            r.name.clone(),
            or(&r.tenant, "(default)"),
            or(&r.resource, "(any)"),
            r.scope.clone(),
            r.burst.to_string(),
            format!("{}/{}", r.rate, r.rate_unit),
            r.mode.clone(),
            r.on_store_unavailable.clone(),
            r.updated_at.clone(),
        ]);
    }
    let widths: Vec<usize> = (0..9)
        .map(|c| lines.iter().map(|l| l[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for line in lines {
        let cells: Vec<String> = line
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// Runs `check`: prints one line per decision.
pub async fn check(args: CheckArgs) -> anyhow::Result<()> {
    let mut client = RateLimiterClient::connect(args.server.clone())
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach {}: {e}", args.server))?;
    for i in 1..=args.repeat.max(1) {
        let response = client
            .should_allow(ShouldAllowRequest {
                key: args.key.clone(),
                cost: args.cost,
                tenant: args.tenant.clone(),
                resource: args.resource.clone(),
                dry_run: args.dry_run,
            })
            .await
            .map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?
            .into_inner();
        let prefix = if args.repeat > 1 {
            format!("#{i:<3} ")
        } else {
            String::new()
        };
        println!("{prefix}{}", describe(&response));
    }
    Ok(())
}

fn describe(r: &crate::grpc::proto::v1::ShouldAllowResponse) -> String {
    let secs = |d: &Option<prost_types::Duration>| {
        d.as_ref()
            .map_or(0.0, |d| d.seconds as f64 + f64::from(d.nanos) / 1e9)
    };
    if r.limit_name.is_empty() {
        return format!(
            "{}  (no rule applies: unlimited)",
            if r.allowed { "ALLOWED" } else { "REJECTED" }
        );
    }
    let mut headers: Vec<_> = r.headers.iter().collect();
    headers.sort();
    let headers: Vec<String> = headers
        .into_iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect();
    format!(
        "{:<8}  remaining {}/{}  retry_after {:.3}s  reset_after {:.3}s  rule {} ({}){}  [{}]",
        if r.allowed { "ALLOWED" } else { "REJECTED" },
        r.remaining,
        r.limit,
        secs(&r.retry_after),
        secs(&r.reset_after),
        r.limit_name,
        r.rate,
        if r.shadow {
            "  shadow: would reject"
        } else {
            ""
        },
        headers.join(", "),
    )
}

/// Runs `top`: a table of the most limited tenants, redrawn in place on a
/// terminal (appended otherwise).
pub async fn top(args: TopArgs) -> anyhow::Result<()> {
    use crate::grpc::proto::v1::TopLimitedRequest;
    use crate::grpc::proto::v1::admin_client::AdminClient;
    use std::io::IsTerminal;

    let mut client = AdminClient::connect(args.server.clone())
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach {}: {e}", args.server))?;
    let terminal = std::io::stdout().is_terminal();
    let mut shown = 0;
    loop {
        let response = client
            .top_limited(TopLimitedRequest {
                tenants: args.tenants,
                keys: args.keys,
            })
            .await
            .map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?
            .into_inner();
        let window = response.window.map_or(0, |w| w.seconds);
        let mut out = String::new();
        if terminal {
            out.push_str("\x1b[H\x1b[2J");
        }
        out.push_str(&format!(
            "Most limited tenants on {} (rejections over the last {}-{} s)\n",
            args.server,
            window,
            2 * window
        ));
        let mut rows = vec![[
            "RANK".to_owned(),
            "TENANT".into(),
            "REJECTIONS".into(),
            "TOP KEYS".into(),
        ]];
        for (i, t) in response.tenants.iter().enumerate() {
            let tenant = if t.tenant.is_empty() {
                "(default)".to_owned()
            } else {
                t.tenant.clone()
            };
            let rejections = if t.error > 0 {
                format!("{} (±{})", t.rejections, t.error)
            } else {
                t.rejections.to_string()
            };
            let keys: Vec<String> = t
                .keys
                .iter()
                .map(|k| format!("{} ({})", k.key, k.rejections))
                .collect();
            rows.push([(i + 1).to_string(), tenant, rejections, keys.join(", ")]);
        }
        if response.tenants.is_empty() {
            out.push_str("no rejections in the window\n");
        } else {
            let widths: Vec<usize> = (0..4)
                .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
                .collect();
            for row in &rows {
                let cells: Vec<String> = row
                    .iter()
                    .zip(&widths)
                    .map(|(c, w)| format!("{c:<w$}"))
                    .collect();
                out.push_str(cells.join("  ").trim_end());
                out.push('\n');
            }
        }
        print!("{out}");
        shown += 1;
        if args.count.is_some_and(|n| shown >= n) {
            return Ok(());
        }
        tokio::time::sleep(args.interval).await;
    }
}

/// Parses the command line, filling `serve` options that neither a flag nor
/// the environment set from the `--config` file.
pub fn parse() -> Result<Cli, String> {
    use clap::parser::ValueSource;
    use clap::{CommandFactory, FromArgMatches};

    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let matches = Cli::command()
        .try_get_matches_from(&args)
        .map_err(|e| e.to_string())?;
    let Some(serve) = matches.subcommand_matches("serve") else {
        return Cli::from_arg_matches(&matches).map_err(|e| e.to_string());
    };
    let Some(path) = serve.get_one::<std::path::PathBuf>("config") else {
        return Cli::from_arg_matches(&matches).map_err(|e| e.to_string());
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("config file {}: {e}", path.display()))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e| format!("config file {}: {e}", path.display()))?;
    let known: Vec<String> = Cli::command()
        .find_subcommand("serve")
        .map(|c| c.get_arguments().map(|a| a.get_id().to_string()).collect())
        .unwrap_or_default();
    let mut extra: Vec<std::ffi::OsString> = Vec::new();
    for (key, value) in &table {
        if key == "config" || !known.contains(key) {
            let mut valid: Vec<&str> = known
                .iter()
                .map(String::as_str)
                .filter(|k| *k != "config")
                .collect();
            valid.sort_unstable();
            return Err(format!(
                "config file {}: unknown option {key:?}; known options: {}",
                path.display(),
                valid.join(", ")
            ));
        }
        // Flags and the environment win over the file.
        if matches!(
            serve.value_source(key),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        ) {
            continue;
        }
        let flag = format!("--{}", key.replace('_', "-"));
        match value {
            toml::Value::Boolean(true) if key != "envoy_response_headers" => {
                extra.push(flag.into())
            }
            toml::Value::Boolean(false) if key != "envoy_response_headers" => {}
            toml::Value::String(s) => extra.extend([flag.into(), s.into()]),
            toml::Value::Integer(_) | toml::Value::Float(_) | toml::Value::Boolean(_) => {
                extra.extend([flag.into(), value.to_string().into()])
            }
            other => {
                return Err(format!(
                    "config file {}: {key} must be a string, number or boolean, not {}",
                    path.display(),
                    other.type_str()
                ));
            }
        }
    }
    let mut all = args;
    all.extend(extra);
    let matches = Cli::command()
        .try_get_matches_from(all)
        .map_err(|e| format!("config file {}: {e}", path.display()))?;
    Cli::from_arg_matches(&matches).map_err(|e| e.to_string())
}

/// Runs `health`: prints the serving status; an error unless SERVING.
pub async fn health(server: String, service: String) -> anyhow::Result<()> {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;

    let channel = tonic::transport::Endpoint::from_shared(server.clone())?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(2))
        .connect()
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach {server}: {e}"))?;
    let status = HealthClient::new(channel)
        .check(HealthCheckRequest { service })
        .await
        .map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?
        .into_inner()
        .status();
    println!("{}", status.as_str_name());
    if status == ServingStatus::Serving {
        Ok(())
    } else {
        anyhow::bail!("not serving")
    }
}
