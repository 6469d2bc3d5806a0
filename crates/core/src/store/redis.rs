//! The Redis store: one truth across instances.
//!
//! Every decision is one `EVALSHA` of `lua/token_bucket.lua`, which reads,
//! decides and writes all of the request's buckets atomically; `NOSCRIPT`
//! (after a restart or failover) is answered by loading the script and
//! retrying, transparently. Connections are multiplexed: concurrent
//! decisions are pipelined on one connection per Redis node.
//!
//! Which node serves a key is `topology`'s business (a single Redis, a
//! Redis Cluster's slot map, or the primary Redis Sentinel names); health
//! is each `node`'s: every node has its own circuit breaker, so a dead
//! shard's calls fail at once while the other shards' go on.
//!
//! With coalescing on ([`RedisConfig::coalesce`]), decisions that arrive
//! while earlier script calls are in flight wait and go together, up to that
//! many in one `EVALSHA` (per hash tag on a cluster). The script decides
//! them one after another in arrival order, each all-or-nothing on its own
//! and seeing what the earlier ones wrote, at one instant: the verdicts are
//! those of the same decisions made one at a time. Nothing waits for a
//! timer: an idle service sends each decision at once.
//!
//! Key format: `PREFIX{TENANT}:SCOPE:RESOURCE:KEY`, for example
//! `tollgate:{acme}:k::alice` (per-key bucket, any resource) or
//! `tollgate:{acme}:t:exports:` (the tenant's ceiling on exports). The
//! default tenant (`''`) is written `{@default}`; `@` cannot occur in tenant
//! names. The hash tag is the tenant, so all of a request's buckets live in
//! one Redis Cluster slot. A batch whose items belong to different tenants
//! spans slots and is refused on a cluster (it works on a single Redis).
//!
//! Time comes from Redis's own clock (`TIME`, read inside the script), so
//! instances with skewed clocks agree. Tests can pin it with a [`Clock`].
//!
//! Every decision has a deadline, the store's timeout from when it was
//! asked, which covers its wait for a coalesced call and that call's
//! redirects and retries; a call carrying several decisions runs by the
//! earliest of theirs (see `coalesce` for the one exception). The
//! store-unavailable fallback is a layer around this store
//! (`super::fallback`, composed in `super::stack`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use parking_lot::Mutex;
use smallvec::SmallVec;
use tokio::time::Instant;

mod coalesce;
mod conn;
mod exec;
mod journal;
mod keys;
mod node;
mod script;
mod topology;
mod url;
mod usual;

use node::Answer;
use script::{Kind, Reply, Request, record_body};
use topology::{Topology as Routes, slot_of};

use super::reservation::MAX_TTL;
use super::{
    Attachment, BucketKey, LeaseAnswer, LeaseId, LeaseOp, LeaseStatus, RecordsFull, ReservationId,
    SettleFuture, Settled, Store, StoreError, StoreFuture, Verdicts, lease, redact,
};
use crate::algorithm::{Charge, Micros, Op};
use crate::clock::Clock;
use crate::telemetry::metrics;

/// Prefix of every key unless configured otherwise.
pub const DEFAULT_PREFIX: &str = "tollgate:";
/// Longest wait for one decision's answer unless configured otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(100);
/// Most decisions coalesced into one script call unless configured otherwise.
pub const DEFAULT_COALESCE: usize = 64;

/// The decision script.
pub const TOKEN_BUCKET_LUA: &str = include_str!("../../../../lua/token_bucket.lua");

/// The share table script ([`super::shares`]).
pub const SHARES_LUA: &str = include_str!("../../../../lua/shares.lua");

