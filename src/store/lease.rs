//! Leases: slots of concurrency caps held by work in flight.
//!
//! An acquire decides like any decision (every enforced rate bucket and
//! concurrency cap must admit) and, when admitted, adds the lease to every
//! admitting cap's lease set and writes a record beside them, in the same
//! atomic step: which sets hold the lease and when it expires. Release and
//! renew read the record, so they need only the lease's id, and touch
//! exactly the sets the acquire took. A lease not released expires by
//! itself (the sets are pruned by expiry on every touch); its record
//! outlives it by [`EXPIRED_GRACE`] so that a late release or renew is
//! answered "expired" rather than "unknown".

use std::fmt;

use super::BucketKey;
use super::reservation::{new_nonce, parse_token, write_token};
use crate::algorithm::Micros;

pub use super::reservation::EXPIRED_GRACE;

/// The longest time to live one acquire or renew may give a lease: one
/// hour (longer work renews).
pub const MAX_TTL: Micros = 3_600_000_000;

/// A lease's identity: the tenant whose caps it holds (the Redis hash tag
/// its record and sets live under) and a random nonce. Written for callers
/// as an opaque token, `l1.NONCE.TENANT`.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct LeaseId {
    tenant: String,
    nonce: u128,
}

impl LeaseId {
    /// A new, random id for a lease on `tenant`'s caps.
    pub fn new(tenant: &str) -> Self {
        Self {
            tenant: tenant.to_owned(),
            nonce: new_nonce(),
        }
    }

    /// The tenant.
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// The nonce: the lease's member in its sets.
    pub fn nonce(&self) -> u128 {
        self.nonce
    }

    /// The nonce as the sets' member, 32 hex digits.
    pub fn member(&self) -> String {
        format!("{:032x}", self.nonce)
    }

    /// The record's name in a store, `tenant:l::NONCE`.
    pub fn record_name(&self) -> BucketKey {
        BucketKey::new(&self.tenant, "l", "", &self.member())
    }

    /// Reads a token written by [`fmt::Display`]; `None` when it is not one.
    pub fn parse(token: &str) -> Option<Self> {
        let (tenant, nonce) = parse_token(token, "l1.")?;
        Some(Self { tenant, nonce })
    }
}

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_token(f, "l1.", self.nonce, &self.tenant)
    }
}

impl fmt::Debug for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// What an acquire writes beside its decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// Its identity.
    pub id: LeaseId,
    /// Time to live from the acquire.
    pub ttl: Micros,
}

/// What to do with a held lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseOp {
    /// Give its slots back.
    Release,
    /// Hold it for `ttl` µs from now.
    Renew {
        /// The new time to live.
        ttl: Micros,
    },
}

/// What a release or renew finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseStatus {
    /// Released now, or renewed now.
    Done,
    /// Released before; nothing changed now.
    AlreadyReleased,
    /// Its time to live passed: its slots were free already.
    Expired,
    /// No such lease (never granted by the store, or expired long ago).
    Unknown,
}

impl LeaseStatus {
    /// The `status` label of the lease metrics.
    pub fn label(self, op: LeaseOp) -> &'static str {
        match (self, op) {
            (Self::Done, LeaseOp::Release) => "released",
            (Self::Done, LeaseOp::Renew { .. }) => "renewed",
            (Self::AlreadyReleased, _) => "already_released",
            (Self::Expired, _) => "expired",
            (Self::Unknown, _) => "unknown",
        }
    }
}

/// A store's answer to a release or renew.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseAnswer {
    /// What it found.
    pub status: LeaseStatus,
    /// Renewed: the time until the lease expires now.
    pub expires_in: Micros,
}

impl LeaseAnswer {
    /// An answer without a time.
    pub const fn of(status: LeaseStatus) -> Self {
        Self {
            status,
            expires_in: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_are_not_reservations() {
        let id = LeaseId::new("acme");
        let token = id.to_string();
        assert!(token.starts_with("l1."), "{token}");
        assert_eq!(LeaseId::parse(&token), Some(id.clone()));
        assert_eq!(
            super::super::ReservationId::parse(&token),
            None,
            "a lease is not a reservation"
        );
        assert_eq!(
            id.record_name().as_str(),
            format!("acme:l::{}", id.member())
        );
        assert_eq!(
            LeaseId::parse("r1.000000000000000000000000000000ff.6162"),
            None
        );
    }
}
