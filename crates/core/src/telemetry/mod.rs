//! Logs and metrics.

pub mod latency;
pub mod metrics;
pub mod recent;
pub mod top;
pub mod traces;

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Log output format.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Installs the global log subscriber: `RUST_LOG` filters (default `info`),
/// output goes to stderr. Safe to call more than once; later calls do nothing.
pub fn init_logs(format: LogFormat) {
    let _ = init(format, None);
}

/// Installs logs and, when `traces` is given, the OpenTelemetry layer
/// exporting decision spans. Keep the guard until shutdown: dropping it
/// flushes the spans still buffered.
pub fn init(
    format: LogFormat,
    traces: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
) -> Option<traces::TraceGuard> {
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;

    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = std::io::stderr().is_terminal();
    let fmt = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(ansi)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_writer(std::io::stderr)
            .boxed(),
    };
    let registry = tracing_subscriber::registry().with(fmt.with_filter(filter));
    match traces {
        Some(provider) => {
            let (otel, guard) = traces::layer(provider);
            registry.with(otel).try_init().ok().map(|_| guard)
        }
        None => {
            let _ = registry.try_init();
            None
        }
    }
}