/// How to reach Redis and how patient to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisConfig {
    /// `redis://[user:password@]host:port[/db]`, `rediss://…` (TLS),
    /// `redis-cluster://[user:password@]host:port,host:port,…` (also
    /// `rediss-cluster://`), or
    /// `redis-sentinel://[user:password@]host:port,…/SERVICE[/db]` (also
    /// `rediss-sentinel://`) for the primary that Redis Sentinel names.
    pub url: String,
    /// Prefix of every key.
    pub prefix: String,
    /// Longest wait for one store call.
    pub timeout: Duration,
    /// Added to each bucket's expiry, past the moment it is full again.
    pub expiry_margin: Duration,
    /// A PEM file of the CA that signed the Redis server's certificate, for
    /// `rediss://` with a private CA (otherwise the built-in web roots).
    pub ca_cert: Option<std::path::PathBuf>,
    /// Most decisions coalesced into one script call; 0 or 1 sends each
    /// decision in its own call.
    pub coalesce: usize,
    /// Consecutive failed calls to one node that open its circuit breaker.
    pub breaker_threshold: u32,
    /// How long an open breaker answers at once before probing its node.
    pub breaker_cooldown: Duration,
    /// Spread each tenant's per-key buckets over the cluster's slots (hash
    /// tag per key) instead of keeping all of a tenant's keys on one slot.
    /// Decisions that spend must then touch one key's buckets (a
    /// tenant-wide bucket beside them comes from `--token-slices`), and
    /// reservations and leases cannot span a per-key and a tenant-wide
    /// bucket.
    pub spread_keys: bool,
    /// Most reservation records one tenant holds at once (with
    /// `spread_keys`, per tenant and slot); `None`: bounded only by the
    /// tokens the tenant may reserve.
    pub max_records_per_tenant: Option<usize>,
    /// Keep a quota journal ([`crate::store::journal`]) beside the
    /// counters, for the usage ledger.
    pub journal: bool,
}

impl RedisConfig {
    /// Defaults for `url`: prefix `tollgate:`, 100 ms timeout, 1 s expiry
    /// margin, up to 64
    /// concurrent decisions coalesced into one script call.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            prefix: DEFAULT_PREFIX.into(),
            timeout: DEFAULT_TIMEOUT,
            expiry_margin: Duration::from_secs(1),
            ca_cert: None,
            coalesce: DEFAULT_COALESCE,
            breaker_threshold: super::breaker::DEFAULT_THRESHOLD,
            breaker_cooldown: super::breaker::DEFAULT_COOLDOWN,
            spread_keys: false,
            max_records_per_tenant: None,
            journal: false,
        }
    }

    /// True for a Redis Cluster URL.
    pub fn is_cluster(&self) -> bool {
        self.url.starts_with("redis-cluster://") || self.url.starts_with("rediss-cluster://")
    }

    /// The URL with any password hidden, for logs.
    pub fn redacted_url(&self) -> String {
        redact(&self.url)
    }

    /// Checks the URL's form without connecting.
    pub fn validate(&self) -> Result<(), String> {
        self.topology().map(|_| ())
    }

    fn topology(&self) -> Result<url::Url, String> {
        url::parse(&self.url, &self.redacted_url())
    }
}

/// Buckets in Redis or a Redis Cluster.
pub struct RedisStore {
    shared: Arc<Shared>,
}

/// What the store and the tasks that drain its queue share.
struct Shared {
    routes: Arc<Routes>,
    script: redis::Script,
    config: RedisConfig,
    clock: Option<Arc<dyn Clock>>,
    /// Reservations this instance made, by when they expire: checked by
    /// [`RedisStore::count_expired`].
    expiring: Mutex<BinaryHeap<Reverse<(tokio::time::Instant, String)>>>,
    /// Quota journals script calls appended to.
    pending: journal::Pending,
}

/// Most reservations and leases one instance tracks for
/// `tollgate_reservations_expired_total` and `tollgate_leases_expired_total`;
/// past this, new ones are not tracked (the metric then undercounts).
const MAX_TRACKED_RESERVATIONS: usize = 100_000;

/// Most expired reservations checked per [`RedisStore::count_expired`].
const EXPIRY_CHECKS_PER_CALL: usize = 1_000;

