//! Where bucket state lives.
//!
//! A backend ([`Store`]: [`memory`], [`redis`]) has one job: apply one
//! [`Request`] to a set of buckets atomically, following
//! [`crate::algorithm::plan()`] (all enforced buckets admit and every
//! admitting bucket is spent, or nothing is spent), writing its
//! [`Attachment`] (a reservation's record, a lease) in the same step when it
//! admits. Buckets are named by [`BucketKey`], built from a typed
//! [`BucketKind`]. The backend also owns the clock its buckets are measured
//! by. One contract suite (`crates/core/tests/store_contract.rs`) runs against every
//! backend.
//!
//! The engine does not call a backend directly: [`stack`] wraps it in
//! layers ([`deny_cache`], [`fallback`], [`slices`]; each a
//! [`layer::Wrapper`] that overrides only what it changes), composed in one
//! place.
//!
//! A decision on two buckets, all or nothing: a key's bucket and its
//! tenant's ceiling. When the ceiling refuses, the key's bucket is not
//! spent either.
//!
//! ```
//! use std::sync::Arc;
//! use tollgate_core::algorithm::{Charge, Limit, Op};
//! use tollgate_core::clock::ManualClock;
//! use tollgate_core::store::{BucketKey, BucketKind, MemoryStore};
//!
//! let store = MemoryStore::new(Arc::new(ManualClock::new(0)), 1_000);
//! let per_key = Limit::new(10, "10/second".parse().unwrap()).unwrap();
//! let ceiling = Limit::new(1, "1/second".parse().unwrap()).unwrap();
//! let buckets = [
//!     BucketKey::new("acme", BucketKind::KEY, "", "alice"),
//!     BucketKey::new("acme", BucketKind::TENANT, "", ""),
//! ];
//! let charges = [Charge::new(per_key, 1), Charge::new(ceiling, 1)];
//!
//! let first = store.apply_now(&buckets, &charges, Op::SPEND).unwrap();
//! assert!(first.allowed);
//! assert_eq!(first.verdicts[0].remaining, 9);
//!
//! let second = store.apply_now(&buckets, &charges, Op::SPEND).unwrap();
//! assert!(!second.allowed, "the ceiling holds no token");
//! // Nothing was spent from the key's bucket: it still holds 9.
//! assert_eq!(second.verdicts[0].remaining, 9);
//! ```

pub mod breaker;
pub mod deny_cache;
pub mod fallback;
pub mod journal;
pub mod layer;
pub mod lease;
pub mod memory;
pub mod record_id;
pub mod redis;
pub mod reservation;
pub mod shares;
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
pub use shares::{Share, ShareAsk};

/// What a bucket is, besides whose: a rule's bucket (per key or per
/// tenant, rate or concurrency, enforced or shadow), an Envoy API counter,
/// or a set of records. Part of the bucket's identity, and written into
/// its name as a short tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BucketKind {
    /// A limits-table rule's bucket.
    Rule {
        /// One bucket per key (else one per tenant).
        per_key: bool,
        /// A concurrency cap's lease set (else a rate bucket).
        concurrency: bool,
        /// A shadow rule's (counted, never refusing).
        shadow: bool,
    },
    /// A limits-table quota's counter (a count per calendar period).
    Quota {
        /// One counter per key (else one per tenant).
        per_key: bool,
        /// A shadow rule's (counted, never refusing).
        shadow: bool,
    },
    /// A counter of the Envoy API: the descriptor's configured rule, or a
    /// limit override sent with the request.
    Envoy {
        /// A limit override's counter.
        overridden: bool,
    },
    /// One of a tenant's sets of records.
    Records(RecordSet),
}

/// A tenant's records of one kind, as a store keeps them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RecordSet {
    /// Reservation records ([`reservation::Reservations`]).
    Reservations,
    /// Leases ([`lease::Leases`]).
    Leases,
    /// The tenant's count of both, where records are capped per tenant.
    Count,
}

