//! Where bucket state lives.
//!
//! A backend ([`Store`]: [`memory`], [`redis`]) has one job: apply a
//! decision to a set of buckets atomically, following
//! [`crate::algorithm::plan`] (all enforced buckets admit and every
//! admitting bucket is spent, or nothing is spent). The backend also owns
//! the clock its buckets are measured by. One contract suite
//! (`tests/store_contract.rs`) runs against every backend.
//!
//! The engine does not call a backend directly: [`stack`] wraps it in
//! layers ([`deny_cache`], [`fallback`]), composed in one place.

pub mod breaker;
pub mod deny_cache;
pub mod fallback;
pub mod layer;
pub mod lease;
pub mod memory;
pub mod record_id;
pub mod redis;
pub mod reservation;
pub mod slices;
pub mod stack;

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use serde::{Deserialize, Serialize};

use crate::algorithm::{Charge, Op, Verdict};

pub use lease::{Lease, LeaseAnswer, LeaseId, LeaseOp, LeaseStatus};
pub use memory::MemoryStore;
pub use redis::{RedisConfig, RedisStore, TOKEN_BUCKET_LUA};
pub use reservation::{Reservation, ReservationId, SettleStatus, Settled};

/// The name of one bucket: tenant, scope, resource and key, rendered as
/// `tenant:scope:resource:key`. Tenants and resources cannot contain `:`,
/// and the key comes last, so the rendering is unambiguous.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct BucketKey(String);

impl BucketKey {
    /// Renders a bucket name. `scope` is a short tag (`k` per key, `t` per
    /// tenant); `key` is empty for tenant-wide buckets.
    pub fn new(tenant: &str, scope: &str, resource: &str, key: &str) -> Self {
        let mut s =
            String::with_capacity(tenant.len() + scope.len() + resource.len() + key.len() + 3);
        for (i, part) in [tenant, scope, resource, key].into_iter().enumerate() {
            if i > 0 {
                s.push(':');
            }
            s.push_str(part);
        }
        Self(s)
    }

    /// The rendered name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The scope part of the name (`k`, `t`, `kc`, …).
    pub fn scope(&self) -> &str {
        self.0.split(':').nth(1).unwrap_or_default()
    }

    /// The key part of the name (empty for a tenant-wide bucket).
    pub fn key(&self) -> &str {
        self.0.splitn(4, ':').nth(3).unwrap_or_default()
    }

    /// True for a per-key bucket (scopes `k`, `ks`, `kc`, `kcs`).
    pub fn is_per_key(&self) -> bool {
        self.scope().starts_with('k')
    }

    /// The tenant part of the name.
    pub fn tenant(&self) -> &str {
        self.0.split(':').next().unwrap_or_default()
    }
}

impl fmt::Debug for BucketKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

/// What a decision writes beside its buckets when the store admits it: a
/// reservation's record, or a lease. The engine owns it for the decision's
/// life; the store borrows it through [`Request::attachment`].
#[derive(Debug, Clone)]
pub enum Attachment {
    /// A reservation's record: settled later ([`Store::settle`]).
    Reservation(Reservation),
    /// A lease: one slot of every admitting concurrency cap, released or
    /// renewed later ([`Store::lease`]).
    Lease(Lease),
}

impl Attachment {
    /// How a decision writing this attachment applies its charges: a
    /// reservation spends; a lease acquires for its time to live.
    pub fn op(&self) -> Op {
        match self {
            Self::Reservation(_) => Op::SPEND,
            Self::Lease(lease) => Op::Acquire { ttl: lease.ttl },
        }
    }
}

/// One atomic decision: what the engine asks of the store stack, and what
/// each layer passes to the next and the last to the backend.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// The buckets, each at most once.
    pub buckets: &'a [BucketKey],
    /// One charge per bucket.
    pub charges: &'a [Charge],
    /// One store-unavailable policy per bucket: how the fallback layer
    /// answers when the backend is unavailable (empty for a backend called
    /// on its own).
    pub policies: &'a [OnStoreUnavailable],
    /// How the charges apply ([`Attachment::op`] when one is attached).
    pub op: Op,
    /// What to write beside the buckets when the decision admits.
    pub attachment: Option<&'a Attachment>,
}

