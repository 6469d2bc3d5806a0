//! The caps every API shares: one set, checked by the engine for every
//! demand, so that no caller can make one store call (one Redis script
//! call) larger than this, whatever API it uses.
//!
//! | cap | value | what a caller gets beyond it |
//! | --- | --- | --- |
//! | key bytes ([`MAX_KEY_BYTES`]) | 256 | INVALID_ARGUMENT naming the field |
//! | items per request ([`MAX_ITEMS`]) | 1000 | INVALID_ARGUMENT |
//! | entries per Envoy descriptor ([`MAX_ENTRIES`]) | 16 | INVALID_ARGUMENT naming the descriptor |
//! | Envoy domain bytes ([`MAX_DOMAIN_BYTES`]) | 128 | INVALID_ARGUMENT |
//! | buckets per decision ([`MAX_BUCKETS`]) | 2000 | INVALID_ARGUMENT |
//! | cost | sums saturate; at or above [`MAX_COST`] no limit can hold it | as any cost above a capacity |

use super::{DecideError, Demand};

/// Longest key in bytes: a native `key`, or an Envoy descriptor entry's
/// key or value.
pub const MAX_KEY_BYTES: usize = 256;
/// Most items in one request: native batch items, or Envoy descriptors.
pub const MAX_ITEMS: usize = 1000;
/// Most entries in one Envoy descriptor.
pub const MAX_ENTRIES: usize = 16;
/// Longest Envoy domain, in bytes.
pub const MAX_DOMAIN_BYTES: usize = 128;
/// Most distinct buckets one decision may touch: one store call (one
/// Redis script call) never carries more.
pub const MAX_BUCKETS: usize = 2000;
/// Costs are clamped here: above every capacity, and exact in Lua's doubles.
pub use crate::algorithm::MAX_COST;
/// Longest bucket name: a tenant, a scope tag, a resource and a key, or an
/// Envoy domain and a descriptor's entries, each within its cap.
pub const MAX_BUCKET_BYTES: usize =
    3 * MAX_DOMAIN_BYTES + 32 + MAX_ENTRIES * (2 * MAX_KEY_BYTES + 2);

/// Checks a key-like field: not longer than [`MAX_KEY_BYTES`].
pub fn check_key(field: impl FnOnce() -> String, value: &str) -> Result<(), DecideError> {
    if value.len() > MAX_KEY_BYTES {
        return Err(DecideError::InvalidField(format!(
            "{} is {} bytes; at most {MAX_KEY_BYTES} are allowed (hash longer keys first)",
            field(),
            value.len()
        )));
    }
    Ok(())
}

/// Checks the number of items: 1 to [`MAX_ITEMS`]. `what` names the list
/// (`items`, `descriptors`).
pub fn check_items(what: &str, n: usize) -> Result<(), DecideError> {
    if n == 0 {
        return Err(DecideError::InvalidBatch(format!(
            "{what} is empty; send 1 to {MAX_ITEMS} {what}"
        )));
    }
    if n > MAX_ITEMS {
        return Err(DecideError::InvalidBatch(format!(
            "{what} has {n} entries; at most {MAX_ITEMS} are allowed, so split the {}",
            if what == "items" { "batch" } else { "request" }
        )));
    }
    Ok(())
}

/// What the engine checks of every demand, whoever built it.
pub(super) fn check_demand(demand: &Demand<'_>) -> Result<(), DecideError> {
    check_items("items", demand.items.len())?;
    debug_assert!(demand.lines.iter().all(|l| l.item < demand.items.len()));
    for item in &demand.items {
        check_key(|| "key".into(), item.key)?;
    }
    if let Some(line) = demand
        .lines
        .iter()
        .find(|l| l.bucket.as_str().len() > MAX_BUCKET_BYTES)
    {
        return Err(DecideError::InvalidField(format!(
            "a bucket name of {} bytes is longer than the {MAX_BUCKET_BYTES} allowed; shorten the keys",
            line.bucket.as_str().len()
        )));
    }
    Ok(())
}