impl RedisStore {
    /// A store for `config`. Does not connect: the first call does, so the
    /// service can start while Redis is still unreachable. `clock` pins the
    /// time for tests; `None` uses Redis's own clock.
    pub fn new(config: RedisConfig, clock: Option<Arc<dyn Clock>>) -> Result<Self, StoreError> {
        // rustls needs one process-wide crypto provider for rediss://; an
        // error only means one is installed already.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let ca_cert = match &config.ca_cert {
            Some(path) => Some(std::fs::read(path).map_err(|e| {
                StoreError::Config(format!("Redis CA certificate {}: {e}", path.display()))
            })?),
            None => None,
        };
        let routes = Routes::new(&config, ca_cert)?;
        let shared = Shared {
            routes,
            script: redis::Script::new(TOKEN_BUCKET_LUA),
            expiring: Mutex::default(),
            pending: journal::Pending::default(),
            config,
            clock,
        };
        Ok(Self {
            shared: Arc::new(shared),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RedisConfig {
        &self.shared.config
    }

    /// The Redis key of a bucket (see the module docs).
    pub fn redis_key(&self, bucket: &BucketKey) -> String {
        self.shared.redis_key(bucket)
    }

    /// Sends PING (with the timeout).
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.shared.ping().await
    }

    async fn decide(
        &self,
        buckets: &[BucketKey],
        charges: &[Charge],
        op: Op,
        attach: Option<&Attachment>,
    ) -> Result<Verdicts, StoreError> {
        let shared = &self.shared;
        if shared.routes.is_cluster() {
            let tenant = buckets[0].tenant();
            if let Some(other) = buckets.iter().find(|b| b.tenant() != tenant) {
                return Err(StoreError::Unsupported(format!(
                    "on a Redis Cluster one call can only touch one tenant's buckets, \
                     but this one touches tenants {tenant:?} and {:?}; send them in separate calls",
                    other.tenant()
                )));
            }
        }
        let mut keys: SmallVec<[String; 4]> = buckets.iter().map(|b| shared.redis_key(b)).collect();
        let split = |keys: &[String]| {
            shared.config.spread_keys
                && keys[1..]
                    .iter()
                    .any(|k| coalesce::hash_tag(k) != coalesce::hash_tag(&keys[0]))
        };
        if split(&keys)
            && matches!(
                (op, attach),
                (Op::DRY | Op::Charge | Op::Refund { .. }, None)
            )
        {
            // Reads and unconditional charges and refunds need no atomicity
            // across slots: each slot's part is applied on its own.
            // Boxed, as is the uncoalesced call in `send`: their state would
            // otherwise enlarge every decision's future, which the store
            // moves into a box of its own per decision.
            return Box::pin(self.decide_per_slot(buckets, charges, op, &keys)).await;
        }
        let kind = match (op, attach) {
            (_, Some(Attachment::Lease(lease))) => {
                if buckets.iter().any(|b| b.tenant() != lease.id.tenant()) {
                    return Err(StoreError::Unsupported(
                        "a lease holds one tenant's caps; acquire each tenant's slots separately"
                            .into(),
                    ));
                }
                keys.push(shared.lease_key(&lease.id));
                Kind::Acquire {
                    ttl: lease.ttl.min(lease::MAX_TTL),
                    member: lease.id.member(),
                }
            }
            (_, Some(Attachment::Reservation(r))) => {
                if buckets.iter().any(|b| b.tenant() != r.id.tenant()) {
                    return Err(StoreError::Unsupported(
                        "a reservation holds one tenant's buckets; reserve each tenant's items separately"
                            .into(),
                    ));
                }
                let body = record_body(&keys, charges, r);
                keys.push(shared.record_key(&r.id));
                if shared.config.max_records_per_tenant.is_some() {
                    keys.push(shared.records_key(&r.id));
                }
                Kind::Reserve {
                    ttl: r.ttl.min(MAX_TTL),
                    body,
                }
            }
            (Op::Decide { spend }, None) => Kind::Decide { spend },
            (Op::Charge, None) => Kind::Charge,
            (Op::Refund { since }, None) => Kind::Refund { since },
            (Op::Acquire { .. }, None) => {
                return Err(StoreError::Unsupported(
                    "leases are taken by acquiring one".into(),
                ));
            }
        };
        if split(&keys) {
            return Err(StoreError::Unsupported(
                "with --redis-spread-keys, a decision that spends, a reservation or a lease \
                 must touch one key's buckets (tenant-wide buckets come from --token-slices, \
                 and reservations and leases cannot mix them with per-key ones); \
                 send each key in its own call"
                    .into(),
            ));
        }
        let tracked = match (&kind, keys.last()) {
            (Kind::Reserve { ttl, .. } | Kind::Acquire { ttl, .. }, Some(record)) => {
                Some((*ttl, record.clone()))
            }
            _ => None,
        };
        let request = Box::new(Request {
            keys,
            charges: charges.iter().copied().collect(),
            kind,
        });
        match shared.send(request).reply(shared.config.timeout).await? {
            Reply::Verdicts(v) => {
                if let (true, Some((ttl, record))) = (v.allowed, tracked) {
                    shared.track(ttl, record);
                }
                Ok(v)
            }
            Reply::RecordsFull { held } => {
                metrics::store_error("redis", "too_many_records");
                let cap = shared.config.max_records_per_tenant.unwrap_or_default();
                Err(StoreError::TooManyRecords(
                    RecordsFull {
                        tenant: buckets[0].tenant().to_owned(),
                        held: held as usize,
                        why: format!("the cap of {cap} per tenant"),
                        flag: "--max-records-per-tenant",
                    }
                    .to_string(),
                ))
            }
            Reply::Settled(_) | Reply::Lease(_) => Err(StoreError::Protocol(
                "token_bucket.lua answered a decision as a settle or a lease".into(),
            )),
        }
    }

    /// A dry run, a charge or a refund over buckets on several slots
    /// (`--redis-spread-keys`): one call per slot, verdicts in order.
    async fn decide_per_slot(
        &self,
        buckets: &[BucketKey],
        charges: &[Charge],
        op: Op,
        keys: &[String],
    ) -> Result<Verdicts, StoreError> {
        let mut verdicts = vec![crate::algorithm::Verdict::admitted(); buckets.len()];
        let mut allowed = true;
        let mut done = vec![false; buckets.len()];
        for first in 0..buckets.len() {
            if done[first] {
                continue;
            }
            let tag = coalesce::hash_tag(&keys[first]);
            let group: SmallVec<[usize; 4]> = (first..buckets.len())
                .filter(|&i| !done[i] && coalesce::hash_tag(&keys[i]) == tag)
                .collect();
            let kind = match op {
                Op::Decide { spend } => Kind::Decide { spend },
                Op::Refund { since } => Kind::Refund { since },
                _ => Kind::Charge,
            };
            let request = Box::new(Request {
                keys: group.iter().map(|&i| keys[i].clone()).collect(),
                charges: group.iter().map(|&i| charges[i]).collect(),
                kind,
            });
            match self
                .shared
                .send(request)
                .reply(self.shared.config.timeout)
                .await?
            {
                Reply::Verdicts(v) => {
                    allowed &= v.allowed;
                    for (&i, verdict) in group.iter().zip(v.verdicts) {
                        verdicts[i] = verdict;
                        done[i] = true;
                    }
                }
                Reply::Settled(_) | Reply::Lease(_) | Reply::RecordsFull { .. } => {
                    return Err(StoreError::Protocol(
                        "token_bucket.lua answered a decision as a settle or a lease".into(),
                    ));
                }
            }
        }
        Ok(Verdicts { allowed, verdicts })
    }

    async fn lease_at(&self, id: &LeaseId, op: LeaseOp) -> Result<LeaseAnswer, StoreError> {
        let shared = &self.shared;
        let op = match op {
            LeaseOp::Renew { ttl } => LeaseOp::Renew {
                ttl: ttl.min(lease::MAX_TTL),
            },
            release => release,
        };
        let request = Box::new(Request {
            keys: smallvec::smallvec![shared.lease_key(id)],
            charges: SmallVec::new(),
            kind: Kind::Lease(op),
        });
        match shared.send(request).reply(shared.config.timeout).await? {
            Reply::Lease(answer) => {
                if let (LeaseOp::Renew { ttl }, LeaseStatus::Done) = (op, answer.status) {
                    shared.track(ttl, shared.lease_key(id));
                }
                Ok(answer)
            }
            _ => Err(StoreError::Protocol(
                "token_bucket.lua answered a lease operation as something else".into(),
            )),
        }
    }

    /// Reports to a share table: `shares.lua` on the node holding it.
    async fn share_at(&self, ask: super::ShareAsk<'_>) -> Result<super::Share, StoreError> {
        let shared = &self.shared;
        let bucket = shared.redis_key(ask.table);
        // `PREFIX{TAG}:sh:REST`: beside the bucket, under its hash tag, and
        // named apart from every bucket (no bucket's tag is `sh`).
        let at = bucket.find("}:").map_or(0, |i| i + 2);
        let key = format!("{}sh:{}", &bucket[..at], &bucket[at..]);
        let now = self
            .shared
            .clock
            .as_ref()
            .map(|c| c.now().to_string())
            .unwrap_or_default();
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(SHARES_LUA)
            .arg(1)
            .arg(&key)
            .arg(ask.member)
            .arg(ask.weight.clamp(1, super::shares::MAX_WEIGHT))
            .arg(ask.ttl)
            .arg(super::shares::MAX_MEMBERS)
            .arg(now);
        let reply: Vec<i64> = shared.exec_as("share", &key, &cmd).await?;
        match reply.as_slice() {
            [ppm, members, full, waiting] => Ok(super::Share {
                ppm: (*ppm).clamp(0, super::shares::PPM as i64) as u64,
                members: (*members).max(0) as u64,
                full: *full == 1,
                waiting: *waiting == 1,
            }),
            _ => Err(StoreError::Protocol(format!(
                "shares.lua answered {} values, not 4",
                reply.len()
            ))),
        }
    }

    async fn settle_at(&self, id: &ReservationId, actual: u64) -> Result<Settled, StoreError> {
        let shared = &self.shared;
        let request = Box::new(Request {
            keys: smallvec::smallvec![shared.record_key(id)],
            charges: SmallVec::new(),
            kind: Kind::Settle { actual },
        });
        match shared.send(request).reply(shared.config.timeout).await? {
            Reply::Settled(s) => Ok(s),
            _ => Err(StoreError::Protocol(
                "token_bucket.lua answered a settle as something else".into(),
            )),
        }
    }
}

impl RedisStore {
    /// Counts, in `tollgate_reservations_expired_total`, the reservations
    /// this instance made whose time to live has passed (by a second, so
    /// that Redis's clock agrees) and whose record is still unsettled, and
    /// in `tollgate_leases_expired_total` the leases it granted or last
    /// renewed that expired unreleased; at
    /// most a fixed number per call. The server calls it on its
    /// sweep interval. Returns how many it found expired.
    pub async fn count_expired(&self) -> u64 {
        let now = tokio::time::Instant::now();
        let due: Vec<String> = {
            let mut expiring = self.shared.expiring.lock();
            let mut due = Vec::new();
            while due.len() < EXPIRY_CHECKS_PER_CALL
                && expiring.peek().is_some_and(|Reverse((at, _))| *at <= now)
            {
                if let Some(Reverse((_, record))) = expiring.pop() {
                    due.push(record);
                }
            }
            due
        };
        let shared = &self.shared;
        let checks = due.iter().map(|record| async move {
            let value: Option<String> = shared
                .exec_as(
                    "record_expiry",
                    record,
                    &redis::cmd("GET").arg(record).clone(),
                )
                .await?;
            let pttl: i64 = shared
                .exec_as(
                    "record_expiry",
                    record,
                    &redis::cmd("PTTL").arg(record).clone(),
                )
                .await?;
            Ok::<_, StoreError>((value, pttl))
        });
        // A lease's record lives its time to live plus the grace period
        // and the margin: with more left than that, it was renewed (and
        // whoever renewed it checks it at its new expiry).
        let grace_ms = (lease::EXPIRED_GRACE / 1000) as i64
            + self.shared.config.expiry_margin.as_millis() as i64;
        let (mut expired, mut leases) = (0, 0);
        for check in futures_util::future::join_all(checks).await {
            match check {
                Ok((Some(value), _)) if value.starts_with("P ") => expired += 1,
                Ok((Some(value), pttl)) if value.starts_with("L ") && pttl <= grace_ms => {
                    leases += 1
                }
                _ => {}
            }
        }
        metrics::leases_expired(leases);
        metrics::reservations_expired(expired);
        expired
    }
}

impl Shared {
    /// Remembers a reservation to check once its time to live has passed.
    fn track(&self, ttl: Micros, record: String) {
        let mut expiring = self.expiring.lock();
        if expiring.len() < MAX_TRACKED_RESERVATIONS {
            let at =
                tokio::time::Instant::now() + Duration::from_micros(ttl) + Duration::from_secs(1);
            expiring.push(Reverse((at, record)));
        }
    }

