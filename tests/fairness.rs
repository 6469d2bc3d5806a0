//! No peer takes the server's capacity from the others, against the real
//! binary: silent and slow sockets on the admin port never keep the health
//! probe out; silent gRPC connections make room and are closed after the
//! handshake deadline; connections holding open, silent decision streams
//! never lock a caller on a fresh connection out, and their streams end
//! after the first-message deadline.

use crate::common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::envoy::sample;
use common::hostile::silent_streams;
use common::peers::{connect_from, loopback};
use common::process::ServeProcess;
use tollgate::proto::v1::ShouldAllowRequest;
use tollgate::proto::v1::rate_limiter_client::RateLimiterClient;

fn request(key: &str) -> ShouldAllowRequest {
    ShouldAllowRequest {
        key: key.into(),
        cost: 1,
        tenant: "t".into(),
        resource: String::new(),
        dry_run: false,
    }
}

fn metric(server: &ServeProcess, series: &str) -> u64 {
    let text = server.admin_get("/metrics").unwrap();
    sample(&text, series).unwrap_or(0)
}

/// Polls until `series` reads at least `want` (bounded: a hang becomes a
/// failure naming what never happened).
fn wait_metric_at_least(server: &ServeProcess, series: &str, want: u64) {
    for _ in 0..6000 {
        if metric(server, series) >= want {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!(
        "{series} never reached {want}; it is {}",
        metric(server, series)
    );
}

/// True once the server has closed `stream` (read returns end of stream or
/// a reset); waits at most `guard`, a hang guard and not a timing bound.
fn closed_within(stream: &mut TcpStream, guard: Duration) -> bool {
    stream.set_read_timeout(Some(guard)).unwrap();
    let mut sink = [0u8; 4096];
    loop {
        match stream.read(&mut sink) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

/// `GET path` on the admin port, from `source`, with a read guard.
fn admin_get_from(server: &ServeProcess, source: u8, path: &str) -> String {
    let mut stream = connect_from(loopback(source), &server.admin);
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
        server.admin
    );
    stream.write_all(request.as_bytes()).unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

#[test]
fn silent_and_slow_admin_connections_never_keep_the_health_probe_out() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(dir.path(), &[]);
    server.wait_ready();
    // Fill the admin port's 64 slots from two attacking peers: half of them
    // send nothing, half send one header line and then nothing.
    let mut attackers = Vec::new();
    for source in [2, 3] {
        for i in 0..32 {
            let mut s = connect_from(loopback(source), &server.admin);
            if i % 2 == 1 {
                s.write_all(b"GET /healthz HTTP/1.1\r\n").unwrap();
            }
            attackers.push(s);
        }
    }
    // A third peer trying for more than its half of the slots only displaces
    // its own connections.
    for _ in 0..40 {
        attackers.push(connect_from(loopback(4), &server.admin));
    }
    // The probe, from the kubelet's address, is answered while every
    // attacking socket is still held open by its peer.
    for _ in 0..5 {
        let answer = admin_get_from(&server, 1, "/healthz");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        let ready = admin_get_from(&server, 1, "/readyz");
        assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
    }
    let evicted = metric(
        &server,
        "tollgate_connections_evicted_total{port=\"admin\"}",
    );
    assert!(evicted >= 8, "{evicted} evicted");
    assert_eq!(
        metric(
            &server,
            "tollgate_connections_refused_total{port=\"admin\"}"
        ),
        0
    );
    // Every attacking socket is closed: displaced, or past the handshake
    // deadline (10 s) without a complete request.
    for s in &mut attackers {
        assert!(closed_within(s, Duration::from_secs(60)));
    }
    let timed_out = metric(
        &server,
        "tollgate_connections_handshake_timeouts_total{port=\"admin\"}",
    );
    let evicted = metric(
        &server,
        "tollgate_connections_evicted_total{port=\"admin\"}",
    );
    assert_eq!(
        timed_out + evicted,
        attackers.len() as u64,
        "{timed_out} timed out, {evicted} evicted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_grpc_connections_make_room_and_close_after_the_handshake_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(dir.path(), &["--grpc-max-connections", "8"]);
    server.wait_ready();
    // Eight sockets from two peers that never send the HTTP/2 preface fill
    // the port.
    let mut silent: Vec<TcpStream> = Vec::new();
    for source in [2, 3] {
        for _ in 0..4 {
            silent.push(connect_from(loopback(source), &server.grpc));
        }
    }
    wait_metric_at_least(&server, "tollgate_connections_open{port=\"grpc\"}", 8);
    // A real client is served at once: the oldest silent socket makes room.
    let mut c = RateLimiterClient::connect(format!("http://{}", server.grpc))
        .await
        .unwrap();
    let answer = c.should_allow(request("k")).await.unwrap().into_inner();
    assert!(answer.allowed);
    assert_eq!(
        metric(&server, "tollgate_connections_evicted_total{port=\"grpc\"}"),
        1
    );
    // The first silent socket was the one displaced.
    assert!(closed_within(&mut silent[0], Duration::from_secs(5)));
    // The rest are closed at the handshake deadline; the served client's
    // connection stays.
    for s in &mut silent[1..] {
        assert!(closed_within(s, Duration::from_secs(60)));
    }
    assert_eq!(
        metric(
            &server,
            "tollgate_connections_handshake_timeouts_total{port=\"grpc\"}"
        ),
        7
    );
    let again = c.should_allow(request("k")).await.unwrap().into_inner();
    assert!(again.allowed);
}

/// The grpc-status a response ends with (headers or trailers).
async fn grpc_status(response: h2::client::ResponseFuture) -> Option<String> {
    let response = response.await.ok()?;
    if let Some(s) = response.headers().get("grpc-status") {
        return Some(s.to_str().unwrap().to_owned());
    }
    let mut body = response.into_body();
    while let Some(chunk) = body.data().await {
        chunk.ok()?;
    }
    let trailers = body.trailers().await.ok()??;
    Some(trailers.get("grpc-status")?.to_str().unwrap().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_decision_streams_never_lock_out_a_fresh_connection_and_end_at_their_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(dir.path(), &["--grpc-request-timeout", "5s"]);
    server.wait_ready();
    // Eight connections, each opening 128 streams that send nothing: as
    // many as the whole in-flight cap (1 024).
    let mut attack = Vec::new();
    for i in 0..8u64 {
        attack.push(silent_streams(&server.grpc, 2 + (i % 2) as u8, 128).await);
        // Each connection's streams admitted or refused before the next.
        let decided = || {
            metric(&server, "tollgate_grpc_requests_in_flight")
                + metric(&server, "tollgate_grpc_overload_refusals_total")
        };
        for _ in 0..6000 {
            if decided() == 128 * (i + 1) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(decided(), 128 * (i + 1));
    }
    // Seven connections took 896 slots (all but the last eighth, kept for
    // connections holding at most four requests); the eighth took four more
    // and its fifth from the reserve, and was refused the rest.
    let held = metric(&server, "tollgate_grpc_requests_in_flight");
    assert_eq!(held, 7 * 128 + 5, "{held} held");
    // A caller on a fresh connection is served while they hold them.
    let mut c = RateLimiterClient::connect(format!("http://{}", server.grpc))
        .await
        .unwrap();
    for i in 0..20 {
        let answer = c
            .should_allow(request(&format!("fresh-{i}")))
            .await
            .expect("a fresh connection is served")
            .into_inner();
        assert!(answer.allowed);
    }
    // The silent streams end with DEADLINE_EXCEEDED (4) once the first
    // message deadline (--grpc-request-timeout) passes; those refused at
    // the cap ended with RESOURCE_EXHAUSTED (8) at once.
    let mut codes = std::collections::BTreeMap::new();
    let mut keep = Vec::new();
    for (responses, bodies, driver) in attack {
        for r in responses {
            let code = grpc_status(r).await.unwrap_or_else(|| "none".into());
            *codes.entry(code).or_insert(0) += 1;
        }
        keep.push((bodies, driver));
    }
    assert_eq!(
        codes,
        [("4".to_owned(), 7 * 128 + 5), ("8".to_owned(), 128 - 5)]
            .into_iter()
            .collect(),
    );
    assert_eq!(metric(&server, "tollgate_grpc_requests_in_flight"), 0);
    for (_, driver) in keep {
        driver.abort();
    }
}
