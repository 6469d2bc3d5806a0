//! Tollgate's integration tests: one test binary, one module per topic
//! (`tests/<topic>.rs`), sharing the helpers in `tests/common/`. One binary
//! links the crate and its dependencies once instead of once per file.
//! nextest runs each test in a process of its own (`.config/nextest.toml`),
//! so tests that read their process's metrics or memory see only their own.

mod common;

mod admin_access;
mod alerts;
mod api;
mod architecture;
mod bad_input;
mod budgets;
mod cli;
mod clients;
mod connections;
mod deny_cache;
mod deploy;
mod distributed;
mod docs;
mod envoy_api;
mod envoy_e2e;
mod envoy_fixtures;
mod envoy_hostile;
mod envoy_llm;
mod envoy_metrics;
mod envoy_refunds;
mod envoy_xds;
mod explain;
mod fairness;
mod fuzz;
mod lease_failures;
mod leases;
mod limits_at_scale;
mod limits_reload;
mod metrics_upkeep;
mod observability;
mod plans;
mod postgres_limits;
mod prometheus;
mod python_client;
mod quotas;
mod records;
mod redis_clock;
mod redis_failures;
mod redis_security;
mod redis_store;
mod redis_topology;
mod rlqs;
mod security;
mod shutdown;
mod soak;
mod status_page;
mod traces;
