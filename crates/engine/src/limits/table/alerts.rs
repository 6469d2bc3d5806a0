//! The `quota_alerts` outbox: each alert threshold a quota counter reached
//! in a period, written once by the usage ledger (`crate::ledger`) however
//! many instances or retries write it (its id is derived from the counter,
//! the period and the threshold), and kept until a webhook delivery
//! succeeds. Deliveries claim alerts for a lease, so instances sharing the
//! table do not send one alert at once; an instance that dies holding a
//! claim leaves the alert to be sent again when the lease runs out.

use sqlx::Row;

use super::{Bind, LimitsTable, Pool, TableError};
use crate::algorithm::Micros;

/// An alert to record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AlertWrite<'a> {
    /// The counter (`tenant:tag:resource:key`).
    pub counter: &'a str,
    /// Its tenant, scope, resource and key.
    pub tenant: &'a str,
    /// `key`, `tenant` or `descriptor`.
    pub scope: &'a str,
    /// The resource ('' for any).
    pub resource: &'a str,
    /// The key ('' for a tenant-wide quota).
    pub key: &'a str,
    /// The quota row counting there.
    pub rule: &'a str,
    /// The period's first instant and the next period's.
    pub start: Micros,
    /// See `start`.
    pub end: Micros,
    /// The threshold reached, in percent.
    pub threshold: u16,
    /// The count that reached it.
    pub used: u64,
    /// The quota per period.
    pub quota: u64,
    /// When it was recorded.
    pub detected_at: Micros,
}

/// One alert of the outbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AlertRow {
    /// The idempotency key: the same for every write of this counter's
    /// period's threshold.
    pub id: String,
    /// See [`AlertWrite`].
    pub counter: String,
    /// See [`AlertWrite`].
    pub tenant: String,
    /// See [`AlertWrite`].
    pub scope: String,
    /// See [`AlertWrite`].
    pub resource: String,
    /// See [`AlertWrite`].
    pub key: String,
    /// See [`AlertWrite`].
    pub rule: String,
    /// See [`AlertWrite`].
    pub start: Micros,
    /// See [`AlertWrite`].
    pub end: Micros,
    /// See [`AlertWrite`].
    pub threshold: u16,
    /// See [`AlertWrite`].
    pub used: u64,
    /// See [`AlertWrite`].
    pub quota: u64,
    /// See [`AlertWrite`].
    pub detected_at: Micros,
    /// Deliveries tried.
    pub attempts: u64,
    /// When the next try is due (or the current claim runs out).
    pub next_attempt: Micros,
    /// When a delivery succeeded.
    pub delivered_at: Option<Micros>,
    /// Why the last try failed ('' if none did).
    pub last_error: String,
}

/// How many alerts wait and how many were delivered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AlertCounts {
    /// Not delivered yet.
    pub pending: u64,
    /// Delivered.
    pub delivered: u64,
}

