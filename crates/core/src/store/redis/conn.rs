//! Tollgate's own connection to one Redis server: commands are written
//! from the caller's task, and one reader task per connection parses the
//! replies and hands each to the call that waits for it.
//!
//! So a call costs one write from the task that makes it and one wake when
//! its reply arrives: no channel to a driver task in between. Replies come
//! in the order the commands were written (Redis answers a connection's
//! commands in order), so the waiters queue in write order, and the write
//! and the queueing happen under one lock.
//!
//! The connection speaks RESP2 over TCP or TLS (rustls), authenticates
//! (`AUTH [user] password`) and selects the database before its first
//! call. Once broken (an I/O error, the server closing, a reply that does
//! not parse, or a write cut short by its caller's cancellation) it stays
//! broken: every waiting and later call fails at once, and the node
//! connects again.

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::{Buf, BytesMut};
use parking_lot::Mutex;
use redis::Value;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls;

/// Where and how a node is reached.
#[derive(Clone)]
pub(crate) struct Endpoint {
    pub host: String,
    pub port: u16,
    /// `rediss://`: the TLS settings (roots), shared by every node.
    pub tls: Option<Arc<rustls::ClientConfig>>,
    pub username: Option<String>,
    pub password: Option<String>,
    pub db: i64,
}

impl Endpoint {
    /// A plain TCP endpoint with no credentials, database 0.
    #[cfg(test)]
    pub fn plain(host: &str, port: u16) -> Self {
        Self {
            host: host.to_owned(),
            port,
            tls: None,
            username: None,
            password: None,
            db: 0,
        }
    }
}

/// Why a call got no reply.
#[derive(Debug, Clone)]
pub(crate) enum ConnError {
    /// The connection broke (before or while this call was on it).
    Broken {
        kind: io::ErrorKind,
        message: String,
    },
}

impl ConnError {
    fn broken(kind: io::ErrorKind, message: impl Into<String>) -> Self {
        Self::Broken {
            kind,
            message: message.into(),
        }
    }

    /// The I/O error kind behind it.
    pub fn kind(&self) -> io::ErrorKind {
        match self {
            Self::Broken { kind, .. } => *kind,
        }
    }
}

impl std::fmt::Display for ConnError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Broken { message, .. } => f.write_str(message),
        }
    }
}

type Reader = Box<dyn AsyncRead + Send + Unpin>;
type Writer = Box<dyn AsyncWrite + Send + Unpin>;

/// A call waiting for its reply: the replies to pass over first (`ASKING`'s
/// before the command's), then the one to hand on.
struct Waiter {
    skip: usize,
    reply: oneshot::Sender<Result<Value, ConnError>>,
}

/// What the writers and the reader share.
struct State {
    waiters: Mutex<VecDeque<Waiter>>,
    /// Set once, when the connection breaks; the reason stays in `error`.
    broken: AtomicBool,
    error: Mutex<Option<ConnError>>,
}

impl State {
    /// Breaks the connection (the first reason wins) and fails every
    /// waiting call with it.
    fn fail(&self, error: ConnError) {
        let error = {
            let mut slot = self.error.lock();
            self.broken.store(true, Ordering::Release);
            slot.get_or_insert(error).clone()
        };
        let waiting = std::mem::take(&mut *self.waiters.lock());
        for waiter in waiting {
            let _ = waiter.reply.send(Err(error.clone()));
        }
    }

    fn error(&self) -> ConnError {
        self.error
            .lock()
            .clone()
            .unwrap_or_else(|| ConnError::broken(io::ErrorKind::NotConnected, "connection closed"))
    }
}

struct Inner {
    writer: tokio::sync::Mutex<Writer>,
    state: Arc<State>,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The last handle gone: stop reading (which closes the socket).
        self.reader.abort();
    }
}

/// See the module docs. Clones share the connection.
#[derive(Clone)]
pub(crate) struct Connection {
    inner: Arc<Inner>,
}

