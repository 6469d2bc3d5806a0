//! Bounded connections against the real binary: the connection cap, the idle
//! timeout (which counts requests, not bytes), the process-wide cap on
//! requests in flight, and a stream flood held under the memory bound that
//! `GrpcLimits::worst_case_bytes` states for the flags in use.

use crate::common;

use std::io::Read;
use std::net::TcpStream;
use std::time::Duration;

use common::envoy::sample;
use common::process::ServeProcess;
use tollgate::proto::v1::rate_limiter_client::RateLimiterClient;
use tollgate::proto::v1::{ShouldAllowRequest, StreamDecision};
use tollgate::server::GrpcLimits;
use tonic::Code;

fn request(key: &str) -> ShouldAllowRequest {
    ShouldAllowRequest {
        key: key.into(),
        cost: 1,
        tenant: "t".into(),
        resource: String::new(),
        dry_run: false,
    }
}

async fn client(server: &ServeProcess) -> RateLimiterClient<tonic::transport::Channel> {
    RateLimiterClient::connect(format!("http://{}", server.grpc))
        .await
        .unwrap()
}

/// The value of one series on `/metrics` (0 when absent).
fn metric(server: &ServeProcess, series: &str) -> u64 {
    let text = server.admin_get("/metrics").unwrap();
    sample(&text, series).unwrap_or(0)
}

