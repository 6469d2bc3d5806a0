//! The Envoy configuration from an xDS management server, as Envoy Gateway
//! programs envoyproxy/ratelimit: `RateLimitConfig` resources over the
//! aggregated discovery service, state of the world.
//!
//! The client subscribes to every resource of [`TYPE_URL`] (a wildcard
//! subscription). Each response is a whole snapshot: its resources, made
//! into the YAML documents they stand for, load with the files'
//! validation and semantics ([`EnvoyConfig::load_documents`]). A valid
//! snapshot replaces the configuration in force and is ACKed with its
//! version; an invalid one is NACKed with the error in `error_detail`, and
//! the last good configuration stays. A lost stream is reconnected with
//! backoff, sending the version in force.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use tokio::sync::mpsc;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
use yaml_rust2::Yaml;
use yaml_rust2::yaml::Hash;

use super::{EnvoyConfig, LiveEnvoyConfig};
use crate::proto::envoy::config::core::v3::Node;
use crate::proto::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use crate::proto::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use crate::proto::google::rpc::Status as RpcStatus;
use crate::proto::ratelimit::config::ratelimit::v3::{RateLimitConfig, RateLimitDescriptor};

/// The resource type Tollgate subscribes to.
pub const TYPE_URL: &str = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";

/// The most descriptors one snapshot may hold, nested ones included.
pub const MAX_DESCRIPTORS: usize = 50_000;

/// The first wait before reconnecting, doubled after each failed attempt.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// The longest wait before reconnecting.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// `google.rpc.Code.INVALID_ARGUMENT`.
const INVALID_ARGUMENT: i32 = 3;

/// Where the Envoy configuration comes from when it is not files.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct XdsOptions {
    /// An xDS management server to take the Envoy configuration from
    /// (RateLimitConfig resources over ADS, state of the world, as Envoy
    /// Gateway serves them) instead of --envoy-config: grpc://HOST:PORT, or
    /// grpcs://HOST:PORT for TLS.
    #[arg(id = "envoy_xds", long = "envoy-xds", env = "TOLLGATE_ENVOY_XDS")]
    pub server: Option<String>,
    /// The node id this instance gives the management server.
    #[arg(
        id = "envoy_xds_node_id",
        long = "envoy-xds-node-id",
        env = "TOLLGATE_ENVOY_XDS_NODE_ID",
        default_value = "tollgate"
    )]
    pub node_id: String,
    /// The node cluster this instance gives the management server.
    #[arg(
        id = "envoy_xds_node_cluster",
        long = "envoy-xds-node-cluster",
        env = "TOLLGATE_ENVOY_XDS_NODE_CLUSTER",
        default_value = "tollgate"
    )]
    pub node_cluster: String,
    /// PEM file of the CA that signed the management server's certificate
    /// (grpcs://; unset: the web's roots).
    #[arg(
        id = "envoy_xds_ca_cert",
        long = "envoy-xds-ca-cert",
        env = "TOLLGATE_ENVOY_XDS_CA_CERT"
    )]
    pub ca_cert: Option<PathBuf>,
    /// The largest response accepted from the management server; a larger
    /// snapshot is refused and the configuration in force stays.
    #[arg(
        id = "envoy_xds_max_message_bytes",
        long = "envoy-xds-max-message-bytes",
        env = "TOLLGATE_ENVOY_XDS_MAX_MESSAGE_BYTES",
        default_value_t = 16 << 20
    )]
    pub max_message_bytes: usize,
}

impl Default for XdsOptions {
    fn default() -> Self {
        crate::options::defaults()
    }
}

/// An `--envoy-xds` address that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("--envoy-xds {0}")]
pub struct XdsAddressError(String);

/// The endpoint to dial: the address checked, TLS set up for grpcs://.
pub fn endpoint(options: &XdsOptions, server: &str) -> Result<Endpoint, XdsAddressError> {
    let bad = |why: &str| XdsAddressError(format!("{server:?}: {why}"));
    let (tls, rest) = if let Some(rest) = server.strip_prefix("grpcs://") {
        (true, rest)
    } else if let Some(rest) = server.strip_prefix("grpc://") {
        (false, rest)
    } else {
        return Err(bad("give grpc://HOST:PORT or grpcs://HOST:PORT"));
    };
    if rest.is_empty() || rest.contains('/') {
        return Err(bad(
            "give grpc://HOST:PORT or grpcs://HOST:PORT, with no path",
        ));
    }
    let scheme = if tls { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{rest}"))
        .map_err(|e| bad(&e.to_string()))?
        .connect_timeout(Duration::from_secs(5))
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(10));
    if tls {
        let mut config = ClientTlsConfig::new().with_webpki_roots();
        if let Some(path) = &options.ca_cert {
            let pem = std::fs::read(path)
                .map_err(|e| bad(&format!("cannot read {}: {e}", path.display())))?;
            config = config.ca_certificate(Certificate::from_pem(pem));
        }
        endpoint = endpoint
            .tls_config(config)
            .map_err(|e| bad(&e.to_string()))?;
    } else if options.ca_cert.is_some() {
        return Err(bad("--envoy-xds-ca-cert is for grpcs:// addresses"));
    }
    Ok(endpoint)
}