impl Connection {
    /// Connects to `endpoint`, authenticates and selects its database.
    /// The caller bounds the time it takes.
    pub async fn open(endpoint: &Endpoint) -> Result<Self, String> {
        let tcp = TcpStream::connect((endpoint.host.as_str(), endpoint.port))
            .await
            .map_err(|e| e.to_string())?;
        tcp.set_nodelay(true).map_err(|e| e.to_string())?;
        let (reader, writer): (Reader, Writer) = match &endpoint.tls {
            None => {
                let (r, w) = tcp.into_split();
                (Box::new(r), Box::new(w))
            }
            Some(config) => {
                let name = rustls::pki_types::ServerName::try_from(endpoint.host.clone())
                    .map_err(|e| format!("TLS server name {:?}: {e}", endpoint.host))?;
                let tls = TlsConnector::from(config.clone())
                    .connect(name, tcp)
                    .await
                    .map_err(|e| format!("TLS handshake: {e}"))?;
                let (r, w) = tokio::io::split(tls);
                (Box::new(r), Box::new(w))
            }
        };
        let state = Arc::new(State {
            waiters: Mutex::default(),
            broken: AtomicBool::new(false),
            error: Mutex::default(),
        });
        let reader = tokio::spawn(read_replies(reader, state.clone()));
        let conn = Self {
            inner: Arc::new(Inner {
                writer: tokio::sync::Mutex::new(writer),
                state,
                reader,
            }),
        };
        conn.handshake(endpoint).await?;
        Ok(conn)
    }

    async fn handshake(&self, endpoint: &Endpoint) -> Result<(), String> {
        if let Some(password) = &endpoint.password {
            let mut auth = redis::cmd("AUTH");
            if let Some(user) = &endpoint.username {
                auth.arg(user);
            }
            auth.arg(password);
            self.expect_ok(&auth, "AUTH").await?;
        }
        if endpoint.db != 0 {
            self.expect_ok(redis::cmd("SELECT").arg(endpoint.db), "SELECT")
                .await?;
        }
        // Names the client in CLIENT LIST (Redis 7.2 and later; older ones
        // refuse it, which changes nothing).
        let setinfo = redis::cmd("CLIENT")
            .arg("SETINFO")
            .arg("LIB-NAME")
            .arg("tollgate")
            .get_packed_command();
        self.send(&setinfo, 0).await.map_err(|e| e.to_string())?;
        Ok(())
    }

    async fn expect_ok(&self, cmd: &redis::Cmd, what: &str) -> Result<(), String> {
        match self.send(&cmd.get_packed_command(), 0).await {
            Ok(Value::Okay) => Ok(()),
            Ok(Value::ServerError(e)) => Err(format!(
                "{what} refused: {} {}",
                e.code(),
                e.details().unwrap_or_default()
            )),
            Ok(other) => Err(format!("{what} answered {other:?}")),
            Err(e) => Err(e.to_string()),
        }
    }

    /// True once the connection is broken: calls on it fail at once.
    pub fn is_broken(&self) -> bool {
        self.inner.state.broken.load(Ordering::Acquire)
    }

    /// Writes `packed` (one or more commands) and waits for its replies:
    /// passes over the first `skip` and returns the next. An error reply
    /// comes back as [`Value::ServerError`].
    pub async fn send(&self, packed: &[u8], skip: usize) -> Result<Value, ConnError> {
        let (reply, answer) = oneshot::channel();
        self.write(packed, [Waiter { skip, reply }]).await?;
        answer
            .await
            .unwrap_or_else(|_| Err(self.inner.state.error()))
    }

    /// Writes `packed`, `count` commands one after another, in one write,
    /// and waits for their replies, in order. Each error reply comes back
    /// as [`Value::ServerError`] in its place; when the connection breaks
    /// part-way, the replies that arrived before stay in theirs.
    pub async fn send_many(
        &self,
        packed: &[u8],
        count: usize,
    ) -> Result<Vec<Result<Value, ConnError>>, ConnError> {
        let mut answers = Vec::with_capacity(count);
        let mut waiters = Vec::with_capacity(count);
        for _ in 0..count {
            let (reply, answer) = oneshot::channel();
            waiters.push(Waiter { skip: 0, reply });
            answers.push(answer);
        }
        self.write(packed, waiters).await?;
        let mut values = Vec::with_capacity(count);
        for answer in answers {
            values.push(
                answer
                    .await
                    .unwrap_or_else(|_| Err(self.inner.state.error())),
            );
        }
        Ok(values)
    }

