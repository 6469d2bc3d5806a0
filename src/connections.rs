//! Bounded connections, for both ports.
//!
//! - [`Acceptor`] accepts with a cap on open connections, and a cap per
//!   peer address (half of it). At a cap, the connection that has gone
//!   longest without showing itself (no request yet) or, failing that, one
//!   with no request in flight from the peer with the most connections, is
//!   closed and its slot given to the newcomer; only when every connection
//!   has a request in flight is the newcomer closed at once (and counted).
//!   So silent or slow sockets can never keep a health probe out. It backs
//!   off when `accept` itself fails (out of file descriptors, say): it never
//!   spins, and logs once per burst of errors.
//! - A connection that has not shown itself within
//!   [`ConnectionLimits::handshake_timeout`] is closed: on the gRPC port by
//!   sending the 24-byte HTTP/2 preface, on the admin port by completing its
//!   first request's headers.
//! - [`Connection`] closes itself when it has had no request in flight for
//!   a whole idle-timeout period (so between one and two periods after its
//!   last request). "Idle" counts requests, not bytes, so HTTP/2 keepalive
//!   pings do not keep an unused connection open, and a request's start and
//!   end cost one atomic add each, no clock read.
//! - [`InFlightLayer`] marks each request's start and end on its connection
//!   (the end is when the response body is done, so a stream counts until
//!   it closes) and, on the gRPC port, holds one of a fixed number of
//!   process-wide slots: past them a request is refused with
//!   RESOURCE_EXHAUSTED at once, before anything is buffered for it. This
//!   is what bounds the memory requests can take, whatever the number of
//!   connections and streams (see the README's "Memory" section). The last
//!   eighth of the slots is kept for connections holding at most
//!   [`FEW_IN_FLIGHT`] requests, so connections that hold many open streams
//!   can never take every slot from a caller on a fresh connection.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::task::AtomicWaker;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

use crate::telemetry::metrics;

/// The longest pause between failed `accept` calls.
const MAX_ACCEPT_BACKOFF: Duration = Duration::from_secs(1);

/// A connection holding at most this many requests in flight may take the
/// last eighth of the process-wide slots.
pub const FEW_IN_FLIGHT: u64 = 4;

/// What a new connection must do within its handshake deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handshake {
    /// Send this many bytes (the HTTP/2 client preface is 24).
    Bytes(usize),
    /// Complete its first request's headers (HTTP/1.1).
    Request,
}

/// The HTTP/2 client preface's length.
pub const HTTP2_PREFACE_BYTES: usize = 24;

/// Bounds on one port's connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Open connections at most; at the cap an idle one makes room, or the
    /// newcomer is closed as soon as it is accepted.
    pub max_connections: usize,
    /// Open connections from one peer address at most (IPv4-mapped IPv6
    /// addresses count as their IPv4 address).
    pub max_per_peer: usize,
    /// What a new connection must do within `handshake_timeout`.
    pub handshake: Handshake,
    /// How long a new connection has for its handshake (zero: forever).
    pub handshake_timeout: Duration,
    /// A connection with no request in flight for this long is closed
    /// (zero: never).
    pub idle_timeout: Duration,
    /// TCP keepalive: probe a quiet peer after this long, and close the
    /// connection when four probes a quarter of it apart go unanswered.
    pub tcp_keepalive: Option<Duration>,
}

/// Accepts connections on one port within its [`ConnectionLimits`].
pub struct Acceptor {
    listener: TcpListener,
    port: &'static str,
    slots: Arc<Semaphore>,
    limits: ConnectionLimits,
    /// Refusals at the cap since the last admitted connection (logged once
    /// per burst).
    refused_in_burst: u64,
    /// The connections accepted (dead ones pruned now and then), to pick
    /// one to close at a cap.
    open: Vec<Weak<Shared>>,
    /// Open connections per peer address.
    peers: HashMap<IpAddr, Arc<AtomicUsize>>,
    accepted: u64,
}

impl Acceptor {
    /// Accepts on `listener`; `port` labels metrics and logs (`grpc`,
    /// `admin`).
    pub fn new(listener: TcpListener, port: &'static str, limits: ConnectionLimits) -> Self {
        metrics::connections_open(port, 0);
        Self {
            listener,
            port,
            slots: Arc::new(Semaphore::new(limits.max_connections)),
            limits,
            refused_in_burst: 0,
            open: Vec::new(),
            peers: HashMap::new(),
            accepted: 0,
        }
    }

