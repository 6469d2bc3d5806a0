//! Wires everything together and serves until shutdown.
//!
//! [`run`] takes already-bound listeners, so callers (the binary, tests)
//! choose the addresses, including port 0.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_stream::wrappers::TcpListenerStream;

use crate::admin::{self, AdminState};
use crate::clock::Clock;
use crate::grpc::{RateLimiterServer, RateLimiterService, proto};
use crate::limiter::{Limiter, Unmatched};
use crate::limits::table::{LimitsTable, TableError};
use crate::limits::watch::{LiveLimits, LoadError, watch as watch_limits};
use crate::store::{MemoryStore, Store};

/// Largest accepted gRPC message: a full batch of maximal items fits.
pub const MAX_MESSAGE_BYTES: usize = 1024 * 1024;

/// Where bucket state lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreSpec {
    /// In this process.
    Memory,
}

impl std::str::FromStr for StoreSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "memory" => Ok(Self::Memory),
            other => Err(format!(
                "store {:?} is not supported by this build; use `memory` (the in-process store)",
                redact(other)
            )),
        }
    }
}

/// Hides a password in a URL (`redis://:secret@host` → `redis://:***@host`).
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            let user = userinfo.split(':').next().unwrap_or_default();
            format!("{}{user}:***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_owned(),
    }
}

/// Everything `serve` needs besides listeners and a clock.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The limits table: a SQLite path or `sqlite:` URL.
    pub limits: String,
    /// Where bucket state lives.
    pub store: StoreSpec,
    /// How often the limits table is re-read.
    pub reload_interval: Duration,
    /// How often idle in-memory buckets are dropped.
    pub sweep_interval: Duration,
    /// The cap on in-memory buckets.
    pub max_buckets: usize,
    /// What to do with requests no rule applies to.
    pub unmatched: Unmatched,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            limits: "tollgate-limits.db".into(),
            store: StoreSpec::Memory,
            reload_interval: Duration::from_secs(1),
            sweep_interval: Duration::from_secs(10),
            max_buckets: 1_000_000,
            unmatched: Unmatched::Allow,
        }
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
}

/// Serves gRPC and admin HTTP until `shutdown` completes, then stops
/// accepting, lets in-flight requests finish and returns.
pub async fn run(
    config: ServeConfig,
    listeners: Listeners,
    clock: Arc<dyn Clock>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    crate::telemetry::metrics::handle(); // install the recorder before the first count
    let table = LimitsTable::open(&config.limits).await?;
    let limits = Arc::new(LiveLimits::load(&table).await?);
    let (memory, store): (Option<Arc<MemoryStore>>, Arc<dyn Store>) = match config.store {
        StoreSpec::Memory => {
            let memory = Arc::new(MemoryStore::new(clock.clone(), config.max_buckets));
            (Some(memory.clone()), memory)
        }
    };
    let limiter = Arc::new(Limiter::new(limits.clone(), store, config.unmatched));

    // Every task stops when `shutdown` completes, or when the gRPC server
    // itself ends.
    let (stop_tx, stop_rx) = watch::channel(false);
    let stop_tx = Arc::new(stop_tx);
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    };
    let trigger = stop_tx.clone();
    tokio::spawn(async move {
        shutdown.await;
        let _ = trigger.send(true);
    });

    let watcher = tokio::spawn(watch_limits(
        limits.clone(),
        table.clone(),
        config.reload_interval,
        stopped(),
    ));
    let sweeper = memory.clone().map(|memory| {
        let stop = stopped();
        let every = config.sweep_interval;
        tokio::spawn(async move {
            tokio::pin!(stop);
            let mut tick = tokio::time::interval(every);
            loop {
                tokio::select! {
                    _ = &mut stop => return,
                    _ = tick.tick() => { memory.sweep_idle(); }
                }
            }
        })
    });

    let grpc_addr = listeners.grpc.local_addr()?;
    let admin_addr = listeners.admin.local_addr()?;
    let admin_state = Arc::new(AdminState {
        limiter: limiter.clone(),
        memory,
        ready: false.into(),
    });
    let admin_server = axum::serve(listeners.admin, admin::router(admin_state.clone()))
        .with_graceful_shutdown(stopped());
    let admin_task = tokio::spawn(async move { admin_server.await });

    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<RateLimiterServer<RateLimiterService>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .expect("the embedded descriptor sets are valid");
    let native = RateLimiterServer::new(RateLimiterService::new(limiter))
        .max_decoding_message_size(MAX_MESSAGE_BYTES);

    tracing::info!(
        grpc = %grpc_addr,
        admin = %admin_addr,
        store = limiter_store_kind(&config.store),
        limits = %table.location(),
        "tollgate listening"
    );
    admin_state.ready.store(true, Ordering::Release);
    let served = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .add_service(health_service)
        .add_service(reflection)
        .add_service(native)
        .serve_with_incoming_shutdown(TcpListenerStream::new(listeners.grpc), stopped())
        .await;
    admin_state.ready.store(false, Ordering::Release);
    let _ = stop_tx.send(true);
    health
        .set_not_serving::<RateLimiterServer<RateLimiterService>>()
        .await;

    let _ = admin_task.await;
    let _ = watcher.await;
    if let Some(sweeper) = sweeper {
        let _ = sweeper.await;
    }
    table.close().await;
    tracing::info!("tollgate stopped");
    served.map_err(Into::into)
}

fn limiter_store_kind(spec: &StoreSpec) -> &'static str {
    match spec {
        StoreSpec::Memory => "memory",
    }
}
