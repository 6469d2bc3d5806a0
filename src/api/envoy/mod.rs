//! Envoy's rate limit service API and envoyproxy/ratelimit's configuration.
//!
//! [`config`] loads the YAML configuration unchanged; [`service`] serves
//! `envoy.service.ratelimit.v3.RateLimitService` through the engine, as
//! every API decides. [`LiveEnvoyConfig`] keeps the
//! configuration directory loaded and hot-reloads it, or ([`xds`]) follows
//! an xDS management server.

pub mod config;
mod explain;
pub mod service;
pub mod xds;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use serde::Serialize;

pub use config::{ConfigError, EnvoyConfig};

use crate::telemetry::metrics;

/// Reads every `*.yaml` / `*.yml` file directly in `dir`, in name order,
/// following symbolic links and skipping hidden entries (so a Kubernetes
/// ConfigMap mount, whose files are links into a hidden `..data`
/// directory that is swapped atomically, reads as one consistent set).
pub fn read_dir(dir: &Path) -> Result<Vec<(String, String)>, ConfigError> {
    let io_err = |what: &Path, e: std::io::Error| ConfigError {
        file: what.display().to_string(),
        message: format!("cannot read: {e}"),
    };
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| io_err(dir, e))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or(".");
            !name.starts_with('.') && (name.ends_with(".yaml") || name.ends_with(".yml"))
        })
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path).map_err(|e| io_err(&path, e))?;
            Ok((path.display().to_string(), text))
        })
        .collect()
}

/// What the admin port reports about the Envoy configuration.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EnvoyConfigStatus {
    /// The directory, if one is configured.
    pub directory: Option<String>,
    /// Domains loaded.
    pub domains: usize,
    /// `rate_limit`s loaded.
    pub rules: usize,
    /// Successful loads that changed the configuration.
    pub generation: u64,
    /// Why the latest reload failed; cleared by the next success.
    pub last_error: Option<String>,
    /// With `--envoy-xds`: the management server and what was heard.
    pub xds: Option<XdsStatus>,
}

/// What the admin port reports about the xDS management server.
#[derive(Debug, Clone, Default, Serialize)]
pub struct XdsStatus {
    /// Its address.
    pub server: String,
    /// Whether a stream is open.
    pub connected: bool,
    /// The version of the snapshot in force (empty before the first).
    pub version: String,
    /// Why the latest stream ended, if it did.
    pub last_disconnect: Option<String>,
}

/// The Envoy configuration in force.
pub struct LiveEnvoyConfig {
    current: ArcSwap<EnvoyConfig>,
    dir: Option<PathBuf>,
    files: Mutex<Vec<(String, String)>>,
    status: Mutex<EnvoyConfigStatus>,
}

impl LiveEnvoyConfig {
    /// No configuration: every domain is unknown, so nothing is limited.
    pub fn empty() -> Self {
        Self {
            current: ArcSwap::from_pointee(EnvoyConfig::default()),
            dir: None,
            files: Mutex::new(Vec::new()),
            status: Mutex::new(EnvoyConfigStatus::default()),
        }
    }

    /// No configuration yet: snapshots from the xDS management server
    /// `server` will come ([`xds::follow`]).
    pub fn xds(server: &str) -> Self {
        let live = Self::empty();
        live.status.lock().xds = Some(XdsStatus {
            server: server.to_owned(),
            ..XdsStatus::default()
        });
        live
    }

    /// The version of the xDS snapshot in force (empty before the first).
    pub fn xds_version(&self) -> String {
        let status = self.status.lock();
        status
            .xds
            .as_ref()
            .map(|x| x.version.clone())
            .unwrap_or_default()
    }

