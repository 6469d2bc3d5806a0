//! Wires everything together and serves until shutdown.
//!
//! [`run`] takes already-bound listeners, so callers (the binary, tests)
//! choose the addresses, including port 0.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::alerts::Notifier;
use crate::api::admin::grpc::{AdminServer, AdminService};
use crate::api::admin::{self, AdminState};
use crate::api::envoy::service::{EnvoyRateLimitService, RateLimitServiceServer};
use crate::api::envoy::{ConfigError, LiveEnvoyConfig, xds};
use crate::api::native::{RateLimiterServer, RateLimiterService};
use crate::api::rlqs::{RateLimitQuotaServiceServer, RlqsService};
use crate::clock::Clock;
use crate::connections::{
    Acceptor, ConnectionHandle, ConnectionLimits, HTTP2_PREFACE_BYTES, Handshake, InFlightCap,
    InFlightLayer,
};
use crate::engine::Engine;
use crate::engine::StoreError;
use crate::engine::backend::{Backend, StoreHandle};
use crate::ledger::Ledger;
use crate::limits::table::{LimitsTable, TableError};
use crate::limits::watch::{LiveLimits, LoadError, spawn_watch};
use crate::proto;
use crate::telemetry::top::TopLimited;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

mod config;

pub use config::{
    CONNECTION_OVERHEAD_BYTES, GrpcLimits, MAX_MESSAGE_BYTES, STREAM_OVERHEAD_BYTES, ServeConfig,
    StoreSpec, TlsFiles, TlsOptions,
};

/// Open connections on the admin port at most (each serves one request at a
/// time); one peer address may hold half.
pub const ADMIN_MAX_CONNECTIONS: usize = 64;

/// How long a new connection has to show itself (the gRPC port: send the
/// HTTP/2 preface; the admin port: complete its first request's headers)
/// before it is closed.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

impl TlsFiles {
    fn config(&self) -> Result<tonic::transport::ServerTlsConfig, ServeError> {
        let read = |p: &std::path::Path| {
            std::fs::read(p).map_err(|e| ServeError::Tls(format!("{}: {e}", p.display())))
        };
        let identity = tonic::transport::Identity::from_pem(read(&self.cert)?, read(&self.key)?);
        let mut tls = tonic::transport::ServerTlsConfig::new().identity(identity);
        if let Some(ca) = &self.client_ca {
            tls = tls.client_ca_root(tonic::transport::Certificate::from_pem(read(ca)?));
        }
        Ok(tls)
    }
}

/// The bound listeners.
pub struct Listeners {
    /// gRPC.
    pub grpc: TcpListener,
    /// Admin HTTP.
    pub admin: TcpListener,
}

