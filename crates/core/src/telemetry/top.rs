//! The most-limited tenants (and keys within them), in bounded memory.
//!
//! Rejections are counted in a space-saving sketch: it tracks at most
//! `capacity` items; a new item replaces the one with the smallest count and
//! inherits that count as its possible overcount (`error`). Any item whose
//! true count exceeds `total / capacity` is guaranteed to be tracked, so
//! the heavy hitters are right no matter how many distinct tenants or keys
//! arrive. "Recent" is two windows: the current one and the one before,
//! rotated every `window`, so the answer covers between one and two
//! windows of history.
//!
//! Names are kept to at most [`MAX_NAME_BYTES`] bytes (cut at a character
//! boundary), so the sketch, `/v1/top-limited` and the status page stay
//! small whatever names callers send: at most 2 × (128 + 512) names.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::Serialize;

use crate::clock::{Clock, Micros};

/// Longest tenant or key name kept, in bytes; longer ones are cut.
pub const MAX_NAME_BYTES: usize = 256;

/// `name` cut to at most [`MAX_NAME_BYTES`], at a character boundary.
fn bounded(name: &str) -> &str {
    if name.len() <= MAX_NAME_BYTES {
        return name;
    }
    let mut end = MAX_NAME_BYTES;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    &name[..end]
}

/// One counted item.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Heavy {
    /// The tenant or key.
    pub name: String,
    /// Rejections counted (an upper bound).
    pub count: u64,
    /// How much of `count` may belong to items it replaced.
    pub error: u64,
}

/// A space-saving sketch of at most `capacity` items.
///
/// The smallest count is found through a min-heap with lazy deletion: every
/// increment pushes the item's new count, and stale heap entries (whose count
/// no longer matches) are skipped when popped, so an eviction costs
/// O(log capacity) amortised.
#[derive(Debug, Clone)]
pub struct SpaceSaving {
    capacity: usize,
    items: HashMap<String, (u64, u64)>,
    heap: BinaryHeap<Reverse<(u64, String)>>,
}

impl SpaceSaving {
    /// A sketch tracking at most `capacity` (≥ 1) items.
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            capacity,
            items: HashMap::with_capacity(capacity),
            heap: BinaryHeap::with_capacity(capacity * 2),
        }
    }

    /// Items tracked now (never more than the capacity).
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// True when nothing was counted.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Counts `weight` for `name`.
    pub fn add(&mut self, name: &str, weight: u64) {
        let count = if let Some(entry) = self.items.get_mut(name) {
            entry.0 = entry.0.saturating_add(weight);
            entry.0
        } else if self.items.len() < self.capacity {
            self.items.insert(name.to_owned(), (weight, 0));
            weight
        } else {
            let min = self.pop_min();
            self.items
                .insert(name.to_owned(), (min.saturating_add(weight), min));
            min.saturating_add(weight)
        };
        self.heap.push(Reverse((count, name.to_owned())));
        if self.heap.len() > self.capacity * 4 {
            // Drop the stale entries.
            self.heap = self
                .items
                .iter()
                .map(|(n, (c, _))| Reverse((*c, n.clone())))
                .collect();
        }
    }

    /// Removes the item with the smallest count; returns that count.
    fn pop_min(&mut self) -> u64 {
        while let Some(Reverse((count, name))) = self.heap.pop() {
            if self.items.get(&name).is_some_and(|(c, _)| *c == count) {
                self.items.remove(&name);
                return count;
            }
        }
        0
    }

    /// This sketch's counts plus another's (for merging two windows).
    fn merged(&self, other: &Self) -> HashMap<String, (u64, u64)> {
        let mut all = self.items.clone();
        for (name, (count, error)) in &other.items {
            let entry = all.entry(name.clone()).or_insert((0, 0));
            entry.0 += count;
            entry.1 += error;
        }
        all
    }
}

