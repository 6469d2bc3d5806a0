//! Tollgate's core: the pure algorithms, the clock, the stores and
//! telemetry.
//!
//! ```text
//! store       backends (in process, Redis, Redis Cluster, Sentinel) wrapped
//!   |         in layers (deny cache, store-unavailable fallback, slices)
//! algorithm   pure functions of (state, limit, cost, now)
//! clock       the only place the time is read
//! telemetry   metrics, traces, logs and the top-limited sketch
//! ```
//!
//! The decision engine (`tollgate-engine`) is this crate's one user in the
//! product: the server and its APIs depend on the engine, never on this
//! crate, so no API can reach a store except through the engine. The
//! store-level tests and benches use it directly.

pub mod algorithm;
pub mod clock;
pub mod store;
pub mod telemetry;
