//! The usual call in its own form (see "The usual call" in
//! `lua/token_bucket.lua`): every request decides and spends, every bucket
//! is a token bucket without a debt floor. Each key, limit and cost other
//! than 1 is sent once per call, each bucket as three bytes naming them,
//! and the reply is one value per bucket, from which the balance and the
//! wait follow here. Redis parses and formats far less per decision
//! (BENCHMARKS.md, "Redis's own CPU per decision").

use smallvec::SmallVec;

use crate::algorithm::{Algorithm, Charge, Micros, Verdict};
use crate::store::{StoreError, Verdicts};

use super::script::{Kind, Reply, Request};

/// A byte names a key or a cost; a limit's byte also carries the shadow
/// flag (128), and ARGV[2] is read with one `string.byte`, whose results
/// Lua's C stack must hold (8 000 values).
const MOST_KEYS: usize = 255;
const MOST_LIMITS: usize = 127;
const MOST_COSTS: usize = 255;
const MOST_PLAN_BYTES: usize = 4000;
const SHADOW: u8 = 128;

/// One script call in the usual form, ready to be written.
pub(super) struct UsualCall<'a> {
    /// Each bucket key once, in the order first named, with its hash (a
    /// key is compared in full only with those of the same hash).
    keys: SmallVec<[(u64, &'a str); 16]>,
    /// Each limit once: (interval, burst).
    limits: SmallVec<[(Micros, u64); 4]>,
    /// Each cost other than 1 once.
    costs: SmallVec<[u64; 4]>,
    /// "=", the number of limits, then per request its number of buckets
    /// and per bucket its key, limit and cost bytes.
    plan: Vec<u8>,
}

impl<'a> UsualCall<'a> {
    /// The call of `requests` in the usual form, or `None` when one of them
    /// is not a usual request, or the call names more keys, limits or
    /// costs than the form holds (the general form carries it then).
    pub(super) fn of(requests: &[&'a Request]) -> Option<Self> {
        let buckets: usize = requests.iter().map(|r| r.charges.len()).sum();
        if 2 + requests.len() + 3 * buckets > MOST_PLAN_BYTES {
            return None;
        }
        let mut call = UsualCall {
            keys: SmallVec::new(),
            limits: SmallVec::new(),
            costs: SmallVec::new(),
            plan: Vec::with_capacity(2 + requests.len() + 3 * buckets),
        };
        call.plan.extend_from_slice(b"=\0");
        for request in requests {
            let n = request.charges.len();
            if !matches!(request.kind, Kind::Decide { spend: true })
                || n == 0
                || n > 255
                || request.keys.len() != n
            {
                return None;
            }
            call.plan.push(n as u8);
            for (key, charge) in request.keys.iter().zip(&request.charges) {
                if !is_usual(charge) {
                    return None;
                }
                let key = index_of(&mut call.keys, (hash(key), key.as_str()), MOST_KEYS)?;
                let limit = (charge.limit.interval(), charge.limit.burst());
                let limit = index_of(&mut call.limits, limit, MOST_LIMITS)?;
                let cost = match charge.cost {
                    1 => 0,
                    cost => index_of(&mut call.costs, cost, MOST_COSTS)?,
                };
                let shadow = if charge.enforce { 0 } else { SHADOW };
                call.plan.extend_from_slice(&[key, limit | shadow, cost]);
            }
        }
        call.plan[1] = call.limits.len() as u8;
        Some(call)
    }

    /// The `EVALSHA` of script `sha` (see `script::evalsha` for `now`,
    /// `deadline` and `margin_ms`), written straight in RESP: an array of
    /// bulk strings, as `redis::Cmd` would write it, without first copying
    /// each argument into a command.
    pub(super) fn evalsha(&self, sha: &str, now: &str, deadline: i64, margin_ms: u64) -> Vec<u8> {
        let args = 3 + self.keys.len() + 3 + self.limits.len() + self.costs.len();
        let key_bytes: usize = self.keys.iter().map(|(_, k)| k.len() + 16).sum();
        let mut out = Vec::with_capacity(96 + key_bytes + self.plan.len() + 48 * args);
        let mut digits = itoa::Buffer::new();
        out.push(b'*');
        out.extend_from_slice(digits.format(args).as_bytes());
        out.extend_from_slice(b"\r\n");
        bulk(&mut out, b"EVALSHA");
        bulk(&mut out, sha.as_bytes());
        bulk(&mut out, digits.format(self.keys.len()).as_bytes());
        for (_, key) in &self.keys {
            bulk(&mut out, key.as_bytes());
        }
        let mut field = String::with_capacity(48);
        field.push_str(now);
        field.push('@');
        field.push_str(digits.format(deadline));
        bulk(&mut out, field.as_bytes());
        bulk(&mut out, &self.plan);
        bulk(&mut out, digits.format(margin_ms).as_bytes());
        for &(interval, burst) in &self.limits {
            field.clear();
            field.push_str(digits.format(interval));
            field.push(':');
            field.push_str(digits.format(burst));
            bulk(&mut out, field.as_bytes());
        }
        for &cost in &self.costs {
            bulk(&mut out, digits.format(cost).as_bytes());
        }
        out
    }
}

/// Appends `bytes` as a RESP bulk string.
fn bulk(out: &mut Vec<u8>, bytes: &[u8]) {
    let mut digits = itoa::Buffer::new();
    out.push(b'$');
    out.extend_from_slice(digits.format(bytes.len()).as_bytes());
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
}

/// A charge the usual form carries: a token bucket without a debt floor
/// whose cost is all it needs.
fn is_usual(charge: &Charge) -> bool {
    charge.limit.algorithm() == Algorithm::TokenBucket
        && charge.limit.debt() == 0
        && charge.need <= charge.cost
}

/// A bucket key's hash, for [`UsualCall::of`]'s lookup: tuples compare
/// their hashes first, so keys sharing a long prefix (a tenant's, a
/// resource's) are compared byte by byte only when they are likely equal.
fn hash(key: &str) -> u64 {
    use std::hash::BuildHasher;
    foldhash::fast::FixedState::with_seed(0x75_5a1).hash_one(key)
}

/// The 1-based index of `item` in `items`, added when new; `None` past
/// `most` items.
fn index_of<T: PartialEq, const N: usize>(
    items: &mut SmallVec<[T; N]>,
    item: T,
    most: usize,
) -> Option<u8>
where
    [T; N]: smallvec::Array<Item = T>,
{
    let at = match items.iter().position(|i| *i == item) {
        Some(at) => at,
        None if items.len() < most => {
            items.push(item);
            items.len() - 1
        }
        None => return None,
    };
    Some(at as u8 + 1)
}

/// The verdicts of the usual form's reply: its clock, then per bucket
/// 2 × reset_after + allowed.
pub(super) fn parse_reply(reply: &[i64], requests: &[&Request]) -> Result<Vec<Reply>, StoreError> {
    let buckets: usize = requests.iter().map(|r| r.charges.len()).sum();
    if reply.len() != 1 + buckets {
        return Err(StoreError::Protocol(format!(
            "token_bucket.lua returned {} values for {buckets} buckets in the usual form",
            reply.len()
        )));
    }
    let mut values = reply[1..].iter();
    let mut outcomes = Vec::with_capacity(requests.len());
    for request in requests {
        let mut verdicts = Vec::with_capacity(request.charges.len());
        for (charge, &value) in request.charges.iter().zip(values.by_ref()) {
            verdicts.push(verdict(charge, value).ok_or_else(|| {
                StoreError::Protocol(format!(
                    "token_bucket.lua returned {value} for a bucket, not 2 × reset_after + allowed"
                ))
            })?);
        }
        // Allowed when every enforced bucket admits (as the script decides).
        let allowed = request
            .charges
            .iter()
            .zip(&verdicts)
            .all(|(c, v)| v.allowed || !c.enforce);
        outcomes.push(Reply::Verdicts(Verdicts { allowed, verdicts }));
    }
    Ok(outcomes)
}

/// A bucket's verdict from its reply value, its limit and its cost (see
/// the script's usual form): what `apply_tokens` reports, recomputed.
fn verdict(charge: &Charge, value: i64) -> Option<Verdict> {
    let value = u64::try_from(value).ok()?;
    let (allowed, reset) = (value & 1 == 1, value >> 1);
    let interval = charge.limit.interval().max(1);
    let burst = charge.limit.burst();
    let tolerance = burst.checked_mul(interval)?;
    let (remaining, debt) = if reset <= tolerance {
        ((tolerance - reset) / interval, 0)
    } else {
        (0, (reset - tolerance).div_ceil(interval))
    };
    let retry_after = if allowed {
        0
    } else if charge.cost > burst {
        Micros::MAX
    } else {
        (reset + charge.cost * interval).saturating_sub(tolerance)
    };
    Some(Verdict {
        allowed,
        remaining,
        debt,
        forgiven: 0,
        retry_after,
        reset_after: reset,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Limit;

    fn decide(keys: &[&str], charges: Vec<Charge>) -> Request {
        Request {
            keys: keys.iter().map(|k| k.to_string()).collect(),
            charges: charges.into_iter().collect(),
            kind: Kind::Decide { spend: true },
        }
    }

    /// `n` tokens a second, a burst of `n`.
    fn per_second(n: u64) -> Limit {
        Limit::new(n, format!("{n}/second").parse().unwrap()).unwrap()
    }

    #[test]
    fn keys_limits_and_costs_are_sent_once() {
        let ceiling = per_second(100);
        let a = decide(
            &["k:a", "t:"],
            vec![Charge::new(per_second(10), 1), Charge::new(ceiling, 1)],
        );
        let mut shadow = Charge::new(per_second(10), 5);
        shadow.enforce = false;
        let b = decide(&["k:b", "t:"], vec![shadow, Charge::new(ceiling, 5)]);
        let call = UsualCall::of(&[&a, &b]).unwrap();
        let keys: Vec<&str> = call.keys.iter().map(|(_, k)| *k).collect();
        assert_eq!(keys, ["k:a", "t:", "k:b"]);
        assert_eq!(call.limits.as_slice(), [(100_000, 10), (10_000, 100)]);
        assert_eq!(call.costs.as_slice(), [5]);
        assert_eq!(
            call.plan,
            b"=\x02\x02\x01\x01\x00\x02\x02\x00\x02\x03\x81\x01\x02\x02\x01"
        );
    }

    /// The call written straight in RESP is byte for byte what
    /// `redis::Cmd` writes for the same arguments.
    #[test]
    fn the_call_is_written_as_a_redis_command_would_be() {
        let ceiling = per_second(100);
        let a = decide(
            &["k:a", "t:"],
            vec![Charge::new(per_second(10), 1), Charge::new(ceiling, 1)],
        );
        let b = decide(
            &["k:ü", "t:"],
            vec![Charge::new(per_second(10), 7), Charge::new(ceiling, 7)],
        );
        let call = UsualCall::of(&[&a, &b]).unwrap();
        let sha = "0123456789abcdef0123456789abcdef01234567";
        let written = call.evalsha(sha, "1700000000123456", -3, 2000);
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(sha)
            .arg(3)
            .arg("k:a")
            .arg("t:")
            .arg("k:ü")
            .arg("1700000000123456@-3")
            .arg(&call.plan[..])
            .arg(2000)
            .arg("100000:10")
            .arg("10000:100")
            .arg(7);
        assert_eq!(written, cmd.get_packed_command());
    }

    #[test]
    fn anything_unusual_takes_the_general_form() {
        let dry = Request {
            kind: Kind::Decide { spend: false },
            ..decide(&["k:a"], vec![Charge::new(per_second(10), 1)])
        };
        assert!(UsualCall::of(&[&dry]).is_none());
        let mut ask = Charge::new(per_second(10), 0);
        ask.need = 1;
        assert!(UsualCall::of(&[&decide(&["k:a"], vec![ask])]).is_none());
        let many: Vec<Request> = (0..256)
            .map(|i| decide(&[&format!("k:{i}")], vec![Charge::new(per_second(10), 1)]))
            .collect();
        let refs: Vec<&Request> = many.iter().collect();
        assert!(UsualCall::of(&refs[..255]).is_some());
        assert!(UsualCall::of(&refs).is_none(), "256 keys");
    }

    #[test]
    fn a_reply_value_is_the_verdict_apply_tokens_gives() {
        // 10 tokens a second: a token is 100 000 µs, the bucket 1 s.
        let charge = Charge::new(per_second(10), 3);
        // Allowed, full again in 0.3 s: 7 tokens left.
        let v = verdict(&charge, 300_000 * 2 + 1).unwrap();
        assert_eq!(
            (v.allowed, v.remaining, v.debt, v.retry_after, v.reset_after),
            (true, 7, 0, 0, 300_000)
        );
        // Refused 0.85 s from full (1.5 tokens): 3 fit in 0.15 s.
        let v = verdict(&charge, 850_000 * 2).unwrap();
        assert_eq!(
            (v.allowed, v.remaining, v.debt, v.retry_after, v.reset_after),
            (false, 1, 0, 150_000, 850_000)
        );
        // In debt (a rule with a floor wrote it): 1.25 s from full owes
        // 2.5 tokens, rounded up.
        let v = verdict(&charge, 1_250_000 * 2).unwrap();
        assert_eq!((v.remaining, v.debt, v.retry_after), (0, 3, 550_000));
        // More than the burst never fits.
        let v = verdict(&Charge::new(per_second(10), 11), 0).unwrap();
        assert_eq!(
            (v.allowed, v.remaining, v.retry_after),
            (false, 10, Micros::MAX)
        );
        assert!(verdict(&charge, -1).is_none());
    }
}