/// The `n` items with the most rejections that are certain (count minus
/// possible overcount), then by count.
fn top(items: HashMap<String, (u64, u64)>, n: usize) -> Vec<Heavy> {
    let mut list: Vec<Heavy> = items
        .into_iter()
        .map(|(name, (count, error))| Heavy { name, count, error })
        .collect();
    list.sort_by(|a, b| {
        (b.count - b.error, b.count)
            .cmp(&(a.count - a.error, a.count))
            .then_with(|| a.name.cmp(&b.name))
    });
    list.truncate(n);
    list
}

/// A tenant among the most limited, with its most limited keys.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TopTenant {
    /// Tenant ('' is the default tenant; Envoy domains start with `~`).
    pub tenant: String,
    /// Rejections counted.
    pub rejections: u64,
    /// Possible overcount.
    pub error: u64,
    /// The tenant's most rejected keys.
    pub keys: Vec<Heavy>,
}

struct Windows {
    /// Rejections per tenant since the last [`TopLimited::take_interval`].
    interval: SpaceSaving,
    started: Micros,
    tenants: [SpaceSaving; 2],
    keys: [SpaceSaving; 2],
}

/// A tenant seen in debt: usage charged after the fact took one of its
/// buckets below zero.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InDebt {
    /// The tenant.
    pub tenant: String,
    /// The key whose bucket was deepest in debt (empty: a tenant-wide one).
    pub key: String,
    /// Tokens below zero when last seen.
    pub debt: u64,
    /// Microseconds since it was seen (the bucket refills meanwhile).
    pub seen_ago_us: Micros,
}

/// A tenant seen holding concurrency slots.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Holding {
    /// The tenant.
    pub tenant: String,
    /// The key of the last acquire seen (empty for tenant-wide caps).
    pub key: String,
    /// Leases held in its fullest cap, as last seen at an acquire.
    pub held: u64,
    /// Microseconds until every lease seen held then has expired, at the
    /// latest (releases free them sooner).
    pub expires_in_us: Micros,
}

/// A tenant seen near a quota: the fullest of its quotas as last seen in
/// the current period.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NearQuota {
    /// The tenant.
    pub tenant: String,
    /// The quota's rule.
    pub rule: String,
    /// Tokens counted in the period when last seen.
    pub used: u64,
    /// The quota per period.
    pub limit: u64,
    /// Microseconds until the period ends.
    pub resets_in_us: Micros,
}

/// A quota as last seen for a tenant.
#[derive(Debug, Clone)]
struct QuotaSeen {
    rule: String,
    used: u64,
    limit: u64,
    until: Micros,
}

impl QuotaSeen {
    /// Ordered by the share of the quota used (exactly: `used / limit`
    /// compared as cross products).
    fn order(&self, other: &Self) -> std::cmp::Ordering {
        (u128::from(self.used) * u128::from(other.limit))
            .cmp(&(u128::from(other.used) * u128::from(self.limit)))
    }

    fn fuller_than(&self, other: &Self) -> bool {
        self.order(other) == std::cmp::Ordering::Greater
    }
}

/// Rejections per tenant and per (tenant, key), over a recent window; the
/// tenants seen in debt; the tenants seen holding the most slots; and the
/// tenants nearest a quota.
pub struct TopLimited {
    /// Tenant → (key, leases held, when they have all expired): the latest
    /// acquire seen per tenant, at most `capacity` tenants.
    holders: Mutex<HashMap<String, (String, u64, Micros)>>,
    windows: Mutex<Windows>,
    /// Tenant → (key, debt, seen at): the deepest debt seen per tenant
    /// within the window, at most `capacity` tenants (the deepest kept).
    debts: Mutex<HashMap<String, (String, u64, Micros)>>,
    /// Tenant → its fullest quota as last seen, until its period ends, at
    /// most `capacity` tenants (the fullest kept).
    quotas: Mutex<HashMap<String, QuotaSeen>>,
    capacity: usize,
    window: Micros,
    clock: Arc<dyn Clock>,
}

