//! One Redis server as the store sees it: its connection, its breaker and
//! its queue of coalesced decisions.
//!
//! Health is per node. A node that keeps failing opens its own breaker, and
//! calls routed to it fail at once (the fallback answers them by policy)
//! while calls to every other node go on as before. Connecting runs in a
//! task of its own beside the traffic: callers wait for it only up to their
//! own deadline, and a connection found broken is dropped so the next call
//! (the breaker's probe, once open) connects again.

use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::{BoxFuture, Shared};
use parking_lot::Mutex;
use redis::{Cmd, ServerErrorKind, Value};
use tokio::time::Instant;

use super::coalesce::Waiting;
use super::conn::{ConnError, Connection, Endpoint};
use crate::store::StoreError;
use crate::store::breaker::{Breaker, BreakerState, Open};
use crate::telemetry::metrics;

/// A command as it goes on the wire (RESP): a [`Cmd`], or the bytes of
/// one already written (the usual script call).
pub(super) trait Wire: Sync {
    /// Appends the command's bytes to `out`.
    fn write_to(&self, out: &mut Vec<u8>);

    /// The command's bytes.
    fn packed(&self) -> std::borrow::Cow<'_, [u8]>;
}

impl Wire for Cmd {
    fn write_to(&self, out: &mut Vec<u8>) {
        self.write_packed_command(out);
    }

    fn packed(&self) -> std::borrow::Cow<'_, [u8]> {
        self.get_packed_command().into()
    }
}

impl Wire for Vec<u8> {
    fn write_to(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(self);
    }

    fn packed(&self) -> std::borrow::Cow<'_, [u8]> {
        self[..].into()
    }
}

/// How a node answered a command, as routing needs to know it.
pub(super) enum Answer {
    /// The reply.
    Value(Value),
    /// `MOVED slot addr` (`moved`), or `ASK slot addr`.
    Redirect { moved: bool, addr: String },
    /// `TRYAGAIN`: a multi-key call during a slot migration; ask again soon.
    TryAgain,
    /// `NOSCRIPT`: load the script on this node and ask again.
    NoScript,
}

/// The connection's state.
enum Conn {
    Idle,
    Connecting(Shared<BoxFuture<'static, Result<(Connection, u64), String>>>),
    Ready(Connection, u64),
}

/// See the module docs.
pub(super) struct Node {
    /// `host:port`, as the cluster or Sentinel names it.
    pub addr: String,
    /// The metric label: the address, or `other` past [`MAX_NODE_LABELS`].
    pub label: String,
    endpoint: Endpoint,
    connect_timeout: Duration,
    conn: Mutex<Conn>,
    generation: AtomicU64,
    breaker: Breaker,
    errors: AtomicU64,
    /// Redis's clock less this process's (µs, see [`local_micros`]), as a
    /// lower bound from the last reply that carried Redis's `TIME`;
    /// [`UNKNOWN`] before the first and after a connection is dropped.
    clock_offset: AtomicI64,
    /// Decisions waiting for a shared script call to this node; `None`
    /// when coalescing is off.
    pub waiting: Option<Mutex<Waiting>>,
}

/// [`Node::clock_offset`] before Redis's clock is known.
const UNKNOWN: i64 = i64::MIN;

/// Microseconds from a fixed instant of this process to `at` (zero for
/// instants before it): the local side of a node's clock offset.
fn local_micros(at: Instant) -> i64 {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    let origin = *ORIGIN.get_or_init(Instant::now);
    i64::try_from(at.saturating_duration_since(origin).as_micros()).unwrap_or(i64::MAX)
}

/// Most node addresses used as metric labels; further nodes share `other`.
pub(super) const MAX_NODE_LABELS: usize = 64;

impl Node {
    pub fn new(
        addr: String,
        label: String,
        endpoint: Endpoint,
        connect_timeout: Duration,
        breaker: Breaker,
        coalesce: bool,
    ) -> Self {
        // Fix the origin of local time before any deadline is converted.
        local_micros(Instant::now());
        Self {
            addr,
            label,
            endpoint,
            connect_timeout,
            conn: Mutex::new(Conn::Idle),
            generation: AtomicU64::new(0),
            breaker,
            errors: AtomicU64::new(0),
            clock_offset: AtomicI64::new(UNKNOWN),
            waiting: coalesce.then(Mutex::default),
        }
    }

