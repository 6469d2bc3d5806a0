//! Reservations: a decision's charge held open until the actual cost is
//! known.
//!
//! `Reserve` decides like any decision and, when admitted, charges the
//! estimate and writes a record beside the buckets, in the same atomic
//! step: which buckets were charged, under which limits, how many times
//! each (rules sharing a bucket), and when. `Settle` reads the record and,
//! in one atomic step, charges the excess (into debt where a rule allows
//! it) or refunds the difference on every bucket, and marks the record
//! settled. The record, not the caller, says what was reserved, so a
//! settle cannot refund more than was charged; a settle repeated answers
//! what the first one did; a record expires by itself.

use super::record_id::{RecordId, RecordKind};
use crate::algorithm::{Charge, Micros, Op, State, Verdict, apply_any, current};

/// The longest time to live a reservation may ask for: one hour.
pub const MAX_TTL: Micros = 3_600_000_000;

/// How long a record outlives its time to live, so that a late settle is
/// answered "expired" (its estimate stays charged) rather than "unknown".
pub const EXPIRED_GRACE: Micros = 600_000_000;

/// A reservation's identity: the tenant whose buckets it charged and a
/// random nonce; its token is `r1.NONCE.TENANT`, its record
/// `tenant:r::NONCE` (see [`RecordId`]).
pub type ReservationId = RecordId<Reservations>;

/// The kind of [`ReservationId`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Reservations;

impl RecordKind for Reservations {
    const PREFIX: &'static str = "r1.";
    const SET: super::RecordSet = super::RecordSet::Reservations;
}

/// What a reserve writes beside its decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    /// Its identity.
    pub id: ReservationId,
    /// The estimated cost charged per line.
    pub estimate: u64,
    /// For each charge of the decision, how many of the request's lines it
    /// merges (rules sharing a bucket): a settle charges or refunds that
    /// many times the difference.
    pub lines: Vec<u64>,
    /// Time to live: unsettled after it, the estimate stays charged.
    pub ttl: Micros,
}

/// What a settle finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettleStatus {
    /// Settled now.
    Settled,
    /// Settled before, with this actual cost; nothing changed now.
    AlreadySettled {
        /// The actual cost of the settle that counted.
        actual: u64,
    },
    /// Its time to live passed unsettled: the estimate stays charged.
    Expired,
    /// No such reservation (never made, or expired long ago).
    Unknown,
}

impl SettleStatus {
    /// The `status` label of `tollgate_settles_total`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Settled => "settled",
            Self::AlreadySettled { .. } => "already_settled",
            Self::Expired => "expired",
            Self::Unknown => "unknown",
        }
    }
}

/// A store's answer to a settle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settled {
    /// What the settle found.
    pub status: SettleStatus,
    /// The estimate reserved (0 when unknown).
    pub estimate: u64,
    /// One verdict per bucket settled (empty unless settled now): what each
    /// holds after the refund or charge.
    pub verdicts: Vec<crate::algorithm::Verdict>,
}

/// A reservation as a store holds it: what the reserve charged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// When the reserve was decided (the store's clock).
    pub reserved_at: Micros,
    /// After this instant an unsettled reservation has expired.
    pub expires_at: Micros,
    /// The estimate per line.
    pub estimate: u64,
    /// The charges the reserve spent (only those), with the cost each
    /// spent.
    pub charges: Vec<Charge>,
    /// Lines merged into each charge.
    pub lines: Vec<u64>,
    /// The actual cost once settled.
    pub settled: Option<u64>,
}

/// What a settle at `actual` does to each of the record's buckets, whose
/// states are `states`, at `now`: the verdicts and the states to write.
/// A bucket charged `c` for `m` lines is charged `m × actual − c` more
/// (into debt as its limit allows) or refunded the difference; a bucket
/// whose share did not change is left alone.
pub fn settle_plan(
    record: &Record,
    states: &[Option<State>],
    actual: u64,
    now: Micros,
) -> (Vec<Verdict>, Vec<Option<State>>) {
    let max = crate::algorithm::MAX_COST;
    record
        .charges
        .iter()
        .zip(&record.lines)
        .zip(states)
        .map(|((charge, &lines), &state)| {
            let target = lines.saturating_mul(actual).min(max);
            let (op, tokens) = if target > charge.cost {
                (Op::Charge, target - charge.cost)
            } else {
                (
                    Op::Refund {
                        since: record.reserved_at,
                    },
                    charge.cost - target,
                )
            };
            if tokens == 0 {
                return (current(state, &charge.limit, now), None);
            }
            let delta = Charge {
                cost: tokens,
                need: tokens,
                ..*charge
            };
            let (verdict, next) = apply_any(state, &delta, op, now);
            (verdict, Some(next))
        })
        .unzip()
}

impl Settled {
    /// The `status` label of `tollgate_settles_total`.
    pub fn status_label(&self) -> &'static str {
        self.status.label()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_reject_anything_else() {
        for tenant in ["", "acme", "é/ü x", "~llm%3A"] {
            let id = ReservationId::new(tenant);
            let token = id.to_string();
            assert_eq!(ReservationId::parse(&token), Some(id.clone()), "{token}");
            assert!(token.starts_with("r1."));
        }
        let id = ReservationId::from_parts("ab", 255);
        assert_eq!(id.to_string(), "r1.000000000000000000000000000000ff.6162");
        assert_eq!(
            id.record_name().as_str(),
            "ab:r::000000000000000000000000000000ff"
        );
        for bad in [
            "",
            "r1.",
            "r2.000000000000000000000000000000ff.6162",
            "r1.00ff.6162",
            "r1.000000000000000000000000000000fg.6162",
            "r1.000000000000000000000000000000ff.616",
            "r1.000000000000000000000000000000ff.3a",
            "r1.000000000000000000000000000000ff.ff",
        ] {
            assert_eq!(ReservationId::parse(bad), None, "{bad:?}");
        }
    }
}