    /// A slot for a connection from `peer` (holding `from_peer`
    /// connections): a free one, or one taken from a connection closed to
    /// make room (of the same peer when the peer is at its own cap).
    fn slot_for(&mut self, from_peer: &Arc<AtomicUsize>) -> Option<OwnedSemaphorePermit> {
        if from_peer.load(Ordering::Acquire) >= self.limits.max_per_peer {
            return self.evict(Some(from_peer));
        }
        match self.slots.clone().try_acquire_owned() {
            Ok(slot) => Some(slot),
            Err(_) => self.evict(None),
        }
    }

    /// Closes the connection (of `only` that peer, if given) that can best
    /// give up its slot, and takes the slot: one that has not yet started a
    /// request first, the oldest such; else one with no request in flight,
    /// from the peer with the most connections. `None` when every candidate
    /// has a request in flight.
    fn evict(&mut self, only: Option<&Arc<AtomicUsize>>) -> Option<OwnedSemaphorePermit> {
        self.open.retain(|c| c.strong_count() > 0);
        let victim = self
            .open
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|c| only.is_none_or(|p| Arc::ptr_eq(p, &c.peer)))
            .filter(|c| !c.evicted.load(Ordering::Acquire))
            .filter(|c| Activity::in_flight(c.activity.load()) == 0)
            .min_by_key(|c| {
                let started = c.activity.load() != 0;
                let crowd = c.peer.load(Ordering::Acquire);
                (started, std::cmp::Reverse(crowd), c.serial)
            })?;
        let slot = victim.slot.lock().take()?;
        victim.evicted.store(true, Ordering::Release);
        victim.waker.wake();
        metrics::connection_evicted(self.port);
        Some(slot)
    }

    /// The count of open connections from `ip`'s peer.
    fn peer(&mut self, ip: IpAddr) -> Arc<AtomicUsize> {
        if self.peers.len() > 2 * self.limits.max_connections {
            self.peers.retain(|_, n| Arc::strong_count(n) > 1);
        }
        self.peers.entry(ip.to_canonical()).or_default().clone()
    }

    /// The next connection within the cap. Accept errors are retried with
    /// backoff (1 ms doubling to 1 s), counted, and logged once per burst.
    pub async fn next(&mut self) -> Connection {
        let mut backoff = Duration::from_millis(1);
        let mut errors_in_burst = 0u64;
        loop {
            let (stream, peer) = match self.listener.accept().await {
                Ok(accepted) => accepted,
                Err(err) => {
                    metrics::accept_error(self.port);
                    if errors_in_burst == 0 {
                        tracing::error!(
                            port = self.port,
                            error = %err,
                            "accepting a connection failed; retrying with backoff (until one \
                             succeeds, further failures are only counted in \
                             tollgate_accept_errors_total)"
                        );
                    }
                    errors_in_burst += 1;
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_ACCEPT_BACKOFF);
                    continue;
                }
            };
            if errors_in_burst > 0 {
                tracing::info!(
                    port = self.port,
                    failures = errors_in_burst,
                    "accepting connections again"
                );
                errors_in_burst = 0;
                backoff = Duration::from_millis(1);
            }
            let from_peer = self.peer(peer.ip());
            let Some(slot) = self.slot_for(&from_peer) else {
                metrics::connection_refused(self.port);
                if self.refused_in_burst == 0 {
                    tracing::warn!(
                        port = self.port,
                        max = self.limits.max_connections,
                        max_per_peer = self.limits.max_per_peer,
                        %peer,
                        "at the connection cap (or this peer's), every connection busy; \
                         closing new connections until one ends"
                    );
                }
                self.refused_in_burst += 1;
                drop(stream);
                continue;
            };
            if self.refused_in_burst > 0 {
                tracing::info!(
                    port = self.port,
                    refused = self.refused_in_burst,
                    "below the connection cap again"
                );
                self.refused_in_burst = 0;
            }
            let _ = stream.set_nodelay(true);
            if let Some(every) = self.limits.tcp_keepalive {
                // The kernel probes a quiet peer, at no cost per request.
                let probe = socket2::TcpKeepalive::new()
                    .with_time(every)
                    .with_interval(every / 4)
                    .with_retries(4);
                let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(&probe);
            }
            self.accepted += 1;
            let connection = Connection::new(
                stream,
                peer,
                Shared::new(self.accepted, from_peer, slot),
                self.port,
                &self.limits,
            );
            if self.open.len() >= 2 * self.limits.max_connections {
                self.open.retain(|c| c.strong_count() > 0);
            }
            self.open.push(Arc::downgrade(&connection.handle.shared));
            return connection;
        }
    }

    /// The connections as a stream, for tonic's `serve_with_incoming`.
    pub fn into_stream(self) -> impl tokio_stream::Stream<Item = io::Result<Connection>> {
        futures_util::stream::unfold(self, |mut acceptor| async move {
            let connection = acceptor.next().await;
            Some((Ok(connection), acceptor))
        })
    }
}

