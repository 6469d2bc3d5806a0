//! Where bucket state lives.
//!
//! A store has one job: apply a decision to a set of buckets atomically,
//! following [`crate::bucket::plan`] (all enforced buckets admit and every
//! admitting bucket is spent, or nothing is spent). The store also owns the
//! clock its buckets are measured by. One contract suite
//! (`tests/store_contract.rs`) runs against every implementation.

pub mod memory;

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use crate::bucket::{Charge, Plan};

pub use memory::MemoryStore;

/// The name of one bucket: tenant, scope, resource and key, rendered as
/// `tenant:scope:resource:key`. Tenants and resources cannot contain `:`,
/// and the key comes last, so the rendering is unambiguous.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct BucketKey(String);

impl BucketKey {
    /// Renders a bucket name. `scope` is a short tag (`k` per key, `t` per
    /// tenant); `key` is empty for tenant-wide buckets.
    pub fn new(tenant: &str, scope: &str, resource: &str, key: &str) -> Self {
        let mut s =
            String::with_capacity(tenant.len() + scope.len() + resource.len() + key.len() + 3);
        for (i, part) in [tenant, scope, resource, key].into_iter().enumerate() {
            if i > 0 {
                s.push(':');
            }
            s.push_str(part);
        }
        Self(s)
    }

    /// The rendered name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The tenant part of the name.
    pub fn tenant(&self) -> &str {
        self.0.split(':').next().unwrap_or_default()
    }
}

impl fmt::Debug for BucketKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

/// A store failure. Details are logged by the caller, never sent to clients.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store could not be reached or did not answer in time; a retry
    /// may succeed.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The store answered something this version does not understand.
    #[error("store protocol error: {0}")]
    Protocol(String),
}

impl StoreError {
    /// True when retrying later may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Unavailable(_))
    }
}

/// A boxed future, so that stores can be chosen at run time.
pub type StoreFuture<'a> = Pin<Box<dyn Future<Output = Result<Plan, StoreError>> + Send + 'a>>;

/// Applies decisions to buckets atomically.
pub trait Store: Send + Sync + 'static {
    /// Decides `charges[i]` against bucket `buckets[i]` for every `i`, as one
    /// atomic step, spending only when `spend` is true and every enforced
    /// charge admits its cost. Each bucket appears at most once.
    fn apply<'a>(
        &'a self,
        buckets: &'a [BucketKey],
        charges: &'a [Charge],
        spend: bool,
    ) -> StoreFuture<'a>;

    /// A short name for logs and metrics: `memory`, `redis`, ...
    fn kind(&self) -> &'static str;
}
