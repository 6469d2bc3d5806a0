//! The HTTP header fields an answer carries for the caller to copy into
//! its own response: the IETF RateLimit fields of
//! draft-ietf-httpapi-ratelimit-headers-11, the earlier drafts' ones, or
//! both (`--rate-limit-headers`), and `Retry-After` on a rejection.
//!
//! ```text
//! RateLimit-Policy: "per-user";q=100;w=60, "tenant";q=5000;w=3600
//! RateLimit: "per-user";r=42;t=35, "tenant";r=4900;t=3600
//! ```
//!
//! One list member per enforced rule that applies, named by the rule:
//! `q` its capacity, `w` the seconds it takes to refill from empty (a
//! window's length), `r` what is left, `t` the seconds until it is full
//! again (rounded up). A concurrency cap has `qu="concurrent-requests"`
//! and no window.

use smallvec::SmallVec;

use super::summary::whole_seconds;
use super::{Allowance, Answer, Demand};
use crate::algorithm::Algorithm;

/// Which RateLimit header fields answers carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
pub enum HeaderStyle {
    /// `RateLimit-Policy` and `RateLimit`
    /// (draft-ietf-httpapi-ratelimit-headers-11), one list member per rule.
    #[default]
    #[value(name = "draft-11")]
    #[serde(rename = "draft-11")]
    Draft11,
    /// `RateLimit-Limit`, `RateLimit-Remaining` and `RateLimit-Reset` of the
    /// tightest rule (the drafts before 08).
    #[value(name = "legacy")]
    #[serde(rename = "legacy")]
    Legacy,
    /// Both sets.
    #[value(name = "both")]
    #[serde(rename = "both")]
    Both,
}

/// Header names and values, in the order they are written.
pub type Fields = SmallVec<[(&'static str, String); 6]>;

/// The fields of `item`'s answer, or (`None`) of the whole answer (its
/// tightest item's legacy fields, every item's rules).
pub fn header_fields(
    style: HeaderStyle,
    demand: &Demand<'_>,
    answer: &Answer,
    item: Option<usize>,
) -> Fields {
    let mut fields = Fields::new();
    let legacy = match item {
        Some(i) => answer.items.get(i).and_then(|a| a.headers),
        None => answer.headers,
    };
    let Some(legacy) = legacy else {
        // No limited rule applied: nothing to advertise.
        return fields;
    };
    if style != HeaderStyle::Legacy {
        let (policy, state) = structured(demand, answer, item);
        if !policy.is_empty() {
            fields.push(("RateLimit-Policy", policy));
            fields.push(("RateLimit", state));
        }
    }
    match (style, legacy.retry_after) {
        // Only `Retry-After` of the legacy set: the others are not made.
        (HeaderStyle::Draft11, Some(seconds)) => fields.push((
            "Retry-After",
            itoa::Buffer::new().format(seconds).to_owned(),
        )),
        (HeaderStyle::Draft11, None) => {}
        _ => fields.extend(legacy.pairs()),
    }
    fields
}

/// One rule's list member.
struct Member<'a> {
    name: &'a str,
    quota: u64,
    /// Seconds; `None` for a concurrency cap.
    window: Option<u64>,
    remaining: u64,
    /// Seconds until full.
    reset: u64,
}

/// The `RateLimit-Policy` and `RateLimit` values: one member per enforced
/// line of `item` (every item's when `None`) that limits; a rule that
/// applies to several items of the whole answer is listed once, with its
/// tightest figures.
fn structured(demand: &Demand<'_>, answer: &Answer, item: Option<usize>) -> (String, String) {
    let mut members: SmallVec<[Member<'_>; 4]> = SmallVec::new();
    for (line, verdict) in demand.lines.iter().zip(&answer.lines) {
        if !line.enforce || item.is_some_and(|i| line.item != i) {
            continue;
        }
        let (quota, window) = match line.allowance {
            Allowance::Unlimited => continue,
            Allowance::Blocked { window } => (0, Some(whole_seconds(window))),
            Allowance::Limited(limit) if limit.algorithm() == Algorithm::Concurrency => {
                (limit.burst(), None)
            }
            Allowance::Limited(limit) => (limit.burst(), Some(whole_seconds(limit.tolerance()))),
        };
        let member = Member {
            name: line.label,
            quota,
            window,
            remaining: verdict.remaining,
            reset: whole_seconds(verdict.reset_after),
        };
        match members.iter_mut().find(|m| m.name == line.label) {
            Some(m) if member.remaining < m.remaining => *m = member,
            Some(_) => {}
            None => members.push(member),
        }
    }
    let (mut policy, mut state) = (String::with_capacity(96), String::with_capacity(96));
    let mut digits = itoa::Buffer::new();
    for m in members {
        if !policy.is_empty() {
            policy.push_str(", ");
            state.push_str(", ");
        }
        // Encoded once, for both fields.
        let name_at = policy.len();
        push_sf_string(&mut policy, m.name);
        state.push_str(&policy[name_at..]);
        policy.push_str(";q=");
        policy.push_str(digits.format(m.quota));
        match m.window {
            Some(w) => {
                policy.push_str(";w=");
                policy.push_str(digits.format(w));
            }
            None => policy.push_str(";qu=\"concurrent-requests\""),
        }
        state.push_str(";r=");
        state.push_str(digits.format(m.remaining));
        state.push_str(";t=");
        state.push_str(digits.format(m.reset));
    }
    (policy, state)
}

/// Appends `s` as a structured field String (RFC 9651): quoted, `"` and
/// `\` escaped; bytes outside printable ASCII, which a String cannot hold,
/// percent-encoded (and `%` itself, so the encoding reads back).
fn push_sf_string(out: &mut String, s: &str) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let plain = |b: u8| matches!(b, 0x20..=0x7e) && !matches!(b, b'"' | b'\\' | b'%');
    // A rule name is nearly always plain: its plain start is copied whole.
    // (The first byte that is not plain is ASCII or begins a character, so
    // the cut falls on a character boundary.)
    let cut = s.bytes().position(|b| !plain(b)).unwrap_or(s.len());
    out.push('"');
    out.push_str(&s[..cut]);
    for b in s[cut..].bytes() {
        match b {
            b'"' | b'\\' => {
                out.push('\\');
                out.push(b as char);
            }
            b'%' => out.push_str("%25"),
            _ if plain(b) => out.push(b as char),
            _ => {
                out.push('%');
                out.push(HEX[usize::from(b >> 4)] as char);
                out.push(HEX[usize::from(b & 15)] as char);
            }
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sf_string(s: &str) -> String {
        let mut out = String::new();
        push_sf_string(&mut out, s);
        out
    }

    #[test]
    fn names_are_structured_field_strings() {
        assert_eq!(sf_string("per-user"), "\"per-user\"");
        assert_eq!(sf_string(""), "\"\"");
        assert_eq!(
            sf_string("plain ~!#$&'()*+,-./:;<=>?@[]^_`{|}"),
            "\"plain ~!#$&'()*+,-./:;<=>?@[]^_`{|}\""
        );
        assert_eq!(sf_string("100%"), "\"100%25\"");
        assert_eq!(sf_string("a \"b\" \\c"), "\"a \\\"b\\\" \\\\c\"");
        assert_eq!(sf_string("édge 100%"), "\"%C3%A9dge 100%25\"");
        assert_eq!(sf_string("tab\there"), "\"tab%09here\"");
    }
}
