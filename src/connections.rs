//! Bounded connections, for both ports.
//!
//! - [`Acceptor`] accepts with a cap on open connections (one past the cap is
//!   accepted and closed at once, and counted), and backs off when `accept`
//!   itself fails (out of file descriptors, say): it never spins, and logs
//!   once per burst of errors.
//! - [`Connection`] closes itself when it has had no request in flight for
//!   the idle timeout. "Idle" counts requests, not bytes, so HTTP/2
//!   keepalive pings do not keep an unused connection open.
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

/// What requests on a connection share with the connection itself: how many
/// are in flight and when that last changed.
#[derive(Debug)]
struct Activity {
    in_flight: AtomicUsize,
    /// Microseconds after `epoch` of the last start or end of a request.
    last_change: AtomicU64,
    epoch: Instant,
}

impl Activity {
    fn touch(&self) {
        let micros = self.epoch.elapsed().as_micros() as u64;
        self.last_change.store(micros, Ordering::Release);
    }

    /// When the connection becomes idle for `timeout`, or `None` while a
    /// request is in flight.
    fn idle_deadline(&self, timeout: Duration) -> Option<Instant> {
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return None;
        }
        let last = Duration::from_micros(self.last_change.load(Ordering::Acquire));
        Some(self.epoch + last + timeout)
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
    fn begin(&self) -> RequestGuard {
        self.activity.in_flight.fetch_add(1, Ordering::AcqRel);
        self.activity.touch();
        RequestGuard {
            activity: Some(self.activity.clone()),
            slot: None,
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
        let epoch = Instant::now();
        metrics::connection_opened(port);
        Self {
            stream,
            handle: ConnectionHandle {
                peer,
                activity: Arc::new(Activity {
                    in_flight: AtomicUsize::new(0),
                    last_change: AtomicU64::new(0),
                    epoch,
                }),
            },
            port,
            idle_timeout,
            idle: (!idle_timeout.is_zero())
                .then(|| Box::pin(tokio::time::sleep_until(epoch + idle_timeout))),
            expired: false,
            _slot: slot,
        }
    }

    /// The handle requests on this connection see.
    pub fn handle(&self) -> &ConnectionHandle {
        &self.handle
    }

    /// True when the connection has been idle for its timeout. Otherwise the
    /// timer is set to the next moment that could be true (and registered
    /// with `cx`).
    fn idle_expired(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(timer) = self.idle.as_mut() else {
            return false;
        };
        while timer.as_mut().poll(cx).is_ready() {
            match self.handle.activity.idle_deadline(self.idle_timeout) {
                Some(deadline) if deadline <= Instant::now() => return true,
                Some(deadline) => timer.as_mut().reset(deadline),
                // Busy: look again one timeout from now.
                None => timer.as_mut().reset(Instant::now() + self.idle_timeout),
            }
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
        if self.idle_expired(cx) {
            // End of stream, from now on: the server closes the connection
            // as if the client had.
            metrics::connection_idle_closed(self.port);
            self.expired = true;
            self.idle = None;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.stream).poll_read(cx, buf)
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
    slot: Option<OwnedSemaphorePermit>,
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if let Some(activity) = self.activity.take() {
            activity.touch();
            activity.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Requests in flight at once across all connections, and how to refuse
/// one past that.
#[derive(Debug, Clone)]
pub struct InFlightCap {
    slots: Arc<Semaphore>,
    max: usize,
}

impl InFlightCap {
    /// At most `max` requests in flight.
    pub fn new(max: usize) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(max)),
            max,
        }
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> usize {
        self.max - self.slots.available_permits()
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

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for InFlight<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
    ResBody: Default + Send + 'static,
{
    type Response = http::Response<Tracked<ResBody>>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        let extensions = request.extensions();
        let handle = extensions.get::<ConnectionHandle>().or_else(|| {
            extensions
                .get::<axum::extract::ConnectInfo<ConnectionHandle>>()
                .map(|info| &info.0)
        });
        let mut guard = match handle {
            Some(handle) => handle.begin(),
            None => RequestGuard {
                activity: None,
                slot: None,
            },
        };
        if let Some(cap) = &self.cap {
            match cap.slots.clone().try_acquire_owned() {
                Ok(slot) => guard.slot = Some(slot),
                Err(_) => {
                    metrics::grpc_overloaded();
                    let status = tonic::Status::resource_exhausted(format!(
                        "this Tollgate instance has {} requests in flight, its cap \
                         (--grpc-max-requests-in-flight); retry shortly",
                        cap.max
                    ));
                    let response = status
                        .into_http::<ResBody>()
                        .map(|body| Tracked::new(body, guard));
                    return Box::pin(async move { Ok(response) });
                }
            }
        }
        let response = self.inner.call(request);
        Box::pin(async move {
            let response = response.await?;
            Ok(response.map(|body| Tracked::new(body, guard)))
        })
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
