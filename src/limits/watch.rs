//! The rules in force, kept current while the server runs.
//!
//! [`LiveLimits`] holds the last good [`RuleSet`] behind an atomic pointer, so
//! the hot path reads it without locks. [`watch`] re-reads the table every
//! interval: a changed, valid table replaces the rules at once; an invalid
//! one is logged (naming the row), counted, reported on the admin port, and
//! the last good rules stay in force.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use serde::Serialize;

use sqlx::postgres::{PgListener, PgNotification};

use super::table::{LimitsTable, TableError};
use super::{RowError, RuleSet, StoredRow};
use crate::telemetry::metrics;

/// Why the rules could not be (re)loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The table could not be read.
    #[error(transparent)]
    Table(#[from] TableError),
    /// A row is invalid.
    #[error("invalid limits table: {0}")]
    Invalid(#[from] RowError),
}

/// What the admin port reports about the limits.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReloadStatus {
    /// Rules in force.
    pub rules: usize,
    /// Successful loads that changed the rules (including the first).
    pub generation: u64,
    /// Why the latest reload failed, if it did; cleared by the next success.
    pub last_error: Option<String>,
}

struct Seen {
    /// The rows behind the rules in force.
    applied: Vec<StoredRow>,
    /// The last rows that failed, so each bad edit is logged once.
    rejected: Option<Vec<StoredRow>>,
}

/// The rules in force.
pub struct LiveLimits {
    current: ArcSwap<RuleSet>,
    seen: Mutex<Seen>,
    status: Mutex<ReloadStatus>,
}

impl LiveLimits {
    /// Loads the table once. At start-up there is no last good table, so an
    /// invalid one is an error.
    pub async fn load(table: &LimitsTable) -> Result<Self, LoadError> {
        let live = Self::from_rows(table.rows().await?)?;
        metrics::limits_reload(true, live.current.load().len());
        Ok(live)
    }

    /// Rules from rows given directly (no table): for tests and embedding.
    pub fn from_rows(rows: Vec<StoredRow>) -> Result<Self, RowError> {
        let set = RuleSet::from_rows(&rows)?;
        Ok(Self {
            status: Mutex::new(ReloadStatus {
                rules: set.len(),
                generation: 1,
                last_error: None,
            }),
            current: ArcSwap::from_pointee(set),
            seen: Mutex::new(Seen {
                applied: rows,
                rejected: None,
            }),
        })
    }

    /// The rules in force now.
    pub fn snapshot(&self) -> Arc<RuleSet> {
        self.current.load_full()
    }

    /// The reload status.
    pub fn status(&self) -> ReloadStatus {
        self.status.lock().clone()
    }

    /// Re-reads the table. Returns whether the rules changed. On error the
    /// rules in force are untouched.
    pub async fn reload(&self, table: &LimitsTable) -> Result<bool, LoadError> {
        let rows = table.rows().await?;
        self.apply_rows(rows)
    }

    fn apply_rows(&self, rows: Vec<StoredRow>) -> Result<bool, LoadError> {
        let mut seen = self.seen.lock();
        if seen.applied == rows {
            // Unchanged (also after a bad edit was reverted).
            seen.rejected = None;
            self.status.lock().last_error = None;
            return Ok(false);
        }
        match RuleSet::from_rows(&rows) {
            Ok(set) => {
                let n = set.len();
                self.current.store(Arc::new(set));
                seen.applied = rows;
                seen.rejected = None;
                let mut status = self.status.lock();
                status.rules = n;
                status.generation += 1;
                status.last_error = None;
                metrics::limits_reload(true, n);
                tracing::info!(rules = n, generation = status.generation, "limits reloaded");
                Ok(true)
            }
            Err(err) => {
                let first_time = seen.rejected.as_ref() != Some(&rows);
                seen.rejected = Some(rows);
                self.status.lock().last_error = Some(err.to_string());
                if first_time {
                    metrics::limits_reload(false, self.current.load().len());
                    tracing::error!(error = %err, "limits table rejected; the last good rules stay in force");
                }
                Err(err.into())
            }
        }
    }
}

/// Reloads `limits` from `table` every `every`, and on PostgreSQL also at
/// once on every change notification, until `shutdown` completes. A lost
/// database connection keeps the last good rules in force; the listener
/// reconnects, and every time it starts listening the table is read, so no
/// edit made while it was not listening is missed.
pub async fn watch(
    limits: Arc<LiveLimits>,
    table: LimitsTable,
    every: Duration,
    shutdown: impl Future<Output = ()>,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    let mut listener: Option<PgListener> = None;
    loop {
        if listener.is_none() && table.is_postgres() {
            match table.listener().await {
                Ok(l) => {
                    listener = l;
                    // Edits made while nobody listened sent their NOTIFY
                    // into the void: read the table now that we listen.
                    reload(&limits, &table).await;
                }
                Err(err) => {
                    tracing::warn!(error = %err, "cannot listen for limits changes; polling meanwhile")
                }
            }
        }
        tokio::select! {
            _ = &mut shutdown => return,
            _ = tick.tick() => {}
            // Without a listener, retry (and poll) every second.
            _ = tokio::time::sleep(Duration::from_secs(1)), if listener.is_none() && table.is_postgres() => {}
            note = next_change(&mut listener) => match note {
                Ok(Some(_)) => {}
                // The connection dropped. Listen again on a fresh connection
                // (and read the table once listening) rather than let the
                // listener reconnect by itself on the next receive: an edit
                // made between its reconnection and no reload would be lost.
                Ok(None) => {
                    tracing::warn!("limits listener lost its connection; reconnecting");
                    listener = None;
                    continue;
                }
                Err(err) => {
                    tracing::warn!(error = %err, "limits listener failed; reconnecting");
                    listener = None;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            },
        }
        reload(&limits, &table).await;
    }
}

/// Reloads, keeping the last good rules when the table cannot be read.
async fn reload(limits: &LiveLimits, table: &LimitsTable) {
    match limits.reload(table).await {
        Ok(_) | Err(LoadError::Invalid(_)) => {}
        Err(LoadError::Table(err)) => {
            limits.status.lock().last_error = Some(err.to_string());
            tracing::warn!(error = %err, "cannot read the limits table; the last good rules stay in force");
        }
    }
}

async fn next_change(
    listener: &mut Option<PgListener>,
) -> Result<Option<PgNotification>, sqlx::Error> {
    match listener {
        Some(l) => l.try_recv().await,
        None => std::future::pending().await,
    }
}