impl<'a> Request<'a> {
    /// Applies `charges[i]` to `buckets[i]` with `op`, writing nothing
    /// beside them.
    pub fn new(buckets: &'a [BucketKey], charges: &'a [Charge], op: Op) -> Self {
        Self {
            buckets,
            charges,
            policies: &[],
            op,
            attachment: None,
        }
    }

    /// The same decision, writing `attachment` when it admits (and
    /// applying the charges as it says: [`Attachment::op`]).
    pub fn attach(self, attachment: &'a Attachment) -> Self {
        Self {
            op: attachment.op(),
            attachment: Some(attachment),
            ..self
        }
    }

    /// The same decision, with one store-unavailable policy per bucket.
    pub fn with_policies(self, policies: &'a [OnStoreUnavailable]) -> Self {
        Self { policies, ..self }
    }
}

/// A store failure. Details are logged by the caller, never sent to clients.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The store's configuration is unusable.
    #[error("store configuration: {0}")]
    Config(String),
    /// The store cannot do what this request asks (for example, span two
    /// Redis Cluster slots); the caller must change the request.
    #[error("{0}")]
    Unsupported(String),
    /// The store could not be reached or did not answer in time; a retry
    /// may succeed.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The store holds as many buckets as it may and none can be dropped
    /// (the in-memory store's cap); a retry may succeed once some refill.
    #[error("{0}")]
    AtCapacity(String),
    /// The request's tenant holds as many reservation or lease records as
    /// it may; the caller must settle, release or wait (RESOURCE_EXHAUSTED).
    #[error("{0}")]
    TooManyRecords(String),
    /// The store answered something this version does not understand.
    #[error("store protocol error: {0}")]
    Protocol(String),
}

impl StoreError {
    /// True when retrying later may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Unavailable(_) | Self::AtCapacity(_))
    }
}

/// Why a reservation or lease record could not be added: its tenant holds
/// as many as it may (in memory, or on Redis with a per-tenant cap).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "tenant {tenant:?} holds {held} reservation and lease records (open, or settled and \
     released ones for ten minutes after their ttl), the most it may hold now ({why}); \
     settle or release what it holds, reserve with shorter ttls, or raise {flag}"
)]
pub struct RecordsFull {
    /// The tenant refused.
    pub tenant: String,
    /// What it holds.
    pub held: usize,
    /// Which bound it met.
    pub why: String,
    /// The flag that raises it.
    pub flag: &'static str,
}

/// What a store answers for one atomic decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdicts {
    /// Every enforced charge admitted its cost (and, unless a dry run, every
    /// admitting charge was spent).
    pub allowed: bool,
    /// One verdict per charge, in order.
    pub verdicts: Vec<Verdict>,
}

/// A boxed future, so that stores can be chosen at run time.
pub type StoreFuture<'a> = Pin<Box<dyn Future<Output = Result<Verdicts, StoreError>> + Send + 'a>>;

/// The future of [`Store::settle`].
pub type SettleFuture<'a> = Pin<Box<dyn Future<Output = Result<Settled, StoreError>> + Send + 'a>>;

/// The future of [`Store::lease`].
pub type LeaseFuture<'a> =
    Pin<Box<dyn Future<Output = Result<LeaseAnswer, StoreError>> + Send + 'a>>;

/// The future of [`Store::ping`].
pub type PingFuture<'a> = Pin<Box<dyn Future<Output = Result<(), StoreError>> + Send + 'a>>;

