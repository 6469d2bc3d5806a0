//! Which Redis node serves which key, kept current beside the traffic.
//!
//! - A single Redis: one node, always.
//! - A Redis Cluster: a slot map (`CLUSTER NODES`: each primary's slots and
//!   its replicas) read from any node that answers. A `MOVED` reply updates
//!   its slot at once and asks for a full refresh; `ASK` and `TRYAGAIN` (a
//!   slot being migrated) are answered by the caller without touching the
//!   map.
//! - Redis Sentinel: the primary that the Sentinels name
//!   (`SENTINEL get-master-addr-by-name`), or, while that one fails, a
//!   replica of it that already says it is the primary (`ROLE`: Sentinel
//!   promotes a replica up to a second before it announces the switch).
//!
//! A refresher task re-reads the map (or asks the Sentinels) every
//! [`CALM_REFRESH`], every [`URGENT_REFRESH`] while a node is failing, and
//! when a caller asks (a redirect, a failure, a slot with no node yet).
//! Callers never wait for a refresh, except a first call that finds no map
//! at all; a refresh that finds a new primary for a failed one counts a
//! failover.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo, Value};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use super::RedisConfig;
use super::conn::Endpoint;
use super::node::{MAX_NODE_LABELS, Node};
use super::url::Url;
use crate::store::StoreError;
use crate::store::breaker::{Breaker, BreakerState};
use crate::telemetry::metrics;

/// Slots in a Redis Cluster.
pub(super) const SLOTS: usize = 16384;

/// The refresh period while every node is healthy.
pub(super) const CALM_REFRESH: Duration = Duration::from_secs(5);
/// The refresh period while a node fails (its breaker not closed) or no map
/// has been read yet.
pub(super) const URGENT_REFRESH: Duration = Duration::from_millis(250);
/// Least time between two refreshes, however often callers ask.
const MIN_REFRESH_GAP: Duration = Duration::from_millis(50);

/// How a node's connection is made.
struct Template {
    info: ConnectionInfo,
    /// `rediss://`: the TLS settings every node's connection uses.
    tls: Option<Arc<rustls::ClientConfig>>,
    timeout: Duration,
    breaker: (u32, Duration),
    coalesce: bool,
}

impl Template {
    /// How `host:port` is reached: over TLS when the URL says so, with
    /// the URL's credentials and database unless `auth` is false (a
    /// Sentinel is asked without the primary's).
    fn endpoint(&self, host: &str, port: u16, auth: bool) -> Endpoint {
        let settings = self.info.redis_settings();
        Endpoint {
            host: host.to_owned(),
            port,
            tls: self.tls.clone(),
            username: auth
                .then(|| settings.username().map(str::to_owned))
                .flatten(),
            password: auth
                .then(|| settings.password().map(str::to_owned))
                .flatten(),
            db: if auth { settings.db() } else { 0 },
        }
    }
}

/// What the store routes by.
#[derive(Clone)]
pub(super) struct Map {
    /// A cluster's node per slot (empty otherwise).
    slots: Vec<Option<Arc<Node>>>,
    /// The one primary of a single Redis or a Sentinel-managed one.
    primary: Option<Arc<Node>>,
    /// Each primary, its count of slots and its replicas' addresses.
    pub primaries: Vec<(Arc<Node>, usize, Vec<String>)>,
}

impl Map {
    fn empty() -> Self {
        Self {
            slots: Vec::new(),
            primary: None,
            primaries: Vec::new(),
        }
    }

    /// True when the node serving `slot` would refuse a call now (its
    /// breaker open).
    pub fn refuses(&self, slot: u16) -> bool {
        self.node(slot).is_some_and(|n| n.refuses())
    }

    fn node(&self, slot: u16) -> Option<Arc<Node>> {
        match &self.primary {
            Some(primary) => Some(primary.clone()),
            None => self.slots.get(usize::from(slot)).cloned().flatten(),
        }
    }
}

enum Mode {
    Standalone,
    Cluster {
        seeds: Vec<(String, u16)>,
    },
    Sentinel {
        sentinels: Vec<Arc<Node>>,
        service: String,
    },
}

