//! Where buckets, records and record sets live in Redis: their key names
//! and hash tags (see the parent module's docs for the format).

use super::Shared;
use crate::store::{BucketKey, BucketKind, LeaseId, RecordSet, ReservationId, key_spread};

impl Shared {
    /// The Redis key of a reservation's record: beside its tenant's
    /// buckets, under the same hash tag.
    pub(super) fn record_key(&self, id: &ReservationId) -> String {
        self.tagged(&id.record_name(), id.key_spread())
    }

    /// The Redis key of the set of a tenant's reservation records, beside
    /// the record (`PREFIX{TENANT}:rq::`).
    pub(super) fn records_key(&self, id: &ReservationId) -> String {
        self.tagged(
            &BucketKey::new(id.tenant(), BucketKind::Records(RecordSet::Count), "", ""),
            id.key_spread(),
        )
    }

    /// The Redis key of a lease's record, under its tenant's hash tag.
    pub(super) fn lease_key(&self, id: &LeaseId) -> String {
        self.tagged(&id.record_name(), id.key_spread())
    }

    /// The Redis key of a bucket (see the module docs).
    pub(super) fn redis_key(&self, bucket: &BucketKey) -> String {
        // A per-key bucket, with --redis-spread-keys: tagged by its tenant
        // and a hash of its key, so that one tenant's keys spread over
        // every slot while one key's buckets (every rule of a decision)
        // share one.
        let spread =
            (self.config.spread_keys && bucket.is_per_key()).then(|| key_spread(bucket.key()));
        self.tagged(bucket, spread)
    }

    /// `PREFIX{TENANT}:SCOPE:RESOURCE:KEY`, or with --redis-spread-keys and
    /// a key's `spread`, `PREFIX{TENANT/SPREAD}:…`: a record written beside
    /// one key's buckets gets the same tag as they do.
    pub(super) fn tagged(&self, name: &BucketKey, spread: Option<u32>) -> String {
        let tenant = name.tenant();
        let rest = name.as_str().get(tenant.len() + 1..).unwrap_or_default();
        let tag = if tenant.is_empty() {
            "@default"
        } else {
            tenant
        };
        // Written by hand: one allocation, no formatting machinery (this
        // runs for every bucket of every decision).
        let prefix = &self.config.prefix;
        let mut key = String::with_capacity(prefix.len() + tag.len() + rest.len() + 12);
        key.push_str(prefix);
        key.push('{');
        key.push_str(tag);
        if let Some(spread) = spread.filter(|_| self.config.spread_keys) {
            key.push('/');
            for shift in (0..8).rev() {
                let digit = (spread >> (4 * shift)) & 0xf;
                key.push(char::from_digit(digit, 16).unwrap_or('0'));
            }
        }
        key.push_str("}:");
        key.push_str(rest);
        key
    }
}
