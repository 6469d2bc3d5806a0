//! The stores an engine decides with, built from the server's options: the
//! in-process store, Redis when configured, and the layers around them.
//! What leaves this module is an [`Engine`], a [`StoreHandle`] (health and
//! figures, for the admin port and readiness) and the sweeper task, never
//! the store itself.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::{Engine, Unmatched};
use crate::algorithm::Micros;
use crate::clock::Clock;
use crate::ledger::{Ledger, LedgerOptions};
use crate::limits::table::LimitsTable;
use crate::limits::watch::LiveLimits;
use crate::store::fallback::Fallback;
use crate::store::journal::Journal;
use crate::store::layer::Layer;
use crate::store::stack::{self, Layers};
use crate::store::{MemoryStore, RedisConfig, RedisStore, Store, StoreError, StoreStatus};
use crate::telemetry::top::TopLimited;

/// Most tenant-wide buckets one instance holds token slices for at once.
const MAX_SLICED_BUCKETS: usize = 100_000;

/// What the stores are built from.
#[derive(Debug, Clone)]
pub struct BackendOptions {
    /// Redis, a Redis Cluster or a Sentinel-managed Redis; `None`: the
    /// in-process store holds the buckets.
    pub redis: Option<RedisConfig>,
    /// Decide Redis calls by the given clock instead of Redis's own `TIME`
    /// (for tests that control time).
    pub redis_uses_clock: bool,
    /// The in-process store's cap on buckets (also the local fallback's and
    /// the deny cache's).
    pub max_buckets: usize,
    /// Its cap on their bytes.
    pub max_bucket_bytes: usize,
    /// Its cap on reservation and lease records.
    pub max_records: usize,
    /// The most records one tenant holds.
    pub max_records_per_tenant: Option<usize>,
    /// The share of each limit a `local` rule allows while Redis is down.
    pub local_fraction: f64,
    /// The retry-after of a request a fail-closed rule refuses while the
    /// store is down.
    pub deny_retry_after: Micros,
    /// Answer recently rejected buckets locally.
    pub deny_cache: bool,
    /// Answer tenant-wide buckets from token slices.
    pub token_slices: bool,
}

/// The stores, built.
pub struct Backend {
    memory: Arc<MemoryStore>,
    redis: Option<Arc<RedisStore>>,
    stack: Arc<dyn Layer>,
}

impl Backend {
    /// Builds the stores: Redis when configured (it connects in the
    /// background; see [`StoreHandle::ping`]), else the in-process store,
    /// either way within the store-unavailable fallback and the optional
    /// deny cache and slices.
    pub fn build(options: &BackendOptions, clock: &Arc<dyn Clock>) -> Result<Self, StoreError> {
        let memory = MemoryStore::new(clock.clone(), options.max_buckets)
            .with_max_bytes(options.max_bucket_bytes)
            .with_max_records(options.max_records, options.max_records_per_tenant);
        // The store that holds the counters keeps the quota journal.
        let memory = Arc::new(match options.redis {
            None => memory.with_journal(),
            Some(_) => memory,
        });
        let fallback = Fallback {
            local: memory.clone(),
            local_fraction: options.local_fraction,
            deny_retry_after: options.deny_retry_after,
        };
        let mut redis_store = None;
        let backend: Arc<dyn Store> = match &options.redis {
            // At its cap the in-process store refuses new buckets, and the
            // fallback answers by each rule's policy.
            None => memory.clone(),
            Some(config) => {
                let pinned = options.redis_uses_clock.then(|| clock.clone());
                let config = RedisConfig {
                    journal: true,
                    ..config.clone()
                };
                let redis = Arc::new(RedisStore::new(config, pinned)?);
                redis_store = Some(redis.clone());
                redis as Arc<dyn Store>
            }
        };
        let stack = stack::build(
            backend,
            Layers {
                fallback: Some(fallback),
                deny_cache: options
                    .deny_cache
                    .then_some((options.max_buckets, options.max_bucket_bytes)),
                slices: options.token_slices.then_some(MAX_SLICED_BUCKETS),
            },
            clock.clone(),
        );
        Ok(Self {
            memory,
            redis: redis_store,
            stack,
        })
    }

    /// An engine deciding with these stores.
    pub fn engine(
        &self,
        clock: Arc<dyn Clock>,
        top: Arc<TopLimited>,
        unmatched: Unmatched,
    ) -> Engine {
        Engine::new(self.stack.clone(), clock, top).with_unmatched(unmatched)
    }

    /// The usage ledger of the store that holds the counters (its quota
    /// journal), recording in `table`.
    pub fn ledger(
        &self,
        table: LimitsTable,
        limits: Arc<LiveLimits>,
        clock: Arc<dyn Clock>,
        options: LedgerOptions,
    ) -> Ledger {
        let journal: Arc<dyn Journal> = match &self.redis {
            Some(redis) => redis.clone(),
            None => self.memory.clone(),
        };
        Ledger::new(table, journal, limits, clock, options)
    }

    /// The stores' health and figures.
    pub fn handle(&self) -> StoreHandle {
        StoreHandle(self.stack.clone())
    }

    /// Drops idle in-process buckets every `every` (and counts reservations
    /// and leases that expired on Redis unsettled) until `stop` completes.
    pub fn spawn_sweeper(
        &self,
        every: Duration,
        stop: impl Future<Output = ()> + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        let (memory, redis) = (self.memory.clone(), self.redis.clone());
        tokio::spawn(async move {
            tokio::pin!(stop);
            let mut tick = tokio::time::interval(every);
            loop {
                tokio::select! {
                    _ = &mut stop => return,
                    _ = tick.tick() => {
                        memory.sweep_idle();
                        memory.sweep_shares();
                        if let Some(redis) = &redis {
                            tokio::select! {
                                _ = &mut stop => return,
                                _ = redis.count_expired() => {}
                            }
                        }
                    }
                }
            }
        })
    }
}

/// The stores' health and figures: what the admin port shows and what
/// readiness waits for. It decides nothing.
#[derive(Clone)]
pub struct StoreHandle(Arc<dyn Layer>);

impl StoreHandle {
    /// Health and figures: the backend's kind, breakers, Redis nodes, the
    /// in-process buckets, and whether the store has answered yet.
    pub fn status(&self) -> StoreStatus {
        self.0.status()
    }

    /// Asks the backend whether it answers.
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.0.ping().await
    }
}
