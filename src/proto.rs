//! The wire contract: code generated from `proto/` (Tollgate's own
//! `tollgate.v1` and the subset of Envoy's API its rate limit service
//! needs). Protobuf types stop at the API wings in `crate::api`.

#![allow(missing_docs, clippy::all, clippy::pedantic)]

/// `tollgate.v1`.
pub mod v1 {
    tonic::include_proto!("tollgate.v1");
}

/// The subset of Envoy's API that its rate limit service needs.
pub mod envoy {
    /// `envoy.config.*`.
    pub mod config {
        /// `envoy.config.core`.
        pub mod core {
            /// `envoy.config.core.v3`.
            pub mod v3 {
                tonic::include_proto!("envoy.config.core.v3");
            }
        }
    }
    /// `envoy.extensions.*`.
    pub mod extensions {
        /// `envoy.extensions.common`.
        pub mod common {
            /// `envoy.extensions.common.ratelimit`.
            pub mod ratelimit {
                /// `envoy.extensions.common.ratelimit.v3`.
                pub mod v3 {
                    tonic::include_proto!("envoy.extensions.common.ratelimit.v3");
                }
            }
        }
    }
    /// `envoy.service.*`.
    pub mod service {
        /// `envoy.service.discovery`.
        pub mod discovery {
            /// `envoy.service.discovery.v3`.
            pub mod v3 {
                tonic::include_proto!("envoy.service.discovery.v3");
            }
        }
        /// `envoy.service.rate_limit_quota`.
        pub mod rate_limit_quota {
            /// `envoy.service.rate_limit_quota.v3`.
            pub mod v3 {
                tonic::include_proto!("envoy.service.rate_limit_quota.v3");
            }
        }
        /// `envoy.service.ratelimit`.
        pub mod ratelimit {
            /// `envoy.service.ratelimit.v3`.
            pub mod v3 {
                tonic::include_proto!("envoy.service.ratelimit.v3");
            }
        }
    }
    /// `envoy.type.*`.
    pub mod r#type {
        /// `envoy.type.v3`.
        pub mod v3 {
            include!(concat!(env!("OUT_DIR"), "/envoy.r#type.v3.rs"));
        }
    }
}

/// envoyproxy/ratelimit's configuration as an xDS resource.
pub mod ratelimit {
    /// `ratelimit.config`.
    pub mod config {
        /// `ratelimit.config.ratelimit`.
        pub mod ratelimit {
            /// `ratelimit.config.ratelimit.v3`.
            pub mod v3 {
                tonic::include_proto!("ratelimit.config.ratelimit.v3");
            }
        }
    }
}

/// `google.rpc`: the status an xDS NACK carries.
pub mod google {
    /// `google.rpc`.
    pub mod rpc {
        tonic::include_proto!("google.rpc");
    }
}

/// The encoded descriptors of every Tollgate proto, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("tollgate_descriptor");
