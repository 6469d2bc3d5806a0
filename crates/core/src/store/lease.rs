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

use super::record_id::{RecordId, RecordKind};
use crate::algorithm::Micros;

pub use super::reservation::EXPIRED_GRACE;

/// The longest time to live one acquire or renew may give a lease: one
/// hour (longer work renews).
pub const MAX_TTL: Micros = 3_600_000_000;

/// A lease's identity: the tenant whose caps it holds and a random nonce
/// (its member in the caps' sets); its token is `l1.NONCE.TENANT`, its
/// record `tenant:l::NONCE` (see [`RecordId`]).
pub type LeaseId = RecordId<Leases>;

/// The kind of [`LeaseId`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Leases;

impl RecordKind for Leases {
    const PREFIX: &'static str = "l1.";
    const SET: super::RecordSet = super::RecordSet::Leases;
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