    /// The breaker's state.
    pub fn breaker_state(&self) -> BreakerState {
        self.breaker.state()
    }

    /// True while the breaker lets calls through (closed, or a probe due).
    pub fn healthy(&self) -> bool {
        self.breaker.state() == BreakerState::Closed
    }

    /// True when the breaker would refuse a call now.
    pub fn refuses(&self) -> bool {
        self.breaker.refuses()
    }

    /// Failed calls since start.
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    /// True when a connection is open.
    pub fn connected(&self) -> bool {
        matches!(&*self.conn.lock(), Conn::Ready(c, _) if !c.is_broken())
    }

    /// The connection, connecting first when there is none (in a task of
    /// its own, shared by every caller that waits for it).
    async fn connection(self: &Arc<Self>) -> Result<(Connection, u64), String> {
        let connecting = {
            let mut conn = self.conn.lock();
            match &*conn {
                Conn::Ready(c, generation) if !c.is_broken() => {
                    return Ok((c.clone(), *generation));
                }
                Conn::Connecting(f) => f.clone(),
                // None yet, or one found broken (a write its caller
                // abandoned, say): connect, and learn the clock again.
                Conn::Idle | Conn::Ready(..) => {
                    self.clock_offset.store(UNKNOWN, Ordering::Relaxed);
                    let node = self.clone();
                    // The lock is held until the state says Connecting, so
                    // the task's own update always comes after.
                    let task = tokio::spawn(async move {
                        let made = match tokio::time::timeout(
                            node.connect_timeout,
                            Connection::open(&node.endpoint),
                        )
                        .await
                        {
                            Ok(made) => made,
                            Err(_) => {
                                Err(format!("no connection within {:?}", node.connect_timeout))
                            }
                        };
                        let mut conn = node.conn.lock();
                        match made {
                            Ok(c) => {
                                let generation =
                                    node.generation.fetch_add(1, Ordering::Relaxed) + 1;
                                *conn = Conn::Ready(c.clone(), generation);
                                Ok((c, generation))
                            }
                            Err(e) => {
                                *conn = Conn::Idle;
                                Err(e)
                            }
                        }
                    });
                    let shared = async move {
                        task.await
                            .unwrap_or_else(|e| Err(format!("connecting: {e}")))
                    }
                    .boxed()
                    .shared();
                    *conn = Conn::Connecting(shared.clone());
                    shared
                }
            }
        };
        connecting.await
    }

    /// Drops connection `generation` after an I/O error, so that the next
    /// call connects again.
    fn broken(&self, generation: u64) {
        let mut conn = self.conn.lock();
        if matches!(&*conn, Conn::Ready(_, g) if *g == generation) {
            *conn = Conn::Idle;
            // The next connection may reach another server (a restart, a
            // failover behind the same address): learn its clock again.
            self.clock_offset.store(UNKNOWN, Ordering::Relaxed);
        }
    }

    /// `deadline` on this node's clock (µs since the Unix epoch), early
    /// rather than late: a script call carries it so that one Redis runs
    /// after its caller was answered applies nothing. The clock is read
    /// first when it is not known yet ([`Node::learn_clock`]).
    pub async fn deadline_on_node(self: &Arc<Self>, deadline: Instant) -> Result<i64, StoreError> {
        self.learn_clock(deadline).await?;
        let offset = self.clock_offset.load(Ordering::Relaxed);
        if offset == UNKNOWN {
            // The connection that read it broke since.
            return Err(StoreError::Unavailable(format!(
                "Redis node {}: connection dropped",
                self.addr
            )));
        }
        Ok(local_micros(deadline).saturating_add(offset))
    }