impl TopLimited {
    /// Tracks up to `capacity` tenants and `4 × capacity` keys per window.
    pub fn new(capacity: usize, window: Duration, clock: Arc<dyn Clock>) -> Self {
        let sketch = |n| [SpaceSaving::new(n), SpaceSaving::new(n)];
        Self {
            windows: Mutex::new(Windows {
                interval: SpaceSaving::new(capacity),
                started: clock.now(),
                tenants: sketch(capacity),
                keys: sketch(capacity * 4),
            }),
            debts: Mutex::new(HashMap::new()),
            holders: Mutex::new(HashMap::new()),
            quotas: Mutex::new(HashMap::new()),
            capacity: capacity.max(1),
            window: window.as_micros().max(1) as Micros,
            clock,
        }
    }

    /// The window length.
    pub fn window(&self) -> Duration {
        Duration::from_micros(self.window)
    }

    fn rotate(&self, w: &mut Windows) {
        let now = self.clock.now();
        let elapsed = now.saturating_sub(w.started);
        if elapsed >= 2 * self.window {
            w.tenants = [
                SpaceSaving::new(w.tenants[0].capacity),
                SpaceSaving::new(w.tenants[0].capacity),
            ];
            w.keys = [
                SpaceSaving::new(w.keys[0].capacity),
                SpaceSaving::new(w.keys[0].capacity),
            ];
            w.started = now;
        } else if elapsed >= self.window {
            w.tenants.swap(0, 1);
            w.tenants[0] = SpaceSaving::new(w.tenants[0].capacity);
            w.keys.swap(0, 1);
            w.keys[0] = SpaceSaving::new(w.keys[0].capacity);
            w.started += self.window;
        }
    }

    /// Counts a rejection of `weight` tokens for `key` of `tenant`.
    pub fn record(&self, tenant: &str, key: &str, weight: u64) {
        let (tenant, key) = (bounded(tenant), bounded(key));
        let mut w = self.windows.lock();
        self.rotate(&mut w);
        w.tenants[0].add(tenant, weight);
        w.interval.add(tenant, weight);
        let mut pair = String::with_capacity(tenant.len() + key.len() + 1);
        pair.push_str(tenant);
        pair.push('\u{0}');
        pair.push_str(key);
        w.keys[0].add(&pair, weight);
    }

    /// The `n` tenants with the most rejections since the previous call
    /// (or start), with their counts; starts the next interval. For the
    /// status page's history, which calls it once a second.
    pub fn take_interval(&self, n: usize) -> Vec<Heavy> {
        let capacity = self.capacity;
        let taken = std::mem::replace(
            &mut self.windows.lock().interval,
            SpaceSaving::new(capacity),
        );
        top(taken.items, n)
    }

    /// Records that `key` of `tenant` was seen `debt` tokens below zero.
    /// Per tenant the latest sighting within the window is kept, or a
    /// deeper one; when `capacity` tenants are held, a new one replaces the
    /// shallowest (or a stale one) only if it is deeper.
    pub fn record_debt(&self, tenant: &str, key: &str, debt: u64) {
        let (tenant, key) = (bounded(tenant), bounded(key));
        let now = self.clock.now();
        let stale = |seen: Micros| now.saturating_sub(seen) >= self.window;
        let mut debts = self.debts.lock();
        if let Some(entry) = debts.get_mut(tenant) {
            if debt >= entry.1 || stale(entry.2) || entry.0 == key {
                *entry = (key.to_owned(), debt, now);
            }
            return;
        }
        if debts.len() >= self.capacity {
            debts.retain(|_, (_, _, seen)| !stale(*seen));
        }
        if debts.len() >= self.capacity {
            let Some((shallowest, depth)) = debts
                .iter()
                .min_by_key(|(_, (_, d, _))| *d)
                .map(|(t, (_, d, _))| (t.clone(), *d))
            else {
                return;
            };
            if depth >= debt {
                return;
            }
            debts.remove(&shallowest);
        }
        debts.insert(tenant.to_owned(), (key.to_owned(), debt, now));
    }

