//! Tollgate: a rate-limit decision service.
//!
//! One engine, many surfaces. Three crates, and dependencies point one way:
//!
//! ```text
//! tollgate (this crate)
//!   api::{native, envoy, admin}   wings side by side; none imports another
//!   server, cli, connections      wiring, the command line, both ports' sockets
//!            |
//! tollgate-engine (crates/engine)
//!   engine                        the one door to the store; backend.rs builds it
//!   limits                        the limits tables, rules and plans
//!            |
//! tollgate-core (crates/core)
//!   store                         backends wrapped in layers
//!   algorithm, clock, telemetry   pure functions of (state, limit, cost, now); metrics
//! ```
//!
//! This crate depends on the engine only, so no wing (and nothing in the
//! server) can name the store: a wrong import does not compile. The engine
//! re-exports the store's vocabulary ([`engine::vocabulary`]) and gives the
//! admin wing a status handle ([`engine::backend::StoreHandle`]). `proto`
//! is the wire contract. The load tool lives in its own crate, `bench/`.

pub use tollgate_engine::{algorithm, clock, engine, limits, telemetry};

pub mod api;
pub mod cli;
pub mod connections;
pub mod options;
pub mod proto;
pub mod runtime;
pub mod server;