impl axum::serve::Listener for Acceptor {
    type Io = Connection;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Connection, SocketAddr) {
        let connection = self.next().await;
        let peer = connection.handle.peer;
        (connection, peer)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}

/// What requests on a connection share with the connection itself, in one
/// word so that a request's start and end are one atomic add each, with no
/// clock read: the low 32 bits count requests in flight, the high 32 bits
/// count starts and ends (wrapping), so the idle check can tell "nothing
/// happened since I last looked".
#[derive(Debug, Default)]
struct Activity(AtomicU64);

impl Activity {
    const ONE_REQUEST: u64 = 1;
    const ONE_EVENT: u64 = 1 << 32;

    /// Returns the requests in flight before this one.
    fn begin(&self) -> u64 {
        let before = self
            .0
            .fetch_add(Self::ONE_EVENT + Self::ONE_REQUEST, Ordering::AcqRel);
        Self::in_flight(before)
    }

    fn end(&self) {
        // One more event, one fewer request: + 2^32 − 1.
        self.0
            .fetch_add(Self::ONE_EVENT - Self::ONE_REQUEST, Ordering::AcqRel);
    }

    fn load(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }

    fn in_flight(word: u64) -> u64 {
        word & (Self::ONE_EVENT - 1)
    }
}

/// What a connection shares with its requests and with the acceptor.
#[derive(Debug)]
struct Shared {
    activity: Activity,
    /// Accepted as the n-th: at a cap the oldest candidate goes first.
    serial: u64,
    /// Open connections from the same peer address (this one included).
    peer: Arc<AtomicUsize>,
    /// Set when the acceptor took this connection's slot for a newcomer:
    /// the connection reads the end of its stream from then on.
    evicted: AtomicBool,
    /// Wakes the connection's pending read when it is evicted.
    waker: AtomicWaker,
    /// The connection's slot under the port's cap, until given away.
    slot: Mutex<Option<OwnedSemaphorePermit>>,
}

