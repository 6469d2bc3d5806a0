//! `tollgate serve`: its options, from flags, the environment and a config
//! file.
//!
//! Each option is declared once, as a field of the group it configures
//! ([`ServeConfig`] and its groups for the server, [`Process`] for the process
//! around it), with its flag, environment variable, default and help. clap
//! reads the flags and the environment; [`file_args`] turns a `--config`
//! TOML file into flags for the options neither set, so a file's values go
//! through the same parsers; the declared defaults fill the rest.
//! [`options_table`] renders the declarations as the table in
//! `docs/configuration.md`.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::builder::BoolishValueParser;
use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, Args, FromArgMatches};

use crate::options::{defaults, parse_ratio};
use crate::server::ServeConfig;
use crate::telemetry::LogFormat;

/// Most `--worker-threads`.
pub const MAX_WORKER_THREADS: u16 = 1024;

/// `tollgate serve`'s options.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// A TOML file with any of these options (same names, snake_case, e.g.
    /// `grpc_addr = "0.0.0.0:50051"`). Flags win over the environment,
    /// which wins over the file, which wins over the defaults.
    #[arg(long, env = "TOLLGATE_CONFIG")]
    pub config: Option<PathBuf>,
    /// The process around the server.
    #[command(flatten)]
    pub process: Process,
    /// The server.
    #[command(flatten)]
    pub server: ServeConfig,
}

/// What `serve` runs with besides the server's own configuration: the
/// process around it.
#[derive(Debug, Clone, PartialEq, Args)]
pub struct Process {
    /// gRPC listen address (port 0 picks a free port; the bound address is
    /// logged).
    #[arg(long, env = "TOLLGATE_GRPC_ADDR", default_value = "127.0.0.1:50051")]
    pub grpc_addr: SocketAddr,
    /// Admin HTTP listen address: /healthz, /readyz, /metrics, /v1/limits.
    #[arg(long, env = "TOLLGATE_ADMIN_ADDR", default_value = "127.0.0.1:8090")]
    pub admin_addr: SocketAddr,
    /// Log format; RUST_LOG filters (default info).
    #[arg(long, env = "TOLLGATE_LOG_FORMAT", value_enum, default_value_t)]
    pub log_format: LogFormat,
    /// Threads that run the service; 0 starts one per CPU this process may
    /// use (cgroup limits included). Fewer leave cores to neighbours (a
    /// sidecar, a local Redis).
    #[arg(
        long,
        env = "TOLLGATE_WORKER_THREADS",
        default_value_t = 0,
        value_parser = clap::value_parser!(u16).range(0..=i64::from(MAX_WORKER_THREADS))
    )]
    pub worker_threads: u16,
    /// Keep tokio's LIFO slot: calls made one at a time are answered sooner
    /// (~30 µs in memory, ~40 µs on Redis), but under load each response
    /// costs a write of its own, about a third more CPU per decision.
    #[arg(long, env = "TOLLGATE_RUNTIME_LIFO_SLOT", action = ArgAction::Set, num_args = 0..=1, default_value_t = false, default_missing_value = "true", value_parser = BoolishValueParser::new())]
    pub runtime_lifo_slot: bool,
    /// Share of decisions traced when the caller's trace is not sampled
    /// (traces are exported only when OTEL_EXPORTER_OTLP_ENDPOINT is set).
    #[arg(long, env = "TOLLGATE_TRACE_SAMPLE_RATIO", value_parser = parse_ratio, default_value_t = 0.01)]
    pub trace_sample_ratio: f64,
}

