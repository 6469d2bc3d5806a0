//! Leases in the engine: acquire (a decision that also takes slots),
//! release and renew, and the book of leases granted through this
//! instance behind `tollgate_leases_held`.

use std::collections::HashMap;

use parking_lot::Mutex;

use super::{Answer, DecideError, Demand, Engine, Ttl, error, refused};
use crate::algorithm::Micros;
use crate::store::Attachment;
use crate::store::{Lease, LeaseAnswer, LeaseId, LeaseOp, LeaseStatus, lease};
use crate::telemetry::metrics;

/// Most leases one instance keeps in its book; past this, new ones are not
/// counted in `tollgate_leases_held` (it then undercounts).
const MAX_BOOKED: usize = 100_000;

/// Leases granted through this instance and not yet known to be gone, for
/// the per-instance `tollgate_leases_held` gauge.
#[derive(Default)]
pub(super) struct LeaseBook {
    inner: Mutex<Book>,
}

#[derive(Default)]
struct Book {
    /// Lease nonce → (its concurrency rules, when it expires).
    leases: HashMap<u128, (Vec<String>, Micros)>,
    /// Rule → leases held under it.
    held: HashMap<String, u64>,
}

impl Book {
    fn drop_lease(&mut self, nonce: u128) {
        if let Some((rules, _)) = self.leases.remove(&nonce) {
            for rule in rules {
                if let Some(n) = self.held.get_mut(&rule) {
                    *n = n.saturating_sub(1);
                    metrics::leases_held(&rule, *n);
                }
            }
        }
    }
}

impl LeaseBook {
    fn granted(&self, id: &LeaseId, rules: Vec<String>, expires_at: Micros) {
        let mut book = self.inner.lock();
        if book.leases.len() >= MAX_BOOKED || rules.is_empty() {
            return;
        }
        for rule in &rules {
            let n = book.held.entry(rule.clone()).or_default();
            *n += 1;
            metrics::leases_held(rule, *n);
        }
        book.leases.insert(id.nonce(), (rules, expires_at));
    }

    fn gone(&self, id: &LeaseId) {
        self.inner.lock().drop_lease(id.nonce());
    }

    fn renewed(&self, id: &LeaseId, expires_at: Micros) {
        if let Some(entry) = self.inner.lock().leases.get_mut(&id.nonce()) {
            entry.1 = expires_at;
        }
    }

    /// Drops the leases whose time to live has passed at `now`.
    pub(super) fn sweep(&self, now: Micros) {
        let mut book = self.inner.lock();
        let expired: Vec<u128> = book
            .leases
            .iter()
            .filter(|(_, (_, at))| *at <= now)
            .map(|(n, _)| *n)
            .collect();
        for nonce in expired {
            book.drop_lease(nonce);
        }
    }
}

/// What an acquire did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acquired {
    /// The decision over the rate rules and the concurrency caps.
    pub answer: Answer,
    /// The lease taken, `None` when nothing was: refused, no concurrency
    /// rule applied, or a store-unavailable policy other than `local`
    /// answered.
    pub lease: Option<LeaseId>,
    /// The lease's time to live.
    pub ttl: Micros,
    /// Leases held under the fullest cap (the one with the fewest slots
    /// left), this one included when granted; 0 when no cap applied.
    pub in_flight: u64,
    /// That cap's size; 0 when no cap applied.
    pub limit: u64,
}

impl Engine {
    /// Decides a demand of one item over its rate lines and concurrency
    /// lines and, when the store admits it (not a fallback's `allow`),
    /// takes a lease in every admitting concurrency line, for the time to
    /// live `asked` (microseconds as the caller sent it, checked against
    /// `kind`: [`Ttl::Lease`] or [`Ttl::HeldLease`]; `None`: the default).
    /// An invalid time to live refuses the demand like any invalid field.
    pub async fn acquire(
        &self,
        demand: &mut Demand<'_>,
        asked: Option<i128>,
        kind: Ttl,
        span: &tracing::Span,
    ) -> Result<Acquired, DecideError> {
        let ttl = kind.check(asked).inspect_err(|_| {
            refused(demand.api, 1, span);
        })?;
        let tenant = demand.items.first().map_or("", |i| i.tenant);
        let lease = Lease {
            id: super::record_id(demand, tenant),
            ttl,
        };
        // Without a concurrency rule there is no slot to hold: a plain
        // decision over the rate rules.
        let caps = demand.lines.iter().any(|l| l.is_concurrency());
        let mut attached = if caps {
            demand.op = crate::algorithm::Op::Acquire { ttl };
            Some(Attachment::Lease(lease))
        } else {
            demand.op = crate::algorithm::Op::SPEND;
            None
        };
        let now = self.clock.now();
        let answer = self.decide_attached(demand, &mut attached, span).await?;
        let mut rules = Vec::new();
        let mut took = false;
        for (line, verdict) in demand.lines.iter().zip(&answer.lines) {
            if !line.is_concurrency() {
                continue;
            }
            let granted = answer.allowed && verdict.allowed;
            if granted || !verdict.allowed {
                metrics::lease_decided(line.label, granted);
            }
            took |= granted;
            if granted {
                rules.push(line.label.to_owned());
            }
            let item = &demand.items[line.item];
            if let Some(cap) = line.cap() {
                let held = cap.saturating_sub(verdict.remaining);
                self.top.record_held(
                    item.tenant,
                    item.key,
                    held,
                    now.saturating_add(verdict.reset_after),
                );
            }
        }
        let id = match attached {
            Some(Attachment::Lease(lease)) if took => Some(lease.id),
            _ => None,
        };
        if let Some(id) = &id {
            self.leases.granted(id, rules, now.saturating_add(ttl));
        }
        // The fullest cap: the fewest slots left.
        let fullest = demand
            .lines
            .iter()
            .zip(&answer.lines)
            .filter_map(|(line, verdict)| line.cap().map(|cap| (cap, verdict.remaining)))
            .min_by_key(|&(_, remaining)| remaining);
        let (in_flight, limit) = fullest.map_or((0, 0), |(cap, remaining)| {
            (cap.saturating_sub(remaining), cap)
        });
        Ok(Acquired {
            answer,
            lease: id,
            ttl,
            in_flight,
            limit,
        })
    }

