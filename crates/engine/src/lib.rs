//! Tollgate's decision engine and its limits tables, over the stores of
//! `tollgate-core`.
//!
//! ```text
//! engine     the one door to the store for every API: demands in, answers
//!            out; backend.rs builds the stores it decides with
//! limits     the limits tables, rules, plans and their live reload
//! ledger     quota periods recorded in the limits database, closed with
//!            their final counts
//! ```
//!
//! The store itself is not exported: the server and the APIs above see the
//! engine, the store's vocabulary it re-exports (bucket names, lease and
//! reservation ids, statuses) and a [`engine::backend::StoreHandle`] for
//! health and figures, so a wrong import from an API to the store does not
//! compile.

pub use tollgate_core::{algorithm, clock, telemetry};

/// The stores, for this crate's own modules only.
pub(crate) use tollgate_core::store;

pub mod engine;
pub mod ledger;
pub mod limits;
