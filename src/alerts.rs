//! Quota alert delivery: webhooks from the `quota_alerts` outbox.
//!
//! The usage ledger records each alert threshold a quota counter reaches
//! in the limits database, once per counter, period and threshold
//! (`tollgate_engine::ledger`). Every instance runs a [`Notifier`] over
//! that outbox: it claims due alerts for a lease (so instances sharing the
//! database do not send one alert at once), POSTs each as JSON to the
//! configured webhook, signed with HMAC-SHA256 over the body, and marks it
//! delivered on a 2xx answer. A failure (an error status, a refused or hung
//! connection, cut off by a timeout) schedules the next try with
//! exponential backoff, capped; the alert stays in the outbox, visible in
//! `tollgate alerts list` and on the status page, until a try succeeds.
//! Work per pass is bounded (a page of alerts, a bounded number of
//! requests at once, each with its timeout), so an outbox of a million
//! alerts costs what a page costs, and one slow receiver holds up only its
//! own requests' slots for their timeout.
//!
//! An instance that dies holding a claim leaves the alert to the next
//! claim once its lease runs out: delivered again, possibly twice across
//! such a crash, with the same `Idempotency-Key` so a receiver can drop
//! the repeat.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::algorithm::Micros;
use crate::algorithm::calendar::rfc3339;
use crate::clock::Clock;
use crate::limits::table::{AlertRow, LimitsTable};
use crate::telemetry::metrics;

/// The header carrying the body's signature: `sha256=` and 64 hex digits
/// of HMAC-SHA256 over the body with the configured secret.
pub const SIGNATURE_HEADER: &str = "tollgate-signature";
/// The header carrying the alert's idempotency key.
pub const IDEMPOTENCY_HEADER: &str = "idempotency-key";

/// Where and how alerts are delivered.
#[derive(Debug, Clone)]
pub struct AlertOptions {
    /// The webhook: `http://host[:port]/path` or `https://…`.
    pub url: http::Uri,
    /// The HMAC-SHA256 key; `None` sends alerts unsigned.
    pub secret: Option<String>,
    /// Longest wait for one delivery: connect, send, answer.
    pub timeout: Duration,
    /// Longest wait between two tries of one alert (backoff doubles from
    /// a second up to it).
    pub retry_max: Duration,
    /// Most deliveries in flight at once.
    pub concurrency: usize,
    /// Alerts claimed per pass.
    pub page: usize,
}

impl AlertOptions {
    /// Delivery to `url` with the defaults: 5 s timeout, retries backing
    /// off to at most 5 minutes apart, 16 requests at once.
    pub fn new(url: http::Uri, secret: Option<String>) -> Self {
        Self {
            url,
            secret,
            timeout: Duration::from_secs(5),
            retry_max: Duration::from_secs(300),
            concurrency: 16,
            page: 64,
        }
    }
}

/// Checks a webhook URL: `http` or `https`, with a host.
pub fn parse_url(s: &str) -> Result<http::Uri, String> {
    let uri: http::Uri = s
        .parse()
        .map_err(|e| format!("alert webhook {s:?} is not a URL: {e}"))?;
    match uri.scheme_str() {
        Some("http" | "https") if uri.host().is_some() => Ok(uri),
        _ => Err(format!(
            "alert webhook {s:?} must be an http:// or https:// URL with a host"
        )),
    }
}

/// The JSON body of an alert's webhook.
pub fn body(alert: &AlertRow) -> String {
    serde_json::json!({
        "id": alert.id,
        "tenant": alert.tenant,
        "scope": alert.scope,
        "resource": alert.resource,
        "key": alert.key,
        "rule": alert.rule,
        "threshold": alert.threshold,
        "used": alert.used,
        "limit": alert.quota,
        "period_start": rfc3339(alert.start),
        "period_end": rfc3339(alert.end),
        "detected_at": rfc3339(alert.detected_at),
    })
    .to_string()
}

/// `sha256=` and the hex HMAC-SHA256 of `body` under `secret`.
pub fn signature(secret: &str, body: &[u8]) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret.as_bytes());
    let tag = ring::hmac::sign(&key, body);
    let hex: String = tag.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256={hex}")
}

