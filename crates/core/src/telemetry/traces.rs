//! OpenTelemetry traces of decisions.
//!
//! Off unless the standard `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) environment variable is set; then
//! decision spans are exported over OTLP/gRPC. A caller's W3C trace
//! context (`traceparent` in the gRPC metadata) becomes the span's parent,
//! so the decision appears inside the caller's trace. Sampling is parent
//! based: a sampled caller is always followed, other decisions are sampled
//! at `--trace-sample-ratio` (or as `OTEL_TRACES_SAMPLER` says). While
//! tracing is off, no span is created at all, so the hot path pays nothing.

use std::sync::OnceLock;

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt;

static ENABLED: OnceLock<bool> = OnceLock::new();

/// True when decision spans are being exported.
pub fn enabled() -> bool {
    ENABLED.get().copied().unwrap_or(false)
}

/// Flushes and stops the exporter when dropped (at shutdown).
pub struct TraceGuard(Option<SdkTracerProvider>);

impl Drop for TraceGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.0.take() {
            let _ = provider.shutdown();
        }
    }
}

/// True when the environment asks for OTLP export.
pub fn configured() -> bool {
    [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()))
}

/// Builds the OTLP pipeline; returns the tracer provider. Must run inside
/// the tokio runtime.
pub fn provider(sample_ratio: f64) -> Result<SdkTracerProvider, String> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()
        .map_err(|e| format!("OTLP exporter: {e}"))?;
    let mut builder = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name("tollgate")
                .build(),
        );
    if std::env::var_os("OTEL_TRACES_SAMPLER").is_none() {
        builder = builder.with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            sample_ratio,
        ))));
    }
    Ok(builder.build())
}

/// The tracing layer exporting to `provider`, and the guard that flushes it.
pub fn layer<S>(provider: SdkTracerProvider) -> (impl tracing_subscriber::Layer<S>, TraceGuard)
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
{
    let _ = ENABLED.set(true);
    let tracer = provider.tracer("tollgate");
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(tracing_subscriber::filter::filter_fn(|m| {
            m.target() == "tollgate::decision"
        }));
    (layer, TraceGuard(Some(provider)))
}

use tracing_subscriber::Layer as _;

struct Metadata<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for Metadata<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// A span for one decision RPC, child of the caller's trace context when the
/// metadata carries one; `Span::none()` while tracing is off. Fill `rule` and
/// `outcome` as they become known.
pub fn decision_span(
    method: &'static str,
    metadata: &tonic::metadata::MetadataMap,
    tenant: &str,
    cost: u64,
) -> tracing::Span {
    if !enabled() {
        return tracing::Span::none();
    }
    let span = tracing::info_span!(
        target: "tollgate::decision",
        "decision",
        otel.name = method,
        otel.kind = "server",
        rpc.system = "grpc",
        rpc.method = method,
        tenant = tenant,
        cost = cost,
        rule = tracing::field::Empty,
        outcome = tracing::field::Empty,
    );
    let parent = TraceContextPropagator::new().extract(&Metadata(metadata));
    let _ = span.set_parent(parent);
    span
}
