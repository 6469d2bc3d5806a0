//! Several buckets decided together, all or nothing, under any algorithm.

use super::{Algorithm, BucketState, Charge, CostExceedsBurst, Limit, Micros, Op, State, Verdict};
use super::{concurrency, token_bucket, window};

/// The state as the limit's algorithm reads it: a state written under
/// another algorithm (the rule changed its algorithm) counts as no state.
fn split(
    state: Option<State>,
    limit: &Limit,
) -> Result<Option<BucketState>, Option<window::WindowState>> {
    match (limit.algorithm, state) {
        (Algorithm::TokenBucket, Some(State::Tokens(s))) => Ok(Some(s)),
        (Algorithm::TokenBucket, _) => Ok(None),
        (_, Some(State::Window(w))) => Err(Some(w)),
        (_, _) => Err(None),
    }
}

/// Decides one charge under any algorithm: spends `cost` when the bucket
/// holds `need` (see [`token_bucket::decide_need`]).
pub fn decide_any(
    state: Option<State>,
    limit: &Limit,
    cost: u64,
    now: Micros,
) -> Result<(Verdict, State), CostExceedsBurst> {
    decide_need_any(state, limit, cost, cost, now)
}

fn decide_need_any(
    state: Option<State>,
    limit: &Limit,
    cost: u64,
    need: u64,
    now: Micros,
) -> Result<(Verdict, State), CostExceedsBurst> {
    if limit.is_concurrency() {
        let (v, o) = concurrency::decide(occupancy(state), limit.burst(), need, None, now);
        return Ok((v, State::Leases(o)));
    }
    match split(state, limit) {
        Ok(tokens) => token_bucket::decide_need(tokens, limit, cost, need, now)
            .map(|(v, s)| (v, State::Tokens(s))),
        Err(win) => {
            window::decide_need(win, limit, cost, need, now).map(|(v, w)| (v, State::Window(w)))
        }
    }
}

/// A lease set's occupancy from a state (anything else: empty).
fn occupancy(state: Option<State>) -> Option<concurrency::Occupancy> {
    match state {
        Some(State::Leases(o)) => Some(o),
        _ => None,
    }
}

/// Applies one charge with an unconditional op ([`Op::Charge`] or
/// [`Op::Refund`]) under any algorithm. A concurrency cap is only
/// reported: tokens charged after the fact take no slot.
pub fn apply_any(state: Option<State>, charge: &Charge, op: Op, now: Micros) -> (Verdict, State) {
    let limit = &charge.limit;
    if limit.is_concurrency() {
        let (v, o) = concurrency::decide(occupancy(state), limit.burst(), 0, None, now);
        return (v, State::Leases(o));
    }
    match (split(state, limit), op) {
        (Ok(tokens), Op::Refund { .. }) => {
            let (v, s) = token_bucket::refund(tokens, limit, charge.cost, now);
            (v, State::Tokens(s))
        }
        (Ok(tokens), _) => {
            let (v, s) = token_bucket::charge(tokens, limit, charge.cost, now);
            (v, State::Tokens(s))
        }
        (Err(win), Op::Refund { since }) => {
            let (v, w) = window::refund(win, limit, charge.cost, since, now);
            (v, State::Window(w))
        }
        (Err(win), _) => {
            let (v, w) = window::charge(win, limit, charge.cost, now);
            (v, State::Window(w))
        }
    }
}

/// What a bucket holds at `now`, without spending: the verdict for a cost
/// of zero.
pub fn current(state: Option<State>, limit: &Limit, now: Micros) -> Verdict {
    match decide_any(state, limit, 0, now) {
        Ok((verdict, _)) => verdict,
        Err(_) => unreachable!("a cost of zero never exceeds a capacity"),
    }
}

/// The outcome of [`plan`]: one verdict per charge, and whether to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// One verdict per charge, in order.
    pub verdicts: Vec<Verdict>,
    /// The states to store, one per charge: `Some` where the bucket changes.
    pub writes: Vec<Option<State>>,
    /// True when every enforced charge admits its cost.
    pub allowed: bool,
}

/// Applies a set of charges together with `op`.
///
/// [`Op::Decide`] is all-or-nothing: the request is allowed when every
/// enforced charge holds what it needs. Only then, and only when spending,
/// is anything written: each charge that admitted its cost (shadow ones
/// included) is spent. When the request is rejected nothing is spent, and
/// the verdicts of buckets that would have admitted the cost report what
/// they hold now rather than after a spend. Needs must not exceed
/// capacities (check beforehand; such a charge is reported as denied with
/// an unbounded wait).
///
/// [`Op::Acquire`] decides and spends the same way and, in each admitting
/// concurrency cap, takes a lease (its write is the occupancy with the
/// lease counted; the store adds the lease itself). Under any other op a
/// concurrency cap is only checked, never written.
///
/// [`Op::Charge`] and [`Op::Refund`] apply to every bucket, shadow ones
/// included, unconditionally.
///
/// Each bucket must appear at most once (merge costs beforehand).
pub fn plan(states: &[Option<State>], charges: &[Charge], now: Micros, op: Op) -> Plan {
    debug_assert_eq!(states.len(), charges.len());
    let (spend, grant) = match op {
        Op::Decide { spend } => (spend, None),
        Op::Acquire { ttl } => (true, Some(now.saturating_add(ttl))),
        Op::Charge | Op::Refund { .. } => {
            let (verdicts, writes) = states
                .iter()
                .zip(charges)
                .map(|(state, charge)| {
                    let (v, s) = apply_any(*state, charge, op, now);
                    (v, (!charge.limit.is_concurrency()).then_some(s))
                })
                .unzip();
            return Plan {
                verdicts,
                writes,
                allowed: true,
            };
        }
    };
    let mut verdicts = Vec::with_capacity(charges.len());
    // The next states, then (in place, one allocation) the writes.
    let mut writes = Vec::with_capacity(charges.len());
    let mut allowed = true;
    for (state, charge) in states.iter().zip(charges) {
        let decided = if charge.limit.is_concurrency() {
            let (v, o) = concurrency::decide(
                occupancy(*state),
                charge.limit.burst(),
                charge.need,
                grant,
                now,
            );
            Ok((v, State::Leases(o)))
        } else {
            decide_need_any(*state, &charge.limit, charge.cost, charge.need, now)
        };
        let (verdict, state) = decided.unwrap_or_else(|_| {
            let verdict = Verdict {
                allowed: false,
                retry_after: Micros::MAX,
                ..current(*state, &charge.limit, now)
            };
            (
                verdict,
                State::Tokens(BucketState::full(&charge.limit, now)),
            )
        });
        allowed &= verdict.allowed || !charge.enforce;
        verdicts.push(verdict);
        writes.push(Some(state));
    }
    if allowed && spend {
        for ((write, v), c) in writes.iter_mut().zip(&verdicts).zip(charges) {
            if !(v.allowed && (grant.is_some() || !c.limit.is_concurrency())) {
                *write = None;
            }
        }
    } else {
        if !allowed {
            // Nothing is spent: report what the admitting buckets hold now.
            for ((v, c), state) in verdicts.iter_mut().zip(charges).zip(states) {
                if v.allowed {
                    *v = current(*state, &c.limit, now);
                }
            }
        }
        writes.fill(None);
    }
    Plan {
        verdicts,
        writes,
        allowed,
    }
}
