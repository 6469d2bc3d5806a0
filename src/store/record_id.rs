//! The identity of a record written beside a decision (a reservation's or
//! a lease's): the tenant whose buckets it touches (the Redis hash tag it
//! lives under) and a random nonce, written for callers as an opaque token
//! `PREFIX NONCE.TENANT` (nonce in 32 hex digits, tenant hex-encoded).

use std::fmt;
use std::hash::Hash;
use std::marker::PhantomData;

use super::BucketKey;

/// What kind of record an id names.
pub trait RecordKind: Clone + PartialEq + Eq + Hash {
    /// The token's prefix, with its version: `r1.`, `l1.`.
    const PREFIX: &'static str;
    /// The scope letter of the record's name among the tenant's buckets.
    const SCOPE: &'static str;
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
        Self::from_parts(tenant, u128::from_le_bytes(nonce))
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

    /// The record's name in a store, `tenant:SCOPE::NONCE`: a bucket name
    /// of its own scope, so that a store files it with the tenant's
    /// buckets.
    pub fn record_name(&self) -> BucketKey {
        BucketKey::new(&self.tenant, K::SCOPE, "", &self.member())
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
