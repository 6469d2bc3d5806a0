//! The `usage_periods` table: each quota counter's periods, opened when a
//! decision first counts in one and closed with the final count once it is
//! over. Written by the usage ledger (`crate::ledger`), by any number of
//! instances at once: every write is an upsert keyed by the counter and the
//! period's start, and a period's final count is written only while it is
//! still open, so racing instances and retries record each figure once.

use sqlx::Row;

use super::{Bind, LimitsTable, Pool, TableError};
use crate::algorithm::Micros;

/// A period to write: opened (`used` `None`) or closed with its final count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeriodWrite<'a> {
    /// The counter's name (`tenant:tag:resource:key`).
    pub counter: &'a str,
    /// The tenant, scope (`key`, `tenant`), resource and key it counts.
    pub tenant: &'a str,
    /// `key` or `tenant`.
    pub scope: &'static str,
    /// The resource ('' for any).
    pub resource: &'a str,
    /// The key ('' for a tenant-wide quota).
    pub key: &'a str,
    /// A shadow quota's counter.
    pub shadow: bool,
    /// The quota row that counts there, as the writer's limits name it.
    pub rule: &'a str,
    /// The period's first instant and the next period's (µs).
    pub start: Micros,
    /// See `start`.
    pub end: Micros,
    /// The quota per period (for a period opened).
    pub quota: u64,
    /// The final count, for a period closed.
    pub used: Option<u64>,
}

/// One row of `usage_periods`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeriodRow {
    /// See [`PeriodWrite`].
    pub counter: String,
    /// See [`PeriodWrite`].
    pub tenant: String,
    /// See [`PeriodWrite`].
    pub scope: String,
    /// See [`PeriodWrite`].
    pub resource: String,
    /// See [`PeriodWrite`].
    pub key: String,
    /// See [`PeriodWrite`].
    pub shadow: bool,
    /// See [`PeriodWrite`].
    pub rule: String,
    /// See [`PeriodWrite`].
    pub start: Micros,
    /// See [`PeriodWrite`].
    pub end: Micros,
    /// See [`PeriodWrite`].
    pub quota: u64,
    /// The final count; `None` while open, or when closed without it (its
    /// counter was lost with its store before it was read).
    pub used: Option<u64>,
    /// The period is closed: `used` is final.
    pub closed: bool,
}

/// Which rows [`LimitsTable::periods`] pages through, in (tenant, start,
/// counter) order.
#[derive(Debug, Clone, Default)]
pub struct PeriodFilter {
    /// One tenant's rows only.
    pub tenant: Option<String>,
    /// Periods that started at or after this instant.
    pub since: Option<Micros>,
    /// Periods that ended at or before this instant.
    pub until: Option<Micros>,
    /// Closed periods only.
    pub closed_only: bool,
    /// Rows after this one (the previous page's last: tenant, start,
    /// counter).
    pub after: Option<(String, Micros, String)>,
    /// Most rows.
    pub limit: usize,
}

const PERIOD_COLUMNS: &str = "counter, tenant, scope, resource, key, shadow, rule, \
     period_start, period_end, quota, used, closed_at IS NOT NULL";

fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn period_of<R: Row>(r: &R) -> Result<PeriodRow, sqlx::Error>
where
    usize: sqlx::ColumnIndex<R>,
    for<'d> String: sqlx::Decode<'d, R::Database> + sqlx::Type<R::Database>,
    for<'d> i64: sqlx::Decode<'d, R::Database> + sqlx::Type<R::Database>,
    for<'d> bool: sqlx::Decode<'d, R::Database> + sqlx::Type<R::Database>,
{
    let count = |v: i64| u64::try_from(v).unwrap_or_default();
    Ok(PeriodRow {
        counter: r.try_get(0)?,
        tenant: r.try_get(1)?,
        scope: r.try_get(2)?,
        resource: r.try_get(3)?,
        key: r.try_get(4)?,
        shadow: r.try_get::<i64, _>(5)? != 0,
        rule: r.try_get(6)?,
        start: count(r.try_get(7)?),
        end: count(r.try_get(8)?),
        quota: count(r.try_get(9)?),
        used: r.try_get::<Option<i64>, _>(10)?.map(count),
        closed: r.try_get(11)?,
    })
}