impl BucketKind {
    /// A per-key rate bucket of an enforced rule.
    pub const KEY: Self = Self::Rule {
        per_key: true,
        concurrency: false,
        shadow: false,
    };
    /// A tenant-wide rate bucket of an enforced rule.
    pub const TENANT: Self = Self::Rule {
        per_key: false,
        concurrency: false,
        shadow: false,
    };

    /// The tag written into bucket names. Stored state is named by it:
    /// these never change.
    pub fn tag(self) -> &'static str {
        match self {
            Self::Rule {
                per_key,
                concurrency,
                shadow,
            } => match (per_key, concurrency, shadow) {
                (true, false, false) => "k",
                (true, false, true) => "ks",
                (false, false, false) => "t",
                (false, false, true) => "ts",
                (true, true, false) => "kc",
                (true, true, true) => "kcs",
                (false, true, false) => "tc",
                (false, true, true) => "tcs",
            },
            Self::Quota { per_key, shadow } => match (per_key, shadow) {
                (true, false) => "kq",
                (true, true) => "kqs",
                (false, false) => "tq",
                (false, true) => "tqs",
            },
            Self::Envoy { .. } => "e",
            Self::Records(RecordSet::Reservations) => "r",
            Self::Records(RecordSet::Leases) => "l",
            Self::Records(RecordSet::Count) => "rq",
        }
    }
}

/// One bucket's identity: tenant, kind, resource and key, built once (by
/// the engine, from a rule; or by a record's id) and rendered once as its
/// name, `tenant:tag:resource:key`. Tenants and resources cannot contain
/// `:` and the key comes last, so the name is unambiguous; the parts are
/// kept beside it, never parsed back out of it.
///
/// As small as the name alone was (24 bytes): a million buckets in memory
/// pay for nothing else. Offsets are 16-bit: the engine bounds names to
/// `MAX_BUCKET_BYTES` (`tollgate_engine::engine::caps`).
#[derive(Clone)]
pub struct BucketKey {
    name: Box<str>,
    kind: BucketKind,
    tenant_len: u16,
    key_at: u16,
}

/// The key part of an Envoy limit override's counter.
const OVERRIDE: &str = "override:";

impl BucketKey {
    /// The bucket of `kind` for `tenant`, `resource` and `key` (`key` empty
    /// for a tenant-wide bucket).
    pub fn new(tenant: &str, kind: BucketKind, resource: &str, key: &str) -> Self {
        let tag = kind.tag();
        let prefix = match kind {
            BucketKind::Envoy { overridden: true } => OVERRIDE,
            _ => "",
        };
        let mut name = String::with_capacity(
            tenant.len() + tag.len() + resource.len() + prefix.len() + key.len() + 3,
        );
        for part in [tenant, ":", tag, ":", resource, ":"] {
            name.push_str(part);
        }
        let key_at = name.len() + prefix.len();
        name.push_str(prefix);
        name.push_str(key);
        Self {
            kind,
            tenant_len: u16::try_from(tenant.len()).unwrap_or(u16::MAX),
            key_at: u16::try_from(key_at).unwrap_or(u16::MAX),
            name: name.into_boxed_str(),
        }
    }

    /// A quota counter's key from its name (`tenant:tag:resource:key`): a
    /// quota rule's or an Envoy descriptor's; `None` for any other name.
    /// Journals name counters ([`journal`]); every other bucket is named,
    /// never parsed.
    pub fn parse(name: &str) -> Option<Self> {
        let mut parts = name.splitn(4, ':');
        let (tenant, tag, resource, key) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if tag == "e" {
            return Some(match key.strip_prefix(OVERRIDE) {
                Some(key) => Self::new(
                    tenant,
                    BucketKind::Envoy { overridden: true },
                    resource,
                    key,
                ),
                None => Self::new(
                    tenant,
                    BucketKind::Envoy { overridden: false },
                    resource,
                    key,
                ),
            });
        }
        let kind = [(true, false), (true, true), (false, false), (false, true)]
            .into_iter()
            .map(|(per_key, shadow)| BucketKind::Quota { per_key, shadow })
            .find(|k| k.tag() == tag)?;
        Some(Self::new(tenant, kind, resource, key))
    }