    /// Releases the lease `token` (as `Acquire` returned it). Idempotent: a
    /// lease released before, expired or unknown is reported as such. A
    /// token that is not a lease's is refused and counted as an `invalid`
    /// release.
    pub async fn release(&self, token: &str) -> Result<LeaseAnswer, DecideError> {
        let id = parse_lease(token, "release")?;
        self.lease(&id, LeaseOp::Release).await
    }

    /// Holds the lease `token` for the time to live `asked` from now
    /// (checked against [`Ttl::Lease`]; `None`: the default). A token that
    /// is not a lease's, or a time to live out of bounds, is refused and
    /// counted as an `invalid` renew.
    pub async fn renew(
        &self,
        token: &str,
        asked: Option<i128>,
    ) -> Result<LeaseAnswer, DecideError> {
        let id = parse_lease(token, "renew")?;
        let ttl = Ttl::Lease.check(asked).inspect_err(|_| {
            metrics::lease_op("renew", "invalid");
        })?;
        self.lease(&id, LeaseOp::Renew { ttl }).await
    }

    /// Releases or renews a lease. A release always answers (it is
    /// idempotent: a lease released before, expired or unknown is reported
    /// as such); a renew of a lease that is not held is an error.
    pub async fn lease(&self, id: &LeaseId, op: LeaseOp) -> Result<LeaseAnswer, DecideError> {
        let name = match op {
            LeaseOp::Release => "release",
            LeaseOp::Renew { .. } => "renew",
        };
        let op = match op {
            LeaseOp::Renew { ttl } => LeaseOp::Renew {
                ttl: ttl.min(lease::MAX_TTL),
            },
            release => release,
        };
        let answer = self.store.lease(id, op).await.map_err(|e| {
            metrics::lease_op(name, "error");
            DecideError::from(e)
        })?;
        metrics::lease_op(name, answer.status.label(op));
        match (op, answer.status) {
            (LeaseOp::Release, _) | (_, LeaseStatus::Expired | LeaseStatus::Unknown) => {
                self.leases.gone(id)
            }
            (LeaseOp::Renew { ttl }, LeaseStatus::Done) => self
                .leases
                .renewed(id, self.clock.now().saturating_add(ttl)),
            _ => {}
        }
        match (op, answer.status) {
            (LeaseOp::Renew { .. }, LeaseStatus::Unknown) => {
                Err(DecideError::UnknownLease(id.to_string()))
            }
            (LeaseOp::Renew { .. }, LeaseStatus::Expired) => Err(DecideError::LeaseGone {
                id: id.to_string(),
                why: "its time to live passed and its slots were freed",
            }),
            (LeaseOp::Renew { .. }, LeaseStatus::AlreadyReleased) => Err(DecideError::LeaseGone {
                id: id.to_string(),
                why: "it was released",
            }),
            _ => Ok(answer),
        }
    }

    /// Drops expired leases from this instance's book (the server calls it
    /// every second).
    pub fn sweep_leases(&self) {
        self.leases.sweep(self.clock.now());
    }
}

/// The lease a caller's token names, or an `InvalidToken` counted as an
/// `invalid` operation `op`.
fn parse_lease(token: &str, op: &'static str) -> Result<LeaseId, DecideError> {
    LeaseId::parse(token).ok_or_else(|| {
        metrics::lease_op(op, "invalid");
        DecideError::InvalidToken(format!(
            "lease {:?} is not a token Acquire returned (they start with \"l1.\")",
            error::shortened(token)
        ))
    })
}
