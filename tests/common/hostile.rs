//! A hostile peer, as the fairness tests and the soak play it: HTTP/2
//! connections holding decision streams that never send a message, gRPC
//! sockets that never send the HTTP/2 preface, and admin sockets that send
//! nothing or one header line. Every loop ends by itself at its deadline;
//! everything goes to loopback.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::time::Instant;

use super::peers::{connect_async_from, loopback};

/// What one connection of silent streams holds open: the responses, the
/// request bodies (dropping one would end its stream) and the connection's
/// driver task.
pub type SilentStreams = (
    Vec<h2::client::ResponseFuture>,
    Vec<h2::SendStream<bytes::Bytes>>,
    tokio::task::JoinHandle<()>,
);

/// One HTTP/2 connection from 127.0.0.`source` opening `streams`
/// ShouldAllowStream calls with headers only: no message is ever sent.
pub async fn silent_streams(addr: &str, source: u8, streams: usize) -> SilentStreams {
    let tcp = connect_async_from(loopback(source), addr).await.unwrap();
    let (mut h2, connection) = h2::client::handshake(tcp).await.unwrap();
    let driver = tokio::spawn(async move {
        let _ = connection.await;
    });
    let (mut responses, mut bodies) = (Vec::new(), Vec::new());
    for _ in 0..streams {
        let ready = tokio::time::timeout(Duration::from_secs(5), h2.clone().ready()).await;
        let Ok(Ok(mut sender)) = ready else {
            break;
        };
        let request = http::Request::post(format!(
            "http://{addr}/tollgate.v1.RateLimiter/ShouldAllowStream"
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
        let Ok((response, body)) = sender.send_request(request, false) else {
            break;
        };
        responses.push(response);
        bodies.push(body);
        h2 = sender;
    }
    (responses, bodies, driver)
}

/// What a [`hostile_peer`] did.
#[derive(Debug, Default)]
pub struct Attacks {
    /// Silent decision streams opened.
    pub streams: AtomicU64,
    /// gRPC sockets opened that never sent the preface.
    pub silent_grpc: AtomicU64,
    /// Admin sockets opened that sent nothing or one header line.
    pub silent_admin: AtomicU64,
}

/// Attacks the gRPC port `grpc` and the admin port `admin` until
/// `deadline`, in rounds of `hold` each: eight connections of 128 silent
/// decision streams (from 127.0.0.2 and .3, the whole in-flight cap), 256
/// gRPC sockets that never send the preface (from .4) and 64 admin sockets,
/// half silent and half sending one header line (from .5). Each round drops
/// what it held and opens it all again.
pub async fn hostile_peer(
    grpc: String,
    admin: String,
    deadline: Instant,
    hold: Duration,
    attacks: &Attacks,
) {
    while Instant::now() < deadline {
        let mut streams = Vec::new();
        for i in 0..8u8 {
            let held = silent_streams(&grpc, 2 + i % 2, 128).await;
            attacks
                .streams
                .fetch_add(held.0.len() as u64, Ordering::Relaxed);
            streams.push(held);
        }
        let mut sockets = Vec::new();
        for _ in 0..256 {
            if let Ok(s) = connect_async_from(loopback(4), &grpc).await {
                attacks.silent_grpc.fetch_add(1, Ordering::Relaxed);
                sockets.push(s);
            }
        }
        for i in 0..64 {
            if let Ok(mut s) = connect_async_from(loopback(5), &admin).await {
                if i % 2 == 1 {
                    let _ = s.write_all(b"GET /healthz HTTP/1.1\r\n").await;
                }
                attacks.silent_admin.fetch_add(1, Ordering::Relaxed);
                sockets.push(s);
            }
        }
        tokio::time::sleep_until((Instant::now() + hold).min(deadline)).await;
        for (_, _, driver) in streams {
            driver.abort();
        }
    }
}