    /// The rendered name.
    pub fn as_str(&self) -> &str {
        &self.name
    }

    /// What the bucket is.
    pub fn kind(&self) -> BucketKind {
        self.kind
    }

    /// The key part (empty for a tenant-wide bucket).
    pub fn key(&self) -> &str {
        self.name.get(self.key_at as usize..).unwrap_or_default()
    }

    /// True for a per-key rule bucket or quota counter.
    pub fn is_per_key(&self) -> bool {
        matches!(
            self.kind,
            BucketKind::Rule { per_key: true, .. } | BucketKind::Quota { per_key: true, .. }
        )
    }

    /// The resource part.
    pub fn resource(&self) -> &str {
        let from = self.tenant_len as usize + self.kind.tag().len() + 2;
        let to = (self.key_at as usize).saturating_sub(1);
        let name = self.name.get(..to).unwrap_or_default();
        let resource = name.get(from..).unwrap_or_default();
        resource.strip_suffix(":override").unwrap_or(resource)
    }

    /// The tenant part.
    pub fn tenant(&self) -> &str {
        self.name
            .get(..self.tenant_len as usize)
            .unwrap_or_default()
    }
}

impl PartialEq for BucketKey {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

impl Eq for BucketKey {}

impl std::hash::Hash for BucketKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.name.hash(state);
    }
}

/// An empty name, which no bucket has: what a bucket moved out of a
/// demand's line leaves behind. It allocates nothing (a decision takes one
/// per bucket); its tenant, resource and key are empty.
impl Default for BucketKey {
    fn default() -> Self {
        Self {
            name: Box::default(),
            kind: BucketKind::KEY,
            tenant_len: 0,
            key_at: 0,
        }
    }
}

impl fmt::Debug for BucketKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.name, f)
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

/// The future of [`Store::share`].
pub type ShareFuture<'a> = Pin<Box<dyn Future<Output = Result<Share, StoreError>> + Send + 'a>>;

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
    /// [`crate::algorithm::plan()`]): a decision spends only when spending
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

    /// Reports a member's demand to a share table and answers its grant,
    /// atomically ([`shares`]).
    fn share<'a>(&'a self, _ask: ShareAsk<'a>) -> ShareFuture<'a> {
        Box::pin(async {
            Err(StoreError::Unsupported(format!(
                "the {} store keeps no share tables",
                self.kind()
            )))
        })
    }

    /// Checks that the store answers.
    fn ping(&self) -> PingFuture<'_>;

    /// A short name for logs and metrics: `memory`, `redis`, ...
    fn kind(&self) -> &'static str;

    /// Health and figures, for the admin port and metrics.
    fn status(&self) -> StoreStatus;
}

/// What a rule does when the shared store cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnStoreUnavailable {
    /// Fail open: admit (a rule's default).
    #[default]
    Allow,
    /// Fail closed: reject.
    Deny,
    /// Decide with in-process buckets.
    Local,
}

impl std::str::FromStr for OnStoreUnavailable {
    type Err = String;

