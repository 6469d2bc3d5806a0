//! The command line: `serve` (in `serve`), `limits`, `plans` and
//! `tenants` (in `limits`, `plans` and `tenants`), and the
//! commands that talk to a running server, `check`, `top` and `health` (in
//! `client`). The load tool is a binary of its own (`bench/`). This file holds the command tree, the parsing of
//! a `serve --config` file, and the value parsers the flags share.
//!
//! Every `serve` flag also reads an environment variable (`TOLLGATE_…`);
//! a flag given on the command line wins over the environment, which wins
//! over the config file, which wins over the built-in default.

/// `println!` for the commands' output, except that a reader that went away
/// (`tollgate limits list | head -1`) ends the process quietly, as it would
/// any Unix tool, instead of panicking.
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::cli::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `print!`, likewise.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::write_stdout(format_args!($($arg)*))
    };
}

mod alerts;
mod client;
mod explain;
mod limits;
mod plans;
mod serve;
mod tenants;

use std::io::Write;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::limits::table::LimitsTable;

pub use crate::options::{parse_duration, parse_duration_or_zero, parse_fraction, parse_ratio};
pub use alerts::{AlertsCommand, alert_json, alerts};
pub use client::{
    AcquireArgs, ChargeArgs, CheckArgs, ReleaseArgs, TopArgs, UsageArgs, acquire, charge, check,
    health, release, top, usage,
};
pub use explain::{ExplainArgs, explain};
pub use limits::{LimitsCommand, SetArgs, limits, render_rows};
pub use plans::{PlansCommand, plans};
pub use serve::{Process, Serve, ServeArgs, options_table};
pub use tenants::{TenantsCommand, tenants};

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
    /// Manage plans (named sets of rules) and the tenants on them.
    #[command(subcommand)]
    Plans(PlansCommand),
    /// A tenant's plan and billing cycle (where its quotas' periods turn).
    #[command(subcommand)]
    Tenants(TenantsCommand),
    /// Ask a running server for a decision and print it.
    Check(CheckArgs),
    /// Print how much of each quota a tenant has used this period (or,
    /// with --periods, every recorded period).
    Usage(UsageArgs),
    /// The quota alerts: recorded, delivered or waiting.
    #[command(subcommand)]
    Alerts(AlertsCommand),
    /// Record usage known after the work on a running server (charged in
    /// full, into debt where the rule allows it).
    Charge(ChargeArgs),
    /// Take a slot of the concurrency caps that apply (a lease) on a running
    /// server, and print its token for `release`.
    Acquire(AcquireArgs),
    /// Give back a lease taken with `acquire`.
    Release(ReleaseArgs),
    /// Show the most limited tenants of a running server, refreshing in place.
    Top(TopArgs),
    /// Why a request gets the answer it gets, from a running server: the
    /// rules that apply and why, each bucket's state, a dry run, and the
    /// key's recent decisions (needs the admin token).
    Explain(ExplainArgs),
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

/// Where the limits table is.
#[derive(Debug, Args)]
pub struct LimitsLocation {
    /// The limits table: a SQLite file path or `sqlite:` URL, or a
    /// `postgres://` URL. A SQLite file must exist (`tollgate serve`
    /// creates it) unless --create is given.
    #[arg(long, env = "TOLLGATE_LIMITS", default_value = crate::limits::table::DEFAULT_LOCATION)]
    pub limits: String,
    /// Create the SQLite file (with its default row) when it does not
    /// exist.
    #[arg(long)]
    pub create: bool,
}

impl LimitsLocation {
    /// Opens the table (see [`LimitsTable::open_existing`]).
    pub async fn open(&self) -> anyhow::Result<LimitsTable> {
        Ok(LimitsTable::open_existing(&self.limits, self.create).await?)
    }
}

/// Which running server an edit waits for.
#[derive(Debug, Args)]
pub struct WaitFor {
    /// After the edit, wait (at most 10 s) until the server at this gRPC
    /// address has applied it, if it answers and reads the same table;
    /// `none` to not wait.
    #[arg(
        long = "wait-for",
        env = "TOLLGATE_SERVER",
        default_value = "http://127.0.0.1:50051"
    )]
    pub server: String,
}