impl LimitsTable {
    /// Writes `periods` in one transaction: each opened (inserted, or its
    /// end, quota and rule updated) or closed (its final count written
    /// unless it is closed already). Returns how many periods this call
    /// closed; a period closed before (by another instance, or an earlier
    /// try of the same write) does not count.
    pub async fn write_periods(&self, periods: &[PeriodWrite<'_>]) -> Result<u64, TableError> {
        let open = "INSERT INTO usage_periods (counter, period_start, period_end, tenant, scope, \
             resource, key, shadow, rule, quota) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) \
             ON CONFLICT (counter, period_start) DO UPDATE SET period_end = excluded.period_end, \
             quota = excluded.quota, rule = excluded.rule";
        let close = format!(
            "INSERT INTO usage_periods (counter, period_start, period_end, tenant, scope, \
             resource, key, shadow, rule, quota, used, closed_at) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, {}) \
             ON CONFLICT (counter, period_start) DO UPDATE SET used = excluded.used, \
             closed_at = excluded.closed_at WHERE usage_periods.closed_at IS NULL",
            self.now()
        );
        with_pool!(self, pool => {
            let mut tx = pool.begin().await?;
            let mut closed = 0;
            for p in periods {
                let mut binds = vec![
                    Bind::Text(p.counter),
                    Bind::Int(int(p.start)),
                    Bind::Int(int(p.end)),
                    Bind::Text(p.tenant),
                    Bind::Text(p.scope),
                    Bind::Text(p.resource),
                    Bind::Text(p.key),
                    Bind::Int(i64::from(p.shadow)),
                    Bind::Text(p.rule),
                    Bind::Int(int(p.quota)),
                ];
                let sql = match p.used {
                    None => open,
                    Some(used) => {
                        binds.push(Bind::Int(int(used)));
                        close.as_str()
                    }
                };
                let done = bound!(sqlx::query(self.sql(sql)), &binds)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                if p.used.is_some() {
                    closed += done;
                }
            }
            tx.commit().await?;
            Ok(closed)
        })
    }

    /// Closes one open period at its final count (`None`: its count was
    /// lost). Returns false when it was closed already.
    pub async fn close_period(
        &self,
        counter: &str,
        start: Micros,
        used: Option<u64>,
    ) -> Result<bool, TableError> {
        let sql = format!(
            "UPDATE usage_periods SET used = ?, closed_at = {} \
             WHERE counter = ? AND period_start = ? AND closed_at IS NULL",
            self.now()
        );
        let used = used.map_or(Bind::Null, |u| Bind::Int(int(u)));
        let done = self
            .execute(&sql, &[used, Bind::Text(counter), Bind::Int(int(start))])
            .await?;
        Ok(done > 0)
    }

    /// Open periods that ended at or before `before`, in order of their
    /// end, after (`end`, `counter`) `after`; at most `limit`.
    pub async fn due_periods(
        &self,
        before: Micros,
        after: Option<(Micros, &str)>,
        limit: usize,
    ) -> Result<Vec<PeriodRow>, TableError> {
        let (end, counter) = after.unwrap_or((0, ""));
        let sql = format!(
            "SELECT {PERIOD_COLUMNS} FROM usage_periods WHERE closed_at IS NULL \
             AND period_end <= ? AND (period_end > ? OR (period_end = ? AND counter > ?)) \
             ORDER BY period_end, counter LIMIT ?"
        );
        let binds = [
            Bind::Int(int(before)),
            Bind::Int(int(end)),
            Bind::Int(int(end)),
            Bind::Text(counter),
            Bind::Int(int(limit as u64)),
        ];
        self.period_rows(&sql, &binds).await
    }

    /// One period of one counter.
    pub async fn period(
        &self,
        counter: &str,
        start: Micros,
    ) -> Result<Option<PeriodRow>, TableError> {
        let sql = format!(
            "SELECT {PERIOD_COLUMNS} FROM usage_periods WHERE counter = ? AND period_start = ?"
        );
        let rows = self
            .period_rows(&sql, &[Bind::Text(counter), Bind::Int(int(start))])
            .await?;
        Ok(rows.into_iter().next())
    }

    /// A page of periods, in (tenant, start, counter) order.
    pub async fn periods(&self, filter: &PeriodFilter) -> Result<Vec<PeriodRow>, TableError> {
        let mut sql = format!("SELECT {PERIOD_COLUMNS} FROM usage_periods WHERE 1 = 1");
        let mut binds = Vec::new();
        if let Some(tenant) = &filter.tenant {
            sql.push_str(" AND tenant = ?");
            binds.push(Bind::Text(tenant));
        }
        if let Some(since) = filter.since {
            sql.push_str(" AND period_start >= ?");
            binds.push(Bind::Int(int(since)));
        }
        if let Some(until) = filter.until {
            sql.push_str(" AND period_end <= ?");
            binds.push(Bind::Int(int(until)));
        }
        if filter.closed_only {
            sql.push_str(" AND closed_at IS NOT NULL");
        }
        if let Some((tenant, start, counter)) = &filter.after {
            sql.push_str(
                " AND (tenant > ? OR (tenant = ? AND (period_start > ? \
                 OR (period_start = ? AND counter > ?))))",
            );
            binds.extend([
                Bind::Text(tenant),
                Bind::Text(tenant),
                Bind::Int(int(*start)),
                Bind::Int(int(*start)),
                Bind::Text(counter),
            ]);
        }
        sql.push_str(" ORDER BY tenant, period_start, counter LIMIT ?");
        binds.push(Bind::Int(int(filter.limit as u64)));
        self.period_rows(&sql, &binds).await
    }

    async fn period_rows(
        &self,
        sql: &str,
        binds: &[Bind<'_>],
    ) -> Result<Vec<PeriodRow>, TableError> {
        with_pool!(self, pool => {
            let rows = bound!(sqlx::query(self.sql(sql)), binds)
                .fetch_all(pool)
                .await?;
            Ok(rows.iter().map(period_of).collect::<Result<_, _>>()?)
        })
    }
}
