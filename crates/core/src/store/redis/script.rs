//! One call of the decision script, `lua/token_bucket.lua`: how requests
//! are written into one `EVALSHA` (see the script's header for the
//! arguments) and how its reply is read back.

use smallvec::SmallVec;

use crate::algorithm::{Algorithm, Charge, Micros, Verdict};
use crate::store::{
    LeaseAnswer, LeaseOp, LeaseStatus, Reservation, SettleStatus, Settled, StoreError, Verdicts,
};

/// One request's part of a script call.
pub(super) struct Request {
    /// The buckets' keys, then a reserve's or a settle's record key.
    pub keys: SmallVec<[String; 4]>,
    /// One per bucket.
    pub charges: SmallVec<[Charge; 4]>,
    pub kind: Kind,
}

/// What a request asks of the script.
impl Request {
    /// True when the call may write a quota counter: it charges one, or it
    /// settles a reservation (whose record may name one).
    pub(super) fn may_enter_a_period(&self) -> bool {
        matches!(self.kind, Kind::Settle { .. })
            || self.charges.iter().any(|c| c.limit.period().is_some())
    }
}

#[derive(Debug, Clone)]
pub(super) enum Kind {
    Decide { spend: bool },
    Charge,
    Refund { since: Micros },
    Reserve { ttl: Micros, body: String },
    Settle { actual: u64 },
    Acquire { ttl: Micros, member: String },
    Lease(LeaseOp),
}

impl Kind {
    /// The operation letter and argument in the script's ARGV[2].
    fn write_shape(&self, n: usize, shape: &mut String) {
        shape.push_str(itoa::Buffer::new().format(n));
        match self {
            Self::Decide { spend: true } => shape.push('s'),
            Self::Decide { spend: false } => shape.push('d'),
            Self::Charge => shape.push('c'),
            Self::Refund { since } => {
                shape.push('r');
                shape.push_str(itoa::Buffer::new().format(*since));
            }
            Self::Reserve { ttl, .. } => {
                shape.push('v');
                shape.push_str(itoa::Buffer::new().format(*ttl));
            }
            Self::Settle { actual } => {
                shape.push('u');
                shape.push_str(itoa::Buffer::new().format(*actual));
            }
            Self::Acquire { ttl, .. } => {
                shape.push('a');
                shape.push_str(itoa::Buffer::new().format(*ttl));
            }
            Self::Lease(LeaseOp::Release) => shape.push('x'),
            Self::Lease(LeaseOp::Renew { ttl }) => {
                shape.push('e');
                shape.push_str(itoa::Buffer::new().format(*ttl));
            }
        }
    }
}

/// A request's answer.
#[derive(Debug, Clone)]
pub(super) enum Reply {
    Verdicts(Verdicts),
    /// A reserve refused because its tenant holds `held` records, the cap.
    RecordsFull {
        held: u64,
    },
    Settled(Settled),
    Lease(LeaseAnswer),
}

/// A reserve's record body (see the script's header): the estimate, then
/// per charge its limit, cost, lines and bucket key.
pub(super) fn record_body(
    keys: &[String],
    charges: &[Charge],
    reservation: &Reservation,
) -> String {
    let mut body = format!("{}\n", reservation.estimate);
    for ((key, charge), lines) in keys.iter().zip(charges).zip(&reservation.lines) {
        let l = &charge.limit;
        let start = l
            .period()
            .map(|p| match l.alerts() {
                a if a.is_empty() => format!(" {}", p.start),
                a => format!(" {} {}", p.start, a.script_field()),
            })
            .unwrap_or_default();
        body.push_str(&format!(
            "{} {} {} {} {} {} {}{start}\n{key}",
            algorithm_letter(l.algorithm()),
            l.interval(),
            l.burst(),
            l.debt(),
            charge.cost,
            lines,
            key.len()
        ));
    }
    body
}

fn algorithm_letter(algorithm: Algorithm) -> &'static str {
    match algorithm {
        Algorithm::TokenBucket => "t",
        Algorithm::FixedWindow => "f",
        Algorithm::SlidingWindow => "s",
        Algorithm::Concurrency => "l",
        Algorithm::Quota => "q",
    }
}

