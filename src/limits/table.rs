//! The limits table in SQL: an embedded SQLite file by default, PostgreSQL
//! in production.
//!
//! The table is created on first use (migrations run at start-up) and
//! seeded with one default rule ([`DEFAULT_ROW`]). Rows are read as plain
//! [`StoredRow`]s; validation happens in [`super::RuleSet::from_rows`], so
//! rows written with plain SQL are checked exactly like rows written by
//! `tollgate limits set`. On PostgreSQL every change also sends a
//! notification on the `tollgate_limits` channel ([`LimitsTable::listener`]).

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use sqlx::{Executor, Row};

use super::{Kind, LimitRow, Mode, OnStoreUnavailable, Scope, StoredRow};
use crate::algorithm::{Rate, RateUnit};
use crate::store::redact;

const SCHEMA: &str = include_str!("schema_sqlite.sql");
const SCHEMA_POSTGRES: &str = include_str!("schema_postgres.sql");

/// The channel PostgreSQL notifies on every change of the table.
pub const NOTIFY_CHANNEL: &str = "tollgate_limits";

/// Where `serve` and `limits` find the table unless told: a SQLite file in
/// the working directory.
pub const DEFAULT_LOCATION: &str = "tollgate-limits.db";

/// The row a new table starts with: every key of every tenant may make 600
/// requests a minute, with bursts of up to 30.
pub fn default_row() -> LimitRow {
    LimitRow {
        name: "default-per-key".into(),
        tenant: String::new(),
        resource: String::new(),
        scope: Scope::Key,
        burst: 30,
        rate: Rate {
            count: 600,
            unit: RateUnit::Minute,
        },
        mode: Mode::Enforce,
        on_store_unavailable: OnStoreUnavailable::Allow,
        debt: 0,
        kind: Kind::Rate,
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
    pool: Pool,
    location: String,
}

#[derive(Clone, Debug)]
enum Pool {
    Sqlite(SqlitePool),
    Postgres(PgPool),
}

/// A value bound into a statement.
enum Bind<'a> {
    Text(&'a str),
    Int(i64),
}

/// `?` placeholders as PostgreSQL's `$1, $2, …` (our statements have no `?`
/// inside literals).
fn numbered(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len() + 8);
    let mut n = 0;
    for c in sql.chars() {
        if c == '?' {
            n += 1;
            out.push_str(&format!("${n}"));
        } else {
            out.push(c);
        }
    }
    out
}

impl LimitsTable {
    /// Opens the table at `location`: a file path or `sqlite:` URL, or a
    /// `postgres://` / `postgresql://` URL. Missing tables are created (and
    /// seeded).
    pub async fn open(location: &str) -> Result<Self, TableError> {
        let bad = |e: &dyn std::fmt::Display| TableError::Location(redact(location), e.to_string());
        let pool = if location.starts_with("postgres://") || location.starts_with("postgresql://") {
            let options = PgConnectOptions::from_str(location).map_err(|e| bad(&e))?;
            let pool = PgPoolOptions::new()
                .max_connections(4)
                .acquire_timeout(Duration::from_secs(5))
                .connect_with(options)
                .await?;
            Pool::Postgres(pool)
        } else {
            let options = if location.starts_with("sqlite:") {
                SqliteConnectOptions::from_str(location).map_err(|e| bad(&e))?
            } else if location.contains("://") {
                return Err(bad(&"give a file path, a sqlite: URL or a postgres:// URL"));
            } else {
                SqliteConnectOptions::new().filename(location)
            };
            let options = options
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .busy_timeout(Duration::from_secs(5));
            Pool::Sqlite(
                SqlitePoolOptions::new()
                    .max_connections(2)
                    .connect_with(options)
                    .await?,
            )
        };
        let table = Self {
            pool,
            location: location.into(),
        };
        table.migrate().await?;
        Ok(table)
    }

    /// Where the table lives, with any password hidden.
    pub fn location(&self) -> String {
        redact(&self.location)
    }

    /// True for PostgreSQL.
    pub fn is_postgres(&self) -> bool {
        matches!(self.pool, Pool::Postgres(_))
    }

