//! What the admin port shows of the quota service: each subscribed
//! bucket's demand, share and assignment on this instance. The quota wing
//! ([`super::rlqs`]) records it; the admin wing reads it.

use std::collections::HashMap;

use parking_lot::Mutex;
use serde::Serialize;

use crate::engine::shares::{Assignment, Shared};

/// Most buckets the view holds (every stream's together); past it, new
/// buckets are counted but not shown.
pub const MAX_ROWS: usize = 100_000;

/// One bucket of one stream.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct BucketRow {
    /// The stream's number on this instance.
    pub stream: u64,
    /// The tenant.
    pub tenant: String,
    /// The resource.
    pub resource: String,
    /// The key.
    pub key: String,
    /// Requests per second the Envoy saw (allowed and denied).
    pub demand: f64,
    /// Its part of the tightest rule, in parts per million.
    pub share_ppm: u64,
    /// Envoys sharing that rule, through every instance.
    pub members: u64,
    /// `allow_all`, `deny_all`, or `token_bucket`.
    pub assignment: &'static str,
    /// The token bucket's rate (tokens per second) and capacity.
    pub rate: Option<f64>,
    /// The token bucket's capacity.
    pub max_tokens: Option<u32>,
    /// The store was unavailable and the rule's policy decided.
    pub degraded: bool,
    /// The Envoy named itself (`x-tollgate-envoy`).
    pub named: bool,
}

/// A bucket's tenant, resource and key.
#[derive(Debug, Clone, Copy)]
pub struct Bucket<'a> {
    /// The tenant.
    pub tenant: &'a str,
    /// The resource.
    pub resource: &'a str,
    /// The key.
    pub key: &'a str,
}

/// The buckets subscribed on this instance.
#[derive(Debug, Default)]
pub struct RlqsView {
    rows: Mutex<HashMap<(u64, u64), BucketRow>>,
}

impl RlqsView {
    /// Records bucket `hash` of stream `stream` as `shared` left it.
    pub fn record(&self, stream: u64, hash: u64, named: bool, bucket: Bucket<'_>, shared: &Shared) {
        let (assignment, rate, max_tokens) = match shared.assignment {
            Assignment::AllowAll => ("allow_all", None, None),
            Assignment::DenyAll => ("deny_all", None, None),
            Assignment::Bucket(b) => ("token_bucket", Some(b.rate()), Some(b.max_tokens)),
        };
        let mut rows = self.rows.lock();
        if rows.len() >= MAX_ROWS && !rows.contains_key(&(stream, hash)) {
            return;
        }
        let row = BucketRow {
            stream,
            tenant: bucket.tenant.to_owned(),
            resource: bucket.resource.to_owned(),
            key: bucket.key.to_owned(),
            demand: shared.demand,
            share_ppm: shared.ppm,
            members: shared.members,
            assignment,
            rate,
            max_tokens,
            degraded: shared.degraded.is_some(),
            named,
        };
        rows.insert((stream, hash), row);
    }

    /// Drops bucket `hash` of stream `stream` (abandoned).
    pub fn drop_bucket(&self, stream: u64, hash: u64) {
        let mut rows = self.rows.lock();
        rows.remove(&(stream, hash));
    }

    /// Drops every bucket of `stream` (it ended).
    pub fn forget(&self, stream: u64) {
        let mut rows = self.rows.lock();
        rows.retain(|(s, _), _| *s != stream);
    }

    /// The `limit` buckets of highest demand, highest first, and how many
    /// buckets there are.
    pub fn top(&self, limit: usize) -> (Vec<BucketRow>, usize) {
        let rows = self.rows.lock();
        let mut top: Vec<BucketRow> = rows.values().cloned().collect();
        top.sort_by(|a, b| {
            b.demand
                .total_cmp(&a.demand)
                .then_with(|| a.tenant.cmp(&b.tenant))
                .then_with(|| a.key.cmp(&b.key))
        });
        top.truncate(limit);
        (top, rows.len())
    }
}