    /// Puts a valid snapshot in force.
    pub fn install_xds(&self, config: EnvoyConfig, version: &str) {
        let mut status = self.status.lock();
        status.domains = config.domains();
        status.rules = config.rules();
        status.generation += 1;
        status.last_error = None;
        if let Some(xds) = &mut status.xds {
            xds.version = version.to_owned();
        }
        self.current.store(Arc::new(config));
        metrics::envoy_config_reload(true);
        tracing::info!(
            version,
            domains = status.domains,
            rules = status.rules,
            "envoy config from xds applied"
        );
    }

    /// Records a snapshot refused: the configuration in force stays.
    pub fn xds_rejected(&self, error: &str) {
        self.status.lock().last_error = Some(error.to_owned());
        metrics::envoy_config_reload(false);
        tracing::error!(
            error,
            "envoy config from xds rejected; the last good configuration stays in force"
        );
    }

    /// Records a stream opened.
    pub fn xds_connected(&self) {
        if let Some(xds) = &mut self.status.lock().xds {
            xds.connected = true;
        }
    }

    /// Records a stream lost, and why.
    pub fn xds_disconnected(&self, why: &str) {
        if let Some(xds) = &mut self.status.lock().xds {
            xds.connected = false;
            xds.last_disconnect = Some(why.to_owned());
        }
    }

    /// Loads `dir`. At start-up there is no last good configuration, so an
    /// invalid one is an error.
    pub fn load(dir: &Path) -> Result<Self, ConfigError> {
        let files = read_dir(dir)?;
        let config = EnvoyConfig::load(&files)?;
        metrics::envoy_config_reload(true);
        let status = EnvoyConfigStatus {
            directory: Some(dir.display().to_string()),
            domains: config.domains(),
            rules: config.rules(),
            generation: 1,
            last_error: None,
            xds: None,
        };
        tracing::info!(dir = %dir.display(), domains = status.domains, rules = status.rules, "envoy config loaded");
        Ok(Self {
            current: ArcSwap::from_pointee(config),
            dir: Some(dir.to_owned()),
            files: Mutex::new(files),
            status: Mutex::new(status),
        })
    }

    /// The configuration in force.
    pub fn snapshot(&self) -> Arc<EnvoyConfig> {
        self.current.load_full()
    }

    /// The reload status.
    pub fn status(&self) -> EnvoyConfigStatus {
        self.status.lock().clone()
    }

    /// Re-reads the directory; a changed, valid configuration replaces the
    /// one in force, an invalid one is reported and the last good one stays.
    /// Returns whether it changed.
    pub fn reload(&self) -> Result<bool, ConfigError> {
        let Some(dir) = &self.dir else {
            return Ok(false);
        };
        let result = read_dir(dir).and_then(|files| {
            if *self.files.lock() == files {
                return Ok(None);
            }
            EnvoyConfig::load(&files).map(|config| Some((files, config)))
        });
        let mut status = self.status.lock();
        match result {
            Ok(None) => {
                status.last_error = None;
                Ok(false)
            }
            Ok(Some((files, config))) => {
                status.domains = config.domains();
                status.rules = config.rules();
                status.generation += 1;
                status.last_error = None;
                self.current.store(Arc::new(config));
                *self.files.lock() = files;
                metrics::envoy_config_reload(true);
                tracing::info!(
                    domains = status.domains,
                    rules = status.rules,
                    "envoy config reloaded"
                );
                Ok(true)
            }
            Err(err) => {
                let message = err.to_string();
                if status.last_error.as_ref() != Some(&message) {
                    metrics::envoy_config_reload(false);
                    tracing::error!(error = %message, "envoy config rejected; the last good configuration stays in force");
                }
                status.last_error = Some(message);
                Err(err)
            }
        }
    }
}

/// Reloads `config` every `every` until `shutdown` completes.
pub async fn watch(
    config: Arc<LiveEnvoyConfig>,
    every: Duration,
    shutdown: impl Future<Output = ()>,
) {
    if config.dir.is_none() {
        return;
    }
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => return,
            _ = tick.tick() => {}
        }
        let live = config.clone();
        let _ = tokio::task::spawn_blocking(move || live.reload()).await;
    }
}