/// The idempotency key of a counter's period's threshold: 32 hex digits
/// of SHA-256 over them.
pub fn alert_id(counter: &str, start: Micros, threshold: u16) -> String {
    let digest = ring::digest::digest(
        &ring::digest::SHA256,
        format!("{counter}\n{start}\n{threshold}").as_bytes(),
    );
    digest.as_ref()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A claim's mark: 32 random hex digits.
fn claim_token() -> String {
    let mut bytes = [0u8; 16];
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

const ALERT_COLUMNS: &str = "id, counter, tenant, scope, resource, key, rule, period_start, \
     period_end, threshold, used, quota, detected_at, attempts, next_attempt, delivered_at, \
     last_error";

fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn alert_of<R: Row>(r: &R) -> Result<AlertRow, sqlx::Error>
where
    usize: sqlx::ColumnIndex<R>,
    for<'d> String: sqlx::Decode<'d, R::Database> + sqlx::Type<R::Database>,
    for<'d> i64: sqlx::Decode<'d, R::Database> + sqlx::Type<R::Database>,
{
    let n = |v: i64| u64::try_from(v).unwrap_or_default();
    Ok(AlertRow {
        id: r.try_get(0)?,
        counter: r.try_get(1)?,
        tenant: r.try_get(2)?,
        scope: r.try_get(3)?,
        resource: r.try_get(4)?,
        key: r.try_get(5)?,
        rule: r.try_get(6)?,
        start: n(r.try_get(7)?),
        end: n(r.try_get(8)?),
        threshold: u16::try_from(r.try_get::<i64, _>(9)?).unwrap_or_default(),
        used: n(r.try_get(10)?),
        quota: n(r.try_get(11)?),
        detected_at: n(r.try_get(12)?),
        attempts: n(r.try_get(13)?),
        next_attempt: n(r.try_get(14)?),
        delivered_at: r.try_get::<Option<i64>, _>(15)?.map(n),
        last_error: r.try_get(16)?,
    })
}

impl LimitsTable {
    /// Records `alerts` in one transaction, each unless recorded already.
    /// Returns, per alert, whether this call recorded it.
    pub async fn record_alerts(&self, alerts: &[AlertWrite<'_>]) -> Result<Vec<bool>, TableError> {
        let sql = "INSERT INTO quota_alerts (id, counter, tenant, scope, resource, key, rule, \
             period_start, period_end, threshold, used, quota, detected_at) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING";
        with_pool!(self, pool => {
            let mut tx = pool.begin().await?;
            let mut recorded = Vec::with_capacity(alerts.len());
            for a in alerts {
                let id = alert_id(a.counter, a.start, a.threshold);
                let binds = [
                    Bind::Text(&id),
                    Bind::Text(a.counter),
                    Bind::Text(a.tenant),
                    Bind::Text(a.scope),
                    Bind::Text(a.resource),
                    Bind::Text(a.key),
                    Bind::Text(a.rule),
                    Bind::Int(int(a.start)),
                    Bind::Int(int(a.end)),
                    Bind::Int(i64::from(a.threshold)),
                    Bind::Int(int(a.used)),
                    Bind::Int(int(a.quota)),
                    Bind::Int(int(a.detected_at)),
                ];
                let done = bound!(sqlx::query(self.sql(sql)), &binds)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                recorded.push(done > 0);
            }
            tx.commit().await?;
            Ok(recorded)
        })
    }

    /// Claims up to `limit` undelivered alerts due at `now` (the oldest
    /// due first) until `now + lease`: another instance claims them only
    /// once that passes. Each claim counts as an attempt. One statement
    /// claims the page (an alert claimed by another instance meanwhile is
    /// no longer due, and is left out), one reads it back.
    pub async fn claim_alerts(
        &self,
        now: Micros,
        lease: Micros,
        limit: usize,
    ) -> Result<Vec<AlertRow>, TableError> {
        let token = claim_token();
        let claim = "UPDATE quota_alerts SET claim = ?, next_attempt = ?, attempts = attempts + 1 \
             WHERE delivered_at IS NULL AND next_attempt <= ? AND id IN (SELECT id FROM \
             quota_alerts WHERE delivered_at IS NULL AND next_attempt <= ? \
             ORDER BY next_attempt, id LIMIT ?)";
        let binds = [
            Bind::Text(&token),
            Bind::Int(int(now + lease)),
            Bind::Int(int(now)),
            Bind::Int(int(now)),
            Bind::Int(int(limit as u64)),
        ];
        if self.execute(claim, &binds).await? == 0 {
            return Ok(Vec::new());
        }
        let sql = format!(
            "SELECT {ALERT_COLUMNS} FROM quota_alerts WHERE claim = ? AND delivered_at IS NULL \
             ORDER BY id"
        );
        self.alert_rows(&sql, &[Bind::Text(&token)]).await
    }

    /// Records what became of claimed alerts, in one transaction: those
    /// `delivered` at `now`, and those that `failed`, each with when its
    /// next try is due and why it failed.
    pub async fn settle_alerts(
        &self,
        now: Micros,
        delivered: &[&str],
        failed: &[(&str, Micros, &str)],
    ) -> Result<(), TableError> {
        let done = "UPDATE quota_alerts SET delivered_at = ?, last_error = '' WHERE id = ?";
        let retry = "UPDATE quota_alerts SET next_attempt = ?, last_error = ? \
             WHERE id = ? AND delivered_at IS NULL";
        with_pool!(self, pool => {
            let mut tx = pool.begin().await?;
            for id in delivered {
                bound!(sqlx::query(self.sql(done)), &[Bind::Int(int(now)), Bind::Text(id)])
                    .execute(&mut *tx)
                    .await?;
            }
            for (id, next, error) in failed {
                let binds = [Bind::Int(int(*next)), Bind::Text(error), Bind::Text(id)];
                bound!(sqlx::query(self.sql(retry)), &binds)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            Ok(())
        })
    }

    /// Marks an alert delivered at `now`.
    pub async fn alert_delivered(&self, id: &str, now: Micros) -> Result<(), TableError> {
        self.settle_alerts(now, &[id], &[]).await
    }

    /// Records a failed try: the next is due at `next_attempt`.
    pub async fn alert_failed(
        &self,
        id: &str,
        next_attempt: Micros,
        error: &str,
    ) -> Result<(), TableError> {
        self.settle_alerts(0, &[], &[(id, next_attempt, error)])
            .await
    }

    /// The most recently detected alerts (only undelivered ones with
    /// `pending`), newest first; at most `limit`.
    pub async fn alerts(&self, pending: bool, limit: usize) -> Result<Vec<AlertRow>, TableError> {
        let filter = if pending {
            "WHERE delivered_at IS NULL "
        } else {
            ""
        };
        let sql = format!(
            "SELECT {ALERT_COLUMNS} FROM quota_alerts {filter}\
             ORDER BY detected_at DESC, id LIMIT ?"
        );
        self.alert_rows(&sql, &[Bind::Int(int(limit as u64))]).await
    }

    /// How many alerts wait: read through the index of undelivered alerts,
    /// so it costs what waits, never the delivered history.
    pub async fn pending_alerts(&self) -> Result<u64, TableError> {
        let sql = "SELECT COUNT(*) FROM quota_alerts WHERE delivered_at IS NULL";
        with_pool!(self, pool => {
            let r = sqlx::query(self.sql(sql)).fetch_one(pool).await?;
            Ok(u64::try_from(r.try_get::<i64, _>(0)?).unwrap_or_default())
        })
    }

    /// How many alerts wait, and how many were delivered (a pass over
    /// the outbox: for `tollgate alerts list` and `/v1/alerts`, not for
    /// anything periodic).
    pub async fn alert_counts(&self) -> Result<AlertCounts, TableError> {
        let sql = "SELECT COUNT(*) - COUNT(delivered_at), COUNT(delivered_at) FROM quota_alerts";
        with_pool!(self, pool => {
            let r = sqlx::query(self.sql(sql)).fetch_one(pool).await?;
            let n = |v: i64| u64::try_from(v).unwrap_or_default();
            Ok(AlertCounts {
                pending: n(r.try_get(0)?),
                delivered: n(r.try_get(1)?),
            })
        })
    }

    async fn alert_rows(&self, sql: &str, binds: &[Bind<'_>]) -> Result<Vec<AlertRow>, TableError> {
        with_pool!(self, pool => {
            let rows = bound!(sqlx::query(self.sql(sql)), binds)
                .fetch_all(pool)
                .await?;
            Ok(rows.iter().map(alert_of).collect::<Result<_, _>>()?)
        })
    }
}