    /// Queues `waiters` for the replies and writes `packed`, under the
    /// writer's lock, so that replies meet their waiters in write order.
    async fn write(
        &self,
        packed: &[u8],
        waiters: impl IntoIterator<Item = Waiter>,
    ) -> Result<(), ConnError> {
        let state = &self.inner.state;
        let mut writer = self.inner.writer.lock().await;
        if self.is_broken() {
            return Err(state.error());
        }
        state.waiters.lock().extend(waiters);
        // A write its caller abandons half-way leaves a partial command on
        // the wire: nothing after it could be read right.
        let cut = BreakUnlessDone(state, false);
        let written = async {
            writer.write_all(packed).await?;
            writer.flush().await
        }
        .await;
        cut.done();
        if let Err(e) = written {
            state.fail(ConnError::broken(e.kind(), format!("writing: {e}")));
            return Err(state.error());
        }
        Ok(())
    }
}

/// Breaks the connection when dropped before [`BreakUnlessDone::done`].
struct BreakUnlessDone<'a>(&'a State, bool);

impl BreakUnlessDone<'_> {
    fn done(mut self) {
        self.1 = true;
    }
}

impl Drop for BreakUnlessDone<'_> {
    fn drop(&mut self) {
        if !self.1 {
            self.0.fail(ConnError::broken(
                io::ErrorKind::Interrupted,
                "a write was cancelled half-way",
            ));
        }
    }
}

/// The reader task: parses replies as they arrive and hands each to the
/// waiter at the front, until the connection breaks.
async fn read_replies(mut reader: Reader, state: Arc<State>) {
    let mut buf = BytesMut::with_capacity(16 * 1024);
    loop {
        match reader.read_buf(&mut buf).await {
            Ok(0) => {
                state.fail(ConnError::broken(
                    io::ErrorKind::UnexpectedEof,
                    "the server closed the connection",
                ));
                return;
            }
            Ok(_) => {}
            Err(e) => {
                state.fail(ConnError::broken(e.kind(), format!("reading: {e}")));
                return;
            }
        }
        loop {
            match parse(&buf, 0) {
                Ok(Some((value, used))) => {
                    buf.advance(used);
                    deliver(&state, value);
                }
                Ok(None) => break,
                Err(why) => {
                    state.fail(ConnError::broken(
                        io::ErrorKind::InvalidData,
                        format!("unreadable reply: {why}"),
                    ));
                    return;
                }
            }
        }
        if buf.capacity() - buf.len() < 1024 {
            buf.reserve(16 * 1024);
        }
    }
}

fn deliver(state: &State, value: Value) {
    let mut waiters = state.waiters.lock();
    let Some(front) = waiters.front_mut() else {
        // A reply nobody asked for: the stream is out of step.
        drop(waiters);
        state.fail(ConnError::broken(
            io::ErrorKind::InvalidData,
            "a reply arrived that no call asked for",
        ));
        return;
    };
    if front.skip > 0 {
        front.skip -= 1;
        return;
    }
    if let Some(waiter) = waiters.pop_front() {
        drop(waiters);
        // Its caller may have stopped waiting: the reply is dropped.
        let _ = waiter.reply.send(Ok(value));
    }
}

/// Deepest nesting of arrays accepted in a reply (CLUSTER SLOTS nests 3).
const MAX_DEPTH: usize = 32;

