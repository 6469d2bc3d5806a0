//! The Envoy configuration over xDS, as Envoy Gateway serves it to a rate
//! limit service: a management server run here (a tonic ADS server; Envoy
//! Gateway itself cannot run here) serves `RateLimitConfig` snapshots, and
//! a real server follows them: applied and ACKed, an invalid one NACKed
//! with the error while the last good one stays in force, hostile ones
//! refused, and the management server's restart survived.

use crate::common;

use std::pin::Pin;
use std::time::Duration;

use common::TestServer;
use common::envoy::{ask, descriptor, request_in};
use prost::Message;
use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tollgate::api::envoy::xds::TYPE_URL;
use tollgate::proto::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use tollgate::proto::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use tollgate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tollgate::proto::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy,
};
use tonic::{Request, Response, Status, Streaming};

/// A management server: sends the latest snapshot on each stream's first
/// request and on every change, and hands every request it hears to the
/// test.
struct Ads {
    snapshots: watch::Receiver<Option<DiscoveryResponse>>,
    heard: mpsc::UnboundedSender<DiscoveryRequest>,
}

type Responses = Pin<Box<dyn Stream<Item = Result<DiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = Responses;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Responses>, Status> {
        let mut inbound = request.into_inner();
        let (heard, mut snapshots) = (self.heard.clone(), self.snapshots.clone());
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            let mut subscribed = false;
            loop {
                tokio::select! {
                    message = inbound.message() => {
                        let Ok(Some(message)) = message else { return };
                        let _ = heard.send(message);
                        if !subscribed {
                            subscribed = true;
                            let latest = snapshots.borrow_and_update().clone();
                            if let Some(latest) = latest
                                && tx.send(Ok(latest)).await.is_err()
                            {
                                return;
                            }
                        }
                    }
                    changed = snapshots.changed(), if subscribed => {
                        if changed.is_err() {
                            return;
                        }
                        let latest = snapshots.borrow_and_update().clone();
                        if let Some(latest) = latest
                            && tx.send(Ok(latest)).await.is_err()
                        {
                            return;
                        }
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

/// A management server on a runtime of its own. tonic serves each
/// connection on a task of its own, which outlives the accept loop; so
/// only ending the runtime ends the connections too, as a management
/// server's death does.
struct Management {
    port: u16,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Management {
    /// Serves on `port` (0: any), waiting for the port while a stopped
    /// server still holds it.
    fn start(
        port: u16,
        snapshots: watch::Receiver<Option<DiscoveryResponse>>,
        heard: mpsc::UnboundedSender<DiscoveryRequest>,
    ) -> Self {
        let mut attempts = 0;
        let listener = loop {
            match std::net::TcpListener::bind(("127.0.0.1", port)) {
                Ok(listener) => break listener,
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && attempts < 500 => {
                    attempts += 1;
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => panic!("binding 127.0.0.1:{port}: {e}"),
            }
        };
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let service = AggregatedDiscoveryServiceServer::new(Ads { snapshots, heard });
        runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await;
        });
        Self {
            port,
            runtime: Some(runtime),
        }
    }

    /// Ends the server and every connection and stream it holds, and
    /// returns once they are gone (so none of them sends anything after).
    fn stop(mut self) {
        let runtime = self.runtime.take().expect("a running server");
        // Waiting for a runtime blocks, which an async test's own thread
        // may not do; another thread may.
        std::thread::spawn(move || runtime.shutdown_timeout(Duration::from_secs(10)))
            .join()
            .unwrap();
    }
}

impl Drop for Management {
    fn drop(&mut self) {
        // A test that failed first: end it without waiting.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// A snapshot: domain `edge`, one rule `ip` of `n` a minute, plus `extra`
/// descriptors.
fn snapshot(version: &str, n: u32, extra: Vec<RateLimitDescriptor>) -> DiscoveryResponse {
    let mut descriptors = vec![limited("ip", n)];
    descriptors.extend(extra);
    let resource = RateLimitConfig {
        name: "edge-policy".into(),
        domain: "edge".into(),
        descriptors,
    };
    DiscoveryResponse {
        version_info: version.into(),
        resources: vec![prost_types::Any {
            type_url: TYPE_URL.into(),
            value: resource.encode_to_vec(),
        }],
        canary: false,
        type_url: TYPE_URL.into(),
        nonce: format!("nonce-{version}"),
    }
}

fn limited(key: &str, n: u32) -> RateLimitDescriptor {
    RateLimitDescriptor {
        key: key.into(),
        rate_limit: Some(RateLimitPolicy {
            unit: 2, // MINUTE
            requests_per_unit: n,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The next request the management server hears.
async fn next(heard: &mut mpsc::UnboundedReceiver<DiscoveryRequest>) -> DiscoveryRequest {
    tokio::time::timeout(Duration::from_secs(30), heard.recv())
        .await
        .expect("the client answers within 30 s")
        .expect("the management server runs")
}

/// The limit the Envoy API applies to an address now.
async fn limit(server: &TestServer) -> u32 {
    let mut client = RateLimitServiceClient::new(server.channel().await);
    let r = ask(
        &mut client,
        request_in(
            "edge",
            vec![
                tollgate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor {
                    hits_addend: Some(0),
                    ..descriptor(&[("ip", "10.0.0.1")])
                },
            ],
        ),
    )
    .await;
    r.statuses[0]
        .current_limit
        .as_ref()
        .map_or(0, |l| l.requests_per_unit)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_are_applied_acked_nacked_and_followed_across_a_restart() {
    let (publish, snapshots) = watch::channel(Some(snapshot("v1", 3, vec![])));
    let (heard_tx, mut heard) = mpsc::unbounded_channel();
    let ads = Management::start(0, snapshots.clone(), heard_tx.clone());
    let port = ads.port;
    let address = format!("grpc://127.0.0.1:{port}");
    let server = TestServer::launch(None, |c| c.envoy_xds.server = Some(address)).await;

    // Subscribed: this node, every RateLimitConfig, no version yet.
    let first = next(&mut heard).await;
    assert_eq!(first.type_url, TYPE_URL);
    assert!(first.resource_names.is_empty(), "a wildcard subscription");
    assert_eq!(first.version_info, "");
    assert_eq!(first.node.as_ref().unwrap().id, "tollgate");
    // v1 applied and ACKed.
    let ack = next(&mut heard).await;
    assert_eq!(
        (ack.version_info.as_str(), ack.response_nonce.as_str()),
        ("v1", "nonce-v1")
    );
    assert!(ack.error_detail.is_none());
    assert_eq!(limit(&server).await, 3);

    // v2 replaces it. (How long that took is printed, not asserted.)
    #[allow(clippy::disallowed_methods)]
    let published = std::time::Instant::now();
    publish.send_replace(Some(snapshot("v2", 5, vec![])));
    let ack = next(&mut heard).await;
    eprintln!(
        "v2 applied and ACKed {:?} after it was published",
        published.elapsed()
    );
    assert_eq!((ack.version_info.as_str(), ack.error_detail), ("v2", None));
    assert_eq!(limit(&server).await, 5);

    // An invalid v3 (a descriptor without a unit) is NACKed with the
    // error, and v2 stays in force.
    let mut bad = limited("user", 1);
    bad.rate_limit.as_mut().unwrap().unit = 0;
    publish.send_replace(Some(snapshot("v3", 7, vec![bad])));
    let nack = next(&mut heard).await;
    assert_eq!(
        (nack.version_info.as_str(), nack.response_nonce.as_str()),
        ("v2", "nonce-v3")
    );
    let error = nack.error_detail.expect("a NACK carries the error");
    assert_eq!(error.code, 3);
    assert_eq!(error.message, "xds:edge-policy: invalid rate limit unit ''");
    assert_eq!(limit(&server).await, 5);
    let (_, status) = server.http_get("/v1/envoy-config").await.unwrap();
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(status["status"]["xds"]["version"], "v2");
    assert_eq!(status["status"]["xds"]["connected"], true);
    assert_eq!(
        status["status"]["last_error"],
        "xds:edge-policy: invalid rate limit unit ''"
    );

    // Hostile snapshots: 100 000 descriptors are NACKed...
    let many = (0..100_000).map(|i| limited(&format!("k{i}"), 1)).collect();
    publish.send_replace(Some(snapshot("v4", 9, many)));
    let nack = next(&mut heard).await;
    assert_eq!(nack.version_info, "v2");
    assert_eq!(
        nack.error_detail.unwrap().message,
        "the snapshot holds more than 50000 descriptors (nested ones included); split the \
         rate limits over fewer descriptors"
    );
    // ...and 50 MB are refused as they arrive: the stream is dropped
    // (there is no reading a NACK's nonce out of them) and the client
    // reconnects, still on v2.
    let mut huge = limited("blob", 1);
    huge.value = "x".repeat(50 << 20);
    publish.send_replace(Some(snapshot("v5", 11, vec![huge])));
    let again = next(&mut heard).await;
    assert_eq!(
        (again.version_info.as_str(), again.response_nonce.as_str()),
        ("v2", ""),
        "a new subscription, from the version in force"
    );
    assert_eq!(limit(&server).await, 5);
    let (_, status) = server.http_get("/v1/envoy-config").await.unwrap();
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    let error = status["status"]["last_error"].as_str().unwrap();
    assert!(
        error.starts_with(
            "the management server sent a response larger than 16777216 bytes \
             (--envoy-xds-max-message-bytes); it was not applied"
        ),
        "{error}"
    );

    // The management server dies and comes back, on the same port, with
    // v6: the client resubscribes from v2 and follows.
    ads.stop();
    publish.send_replace(Some(snapshot("v6", 13, vec![])));
    while heard.try_recv().is_ok() {}
    let ads = Management::start(port, snapshots, heard_tx);
    let resubscribed = loop {
        let request = next(&mut heard).await;
        if request.response_nonce.is_empty() {
            break request;
        }
    };
    assert_eq!(resubscribed.version_info, "v2");
    let ack = loop {
        let request = next(&mut heard).await;
        if request.response_nonce == "nonce-v6" {
            break request;
        }
    };
    assert_eq!((ack.version_info.as_str(), ack.error_detail), ("v6", None));
    assert_eq!(limit(&server).await, 13);
    let (_, status) = server.http_get("/v1/envoy-config").await.unwrap();
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(status["status"]["xds"]["version"], "v6");
    assert_eq!(status["status"]["last_error"], serde_json::Value::Null);
    server.stop().await;
    ads.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_management_server_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    common::tls::certificates(dir.path());
    let read = |name: &str| std::fs::read(dir.path().join(name)).unwrap();
    let identity = tonic::transport::Identity::from_pem(read("server.pem"), read("server.key"));
    let (_publish, snapshots) = watch::channel(Some(snapshot("v1", 4, vec![])));
    let (heard_tx, mut heard) = mpsc::unbounded_channel();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let service = AggregatedDiscoveryServiceServer::new(Ads {
        snapshots,
        heard: heard_tx,
    });
    let ads = tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))
            .unwrap()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await;
    });
    let ca = dir.path().join("ca.pem");
    let server = TestServer::launch(None, |c| {
        c.envoy_xds.server = Some(format!("grpcs://localhost:{port}"));
        c.envoy_xds.ca_cert = Some(ca);
    })
    .await;
    assert_eq!(next(&mut heard).await.version_info, "");
    assert_eq!(next(&mut heard).await.version_info, "v1");
    assert_eq!(limit(&server).await, 4);
    server.stop().await;
    ads.abort();
}