impl Listeners {
    /// Binds both addresses (port 0 picks a free port).
    pub async fn bind(grpc: SocketAddr, admin: SocketAddr) -> std::io::Result<Self> {
        Ok(Self {
            grpc: TcpListener::bind(grpc).await?,
            admin: TcpListener::bind(admin).await?,
        })
    }
}

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The limits table could not be opened.
    #[error(transparent)]
    Table(#[from] TableError),
    /// The limits table could not be loaded.
    #[error(transparent)]
    Limits(#[from] LoadError),
    /// A listener failed.
    #[error("listener: {0}")]
    Io(#[from] std::io::Error),
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Grpc(#[from] tonic::transport::Error),
    /// The store could not be set up.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The TLS files could not be read.
    #[error("TLS: {0}")]
    Tls(String),
    /// The Envoy configuration could not be loaded.
    #[error("envoy config: {0}")]
    EnvoyConfig(#[from] ConfigError),
    /// The admin port's access settings would open it by accident.
    #[error("{0}")]
    Admin(String),
    /// The xDS management server's address cannot be used.
    #[error(transparent)]
    Xds(#[from] xds::XdsAddressError),
}

/// Serves gRPC and admin HTTP until `shutdown` completes, then stops
/// accepting, lets in-flight requests finish and returns. The steps, in
/// order: check the settings against the bound ports, open the limits and
/// the stores, start the background loops, serve the admin port, become
/// ready once the store answers, serve gRPC, and shut down within the
/// grace period.
pub async fn run(
    config: ServeConfig,
    listeners: Listeners,
    clock: Arc<dyn Clock>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let tls = check(&config, &listeners)?;
    crate::telemetry::metrics::handle(); // install the recorder before the first count
    crate::telemetry::metrics::runtime(crate::runtime::lifo_slot());
    let parts = Parts::open(&config, &clock).await?;
    let stop = Stop::on(shutdown);
    let background = Background::spawn(&config, &parts, &stop)?;
    let grpc_addr = listeners.grpc.local_addr()?;
    let in_flight = InFlightCap::new(config.grpc_limits.max_requests_in_flight);
    let admin = serve_admin(&config, &parts, listeners.admin, in_flight.clone(), &stop)?;
    let (health, health_service) = tonic_health::server::health_reporter();
    let readiness = start_readiness(&parts, &health, &admin.state, &stop).await;
    tracing::info!(
        grpc = %grpc_addr,
        admin = %admin.addr,
        store = %config.store.describe(),
        limits = %parts.table.location(),
        "tollgate listening"
    );
    if !crate::runtime::CAN_TURN_OFF_LIFO_SLOT {
        tracing::warn!(
            "built without --cfg tokio_unstable, so the runtime keeps its LIFO slot and each \
             response costs a write of its own (about a third more CPU per decision); build \
             from the repository, whose .cargo/config.toml sets it, or add it to RUSTFLAGS"
        );
    }
    let served = serve_grpc(
        &config,
        &parts,
        listeners.grpc,
        tls,
        in_flight,
        health_service,
        &stop,
    )?;
    // At shutdown the server stops accepting, sends GOAWAY and lets calls
    // in flight finish; what is still open after the grace period (an idle
    // connection that never sent a request, a request half sent) is closed
    // by dropping it, so the process always exits. One deadline for both
    // ports: the grace counts from the moment the shutdown begins.
    let grace = config.shutdown_grace;
    let deadline = GraceDeadline::after(stop.stopped(), grace);
    let grpc_past_grace = deadline.passed();
    tokio::pin!(served, grpc_past_grace);
    let served = tokio::select! {
        served = &mut served => served,
        () = &mut grpc_past_grace => {
            tracing::warn!(?grace, "gRPC connections still open after the shutdown grace period; closing them");
            Ok(())
        }
    };
    admin.state.ready.set_stopping();
    stop.now();
    health
        .set_not_serving::<RateLimiterServer<RateLimiterService>>()
        .await;
    // The admin port's connections have what is left of the same grace.
    let admin_abort = admin.task.abort_handle();
    tokio::select! {
        _ = admin.task => {}
        () = deadline.passed() => {
            tracing::warn!(
                ?grace,
                "admin connections still open after the shutdown grace period; closing them"
            );
            admin_abort.abort();
        }
    }
    background.join().await;
    let _ = readiness.await;
    let _ = admin.sampler.await;
    parts.table.close().await;
    tracing::info!("tollgate stopped");
    served.map_err(Into::into)
}

/// Refuses settings that would open the admin port by accident, and reads
/// the TLS files of the gRPC port.
fn check(
    config: &ServeConfig,
    listeners: &Listeners,
) -> Result<Option<tonic::transport::ServerTlsConfig>, ServeError> {
    config
        .admin_access
        .validate(listeners.admin.local_addr()?)
        .map_err(ServeError::Admin)?;
    config
        .tls
        .files()
        .map_err(ServeError::Tls)?
        .as_ref()
        .map(TlsFiles::config)
        .transpose()
}

/// What the server is made of: the limits and the Envoy configuration in
/// force, the stores and the engine deciding with them.
struct Parts {
    table: LimitsTable,
    limits: Arc<LiveLimits>,
    envoy_config: Arc<LiveEnvoyConfig>,
    backend: Backend,
    store: StoreHandle,
    top: Arc<TopLimited>,
    engine: Arc<Engine>,
    ledger: Arc<Ledger>,
    rlqs: Arc<crate::api::quota_view::RlqsView>,
    explain: Arc<crate::api::explain::Explainer>,
}

impl Parts {
    async fn open(config: &ServeConfig, clock: &Arc<dyn Clock>) -> Result<Self, ServeError> {
        let table = LimitsTable::open(&config.limits).await?;
        let limits = Arc::new(LiveLimits::load(&table, config.max_limit_rows).await?);
        let envoy_config = Arc::new(match (&config.envoy_config, &config.envoy_xds.server) {
            (Some(dir), _) => LiveEnvoyConfig::load(dir)?,
            (None, Some(server)) => LiveEnvoyConfig::xds(server),
            (None, None) => LiveEnvoyConfig::empty(),
        });
        let backend = Backend::build(&config.backend(), clock)?;
        let top = Arc::new(TopLimited::new(128, Duration::from_secs(60), clock.clone()));
        let engine = Arc::new(
            backend
                .engine(clock.clone(), top.clone(), config.unmatched)
                .with_header_style(config.rate_limit_headers),
        );
        let store = backend.handle();
        let ledger = Arc::new(backend.ledger(
            table.clone(),
            limits.clone(),
            clock.clone(),
            config.ledger(),
        ));
        let explain = Arc::new(crate::api::explain::Explainer::new(
            engine.clone(),
            limits.clone(),
            Some(table.clone()),
            Arc::new(EnvoyRateLimitService::new(
                engine.clone(),
                envoy_config.clone(),
                config.envoy_options,
            )),
        ));
        Ok(Self {
            table,
            limits,
            envoy_config,
            backend,
            store,
            top,
            engine,
            ledger,
            rlqs: Arc::default(),
            explain,
        })
    }
}

/// The shutdown signal every task waits for: set when `shutdown`
/// completes, or when the gRPC server itself ends.
#[derive(Clone)]
struct Stop(Arc<watch::Sender<bool>>);

impl Stop {
    fn on(shutdown: impl Future<Output = ()> + Send + 'static) -> Self {
        let stop = Self(Arc::new(watch::channel(false).0));
        let trigger = stop.clone();
        tokio::spawn(async move {
            shutdown.await;
            trigger.now();
        });
        stop
    }

    /// Stops every task now.
    fn now(&self) {
        self.0.send_replace(true);
    }

    /// Completes once stopping has begun.
    fn stopped(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.0.subscribe();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    }

    /// The signal as a watch, for services that end their streams.
    fn watch(&self) -> watch::Receiver<bool> {
        self.0.subscribe()
    }
}

/// The loops that run beside the traffic: the limits watcher, the Envoy
/// configuration's reloads, the stores' sweeper, the usage ledger and the
/// quota alerts' notifier.
struct Background {
    limits: tokio::sync::oneshot::Receiver<()>,
    envoy: tokio::task::JoinHandle<()>,
    sweeper: tokio::task::JoinHandle<()>,
    ledger: tokio::task::JoinHandle<()>,
    notifier: Option<tokio::task::JoinHandle<()>>,
}

impl Background {
    fn spawn(config: &ServeConfig, parts: &Parts, stop: &Stop) -> Result<Self, ServeError> {
        let envoy = match &config.envoy_xds.server {
            Some(server) => {
                let endpoint = xds::endpoint(&config.envoy_xds, server)?;
                tokio::spawn(xds::follow(
                    parts.envoy_config.clone(),
                    config.envoy_xds.clone(),
                    endpoint,
                    stop.stopped(),
                ))
            }
            None => tokio::spawn(crate::api::envoy::watch(
                parts.envoy_config.clone(),
                config.reload_interval,
                stop.stopped(),
            )),
        };
        let limits = spawn_watch(
            parts.limits.clone(),
            parts.table.clone(),
            config.reload_interval,
            stop.stopped(),
        )?;
        let sweeper = parts
            .backend
            .spawn_sweeper(config.sweep_interval, stop.stopped());
        let ledger = parts.ledger.clone().spawn(stop.stopped());
        let notifier = config.alerts().map(|options| {
            let clock: Arc<dyn Clock> = Arc::new(crate::clock::SystemClock);
            Arc::new(Notifier::new(parts.table.clone(), options, clock)).spawn(stop.stopped())
        });
        Ok(Self {
            limits,
            envoy,
            sweeper,
            ledger,
            notifier,
        })
    }

    async fn join(self) {
        let _ = self.limits.await;
        let _ = self.envoy.await;
        let _ = self.sweeper.await;
        let _ = self.ledger.await;
        if let Some(notifier) = self.notifier {
            let _ = notifier.await;
        }
    }
}

/// The admin port, served.
struct Admin {
    addr: SocketAddr,
    state: Arc<AdminState>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    sampler: tokio::task::JoinHandle<()>,
}

/// Serves the admin port (and samples the decision rates it shows).
fn serve_admin(
    config: &ServeConfig,
    parts: &Parts,
    listener: TcpListener,
    grpc_in_flight: InFlightCap,
    stop: &Stop,
) -> Result<Admin, ServeError> {
    let addr = listener.local_addr()?;
    let state = Arc::new(AdminState {
        limits: parts.limits.clone(),
        store: parts.store.clone(),
        top: parts.top.clone(),
        envoy_status: {
            let envoy = parts.envoy_config.clone();
            Box::new(move || serde_json::json!(envoy.status()))
        },
        ready: Default::default(),
        table: parts.table.clone(),
        access: config.admin_access.clone(),
        grpc_in_flight,
        engine: parts.engine.clone(),
        rlqs: parts.rlqs.clone(),
        explain: parts.explain.clone(),
        history: Default::default(),
    });
    let sampler = spawn_sampler(state.clone(), parts.engine.clone(), stop.stopped());
    let ports = config.grpc_limits;
    ensure_file_descriptors(ports.max_connections + ADMIN_MAX_CONNECTIONS);
    let acceptor = Acceptor::new(
        listener,
        "admin",
        ConnectionLimits {
            max_connections: ADMIN_MAX_CONNECTIONS,
            max_per_peer: ADMIN_MAX_CONNECTIONS / 2,
            handshake: Handshake::Request,
            handshake_timeout: HANDSHAKE_TIMEOUT,
            idle_timeout: ports.idle_timeout,
            tcp_keepalive: ports.tcp_keepalive(),
        },
    );
    let server = axum::serve(
        acceptor,
        admin::router(state.clone())
            .layer(InFlightLayer::uncapped())
            .into_make_service_with_connect_info::<ConnectionHandle>(),
    )
    .with_graceful_shutdown(stop.stopped());
    let task = tokio::spawn(async move { server.await });
    Ok(Admin {
        addr,
        state,
        task,
        sampler,
    })
}

/// Reports the service not serving (health NOT_SERVING, /readyz 503) until
/// the store answers; a Redis that is down at start-up is retried with
/// backoff meanwhile.
async fn start_readiness(
    parts: &Parts,
    health: &HealthReporter,
    admin: &Arc<AdminState>,
    stop: &Stop,
) -> tokio::task::JoinHandle<()> {
    health
        .set_service_status("", ServingStatus::NotServing)
        .await;
    health
        .set_not_serving::<RateLimiterServer<RateLimiterService>>()
        .await;
    tokio::spawn(become_ready(
        parts.store.clone(),
        health.clone(),
        admin.clone(),
        stop.stopped(),
    ))
}

/// The gRPC server on `listener`, bounded by `config`'s gRPC limits:
/// Tollgate's API, Envoy's, the admin service, health and reflection.
/// Completes when stopping has begun and its calls have finished.
fn serve_grpc(
    config: &ServeConfig,
    parts: &Parts,
    listener: TcpListener,
    tls: Option<tonic::transport::ServerTlsConfig>,
    in_flight: InFlightCap,
    health_service: tonic_health::pb::health_server::HealthServer<
        impl tonic_health::pb::health_server::Health,
    >,
    stop: &Stop,
) -> Result<impl Future<Output = Result<(), tonic::transport::Error>>, ServeError> {
    let limits = config.grpc_limits;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .expect("the embedded descriptor sets are valid");
    let envoy = RateLimitServiceServer::new(EnvoyRateLimitService::new(
        parts.engine.clone(),
        parts.envoy_config.clone(),
        config.envoy_options,
    ))
    .max_decoding_message_size(limits.max_message_bytes);
    let rlqs = RateLimitQuotaServiceServer::new(
        RlqsService::new(
            parts.engine.clone(),
            parts.limits.clone(),
            config.rlqs.clone(),
            parts.rlqs.clone(),
        )
        .with_shutdown(stop.watch()),
    )
    .max_decoding_message_size(limits.max_message_bytes);
    let admin_grpc = AdminServer::new(
        AdminService::new(
            parts.top.clone(),
            parts.limits.clone(),
            parts.table.fingerprint(),
        )
        .with_explain(parts.explain.clone(), config.admin_access.token.clone()),
    );
    let native = RateLimiterServer::new(
        RateLimiterService::new(parts.engine.clone(), parts.limits.clone())
            .with_table(parts.table.clone())
            .with_shutdown(stop.watch())
            .with_first_message_deadline(limits.request_timeout),
    )
    .max_decoding_message_size(limits.max_message_bytes);
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = builder.tls_config(tls)?;
    }
    tracing::info!(
        max_connections = limits.max_connections,
        max_requests_in_flight = limits.max_requests_in_flight,
        worst_case_mib = limits.worst_case_bytes() >> 20,
        "gRPC connections and requests bounded"
    );
    let acceptor = Acceptor::new(
        listener,
        "grpc",
        ConnectionLimits {
            max_connections: limits.max_connections,
            max_per_peer: limits.max_connections.div_ceil(2),
            handshake: Handshake::Bytes(HTTP2_PREFACE_BYTES),
            handshake_timeout: HANDSHAKE_TIMEOUT,
            idle_timeout: limits.idle_timeout,
            tcp_keepalive: limits.tcp_keepalive(),
        },
    );
    Ok(builder
        .tcp_nodelay(true)
        .max_concurrent_streams(limits.max_concurrent_streams)
        .concurrency_limit_per_connection(limits.connection_concurrency)
        .http2_max_header_list_size(limits.max_header_bytes)
        .initial_connection_window_size(limits.connection_window_bytes)
        .initial_stream_window_size((limits.connection_window_bytes / 4).max(65_535))
        .http2_keepalive_interval(
            (!limits.keepalive_interval.is_zero()).then_some(limits.keepalive_interval),
        )
        .http2_keepalive_timeout(Some(limits.keepalive_timeout))
        .layer(InFlightLayer::capped(in_flight))
        .layer(crate::api::observe::ObserveLayer)
        // The request timeout, without tonic's timer per request (tonic
        // keeps one for a caller's own `grpc-timeout`).
        .layer(crate::api::timeout::RequestTimeoutLayer::new(
            limits.request_timeout,
        ))
        .add_service(health_service)
        .add_service(reflection)
        .add_service(crate::api::frames::SkipOversized::new(
            native,
            limits.max_message_bytes,
        ))
        .add_service(envoy)
        .add_service(rlqs)
        .add_service(admin_grpc)
        .serve_with_incoming_shutdown(acceptor.into_stream(), stop.stopped()))
}

/// Every second until `stop` completes: samples the decision rates, and
/// takes leases past their time to live out of this instance's book
/// (`tollgate_leases_held`).
fn spawn_sampler(
    state: Arc<AdminState>,
    engine: Arc<Engine>,
    stop: impl Future<Output = ()> + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        tokio::pin!(stop);
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = &mut stop => return,
                _ = tick.tick() => {
                    state.sample();
                    engine.sweep_leases();
                }
            }
        }
    })
}