/// The wait before try `attempts + 1` of an alert whose `attempts` failed:
/// 1 s, 2 s, 4 s … up to `max`, less up to a fifth at random so instances
/// retrying together spread out.
pub fn backoff(attempts: u64, max: Duration) -> Duration {
    let doubled = Duration::from_secs(1u64 << attempts.saturating_sub(1).min(20));
    let wait = doubled.min(max);
    let spread = getrandom::u64().unwrap_or(0) % 1000;
    wait - wait.mul_f64(spread as f64 / 5000.0)
}

/// Delivers the outbox's alerts, on every instance.
pub struct Notifier {
    table: LimitsTable,
    options: AlertOptions,
    clock: Arc<dyn Clock>,
    tls: tokio_rustls::TlsConnector,
}

impl Notifier {
    /// A notifier over `table`'s outbox; `clock` schedules retries.
    pub fn new(table: LimitsTable, options: AlertOptions, clock: Arc<dyn Clock>) -> Self {
        let roots = rustls::RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        };
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map(|b| b.with_root_certificates(roots).with_no_client_auth());
        let config = config.unwrap_or_else(|_| {
            rustls::ClientConfig::builder()
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth()
        });
        Self {
            table,
            options,
            clock,
            tls: tokio_rustls::TlsConnector::from(Arc::new(config)),
        }
    }

    /// One pass: claims a page of due alerts and tries each. Returns how
    /// many were delivered.
    pub async fn pass(&self) -> Result<usize, crate::limits::table::TableError> {
        let now = self.clock.now();
        // Long enough for the whole page: its tries run `concurrency` at a
        // time, each for at most the timeout, and the marks follow. An
        // alert whose lease ran out while it was being sent would be sent
        // again by another instance.
        let rounds = self.options.page.div_ceil(self.options.concurrency.max(1)) as u32;
        let lease = (self.options.timeout * rounds + Duration::from_secs(10)).as_micros() as Micros;
        let claimed_at = now;
        let claimed = self
            .table
            .claim_alerts(now, lease, self.options.page)
            .await?;
        let tries = futures_util::stream::iter(claimed)
            .map(|alert| async move {
                let result = self.deliver(&alert).await;
                (alert, result)
            })
            .buffer_unordered(self.options.concurrency.max(1));
        let results: Vec<_> = tries.collect().await;
        let now = self.clock.now();
        let mut delivered = Vec::new();
        let mut failed = Vec::new();
        for (alert, result) in &results {
            match result {
                Ok(()) => {
                    metrics::quota_alert(alert.threshold, "delivered");
                    delivered.push(alert.id.as_str());
                }
                Err(why) => {
                    let wait = backoff(alert.attempts, self.options.retry_max);
                    metrics::quota_alert(alert.threshold, "failed");
                    let next = now + wait.as_micros() as Micros;
                    failed.push((alert.id.as_str(), next, why.as_str()));
                }
            }
        }
        // One line per pass, not per alert: a receiver down for an hour
        // must not flood the log.
        if let Some((id, _, why)) = failed.first() {
            tracing::warn!(
                failed = failed.len(),
                delivered = delivered.len(),
                first = id,
                "quota alerts not delivered, retried with backoff: {why}"
            );
        }
        for (alert, result) in &results {
            if result.is_ok() {
                tracing::info!(
                    id = alert.id,
                    tenant = alert.tenant,
                    threshold = alert.threshold,
                    "quota alert delivered"
                );
            }
        }
        // What was delivered must be marked, or it is sent again: a busy
        // database is waited for, up to the lease's end.
        let mut wait = Duration::from_millis(100);
        loop {
            match self.table.settle_alerts(now, &delivered, &failed).await {
                Ok(()) => return Ok(delivered.len()),
                Err(e) if self.clock.now() + (wait.as_micros() as Micros) < claimed_at + lease => {
                    metrics::ledger_error("alerts");
                    tracing::warn!(error = %e, "delivered quota alerts not marked yet; retrying");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(2));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// POSTs one alert; `Err` says why it did not land.
    async fn deliver(&self, alert: &AlertRow) -> Result<(), String> {
        let body = body(alert);
        match tokio::time::timeout(self.options.timeout, self.post(alert, body)).await {
            Ok(result) => result,
            Err(_) => Err(format!(
                "no answer within {:?} (--alert-timeout)",
                self.options.timeout
            )),
        }
    }

    async fn post(&self, alert: &AlertRow, body: String) -> Result<(), String> {
        let url = &self.options.url;
        let https = url.scheme_str() == Some("https");
        let host = url.host().unwrap_or_default();
        let port = url.port_u16().unwrap_or(if https { 443 } else { 80 });
        let tcp = TcpStream::connect((host, port))
            .await
            .map_err(|e| format!("connecting to {host}:{port}: {e}"))?;
        let _ = tcp.set_nodelay(true);
        let mut request = http::Request::post(url.path_and_query().map_or("/", |p| p.as_str()))
            .header(
                http::header::HOST,
                url.authority().map_or(host, |a| a.as_str()),
            )
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(
                http::header::USER_AGENT,
                concat!("tollgate/", env!("CARGO_PKG_VERSION")),
            )
            .header(IDEMPOTENCY_HEADER, alert.id.as_str());
        if let Some(secret) = &self.options.secret {
            request = request.header(SIGNATURE_HEADER, signature(secret, body.as_bytes()));
        }
        let request = request
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| format!("building the request: {e}"))?;
        let status = if https {
            let name = rustls::pki_types::ServerName::try_from(host.to_owned())
                .map_err(|e| format!("{host} is not a TLS server name: {e}"))?;
            let tls = self
                .tls
                .connect(name, tcp)
                .await
                .map_err(|e| format!("TLS with {host}: {e}"))?;
            send(TokioIo::new(tls), request).await?
        } else {
            send(TokioIo::new(tcp), request).await?
        };
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("the webhook answered {status}"))
        }
    }

    /// Runs passes until `stop`: at once when the last pass had a full
    /// page, else every second; the pending gauge every ten seconds.
    pub fn spawn(
        self: Arc<Self>,
        stop: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            tokio::pin!(stop);
            let mut counted = tokio::time::Instant::now() - Duration::from_secs(10);
            loop {
                let busy = match self.pass().await {
                    Ok(n) => n >= self.options.page,
                    Err(e) => {
                        metrics::ledger_error("alerts");
                        tracing::warn!(error = %e, "quota alerts not read from the outbox; retrying");
                        false
                    }
                };
                if counted.elapsed() >= Duration::from_secs(10) {
                    if let Ok(pending) = self.table.pending_alerts().await {
                        metrics::quota_alerts_pending(pending);
                    }
                    counted = tokio::time::Instant::now();
                }
                let pause = if busy {
                    Duration::ZERO
                } else {
                    Duration::from_secs(1)
                };
                tokio::select! {
                    () = &mut stop => return,
                    () = tokio::time::sleep(pause) => {}
                }
            }
        })
    }
}