    /// Records that `key` of `tenant` was seen holding `held` leases in a
    /// cap whose leases have all expired by `until` (the latest sighting
    /// per tenant is kept; when `capacity` tenants are held, a new one
    /// replaces one whose leases have expired, or the smallest if it holds
    /// more).
    pub fn record_held(&self, tenant: &str, key: &str, held: u64, until: Micros) {
        let (tenant, key) = (bounded(tenant), bounded(key));
        let now = self.clock.now();
        let mut holders = self.holders.lock();
        if let Some(entry) = holders.get_mut(tenant) {
            *entry = (key.to_owned(), held, until);
            return;
        }
        if held == 0 {
            return;
        }
        if holders.len() >= self.capacity {
            holders.retain(|_, (_, _, until)| *until > now);
        }
        if holders.len() >= self.capacity {
            let Some((smallest, least)) = holders
                .iter()
                .min_by_key(|(_, (_, h, _))| *h)
                .map(|(t, (_, h, _))| (t.clone(), *h))
            else {
                return;
            };
            if least >= held {
                return;
            }
            holders.remove(&smallest);
        }
        holders.insert(tenant.to_owned(), (key.to_owned(), held, until));
    }

    /// Records that `tenant`'s quota `rule` counted `used` of `limit` in a
    /// period ending at `until`. Per tenant its fullest quota is kept (the
    /// latest sighting of the same rule replaces the earlier one); when
    /// `capacity` tenants are held, a new one replaces one whose period has
    /// ended, or the least full if it is fuller.
    pub fn record_quota(&self, tenant: &str, rule: &str, used: u64, limit: u64, until: Micros) {
        let seen = QuotaSeen {
            rule: bounded(rule).to_owned(),
            used,
            limit: limit.max(1),
            until,
        };
        let tenant = bounded(tenant);
        let now = self.clock.now();
        let mut quotas = self.quotas.lock();
        if let Some(entry) = quotas.get_mut(tenant) {
            if entry.rule == seen.rule || entry.until <= now || seen.fuller_than(entry) {
                *entry = seen;
            }
            return;
        }
        if used == 0 {
            return;
        }
        if quotas.len() >= self.capacity {
            quotas.retain(|_, q| q.until > now);
        }
        if quotas.len() >= self.capacity {
            let Some(least) = quotas
                .iter()
                .min_by(|a, b| a.1.order(b.1))
                .map(|(t, q)| (t.clone(), q.clone()))
            else {
                return;
            };
            if !seen.fuller_than(&least.1) {
                return;
            }
            quotas.remove(&least.0);
        }
        quotas.insert(tenant.to_owned(), seen);
    }

    /// Up to `n` tenants nearest a quota in its current period, fullest
    /// first (by the share used).
    pub fn nearest_quota(&self, n: usize) -> Vec<NearQuota> {
        let now = self.clock.now();
        let quotas = self.quotas.lock();
        let mut near: Vec<(&String, &QuotaSeen)> = quotas
            .iter()
            .filter(|(_, q)| q.used > 0 && q.until > now)
            .collect();
        near.sort_by(|a, b| b.1.order(a.1).then_with(|| a.0.cmp(b.0)));
        near.into_iter()
            .take(n)
            .map(|(tenant, q)| NearQuota {
                tenant: tenant.clone(),
                rule: q.rule.clone(),
                used: q.used,
                limit: q.limit,
                resets_in_us: q.until - now,
            })
            .collect()
    }

    /// Up to `n` tenants seen holding slots whose leases may still be
    /// held, most first.
    pub fn holding(&self, n: usize) -> Vec<Holding> {
        let now = self.clock.now();
        let mut holding: Vec<Holding> = self
            .holders
            .lock()
            .iter()
            .filter(|(_, (_, held, until))| *held > 0 && *until > now)
            .map(|(tenant, (key, held, until))| Holding {
                tenant: tenant.clone(),
                key: key.clone(),
                held: *held,
                expires_in_us: until - now,
            })
            .collect();
        holding.sort_by(|a, b| b.held.cmp(&a.held).then_with(|| a.tenant.cmp(&b.tenant)));
        holding.truncate(n);
        holding
    }