/// See the module docs.
pub(super) struct Topology {
    mode: Mode,
    template: Template,
    /// Every node seen, by address: a node keeps its connection and its
    /// breaker across refreshes.
    nodes: Mutex<HashMap<String, Arc<Node>>>,
    map: ArcSwap<Map>,
    /// Bumped on every new map.
    generation: watch::Sender<u64>,
    wake: Arc<Notify>,
    refresher: AtomicBool,
}

impl Topology {
    pub fn new(config: &RedisConfig, ca_cert: Option<Vec<u8>>) -> Result<Arc<Self>, StoreError> {
        let bad = |e: &dyn std::fmt::Display| {
            StoreError::Config(format!("{}: {e}", config.redacted_url()))
        };
        let info_of = |url: &str| -> Result<ConnectionInfo, StoreError> {
            url.into_connection_info().map_err(|e| bad(&e))
        };
        let (mode, info, sentinel_addrs) = match config.topology().map_err(StoreError::Config)? {
            Url::Standalone(url) => (Mode::Standalone, info_of(&url)?, Vec::new()),
            Url::Cluster(urls) => {
                let infos = urls
                    .iter()
                    .map(|u| info_of(u))
                    .collect::<Result<Vec<_>, _>>()?;
                let seeds = infos.iter().filter_map(host_port).collect();
                (Mode::Cluster { seeds }, infos[0].clone(), Vec::new())
            }
            Url::Sentinel { sentinels, service } => {
                let infos = sentinels
                    .iter()
                    .map(|u| info_of(u))
                    .collect::<Result<Vec<_>, _>>()?;
                let addrs = infos.iter().filter_map(host_port).collect();
                let mode = Mode::Sentinel {
                    sentinels: Vec::new(),
                    service,
                };
                (mode, infos[0].clone(), addrs)
            }
        };
        let info = info.set_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true));
        let tls = match info.addr() {
            ConnectionAddr::TcpTls { insecure: true, .. } => {
                return Err(bad(
                    &"rediss:// with #insecure is not supported: give the server's CA with --redis-ca-cert",
                ));
            }
            ConnectionAddr::TcpTls { .. } => {
                Some(tls_config(ca_cert.as_deref()).map_err(|e| bad(&e))?)
            }
            _ => None,
        };
        let template = Template {
            info,
            tls,
            timeout: config.timeout,
            breaker: (config.breaker_threshold, config.breaker_cooldown),
            coalesce: config.coalesce > 1,
        };
        let mut topology = Self {
            mode,
            template,
            nodes: Mutex::default(),
            map: ArcSwap::from_pointee(Map::empty()),
            generation: watch::channel(0).0,
            wake: Arc::new(Notify::new()),
            refresher: AtomicBool::new(false),
        };
        match &mut topology.mode {
            Mode::Standalone => {
                let (host, port) = host_port(&topology.template.info)
                    .ok_or_else(|| bad(&"a single Redis is reached over TCP: host:port"))?;
                let node = topology.node(&host, port)?;
                topology.map.store(Arc::new(Map {
                    slots: Vec::new(),
                    primary: Some(node.clone()),
                    primaries: vec![(node, SLOTS, Vec::new())],
                }));
            }
            Mode::Sentinel { sentinels, .. } => {
                for (host, port) in sentinel_addrs {
                    // Sentinels are asked without the primary's credentials.
                    let endpoint = topology.template.endpoint(&host, port, false);
                    sentinels.push(Arc::new(Node::new(
                        format!("{host}:{port}"),
                        "sentinel".into(),
                        endpoint,
                        topology.template.timeout,
                        Breaker::new(1, Duration::ZERO),
                        false,
                    )));
                }
            }
            Mode::Cluster { .. } => {}
        }
        Ok(Arc::new(topology))
    }

    /// True for a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self.mode, Mode::Cluster { .. })
    }

    /// The current map.
    pub fn map(&self) -> Arc<Map> {
        self.map.load_full()
    }

    /// True when the node serving `slot` would refuse a call now (its
    /// breaker open).
    pub fn refuses(&self, slot: u16) -> bool {
        self.map.load().refuses(slot)
    }

    /// The node for `host:port`, made on first sight.
    fn node(&self, host: &str, port: u16) -> Result<Arc<Node>, StoreError> {
        let addr = format!("{host}:{port}");
        let mut nodes = self.nodes.lock();
        if let Some(node) = nodes.get(&addr) {
            return Ok(node.clone());
        }
        let label = if nodes.len() < MAX_NODE_LABELS {
            addr.clone()
        } else {
            "other".to_owned()
        };
        let (threshold, cooldown) = self.template.breaker;
        let node = Arc::new(Node::new(
            addr.clone(),
            label,
            self.template.endpoint(host, port, true),
            self.template.timeout,
            Breaker::new(threshold, cooldown),
            self.template.coalesce,
        ));
        nodes.insert(addr, node.clone());
        Ok(node)
    }

    /// The node for a redirect's `host:port`.
    pub fn node_at(&self, addr: &str) -> Result<Arc<Node>, StoreError> {
        let (host, port) = split_addr(addr).ok_or_else(|| {
            StoreError::Protocol(format!("Redis redirected to {addr:?}, not host:port"))
        })?;
        self.node(host, port)
    }

    /// The node serving `slot` in the map as it is now, if one does.
    pub fn route_now(&self, slot: u16) -> Option<Arc<Node>> {
        self.map.load().node(slot)
    }

    /// The node serving `slot`, waiting (until `deadline`) only when no map
    /// has been read yet.
    pub async fn route(
        self: &Arc<Self>,
        slot: u16,
        deadline: Instant,
    ) -> Result<Arc<Node>, StoreError> {
        if let Some(node) = self.route_now(slot) {
            return Ok(node);
        }
        // Subscribed before looking again, so a change in between is seen.
        let mut changed = self.generation.subscribe();
        loop {
            if let Some(node) = self.map.load().node(slot) {
                return Ok(node);
            }
            self.refresh_soon();
            if tokio::time::timeout_at(deadline, changed.changed())
                .await
                .is_err()
            {
                return Err(StoreError::Unavailable(match &self.mode {
                    Mode::Sentinel { service, .. } => {
                        format!("no Sentinel has named a primary for {service:?} yet")
                    }
                    _ => format!("no Redis Cluster node has claimed slot {slot} yet"),
                }));
            }
        }
    }

    /// After `MOVED slot addr`: points the slot at `addr` now, and asks
    /// for a full refresh.
    pub fn moved(self: &Arc<Self>, slot: u16, node: &Arc<Node>) {
        let map = self.map.load();
        if !map.slots.is_empty() && !map.node(slot).is_some_and(|n| Arc::ptr_eq(&n, node)) {
            let mut next = Map::clone(&map);
            next.slots[usize::from(slot)] = Some(node.clone());
            self.map.store(Arc::new(next));
            self.generation.send_modify(|g| *g += 1);
        }
        self.refresh_soon();
    }

    /// Asks the refresher for a refresh (starting it on first use).
    pub fn refresh_soon(self: &Arc<Self>) {
        if matches!(self.mode, Mode::Standalone) {
            return;
        }
        if !self.refresher.swap(true, Ordering::Relaxed) {
            tokio::spawn(refresher(Arc::downgrade(self), self.wake.clone()));
        }
        self.wake.notify_one();
    }

    /// Reads the map (or the Sentinels' answer) once. Returns true when a
    /// node is unhealthy or nothing could be read, so the refresher comes
    /// back soon.
    async fn refresh(self: &Arc<Self>) -> bool {
        let next = match &self.mode {
            Mode::Standalone => return false,
            Mode::Cluster { seeds } => self.read_slots(seeds).await,
            Mode::Sentinel { sentinels, service } => self.ask_sentinels(sentinels, service).await,
        };
        let Some(next) = next else {
            metrics::topology_refresh("failed");
            return true;
        };
        let old = self.map.load_full();
        let changed = differs(&old, &next);
        if changed {
            let failovers = match &self.mode {
                // Sentinel changes the primary only by failing over, so a
                // new one is a promotion even when the old map had not yet
                // listed that replica (Sentinel learns replicas from the
                // primary's INFO every 10 s).
                Mode::Sentinel { .. } => replaced(&old, &next),
                _ => failovers(&old, &next),
            };
            if failovers > 0 {
                tracing::warn!(
                    failovers,
                    "Redis failover: a replica now serves a failed primary's slots"
                );
                metrics::failovers(failovers);
            }
            self.map.store(Arc::new(next));
            self.generation.send_modify(|g| *g += 1);
        }
        metrics::topology_refresh(if changed { "changed" } else { "unchanged" });
        self.map
            .load()
            .primaries
            .iter()
            .any(|(node, _, _)| !node.healthy())
    }

    /// `CLUSTER NODES` from the first node that answers: healthy known
    /// primaries first, then the others, their replicas, then the URL's
    /// seeds.
    async fn read_slots(self: &Arc<Self>, seeds: &[(String, u16)]) -> Option<Map> {
        let map = self.map.load_full();
        let mut asked: Vec<Arc<Node>> = Vec::new();
        let mut candidates: Vec<Arc<Node>> =
            map.primaries.iter().map(|(n, _, _)| n.clone()).collect();
        candidates.sort_by_key(|n| !n.healthy());
        for replica in map.primaries.iter().flat_map(|(_, _, r)| r) {
            if let Ok(node) = self.node_at(replica) {
                candidates.push(node);
            }
        }
        for (host, port) in seeds {
            if let Ok(node) = self.node(host, *port) {
                candidates.push(node);
            }
        }
        for node in candidates {
            if asked.iter().any(|a| Arc::ptr_eq(a, &node)) {
                continue;
            }
            asked.push(node.clone());
            let deadline = Instant::now() + self.template.timeout;
            let ask = redis::cmd("CLUSTER").arg("NODES").clone();
            let text = match node.query(&ask, deadline).await {
                Ok(Value::BulkString(b)) => String::from_utf8(b).ok(),
                Ok(Value::VerbatimString { text, .. }) => Some(text),
                _ => None,
            };
            let asked_host = node.addr.rsplit_once(':').map_or("", |(h, _)| h);
            if let Some(next) = text.and_then(|t| self.parse_nodes(&t, asked_host)) {
                return Some(next);
            }
        }
        None
    }

    /// A map from `CLUSTER NODES`: each primary's slot ranges, and which
    /// nodes replicate it. `None` when the answer covers no slot.
    fn parse_nodes(&self, text: &str, asked_host: &str) -> Option<Map> {
        struct Line<'a> {
            id: &'a str,
            addr: (String, u16),
            master: bool,
            of: &'a str,
            ranges: Vec<(usize, usize)>,
        }
        let mut lines = Vec::new();
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 8 || f[2].contains("noaddr") || f[2].contains("handshake") {
                continue;
            }
            let endpoint = f[1].split(['@', ',']).next().unwrap_or_default();
            let Some((host, port)) = split_addr(endpoint) else {
                continue;
            };
            let host = if host.is_empty() { asked_host } else { host };
            let ranges = f[8..]
                .iter()
                .filter(|r| !r.starts_with('['))
                .filter_map(|r| {
                    let (a, b) = r.split_once('-').unwrap_or((r, r));
                    let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                    (a <= b && b < SLOTS).then_some((a, b))
                })
                .collect();
            lines.push(Line {
                id: f[0],
                addr: (host.to_owned(), port),
                master: f[2].contains("master"),
                of: f[3],
                ranges,
            });
        }
        let mut slots: Vec<Option<Arc<Node>>> = vec![None; SLOTS];
        let mut primaries: Vec<(Arc<Node>, usize, Vec<String>)> = Vec::new();
        for line in lines.iter().filter(|l| l.master && !l.ranges.is_empty()) {
            let node = self.node(&line.addr.0, line.addr.1).ok()?;
            let mut count = 0;
            for &(a, b) in &line.ranges {
                for slot in &mut slots[a..=b] {
                    *slot = Some(node.clone());
                }
                count += b - a + 1;
            }
            let replicas = lines
                .iter()
                .filter(|r| !r.master && r.of == line.id)
                .map(|r| format!("{}:{}", r.addr.0, r.addr.1))
                .collect();
            primaries.push((node, count, replicas));
        }
        if primaries.is_empty() {
            return None;
        }
        primaries.sort_by(|a, b| a.0.addr.cmp(&b.0.addr));
        Some(Map {
            slots,
            primary: None,
            primaries,
        })
    }

    /// The primary the first answering Sentinel names.
    async fn ask_sentinels(
        self: &Arc<Self>,
        sentinels: &[Arc<Node>],
        service: &str,
    ) -> Option<Map> {
        for sentinel in sentinels {
            let deadline = Instant::now() + self.template.timeout;
            let ask = redis::cmd("SENTINEL")
                .arg("get-master-addr-by-name")
                .arg(service)
                .clone();
            let Ok(Value::Array(reply)) = sentinel.query(&ask, deadline).await else {
                continue;
            };
            let Some((host, port)) = endpoint_pair(&reply) else {
                continue;
            };
            let node = self.node(&host, port).ok()?;
            let ask = redis::cmd("SENTINEL").arg("replicas").arg(service).clone();
            let replicas = match sentinel.query(&ask, deadline).await {
                Ok(Value::Array(replicas)) => {
                    replicas.iter().filter_map(sentinel_replica).collect()
                }
                _ => Vec::new(),
            };
            if !node.healthy() {
                // Sentinel still names a primary that fails. A replica it
                // has promoted says so (ROLE) up to a second before Sentinel
                // announces the switch: use it at once.
                for addr in &replicas {
                    let Ok(replica) = self.node_at(addr) else {
                        continue;
                    };
                    let role = replica.query(&redis::cmd("ROLE"), deadline).await;
                    if matches!(&role, Ok(Value::Array(r)) if r.first() == Some(&Value::BulkString(b"master".to_vec())))
                    {
                        return Some(Map {
                            slots: Vec::new(),
                            primary: Some(replica.clone()),
                            primaries: vec![(replica, SLOTS, Vec::new())],
                        });
                    }
                }
            }
            return Some(Map {
                slots: Vec::new(),
                primary: Some(node.clone()),
                primaries: vec![(node, SLOTS, replicas)],
            });
        }
        None
    }
}