    async fn migrate(&self) -> Result<(), TableError> {
        match &self.pool {
            Pool::Sqlite(pool) => {
                let mut tx = pool.begin().await?;
                let exists: i64 = sqlx::query(
                    "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'limits'",
                )
                .fetch_one(&mut *tx)
                .await?
                .try_get(0)?;
                tx.execute(SCHEMA).await?;
                // Tables made before the debt column get it (SQLite has no
                // ADD COLUMN IF NOT EXISTS).
                let has_debt: i64 = sqlx::query(
                    "SELECT count(*) FROM pragma_table_info('limits') WHERE name = 'debt'",
                )
                .fetch_one(&mut *tx)
                .await?
                .try_get(0)?;
                if has_debt == 0 {
                    tx.execute("ALTER TABLE limits ADD COLUMN debt INTEGER NOT NULL DEFAULT 0")
                        .await?;
                }
                // Tables made before the kind column are rebuilt: their
                // uniqueness must include the kind, and SQLite cannot
                // change a table's constraints in place.
                let has_kind: i64 = sqlx::query(
                    "SELECT count(*) FROM pragma_table_info('limits') WHERE name = 'kind'",
                )
                .fetch_one(&mut *tx)
                .await?
                .try_get(0)?;
                if has_kind == 0 {
                    tx.execute(
                        "ALTER TABLE limits RENAME TO limits_before_kind; \
                         DROP TRIGGER IF EXISTS limits_touch;",
                    )
                    .await?;
                    tx.execute(SCHEMA).await?;
                    tx.execute(
                        "INSERT INTO limits (id, name, tenant, resource, scope, burst, rate, rate_unit, \
                         mode, on_store_unavailable, debt, kind, updated_at) \
                         SELECT id, name, tenant, resource, scope, burst, rate, rate_unit, mode, \
                         on_store_unavailable, debt, 'rate', updated_at FROM limits_before_kind; \
                         DROP TABLE limits_before_kind;",
                    )
                    .await?;
                }
                tx.commit().await?;
                if exists == 0 {
                    self.insert(&default_row()).await?;
                }
            }
            Pool::Postgres(pool) => {
                let mut tx = pool.begin().await?;
                // One instance migrates at a time.
                sqlx::query("SELECT pg_advisory_xact_lock(7305521)")
                    .execute(&mut *tx)
                    .await?;
                let exists: bool = sqlx::query("SELECT to_regclass('limits') IS NOT NULL")
                    .fetch_one(&mut *tx)
                    .await?
                    .try_get(0)?;
                sqlx::raw_sql(SCHEMA_POSTGRES).execute(&mut *tx).await?;
                if !exists {
                    let row = default_row();
                    bind_pg(
                        sqlx::query(sqlx::AssertSqlSafe(numbered(INSERT))),
                        &insert_binds(&row.stored()),
                    )
                    .execute(&mut *tx)
                    .await?;
                }
                tx.commit().await?;
            }
        }
        Ok(())
    }

    async fn execute(&self, sql: &str, binds: &[Bind<'_>]) -> Result<u64, sqlx::Error> {
        Ok(match &self.pool {
            // Our statements are constants; only placeholders are rewritten.
            Pool::Sqlite(pool) => {
                bind_sqlite(sqlx::query(sqlx::AssertSqlSafe(sql.to_owned())), binds)
                    .execute(pool)
                    .await?
                    .rows_affected()
            }
            Pool::Postgres(pool) => bind_pg(sqlx::query(sqlx::AssertSqlSafe(numbered(sql))), binds)
                .execute(pool)
                .await?
                .rows_affected(),
        })
    }

    async fn insert(&self, row: &LimitRow) -> Result<(), sqlx::Error> {
        let row = row.stored();
        self.execute(INSERT, &insert_binds(&row)).await.map(|_| ())
    }

    /// Every row, in id order.
    pub async fn rows(&self) -> Result<Vec<StoredRow>, TableError> {
        const COLUMNS: &str = "name, tenant, resource, scope, burst, rate, rate_unit, mode, on_store_unavailable, debt, kind";
        match &self.pool {
            Pool::Sqlite(pool) => {
                let sql = format!("SELECT {COLUMNS}, updated_at FROM limits ORDER BY id");
                let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
                    .fetch_all(pool)
                    .await?;
                rows.iter()
                    .map(to_row)
                    .collect::<Result<_, _>>()
                    .map_err(Into::into)
            }
            Pool::Postgres(pool) => {
                let sql = format!(
                    "SELECT {COLUMNS}, to_char(updated_at AT TIME ZONE 'UTC', \
                     'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') AS updated_at FROM limits ORDER BY id"
                );
                let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
                    .fetch_all(pool)
                    .await?;
                rows.iter()
                    .map(to_row)
                    .collect::<Result<_, _>>()
                    .map_err(Into::into)
            }
        }
    }

    /// Inserts the row, or updates the row with the same tenant, resource,
    /// scope and mode. Validate it first; the table only enforces uniqueness.
    pub async fn upsert(&self, row: &LimitRow) -> Result<(), TableError> {
        let row = &row.stored();
        let clash = match &self.pool {
            Pool::Sqlite(pool) => bind_sqlite(sqlx::query(CLASH), &clash_binds(row))
                .fetch_optional(pool)
                .await?
                .map(|r| clash_of(&r))
                .transpose()?,
            Pool::Postgres(pool) => bind_pg(
                sqlx::query(sqlx::AssertSqlSafe(numbered(CLASH))),
                &clash_binds(row),
            )
            .fetch_optional(pool)
            .await?
            .map(|r| clash_of(&r))
            .transpose()?,
        };
        if let Some((tenant, resource, scope)) = clash {
            return Err(TableError::Conflict(format!(
                "name {:?} already belongs to the row for tenant {tenant:?}, resource {resource:?}, scope {scope:?}; \
                 pick another --name or delete that row first",
                row.name
            )));
        }
        let now = match self.pool {
            Pool::Sqlite(_) => "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')",
            Pool::Postgres(_) => "now()",
        };
        let sql = format!(
            "{INSERT} ON CONFLICT (tenant, resource, scope, mode, kind) DO UPDATE SET name = excluded.name, \
             burst = excluded.burst, rate = excluded.rate, rate_unit = excluded.rate_unit, \
             on_store_unavailable = excluded.on_store_unavailable, debt = excluded.debt, \
             updated_at = {now}"
        );
        self.execute(&sql, &insert_binds(row)).await?;
        Ok(())
    }

    /// Deletes the row with this name. Returns whether one existed.
    pub async fn delete(&self, name: &str) -> Result<bool, TableError> {
        Ok(self
            .execute("DELETE FROM limits WHERE name = ?", &[Bind::Text(name)])
            .await?
            > 0)
    }

    /// Runs SQL (one or more statements): for tests and tools that edit the
    /// table the way an operator would, with plain SQL.
    pub async fn execute_sql(&self, sql: &str) -> Result<u64, TableError> {
        let sql = sqlx::AssertSqlSafe(sql.to_owned());
        Ok(match &self.pool {
            Pool::Sqlite(pool) => sqlx::raw_sql(sql).execute(pool).await?.rows_affected(),
            Pool::Postgres(pool) => sqlx::raw_sql(sql).execute(pool).await?.rows_affected(),
        })
    }

    /// A listener on the change notifications (PostgreSQL only).
    pub async fn listener(&self) -> Result<Option<PgListener>, TableError> {
        match &self.pool {
            Pool::Sqlite(_) => Ok(None),
            Pool::Postgres(pool) => {
                let mut listener = PgListener::connect_with(pool).await?;
                listener.listen(NOTIFY_CHANNEL).await?;
                Ok(Some(listener))
            }
        }
    }

    /// Closes the connections.
    pub async fn close(&self) {
        match &self.pool {
            Pool::Sqlite(pool) => pool.close().await,
            Pool::Postgres(pool) => pool.close().await,
        }
    }
}

const INSERT: &str = "INSERT INTO limits (name, tenant, resource, scope, burst, rate, rate_unit, mode, \
                      on_store_unavailable, debt, kind) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)";

const CLASH: &str = "SELECT tenant, resource, scope FROM limits WHERE name = ? \
                     AND NOT (tenant = ? AND resource = ? AND scope = ? AND mode = ? AND kind = ?)";

fn insert_binds(row: &StoredRow) -> Vec<Bind<'_>> {
    vec![
        Bind::Text(&row.name),
        Bind::Text(&row.tenant),
        Bind::Text(&row.resource),
        Bind::Text(&row.scope),
        Bind::Int(row.burst),
        Bind::Int(row.rate),
        Bind::Text(&row.rate_unit),
        Bind::Text(&row.mode),
        Bind::Text(&row.on_store_unavailable),
        Bind::Int(row.debt),
        Bind::Text(&row.kind),
    ]
}