/// A bucket's rule field: the algorithm's letter, "1" enforced or "0"
/// shadow, and ":DEBT" for a debt floor.
fn write_rule(charge: &Charge, out: &mut String) {
    out.push_str(algorithm_letter(charge.limit.algorithm()));
    out.push(if charge.enforce { '1' } else { '0' });
    if charge.limit.debt() > 0 {
        out.push(':');
        out.push_str(itoa::Buffer::new().format(charge.limit.debt()));
    }
}

/// The `EVALSHA` of script `sha` deciding `requests` in order, at `now`
/// (empty: Redis's clock), unless Redis runs it at or after `deadline` on
/// its own clock (µs), with each bucket's expiry `margin_ms` past the
/// moment it is full again. Written straight into one command (redis-rs's
/// `ScriptInvocation` would allocate a vector per key and argument first,
/// then copy them: ~20 allocations per decision).
pub(super) fn evalsha(
    sha: &str,
    requests: &[&Request],
    now: &str,
    deadline: i64,
    margin_ms: u64,
    record_cap: Option<usize>,
    journal: Option<&str>,
) -> redis::Cmd {
    let keys: usize =
        requests.iter().map(|r| r.keys.len()).sum::<usize>() + usize::from(journal.is_some());
    let mut shape = String::with_capacity(4 * requests.len());
    for request in requests {
        if !shape.is_empty() {
            shape.push(',');
        }
        request.kind.write_shape(request.charges.len(), &mut shape);
    }
    let mut evalsha = redis::cmd("EVALSHA");
    evalsha.arg(sha).arg(keys);
    for key in requests.iter().flat_map(|r| &r.keys) {
        evalsha.arg(key.as_str());
    }
    if let Some(journal) = journal {
        evalsha.arg(journal);
    }
    // One buffer for every field written here: redis-rs copies each
    // argument into the command.
    let mut field = String::with_capacity(48);
    field.push_str(now);
    field.push('@');
    field.push_str(itoa::Buffer::new().format(deadline));
    evalsha.arg(field.as_str()).arg(shape);
    let j = if journal.is_some() { "j" } else { "" };
    match record_cap {
        Some(cap) => evalsha.arg(format!("{margin_ms}:{cap}{j}")),
        None if journal.is_some() => evalsha.arg(format!("{margin_ms}j")),
        None => evalsha.arg(margin_ms),
    };
    for c in requests.iter().flat_map(|r| &r.charges) {
        field.clear();
        write_rule(c, &mut field);
        evalsha.arg(field.as_str());
        field.clear();
        field.push_str(itoa::Buffer::new().format(c.limit.interval()));
        field.push(':');
        field.push_str(itoa::Buffer::new().format(c.limit.burst()));
        if let Some(period) = c.limit.period() {
            field.push(':');
            field.push_str(itoa::Buffer::new().format(period.start));
            if !c.limit.alerts().is_empty() {
                field.push(':');
                field.push_str(&c.limit.alerts().script_field());
            }
        }
        evalsha.arg(field.as_str());
        if c.need > c.cost {
            field.clear();
            field.push_str(itoa::Buffer::new().format(c.cost));
            field.push('/');
            field.push_str(itoa::Buffer::new().format(c.need));
            evalsha.arg(field.as_str());
        } else {
            evalsha.arg(c.cost);
        }
    }
    for request in requests {
        match &request.kind {
            Kind::Reserve { body, .. } => evalsha.arg(body.as_str()),
            Kind::Acquire { member, .. } => evalsha.arg(member.as_str()),
            _ => continue,
        };
    }
    evalsha
}

/// Redis's clock as a script call's reply reports it (its first values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Clock {
    /// The call ran; Redis's `TIME` then (µs).
    OnTime(i64),
    /// The call ran at or after its deadline and applied nothing.
    Late(i64),
}

/// The clock at the head of a script call's reply, `None` when the reply
/// is not one (the caller's parse names that).
pub(super) fn clock_of(reply: &redis::Value) -> Option<Clock> {
    let redis::Value::Array(items) = reply else {
        return None;
    };
    match items.as_slice() {
        [redis::Value::Int(-1), redis::Value::Int(clock)] => Some(Clock::Late(*clock)),
        [redis::Value::Int(clock), ..] if *clock >= 0 => Some(Clock::OnTime(*clock)),
        _ => None,
    }
}

