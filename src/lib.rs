//! Tollgate: a rate-limit decision service.
//!
//! Dependencies point one way:
//! `bucket` (pure arithmetic) ← `store` (where bucket state lives) ←
//! `limiter` (rules → charges → decision) ← `grpc` / `admin` ← `server`.
//! The limits table (`limits`) feeds the limiter its rules.

pub mod bucket;
pub mod clock;
pub mod store;