/// Polls until `series` reads `want` (bounded: a hang becomes a failure
/// naming what never happened).
fn wait_metric(server: &ServeProcess, series: &str, want: u64) {
    for _ in 0..3000 {
        if metric(server, series) == want {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!(
        "{series} never reached {want}; it is {}",
        metric(server, series)
    );
}

/// Reads until the server closes the connection; panics if it does not
/// within a minute (a hang guard, not a timing bound).
fn wait_closed(mut stream: TcpStream) {
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut sink = Vec::new();
    match stream.read_to_end(&mut sink) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("the server never closed the connection: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_connection_busy_one_past_the_cap_is_closed_and_counted_and_the_slot_comes_back()
{
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(
        dir.path(),
        &[
            "--grpc-max-connections",
            "4",
            "--grpc-request-timeout",
            "120s",
        ],
    );
    server.wait_ready();
    // Four connections, two per peer address (each peer's own cap), each
    // holding a stream in flight: none can make room.
    let mut held = Vec::new();
    for source in [2, 2, 3, 3] {
        let flood = flood_connection(server.grpc.clone(), common::peers::loopback(source), 1, 0)
            .await
            .expect("a connection under the cap is served");
        held.push(flood);
    }
    wait_metric(&server, "tollgate_grpc_requests_in_flight", 4);

    wait_closed(common::peers::connect_from(
        common::peers::loopback(4),
        &server.grpc,
    ));
    assert_eq!(
        metric(&server, "tollgate_connections_refused_total{port=\"grpc\"}"),
        1
    );
    assert_eq!(
        metric(&server, "tollgate_connections_evicted_total{port=\"grpc\"}"),
        0
    );
    assert_eq!(
        metric(&server, "tollgate_connections_open{port=\"grpc\"}"),
        4
    );

    drop(held);
    wait_metric(&server, "tollgate_connections_open{port=\"grpc\"}", 0);
    let answer = client(&server)
        .await
        .should_allow(request("k"))
        .await
        .unwrap()
        .into_inner();
    assert!(answer.allowed);
    assert_eq!(
        metric(&server, "tollgate_connections_refused_total{port=\"grpc\"}"),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_close_but_a_connection_holding_a_stream_stays_open() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(dir.path(), &["--idle-timeout", "1s"]);
    server.wait_ready();

    // A stream opened at once and used again after three idle timeouts:
    // the connection carries a request in flight, so it is not idle.
    let mut streaming = client(&server).await;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let mut answers = streaming
        .should_allow_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    tx.send(request("a")).await.unwrap();
    let first: StreamDecision = answers.message().await.unwrap().unwrap();
    assert!(first.decision.unwrap().allowed);

    // Silent connections on both ports close after the timeout.
    wait_closed(TcpStream::connect(&server.grpc).unwrap());
    wait_closed(TcpStream::connect(&server.admin).unwrap());
    assert_eq!(
        metric(
            &server,
            "tollgate_connections_idle_closed_total{port=\"grpc\"}"
        ),
        1
    );
    assert_eq!(
        metric(
            &server,
            "tollgate_connections_idle_closed_total{port=\"admin\"}"
        ),
        1
    );

    tokio::time::sleep(Duration::from_secs(3)).await;
    tx.send(request("a")).await.unwrap();
    let second = answers.message().await.unwrap().unwrap();
    assert_eq!(second.error_code, 0, "{second:?}");
    assert!(second.decision.unwrap().allowed);
    assert_eq!(
        metric(
            &server,
            "tollgate_connections_idle_closed_total{port=\"grpc\"}"
        ),
        1,
        "the busy connection was closed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_in_flight_cap_a_request_is_refused_at_once_with_resource_exhausted() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(dir.path(), &["--grpc-max-requests-in-flight", "2"]);
    server.wait_ready();
    let mut c = client(&server).await;

    // Two open streams hold both slots until they end.
    let mut senders = Vec::new();
    let mut streams = Vec::new();
    for _ in 0..2 {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut answers = c
            .should_allow_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        tx.send(request("s")).await.unwrap();
        assert_eq!(answers.message().await.unwrap().unwrap().error_code, 0);
        senders.push(tx);
        streams.push(answers);
    }
    for _ in 0..3 {
        let status = c.should_allow(request("u")).await.unwrap_err();
        assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
        assert!(
            status.message().contains("--grpc-max-requests-in-flight"),
            "{status:?}"
        );
    }
    assert_eq!(metric(&server, "tollgate_grpc_overload_refusals_total"), 3);

    // Ending one stream frees its slot.
    senders.pop();
    let mut ended = streams.pop().unwrap();
    assert!(ended.message().await.unwrap().is_none());
    let mut answered = None;
    for _ in 0..3000 {
        match c.should_allow(request("u")).await {
            Ok(r) => {
                answered = Some(r.into_inner());
                break;
            }
            Err(status) => {
                assert_eq!(status.code(), Code::ResourceExhausted);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    assert!(answered.expect("a slot came back").allowed);
}

/// User and system CPU time of `pid` so far, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name, which is in parentheses.
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

/// Out of file descriptors, `accept` fails: the port backs off instead of
/// spinning, logs once for the whole burst, counts every failure, and takes
/// connections again once descriptors are free.
#[test]
fn out_of_file_descriptors_the_accept_loop_backs_off_logs_once_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start_under(&["prlimit", "--nofile=64:64"], dir.path(), &[], &[]);
    server.wait_ready();
    let pid = server.child.id();
    // Hold connections until the process has no descriptor left.
    let mut held = Vec::new();
    for _ in 0..80 {
        held.push(TcpStream::connect(&server.grpc).unwrap());
    }
    let mut seen = Vec::new();
    loop {
        let line = server
            .logs
            .recv_timeout(Duration::from_secs(60))
            .expect("accept never failed");
        let failed = line.contains("accepting a connection failed");
        seen.push(line);
        if failed {
            break;
        }
    }
    // While the descriptors stay taken, the loop retries at most once a
    // second: a spinning loop would burn a CPU second per second here.
    let ticks_per_second = 100;
    let before = cpu_ticks(pid);
    std::thread::sleep(Duration::from_secs(3));
    let spent = cpu_ticks(pid) - before;
    assert!(
        spent < ticks_per_second,
        "the process used {spent} ticks of CPU in 3 s while out of descriptors"
    );
    drop(held);
    // Free again: a real call is answered.
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let answer = runtime.block_on(async {
        let mut c = client(&server).await;
        c.should_allow(request("k")).await.unwrap().into_inner()
    });
    assert!(answer.allowed);
    let failures = metric(&server, "tollgate_accept_errors_total{port=\"grpc\"}");
    assert!(failures >= 1);
    let (_, rest) = server.terminate();
    seen.extend(rest);
    // Logged once per burst of failures, not once per failure: a burst's
    // first failure and its recovery, with the count. (While the 80
    // connections are being taken, a descriptor the server frees, such as
    // the readiness probe's, can end a burst early and start another: so
    // bursts are counted, not assumed to be one.)
    // Only the gRPC port's lines: the admin port can run out too (the
    // metrics call below may arrive before the server has closed its side
    // of the 80 dropped connections), and it counts in its own series.
    let grpc: Vec<&String> = seen
        .iter()
        .filter(|l| l.contains("port=\"grpc\""))
        .collect();
    let said = |text: &str| grpc.iter().filter(|l| l.contains(text)).count();
    let bursts = said("accepting a connection failed");
    let recoveries = said("accepting connections again");
    // Every burst ends with its recovery line, except perhaps the last: the
    // server may still be accepting what is left of the 80 connections in
    // its backlog (closed by now, each taking a descriptor a moment) when
    // it is told to stop.
    let open = bursts
        .checked_sub(recoveries)
        .unwrap_or_else(|| panic!("more recoveries than bursts: {seen:#?}"));
    assert!(recoveries >= 1 && open <= 1, "{seen:#?}");
    assert!((1..=3).contains(&bursts), "{seen:#?}");
    let counted: u64 = grpc
        .iter()
        .filter(|l| l.contains("accepting connections again"))
        .filter_map(|l| l.split("failures=").nth(1))
        .map(|n| n.trim().parse::<u64>().unwrap())
        .sum();
    if open == 0 {
        assert_eq!(
            counted, failures,
            "the recovery lines count all {failures} failures: {seen:#?}"
        );
    } else {
        // The open burst's failures are counted, in part or whole, by the
        // metric read before the stop, and by no recovery line.
        assert!(
            counted <= failures,
            "the recovery lines count {counted} of {failures} failures: {seen:#?}"
        );
    }
    assert!(
        failures > 2 * bursts as u64,
        "fewer lines than failures ({failures} failures, {bursts} bursts)"
    );
}

/// The resident set of `pid`, in bytes.
fn rss(pid: u32) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS");
    kb * 1024
}

/// One flooding connection: its streams, held open, and the task driving
/// it (aborted on drop, which closes the socket).
struct Flood {
    streams: Vec<(h2::client::ResponseFuture, h2::SendStream<bytes::Bytes>)>,
    driver: tokio::task::JoinHandle<()>,
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

/// Opens one HTTP/2 connection and as many streams as the server allows,
/// each a ShouldAllow request whose headers are sent and whose body never
/// comes (half of them announce a full-size message first). `None` when
/// the server closed the connection at once.
async fn flood_connection(
    addr: String,
    source: std::net::IpAddr,
    streams: usize,
    announce: u32,
) -> Option<Flood> {
    let tcp = common::peers::connect_async_from(source, &addr)
        .await
        .ok()?;
    let (mut h2, connection) = h2::client::handshake(tcp).await.ok()?;
    let mut flood = Flood {
        streams: Vec::new(),
        driver: tokio::spawn(async move {
            let _ = connection.await;
        }),
    };
    for i in 0..streams {
        let ready = tokio::time::timeout(Duration::from_millis(500), h2.clone().ready()).await;
        let Ok(Ok(mut sender)) = ready else {
            break; // the server's stream cap, or a closed connection
        };
        let request =
            http::Request::post(format!("http://{addr}/tollgate.v1.RateLimiter/ShouldAllow"))
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .body(())
                .unwrap();
        let Ok((response, mut body)) = sender.send_request(request, false) else {
            break;
        };
        if i % 2 == 0 && announce > 0 {
            // A message header announcing `announce` bytes that never come.
            let mut prefix = vec![0u8];
            prefix.extend_from_slice(&announce.to_be_bytes());
            let _ = body.send_data(prefix.into(), false);
        }
        flood.streams.push((response, body));
        h2 = sender;
    }
    (!flood.streams.is_empty()).then_some(flood)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_flood_stays_under_the_stated_memory_bound_and_memory_comes_back() {
    let limits = GrpcLimits {
        max_connections: 20,
        max_concurrent_streams: 64,
        connection_concurrency: 64,
        max_requests_in_flight: 256,
        max_message_bytes: 1024 * 1024,
        ..GrpcLimits::default()
    };
    // The bound, from the figures docs/operations.md states (64 KiB per
    // connection, its 256 KiB window, 16 KiB per stream plus its 16 KiB of
    // headers, a largest message per request in service), not from the
    // code's own formula: a formula whose overheads grew would pass a
    // flood check against itself.
    let per_connection = 64 * 1024 + 256 * 1024 + 64 * (16 * 1024 + 16 * 1024);
    let bound = 20 * per_connection + 256 * 1024 * 1024;
    assert_eq!(
        limits.worst_case_bytes(),
        bound,
        "GrpcLimits::worst_case_bytes"
    );
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(
        dir.path(),
        &[
            "--grpc-max-connections",
            &limits.max_connections.to_string(),
            "--grpc-max-concurrent-streams",
            &limits.max_concurrent_streams.to_string(),
            "--grpc-connection-concurrency",
            &limits.connection_concurrency.to_string(),
            "--grpc-max-requests-in-flight",
            &limits.max_requests_in_flight.to_string(),
            "--grpc-max-message-bytes",
            &limits.max_message_bytes.to_string(),
            "--grpc-request-timeout",
            "60s",
        ],
    );
    server.wait_ready();
    let pid = server.child.id();
    let before = rss(pid);

    // Ten times the connection cap, each asking for sixteen times the
    // stream cap: without the caps this holds over a gigabyte.
    // From four peer addresses, so the per-peer cap (half the port's) is
    // not what bounds them.
    let floods: Vec<_> = (0..200)
        .map(|i| {
            let announce = limits.max_message_bytes as u32;
            let source = common::peers::loopback(2 + (i % 4) as u8);
            tokio::spawn(flood_connection(
                server.grpc.clone(),
                source,
                1024,
                announce,
            ))
        })
        .collect();
    let mut held = Vec::new();
    for flood in floods {
        if let Some(streams) = flood.await.unwrap() {
            held.push(streams);
        }
    }
    let streams_sent: usize = held.iter().map(|f: &Flood| f.streams.len()).sum();
    // Both caps were hit: connections past the twentieth were closed, and
    // requests past the 256th in flight refused.
    assert_eq!(
        metric(&server, "tollgate_connections_open{port=\"grpc\"}"),
        20
    );
    // (A connection accepted and not yet past its first request can be
    // closed to make room for a newer one: counted as evicted.)
    let refused = metric(&server, "tollgate_connections_refused_total{port=\"grpc\"}");
    let evicted = metric(&server, "tollgate_connections_evicted_total{port=\"grpc\"}");
    assert!(
        refused + evicted >= 180,
        "{refused} refused, {evicted} evicted"
    );
    assert!(metric(&server, "tollgate_grpc_overload_refusals_total") > 0);
    let mut peak = 0;
    for _ in 0..20 {
        peak = peak.max(rss(pid));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "RSS before {} KiB, peak during the flood {} KiB (bound {} KiB), {streams_sent} requests opened by the client",
        before / 1024,
        peak / 1024,
        bound / 1024
    );
    assert!(
        peak.saturating_sub(before) <= bound,
        "the flood took {} KiB, over the stated bound of {} KiB",
        peak.saturating_sub(before) / 1024,
        bound / 1024
    );

    // The flood ends: every connection closes, and the server still answers.
    drop(held);
    wait_metric(&server, "tollgate_connections_open{port=\"grpc\"}", 0);
    let answer = client(&server)
        .await
        .should_allow(request("after"))
        .await
        .unwrap()
        .into_inner();
    assert!(answer.allowed);
    // Freed memory goes back to the system as the allocator's threads run
    // again: light traffic from four connections (so every worker thread
    // allocates) until four fifths of the flood's growth are gone
    // (docs/operations.md says about 86 %; what stays is the allocator's
    // retained segments and the tables' grown capacity). The bound on the
    // wait only turns "never" into a failure.
    let clients = clients_on_own_connections(&server, 4).await;
    let grown = peak.saturating_sub(before);
    let kept = grown / 5;
    let mut after = rss(pid);
    for round in 0..300 {
        if after.saturating_sub(before) <= kept {
            break;
        }
        let calls = clients.iter().cloned().map(|mut c| async move {
            for i in 0..20 {
                c.should_allow(request(&format!("r{round}-{i}")))
                    .await
                    .unwrap();
            }
        });
        futures_util::future::join_all(calls).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        after = rss(pid);
    }
    eprintln!(
        "RSS after the flood ended: {} KiB ({} % of the growth returned)",
        after / 1024,
        100 - after.saturating_sub(before) * 100 / grown.max(1)
    );
    assert!(
        after.saturating_sub(before) <= kept,
        "of the {} KiB the flood took, {} KiB were still held after 30 s of traffic",
        grown / 1024,
        after.saturating_sub(before) / 1024
    );
}

/// `n` clients, each on a connection of its own.
async fn clients_on_own_connections(
    server: &ServeProcess,
    n: usize,
) -> Vec<RateLimiterClient<tonic::transport::Channel>> {
    let mut clients = Vec::new();
    for _ in 0..n {
        clients.push(client(server).await);
    }
    clients
}
