//! The identity of a record written beside a decision (a reservation's or
//! a lease's): the tenant whose buckets it touches (the Redis hash tag it
//! lives under) and a random nonce, written for callers as an opaque token
//! `PREFIX NONCE.TENANT` (nonce in 32 hex digits, tenant hex-encoded).

use std::fmt;
use std::hash::Hash;
use std::marker::PhantomData;

use super::BucketKey;

/// The nonce bit that marks an id made by [`RecordId::for_key`].
const KEYED: u128 = 1 << 95;

/// What kind of record an id names.
pub trait RecordKind: Clone + PartialEq + Eq + Hash {
    /// The token's prefix, with its version: `r1.`, `l1.`.
    const PREFIX: &'static str;
    /// The set the record is kept in among the tenant's buckets.
    const SET: super::RecordSet;
}

/// See the module docs.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct RecordId<K: RecordKind> {
    tenant: String,
    nonce: u128,
    kind: PhantomData<K>,
}

impl<K: RecordKind> RecordId<K> {
    /// A new, random id for a record on `tenant`'s buckets.
    pub fn new(tenant: &str) -> Self {
        let mut nonce = [0u8; 16];
        // The operating system's generator; it only fails on systems
        // without one, where Tollgate cannot run safely anyway.
        getrandom::fill(&mut nonce).expect("the operating system's random number generator");
        Self::from_parts(tenant, u128::from_le_bytes(nonce) & !KEYED)
    }

    /// A new id for a record on the per-key buckets of `key` (of
    /// `tenant`) only: random but for its first 33 bits, the key's spread
    /// ([`super::key_spread`]) and a flag saying so, so that with
    /// `--redis-spread-keys` the record lives on the slot of the key's
    /// buckets ([`RecordId::key_spread`]).
    pub fn for_key(tenant: &str, key: &str) -> Self {
        let random = Self::new(tenant).nonce & ((1u128 << 95) - 1);
        let nonce = (u128::from(super::key_spread(key)) << 96) | KEYED | random;
        Self::from_parts(tenant, nonce)
    }

    /// The spread of the key whose buckets the record goes with, for an id
    /// made by [`RecordId::for_key`]; `None` for one that goes with the
    /// tenant's.
    pub fn key_spread(&self) -> Option<u32> {
        (self.nonce & KEYED != 0).then_some((self.nonce >> 96) as u32)
    }

    pub(crate) fn from_parts(tenant: &str, nonce: u128) -> Self {
        Self {
            tenant: tenant.to_owned(),
            nonce,
            kind: PhantomData,
        }
    }

    /// The tenant.
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// The nonce.
    pub fn nonce(&self) -> u128 {
        self.nonce
    }

    /// The nonce in 32 hex digits (a lease's member in its sets).
    pub fn member(&self) -> String {
        format!("{:032x}", self.nonce)
    }

    /// The record's name in a store, `tenant:TAG::NONCE`: a bucket name
    /// of its own scope, so that a store files it with the tenant's
    /// buckets.
    pub fn record_name(&self) -> BucketKey {
        BucketKey::new(
            &self.tenant,
            super::BucketKind::Records(K::SET),
            "",
            &self.member(),
        )
    }

    /// Reads a token written by [`fmt::Display`]; `None` when it is not one.
    pub fn parse(token: &str) -> Option<Self> {
        let rest = token.strip_prefix(K::PREFIX)?;
        let (nonce, tenant) = rest.split_once('.')?;
        if nonce.len() != 32 || tenant.len() % 2 != 0 || tenant.len() > 2 * 256 {
            return None;
        }
        let nonce = u128::from_str_radix(nonce, 16).ok()?;
        let bytes = (0..tenant.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(tenant.get(i..i + 2)?, 16).ok())
            .collect::<Option<Vec<u8>>>()?;
        let tenant = String::from_utf8(bytes).ok()?;
        if tenant.contains(':') {
            return None;
        }
        Some(Self::from_parts(&tenant, nonce))
    }
}

impl<K: RecordKind> fmt::Display for RecordId<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{:032x}.", K::PREFIX, self.nonce)?;
        for b in self.tenant.bytes() {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl<K: RecordKind> fmt::Debug for RecordId<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use crate::store::{ReservationId, key_spread};

    #[test]
    fn an_id_for_a_key_carries_its_spread_and_keeps_it_through_its_token() {
        let id = ReservationId::for_key("acme", "user-42");
        assert_eq!(id.key_spread(), Some(key_spread("user-42")));
        assert_eq!(id.member()[..8], format!("{:08x}", key_spread("user-42")));
        let back = ReservationId::parse(&id.to_string()).unwrap();
        assert_eq!(back, id);
        assert_eq!(back.key_spread(), Some(key_spread("user-42")));
        // Ids for the tenant's buckets carry none; both stay random.
        for _ in 0..64 {
            assert_eq!(ReservationId::new("acme").key_spread(), None);
        }
        assert_ne!(ReservationId::for_key("acme", "user-42"), id);
    }
}
