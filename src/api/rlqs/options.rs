//! The quota service's options: which bucket-id entries name what, how
//! long assignments hold, and the caps on what one client may open.

use std::time::Duration;

/// Options of the quota service.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct RlqsOptions {
    /// The bucket id entry that names the tenant (missing: the default
    /// tenant, "").
    #[arg(
        id = "rlqs_tenant_entry",
        long = "rlqs-tenant-entry",
        env = "TOLLGATE_RLQS_TENANT_ENTRY",
        default_value = "tenant"
    )]
    pub tenant_entry: String,
    /// The bucket id entry that names the resource (missing: "").
    #[arg(
        id = "rlqs_resource_entry",
        long = "rlqs-resource-entry",
        env = "TOLLGATE_RLQS_RESOURCE_ENTRY",
        default_value = "resource"
    )]
    pub resource_entry: String,
    /// The bucket id entry that names the key (missing: every other entry,
    /// as `name=value` pairs in name order joined by `,`).
    #[arg(
        id = "rlqs_key_entry",
        long = "rlqs-key-entry",
        env = "TOLLGATE_RLQS_KEY_ENTRY",
        default_value = "key"
    )]
    pub key_entry: String,
    /// How long an assignment holds at the Envoy (whole seconds; three of
    /// the Envoy's reporting intervals when that is longer; Envoy 1.40
    /// reports every 5 s): an Envoy that loses its Tollgate instance
    /// enforces its share this long, and a share whose Envoy vanished is
    /// held this long before the others may take it.
    #[arg(id = "rlqs_assignment_ttl", long = "rlqs-assignment-ttl", env = "TOLLGATE_RLQS_ASSIGNMENT_TTL", value_parser = crate::options::parse_duration, default_value = "15s")]
    pub assignment_ttl: Duration,
    /// A bucket that reports no requests this long is abandoned: the Envoy
    /// forgets it and its share is given back.
    #[arg(id = "rlqs_abandon_after", long = "rlqs-abandon-after", env = "TOLLGATE_RLQS_ABANDON_AFTER", value_parser = crate::options::parse_duration, default_value = "5m")]
    pub abandon_after: Duration,
    /// Most quota streams open at once on this instance.
    #[arg(
        id = "rlqs_max_streams",
        long = "rlqs-max-streams",
        env = "TOLLGATE_RLQS_MAX_STREAMS",
        default_value_t = 4096
    )]
    pub max_streams: usize,
    /// Most quota streams open at once from one peer address.
    #[arg(
        id = "rlqs_max_streams_per_peer",
        long = "rlqs-max-streams-per-peer",
        env = "TOLLGATE_RLQS_MAX_STREAMS_PER_PEER",
        default_value_t = 64
    )]
    pub max_streams_per_peer: usize,
    /// Most buckets one stream subscribes.
    #[arg(
        id = "rlqs_max_buckets_per_stream",
        long = "rlqs-max-buckets-per-stream",
        env = "TOLLGATE_RLQS_MAX_BUCKETS_PER_STREAM",
        default_value_t = 10_000
    )]
    pub max_buckets_per_stream: usize,
    /// Most buckets one peer address subscribes, over all its streams.
    #[arg(
        id = "rlqs_max_buckets_per_peer",
        long = "rlqs-max-buckets-per-peer",
        env = "TOLLGATE_RLQS_MAX_BUCKETS_PER_PEER",
        default_value_t = 100_000
    )]
    pub max_buckets_per_peer: usize,
}

impl Default for RlqsOptions {
    fn default() -> Self {
        crate::options::defaults()
    }
}

impl RlqsOptions {
    /// Refuses options that cannot work.
    pub fn validate(&self) -> Result<(), String> {
        if self.assignment_ttl < Duration::from_secs(1) {
            return Err(
                "--rlqs-assignment-ttl must be at least 1s (Envoy reads whole seconds)".into(),
            );
        }
        let entries = [&self.tenant_entry, &self.resource_entry, &self.key_entry];
        if entries.iter().any(|e| e.is_empty()) {
            return Err(
                "--rlqs-tenant-entry, --rlqs-resource-entry and --rlqs-key-entry must not be empty"
                    .into(),
            );
        }
        if self.max_streams == 0
            || self.max_streams_per_peer == 0
            || self.max_buckets_per_stream == 0
            || self.max_buckets_per_peer == 0
        {
            return Err("--rlqs-max-streams, --rlqs-max-streams-per-peer, --rlqs-max-buckets-per-stream and --rlqs-max-buckets-per-peer must be at least 1".into());
        }
        Ok(())
    }
}