    /// Up to `n` tenants seen in debt within the window, deepest first.
    pub fn in_debt(&self, n: usize) -> Vec<InDebt> {
        let now = self.clock.now();
        let mut debts: Vec<InDebt> = self
            .debts
            .lock()
            .iter()
            .filter(|(_, (_, debt, seen))| *debt > 0 && now.saturating_sub(*seen) < self.window)
            .map(|(tenant, (key, debt, seen))| InDebt {
                tenant: tenant.clone(),
                key: key.clone(),
                debt: *debt,
                seen_ago_us: now.saturating_sub(*seen),
            })
            .collect();
        debts.sort_by(|a, b| b.debt.cmp(&a.debt).then_with(|| a.tenant.cmp(&b.tenant)));
        debts.truncate(n);
        debts
    }

    /// The `n` most limited tenants, each with up to `keys` of its keys.
    pub fn top(&self, n: usize, keys: usize) -> Vec<TopTenant> {
        let mut w = self.windows.lock();
        self.rotate(&mut w);
        let tenants = top(w.tenants[0].merged(&w.tenants[1]), n);
        let all_keys = w.keys[0].merged(&w.keys[1]);
        tenants
            .into_iter()
            .map(|t| {
                let prefix = format!("{}\u{0}", t.name);
                let mine = all_keys
                    .iter()
                    .filter_map(|(pair, v)| pair.strip_prefix(&prefix).map(|k| (k.to_owned(), *v)))
                    .collect();
                TopTenant {
                    tenant: t.name,
                    rejections: t.count,
                    error: t.error,
                    keys: top(mine, keys),
                }
            })
            .collect()
    }

    /// Items held, for memory checks: (tenants, keys).
    pub fn held(&self) -> (usize, usize) {
        let w = self.windows.lock();
        (
            w.tenants[0].len() + w.tenants[1].len(),
            w.keys[0].len() + w.keys[1].len(),
        )
    }
}

/// The Prometheus text of the top-limited family: only the current top
/// `n` tenants, so its series never grow beyond `n`.
pub fn render_metric(top: &[TopTenant]) -> String {
    let mut out = String::from(
        "# HELP tollgate_top_limited_rejections Rejections of the currently most limited tenants over the recent window (top K only).\n\
         # TYPE tollgate_top_limited_rejections gauge\n",
    );
    for (rank, t) in top.iter().enumerate() {
        let tenant = escape_label(&t.tenant);
        out.push_str(&format!(
            "tollgate_top_limited_rejections{{tenant=\"{tenant}\",rank=\"{}\"}} {}\n",
            rank + 1,
            t.rejections
        ));
    }
    out
}

/// The Prometheus text of the in-debt family: the deepest `n` tenants seen
/// in debt within the window, so its series never grow beyond `n`.
pub fn render_debt_metric(in_debt: &[InDebt]) -> String {
    let mut out = String::from(
        "# HELP tollgate_tenant_debt_tokens Tokens below zero of the tenants seen deepest in debt over the recent window, as last seen (top K only).\n\
         # TYPE tollgate_tenant_debt_tokens gauge\n",
    );
    for d in in_debt {
        out.push_str(&format!(
            "tollgate_tenant_debt_tokens{{tenant=\"{}\"}} {}\n",
            escape_label(&d.tenant),
            d.debt
        ));
    }
    out
}

/// The Prometheus text of the holders family: the `n` tenants seen holding
/// the most concurrency slots, so its series never grow beyond `n`.
pub fn render_holding_metric(holding: &[Holding]) -> String {
    let mut out = String::from(
        "# HELP tollgate_tenant_leases_held Concurrency slots held in the fullest cap of the tenants seen holding the most, at their latest acquire through this instance (top K only).\n\
         # TYPE tollgate_tenant_leases_held gauge\n",
    );
    for h in holding {
        out.push_str(&format!(
            "tollgate_tenant_leases_held{{tenant=\"{}\"}} {}\n",
            escape_label(&h.tenant),
            h.held
        ));
    }
    out
}

