//! Times to live that callers ask for: each kind's default and bounds,
//! checked here once for every API (a wing only converts its wire format
//! into microseconds).

use super::DecideError;
use crate::algorithm::Micros;
use crate::store::{lease, reservation};

/// What a time to live is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ttl {
    /// A reservation (`Reserve`): from 1 µs to one hour.
    Reservation,
    /// A lease (`Acquire`, `Renew`): from 1 ms to one hour.
    Lease,
    /// A lease held by a stream (`Hold`): from 1 s (it is renewed every
    /// third of it) to one hour.
    HeldLease,
}

impl Ttl {
    /// The time to live when the caller names none: one minute.
    pub const DEFAULT: Micros = 60_000_000;

    /// The shortest time to live of this kind.
    pub const fn min(self) -> Micros {
        match self {
            Self::Reservation => 1,
            Self::Lease => 1_000,
            Self::HeldLease => 1_000_000,
        }
    }

    /// The longest time to live of this kind.
    pub const fn max(self) -> Micros {
        match self {
            Self::Reservation => reservation::MAX_TTL,
            Self::Lease | Self::HeldLease => lease::MAX_TTL,
        }
    }

    /// The time to live `asked` (in microseconds, as the caller sent it;
    /// `None`: the default), or an `InvalidField` naming the bounds.
    pub fn check(self, asked: Option<i128>) -> Result<Micros, DecideError> {
        let Some(us) = asked else {
            return Ok(Self::DEFAULT);
        };
        if us >= i128::from(self.min()) && us <= i128::from(self.max()) {
            return Ok(us as Micros);
        }
        let shown = format!(
            "{}{}.{:06} s",
            if us < 0 { "-" } else { "" },
            us.unsigned_abs() / 1_000_000,
            us.unsigned_abs() % 1_000_000
        );
        Err(DecideError::InvalidField(match self {
            Self::Reservation => {
                format!("ttl is {shown}; a reservation lives from 1 µs to one hour (3600 s)")
            }
            Self::Lease => format!(
                "ttl is {shown}; a lease lives from 1 ms to one hour (3600 s): renew it for \
                 longer work"
            ),
            Self::HeldLease => format!(
                "ttl is {shown}; a held lease's ttl must be at least 1 s (it is renewed every \
                 third of it, and it is the backstop that frees the slot if this Tollgate \
                 instance dies) and at most one hour (3600 s)"
            ),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_bounds_per_kind() {
        assert_eq!(Ttl::Lease.check(None).unwrap(), 60_000_000);
        assert_eq!(Ttl::Reservation.check(Some(1)).unwrap(), 1);
        assert!(Ttl::Lease.check(Some(999)).is_err());
        assert_eq!(Ttl::Lease.check(Some(1_000)).unwrap(), 1_000);
        assert_eq!(Ttl::HeldLease.check(Some(1_000_000)).unwrap(), 1_000_000);
        let hour = 3_600_000_000;
        assert_eq!(Ttl::Reservation.check(Some(hour)).unwrap(), hour as Micros);
        let err = Ttl::Reservation
            .check(Some(hour + 1))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "ttl is 3600.000001 s; a reservation lives from 1 µs to one hour (3600 s)"
        );
        let err = Ttl::HeldLease.check(Some(500_000)).unwrap_err().to_string();
        assert!(err.starts_with("ttl is 0.500000 s; a held lease's ttl must be at least 1 s"));
        let err = Ttl::Reservation
            .check(Some(-2_500_000))
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("ttl is -2.500000 s;"), "{err}");
    }
}