/// One RESP2 reply at the start of `buf`: the value and its length in
/// bytes, or `None` while it is incomplete.
fn parse(buf: &[u8], depth: usize) -> Result<Option<(Value, usize)>, String> {
    let Some(end) = line_end(buf) else {
        return Ok(None);
    };
    let Some((&kind, line)) = buf[..end].split_first() else {
        return Err("an empty line".into());
    };
    let next = end + 2;
    let value = match kind {
        b'+' if line == b"OK" => Value::Okay,
        b'+' => Value::SimpleString(String::from_utf8_lossy(line).into_owned()),
        b'-' => {
            // redis-rs's own error type, as its parser builds it.
            let error = redis::parse_redis_value(&buf[..next]).map_err(|e| e.to_string())?;
            match error {
                Value::ServerError(_) => error,
                other => return Err(format!("an error line read as {other:?}")),
            }
        }
        b':' => Value::Int(number(line)?),
        b'$' => {
            let len = number(line)?;
            if len < 0 {
                return Ok(Some((Value::Nil, next)));
            }
            let len = usize::try_from(len).map_err(|_| "a bulk length out of range")?;
            let end = len
                .checked_add(next + 2)
                .ok_or("a bulk length out of range")?;
            let Some(body) = buf.get(next..end) else {
                return Ok(None);
            };
            if &body[len..] != b"\r\n" {
                return Err("a bulk string not ended by CRLF".into());
            }
            return Ok(Some((Value::BulkString(body[..len].to_vec()), end)));
        }
        b'*' => {
            let count = number(line)?;
            if count < 0 {
                return Ok(Some((Value::Nil, next)));
            }
            if depth >= MAX_DEPTH {
                return Err("arrays nested too deep".into());
            }
            let count = usize::try_from(count).map_err(|_| "an array length out of range")?;
            // Each element takes at least 3 bytes: no allocation bigger
            // than what has arrived.
            let mut items = Vec::with_capacity(count.min((buf.len() - next) / 3));
            let mut at = next;
            for _ in 0..count {
                match parse(&buf[at..], depth + 1)? {
                    Some((item, used)) => {
                        items.push(item);
                        at += used;
                    }
                    None => return Ok(None),
                }
            }
            return Ok(Some((Value::Array(items), at)));
        }
        other => return Err(format!("unknown reply type {:?}", char::from(other))),
    };
    Ok(Some((value, next)))
}

/// Where the first line of `buf` ends (its `\r`), once its `\r\n` arrived.
fn line_end(buf: &[u8]) -> Option<usize> {
    let newline = buf.iter().position(|&b| b == b'\n')?;
    (newline > 0 && buf[newline - 1] == b'\r').then(|| newline - 1)
}

fn number(line: &[u8]) -> Result<i64, String> {
    std::str::from_utf8(line)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("{:?} is not a number", String::from_utf8_lossy(line)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(bytes: &[u8]) -> Value {
        let (value, used) = parse(bytes, 0).unwrap().unwrap();
        assert_eq!(used, bytes.len(), "{bytes:?}");
        value
    }

    #[test]
    fn every_resp2_reply_parses_as_redis_rs_parses_it() {
        for bytes in [
            &b"+OK\r\n"[..],
            b"+PONG\r\n",
            b":-42\r\n",
            b"$5\r\nhe\r\no\r\n",
            b"$0\r\n\r\n",
            b"$-1\r\n",
            b"*-1\r\n",
            b"*0\r\n",
            b"*3\r\n:1\r\n*2\r\n$1\r\na\r\n$-1\r\n+x\r\n",
            b"-MOVED 3999 127.0.0.1:6381\r\n",
            b"-NOSCRIPT No matching script.\r\n",
            b"-ERR unknown command\r\n",
        ] {
            assert_eq!(
                whole(bytes),
                redis::parse_redis_value(bytes).unwrap(),
                "{}",
                String::from_utf8_lossy(bytes)
            );
        }
    }

    #[test]
    fn a_reply_cut_anywhere_waits_for_the_rest() {
        let bytes = b"*2\r\n$11\r\nhello world\r\n*1\r\n:7\r\n";
        for cut in 0..bytes.len() {
            assert_eq!(parse(&bytes[..cut], 0).unwrap(), None, "cut at {cut}");
        }
        assert_eq!(
            whole(bytes),
            Value::Array(vec![
                Value::BulkString(b"hello world".to_vec()),
                Value::Array(vec![Value::Int(7)])
            ])
        );
    }

    #[test]
    fn a_stream_out_of_step_is_an_error_not_a_panic() {
        for bad in [
            &b"?what\r\n"[..],
            b":12x\r\n",
            b"$3\r\nabcd\r\n",
            b"$-7x\r\n",
            b"\r\n",
        ] {
            assert!(parse(bad, 0).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        let deep = "*1\r\n".repeat(MAX_DEPTH + 1) + ":1\r\n";
        assert!(parse(deep.as_bytes(), 0).is_err());
        // A huge declared array allocates only for what arrived.
        assert_eq!(parse(b"*1000000000000\r\n:1\r\n", 0).unwrap(), None);
    }
}