    /// Sends one request, coalesced with others bound for the same node
    /// when coalescing is on. What can be done before any wait (routing by
    /// the current map, joining the node's queue) is done here, so the
    /// request is moved once and the future holds no copy of it; callers
    /// await [`Sending::reply`] at once. (Returning that future from here
    /// instead would move it once more: 170 instructions per decision.)
    fn send(self: &Arc<Self>, request: Box<Request>) -> Sending<'_> {
        if self.config.coalesce > 1 {
            let deadline = Instant::now() + self.config.timeout;
            // Outside a cluster one primary serves every slot.
            let slot = if self.routes.is_cluster() {
                slot_of(&request.keys[0])
            } else {
                0
            };
            match self.routes.route_now(slot) {
                Some(node) if node.waiting.is_some() => {
                    return Sending::Joined(coalesce::join(self, node, request, deadline));
                }
                Some(_) => {}
                // No map names the slot's node yet: wait for one.
                None => {
                    return Sending::Other(Box::pin(async move {
                        let node = self.routes.route(slot, deadline).await?;
                        if node.waiting.is_some() {
                            return coalesce::join(self, node, request, deadline)
                                .answer(self.config.timeout)
                                .await;
                        }
                        self.run_one(&request).await
                    }));
                }
            }
        }
        Sending::Other(Box::pin(async move { self.run_one(&request).await }))
    }