/// A label value escaped as the exposition format wants: backslash,
/// double quote and line feed (a raw newline would start a forged sample
/// line).
fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    #[test]
    fn the_tenants_nearest_a_quota_are_the_fullest_until_their_period_ends() {
        let clock = Arc::new(ManualClock::new(1_000));
        let top = TopLimited::new(2, Duration::from_secs(60), clock.clone());
        top.record_quota("acme", "monthly", 80, 100, 5_000);
        top.record_quota("globex", "daily", 9, 10, 3_000);
        // Nothing used: not a tenant near anything.
        top.record_quota("initech", "monthly", 0, 100, 5_000);
        let near = top.nearest_quota(10);
        let names: Vec<(&str, &str, u64)> = near
            .iter()
            .map(|q| (q.tenant.as_str(), q.rule.as_str(), q.used))
            .collect();
        assert_eq!(names, [("globex", "daily", 9), ("acme", "monthly", 80)]);
        assert_eq!(near[0].resets_in_us, 2_000);
        // A fuller quota of the same tenant takes its place; the same rule
        // seen again replaces itself, fuller or not.
        top.record_quota("acme", "weekly", 95, 100, 4_000);
        assert_eq!(top.nearest_quota(1)[0].rule, "weekly");
        top.record_quota("acme", "monthly", 99, 100, 5_000);
        assert_eq!(top.nearest_quota(1)[0].rule, "monthly");
        top.record_quota("acme", "monthly", 30, 100, 5_000);
        top.record_quota("acme", "weekly", 10, 100, 4_000);
        let acme = &top.nearest_quota(10)[1];
        assert_eq!((acme.rule.as_str(), acme.used), ("monthly", 30));
        // At capacity, a newcomer replaces the least full only if fuller.
        top.record_quota("hooli", "daily", 1, 100, 9_000);
        assert_eq!(top.nearest_quota(10).len(), 2);
        assert!(top.nearest_quota(10).iter().all(|q| q.tenant != "hooli"));
        top.record_quota("hooli", "daily", 50, 100, 9_000);
        let tenants: Vec<String> = top
            .nearest_quota(10)
            .into_iter()
            .map(|q| q.tenant)
            .collect();
        assert_eq!(tenants, ["globex", "hooli"]);
        // A period that ended is no longer near anything, and makes room.
        clock.set(3_000);
        let tenants: Vec<String> = top
            .nearest_quota(10)
            .into_iter()
            .map(|q| q.tenant)
            .collect();
        assert_eq!(tenants, ["hooli"]);
        top.record_quota("umbrella", "daily", 1, 1000, 9_000);
        assert_eq!(top.nearest_quota(10).len(), 2);
    }

    #[test]
    fn a_million_distinct_tenants_stay_bounded_and_the_heavy_hitters_win() {
        let clock = Arc::new(ManualClock::new(0));
        let top_limited = TopLimited::new(128, Duration::from_secs(60), clock.clone());
        // A million one-off tenants, a scraper with 2% of the rejections and
        // a retry storm with 1% (from two clients).
        for i in 0..1_000_000u32 {
            top_limited.record(&format!("noise-{i}"), "k", 1);
            if i % 50 == 0 {
                top_limited.record("scraper", "bot-1", 1);
            }
            if i % 200 == 0 {
                top_limited.record("retry-storm", "client-9", 1);
                top_limited.record("retry-storm", "client-7", 1);
            }
        }
        let (tenants, keys) = top_limited.held();
        assert!(tenants <= 2 * 128 && keys <= 2 * 512, "{tenants} {keys}");
        let top = top_limited.top(2, 2);
        assert_eq!(top[0].tenant, "scraper");
        assert_eq!(top[1].tenant, "retry-storm");
        // Space-saving never undercounts, and count − error never overcounts.
        assert!(top[0].rejections >= 20_000 && top[0].rejections - top[0].error <= 20_000);
        assert_eq!(top[1].keys.len(), 2);
        assert!(top[1].keys.iter().all(|k| k.name.starts_with("client-")));
    }

    #[test]
    fn debts_keep_the_latest_sighting_the_deepest_tenants_and_age_out() {
        let clock = Arc::new(ManualClock::new(0));
        let t = TopLimited::new(2, Duration::from_secs(60), clock.clone());
        t.record_debt("a", "k1", 50);
        t.record_debt("a", "k1", 20); // the same bucket, partly repaid
        t.record_debt("b", "", 10);
        t.record_debt("c", "k", 5); // shallower than both: not kept
        let seen = |t: &TopLimited| -> Vec<(String, String, u64)> {
            t.in_debt(10)
                .into_iter()
                .map(|d| (d.tenant, d.key, d.debt))
                .collect()
        };
        assert_eq!(
            seen(&t),
            [("a".into(), "k1".into(), 20), ("b".into(), "".into(), 10)]
        );
        t.record_debt("c", "k", 30); // deeper than b: replaces it
        assert_eq!(
            seen(&t),
            [("c".into(), "k".into(), 30), ("a".into(), "k1".into(), 20)]
        );
        assert_eq!(t.in_debt(1).len(), 1);
        clock.advance(Duration::from_secs(59));
        assert_eq!(t.in_debt(10)[0].seen_ago_us, 59_000_000);
        clock.advance(Duration::from_secs(1));
        assert!(t.in_debt(10).is_empty(), "older than the window");
        t.record_debt("d", "k", 1); // stale entries make room
        assert_eq!(seen(&t), [("d".into(), "k".into(), 1)]);
    }

    #[test]
    fn windows_rotate_and_old_rejections_age_out() {
        let clock = Arc::new(ManualClock::new(0));
        let t = TopLimited::new(8, Duration::from_secs(60), clock.clone());
        t.record("a", "k", 5);
        clock.advance(Duration::from_secs(60));
        t.record("b", "k", 1);
        let names: Vec<_> = t
            .top(10, 0)
            .into_iter()
            .map(|x| (x.tenant, x.rejections))
            .collect();
        assert_eq!(
            names,
            [("a".to_string(), 5), ("b".to_string(), 1)],
            "the previous window still counts"
        );
        clock.advance(Duration::from_secs(60));
        let names: Vec<_> = t.top(10, 0).into_iter().map(|x| x.tenant).collect();
        assert_eq!(names, ["b"]);
        clock.advance(Duration::from_secs(120));
        assert!(t.top(10, 0).is_empty());
    }

    #[test]
    fn names_are_bounded_and_label_values_escaped() {
        let t = TopLimited::new(8, Duration::from_secs(60), Arc::new(ManualClock::new(0)));
        t.record(&"é".repeat(1_000), &"k".repeat(1_000_000), 1);
        let top = t.top(1, 1);
        assert_eq!(
            top[0].tenant,
            "é".repeat(128),
            "cut at a character boundary"
        );
        assert_eq!(top[0].keys[0].name.len(), MAX_NAME_BYTES);
        let text = render_metric(&[TopTenant {
            tenant: "~a\nfake_metric 1\\\"".into(),
            rejections: 1,
            error: 0,
            keys: vec![],
        }]);
        assert!(
            text.contains("tollgate_top_limited_rejections{tenant=\"~a\\nfake_metric 1\\\\\\\"\",rank=\"1\"} 1\n"),
            "{text}"
        );
        assert!(
            !text.lines().any(|l| l.starts_with("fake_metric")),
            "{text}"
        );
    }

    #[test]
    fn the_metric_family_holds_only_the_top() {
        let top = vec![TopTenant {
            tenant: "a\"b".into(),
            rejections: 3,
            error: 0,
            keys: vec![],
        }];
        let text = render_metric(&top);
        assert!(
            text.contains("tollgate_top_limited_rejections{tenant=\"a\\\"b\",rank=\"1\"} 3\n"),
            "{text}"
        );
        assert_eq!(text.lines().filter(|l| !l.starts_with('#')).count(), 1);
    }
}