/// Re-reads the map when woken, on its period, and stops with the store.
async fn refresher(topology: Weak<Topology>, wake: Arc<Notify>) {
    loop {
        let urgent = match topology.upgrade() {
            Some(t) => t.refresh().await || t.map.load().primaries.is_empty(),
            None => return,
        };
        tokio::time::sleep(MIN_REFRESH_GAP).await;
        let period = if urgent { URGENT_REFRESH } else { CALM_REFRESH };
        let _ = tokio::time::timeout(period, wake.notified()).await;
    }
}

/// True when some slot (or the primary) is served by another node.
fn differs(old: &Map, new: &Map) -> bool {
    let same = |a: &Option<Arc<Node>>, b: &Option<Arc<Node>>| match (a, b) {
        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
        (None, None) => true,
        _ => false,
    };
    !same(&old.primary, &new.primary)
        || old.slots.len() != new.slots.len()
        || old.slots.iter().zip(&new.slots).any(|(a, b)| !same(a, b))
        || old.primaries.len() != new.primaries.len()
}

/// Primaries of `old` whose slots (or whose role, under Sentinel) one of
/// their replicas now holds.
fn failovers(old: &Map, new: &Map) -> u64 {
    let mut count = 0;
    for (primary, _, replicas) in &old.primaries {
        let still = new
            .primaries
            .iter()
            .any(|(n, _, _)| Arc::ptr_eq(n, primary));
        let promoted = new
            .primaries
            .iter()
            .any(|(n, _, _)| replicas.contains(&n.addr));
        if !still && promoted {
            count += 1;
        }
    }
    count
}