fn clash_binds(row: &StoredRow) -> Vec<Bind<'_>> {
    vec![
        Bind::Text(&row.name),
        Bind::Text(&row.tenant),
        Bind::Text(&row.resource),
        Bind::Text(&row.scope),
        Bind::Text(&row.mode),
        Bind::Text(&row.kind),
    ]
}

type SqliteQuery<'q> = sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments>;
type PgQuery<'q> = sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>;

fn bind_sqlite<'q>(mut q: SqliteQuery<'q>, binds: &[Bind<'q>]) -> SqliteQuery<'q> {
    for b in binds {
        q = match b {
            Bind::Text(s) => q.bind(*s),
            Bind::Int(i) => q.bind(*i),
        };
    }
    q
}

fn bind_pg<'q>(mut q: PgQuery<'q>, binds: &[Bind<'q>]) -> PgQuery<'q> {
    for b in binds {
        q = match b {
            Bind::Text(s) => q.bind(*s),
            Bind::Int(i) => q.bind(*i),
        };
    }
    q
}

fn to_row<R: Row>(r: &R) -> Result<StoredRow, sqlx::Error>
where
    for<'c> &'c str: sqlx::ColumnIndex<R>,
    for<'d> String: sqlx::Decode<'d, R::Database> + sqlx::Type<R::Database>,
    for<'d> i64: sqlx::Decode<'d, R::Database> + sqlx::Type<R::Database>,
{
    Ok(StoredRow {
        name: r.try_get("name")?,
        tenant: r.try_get("tenant")?,
        resource: r.try_get("resource")?,
        scope: r.try_get("scope")?,
        burst: r.try_get("burst")?,
        rate: r.try_get("rate")?,
        rate_unit: r.try_get("rate_unit")?,
        mode: r.try_get("mode")?,
        on_store_unavailable: r.try_get("on_store_unavailable")?,
        debt: r.try_get("debt")?,
        kind: r.try_get("kind")?,
        updated_at: r.try_get("updated_at")?,
    })
}

fn clash_of<R: Row>(r: &R) -> Result<(String, String, String), sqlx::Error>
where
    usize: sqlx::ColumnIndex<R>,
    for<'d> String: sqlx::Decode<'d, R::Database> + sqlx::Type<R::Database>,
{
    Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?))
}
