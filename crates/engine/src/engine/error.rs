//! Why a demand could not be decided. Being over the limit is not an
//! error; it is an answer. `crate::api::status` turns these into gRPC
//! statuses, for every API alike.

use super::Api;
use crate::store::StoreError;

/// Why a demand could not be decided.
#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    /// A field is missing, too long or malformed. The message starts with
    /// the field's name, such as `key`, `items[2].tenant` or
    /// `descriptors[0].entries[1].value`.
    #[error("{0}")]
    InvalidField(String),
    /// The request has too many or no items.
    #[error("{0}")]
    InvalidBatch(String),
    /// A reservation's or a lease's token that is not one Tollgate gave
    /// out. The message names the field and what such tokens look like.
    #[error("{0}")]
    InvalidToken(String),
    /// The demand touches more buckets than one store call may.
    #[error(
        "the request touches more than {max} buckets; one decision may touch at most {max}, so split it{}",
        match api { Api::Native => " into smaller batches", Api::Envoy => " (fewer descriptors)", Api::Rlqs => "" }
    )]
    TooManyBuckets {
        /// The API, for the advice.
        api: Api,
        /// The cap.
        max: usize,
    },
    /// The request spends more than a rule's capacity: it could never pass.
    #[error(
        "cost {cost} of {what} exceeds the capacity (burst) {burst} of rule {rule:?}; \
         it can never be allowed, so lower the cost or raise the rule's burst"
    )]
    CostExceedsCapacity {
        /// `the request`, `items[i]`, or the items that share the bucket.
        what: String,
        /// The rule.
        rule: String,
        /// Its capacity.
        burst: u64,
        /// The cost asked for.
        cost: u64,
    },
    /// No rule applies and the server refuses unlimited requests.
    #[error(
        "no limit applies to tenant {tenant:?} (resource {resource:?}) and this server refuses \
         unlimited requests; add a row for the tenant or a default row (tenant '') to the limits table"
    )]
    NoRule {
        /// The tenant.
        tenant: String,
        /// The resource.
        resource: String,
    },
    /// A settle named a reservation the store does not hold.
    #[error(
        "reservation {0} is unknown: it was never made (a reserve answered while the store was \
         unavailable reserves nothing), or it expired more than ten minutes ago"
    )]
    UnknownReservation(String),
    /// A settle came after the reservation's time to live.
    #[error(
        "reservation {id} expired unsettled, so its estimate of {estimate} stays charged; \
         settle before the ttl ends, or reserve with a longer ttl (at most one hour)"
    )]
    ExpiredReservation {
        /// The token.
        id: String,
        /// The estimate that stays charged.
        estimate: u64,
    },
    /// A renew named a lease the store does not hold.
    #[error(
        "lease {0} is unknown: it was never granted (an acquire answered while the store was \
         unavailable holds no lease unless its rule decides locally), or it expired more than \
         ten minutes ago; acquire a new one"
    )]
    UnknownLease(String),
    /// A renew came after the lease was released or expired.
    #[error("lease {id} cannot be renewed: {why}; acquire a new one")]
    LeaseGone {
        /// The token.
        id: String,
        /// What happened to it.
        why: &'static str,
    },
    /// The store failed and no fallback covered it.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// At most 64 bytes of a caller's string, for an error message.
pub(super) fn shortened(s: &str) -> &str {
    let mut end = s.len().min(64);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}