    /// Learns this node's clock from `redis_now`, its `TIME` (µs) in a
    /// reply received just now. Redis read it at some moment between the
    /// call's sending and now, so `redis_now` less the local time now is a
    /// lower bound of the offset: deadlines written with it fall early on
    /// Redis's clock, never late (unless Redis's clock steps back between
    /// two replies; the next reply corrects it).
    pub fn observe_clock(&self, redis_now: i64) {
        let offset = redis_now.saturating_sub(local_micros(Instant::now()));
        self.clock_offset.store(offset, Ordering::Relaxed);
    }

    /// Reads the node's clock with `TIME` when it is not known yet (the
    /// first script call over a connection).
    async fn learn_clock(self: &Arc<Self>, deadline: Instant) -> Result<(), StoreError> {
        if self.clock_offset.load(Ordering::Relaxed) != UNKNOWN {
            return Ok(());
        }
        let value = match self.call(&redis::cmd("TIME"), false, deadline).await? {
            Answer::Value(value) => value,
            _ => {
                return Err(StoreError::Unavailable(format!(
                    "Redis node {} did not answer TIME",
                    self.addr
                )));
            }
        };
        let (secs, micros): (i64, i64) = redis::from_redis_value(value).map_err(|e| {
            StoreError::Protocol(format!(
                "Redis node {} answered TIME unexpectedly: {e}",
                self.addr
            ))
        })?;
        self.observe_clock(secs.saturating_mul(1_000_000).saturating_add(micros));
        Ok(())
    }

    /// Sends `cmd` (after `ASKING` when `asking`), by `deadline`, through
    /// the breaker: a transient failure counts against this node, and an
    /// open breaker refuses at once.
    pub async fn call(
        self: &Arc<Self>,
        cmd: &dyn Wire,
        asking: bool,
        deadline: Instant,
    ) -> Result<Answer, StoreError> {
        let pending = self.admit()?;
        let result = self.send(cmd, asking, deadline).await;
        let healthy = match &result {
            Ok(_) => true,
            Err(failure) => !failure.is_transient(),
        };
        pending.report(healthy);
        result.map_err(Failure::into_error)
    }

    /// Sends `cmds` one after another in one write, by `deadline`, through
    /// the breaker as one call, and answers each in its place. What fails
    /// them all (an open breaker, no connection, no answer by `deadline`)
    /// is the outer error; a connection that breaks part-way fails the
    /// commands whose replies had not arrived.
    pub async fn call_many(
        self: &Arc<Self>,
        cmds: &[impl Wire],
        deadline: Instant,
    ) -> Result<Vec<Result<Answer, StoreError>>, StoreError> {
        let pending = self.admit()?;
        let result = self.send_many(cmds, deadline).await;
        let healthy = match &result {
            Ok(answers) => !answers
                .iter()
                .any(|a| a.as_ref().is_err_and(Failure::is_transient)),
            Err(failure) => !failure.is_transient(),
        };
        pending.report(healthy);
        let answers = result.map_err(Failure::into_error)?;
        Ok(answers
            .into_iter()
            .map(|a| a.map_err(Failure::into_error))
            .collect())
    }

    /// Lets a call through the breaker, or refuses it while it is open.
    fn admit(&self) -> Result<Pending<'_>, StoreError> {
        match self.breaker.admit() {
            Ok(()) => Ok(Pending {
                node: self,
                done: false,
            }),
            Err(Open) => {
                metrics::store_error("redis", "circuit_open");
                Err(StoreError::Unavailable(format!(
                    "Redis node {}: circuit breaker open",
                    self.addr
                )))
            }
        }
    }

