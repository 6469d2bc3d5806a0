//! The limits table in SQL: the embedded default is a SQLite file.
//!
//! The table is created on first use and seeded with one default rule
//! ([`DEFAULT_ROW`]). Rows are read as plain [`LimitRow`]s; validation
//! happens in [`super::RuleSet::from_rows`], so rows written with plain SQL
//! are checked exactly like rows written by `tollgate limits set`.

use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use sqlx::{Executor, Row};

use super::LimitRow;

const SCHEMA: &str = include_str!("schema_sqlite.sql");

/// The row a new table starts with: every key of every tenant may make 600
/// requests a minute, with bursts of up to 30.
pub fn default_row() -> LimitRow {
    LimitRow {
        name: "default-per-key".into(),
        tenant: String::new(),
        resource: String::new(),
        scope: "key".into(),
        burst: 30,
        rate: 600,
        rate_unit: "minute".into(),
        mode: "enforce".into(),
        on_store_unavailable: "allow".into(),
        updated_at: String::new(),
    }
}

/// The seeded default, as a constant for documentation.
pub const DEFAULT_ROW: &str =
    "default-per-key: tenant '', resource '', scope key, burst 30, 600/minute";

/// A failure reading or writing the table.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    /// The location is not something this build can open.
    #[error("limits location {0:?}: {1}")]
    Location(String, String),
    /// The database failed.
    #[error("limits table: {0}")]
    Database(#[from] sqlx::Error),
    /// A write was refused because it conflicts with another row.
    #[error("{0}")]
    Conflict(String),
}

/// A handle on the limits table.
#[derive(Clone, Debug)]
pub struct LimitsTable {
    pool: SqlitePool,
    location: String,
}

impl LimitsTable {
    /// Opens the table at `location`: a file path, or a `sqlite:` URL. The
    /// file and table are created (and seeded) when missing.
    pub async fn open(location: &str) -> Result<Self, TableError> {
        let options = if location.starts_with("sqlite:") {
            SqliteConnectOptions::from_str(location)
                .map_err(|e| TableError::Location(location.into(), e.to_string()))?
        } else if location.contains("://") {
            return Err(TableError::Location(
                location.into(),
                "this build reads limits from SQLite only; give a file path or a sqlite: URL"
                    .into(),
            ));
        } else {
            SqliteConnectOptions::new().filename(location)
        };
        let options = options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(2)
            .connect_with(options)
            .await?;
        let table = Self {
            pool,
            location: location.into(),
        };
        table.migrate().await?;
        Ok(table)
    }

    /// Where the table lives, as given to [`Self::open`].
    pub fn location(&self) -> &str {
        &self.location
    }

    async fn migrate(&self) -> Result<(), TableError> {
        let mut tx = self.pool.begin().await?;
        let exists: i64 = sqlx::query(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'limits'",
        )
        .fetch_one(&mut *tx)
        .await?
        .try_get(0)?;
        tx.execute(SCHEMA).await?;
        if exists == 0 {
            insert(&mut tx, &default_row()).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Every row, in id order.
    pub async fn rows(&self) -> Result<Vec<LimitRow>, TableError> {
        let rows = sqlx::query(
            "SELECT name, tenant, resource, scope, burst, rate, rate_unit, mode, \
             on_store_unavailable, updated_at FROM limits ORDER BY id",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(LimitRow {
                    name: r.try_get("name")?,
                    tenant: r.try_get("tenant")?,
                    resource: r.try_get("resource")?,
                    scope: r.try_get("scope")?,
                    burst: r.try_get("burst")?,
                    rate: r.try_get("rate")?,
                    rate_unit: r.try_get("rate_unit")?,
                    mode: r.try_get("mode")?,
                    on_store_unavailable: r.try_get("on_store_unavailable")?,
                    updated_at: r.try_get("updated_at")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    /// Inserts the row, or updates the row with the same tenant, resource,
    /// scope and mode. Validate it first; the table only enforces uniqueness.
    pub async fn upsert(&self, row: &LimitRow) -> Result<(), TableError> {
        let mut tx = self.pool.begin().await?;
        let clash: Option<(String, String, String)> = sqlx::query(
            "SELECT tenant, resource, scope FROM limits WHERE name = ? \
             AND NOT (tenant = ? AND resource = ? AND scope = ? AND mode = ?)",
        )
        .bind(&row.name)
        .bind(&row.tenant)
        .bind(&row.resource)
        .bind(&row.scope)
        .bind(&row.mode)
        .fetch_optional(&mut *tx)
        .await?
        .map(|r| Ok::<_, sqlx::Error>((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?)))
        .transpose()?;
        if let Some((tenant, resource, scope)) = clash {
            return Err(TableError::Conflict(format!(
                "name {:?} already belongs to the row for tenant {tenant:?}, resource {resource:?}, scope {scope:?}; \
                 pick another --name or delete that row first",
                row.name
            )));
        }
        let updated = sqlx::query(
            "UPDATE limits SET name = ?, burst = ?, rate = ?, rate_unit = ?, \
             on_store_unavailable = ?, updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
             WHERE tenant = ? AND resource = ? AND scope = ? AND mode = ?",
        )
        .bind(&row.name)
        .bind(row.burst)
        .bind(row.rate)
        .bind(&row.rate_unit)
        .bind(&row.on_store_unavailable)
        .bind(&row.tenant)
        .bind(&row.resource)
        .bind(&row.scope)
        .bind(&row.mode)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if updated == 0 {
            insert(&mut tx, row).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Deletes the row with this name. Returns whether one existed.
    pub async fn delete(&self, name: &str) -> Result<bool, TableError> {
        let done = sqlx::query("DELETE FROM limits WHERE name = ?")
            .bind(name)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    /// Runs one SQL statement: for tests and tools that edit the table the
    /// way an operator would, with plain SQL.
    pub async fn execute_sql(&self, sql: &str) -> Result<u64, TableError> {
        let done = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }

    /// Closes the connections.
    pub async fn close(&self) {
        self.pool.close().await;
    }
}

async fn insert(tx: &mut sqlx::SqliteConnection, row: &LimitRow) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO limits (name, tenant, resource, scope, burst, rate, rate_unit, mode, on_store_unavailable) \
         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
    )
    .bind(&row.name)
    .bind(&row.tenant)
    .bind(&row.resource)
    .bind(&row.scope)
    .bind(row.burst)
    .bind(row.rate)
    .bind(&row.rate_unit)
    .bind(&row.mode)
    .bind(&row.on_store_unavailable)
    .execute(tx)
    .await?;
    Ok(())
}
