//! Bounded connections, for both ports.
//!
//! - [`Acceptor`] accepts with a cap on open connections (one past the cap is
//!   accepted and closed at once, and counted), and backs off when `accept`
//!   itself fails (out of file descriptors, say): it never spins, and logs
//!   once per burst of errors.
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
//!   connections and streams (see the README's "Memory" section).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

use crate::telemetry::metrics;

/// The longest pause between failed `accept` calls.
const MAX_ACCEPT_BACKOFF: Duration = Duration::from_secs(1);

/// Bounds on one port's connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Open connections at most; one more is closed as soon as it is
    /// accepted.
    pub max_connections: usize,
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
        }
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
            let Ok(slot) = self.slots.clone().try_acquire_owned() else {
                metrics::connection_refused(self.port);
                if self.refused_in_burst == 0 {
                    tracing::warn!(
                        port = self.port,
                        max = self.limits.max_connections,
                        %peer,
                        "at the connection cap; closing new connections until one ends"
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
            return Connection::new(stream, peer, slot, self.port, self.limits.idle_timeout);
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

    fn begin(&self) {
        self.0
            .fetch_add(Self::ONE_EVENT + Self::ONE_REQUEST, Ordering::AcqRel);
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

/// A handle on one connection, found in each request's extensions (and, on
/// the admin port, as axum's `ConnectInfo`).
#[derive(Debug, Clone)]
pub struct ConnectionHandle {
    /// The peer's address.
    pub peer: SocketAddr,
    activity: Arc<Activity>,
}

impl ConnectionHandle {
    /// Marks a request as started; it ends when the guard is dropped.
    fn begin(self) -> RequestGuard {
        self.activity.begin();
        RequestGuard {
            activity: Some(self.activity),
            cap: None,
        }
    }
}

/// One accepted connection: the socket, its slot under the cap, and the
/// idle timer.
pub struct Connection {
    stream: TcpStream,
    handle: ConnectionHandle,
    port: &'static str,
    idle_timeout: Duration,
    idle: Option<Pin<Box<Sleep>>>,
    /// The activity word when the idle timer last fired.
    seen: u64,
    /// Idle for its timeout: every read is the end of the stream.
    expired: bool,
    _slot: OwnedSemaphorePermit,
}

impl Connection {
    fn new(
        stream: TcpStream,
        peer: SocketAddr,
        slot: OwnedSemaphorePermit,
        port: &'static str,
        idle_timeout: Duration,
    ) -> Self {
        metrics::connection_opened(port);
        Self {
            stream,
            handle: ConnectionHandle {
                peer,
                activity: Arc::default(),
            },
            port,
            idle_timeout,
            idle: (!idle_timeout.is_zero()).then(|| Box::pin(tokio::time::sleep(idle_timeout))),
            seen: 0,
            expired: false,
            _slot: slot,
        }
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
            let now = self.handle.activity.load();
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
        // The socket first: the idle timer only matters when it has nothing.
        let read = Pin::new(&mut self.stream).poll_read(cx, buf);
        if read.is_pending() && self.idle_expired(cx) {
            // End of stream, from now on: the server closes the connection
            // as if the client had.
            metrics::connection_idle_closed(self.port);
            self.expired = true;
            self.idle = None;
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
    activity: Option<Arc<Activity>>,
    cap: Option<InFlightCap>,
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if let Some(activity) = &self.activity {
            activity.end();
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

    /// Takes a slot, or `false` at the cap.
    fn take(&self) -> bool {
        if self.count.fetch_add(1, Ordering::AcqRel) < self.max {
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

    fn call(&mut self, mut request: http::Request<ReqBody>) -> Self::Future {
        // The request's own copy of the handle moves into the guard.
        let extensions = request.extensions_mut();
        let handle = extensions.remove::<ConnectionHandle>().or_else(|| {
            extensions
                .get::<axum::extract::ConnectInfo<ConnectionHandle>>()
                .map(|info| info.0.clone())
        });
        let mut guard = match handle {
            Some(handle) => handle.begin(),
            None => RequestGuard {
                activity: None,
                cap: None,
            },
        };
        if let Some(cap) = &self.cap {
            if !cap.take() {
                metrics::grpc_overloaded();
                let status = tonic::Status::resource_exhausted(format!(
                    "this Tollgate instance has {} requests in flight, its cap \
                     (--grpc-max-requests-in-flight); retry shortly",
                    cap.max
                ));
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