    /// Sends `cmd` without the breaker (slot-map and Sentinel queries).
    pub async fn query(
        self: &Arc<Self>,
        cmd: &Cmd,
        deadline: Instant,
    ) -> Result<Value, StoreError> {
        match self.send(cmd, false, deadline).await {
            Ok(Answer::Value(v)) => Ok(v),
            Ok(_) => Err(StoreError::Unavailable(format!(
                "Redis node {} redirected a query",
                self.addr
            ))),
            Err(failure) => Err(failure.into_error()),
        }
    }

    async fn send(
        self: &Arc<Self>,
        cmd: &dyn Wire,
        asking: bool,
        deadline: Instant,
    ) -> Result<Answer, Failure> {
        let (conn, generation) = self.connection_by(deadline).await?;
        let (packed, skip) = if asking {
            let mut packed = redis::cmd("ASKING").get_packed_command();
            cmd.write_to(&mut packed);
            (packed.into(), 1)
        } else {
            (cmd.packed(), 0)
        };
        match tokio::time::timeout_at(deadline, conn.send(&packed, skip)).await {
            Err(_) => Err(self.late()),
            Ok(Err(e)) => Err(self.lost(generation, &e)),
            Ok(Ok(value)) => self.answer(value),
        }
    }

    async fn send_many(
        self: &Arc<Self>,
        cmds: &[impl Wire],
        deadline: Instant,
    ) -> Result<Vec<Result<Answer, Failure>>, Failure> {
        let (conn, generation) = self.connection_by(deadline).await?;
        let mut packed = Vec::new();
        for cmd in cmds {
            cmd.write_to(&mut packed);
        }
        let values =
            match tokio::time::timeout_at(deadline, conn.send_many(&packed, cmds.len())).await {
                Err(_) => return Err(self.late()),
                Ok(Err(e)) => return Err(self.lost(generation, &e)),
                Ok(Ok(values)) => values,
            };
        // A break part-way is one failure of the node, however many
        // commands it cut off.
        let mut lost = None;
        Ok(values
            .into_iter()
            .map(|value| match value {
                Ok(value) => self.answer(value),
                Err(e) => Err(Failure::Transient(
                    lost.get_or_insert_with(|| self.lost(generation, &e).into_error())
                        .clone(),
                )),
            })
            .collect())
    }

    /// The connection, connecting first if there is none, by `deadline`.
    async fn connection_by(
        self: &Arc<Self>,
        deadline: Instant,
    ) -> Result<(Connection, u64), Failure> {
        match tokio::time::timeout_at(deadline, self.connection()).await {
            Ok(Ok(conn)) => Ok(conn),
            Ok(Err(e)) => {
                self.failed("connect");
                Err(Failure::Transient(StoreError::Unavailable(format!(
                    "Redis node {}: {e}",
                    self.addr
                ))))
            }
            Err(_) => Err(self.late()),
        }
    }

    /// No answer by the caller's deadline.
    fn late(&self) -> Failure {
        self.failed("timeout");
        Failure::Transient(StoreError::Unavailable(format!(
            "Redis node {}: no answer in time",
            self.addr
        )))
    }

    /// Connection `generation` broke under a call.
    fn lost(&self, generation: u64, e: &ConnError) -> Failure {
        self.broken(generation);
        self.failed(io_kind(e));
        Failure::Transient(StoreError::Unavailable(format!(
            "Redis node {}: {e}",
            self.addr
        )))
    }

    /// A reply, as routing needs to know it.
    fn answer(&self, value: Value) -> Result<Answer, Failure> {
        match value {
            Value::ServerError(err) => {
                self.server_error(err.kind(), err.code(), err.details().unwrap_or_default())
            }
            value => Ok(Answer::Value(value)),
        }
    }