    /// Sends one request in a call of its own.
    async fn run_one(self: &Arc<Self>, request: &Request) -> Result<Reply, StoreError> {
        let mut outcomes = self.run(std::slice::from_ref(request)).await?;
        Ok(outcomes.swap_remove(0))
    }

    /// Checks that Redis answers: the primary of a single or
    /// Sentinel-managed Redis, which also loads the decision script so that
    /// once the service is ready its first decision is one round trip; on a
    /// cluster, one primary (each loads the script on its first NOSCRIPT).
    async fn ping(&self) -> Result<(), StoreError> {
        let started = Instant::now();
        let deadline = started + self.config.timeout;
        let result = async {
            let node = self.routes.route(0, deadline).await?;
            let cmd = if self.routes.is_cluster() {
                redis::cmd("PING")
            } else {
                redis::cmd("SCRIPT")
                    .arg("LOAD")
                    .arg(TOKEN_BUCKET_LUA)
                    .clone()
            };
            match node.call(&cmd, false, deadline).await? {
                Answer::Value(_) => Ok(()),
                _ => Err(StoreError::Unavailable(format!(
                    "Redis node {} did not answer PING",
                    node.addr
                ))),
            }
        }
        .await;
        metrics::store_call("redis", "ping", started.elapsed());
        result
    }
}

