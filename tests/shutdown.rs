//! SIGTERM always ends the process: connections that stay open (an idle
//! TCP connection that never spoke HTTP/2, a request half sent, an idle
//! admin connection) are closed once `--shutdown-grace` has passed.

mod common;

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
    std::thread::spawn(move || {
        let _ = tx.send(server.terminate());
    });
    // Without the grace period this never returns; the bound only turns a
    // hang into a failure with a message.
    let (status, logs) = rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("tollgate (pid {pid}) did not exit after SIGTERM"));
    assert!(status.success(), "{status:?}: {logs:#?}");
    assert!(
        logs.iter()
            .any(|l| l.contains("still open after the shutdown grace period; closing them")),
        "{logs:#?}"
    );
    drop((half_sent, admin_half));
}