/// Pings the store until it answers (backing off from 100 ms to 2 s) or a
/// decision reaches it, then reports the service ready (the admin port's
/// `/readyz` turns ready with the first answer by itself).
async fn become_ready(
    store: StoreHandle,
    health: HealthReporter,
    admin: Arc<AdminState>,
    stop: impl Future<Output = ()>,
) {
    tokio::pin!(stop);
    let mut backoff = Duration::from_millis(100);
    let mut attempts = 0u32;
    loop {
        // A decision that reached the store counts as its answer.
        if store.status().answered {
            break;
        }
        match store.ping().await {
            Ok(()) => break,
            Err(err) => {
                attempts += 1;
                if attempts == 1 || attempts.is_power_of_two() {
                    tracing::warn!(error = %err, attempts, "store not reachable yet; not ready, retrying");
                }
            }
        }
        tokio::select! {
            _ = &mut stop => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
    health.set_service_status("", ServingStatus::Serving).await;
    health
        .set_serving::<RateLimiterServer<RateLimiterService>>()
        .await;
    admin.ready.set_ready();
    tracing::info!(store = store.status().kind, "store answered; ready");
}

/// Raises the soft limit on open files towards the hard limit when `needed`
/// connections (plus room for the store, the table and logs) would not fit,
/// and warns when even the hard limit is too low: at the limit `accept`
/// fails, and new callers are turned away.
fn ensure_file_descriptors(needed: usize) {
    let wanted = needed as u64 + 256;
    match rlimit::increase_nofile_limit(wanted) {
        Ok(got) if got < wanted => tracing::warn!(
            open_files = got,
            wanted,
            "the open-file limit is below the connection caps; raise it (ulimit -n) or \
             lower --grpc-max-connections"
        ),
        Ok(_) => {}
        Err(err) => tracing::warn!(error = %err, "could not read or raise the open-file limit"),
    }
}

/// Connections accepted on `listener` with TCP_NODELAY set on each and no
/// other bounds: for the load tool's empty server, which measures tonic
/// alone. Without TCP_NODELAY a response written behind an unacknowledged
/// one waits for the client's delayed ACK: 40 ms stalls at the tail.
pub fn accepted(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// The one shutdown deadline every port shares: `grace` after the
/// shutdown begins, however late each port starts waiting for it.
struct GraceDeadline(watch::Receiver<bool>);

impl GraceDeadline {
    /// The deadline `grace` after `stop` completes.
    fn after(stop: impl Future<Output = ()> + Send + 'static, grace: Duration) -> Self {
        let (passed, deadline) = watch::channel(false);
        tokio::spawn(async move {
            stop.await;
            tokio::time::sleep(grace).await;
            let _ = passed.send(true);
        });
        Self(deadline)
    }

    /// Completes at the deadline, or at once once it has passed.
    fn passed(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut deadline = self.0.clone();
        async move {
            let _ = deadline.wait_for(|passed| *passed).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The admin port starts waiting only once gRPC's wait has ended; it
    /// gets what is left of the same grace, not a grace of its own.
    #[tokio::test(start_paused = true)]
    async fn both_ports_share_one_shutdown_deadline() {
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let deadline = GraceDeadline::after(
            async move {
                let _ = stop_rx.await;
            },
            Duration::from_secs(10),
        );
        let grpc = tokio::spawn(deadline.passed());
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!grpc.is_finished(), "no deadline before the shutdown");
        let stopped_at = tokio::time::Instant::now();
        stop_tx.send(()).unwrap();
        grpc.await.unwrap();
        assert_eq!(stopped_at.elapsed(), Duration::from_secs(10));
        // The admin port begins to wait now: the deadline has passed.
        let admin = tokio::spawn(deadline.passed());
        tokio::task::yield_now().await;
        admin.await.unwrap();
        assert_eq!(
            stopped_at.elapsed(),
            Duration::from_secs(10),
            "one grace for both ports, not two"
        );
    }
}
