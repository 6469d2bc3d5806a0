//! A decision appears inside the caller's trace: a small OTLP/gRPC receiver
//! collects what `tollgate serve` exports when OTEL_EXPORTER_OTLP_ENDPOINT
//! points at it.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::process::ServeProcess;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use parking_lot::Mutex;
use tollgate::proto::v1::ShouldAllowRequest;
use tollgate::proto::v1::rate_limiter_client::RateLimiterClient;

#[derive(Clone, Default)]
struct Receiver(Arc<Mutex<Vec<Span>>>);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.0.lock();
        for rs in request.into_inner().resource_spans {
            for ss in rs.scope_spans {
                spans.extend(ss.spans);
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn attribute(span: &Span, key: &str) -> Option<String> {
    span.attributes.iter().find(|a| a.key == key).and_then(|a| {
        match a.value.as_ref()?.value.as_ref()? {
            Value::StringValue(s) => Some(s.clone()),
            Value::IntValue(i) => Some(i.to_string()),
            other => Some(format!("{other:?}")),
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decision_span_joins_the_callers_trace() {
    let receiver = Receiver::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let service = TraceServiceServer::new(receiver.clone());
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
    });

    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("http://127.0.0.1:{port}");
    // Ratio 0: only decisions whose caller's trace is sampled are exported.
    let server = ServeProcess::start_with_env(
        dir.path(),
        &["--trace-sample-ratio", "0"],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    );
    let mut client = RateLimiterClient::connect(format!("http://{}", server.grpc))
        .await
        .unwrap();
    let request = || ShouldAllowRequest {
        key: "alice".into(),
        cost: 3,
        tenant: "acme".into(),
        resource: String::new(),
        dry_run: false,
    };
    let mut traced = tonic::Request::new(request());
    traced.metadata_mut().insert(
        "traceparent",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
            .parse()
            .unwrap(),
    );
    assert!(
        client
            .should_allow(traced)
            .await
            .unwrap()
            .into_inner()
            .allowed
    );
    // Not part of a sampled trace: not exported at ratio 0.
    client.should_allow(request()).await.unwrap();

    let mut spans = Vec::new();
    for _ in 0..200 {
        spans = receiver.0.lock().clone();
        if !spans.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Shutting down flushes anything still buffered.
    let (status, _) = server.terminate();
    assert!(status.success());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let all = receiver.0.lock().clone();
    spans = if all.len() > spans.len() { all } else { spans };

    assert_eq!(spans.len(), 1, "exactly the sampled decision: {spans:#?}");
    let span = &spans[0];
    assert_eq!(
        hex(&span.trace_id),
        "4bf92f3577b34da6a3ce929d0e0e4736",
        "the caller's trace id"
    );
    assert_eq!(
        hex(&span.parent_span_id),
        "00f067aa0ba902b7",
        "the caller's span is the parent"
    );
    assert_eq!(span.name, "ShouldAllow");
    assert_eq!(attribute(span, "tenant").as_deref(), Some("acme"));
    assert_eq!(attribute(span, "cost").as_deref(), Some("3"));
    assert_eq!(attribute(span, "rule").as_deref(), Some("default-per-key"));
    assert_eq!(attribute(span, "outcome").as_deref(), Some("allowed"));
}