    /// What an error reply means for routing and for the node's health.
    fn server_error(
        &self,
        kind: Option<ServerErrorKind>,
        code: &str,
        detail: &str,
    ) -> Result<Answer, Failure> {
        let target = || {
            detail
                .split_ascii_whitespace()
                .nth(1)
                .unwrap_or_default()
                .to_owned()
        };
        let error =
            || StoreError::Unavailable(format!("Redis node {}: {code} {detail}", self.addr));
        match kind {
            Some(ServerErrorKind::Moved) => Ok(Answer::Redirect {
                moved: true,
                addr: target(),
            }),
            Some(ServerErrorKind::Ask) => Ok(Answer::Redirect {
                moved: false,
                addr: target(),
            }),
            Some(ServerErrorKind::TryAgain) => Ok(Answer::TryAgain),
            Some(ServerErrorKind::NoScript) => Ok(Answer::NoScript),
            Some(
                ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown
                | ServerErrorKind::BusyLoading
                | ServerErrorKind::ReadOnly,
            ) => {
                self.failed("server");
                Err(Failure::Transient(error()))
            }
            _ => {
                metrics::store_error("redis", "server");
                Err(Failure::Other(error()))
            }
        }
    }

    fn failed(&self, kind: &'static str) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        metrics::store_error("redis", kind);
        metrics::node_error(&self.label, kind);
    }
}

enum Failure {
    /// The node is down, slow or not serving: counts against its breaker.
    Transient(StoreError),
    /// Anything else (an error in the script, a refused command: nothing
    /// about the node's health).
    Other(StoreError),
}

impl Failure {
    fn is_transient(&self) -> bool {
        matches!(self, Self::Transient(_))
    }

    fn into_error(self) -> StoreError {
        match self {
            Self::Transient(e) | Self::Other(e) => e,
        }
    }
}

fn io_kind(e: &ConnError) -> &'static str {
    match e.kind() {
        std::io::ErrorKind::TimedOut => "timeout",
        std::io::ErrorKind::ConnectionRefused => "connection_refused",
        _ => "io",
    }
}

/// Reports a call's health to the breaker; a call dropped before it ended
/// counts as failed, so a probe whose caller went away never leaves the
/// breaker half-open.
struct Pending<'a> {
    node: &'a Node,
    done: bool,
}

impl Pending<'_> {
    fn report(mut self, healthy: bool) {
        if healthy {
            self.node.breaker.success();
        } else {
            self.node.breaker.failure();
        }
        self.done = true;
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.node.breaker.failure();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node where nothing listens: every connection is refused at once.
    fn unreachable(threshold: u32, cooldown: Duration) -> Arc<Node> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        Arc::new(Node::new(
            format!("127.0.0.1:{port}"),
            "test".into(),
            Endpoint::plain("127.0.0.1", port),
            Duration::from_secs(1),
            Breaker::new(threshold, cooldown),
            false,
        ))
    }

    #[tokio::test]
    async fn failures_open_the_breaker_and_a_dropped_probe_counts_as_failed() {
        let node = unreachable(2, Duration::from_millis(50));
        let ping = redis::cmd("PING");
        let deadline = || Instant::now() + Duration::from_secs(1);
        for _ in 0..2 {
            let err = node.call(&ping, false, deadline()).await.err().unwrap();
            assert!(err.to_string().contains(&node.addr), "{err}");
        }
        assert_eq!(node.breaker_state(), BreakerState::Open);
        assert_eq!(node.errors(), 2);
        let refused = node.call(&ping, false, deadline()).await.err().unwrap();
        assert_eq!(
            refused.to_string(),
            format!(
                "store unavailable: Redis node {}: circuit breaker open",
                node.addr
            )
        );
        assert_eq!(node.errors(), 2, "a refused call never reached the node");

        tokio::time::sleep(Duration::from_millis(60)).await;
        // The probe's caller goes away before the node answers.
        let mut probe = Box::pin(node.call(&ping, false, deadline()));
        assert!(futures_util::poll!(probe.as_mut()).is_pending());
        assert_eq!(node.breaker_state(), BreakerState::HalfOpen);
        drop(probe);
        assert_eq!(
            node.breaker_state(),
            BreakerState::Open,
            "a dropped probe counts as failed, so the breaker probes again later"
        );
        assert!(!node.connected());
    }
}
