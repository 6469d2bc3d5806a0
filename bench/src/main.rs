//! `tollgate-bench`: Tollgate's load tool, and the empty server it is
//! compared against. Kept apart from the product: the `tollgate` binary and
//! its container image carry neither.
//!
//! ```text
//! tollgate-bench run --server http://127.0.0.1:50051 --duration 10s --concurrency 64
//! tollgate-bench empty-server --grpc-addr 127.0.0.1:50052
//! ```
//!
//! Closed loop: `concurrency` requests in flight, each sent as soon as the
//! previous answered; throughput is what the server sustains. Open loop
//! (`--rate`): requests are sent on a fixed schedule whatever the answers
//! do, and each latency is measured from the moment the request was *due*,
//! so a stalled server shows up as latency instead of silently lowering the
//! load (coordinated omission).

mod empty;
mod load;
mod verdicts;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use tollgate::cli::parse_duration;

/// The same allocator as the product, so the client's cost per call is
/// comparable across runs and with the server's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(name = "tollgate-bench", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Drive a running server with load and report throughput and latency.
    Run(RunArgs),
    /// Serve a RateLimiter whose handlers do nothing: the ceiling `run`
    /// compares the real service against.
    EmptyServer {
        /// gRPC listen address.
        #[arg(long, default_value = "127.0.0.1:50052")]
        grpc_addr: std::net::SocketAddr,
        /// Keep tokio's LIFO slot, as `tollgate serve --runtime-lifo-slot`
        /// does (so that a comparison runs both servers on the same runtime).
        #[arg(long)]
        runtime_lifo_slot: bool,
        /// Answer each single decision only after a thread outside the
        /// runtime releases it, in batches, this many µs after the first
        /// call of a batch: an empty handler whose answers wait, as on
        /// Redis.
        #[arg(long)]
        answer_after_us: Option<u64>,
    },
}

#[derive(Debug, Args)]
struct RunArgs {
    /// The server's gRPC address.
    #[arg(
        long,
        env = "TOLLGATE_SERVER",
        default_value = "http://127.0.0.1:50051"
    )]
    server: String,
    /// Which API to drive.
    #[arg(long, value_enum, default_value = "native")]
    api: load::Api,
    /// Items per call with --api batch.
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// HTTP/2 connections to spread the calls over.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Calls in flight (closed loop), or workers sending on schedule (open loop).
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Open loop: this many calls per second on a fixed schedule; latency is
    /// measured from each call's scheduled time.
    #[arg(long)]
    rate: Option<u64>,
    /// How long to run.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    duration: Duration,
    /// Distinct keys.
    #[arg(long, default_value_t = 10_000)]
    keys: u64,
    /// Key distribution: uniform, zipf or zipf:EXPONENT.
    #[arg(long, default_value = "uniform")]
    distribution: load::Distribution,
    /// Tenant (native) or domain (Envoy) of the calls; a comma-separated
    /// list (`a,b,c`) spreads the workers over them in turn.
    #[arg(long, default_value = "bench")]
    tenant: String,
    /// Resource of the native, batch and stream calls (none by default).
    #[arg(long, default_value = "")]
    resource: String,
    /// PID of the server, to report its CPU time per decision.
    #[arg(long)]
    server_pid: Option<u32>,
    /// No per-second progress line.
    #[arg(long)]
    quiet: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The same log subscriber as `tollgate serve` (RUST_LOG, default info):
    // with none installed, every trace span inside h2 and tonic falls back
    // to the `log` crate's path (sqlx turns on tracing's `log` feature),
    // about 11 000 instructions per call that the product never pays.
    tollgate::telemetry::init_logs(tollgate::telemetry::LogFormat::Text);
    let keep_lifo_slot = matches!(
        cli.command,
        Command::EmptyServer {
            runtime_lifo_slot: true,
            ..
        }
    );
    let runtime = match tollgate::runtime::build(0, keep_lifo_slot) {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: starting the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(dispatch(cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Run(args) => run(args).await,
        Command::EmptyServer {
            grpc_addr,
            answer_after_us,
            ..
        } => {
            let listener = tokio::net::TcpListener::bind(grpc_addr).await?;
            eprintln!(
                "empty RateLimiter listening grpc={}",
                listener.local_addr()?
            );
            empty::serve_empty(listener, answer_after_us.map(Duration::from_micros)).await?;
            Ok(())
        }
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let server_before = args.server_pid.and_then(load::cpu_time);
    let client_before = load::cpu_time(std::process::id());
    let summary = load::run(load::LoadOptions {
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
        args.server_pid.and_then(load::cpu_time),
    );
    cpu_line("client", client_before, load::cpu_time(std::process::id()));
    Ok(())
}
