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
//!
//! A server on free loopback ports, with its limits table in a temporary
//! directory, asked over gRPC the way any caller would:
//!
//! ```
//! use std::sync::Arc;
//! use tollgate::clock::SystemClock;
//! use tollgate::proto::v1::ShouldAllowRequest;
//! use tollgate::proto::v1::rate_limiter_client::RateLimiterClient;
//! use tollgate::server::{self, Listeners, ServeConfig};
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let dir = tempfile::tempdir().unwrap();
//! let config = ServeConfig {
//!     limits: dir.path().join("limits.db").display().to_string(),
//!     ..ServeConfig::default()
//! };
//! let any = "127.0.0.1:0".parse().unwrap();
//! let listeners = Listeners::bind(any, any).await.unwrap();
//! let address = format!("http://{}", listeners.grpc.local_addr().unwrap());
//! let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
//! let serving = tokio::spawn(server::run(config, listeners, Arc::new(SystemClock), async {
//!     let _ = stopped.await;
//! }));
//! let mut client = loop {
//!     match RateLimiterClient::connect(address.clone()).await {
//!         Ok(client) => break client,
//!         Err(_) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
//!     }
//! };
//! let ask = ShouldAllowRequest { key: "alice".into(), tenant: "acme".into(), ..Default::default() };
//! let answer = client.should_allow(ask).await.unwrap().into_inner();
//! // The seeded default row: 600 a minute per key, bursts of 30.
//! assert!(answer.allowed);
//! assert_eq!((answer.remaining, answer.limit), (29, 30));
//! assert_eq!(answer.limit_name, "default-per-key");
//! drop(client);
//! stop.send(()).unwrap();
//! serving.await.unwrap().unwrap();
//! # });
//! ```

pub use tollgate_engine::{algorithm, clock, engine, ledger, limits, telemetry};

pub mod alerts;
pub mod api;
pub mod cli;
pub mod connections;
pub mod options;
pub mod proto;
pub mod runtime;
pub mod server;