/// How long an edit waits for a server to apply it.
const WAIT_FOR_APPLIED: Duration = Duration::from_secs(10);

impl WaitFor {
    /// Reports where the edit was written and waits until the server has
    /// applied it (or says why it does not wait), on standard error.
    pub async fn applied(&self, table: &LimitsTable) -> anyhow::Result<()> {
        use crate::proto::v1::LimitsStatusRequest;
        use crate::proto::v1::admin_client::AdminClient;

        let version = table.version().await?;
        let written = format!("written to {} (table version {version})", table.location());
        let server = &self.server;
        if server == "none" {
            eprintln!("{written}");
            return Ok(());
        }
        let endpoint = tonic::transport::Endpoint::from_shared(server.clone())
            .map_err(|e| anyhow::anyhow!("--wait-for {server:?}: {e}"))?
            .connect_timeout(Duration::from_millis(500))
            .timeout(Duration::from_secs(2));
        let Ok(channel) = endpoint.connect().await else {
            eprintln!(
                "{written}; no server answers at {server} (a server reading this table applies \
                 the edit within its --reload-interval, 1 s by default)"
            );
            return Ok(());
        };
        let mut client = AdminClient::new(channel);
        let deadline = tokio::time::Instant::now() + WAIT_FOR_APPLIED;
        loop {
            let status = match client.limits_status(LimitsStatusRequest {}).await {
                Ok(r) => r.into_inner(),
                Err(s) => {
                    eprintln!(
                        "{written}; the server at {server} does not say what it applied ({:?}: {})",
                        s.code(),
                        s.message()
                    );
                    return Ok(());
                }
            };
            if status.table != table.fingerprint() {
                eprintln!(
                    "{written}; the server at {server} reads another table (its --limits), so it \
                     will not see this edit"
                );
                return Ok(());
            }
            if status.version >= version {
                eprintln!("{written}; applied by the server at {server}");
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                anyhow::bail!(
                    "{written}; the server at {server} still holds version {} after {} s: its \
                     log and its admin port's /v1/limits say why",
                    status.version,
                    WAIT_FOR_APPLIED.as_secs()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Parses the command line. For `serve`, a file named by `--config` fills
/// the options that neither a flag nor the environment set.
pub fn parse() -> Result<Cli, clap::Error> {
    parse_from(std::env::args_os())
}

/// As [`parse`], from the given arguments (the first is the program).
pub fn parse_from(
    argv: impl IntoIterator<Item = impl Into<std::ffi::OsString>>,
) -> Result<Cli, clap::Error> {
    use clap::{CommandFactory, FromArgMatches};

    let mut argv: Vec<std::ffi::OsString> = argv.into_iter().map(Into::into).collect();
    let command = Cli::command();
    let mut matches = command.clone().try_get_matches_from(&argv)?;
    if let Some(("serve", given)) = matches.subcommand()
        && let Some(path) = given.get_one::<std::path::PathBuf>("config")
    {
        let serve = command
            .find_subcommand("serve")
            .expect("serve is a subcommand");
        let refuse = |message: String| {
            clap::Error::raw(
                clap::error::ErrorKind::ValueValidation,
                format!("{message}\n"),
            )
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| refuse(format!("config file {}: {e}", path.display())))?;
        argv.extend(serve::file_args(serve, Some(given), path, &text).map_err(refuse)?);
        matches = command.try_get_matches_from(&argv)?;
    }
    Cli::from_arg_matches(&matches)
}

/// Writes to stdout and flushes. When stdout is a pipe whose reader has
/// closed, the process exits with status 0 (the reader has what it wanted);
/// any other failure to write exits with status 1 and a message.
pub fn write_stdout(text: std::fmt::Arguments) {
    let mut stdout = std::io::stdout().lock();
    if let Err(err) = stdout.write_fmt(text).and_then(|()| stdout.flush()) {
        if err.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("error: writing to stdout: {err}");
        std::process::exit(1);
    }
}

/// Rows as left-aligned columns two spaces apart, one line each.
fn aligned<const N: usize>(rows: &[[String; N]]) -> String {
    let widths: Vec<usize> = (0..N)
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}
