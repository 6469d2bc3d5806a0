//! Several buckets decided together, all or nothing, under any algorithm.

use super::{Algorithm, BucketState, Charge, CostExceedsBurst, Limit, Micros, State, Verdict};
use super::{token_bucket, window};

/// Decides one charge under any algorithm. A state written under another
/// algorithm (the rule changed its algorithm) counts as no state.
pub fn decide_any(
    state: Option<State>,
    limit: &Limit,
    cost: u64,
    now: Micros,
) -> Result<(Verdict, State), CostExceedsBurst> {
    match limit.algorithm {
        Algorithm::TokenBucket => {
            let tokens = match state {
                Some(State::Tokens(s)) => Some(s),
                _ => None,
            };
            token_bucket::decide(tokens, limit, cost, now).map(|(v, s)| (v, State::Tokens(s)))
        }
        _ => {
            let win = match state {
                Some(State::Window(w)) => Some(w),
                _ => None,
            };
            window::decide(win, limit, cost, now).map(|(v, w)| (v, State::Window(w)))
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

/// Decides a set of buckets together: all-or-nothing.
///
/// The request is allowed when every enforced charge admits it. Only then,
/// and only when `spend` is true, is anything written: each charge that
/// admitted its cost (shadow ones included) is spent. When the request is
/// rejected nothing is spent, and the verdicts of buckets that would have
/// admitted the cost report what they hold now rather than after a spend.
/// Each bucket must appear at most once (merge costs beforehand); costs
/// must not exceed capacities (check beforehand; such a charge is reported
/// as denied with an unbounded wait).
pub fn plan(states: &[Option<State>], charges: &[Charge], now: Micros, spend: bool) -> Plan {
    debug_assert_eq!(states.len(), charges.len());
    let mut verdicts = Vec::with_capacity(charges.len());
    let mut next = Vec::with_capacity(charges.len());
    let mut allowed = true;
    for (state, charge) in states.iter().zip(charges) {
        let (verdict, state) =
            decide_any(*state, &charge.limit, charge.cost, now).unwrap_or_else(|_| {
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
        next.push(state);
    }
    let writes = if allowed && spend {
        verdicts
            .iter()
            .zip(next)
            .map(|(v, s)| v.allowed.then_some(s))
            .collect()
    } else {
        if !allowed {
            // Nothing is spent: report what the admitting buckets hold now.
            for ((v, c), state) in verdicts.iter_mut().zip(charges).zip(states) {
                if v.allowed {
                    *v = current(*state, &c.limit, now);
                }
            }
        }
        vec![None; charges.len()]
    };
    Plan {
        verdicts,
        writes,
        allowed,
    }
}
