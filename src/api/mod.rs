//! The API wings, side by side over the engine: none imports another.
//!
//! - [`native`]: `tollgate.v1.RateLimiter` (single, batch, stream);
//! - [`envoy`]: Envoy's `envoy.service.ratelimit.v3.RateLimitService`, with
//!   envoyproxy/ratelimit's YAML configuration;
//! - [`rlqs`]: Envoy's `envoy.service.rate_limit_quota.v3.RateLimitQuotaService`,
//!   shares of the limits-table rules for Envoys that enforce them;
//! - [`admin`]: the admin HTTP port and the `tollgate.v1.Admin` gRPC service.
//!
//! Each wing maps its wire format to an [`crate::engine::Demand`] and the
//! engine's answer back. What they share lives here: the protobuf codec,
//! the one error → status mapping, the request-latency and request-timeout
//! layers.

pub mod admin;
pub mod codec;
pub mod envoy;
pub mod explain;
pub mod frames;
pub mod native;
pub mod observe;
pub mod quota_view;
pub mod rlqs;
pub mod status;
pub mod timeout;
pub mod usage;

use crate::algorithm::Micros;

/// Microseconds as a protobuf Duration.
pub fn duration(us: Micros) -> prost_types::Duration {
    prost_types::Duration {
        seconds: (us / 1_000_000) as i64,
        nanos: ((us % 1_000_000) * 1_000) as i32,
    }
}

/// A protobuf Duration as microseconds, exactly as sent (negative and
/// out-of-range values included: the engine checks them).
pub fn micros(d: &prost_types::Duration) -> i128 {
    i128::from(d.seconds) * 1_000_000 + i128::from(d.nanos) / 1_000
}