/// A request on its way (see [`Shared::send`]).
enum Sending<'a> {
    /// In a node's coalescing.
    Joined(coalesce::Joined<'a>),
    /// Routed once the map names its node, or sent in a call of its own
    /// (coalescing off): rarer, and boxed, so that their state does not
    /// enlarge every decision's future.
    Other(Pin<Box<dyn Future<Output = Result<Reply, StoreError>> + Send + 'a>>),
}

impl Sending<'_> {
    /// The request's reply; `timeout` is the store's, for the message.
    async fn reply(self, timeout: Duration) -> Result<Reply, StoreError> {
        match self {
            Sending::Joined(joined) => joined.answer(timeout).await,
            Sending::Other(call) => call.await,
        }
    }
}

impl Store for RedisStore {
    fn apply<'a>(&'a self, r: super::Request<'a>) -> StoreFuture<'a> {
        let op = r.attachment.map_or(r.op, Attachment::op);
        Box::pin(self.decide(r.buckets, r.charges, op, r.attachment))
    }

    fn lease<'a>(&'a self, id: &'a LeaseId, op: LeaseOp) -> super::LeaseFuture<'a> {
        Box::pin(self.lease_at(id, op))
    }

    fn settle<'a>(&'a self, id: &'a ReservationId, actual: u64) -> SettleFuture<'a> {
        Box::pin(self.settle_at(id, actual))
    }