impl Shared {
    fn new(serial: u64, peer: Arc<AtomicUsize>, slot: OwnedSemaphorePermit) -> Arc<Self> {
        peer.fetch_add(1, Ordering::AcqRel);
        Arc::new(Self {
            activity: Activity::default(),
            serial,
            peer,
            evicted: AtomicBool::new(false),
            waker: AtomicWaker::new(),
            slot: Mutex::new(Some(slot)),
        })
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.peer.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A handle on one connection, found in each request's extensions (and, on
/// the admin port, as axum's `ConnectInfo`): the services that bound what
/// one peer may hold read its address there.
#[derive(Debug, Clone)]
pub struct ConnectionHandle {
    /// The peer's address.
    pub peer: SocketAddr,
    shared: Arc<Shared>,
}

impl ConnectionHandle {
    /// Marks a request as started; it ends when the guard is dropped. Also
    /// returns how many requests the connection held before it.
    fn begin(&self) -> (RequestGuard, u64) {
        let before = self.shared.activity.begin();
        let guard = RequestGuard {
            connection: Some(self.shared.clone()),
            cap: None,
        };
        (guard, before)
    }
}

/// One accepted connection: the socket, its slot under the cap (in the
/// port's shared state), the handshake deadline and the idle timer.
pub struct Connection {
    stream: TcpStream,
    handle: ConnectionHandle,
    port: &'static str,
    idle_timeout: Duration,
    idle: Option<Pin<Box<Sleep>>>,
    /// The activity word when the idle timer last fired.
    seen: u64,
    /// Until the handshake is done: what it takes, and its deadline.
    handshake: Option<(Handshake, Pin<Box<Sleep>>)>,
    /// Bytes read so far, while the handshake counts them.
    received: usize,
    /// Idle for its timeout, evicted, or past its handshake deadline: every
    /// read is the end of the stream.
    expired: bool,
}

impl Connection {
    fn new(
        stream: TcpStream,
        peer: SocketAddr,
        shared: Arc<Shared>,
        port: &'static str,
        limits: &ConnectionLimits,
    ) -> Self {
        metrics::connection_opened(port);
        let idle_timeout = limits.idle_timeout;
        Self {
            stream,
            handle: ConnectionHandle { peer, shared },
            port,
            idle_timeout,
            idle: (!idle_timeout.is_zero()).then(|| Box::pin(tokio::time::sleep(idle_timeout))),
            seen: 0,
            handshake: (!limits.handshake_timeout.is_zero()).then(|| {
                (
                    limits.handshake,
                    Box::pin(tokio::time::sleep(limits.handshake_timeout)),
                )
            }),
            received: 0,
            expired: false,
        }
    }

    /// True when the handshake deadline passed with the handshake not done
    /// (registering the timer with `cx` otherwise).
    fn handshake_expired(&mut self, cx: &mut Context<'_>) -> bool {
        let Some((kind, timer)) = self.handshake.as_mut() else {
            return false;
        };
        let done = match *kind {
            Handshake::Bytes(n) => self.received >= n,
            Handshake::Request => self.handle.shared.activity.load() != 0,
        };
        if done {
            self.handshake = None;
            return false;
        }
        timer.as_mut().poll(cx).is_ready()
    }

    /// The handle requests on this connection see.
    pub fn handle(&self) -> &ConnectionHandle {
        &self.handle
    }

    /// True when the connection has had no request in flight, and no
    /// request start or end, for a whole timeout period: so it closes
    /// between one and two timeouts after its last request ended. Otherwise
    /// the timer is set one period on (and registered with `cx`).
    fn idle_expired(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(timer) = self.idle.as_mut() else {
            return false;
        };
        while timer.as_mut().poll(cx).is_ready() {
            let now = self.handle.shared.activity.load();
            if now == self.seen && Activity::in_flight(now) == 0 {
                return true;
            }
            self.seen = now;
            timer.as_mut().reset(Instant::now() + self.idle_timeout);
        }
        false
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        metrics::connection_closed(self.port);
    }
}

impl AsyncRead for Connection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.expired {
            return Poll::Ready(Ok(()));
        }
        if self.handle.shared.evicted.load(Ordering::Acquire) {
            // Its slot went to a newcomer (counted by the acceptor).
            self.expired = true;
            return Poll::Ready(Ok(()));
        }
        // The socket first: the timers only matter when it has nothing.
        let before = buf.filled().len();
        let read = Pin::new(&mut self.stream).poll_read(cx, buf);
        if read.is_ready() {
            if matches!(self.handshake, Some((Handshake::Bytes(_), _))) {
                self.received += buf.filled().len() - before;
            }
            return read;
        }
        // End of stream, from now on: the server closes the connection as
        // if the client had.
        let shared = &self.handle.shared;
        shared.waker.register(cx.waker());
        let close = if shared.evicted.load(Ordering::Acquire) {
            true // counted by the acceptor
        } else if self.handshake_expired(cx) {
            metrics::connection_handshake_timeout(self.port);
            true
        } else if self.idle_expired(cx) {
            metrics::connection_idle_closed(self.port);
            true
        } else {
            false
        };
        if close {
            self.expired = true;
            self.idle = None;
            self.handshake = None;
            return Poll::Ready(Ok(()));
        }
        read
    }
}

impl AsyncWrite for Connection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Connection {
    type ConnectInfo = ConnectionHandle;

    fn connect_info(&self) -> ConnectionHandle {
        self.handle.clone()
    }
}

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, Acceptor>>
    for ConnectionHandle
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, Acceptor>) -> Self {
        stream.io().handle.clone()
    }
}