/// Reply values per bucket.
const PER_BUCKET: usize = 3;

/// A verdict from a bucket's three reply values: 2 × balance (negative:
/// tokens owed) + allowed, retry_after (a charge: tokens forgiven) and
/// reset_after.
fn verdict(v: &[i64], charge: bool) -> Verdict {
    let as_micros = |v: i64| -> Micros { if v < 0 { Micros::MAX } else { v as Micros } };
    let balance = v[0] >> 1;
    Verdict {
        allowed: v[0] & 1 == 1,
        remaining: balance.max(0) as u64,
        debt: balance.min(0).unsigned_abs(),
        forgiven: if charge { v[1].max(0) as u64 } else { 0 },
        retry_after: if charge { 0 } else { as_micros(v[1]) },
        reset_after: as_micros(v[2]),
    }
}

/// Splits the script's reply: `now`, then per request its answer (see the
/// script's header).
pub(super) fn parse_reply<'a>(
    reply: &[i64],
    requests: impl ExactSizeIterator<Item = (&'a Kind, &'a [Charge])>,
) -> Result<Vec<Reply>, StoreError> {
    let short = || {
        StoreError::Protocol(format!(
            "token_bucket.lua returned {} values, fewer than its requests need",
            reply.len()
        ))
    };
    let mut rest = reply.get(1..).ok_or_else(short)?;
    let mut outcomes = Vec::with_capacity(requests.len());
    for (kind, charges) in requests {
        let n = charges.len();
        if let Kind::Lease(_) = kind {
            let [status, expires_in, ..] = *rest else {
                return Err(short());
            };
            rest = &rest[2..];
            let status = match status {
                1 => LeaseStatus::Done,
                2 => LeaseStatus::AlreadyReleased,
                3 => LeaseStatus::Expired,
                _ => LeaseStatus::Unknown,
            };
            outcomes.push(Reply::Lease(LeaseAnswer {
                status,
                expires_in: expires_in.max(0) as Micros,
            }));
            continue;
        }
        if let Kind::Settle { .. } = kind {
            let [status, actual, estimate, n, ..] = *rest else {
                return Err(short());
            };
            let n = usize::try_from(n).map_err(|_| short())?;
            let this = rest.get(4..4 + PER_BUCKET * n).ok_or_else(short)?;
            rest = &rest[4 + PER_BUCKET * n..];
            let status = match status {
                1 => SettleStatus::Settled,
                2 => SettleStatus::AlreadySettled {
                    actual: actual as u64,
                },
                3 => SettleStatus::Expired,
                _ => SettleStatus::Unknown,
            };
            outcomes.push(Reply::Settled(Settled {
                status,
                estimate: estimate.max(0) as u64,
                verdicts: this
                    .chunks_exact(PER_BUCKET)
                    .map(|v| verdict(v, true))
                    .collect(),
            }));
            continue;
        }
        let this = rest.get(..PER_BUCKET * n).ok_or_else(short)?;
        rest = &rest[PER_BUCKET * n..];
        if let (Kind::Reserve { .. }, [_, -2, held, ..]) = (kind, this) {
            outcomes.push(Reply::RecordsFull {
                held: (*held).max(0) as u64,
            });
            continue;
        }
        let charge = matches!(kind, Kind::Charge);
        let verdicts: Vec<Verdict> = this
            .chunks_exact(PER_BUCKET)
            .map(|v| verdict(v, charge))
            .collect();
        // Allowed when every enforced bucket admits (as the script decides).
        let allowed = charges
            .iter()
            .zip(&verdicts)
            .all(|(c, v)| v.allowed || !c.enforce);
        outcomes.push(Reply::Verdicts(Verdicts { allowed, verdicts }));
    }
    if !rest.is_empty() {
        return Err(StoreError::Protocol(format!(
            "token_bucket.lua returned {} values more than its requests need",
            rest.len()
        )));
    }
    Ok(outcomes)
}