    /// `allow`, `deny` or `local`, as the limits table writes it.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "allow" => Ok(Self::Allow),
            "deny" => Ok(Self::Deny),
            "local" => Ok(Self::Local),
            _ => {
                // At most 128 bytes of the value, as every row error quotes.
                let end = (0..=s.len().min(128))
                    .rev()
                    .find(|&i| s.is_char_boundary(i))
                    .unwrap_or(0);
                let shown = if end < s.len() {
                    format!("{}... ({} bytes)", &s[..end], s.len())
                } else {
                    s.to_owned()
                };
                Err(format!(
                    "on_store_unavailable is {shown:?}; it must be one of allow, deny, local"
                ))
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_keeps_its_parts_beside_its_name() {
        let shadow_cap = BucketKind::Rule {
            per_key: true,
            concurrency: true,
            shadow: true,
        };
        // A key may hold ':' (it comes last); the parts are never parsed
        // back out of the name.
        let b = BucketKey::new("acme", shadow_cap, "search", "user:42:x");
        assert_eq!(b.as_str(), "acme:kcs:search:user:42:x");
        assert_eq!(
            (b.tenant(), b.key(), b.kind()),
            ("acme", "user:42:x", shadow_cap)
        );
        assert_eq!(b.resource(), "search");
        assert!(b.is_per_key());
        let t = BucketKey::new("", BucketKind::TENANT, "", "");
        assert_eq!((t.as_str(), t.tenant(), t.key()), (":t::", "", ""));
        assert_eq!(t.resource(), "");
        assert!(!t.is_per_key());
        // What a bucket moved out of a line leaves: no name, no parts.
        let empty = BucketKey::default();
        assert_eq!(
            (
                empty.as_str(),
                empty.tenant(),
                empty.resource(),
                empty.key()
            ),
            ("", "", "", "")
        );
        // An Envoy override's bucket is apart from the rule's of the same
        // counter.
        let rule = BucketKey::new(
            "~d",
            BucketKind::Envoy { overridden: false },
            "fixed",
            "a_b",
        );
        let over = BucketKey::new("~d", BucketKind::Envoy { overridden: true }, "fixed", "a_b");
        assert_eq!(rule.as_str(), "~d:e:fixed:a_b");
        assert_eq!(over.as_str(), "~d:e:fixed:override:a_b");
        assert_eq!(over.key(), "a_b");
        assert_eq!((rule.resource(), over.resource()), ("fixed", "fixed"));
        let bare = BucketKey::new("~d", BucketKind::Envoy { overridden: true }, "", "k");
        assert_eq!(bare.resource(), "");
        for b in [&rule, &over, &bare] {
            assert_eq!(BucketKey::parse(b.as_str()).as_ref(), Some(b));
            assert_eq!(BucketKey::parse(b.as_str()).unwrap().kind(), b.kind());
        }
        assert_eq!(BucketKey::parse("acme:k::alice"), None);
        assert_ne!(rule, over);
        let records = BucketKey::new(
            "acme",
            BucketKind::Records(RecordSet::Reservations),
            "",
            "n1",
        );
        assert_eq!(records.as_str(), "acme:r::n1");
    }

    #[test]
    fn every_rule_kind_has_its_own_tag() {
        let mut tags = std::collections::HashSet::new();
        for bits in 0..8u8 {
            let kind = BucketKind::Rule {
                per_key: bits & 1 != 0,
                concurrency: bits & 2 != 0,
                shadow: bits & 4 != 0,
            };
            assert!(tags.insert(kind.tag()), "{kind:?}");
        }
        for bits in 0..4u8 {
            let kind = BucketKind::Quota {
                per_key: bits & 1 != 0,
                shadow: bits & 2 != 0,
            };
            assert!(tags.insert(kind.tag()), "{kind:?}");
        }
        let quota = BucketKey::new(
            "acme",
            BucketKind::Quota {
                per_key: true,
                shadow: false,
            },
            "",
            "k1",
        );
        assert_eq!(quota.as_str(), "acme:kq::k1");
        assert!(quota.is_per_key());
        assert!(tags.insert(BucketKind::Envoy { overridden: true }.tag()));
        for set in [RecordSet::Reservations, RecordSet::Leases, RecordSet::Count] {
            assert!(tags.insert(BucketKind::Records(set).tag()), "{set:?}");
        }
        assert_eq!(std::mem::size_of::<BucketKey>(), 24);
        assert_eq!(BucketKind::KEY.tag(), "k");
        assert_eq!(BucketKind::TENANT.tag(), "t");
    }
}