/// Ends a request's time in flight (and frees its process-wide slot) when
/// dropped.
#[derive(Debug)]
pub struct RequestGuard {
    connection: Option<Arc<Shared>>,
    cap: Option<InFlightCap>,
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if let Some(connection) = &self.connection {
            connection.activity.end();
        }
        if let Some(cap) = &self.cap {
            cap.count.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Requests in flight at once across all connections, and how to refuse
/// one past that.
#[derive(Debug, Clone)]
pub struct InFlightCap {
    count: Arc<AtomicUsize>,
    max: usize,
}

impl InFlightCap {
    /// At most `max` requests in flight.
    pub fn new(max: usize) -> Self {
        Self {
            count: Arc::default(),
            max,
        }
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> usize {
        self.count.load(Ordering::Acquire).min(self.max)
    }

    /// Slots only connections holding at most [`FEW_IN_FLIGHT`] requests
    /// may take.
    fn reserved(&self) -> usize {
        self.max / 8
    }

    /// Takes a slot for a request on a connection already holding `held`,
    /// or `false` past what that connection may take.
    fn take(&self, held: u64) -> bool {
        let bound = if held <= FEW_IN_FLIGHT {
            self.max
        } else {
            self.max - self.reserved()
        };
        if self.count.fetch_add(1, Ordering::AcqRel) < bound {
            return true;
        }
        self.count.fetch_sub(1, Ordering::AcqRel);
        false
    }
}

/// The tower layer that tracks requests on their connection; see the module
/// comment.
#[derive(Debug, Clone, Default)]
pub struct InFlightLayer {
    cap: Option<InFlightCap>,
}

impl InFlightLayer {
    /// Tracks requests, and refuses those past `cap` (gRPC).
    pub fn capped(cap: InFlightCap) -> Self {
        Self { cap: Some(cap) }
    }

    /// Tracks requests only (the admin port, one request per connection).
    pub fn uncapped() -> Self {
        Self { cap: None }
    }
}

impl<S> tower::Layer<S> for InFlightLayer {
    type Service = InFlight<S>;

    fn layer(&self, inner: S) -> InFlight<S> {
        InFlight {
            inner,
            cap: self.cap.clone(),
        }
    }
}

/// The service [`InFlightLayer`] wraps.
#[derive(Debug, Clone)]
pub struct InFlight<S> {
    inner: S,
    cap: Option<InFlightCap>,
}

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for InFlight<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    ResBody: Default,
{
    type Response = http::Response<Tracked<ResBody>>;
    type Error = S::Error;
    type Future = InFlightFuture<S::Future, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        // The handle stays in the request's extensions (the services that
        // bound what one peer may hold read its address there).
        let extensions = request.extensions();
        let handle = extensions.get::<ConnectionHandle>().or_else(|| {
            extensions
                .get::<axum::extract::ConnectInfo<ConnectionHandle>>()
                .map(|info| &info.0)
        });
        let (mut guard, held) = match handle {
            Some(handle) => handle.begin(),
            None => (
                RequestGuard {
                    connection: None,
                    cap: None,
                },
                0,
            ),
        };
        if let Some(cap) = &self.cap {
            if !cap.take(held) {
                metrics::grpc_overloaded();
                let message = if held <= FEW_IN_FLIGHT {
                    format!(
                        "this Tollgate instance has {} requests in flight, its cap \
                         (--grpc-max-requests-in-flight); retry shortly",
                        cap.max
                    )
                } else {
                    format!(
                        "this connection holds {held} requests in flight and the instance is \
                         near its cap of {} (--grpc-max-requests-in-flight), whose last {} slots \
                         are kept for connections holding at most {FEW_IN_FLIGHT}; retry \
                         shortly, or send from more connections",
                        cap.max,
                        cap.reserved()
                    )
                };
                let status = tonic::Status::resource_exhausted(message);
                let response = status
                    .into_http::<ResBody>()
                    .map(|body| Tracked::new(body, guard));
                return InFlightFuture::Refused {
                    response: Some(response),
                };
            }
            guard.cap = Some(cap.clone());
        }
        InFlightFuture::Called {
            inner: self.inner.call(request),
            guard: Some(guard),
        }
    }
}

pin_project_lite::pin_project! {
    /// The future of [`InFlight`]: the inner call's, its response body
    /// wrapped to end the request when it is done.
    #[project = InFlightProjection]
    #[allow(missing_docs)] // the variants' fields are described on the variants

    pub enum InFlightFuture<F, B> {
        /// Refused at the cap: the RESOURCE_EXHAUSTED answer, until taken.
        Refused { response: Option<http::Response<Tracked<B>>> },
        /// In service: the inner call, and the guard that ends the request
        /// with its response body.
        Called {
            #[pin]
            inner: F,
            guard: Option<RequestGuard>,
        },
    }
}

impl<F, B, E> Future for InFlightFuture<F, B>
where
    F: Future<Output = Result<http::Response<B>, E>>,
{
    type Output = Result<http::Response<Tracked<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            InFlightProjection::Refused { response } => {
                Poll::Ready(Ok(response.take().expect("polled after completion")))
            }
            InFlightProjection::Called { inner, guard } => {
                let response = std::task::ready!(inner.poll(cx))?;
                let guard = guard.take().expect("polled after completion");
                Poll::Ready(Ok(response.map(|body| Tracked::new(body, guard))))
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// A response body that ends its request's time in flight when it is
    /// done (or dropped).
    pub struct Tracked<B> {
        #[pin]
        body: B,
        guard: Option<RequestGuard>,
    }
}

impl<B> Tracked<B> {
    fn new(body: B, guard: RequestGuard) -> Self {
        Self {
            body,
            guard: Some(guard),
        }
    }
}

impl<B: http_body::Body> http_body::Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<B::Data>, B::Error>>> {
        let this = self.project();
        let frame = this.body.poll_frame(cx);
        if let Poll::Ready(None) = frame {
            this.guard.take();
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