/// Follows the management server until `shutdown` completes.
pub async fn follow(
    config: Arc<LiveEnvoyConfig>,
    options: XdsOptions,
    endpoint: Endpoint,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let mut backoff = FIRST_BACKOFF;
    let jitter = std::collections::hash_map::RandomState::new();
    for attempt in 0u64.. {
        let session = session(&config, &options, &endpoint);
        let outcome = tokio::select! {
            _ = &mut shutdown => return,
            outcome = session => outcome,
        };
        let (heard, why) = match outcome {
            Ok(heard) => (heard, "the management server ended the stream".to_owned()),
            Err((heard, e)) => (heard, e),
        };
        config.xds_disconnected(&why);
        if heard {
            backoff = FIRST_BACKOFF;
        }
        // Up to a quarter more, so that instances a restart disconnected
        // together do not reconnect together.
        use std::hash::BuildHasher;
        let spread = backoff.as_millis() as u64 / 4 + 1;
        let wait = backoff + Duration::from_millis(jitter.hash_one(attempt) % spread);
        tracing::warn!(error = %why, retry_in = ?wait, "envoy xds stream lost; reconnecting");
        tokio::select! {
            _ = &mut shutdown => return,
            _ = tokio::time::sleep(wait) => {}
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One stream: subscribes, then applies and answers each response until
/// the stream ends. Returns whether a response was heard.
async fn session(
    config: &LiveEnvoyConfig,
    options: &XdsOptions,
    endpoint: &Endpoint,
) -> Result<bool, (bool, String)> {
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| (false, format!("cannot connect: {}", source_chain(&e))))?;
    let mut client = AggregatedDiscoveryServiceClient::new(channel)
        .max_decoding_message_size(options.max_message_bytes);
    let (tx, rx) = mpsc::channel(4);
    let node = Node {
        id: options.node_id.clone(),
        cluster: options.node_cluster.clone(),
        user_agent_name: "tollgate".into(),
    };
    let subscribe = DiscoveryRequest {
        version_info: config.xds_version(),
        node: Some(node),
        resource_names: Vec::new(),
        type_url: TYPE_URL.into(),
        response_nonce: String::new(),
        error_detail: None,
    };
    tx.send(subscribe)
        .await
        .map_err(|_| (false, "the request stream closed".to_owned()))?;
    let mut responses = client
        .stream_aggregated_resources(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .map_err(|e| (false, describe(&e, options)))?
        .into_inner();
    config.xds_connected();
    let mut heard = false;
    loop {
        let response = match responses.message().await {
            Ok(Some(response)) => response,
            Ok(None) => return Ok(heard),
            Err(e) => {
                let why = describe(&e, options);
                // A response that could not be read is a snapshot refused.
                config.xds_rejected(&why);
                return Err((heard, why));
            }
        };
        heard = true;
        let answer = apply(config, &response);
        if tx.send(answer).await.is_err() {
            return Err((heard, "the request stream closed".to_owned()));
        }
    }
}

/// Applies one response and makes its ACK, or its NACK.
fn apply(config: &LiveEnvoyConfig, response: &DiscoveryResponse) -> DiscoveryRequest {
    let answer = |version_info: String, error_detail: Option<RpcStatus>| DiscoveryRequest {
        version_info,
        node: None,
        resource_names: Vec::new(),
        type_url: TYPE_URL.into(),
        response_nonce: response.nonce.clone(),
        error_detail,
    };
    match snapshot(response) {
        Ok(loaded) => {
            config.install_xds(loaded, &response.version_info);
            answer(response.version_info.clone(), None)
        }
        Err(message) => {
            config.xds_rejected(&message);
            answer(
                config.xds_version(),
                Some(RpcStatus {
                    code: INVALID_ARGUMENT,
                    message,
                    details: Vec::new(),
                }),
            )
        }
    }
}

/// A response's resources as a configuration, or why they are not one.
pub fn snapshot(response: &DiscoveryResponse) -> Result<EnvoyConfig, String> {
    if response.type_url != TYPE_URL {
        return Err(format!(
            "the response is of type {:?}; this client subscribes to {TYPE_URL} only",
            response.type_url
        ));
    }
    let mut documents = Vec::with_capacity(response.resources.len());
    let mut descriptors = 0;
    for (i, any) in response.resources.iter().enumerate() {
        if any.type_url != TYPE_URL {
            return Err(format!(
                "resources[{i}] is of type {:?}, not {TYPE_URL}",
                any.type_url
            ));
        }
        let resource = RateLimitConfig::decode(any.value.as_slice())
            .map_err(|e| format!("resources[{i}] is not a RateLimitConfig: {e}"))?;
        descriptors += count(&resource.descriptors);
        if descriptors > MAX_DESCRIPTORS {
            return Err(format!(
                "the snapshot holds more than {MAX_DESCRIPTORS} descriptors (nested ones \
                 included); split the rate limits over fewer descriptors"
            ));
        }
        let name = if resource.name.is_empty() {
            format!("xds:resources[{i}]")
        } else {
            format!("xds:{}", resource.name)
        };
        let document = document(&resource).map_err(|message| format!("{name}: {message}"))?;
        documents.push((name, document));
    }
    EnvoyConfig::load_documents(&documents).map_err(|e| e.to_string())
}

fn count(descriptors: &[RateLimitDescriptor]) -> usize {
    descriptors.iter().map(|d| 1 + count(&d.descriptors)).sum()
}

/// A resource as the YAML file it stands for.
fn document(resource: &RateLimitConfig) -> Result<Yaml, String> {
    let mut root = Hash::new();
    root.insert(text("domain"), text(&resource.domain));
    root.insert(text("descriptors"), descriptor_list(&resource.descriptors)?);
    Ok(Yaml::Hash(root))
}

fn descriptor_list(descriptors: &[RateLimitDescriptor]) -> Result<Yaml, String> {
    descriptors
        .iter()
        .map(descriptor)
        .collect::<Result<Vec<_>, _>>()
        .map(Yaml::Array)
}

fn descriptor(d: &RateLimitDescriptor) -> Result<Yaml, String> {
    if d.quota_mode {
        return Err(format!(
            "descriptor {:?} sets quota_mode, which Tollgate does not support; use a rule of \
             algorithm quota in a file instead",
            d.key
        ));
    }
    let mut item = Hash::new();
    item.insert(text("key"), text(&d.key));
    if !d.value.is_empty() {
        item.insert(text("value"), text(&d.value));
    }
    if d.shadow_mode {
        item.insert(text("shadow_mode"), Yaml::Boolean(true));
    }
    if d.detailed_metric {
        item.insert(text("detailed_metric"), Yaml::Boolean(true));
    }
    if let Some(policy) = &d.rate_limit {
        let mut rule = Hash::new();
        // UNKNOWN (0) is no unit at all: as a file without `unit`.
        let unit = match policy.unit {
            0 => None,
            1 => Some("second".to_owned()),
            2 => Some("minute".to_owned()),
            3 => Some("hour".to_owned()),
            4 => Some("day".to_owned()),
            5 => Some("month".to_owned()),
            6 => Some("year".to_owned()),
            7 => Some("week".to_owned()),
            other => Some(other.to_string()),
        };
        if let Some(unit) = unit {
            rule.insert(text("unit"), text(&unit));
        }
        rule.insert(
            text("requests_per_unit"),
            Yaml::Integer(i64::from(policy.requests_per_unit)),
        );
        if policy.unlimited {
            rule.insert(text("unlimited"), Yaml::Boolean(true));
        }
        if !policy.name.is_empty() {
            rule.insert(text("name"), text(&policy.name));
        }
        if !policy.replaces.is_empty() {
            let replaces = policy
                .replaces
                .iter()
                .map(|r| {
                    let mut one = Hash::new();
                    one.insert(text("name"), text(&r.name));
                    Yaml::Hash(one)
                })
                .collect();
            rule.insert(text("replaces"), Yaml::Array(replaces));
        }
        item.insert(text("rate_limit"), Yaml::Hash(rule));
    }
    if !d.descriptors.is_empty() {
        item.insert(text("descriptors"), descriptor_list(&d.descriptors)?);
    }
    Ok(Yaml::Hash(item))
}

fn text(s: &str) -> Yaml {
    Yaml::String(s.to_owned())
}

/// A gRPC error from the management server, with what to do about a
/// response over the size cap.
fn describe(status: &tonic::Status, options: &XdsOptions) -> String {
    let message = status.message();
    if status.code() == tonic::Code::OutOfRange || message.contains("message length too large") {
        return format!(
            "the management server sent a response larger than {} bytes \
             (--envoy-xds-max-message-bytes); it was not applied: {message}",
            options.max_message_bytes
        );
    }
    format!("{:?}: {message}", status.code())
}

/// An error with its causes, `a: b: c`.
fn source_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        next = cause.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::ratelimit::config::ratelimit::v3::RateLimitPolicy;

    fn response(resources: Vec<RateLimitConfig>) -> DiscoveryResponse {
        DiscoveryResponse {
            version_info: "v1".into(),
            resources: resources
                .iter()
                .map(|r| prost_types::Any {
                    type_url: TYPE_URL.into(),
                    value: r.encode_to_vec(),
                })
                .collect(),
            canary: false,
            type_url: TYPE_URL.into(),
            nonce: "n1".into(),
        }
    }

    fn limited(key: &str, unit: i32, n: u32) -> RateLimitDescriptor {
        RateLimitDescriptor {
            key: key.into(),
            rate_limit: Some(RateLimitPolicy {
                unit,
                requests_per_unit: n,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn snapshots_load_like_files_and_refuse_what_files_refuse() {
        let good = RateLimitConfig {
            name: "edge".into(),
            domain: "edge".into(),
            descriptors: vec![limited("ip", 2, 3), limited("user", 7, 10)],
        };
        let config = snapshot(&response(vec![good.clone()])).unwrap();
        assert_eq!((config.domains(), config.rules()), (1, 2));
        let found = config.find("edge", &[("ip", "1.2.3.4")]).unwrap();
        assert_eq!(found.counter, "ip_1.2.3.4");
        assert_eq!(found.rule.requests_per_unit, 3);

        let cases = [
            (
                vec![RateLimitConfig {
                    descriptors: vec![limited("ip", 0, 3)],
                    ..good.clone()
                }],
                "xds:edge: invalid rate limit unit ''",
            ),
            (
                vec![RateLimitConfig {
                    descriptors: vec![limited("ip", 99, 3)],
                    ..good.clone()
                }],
                "xds:edge: invalid rate limit unit '99'",
            ),
            (
                vec![good.clone(), good.clone()],
                "xds:edge: duplicate domain 'edge' in config file",
            ),
            (
                vec![RateLimitConfig {
                    descriptors: vec![limited("ip", 1, 1), limited("ip", 1, 2)],
                    ..good.clone()
                }],
                "xds:edge: duplicate descriptor composite key 'edge.ip'",
            ),
            (
                vec![RateLimitConfig {
                    descriptors: vec![RateLimitDescriptor {
                        quota_mode: true,
                        ..limited("ip", 1, 1)
                    }],
                    ..good.clone()
                }],
                "xds:edge: descriptor \"ip\" sets quota_mode, which Tollgate does not support; \
                 use a rule of algorithm quota in a file instead",
            ),
        ];
        for (resources, expected) in cases {
            assert_eq!(snapshot(&response(resources)).unwrap_err(), expected);
        }
        let mut wrong = response(vec![good]);
        wrong.resources[0].type_url = "type.googleapis.com/envoy.config.cluster.v3.Cluster".into();
        assert!(
            snapshot(&wrong)
                .unwrap_err()
                .starts_with("resources[0] is of type \"type.googleapis.com/envoy.config.cluster")
        );
        wrong.resources[0].type_url = TYPE_URL.into();
        wrong.resources[0].value = vec![0xff, 0xff];
        assert!(
            snapshot(&wrong)
                .unwrap_err()
                .starts_with("resources[0] is not a RateLimitConfig")
        );
    }

    #[test]
    fn addresses_are_checked() {
        let options = XdsOptions::default();
        assert!(endpoint(&options, "grpc://127.0.0.1:18000").is_ok());
        for bad in [
            "127.0.0.1:18000",
            "http://x:1",
            "grpc://",
            "grpc://x:1/path",
        ] {
            let err = endpoint(&options, bad).unwrap_err().to_string();
            assert!(
                err.starts_with(&format!("--envoy-xds {bad:?}: give grpc://")),
                "{err}"
            );
        }
    }
}
