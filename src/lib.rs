//! Tollgate: a rate-limit decision service.
//!
//! One engine, many surfaces. Dependencies point one way:
//!
//! ```text
//! api::{native, envoy, admin}    wings side by side; none imports another
//!            |
//!          engine                the only caller of the store's decisions
//!         /      \
//!     limits    store            store = backend wrapped in layers
//!                 |
//!        algorithm, clock        pure functions of (state, limit, cost, now)
//! ```
//!
//! The admin wing reads the store's status (health and figures) and the
//! limits' status, never a decision. `server` wires them together; `proto` is the wire contract; `telemetry`
//! holds metrics, traces and the top-limited sketch; `cli` is the command
//! line of the binary. The load tool lives in its own crate, `bench/`.

pub mod algorithm;
pub mod api;
pub mod cli;
pub mod clock;
pub mod connections;
pub mod engine;
pub mod limits;
pub mod options;
pub mod proto;
pub mod runtime;
pub mod server;
pub mod store;
pub mod telemetry;