    fn share<'a>(&'a self, ask: super::ShareAsk<'a>) -> super::ShareFuture<'a> {
        Box::pin(self.share_at(ask))
    }

    fn ping(&self) -> super::PingFuture<'_> {
        Box::pin(RedisStore::ping(self))
    }

    fn kind(&self) -> &'static str {
        "redis"
    }

    fn status(&self) -> super::StoreStatus {
        let map = self.shared.routes.map();
        super::StoreStatus {
            kind: "redis",
            breaker: Some(topology::worst(&map)),
            nodes: map
                .primaries
                .iter()
                .map(|(node, slots, replicas)| super::NodeStatus {
                    address: node.addr.clone(),
                    slots: *slots,
                    replicas: replicas.clone(),
                    breaker: node.breaker_state(),
                    connected: node.connected(),
                    errors: node.errors(),
                })
                .collect(),
            local: None,
            answered: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::BucketKind;

    fn store(spread_keys: bool) -> RedisStore {
        let config = RedisConfig {
            spread_keys,
            ..RedisConfig::new("redis://127.0.0.1:1")
        };
        RedisStore::new(config, None).expect("a store needs no connection to name keys")
    }

    #[test]
    fn keys_carry_the_tenant_as_hash_tag_and_with_spread_keys_a_hash_of_the_key() {
        let plain = store(false);
        let spread = store(true);
        let per_key = BucketKey::new("acme", BucketKind::KEY, "search", "user-42");
        let tenant_wide = BucketKey::new("acme", BucketKind::TENANT, "search", "");
        let no_tenant = BucketKey::new("", BucketKind::KEY, "", "ip-1");
        assert_eq!(
            plain.redis_key(&per_key),
            "tollgate:{acme}:k:search:user-42"
        );
        assert_eq!(plain.redis_key(&tenant_wide), "tollgate:{acme}:t:search:");
        assert_eq!(plain.redis_key(&no_tenant), "tollgate:{@default}:k::ip-1");
        assert_eq!(
            spread.redis_key(&per_key),
            format!(
                "tollgate:{{acme/{:08x}}}:k:search:user-42",
                super::super::key_spread("user-42")
            )
        );
        assert_eq!(
            spread.redis_key(&BucketKey::new("acme", BucketKind::KEY, "", "")),
            "tollgate:{acme/811c9dc5}:k::",
            "the FNV-1a offset basis, zero-padded to eight digits, for an empty key"
        );
        assert_eq!(
            spread.redis_key(&tenant_wide),
            "tollgate:{acme}:t:search:",
            "tenant-wide buckets keep the tenant's tag"
        );
    }
}