impl Default for Process {
    fn default() -> Self {
        defaults()
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
    /// The settings these options give, once their combinations are
    /// checked (a config file is already layered in by [`crate::cli::parse`]).
    pub fn resolve(&self) -> Result<Serve, String> {
        self.server.validate()?;
        Ok(Serve {
            process: self.process.clone(),
            config: self.server.clone(),
        })
    }

    /// The settings a config file's text gives on its own (no flags, no
    /// environment), checked as at start-up.
    pub fn from_toml(text: &str) -> Result<Serve, String> {
        let command = Self::augment_args(clap::Command::new("serve"))
            .mut_args(|arg| arg.env(None::<&'static str>));
        let args = file_args(&command, None, Path::new("(text)"), text)?;
        let matches = command
            .try_get_matches_from(std::iter::once(OsString::from("serve")).chain(args))
            .map_err(|e| message(&e))?;
        Self::from_arg_matches(&matches)
            .map_err(|e| message(&e))?
            .resolve()
    }
}

/// The option names a config file may use (each flag's snake_case name),
/// sorted.
pub fn names(serve: &clap::Command) -> Vec<String> {
    let mut names: Vec<String> = serve
        .get_arguments()
        .filter(|arg| arg.get_long().is_some() && arg.get_id() != "config")
        .map(|arg| arg.get_id().to_string())
        .collect();
    names.sort_unstable();
    names
}

/// The flags that carry a config file's values (`text`, read from `path`)
/// for the options `given` (the command line and environment) left at
/// their defaults. Each value is checked by its option's own parser here,
/// so an error names the file.
pub fn file_args(
    serve: &clap::Command,
    given: Option<&ArgMatches>,
    path: &Path,
    text: &str,
) -> Result<Vec<OsString>, String> {
    let at = |e: &dyn std::fmt::Display| format!("config file {}: {e}", path.display());
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| at(&e))?;
    let mut args = Vec::with_capacity(table.len());
    for (key, value) in &table {
        let arg = serve.get_arguments().find(|arg| {
            arg.get_id() == key.as_str() && arg.get_long().is_some() && key != "config"
        });
        let (Some(arg), Some(long)) = (arg, arg.and_then(|a| a.get_long())) else {
            return Err(at(&format!(
                "unknown option {key:?}; known options: {}",
                names(serve).join(", ")
            )));
        };
        let set_above = given.is_some_and(|m| {
            matches!(
                m.value_source(key),
                Some(ValueSource::CommandLine | ValueSource::EnvVariable)
            )
        });
        if set_above {
            continue;
        }
        let value = match value {
            toml::Value::String(s) => s.clone(),
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            other => {
                return Err(at(&format!(
                    "{key}: expected a string, a number or true/false, not a {}",
                    other.type_str()
                )));
            }
        };
        let flag = format!("--{long}={value}");
        clap::Command::new("serve")
            .arg(arg.clone().env(None::<&'static str>))
            .try_get_matches_from(["serve", flag.as_str()])
            .map_err(|e| at(&format!("{key}: {}", message(&e))))?;
        args.push(flag.into());
    }
    Ok(args)
}

/// A clap error's message without its `error:` prefix and help hint.
fn message(err: &clap::Error) -> String {
    let text = err.to_string();
    let text = text.strip_prefix("error: ").unwrap_or(&text);
    text.split("\n\n").next().unwrap_or(text).trim().to_owned()
}

/// `serve`'s options as a Markdown table (flag, environment variable,
/// default, what it does), rendered from their declarations.
pub fn options_table(serve: &clap::Command) -> String {
    let mut out = String::from("| flag | environment | default | |\n| --- | --- | --- | --- |\n");
    for arg in serve.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        let env = arg
            .get_env()
            .map(|e| format!("`{}`", e.to_string_lossy()))
            .unwrap_or_default();
        let default: Vec<String> = arg
            .get_default_values()
            .iter()
            .map(|v| v.to_string_lossy().into_owned())
            .collect();
        let default = if default.is_empty() {
            "(none)".to_owned()
        } else {
            format!("`{}`", default.join(","))
        };
        let help = arg
            .get_long_help()
            .or(arg.get_help())
            .map(|h| h.to_string())
            .unwrap_or_default()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
            .replace('|', "\\|");
        out.push_str(&format!("| `--{long}` | {env} | {default} | {help} |\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::server::GrpcLimits;

    #[test]
    fn an_empty_command_line_is_the_declared_defaults() {
        let process = Process::default();
        assert_eq!(process.grpc_addr, SocketAddr::from(([127, 0, 0, 1], 50051)));
        assert_eq!(process.trace_sample_ratio, 0.01);
        let d = ServeConfig::default();
        assert_eq!(d.store_timeout, crate::engine::redis::DEFAULT_TIMEOUT);
        assert_eq!(d.breaker_cooldown, Duration::from_secs(1));
        assert_eq!(d.reload_interval, Duration::from_millis(500));
        assert_eq!(d.grpc_limits.keepalive_interval, Duration::ZERO);
        assert_eq!(d.grpc_limits.max_message_bytes, 1 << 20);
        assert!(d.envoy_options.response_headers && !d.envoy_options.shadow_mode);
        assert_eq!(GrpcLimits::default(), d.grpc_limits);
        // The Redis store's own defaults are the same declarations.
        let redis = d.redis("redis://127.0.0.1:6379");
        let plain = crate::engine::RedisConfig::new("redis://127.0.0.1:6379");
        assert_eq!(
            (
                redis.prefix,
                redis.timeout,
                redis.coalesce,
                redis.breaker_threshold,
                redis.breaker_cooldown
            ),
            (
                plain.prefix,
                plain.timeout,
                plain.coalesce,
                plain.breaker_threshold,
                plain.breaker_cooldown
            )
        );
        let empty = ServeArgs::from_toml("").unwrap();
        assert_eq!(empty.process, process);
        assert_eq!(format!("{:?}", empty.config), format!("{d:?}"));
    }

    fn serve_command() -> clap::Command {
        ServeArgs::augment_args(clap::Command::new("serve"))
            .mut_args(|arg| arg.env(None::<&'static str>))
    }

    #[test]
    fn a_file_fills_only_what_flags_left_unset_and_is_checked_like_flags() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.toml");
        let text = "max_buckets = 5000\nreload_interval = \"250ms\"\nstore_timeout = \"2s\"\ndeny_cache = true\n";
        let command = serve_command();
        let flags = ["serve", "--store-timeout", "50ms"];
        let given = command.clone().try_get_matches_from(flags).unwrap();
        let extra = file_args(&command, Some(&given), &path, text).unwrap();
        let all = flags.iter().map(OsString::from).chain(extra);
        let matches = command.try_get_matches_from(all).unwrap();
        let s = ServeArgs::from_arg_matches(&matches)
            .unwrap()
            .resolve()
            .unwrap();
        assert_eq!(s.config.max_buckets, 5000);
        assert_eq!(s.config.reload_interval, Duration::from_millis(250));
        assert_eq!(
            s.config.store_timeout,
            Duration::from_millis(50),
            "the flag wins"
        );
        assert!(s.config.deny_cache);

        let err = |text: &str| ServeArgs::from_toml(text).unwrap_err();
        assert_eq!(
            err("local_fraction = 1.5\n"),
            "config file (text): local_fraction: invalid value '1.5' for '--local-fraction \
             <LOCAL_FRACTION>': \"1.5\" must be a number greater than 0 and at most 1"
        );
        assert_eq!(
            err("worker_threads = 5000\n"),
            "config file (text): worker_threads: invalid value '5000' for '--worker-threads \
             <WORKER_THREADS>': 5000 is not in 0..=1024"
        );
        assert!(
            err("reload_interval = \"soon\"\n")
                .contains("\"soon\" must look like 500ms, 1s, 2m or 1h"),
        );
        assert!(err("nope = 1\n").starts_with(
            "config file (text): unknown option \"nope\"; known options: admin_addr, admin_protect_reads,"
        ));
        assert_eq!(
            err("idle_timeout = { a = 1 }\n"),
            "config file (text): idle_timeout: expected a string, a number or true/false, not a table"
        );
        assert_eq!(
            err("tls_cert = \"a.pem\"\n"),
            "--tls-cert and --tls-key go together; give both"
        );
        let store = err("store = \"redis://:hunter2@\"\n");
        assert!(!store.contains("hunter2"), "{store}");
        assert!(
            err("redis_spread_keys = true\n")
                .starts_with("--redis-spread-keys needs --token-slices"),
        );
        assert_eq!(
            err("envoy_config = \"envoy\"\nenvoy_xds = \"grpc://127.0.0.1:18000\"\n"),
            "--envoy-config and --envoy-xds grpc://127.0.0.1:18000 are exclusive: take the Envoy \
             configuration from files or from an xDS management server"
        );
        assert_eq!(
            err("envoy_xds = \"127.0.0.1:18000\"\n"),
            "--envoy-xds \"127.0.0.1:18000\": give grpc://HOST:PORT or grpcs://HOST:PORT"
        );
        let s = ServeArgs::from_toml("envoy_xds = \"grpc://127.0.0.1:18000\"\n").unwrap();
        assert_eq!(
            s.config.envoy_xds.server.as_deref(),
            Some("grpc://127.0.0.1:18000")
        );
        let s = ServeArgs::from_toml("redis_spread_keys = true\ntoken_slices = true\n").unwrap();
        assert!(s.config.redis_spread_keys && s.config.token_slices);
        let s = ServeArgs::from_toml("grpc_max_connections = 7\nidle_timeout = \"0s\"\n").unwrap();
        assert_eq!(s.config.grpc_limits.max_connections, 7);
        assert_eq!(s.config.grpc_limits.idle_timeout, Duration::ZERO);
    }

    #[test]
    fn every_option_has_a_flag_an_environment_variable_and_help() {
        let command = serve_command();
        let with_env = ServeArgs::augment_args(clap::Command::new("serve"));
        for arg in with_env.get_arguments() {
            let id = arg.get_id().as_str();
            let long = arg.get_long().unwrap_or_else(|| panic!("{id} has no flag"));
            assert_eq!(
                long.replace('-', "_"),
                id,
                "a config file names {id} as its flag"
            );
            let env = arg
                .get_env()
                .unwrap_or_else(|| panic!("{id} has no variable"));
            assert_eq!(
                env.to_string_lossy(),
                format!("TOLLGATE_{}", id.to_uppercase()),
            );
            assert!(arg.get_help().is_some(), "{id} has no help");
        }
        assert_eq!(names(&command).len(), with_env.get_arguments().count() - 1);
    }
}
