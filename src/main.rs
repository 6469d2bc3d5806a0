//! The `tollgate` binary: parses the command line and hands over to the
//! library.

use std::process::ExitCode;
use std::sync::Arc;

use tollgate::cli::{self, Cli, Command, Serve};
use tollgate::clock::SystemClock;
use tollgate::server::{self, Listeners};
use tollgate::telemetry::{self, LogFormat};

/// mimalloc instead of the system allocator: a gRPC call allocates dozens of
/// small buffers (h2 frames, headers, protobuf strings), and glibc's malloc
/// and free were about a tenth of the server's CPU in the profile. See
/// BENCHMARKS.md for the measured difference.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // clap's own messages (including --help and --version) print as is.
    let cli = cli::parse().unwrap_or_else(|e| e.exit());
    // `serve`'s options: flags, environment and config file, resolved
    // before the runtime starts (its size is one of them).
    let serve = match &cli.command {
        Command::Serve(args) => match args.resolve() {
            Ok(serve) => Some(serve),
            Err(message) => {
                eprintln!("error: {message}");
                return ExitCode::FAILURE;
            }
        },
        _ => None,
    };
    let (workers, keep_lifo_slot) = serve.as_ref().map_or((0, false), |s| {
        (
            usize::from(s.process.worker_threads),
            s.process.runtime_lifo_slot,
        )
    });
    let runtime = match tollgate::runtime::build(workers, keep_lifo_slot) {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: starting the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(dispatch(cli, serve)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(cli: Cli, serve: Option<Serve>) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve(_) => {
            let Serve { process, config } = serve.expect("resolved in main");
            let traces = if telemetry::traces::configured() {
                Some(
                    telemetry::traces::provider(process.trace_sample_ratio)
                        .map_err(anyhow::Error::msg)?,
                )
            } else {
                None
            };
            let _flush_traces_at_exit = telemetry::init(process.log_format, traces);
            let listeners = Listeners::bind(process.grpc_addr, process.admin_addr).await?;
            server::run(config, listeners, Arc::new(SystemClock), shutdown_signal()).await?;
        }
        Command::Limits(command) => {
            telemetry::init_logs(LogFormat::Text);
            cli::limits(command).await?;
        }
        Command::Plans(command) => {
            telemetry::init_logs(LogFormat::Text);
            cli::plans(command).await?;
        }
        Command::Tenants(command) => {
            telemetry::init_logs(LogFormat::Text);
            cli::tenants(command).await?;
        }
        Command::Check(args) => cli::check(args).await?,
        Command::Usage(args) => cli::usage(args).await?,
        Command::Alerts(command) => {
            telemetry::init_logs(LogFormat::Text);
            cli::alerts(command).await?;
        }
        Command::Charge(args) => cli::charge(args).await?,
        Command::Acquire(args) => cli::acquire(args).await?,
        Command::Release(args) => cli::release(args).await?,
        Command::Top(args) => cli::top(args).await?,
        Command::Explain(args) => cli::explain(args).await?,
        Command::Health { server, service } => cli::health(server, service).await?,
    }
    Ok(())
}

/// Completes on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing a SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
    tracing::info!("shutting down: finishing in-flight requests");
}
