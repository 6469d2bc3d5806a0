//! SIGTERM always ends the process: connections that stay open (an idle
//! TCP connection that never spoke HTTP/2, a request half sent, an idle
//! admin connection) are closed once `--shutdown-grace` has passed.

use crate::common;

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use common::process::ServeProcess;

#[test]
fn sigterm_exits_after_the_grace_period_whatever_connections_stay_open() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(dir.path(), &["--shutdown-grace", "1s"]);
    server.wait_ready();
    // An idle connection on each port, and a gRPC request whose body never
    // comes: the HTTP/2 preface, settings and the start of a HEADERS frame.
    let _idle_grpc = TcpStream::connect(&server.grpc).unwrap();
    let _idle_admin = TcpStream::connect(&server.admin).unwrap();
    let mut half_sent = TcpStream::connect(&server.grpc).unwrap();
    half_sent
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00\x00\x00\x40\x01\x04")
        .unwrap();
    let mut admin_half = TcpStream::connect(&server.admin).unwrap();
    admin_half
        .write_all(b"GET /v1/limits HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));

    let pid = server.child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    let signalled = tokio::time::Instant::now();
    std::thread::spawn(move || {
        let _ = tx.send(server.terminate());
    });
    // Without the grace period this never returns; the bound only turns a
    // hang into a failure with a message.
    let (status, logs) = rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("tollgate (pid {pid}) did not exit after SIGTERM"));
    // The open connections held it for the whole grace period (a slow
    // machine only makes this longer): it waited, then closed them.
    let waited = signalled.elapsed();
    assert!(
        waited >= Duration::from_secs(1),
        "exited {waited:?} after SIGTERM, before the 1 s grace period"
    );
    assert!(status.success(), "{status:?}: {logs:#?}");
    assert!(
        logs.iter()
            .any(|l| l.contains("still open after the shutdown grace period; closing them")),
        "{logs:#?}"
    );
    drop((half_sent, admin_half));
}

/// SIGTERM lets a call in flight finish with its real answer, and refuses
/// calls that come after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_calls_in_flight_and_refuses_new_ones() {
    use tollgate::proto::v1::rate_limiter_client::RateLimiterClient;
    use tollgate::proto::v1::{Degraded, ShouldAllowRequest};
    let request = |key: &str| ShouldAllowRequest {
        key: key.into(),
        cost: 1,
        tenant: "t".into(),
        resource: String::new(),
        dry_run: false,
    };
    let redis = common::redis::RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(
        dir.path(),
        &[
            "--store",
            &redis.url(),
            "--store-timeout",
            "30s",
            "--shutdown-grace",
            "30s",
        ],
    );
    server.wait_ready();
    let url = format!("http://{}", server.grpc);
    let mut client = RateLimiterClient::connect(url.clone()).await.unwrap();
    assert!(
        client
            .should_allow(request("warm"))
            .await
            .unwrap()
            .into_inner()
            .allowed
    );

    // A call stuck in the store (Redis frozen) while SIGTERM arrives.
    redis.freeze();
    let in_flight = tokio::spawn({
        let mut client = client.clone();
        async move { client.should_allow(request("in-flight")).await }
    });
    // Signalled once the call is in service (the gauge counts it), not
    // after a sleep that a loaded machine may outlast.
    let mut reached = false;
    for _ in 0..1_000 {
        let metrics = server.admin_get("/metrics").unwrap();
        if metrics
            .lines()
            .any(|l| l == "tollgate_grpc_requests_in_flight 1")
        {
            reached = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(reached, "the call reached the server within 10 s");
    assert!(!in_flight.is_finished());
    let pid = server.child.id();
    std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    // New connections are refused once the listener is closed.
    let mut refused = false;
    for _ in 0..500 {
        if RateLimiterClient::connect(url.clone()).await.is_err() {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(refused, "new connections were still accepted after SIGTERM");
    // Redis answers again: the call in flight gets Redis's answer.
    redis.thaw();
    let answer = in_flight
        .await
        .unwrap()
        .expect("the call in flight is answered")
        .into_inner();
    assert!(answer.allowed);
    assert_eq!(answer.degraded(), Degraded::None);
    let (status, logs) = tokio::task::spawn_blocking(move || server.terminate())
        .await
        .unwrap();
    assert!(status.success(), "{logs:#?}");
    assert!(
        logs.iter().any(|l| l.contains("tollgate stopped")),
        "{logs:#?}"
    );
}
