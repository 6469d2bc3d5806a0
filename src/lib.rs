//! Tollgate: a rate-limit decision service.
//!
//! Dependencies point one way:
//! `bucket` (pure arithmetic) ← `store` (where bucket state lives) ←
//! `limiter` (rules → charges → decision) ← `grpc` / `admin` ← `server`.
//! The limits table (`limits`) feeds the limiter its rules.

pub mod admin;
pub mod bench;
pub mod bucket;
pub mod cli;
pub mod clock;
pub mod deny_cache;
pub mod envoy;
pub mod grpc;
pub mod limiter;
pub mod limits;
pub mod runtime;
pub mod server;
pub mod store;
pub mod telemetry;