/// The 32-bit FNV-1a hash of a key: how `--redis-spread-keys` spreads
/// one tenant's per-key buckets over Redis Cluster slots, and how a
/// reservation or lease id on one key names the slot of that key
/// ([`record_id::RecordId::for_key`]).
pub fn key_spread(key: &str) -> u32 {
    key.bytes().fold(0x811c_9dc5, |h: u32, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

/// Hides a password in a URL (`redis://:secret@host` → `redis://:***@host`),
/// so that URLs can be logged.
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

/// Applies decisions to buckets atomically.
pub trait Store: Send + Sync + 'static {
    /// Applies `request.charges[i]` to bucket `request.buckets[i]` for
    /// every `i` with `request.op`, as one atomic step (see
    /// [`crate::algorithm::plan`]): a decision spends only when spending
    /// and every enforced charge admits; a charge or a refund always
    /// applies. Each bucket appears at most once. When the decision admits
    /// and a record is attached, it is written in the same step: a
    /// reservation's record, or a lease added to every admitting
    /// concurrency cap's set.
    fn apply<'a>(&'a self, request: Request<'a>) -> StoreFuture<'a>;

    /// [`Store::apply`] done at once, for a store that never waits (the
    /// in-process one); `None` for one that does.
    fn apply_now(&self, _request: Request<'_>) -> Option<Result<Verdicts, StoreError>> {
        None
    }

    /// Settles a reservation at `actual` per line, atomically: every
    /// bucket it charged gets the difference back or the excess charged.
    fn settle<'a>(&'a self, id: &'a ReservationId, actual: u64) -> SettleFuture<'a>;

    /// Releases or renews a lease, atomically on every set it holds.
    fn lease<'a>(&'a self, id: &'a LeaseId, op: LeaseOp) -> LeaseFuture<'a>;

    /// Checks that the store answers.
    fn ping(&self) -> PingFuture<'_>;

    /// A short name for logs and metrics: `memory`, `redis`, ...
    fn kind(&self) -> &'static str;

    /// Health and figures, for the admin port and metrics.
    fn status(&self) -> StoreStatus;
}

/// What a rule does when the shared store cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnStoreUnavailable {
    /// Fail open: admit.
    Allow,
    /// Fail closed: reject.
    Deny,
    /// Decide with in-process buckets.
    Local,
}

/// A store's health and figures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreStatus {
    /// `memory`, `redis`.
    pub kind: &'static str,
    /// The circuit breaker's state, for a backend that has them: on Redis
    /// the worst of its nodes' (see `nodes`).
    pub breaker: Option<breaker::BreakerState>,
    /// Each Redis primary: its address, slots, replicas and breaker.
    pub nodes: Vec<NodeStatus>,
    /// The in-process buckets: the memory backend's, or the local
    /// fallback's.
    pub local: Option<MemoryFigures>,
    /// The backend has answered a decision or a ping since start (set by
    /// the stack's bottom layer; a backend alone reports false).
    pub answered: bool,
}

/// One Redis primary's health, as the status page and metrics show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeStatus {
    /// `host:port`.
    pub address: String,
    /// Cluster slots it serves (all 16384 for a single Redis).
    pub slots: usize,
    /// Its replicas' addresses, as the cluster (or Sentinel) reports them.
    pub replicas: Vec<String>,
    /// Its circuit breaker.
    pub breaker: breaker::BreakerState,
    /// A connection is open.
    pub connected: bool,
    /// Failed calls since start (timeouts, refused connections, errors
    /// that mean it cannot serve).
    pub errors: u64,
}

/// Figures of in-process buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryFigures {
    /// Buckets held.
    pub buckets: usize,
    /// The cap.
    pub max_buckets: usize,
    /// Bytes held, as counted against the byte cap.
    pub bytes: usize,
    /// The byte cap.
    pub max_bytes: usize,
    /// Buckets dropped because they were full.
    pub evicted_idle: u64,
    /// Decisions refused at the cap (never a bucket dropped while refilling).
    pub refused_at_capacity: u64,
}
