//! The Python and Node.js middlewares in `examples/`, run against a live
//! Tollgate: the application answers until the key's burst is spent, then
//! the middleware answers 429 with Tollgate's headers.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};

use common::process::{ServeProcess, tollgate};
use common::redis::free_port;

struct App(Child);

impl Drop for App {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn get(port: u16, key: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "GET / HTTP/1.1\r\nHost: app\r\nx-api-key: {key}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut r = String::new();
    s.read_to_string(&mut r).unwrap();
    (
        r.split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0),
        r.to_ascii_lowercase(),
    )
}

fn check(mut command: Command) {
    let dir = tempfile::tempdir().unwrap();
    let out = tollgate(
        dir.path(),
        &[
            "limits", "set", "--tenant", "shop", "--burst", "2", "--rate", "1/hour",
        ],
    );
    assert!(out.status.success());
    let server = ServeProcess::start(dir.path(), &[]);
    let port = free_port(false);
    let mut child = command
        // A generous deadline: on a loaded machine the first call (which
        // also connects) can take longer than the examples' default 50 ms,
        // and they would then let the request through unlimited.
        .args([
            port.to_string(),
            server.grpc.clone(),
            "shop".into(),
            "5000".into(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the example starts (scripts/test installs its dependencies)");
    let stdout = child.stdout.take().unwrap();
    let _app = App(child);
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), format!("listening on 127.0.0.1:{port}"));

    for left in ["1", "0"] {
        let (status, response) = get(port, "customer-1");
        assert_eq!(status, 200, "{response}");
        assert!(response.contains("hello from the application"));
        assert!(
            response.contains(&format!("ratelimit-remaining: {left}\r\n")),
            "{response}"
        );
    }
    let (status, response) = get(port, "customer-1");
    assert_eq!(status, 429, "{response}");
    assert!(response.contains("retry-after: 3600\r\n"), "{response}");
    assert!(response.contains("ratelimit-limit: 2\r\n"), "{response}");
    assert!(!response.contains("hello from the application"));
    assert_eq!(
        get(port, "customer-2").0,
        200,
        "another key has its own budget"
    );
}

#[test]
fn python_grpcio_middleware() {
    let mut c = Command::new("python3");
    c.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/python/tollgate_middleware.py"
    ));
    check(c);
}

#[test]
fn node_grpc_js_middleware() {
    let mut c = Command::new("node");
    c.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/node/server.js"
    ));
    check(c);
}