/// Sends `request` over one HTTP/1.1 connection and returns the status.
async fn send<T>(
    io: TokioIo<T>,
    request: http::Request<Full<Bytes>>,
) -> Result<http::StatusCode, String>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| format!("HTTP handshake: {e}"))?;
    let driver = tokio::spawn(connection);
    let answer = sender.send_request(request).await;
    driver.abort();
    answer
        .map(|r| r.status())
        .map_err(|e| format!("sending: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_hmac_sha256_over_the_body() {
        // RFC 4231, test case 2.
        assert_eq!(
            signature("Jefe", b"what do ya want for nothing?"),
            "sha256=5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn backoff_doubles_to_its_cap_and_spreads_by_at_most_a_fifth() {
        let max = Duration::from_secs(300);
        for (attempts, full) in [(1, 1), (2, 2), (3, 4), (9, 256), (10, 300), (60, 300)] {
            let wait = backoff(attempts, max);
            let full = Duration::from_secs(full);
            assert!(
                wait <= full && wait >= full.mul_f64(0.8),
                "{attempts}: {wait:?}"
            );
        }
    }

    #[test]
    fn only_http_and_https_urls_with_a_host_are_webhooks() {
        assert!(parse_url("http://127.0.0.1:9000/hook").is_ok());
        assert!(parse_url("https://billing.example.com/tollgate").is_ok());
        for bad in ["ftp://x/y", "/relative", "not a url", "http:///nohost"] {
            let err = parse_url(bad).unwrap_err();
            assert!(err.contains("alert webhook"), "{bad}: {err}");
        }
    }
}