/// Primaries of `old` that `new` no longer has.
fn replaced(old: &Map, new: &Map) -> u64 {
    old.primaries
        .iter()
        .filter(|(primary, _, _)| {
            !new.primaries
                .iter()
                .any(|(n, _, _)| Arc::ptr_eq(n, primary))
        })
        .count() as u64
}

/// A replica's `ip:port` from `SENTINEL replicas` (a flat list of field
/// names and values, or a map under RESP3), unless Sentinel sees it down.
fn sentinel_replica(entry: &Value) -> Option<String> {
    let text = |v: &Value| match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    let pairs: Vec<(String, String)> = match entry {
        Value::Array(flat) => flat
            .chunks_exact(2)
            .filter_map(|kv| Some((text(&kv[0])?, text(&kv[1])?)))
            .collect(),
        Value::Map(map) => map
            .iter()
            .filter_map(|(k, v)| Some((text(k)?, text(v)?)))
            .collect(),
        _ => return None,
    };
    let field = |name: &str| {
        pairs
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    if field("flags").is_some_and(|f| f.contains("down")) {
        return None;
    }
    Some(format!("{}:{}", field("ip")?, field("port")?))
}

fn endpoint_pair(parts: &[Value]) -> Option<(String, u16)> {
    let host = match parts.first()? {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok()?,
        Value::SimpleString(s) => s.clone(),
        _ => return None,
    };
    let port = match parts.get(1)? {
        Value::Int(p) => u16::try_from(*p).ok()?,
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok()?,
        _ => return None,
    };
    Some((host, port))
}

/// The TLS settings of `rediss://`: trust the CA certificates of `ca_pem`
/// when given (only them), else the usual public roots.
fn tls_config(ca_pem: Option<&[u8]>) -> Result<Arc<rustls::ClientConfig>, String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    match ca_pem {
        Some(pem) => {
            for cert in CertificateDer::pem_slice_iter(pem) {
                let cert = cert.map_err(|e| format!("the Redis CA certificate: {e}"))?;
                roots
                    .add(cert)
                    .map_err(|e| format!("the Redis CA certificate: {e}"))?;
            }
            if roots.is_empty() {
                return Err("the Redis CA certificate file holds no certificate".into());
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    let config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

fn host_port(info: &ConnectionInfo) -> Option<(String, u16)> {
    match info.addr() {
        ConnectionAddr::Tcp(host, port) | ConnectionAddr::TcpTls { host, port, .. } => {
            Some((host.clone(), *port))
        }
        _ => None,
    }
}

/// `host:port` (IPv6 hosts possibly in brackets).
fn split_addr(addr: &str) -> Option<(&str, u16)> {
    let (host, port) = addr.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some((host, port.parse().ok()?))
}

/// The cluster slot of a key: CRC16 (XMODEM) of its hash tag, mod 16384.
pub(super) fn slot_of(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let tagged = bytes.iter().position(|&b| b == b'{').and_then(|open| {
        let close = bytes[open + 1..].iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &bytes[open + 1..open + 1 + close])
    });
    crc16(tagged.unwrap_or(bytes)) % SLOTS as u16
}

/// CRC16-CCITT (XMODEM), what Redis Cluster hashes keys with: one table
/// lookup per byte.
fn crc16(bytes: &[u8]) -> u16 {
    bytes.iter().fold(0u16, |crc, &b| {
        (crc << 8) ^ CRC16_TABLE[usize::from((crc >> 8) as u8 ^ b)]
    })
}

/// The CRC of each byte value, shifted in with polynomial 0x1021.
const CRC16_TABLE: [u16; 256] = {
    let mut table = [0u16; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = (i as u16) << 8;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

/// The worst breaker state among the map's primaries.
pub(super) fn worst(map: &Map) -> BreakerState {
    let mut worst = BreakerState::Closed;
    for (node, _, _) in &map.primaries {
        match node.breaker_state() {
            BreakerState::Open => return BreakerState::Open,
            BreakerState::HalfOpen => worst = BreakerState::HalfOpen,
            BreakerState::Closed => {}
        }
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_redis_cluster() {
        // Values from the Redis Cluster specification and CLUSTER KEYSLOT.
        assert_eq!(crc16(b"123456789"), 0x31c3);
        assert_eq!(slot_of("foo"), 12182);
        assert_eq!(
            slot_of("{user1000}.following"),
            slot_of("{user1000}.followers")
        );
        assert_eq!(slot_of("tollgate:{acme}:k::alice"), slot_of("acme"));
        assert_eq!(
            slot_of("foo{}{bar}"),
            slot_of("foo{}{bar}"),
            "an empty tag hashes the whole key"
        );
        assert_ne!(slot_of("foo{}{bar}"), slot_of("bar"));
    }

    #[test]
    fn redirect_targets_parse_with_and_without_brackets() {
        assert_eq!(split_addr("127.0.0.1:7001"), Some(("127.0.0.1", 7001)));
        assert_eq!(split_addr("[::1]:7001"), Some(("::1", 7001)));
        assert_eq!(split_addr("::1:7001"), Some(("::1", 7001)));
        assert_eq!(split_addr("nope"), None);
    }

    const NODES: &str = "\
a1 127.0.0.1:7001@17001 myself,master - 0 0 1 connected 0-5460 [5461->-b2]
b2 127.0.0.1:7002@17002 master - 0 1 2 connected 5461-10922
c3 :7003@17003 master - 0 1 3 connected 10923-16383
d4 127.0.0.1:7004@17004 slave a1 0 1 1 connected
e5 127.0.0.1:7005@17005 slave c3 0 1 3 connected
f6 127.0.0.1:7006@17006 master,fail - 0 1 0 disconnected
";

    #[tokio::test]
    async fn the_map_comes_from_cluster_nodes_and_a_promotion_counts_as_a_failover() {
        let config = RedisConfig::new("redis-cluster://127.0.0.1:7001");
        let topology = Topology::new(&config, None).unwrap();
        let map = topology.parse_nodes(NODES, "127.0.0.1").unwrap();
        let at = |slot: u16| map.node(slot).unwrap().addr.clone();
        assert_eq!(at(0), "127.0.0.1:7001");
        assert_eq!(at(5460), "127.0.0.1:7001");
        assert_eq!(
            at(5461),
            "127.0.0.1:7002",
            "a slot being migrated stays with its owner"
        );
        assert_eq!(
            at(16383),
            "127.0.0.1:7003",
            "an empty host is the asked node's"
        );
        let summary: Vec<(String, usize, Vec<String>)> = map
            .primaries
            .iter()
            .map(|(n, slots, replicas)| (n.addr.clone(), *slots, replicas.clone()))
            .collect();
        assert_eq!(
            summary,
            [
                ("127.0.0.1:7001".into(), 5461, vec!["127.0.0.1:7004".into()]),
                ("127.0.0.1:7002".into(), 5462, vec![]),
                ("127.0.0.1:7003".into(), 5461, vec!["127.0.0.1:7005".into()]),
            ]
        );
        // 7001 fails and its replica 7004 takes its slots; 7003's slots
        // move to 7002 by a reshard, which is no failover.
        let after = NODES
            .replace(
                "myself,master - 0 0 1 connected 0-5460 [5461->-b2]",
                "master,fail - 0 0 1 disconnected",
            )
            .replace(
                "slave a1 0 1 1 connected",
                "master - 0 1 4 connected 0-5460",
            )
            .replace("connected 5461-10922", "connected 5461-16383")
            .replace("connected 10923-16383", "connected");
        let next = topology.parse_nodes(&after, "127.0.0.1").unwrap();
        assert_eq!(next.node(0).unwrap().addr, "127.0.0.1:7004");
        assert_eq!(next.node(16383).unwrap().addr, "127.0.0.1:7002");
        assert!(differs(&map, &next));
        assert_eq!(failovers(&map, &next), 1);
        assert!(!differs(
            &next,
            &topology.parse_nodes(&after, "127.0.0.1").unwrap()
        ));
        assert!(
            topology.parse_nodes("", "127.0.0.1").is_none(),
            "no slots, no map"
        );
    }
}
