//! The limits tables in SQL: an embedded SQLite file by default, PostgreSQL
//! in production.
//!
//! Three tables: `limits` (one row per rule, owned by a tenant, a plan or
//! the defaults), `plans` (the plans that exist) and `tenants` (which plan
//! each tenant is on). They are created on first use (migrations run at
//! start-up) and seeded with one default rule ([`DEFAULT_ROW`]). Triggers
//! log every change's owner under a monotonic version (`limits_version`,
//! `limits_changes`), so [`LimitsTable::read_changes`] reads only what
//! changed since the version an instance holds; PostgreSQL also notifies
//! the version on the `tollgate_limits` channel at commit
//! ([`LimitsTable::listener`]). Rows are read as plain [`StoredRow`]s and
//! validated by the loader, so rows written with plain SQL are checked
//! exactly like rows written by `tollgate limits set`.

use std::str::FromStr;
use std::time::Duration;

use futures_util::TryStreamExt;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use sqlx::{Executor, Row};

use super::{Kind, LimitRow, Mode, OnStoreUnavailable, Owner, Scope, StoredRow};
use crate::algorithm::calendar::Cycle;
use crate::algorithm::{Rate, RateUnit};
use crate::store::redact;

const SCHEMA: &str = include_str!("schema_sqlite.sql");
const SCHEMA_POSTGRES: &str = include_str!("schema_postgres.sql");

/// How many times a PostgreSQL migration that lost a deadlock is tried
/// again before start-up fails with it.
const MIGRATION_ATTEMPTS: u64 = 5;

/// The channel PostgreSQL notifies on every change of the tables; the
/// payload is the table's new version.
pub const NOTIFY_CHANNEL: &str = "tollgate_limits";

/// Where `serve` and `limits` find the table unless told: a SQLite file in
/// the working directory.
pub const DEFAULT_LOCATION: &str = "tollgate-limits.db";

/// How long the change log keeps an entry. An instance that has not caught
/// up for longer reads every row again.
pub const CHANGE_LOG_RETENTION: Duration = Duration::from_secs(600);

/// The row a new table starts with: every key of every tenant may make 600
/// requests a minute, with bursts of up to 30.
pub fn default_row() -> LimitRow {
    LimitRow {
        name: "default-per-key".into(),
        tenant: String::new(),
        plan: String::new(),
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
        alerts: crate::algorithm::alerts::Alerts::NONE,
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
    /// A write names something that does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The database returned rows this build cannot read (from
    /// [`LimitsTable::read_changes`]).
    #[error("limits table: unreadable rows at {0:?}")]
    Chunk(String),
    /// More changes wait than [`LimitsTable::read_changes`] was asked to
    /// read at most (`u64::MAX`: the whole table); nothing was read.
    #[error("limits table: {0} changes wait, more than asked to read")]
    TooManyChanges(u64),
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

/// Runs `$body` with `$pool` bound to whichever pool the table has: the
/// statements are the same text for both (placeholders go through
/// [`LimitsTable::sql`]).
macro_rules! with_pool {
    ($table:expr, $pool:ident => $body:expr) => {
        match &$table.pool {
            Pool::Sqlite($pool) => $body,
            Pool::Postgres($pool) => $body,
        }
    };
}

/// A value bound into a statement.
#[derive(Debug, Clone)]
pub(crate) enum Bind<'a> {
    Text(&'a str),
    Int(i64),
    Null,
}

macro_rules! bound {
    ($query:expr, $binds:expr) => {{
        let mut q = $query;
        for b in $binds {
            q = match b {
                Bind::Text(s) => q.bind(*s),
                Bind::Int(i) => q.bind(*i),
                Bind::Null => q.bind(None::<i64>),
            };
        }
        q
    }};
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

/// What [`LimitsTable::read_changes`] feeds, in this order: `begin` once,
/// then the plans that exist, the rows (a tenant's rows one after another)
/// and the tenants' plan assignments, all read in one snapshot.
pub trait ChangeSink {
    /// Everything follows (`full`), or the state of `owners` only.
    fn begin(&mut self, full: bool, owners: Vec<Owner>);
    /// A plan that exists.
    fn plan(&mut self, name: &str);
    /// A row.
    fn row(&mut self, row: StoredRow);
    /// A tenant's row of `tenants`: its plan ('' for none) and billing
    /// cycle, as stored.
    fn tenant(&mut self, row: TenantRow<'_>);
}

/// A `tenants` row as stored: validated by the loader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantRow<'a> {
    /// The tenant.
    pub tenant: &'a str,
    /// Its plan; '' for none.
    pub plan: &'a str,
    /// The IANA time zone of its billing cycle.
    pub time_zone: &'a str,
    /// The day of the month its monthly and yearly periods turn on.
    pub cycle_day: i64,
    /// The month its yearly periods turn in.
    pub cycle_month: i64,
    /// The weekday its weekly periods turn on.
    pub cycle_weekday: &'a str,
}

impl<'a> TenantRow<'a> {
    /// The row of `tenant` on `plan` ('' for none), with the default cycle.
    pub fn on_plan(tenant: &'a str, plan: &'a str) -> Self {
        Self {
            tenant,
            plan,
            time_zone: "UTC",
            cycle_day: 1,
            cycle_month: 1,
            cycle_weekday: "monday",
        }
    }

    fn read<R: Row>(r: &'a R) -> Result<Self, sqlx::Error>
    where
        usize: sqlx::ColumnIndex<R>,
        for<'d> &'d str: sqlx::Decode<'d, R::Database> + sqlx::Type<R::Database>,
        for<'d> i64: sqlx::Decode<'d, R::Database> + sqlx::Type<R::Database>,
    {
        Ok(Self {
            tenant: r.try_get(0)?,
            plan: r.try_get(1)?,
            time_zone: r.try_get(2)?,
            cycle_day: r.try_get(3)?,
            cycle_month: r.try_get(4)?,
            cycle_weekday: r.try_get(5)?,
        })
    }

    /// True when the cycle is the default one (UTC, the 1st, January,
    /// Monday).
    pub fn default_cycle(&self) -> bool {
        (
            self.time_zone,
            self.cycle_day,
            self.cycle_month,
            self.cycle_weekday,
        ) == ("UTC", 1, 1, "monday")
    }

    /// The billing cycle, checked; the error says what to fix.
    pub fn cycle(&self) -> Result<Cycle, String> {
        let small = |what: &str, v: i64| {
            u8::try_from(v).map_err(|_| {
                format!(
                    "{what} {v}: use 1 to {}",
                    if what == "anchor month" { 12 } else { 31 }
                )
            })
        };
        Cycle::new(
            self.time_zone,
            small("anchor day", self.cycle_day)?,
            small("anchor month", self.cycle_month)?,
            self.cycle_weekday,
        )
    }
}

/// The SQL condition of a `tenants` row holding the default cycle.
const DEFAULT_CYCLE: &str = "time_zone = 'UTC' AND cycle_day = 1 AND cycle_month = 1 \
                             AND cycle_weekday = 'monday'";

/// A filter for [`LimitsTable::rows_page`].
#[derive(Debug, Clone, Default)]
pub struct RowFilter {
    /// Only this tenant's rows ('' for any; the default rows are tenant ''
    /// and plan '': ask with `defaults`).
    pub tenant: String,
    /// Only this plan's rows ('' for any).
    pub plan: String,
    /// Only names starting with this.
    pub prefix: String,
    /// Only names after this one (the previous page's last).
    pub after: String,
    /// At most this many rows.
    pub limit: usize,
}

/// A plan and how many tenants are on it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PlanRow {
    /// The plan's name.
    pub name: String,
    /// What it is for.
    pub description: String,
    /// Its rules.
    pub rules: i64,
    /// Tenants assigned to it.
    pub tenants: i64,
}

const COLUMNS: &str = "id, name, tenant, plan, resource, scope, burst, rate, rate_unit, mode, \
                       on_store_unavailable, debt, kind, alerts";

const INSERT: &str = "INSERT INTO limits (name, tenant, plan, resource, scope, burst, rate, rate_unit, \
                      mode, on_store_unavailable, debt, kind, alerts) \
                      VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)";

const CLASH: &str = "SELECT tenant, plan, resource, scope FROM limits WHERE name = ? \
                     AND NOT (tenant = ? AND plan = ? AND resource = ? AND scope = ? AND mode = ? AND kind = ?)";

const CONFLICT_TARGET: &str = "(tenant, plan, resource, scope, mode, kind)";

/// Columns added after their table was first made (the alert thresholds of
/// `limits`, the billing cycle of `tenants`), as SQLite adds them to a table
/// made before them (PostgreSQL's schema adds them `IF NOT EXISTS`).
const ADDED_COLUMNS: [(&str, &str, &str); 5] = [
    ("limits", "alerts", "TEXT NOT NULL DEFAULT ''"),
    ("tenants", "time_zone", "TEXT NOT NULL DEFAULT 'UTC'"),
    ("tenants", "cycle_day", "INTEGER NOT NULL DEFAULT 1"),
    ("tenants", "cycle_month", "INTEGER NOT NULL DEFAULT 1"),
    ("tenants", "cycle_weekday", "TEXT NOT NULL DEFAULT 'monday'"),
];

/// The columns a SQLite table has (none when it does not exist).
async fn sqlite_columns(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    table: &str,
) -> Result<Vec<String>, sqlx::Error> {
    let sql = format!("SELECT name FROM pragma_table_info('{table}')");
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .fetch_all(&mut **tx)
        .await?
        .iter()
        .map(|r| r.try_get(0))
        .collect()
}

/// A `tenants` row's columns as read, for the loader.
const TENANT_COLUMNS: &str = "tenant, plan, time_zone, cycle_day, cycle_month, cycle_weekday";

/// The batch above which reading every row beats reading the owners that
/// changed: more change-log entries than this fraction of the rules held.
const FULL_READ_FRACTION: usize = 2;

impl LimitsTable {
    /// Opens the table at `location`: a file path or `sqlite:` URL, or a
    /// `postgres://` / `postgresql://` URL. Missing tables are created (and
    /// seeded).
    pub async fn open(location: &str) -> Result<Self, TableError> {
        let pool = Self::connect(location).await?;
        // A file path is named absolute from here on (in messages, and to
        // a `tollgate limits` run from another directory).
        let location = match sqlite_file(location) {
            Some(path) => std::fs::canonicalize(path)
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_else(|_| location.into()),
            None => location.into(),
        };
        let table = Self { pool, location };
        table.migrate().await?;
        Ok(table)
    }

    /// [`LimitsTable::open`] for a command that edits or reads a table
    /// outside `serve`: a SQLite file that does not exist is an error
    /// naming where it was looked for, unless `create` (so that a command
    /// run from another directory never makes a second table silently).
    pub async fn open_existing(location: &str, create: bool) -> Result<Self, TableError> {
        if let Some(path) = sqlite_file(location).filter(|_| !create) {
            let path = std::path::Path::new(path);
            if !path.exists() {
                let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_owned());
                return Err(TableError::NotFound(format!(
                    "no limits table at {}: `tollgate serve` creates it there, or pass --create; \
                     to edit a server's table, pass its --limits (or set TOLLGATE_LIMITS)",
                    absolute.display()
                )));
            }
        }
        Self::open(location).await
    }

    /// A handle on the same table with connections of its own, made on the
    /// calling thread's runtime (the limits watcher reads through one on
    /// its low-priority thread). An in-memory SQLite database exists only
    /// in its own connections, so its handle is shared instead.
    pub async fn reopen(&self) -> Result<Self, TableError> {
        if !self.is_postgres() && sqlite_file(&self.location).is_none() {
            return Ok(self.clone());
        }
        Ok(Self {
            pool: Self::connect(&self.location).await?,
            location: self.location.clone(),
        })
    }

    async fn connect(location: &str) -> Result<Pool, TableError> {
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
        Ok(pool)
    }

    /// Where the table lives, with any password hidden.
    pub fn location(&self) -> String {
        redact(&self.location)
    }

    /// A fingerprint of [`LimitsTable::location`] (64-bit FNV-1a, hex):
    /// equal for two handles on the same table, and not the location.
    pub fn fingerprint(&self) -> String {
        let hash = self
            .location()
            .bytes()
            .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            });
        format!("{hash:016x}")
    }

    /// True for PostgreSQL.
    pub fn is_postgres(&self) -> bool {
        matches!(self.pool, Pool::Postgres(_))
    }

    /// `sql` with this database's placeholders.
    fn sql(&self, sql: &str) -> sqlx::AssertSqlSafe<String> {
        // Our statements are constants; only placeholders are rewritten.
        sqlx::AssertSqlSafe(match self.pool {
            Pool::Sqlite(_) => sql.to_owned(),
            Pool::Postgres(_) => numbered(sql),
        })
    }

    fn now(&self) -> &'static str {
        match self.pool {
            Pool::Sqlite(_) => "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')",
            Pool::Postgres(_) => "now()",
        }
    }

    async fn migrate(&self) -> Result<(), TableError> {
        match &self.pool {
            Pool::Sqlite(pool) => {
                let mut tx = pool.begin().await?;
                let columns = sqlite_columns(&mut tx, "limits").await?;
                let exists = !columns.is_empty();
                let has = |c: &str| columns.iter().any(|n| n == c);
                if exists && !has("plan") {
                    // Tables made before plans are rebuilt: their uniqueness
                    // must include the plan, and SQLite cannot change a
                    // table's constraints in place.
                    if !has("debt") {
                        tx.execute("ALTER TABLE limits ADD COLUMN debt INTEGER NOT NULL DEFAULT 0")
                            .await?;
                    }
                    if !has("kind") {
                        tx.execute(
                            "ALTER TABLE limits ADD COLUMN kind TEXT NOT NULL DEFAULT 'rate'",
                        )
                        .await?;
                    }
                    tx.execute(
                        "ALTER TABLE limits RENAME TO limits_before_plan; \
                         DROP TRIGGER IF EXISTS limits_touch;",
                    )
                    .await?;
                    tx.execute(SCHEMA).await?;
                    tx.execute(
                        "INSERT INTO limits (id, name, tenant, resource, scope, burst, rate, rate_unit, \
                         mode, on_store_unavailable, debt, kind, updated_at) \
                         SELECT id, name, tenant, resource, scope, burst, rate, rate_unit, mode, \
                         on_store_unavailable, debt, kind, updated_at FROM limits_before_plan; \
                         DROP TABLE limits_before_plan;",
                    )
                    .await?;
                }
                tx.execute(SCHEMA).await?;
                // Tables made before a column was added get it.
                for (table, column, definition) in ADDED_COLUMNS {
                    if !sqlite_columns(&mut tx, table)
                        .await?
                        .iter()
                        .any(|c| c == column)
                    {
                        let sql = format!("ALTER TABLE {table} ADD COLUMN {column} {definition}");
                        tx.execute(sqlx::AssertSqlSafe(sql)).await?;
                    }
                }
                tx.commit().await?;
                if !exists {
                    self.insert(&default_row()).await?;
                }
            }
            Pool::Postgres(pool) => {
                // A schema change that meets another instance's reads may
                // deadlock with them; PostgreSQL aborts one side, and the
                // migration, if it is that side, is tried again.
                let mut attempt = 0;
                while let Err(e) = migrate_postgres(pool).await {
                    if !is_deadlock(&e) || attempt == MIGRATION_ATTEMPTS {
                        return Err(e.into());
                    }
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(50 * attempt)).await;
                }
            }
        }
        Ok(())
    }

    async fn execute(&self, sql: &str, binds: &[Bind<'_>]) -> Result<u64, sqlx::Error> {
        Ok(
            with_pool!(self, pool => bound!(sqlx::query(self.sql(sql)), binds)
            .execute(pool)
            .await?
            .rows_affected()),
        )
    }

    async fn insert(&self, row: &LimitRow) -> Result<(), sqlx::Error> {
        let row = row.stored();
        self.execute(INSERT, &insert_binds(&row)).await.map(|_| ())
    }

    /// Every row, in id order.
    pub async fn rows(&self) -> Result<Vec<StoredRow>, TableError> {
        let mut rows = Vec::new();
        self.export(|row| {
            rows.push(row);
            Ok(())
        })
        .await?;
        Ok(rows)
    }

    /// Every row in id order, one at a time (never all in memory).
    pub async fn export(
        &self,
        mut each: impl FnMut(StoredRow) -> std::io::Result<()>,
    ) -> Result<(), TableError> {
        let sql = format!(
            "SELECT {COLUMNS}, {} AS updated_at FROM limits ORDER BY id",
            self.updated_at()
        );
        with_pool!(self, pool => {
            let mut stream = sqlx::query(sqlx::AssertSqlSafe(sql)).fetch(pool);
            while let Some(r) = stream.try_next().await? {
                each(to_row(&r)?).map_err(|e| TableError::Location(self.location(), e.to_string()))?;
            }
        });
        Ok(())
    }

    /// `SELECT`s the rows of `from` (a `FROM` clause and its `WHERE`s,
    /// over table `limits` or a query of its columns) as chunks: one text
    /// value per [`CHUNK_ROWS`] ids, each row a run of its fourteen values
    /// (the id, then [`super::file::COLUMNS`]), each value written as its length in bytes, a comma and
    /// the value. Lengths rather than separators, so no value can be
    /// mistaken for the next (a name may hold any character). The database
    /// driver copies and allocates every value it returns and hands each
    /// row from its thread to the reader's: at a million rows that was most
    /// of a load's time, and a thousand rows a value makes it a rounding
    /// error.
    fn chunked(&self, from: &str) -> String {
        let (len, agg) = match self.pool {
            Pool::Sqlite(_) => ("octet_length({c})", "group_concat"),
            Pool::Postgres(_) => ("octet_length({c}::text)", "string_agg"),
        };
        // The id, then the columns in `export`'s order: as `chunk_rows`
        // reads them.
        let row = std::iter::once(&"id")
            .chain(super::file::COLUMNS.iter())
            .map(|c| {
                let text = match self.pool {
                    Pool::Sqlite(_) => (*c).to_owned(),
                    Pool::Postgres(_) => format!("{c}::text"),
                };
                format!("{} || ',' || {text}", len.replace("{c}", c))
            })
            .collect::<Vec<_>>()
            .join(" || ");
        format!("SELECT {agg}({row}, '') FROM {from} GROUP BY id / {CHUNK_ROWS}")
    }

    fn updated_at(&self) -> &'static str {
        match self.pool {
            Pool::Sqlite(_) => "updated_at",
            Pool::Postgres(_) => {
                "to_char(updated_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')"
            }
        }
    }

    /// One page of rows, in name order, as `filter` asks.
    pub async fn rows_page(&self, filter: &RowFilter) -> Result<Vec<StoredRow>, TableError> {
        let sql = format!(
            "SELECT {COLUMNS}, {} AS updated_at FROM limits \
             WHERE (? = '' OR tenant = ?) AND (? = '' OR plan = ?) \
             AND substr(name, 1, length(?)) = ? AND name > ? ORDER BY name LIMIT ?",
            self.updated_at()
        );
        let limit = i64::try_from(filter.limit).unwrap_or(i64::MAX);
        let binds = [
            Bind::Text(&filter.tenant),
            Bind::Text(&filter.tenant),
            Bind::Text(&filter.plan),
            Bind::Text(&filter.plan),
            Bind::Text(&filter.prefix),
            Bind::Text(&filter.prefix),
            Bind::Text(&filter.after),
            Bind::Int(limit),
        ];
        let rows = with_pool!(self, pool => bound!(sqlx::query(self.sql(&sql)), &binds)
            .fetch_all(pool)
            .await?
            .iter()
            .map(to_row)
            .collect::<Result<Vec<_>, _>>()?);
        Ok(rows)
    }

    /// How many rows the `limits` and `tenants` tables hold together: what
    /// an instance holds in memory.
    pub async fn count(&self) -> Result<u64, TableError> {
        let sql = "SELECT (SELECT count(*) FROM limits) + (SELECT count(*) FROM tenants)";
        let n: i64 = with_pool!(self, pool => sqlx::query(sql)
            .fetch_one(pool)
            .await?
            .try_get(0)?);
        Ok(n.max(0) as u64)
    }

    /// The table's version: bumped by every change.
    pub async fn version(&self) -> Result<i64, TableError> {
        Ok(
            with_pool!(self, pool => sqlx::query("SELECT version FROM limits_version WHERE id = 1")
            .fetch_one(pool)
            .await?
            .try_get(0)?),
        )
    }

    /// How many changes the table logged after version `since`: 0 when
    /// none, `u64::MAX` when everything must be read again (`since` is 0,
    /// or the change log no longer reaches back to it). One indexed read.
    pub async fn pending(&self, since: i64) -> Result<u64, TableError> {
        with_pool!(self, pool => {
            let head = sqlx::query("SELECT version, pruned FROM limits_version WHERE id = 1")
                .fetch_one(pool)
                .await?;
            let (version, pruned): (i64, i64) = (head.try_get(0)?, head.try_get(1)?);
            if version == since {
                return Ok(0);
            }
            if since == 0 || since < pruned || since > version {
                return Ok(u64::MAX);
            }
            let logged: i64 = bound!(
                sqlx::query(self.sql("SELECT count(*) FROM limits_changes WHERE version > ?")),
                &[Bind::Int(since)]
            )
            .fetch_one(pool)
            .await?
            .try_get(0)?;
            Ok(logged.max(0) as u64)
        })
    }

    /// Reads what changed after version `since` into `sink`, in one
    /// snapshot, and returns the version read up to; `None` (and nothing
    /// fed) when nothing changed. Reads everything when `since` is 0, when
    /// the change log no longer reaches back to `since`, or when more
    /// changed than `held / 2` (the rules the caller holds). When more than
    /// `most` changes wait in that snapshot (a read of everything counts as
    /// `u64::MAX`), reads nothing and answers
    /// [`TableError::TooManyChanges`].
    pub async fn read_changes(
        &self,
        since: i64,
        held: usize,
        most: u64,
        sink: &mut (dyn ChangeSink + Send),
    ) -> Result<Option<i64>, TableError> {
        with_pool!(self, pool => {
            let mut tx = pool.begin().await?;
            if self.is_postgres() {
                sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                    .execute(&mut *tx)
                    .await?;
            }
            let head = sqlx::query("SELECT version, pruned FROM limits_version WHERE id = 1")
                .fetch_one(&mut *tx)
                .await?;
            let (version, pruned): (i64, i64) = (head.try_get(0)?, head.try_get(1)?);
            if version == since {
                tx.commit().await?;
                return Ok(None);
            }
            let mut full = since == 0 || since < pruned || since > version;
            let mut logged = u64::MAX;
            if !full {
                let count: i64 = bound!(
                    sqlx::query(self.sql("SELECT count(*) FROM limits_changes WHERE version > ?")),
                    &[Bind::Int(since)]
                )
                .fetch_one(&mut *tx)
                .await?
                .try_get(0)?;
                logged = count.max(0) as u64;
                full = logged > (held / FULL_READ_FRACTION).max(1000) as u64;
            }
            if logged > most {
                tx.commit().await?;
                return Err(TableError::TooManyChanges(logged));
            }
            let since_bind = [Bind::Int(since)];
            if full {
                sink.begin(true, Vec::new());
                let mut plans = sqlx::query("SELECT name FROM plans").fetch(&mut *tx);
                while let Some(r) = plans.try_next().await? {
                    sink.plan(r.try_get::<&str, _>(0)?);
                }
                drop(plans);
                // Table order: the loader groups a tenant's rows itself.
                let sql = self.chunked("limits");
                let mut chunks = sqlx::query(sqlx::AssertSqlSafe(sql)).fetch(&mut *tx);
                while let Some(r) = chunks.try_next().await? {
                    chunk_rows(r.try_get(0)?, sink)?;
                }
                drop(chunks);
                let sql = format!("SELECT {TENANT_COLUMNS} FROM tenants");
                let mut assigned = sqlx::query(sqlx::AssertSqlSafe(sql)).fetch(&mut *tx);
                while let Some(r) = assigned.try_next().await? {
                    sink.tenant(TenantRow::read(&r)?);
                }
                drop(assigned);
            } else {
                let owners: Vec<Owner> = bound!(
                    sqlx::query(self.sql(
                        "SELECT DISTINCT tenant, plan FROM limits_changes WHERE version > ?"
                    )),
                    &since_bind
                )
                .fetch_all(&mut *tx)
                .await?
                .iter()
                .map(|r| Ok(Owner::of(r.try_get::<&str, _>(0)?, r.try_get::<&str, _>(1)?)))
                .collect::<Result<_, sqlx::Error>>()?;
                sink.begin(false, owners);
                let changed_plans =
                    "SELECT plan FROM limits_changes WHERE version > ? AND plan <> ''";
                let changed_tenants =
                    "SELECT tenant FROM limits_changes WHERE version > ? AND plan = ''";
                let sql = format!("SELECT name FROM plans WHERE name IN ({changed_plans})");
                for r in bound!(sqlx::query(self.sql(&sql)), &since_bind)
                    .fetch_all(&mut *tx)
                    .await?
                {
                    sink.plan(r.try_get::<&str, _>(0)?);
                }
                let sql = self.chunked(&format!(
                    "(SELECT * FROM limits WHERE plan = '' AND tenant IN ({changed_tenants}) \
                     UNION ALL SELECT * FROM limits WHERE plan <> '' AND plan IN ({changed_plans})) \
                     AS changed"
                ));
                let binds = [Bind::Int(since), Bind::Int(since)];
                let mut chunks = bound!(sqlx::query(self.sql(&sql)), &binds).fetch(&mut *tx);
                while let Some(r) = chunks.try_next().await? {
                    chunk_rows(r.try_get(0)?, sink)?;
                }
                drop(chunks);
                let sql = format!(
                    "SELECT {TENANT_COLUMNS} FROM tenants WHERE tenant IN ({changed_tenants})"
                );
                for r in bound!(sqlx::query(self.sql(&sql)), &since_bind)
                    .fetch_all(&mut *tx)
                    .await?
                {
                    sink.tenant(TenantRow::read(&r)?);
                }
            }
            tx.commit().await?;
            Ok(Some(version))
        })
    }

    /// Deletes change-log entries older than `retention`, and records the
    /// highest version deleted (an instance behind it reads everything).
    /// Returns how many entries went. Costs one indexed read when there is
    /// nothing to delete.
    pub async fn prune_changes(&self, retention: Duration) -> Result<u64, TableError> {
        let secs = retention.as_secs() as i64;
        let (oldest, cutoff) = match self.pool {
            Pool::Sqlite(_) => (
                "SELECT 1 FROM limits_changes WHERE version = (SELECT min(version) FROM limits_changes) \
                 AND at < CAST(strftime('%s', 'now') AS INTEGER) - ?",
                "SELECT max(version) FROM limits_changes WHERE at < CAST(strftime('%s', 'now') AS INTEGER) - ?",
            ),
            Pool::Postgres(_) => (
                "SELECT 1 FROM limits_changes WHERE version = (SELECT min(version) FROM limits_changes) \
                 AND at < now() - make_interval(secs => ?)",
                "SELECT max(version) FROM limits_changes WHERE at < now() - make_interval(secs => ?)",
            ),
        };
        let secs_bind = [Bind::Int(secs)];
        let pg_secs = secs as f64;
        with_pool!(self, pool => {
            let due = if self.is_postgres() {
                sqlx::query(self.sql(oldest)).bind(pg_secs).fetch_optional(pool).await?
            } else {
                bound!(sqlx::query(self.sql(oldest)), &secs_bind).fetch_optional(pool).await?
            };
            if due.is_none() {
                return Ok(0);
            }
            let mut tx = pool.begin().await?;
            let upto: Option<i64> = if self.is_postgres() {
                sqlx::query(self.sql(cutoff)).bind(pg_secs).fetch_one(&mut *tx).await?.try_get(0)?
            } else {
                bound!(sqlx::query(self.sql(cutoff)), &secs_bind).fetch_one(&mut *tx).await?.try_get(0)?
            };
            let Some(upto) = upto else {
                return Ok(0);
            };
            let bind = [Bind::Int(upto)];
            let sql = "UPDATE limits_version SET pruned = CASE WHEN pruned > ? THEN pruned ELSE ? END WHERE id = 1";
            bound!(sqlx::query(self.sql(sql)), &[Bind::Int(upto), Bind::Int(upto)])
                .execute(&mut *tx)
                .await?;
            let gone = bound!(sqlx::query(self.sql("DELETE FROM limits_changes WHERE version <= ?")), &bind)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            tx.commit().await?;
            Ok(gone)
        })
    }

    /// Inserts the row, or updates the row with the same owner, resource,
    /// scope, mode and kind. Validate it first; the table only enforces
    /// uniqueness. A plan's row needs the plan to exist.
    pub async fn upsert(&self, row: &LimitRow) -> Result<(), TableError> {
        let row = &row.stored();
        if !row.plan.is_empty() && !self.plan_exists(&row.plan).await? {
            return Err(missing_plan(&row.plan));
        }
        let clash = with_pool!(self, pool => bound!(sqlx::query(self.sql(CLASH)), &clash_binds(row))
            .fetch_optional(pool)
            .await?
            .map(|r| clash_of(&r))
            .transpose()?);
        if let Some((tenant, plan, resource, scope)) = clash {
            let owner = if plan.is_empty() {
                format!("tenant {tenant:?}")
            } else {
                format!("plan {plan:?}")
            };
            return Err(TableError::Conflict(format!(
                "name {:?} already belongs to the row for {owner}, resource {resource:?}, scope {scope:?}; \
                 pick another --name or delete that row first",
                row.name
            )));
        }
        let sql = format!(
            "{INSERT} ON CONFLICT {CONFLICT_TARGET} DO UPDATE SET name = excluded.name, \
             burst = excluded.burst, rate = excluded.rate, rate_unit = excluded.rate_unit, \
             on_store_unavailable = excluded.on_store_unavailable, debt = excluded.debt, \
             alerts = excluded.alerts, updated_at = {}",
            self.now()
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

    async fn plan_exists(&self, plan: &str) -> Result<bool, TableError> {
        Ok(with_pool!(self, pool => bound!(
            sqlx::query(self.sql("SELECT 1 FROM plans WHERE name = ?")),
            &[Bind::Text(plan)]
        )
        .fetch_optional(pool)
        .await?
        .is_some()))
    }

    /// Creates a plan, or changes its description.
    pub async fn create_plan(&self, name: &str, description: &str) -> Result<(), TableError> {
        let sql = format!(
            "INSERT INTO plans (name, description) VALUES (?, ?) ON CONFLICT (name) DO UPDATE \
             SET description = excluded.description, updated_at = {}",
            self.now()
        );
        self.execute(&sql, &[Bind::Text(name), Bind::Text(description)])
            .await?;
        Ok(())
    }

    /// Deletes a plan and its rules, in one transaction. Refused while
    /// tenants are on it, unless `force` (they then get the default rows
    /// until they are moved). Returns whether the plan existed.
    pub async fn delete_plan(&self, name: &str, force: bool) -> Result<bool, TableError> {
        let name_bind = [Bind::Text(name)];
        with_pool!(self, pool => {
            let mut tx = pool.begin().await?;
            let on: i64 = bound!(sqlx::query(self.sql("SELECT count(*) FROM tenants WHERE plan = ?")), &name_bind)
                .fetch_one(&mut *tx)
                .await?
                .try_get(0)?;
            if on > 0 && !force {
                return Err(TableError::Conflict(format!(
                    "{on} tenants are on plan {name:?}; move them first (`tollgate plans assign`) \
                     or delete with --force, and they get the default rows"
                )));
            }
            bound!(sqlx::query(self.sql("DELETE FROM limits WHERE plan = ?")), &name_bind)
                .execute(&mut *tx)
                .await?;
            let gone = bound!(sqlx::query(self.sql("DELETE FROM plans WHERE name = ?")), &name_bind)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            tx.commit().await?;
            Ok(gone > 0)
        })
    }

    /// The plans, with their rules and tenants counted.
    pub async fn plans(&self) -> Result<Vec<PlanRow>, TableError> {
        let sql = "SELECT name, description, \
                   (SELECT count(*) FROM limits l WHERE l.plan = p.name) AS rules, \
                   (SELECT count(*) FROM tenants t WHERE t.plan = p.name) AS tenants \
                   FROM plans p ORDER BY name";
        let rows = with_pool!(self, pool => sqlx::query(sql)
            .fetch_all(pool)
            .await?
            .iter()
            .map(|r| {
                Ok(PlanRow {
                    name: r.try_get(0)?,
                    description: r.try_get(1)?,
                    rules: r.try_get(2)?,
                    tenants: r.try_get(3)?,
                })
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()?);
        Ok(rows)
    }

    /// Puts `tenant` on `plan` (which must exist), or takes it off any plan
    /// (`None`). Returns the plan it was on.
    pub async fn assign(
        &self,
        tenant: &str,
        plan: Option<&str>,
    ) -> Result<Option<String>, TableError> {
        if let Some(plan) = plan
            && !self.plan_exists(plan).await?
        {
            return Err(missing_plan(plan));
        }
        let tenant_bind = [Bind::Text(tenant)];
        with_pool!(self, pool => {
            let mut tx = pool.begin().await?;
            let before: Option<String> = bound!(
                sqlx::query(self.sql("SELECT plan FROM tenants WHERE tenant = ?")),
                &tenant_bind
            )
            .fetch_optional(&mut *tx)
            .await?
            .map(|r| r.try_get::<String, _>(0))
            .transpose()?
            .filter(|p| !p.is_empty());
            match plan {
                Some(plan) => {
                    let sql = format!(
                        "INSERT INTO tenants (tenant, plan) VALUES (?, ?) ON CONFLICT (tenant) \
                         DO UPDATE SET plan = excluded.plan, updated_at = {}",
                        self.now()
                    );
                    bound!(sqlx::query(self.sql(&sql)), &[Bind::Text(tenant), Bind::Text(plan)])
                        .execute(&mut *tx)
                        .await?;
                }
                None => {
                    // The row goes, unless it holds a billing cycle: then
                    // only the plan does.
                    let gone = bound!(
                        sqlx::query(self.sql(&format!("DELETE FROM tenants WHERE tenant = ? AND {DEFAULT_CYCLE}"))),
                        &tenant_bind
                    )
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                    if gone == 0 && before.is_some() {
                        let sql = format!(
                            "UPDATE tenants SET plan = '', updated_at = {} WHERE tenant = ?",
                            self.now()
                        );
                        bound!(sqlx::query(self.sql(&sql)), &tenant_bind)
                            .execute(&mut *tx)
                            .await?;
                    }
                }
            }
            tx.commit().await?;
            Ok(before)
        })
    }

    /// Sets `tenant`'s billing cycle (its plan, if any, stays). The default
    /// cycle on a tenant with no plan leaves no row.
    pub async fn set_cycle(&self, tenant: &str, cycle: &Cycle) -> Result<(), TableError> {
        let sql = format!(
            "INSERT INTO tenants (tenant, plan, time_zone, cycle_day, cycle_month, cycle_weekday) \
             VALUES (?, '', ?, ?, ?, ?) ON CONFLICT (tenant) DO UPDATE SET \
             time_zone = excluded.time_zone, cycle_day = excluded.cycle_day, \
             cycle_month = excluded.cycle_month, cycle_weekday = excluded.cycle_weekday, \
             updated_at = {}",
            self.now()
        );
        let binds = [
            Bind::Text(tenant),
            Bind::Text(cycle.zone()),
            Bind::Int(i64::from(cycle.day())),
            Bind::Int(i64::from(cycle.month())),
            Bind::Text(cycle.weekday()),
        ];
        with_pool!(self, pool => {
            let mut tx = pool.begin().await?;
            if *cycle == Cycle::default() {
                let sql = "DELETE FROM tenants WHERE tenant = ? AND plan = ''";
                let gone = bound!(sqlx::query(self.sql(sql)), &[Bind::Text(tenant)])
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                if gone > 0 {
                    tx.commit().await?;
                    return Ok(());
                }
            }
            bound!(sqlx::query(self.sql(&sql)), &binds).execute(&mut *tx).await?;
            tx.commit().await?;
            Ok(())
        })
    }

    /// `tenant`'s plan ('' for none) and billing cycle, as stored (`None`:
    /// no row, so no plan and the default cycle).
    pub async fn tenant(&self, tenant: &str) -> Result<Option<(String, Cycle)>, TableError> {
        let sql = format!("SELECT {TENANT_COLUMNS} FROM tenants WHERE tenant = ?");
        with_pool!(self, pool => {
            let Some(r) = bound!(sqlx::query(self.sql(&sql)), &[Bind::Text(tenant)])
                .fetch_optional(pool)
                .await?
            else {
                return Ok(None);
            };
            let row = TenantRow::read(&r)?;
            let cycle = row.cycle().map_err(TableError::Conflict)?;
            Ok(Some((row.plan.to_owned(), cycle)))
        })
    }

    /// Upserts `rows` (already validated; `line` numbers them for errors)
    /// in one transaction: every row or none. `progress` is called with the
    /// rows written so far. A name that another owner's row already uses,
    /// or a plan that does not exist, fails the import naming the line.
    pub async fn import(
        &self,
        rows: &[(usize, StoredRow)],
        mut progress: impl FnMut(usize),
    ) -> Result<(), TableError> {
        const CHUNK: usize = 500;
        let stage = "CREATE TEMPORARY TABLE tollgate_import (line BIGINT NOT NULL, name TEXT NOT NULL, \
                     tenant TEXT NOT NULL, plan TEXT NOT NULL, resource TEXT NOT NULL, scope TEXT NOT NULL, \
                     burst BIGINT NOT NULL, rate BIGINT NOT NULL, rate_unit TEXT NOT NULL, mode TEXT NOT NULL, \
                     on_store_unavailable TEXT NOT NULL, debt BIGINT NOT NULL, kind TEXT NOT NULL, \
                     alerts TEXT NOT NULL)";
        let cols = "line, name, tenant, plan, resource, scope, burst, rate, rate_unit, mode, \
                    on_store_unavailable, debt, kind, alerts";
        let one = "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)";
        let clash = "SELECT s.line, s.name, l.tenant, l.plan FROM tollgate_import s JOIN limits l \
                     ON l.name = s.name AND NOT (l.tenant = s.tenant AND l.plan = s.plan AND \
                     l.resource = s.resource AND l.scope = s.scope AND l.mode = s.mode AND l.kind = s.kind) \
                     ORDER BY s.line LIMIT 1";
        let missing = "SELECT s.line, s.plan FROM tollgate_import s WHERE s.plan <> '' AND NOT EXISTS \
                       (SELECT 1 FROM plans p WHERE p.name = s.plan) ORDER BY s.line LIMIT 1";
        let upsert = format!(
            "INSERT INTO limits (name, tenant, plan, resource, scope, burst, rate, rate_unit, mode, \
             on_store_unavailable, debt, kind, alerts) SELECT name, tenant, plan, resource, scope, \
             burst, rate, rate_unit, mode, on_store_unavailable, debt, kind, alerts \
             FROM tollgate_import WHERE true \
             ON CONFLICT {CONFLICT_TARGET} DO UPDATE SET name = excluded.name, burst = excluded.burst, \
             rate = excluded.rate, rate_unit = excluded.rate_unit, \
             on_store_unavailable = excluded.on_store_unavailable, debt = excluded.debt, \
             alerts = excluded.alerts, updated_at = {}",
            self.now()
        );
        with_pool!(self, pool => {
            let mut tx = pool.begin().await?;
            sqlx::query("DROP TABLE IF EXISTS tollgate_import").execute(&mut *tx).await?;
            sqlx::query(stage).execute(&mut *tx).await?;
            for (n, chunk) in rows.chunks(CHUNK).enumerate() {
                let sql = format!(
                    "INSERT INTO tollgate_import ({cols}) VALUES {}",
                    vec![one; chunk.len()].join(", ")
                );
                let mut binds = Vec::with_capacity(chunk.len() * 14);
                for (line, row) in chunk {
                    binds.push(Bind::Int(*line as i64));
                    binds.extend(insert_binds(row));
                }
                bound!(sqlx::query(self.sql(&sql)), &binds).execute(&mut *tx).await?;
                progress(n * CHUNK + chunk.len());
            }
            if let Some(r) = sqlx::query(clash).fetch_optional(&mut *tx).await? {
                let (line, name, tenant, plan): (i64, String, String, String) =
                    (r.try_get(0)?, r.try_get(1)?, r.try_get(2)?, r.try_get(3)?);
                let owner = if plan.is_empty() { format!("tenant {tenant:?}") } else { format!("plan {plan:?}") };
                return Err(TableError::Conflict(format!(
                    "line {line}: name {name:?} already belongs to a row of {owner} with another \
                     resource, scope, mode or kind; nothing was imported"
                )));
            }
            if let Some(r) = sqlx::query(missing).fetch_optional(&mut *tx).await? {
                let (line, plan): (i64, String) = (r.try_get(0)?, r.try_get(1)?);
                return Err(TableError::NotFound(format!(
                    "line {line}: plan {plan:?} does not exist; create it with `tollgate plans create {plan}`; \
                     nothing was imported"
                )));
            }
            sqlx::query(sqlx::AssertSqlSafe(upsert)).execute(&mut *tx).await?;
            sqlx::query("DROP TABLE tollgate_import").execute(&mut *tx).await?;
            tx.commit().await?;
            Ok(())
        })
    }

    /// Runs SQL (one or more statements): for tests and tools that edit the
    /// table the way an operator would, with plain SQL.
    pub async fn execute_sql(&self, sql: &str) -> Result<u64, TableError> {
        let sql = sqlx::AssertSqlSafe(sql.to_owned());
        Ok(with_pool!(self, pool => sqlx::raw_sql(sql).execute(pool).await?.rows_affected()))
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
        with_pool!(self, pool => pool.close().await)
    }
}

fn missing_plan(plan: &str) -> TableError {
    TableError::NotFound(format!(
        "plan {:?} does not exist; create it with `tollgate plans create {}` (`tollgate plans list` shows the plans)",
        super::short(plan),
        super::short(plan)
    ))
}

fn insert_binds(row: &StoredRow) -> Vec<Bind<'_>> {
    vec![
        Bind::Text(&row.name),
        Bind::Text(&row.tenant),
        Bind::Text(&row.plan),
        Bind::Text(&row.resource),
        Bind::Text(&row.scope),
        Bind::Int(row.burst),
        Bind::Int(row.rate),
        Bind::Text(&row.rate_unit),
        Bind::Text(&row.mode),
        Bind::Text(&row.on_store_unavailable),
        Bind::Int(row.debt),
        Bind::Text(&row.kind),
        Bind::Text(&row.alerts),
    ]
}

fn clash_binds(row: &StoredRow) -> Vec<Bind<'_>> {
    vec![
        Bind::Text(&row.name),
        Bind::Text(&row.tenant),
        Bind::Text(&row.plan),
        Bind::Text(&row.resource),
        Bind::Text(&row.scope),
        Bind::Text(&row.mode),
        Bind::Text(&row.kind),
    ]
}

fn to_row<R: Row>(r: &R) -> Result<StoredRow, sqlx::Error>
where
    usize: sqlx::ColumnIndex<R>,
    for<'d> String: sqlx::Decode<'d, R::Database> + sqlx::Type<R::Database>,
    for<'d> i64: sqlx::Decode<'d, R::Database> + sqlx::Type<R::Database>,
{
    // By position: every SELECT of rows lists COLUMNS, then updated_at.
    Ok(StoredRow {
        id: r.try_get(0)?,
        name: r.try_get(1)?,
        tenant: r.try_get(2)?,
        plan: r.try_get(3)?,
        resource: r.try_get(4)?,
        scope: r.try_get(5)?,
        burst: r.try_get(6)?,
        rate: r.try_get(7)?,
        rate_unit: r.try_get(8)?,
        mode: r.try_get(9)?,
        on_store_unavailable: r.try_get(10)?,
        debt: r.try_get(11)?,
        kind: r.try_get(12)?,
        alerts: r.try_get(13)?,
        updated_at: r.try_get(14)?,
    })
}

/// The file of a SQLite location (a path, or a `sqlite:` URL naming a
/// file); `None` for PostgreSQL and in-memory databases.
fn sqlite_file(location: &str) -> Option<&str> {
    if location.contains(":memory:") || location.contains("mode=memory") {
        return None;
    }
    let path = match location.strip_prefix("sqlite:") {
        Some(url) => url
            .trim_start_matches("//")
            .split('?')
            .next()
            .unwrap_or_default(),
        None if location.contains("://") => return None,
        None => location,
    };
    (!path.is_empty()).then_some(path)
}

/// Rows per chunk: ids `[k * CHUNK_ROWS, (k + 1) * CHUNK_ROWS)` are read
/// as one value.
const CHUNK_ROWS: i64 = 1024;

/// Feeds the rows of one chunk written by [`LimitsTable::chunked`] to
/// `sink`. A number column holding text (SQLite lets it) becomes a row
/// that validation rejects, naming the value. A chunk that does not
/// parse is an error: the read fails and the rules in force stay.
fn chunk_rows(chunk: Option<&str>, sink: &mut (dyn ChangeSink + Send)) -> Result<(), TableError> {
    let mut rest = chunk.unwrap_or_default();
    while !rest.is_empty() {
        let mut next = || field(&mut rest);
        let id = next()?;
        let mut row = StoredRow {
            id: id
                .parse()
                .map_err(|_| TableError::Chunk(super::short(id)))?,
            name: next()?.to_owned(),
            tenant: next()?.to_owned(),
            plan: next()?.to_owned(),
            resource: next()?.to_owned(),
            scope: next()?.to_owned(),
            burst: 0,
            rate: 0,
            rate_unit: String::new(),
            mode: String::new(),
            on_store_unavailable: String::new(),
            debt: 0,
            kind: String::new(),
            alerts: String::new(),
            updated_at: String::new(),
        };
        let mut bad = None;
        let mut number = |what: &'static str, value: &str| -> i64 {
            value.parse().unwrap_or_else(|_| {
                bad.get_or_insert((what, super::short(value).to_owned()));
                0
            })
        };
        row.burst = number("burst", next()?);
        row.rate = number("rate", next()?);
        row.rate_unit = next()?.to_owned();
        row.mode = next()?.to_owned();
        row.on_store_unavailable = next()?.to_owned();
        row.debt = number("debt", next()?);
        row.kind = next()?.to_owned();
        row.alerts = next()?.to_owned();
        if let Some((what, value)) = bad {
            row.scope = format!("(the {what} column holds {value:?}, not a whole number)");
        }
        sink.row(row);
    }
    Ok(())
}

/// The next length-prefixed value of `rest`, which moves past it.
fn field<'a>(rest: &mut &'a str) -> Result<&'a str, TableError> {
    let text: &'a str = rest;
    let bad = || TableError::Chunk(super::short(text));
    let (len, tail) = text.split_once(',').ok_or_else(bad)?;
    let len: usize = len.parse().map_err(|_| bad())?;
    let value = tail.get(..len).ok_or_else(bad)?;
    *rest = &tail[len..];
    Ok(value)
}

type Clash = (String, String, String, String);

fn clash_of<R: Row>(r: &R) -> Result<Clash, sqlx::Error>
where
    usize: sqlx::ColumnIndex<R>,
    for<'d> String: sqlx::Decode<'d, R::Database> + sqlx::Type<R::Database>,
{
    Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?, r.try_get(3)?))
}

mod alerts;
mod periods;
pub use alerts::{AlertCounts, AlertRow, AlertWrite, alert_id};
pub use periods::{PeriodFilter, PeriodRow, PeriodWrite};

/// Applies [`SCHEMA_POSTGRES`] unless the database already holds this
/// script (its digest in `limits_schema`), one instance at a time, and
/// seeds the default rule into a new table. A current schema takes no lock
/// on the limits tables, so instances starting while others read them
/// never wait for or deadlock with those reads.
async fn migrate_postgres(pool: &PgPool) -> Result<(), sqlx::Error> {
    let digest = schema_digest(SCHEMA_POSTGRES);
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(7305521)")
        .execute(&mut *tx)
        .await?;
    let exists: bool = sqlx::query("SELECT to_regclass('limits') IS NOT NULL")
        .fetch_one(&mut *tx)
        .await?
        .try_get(0)?;
    let applied: Option<String> = if exists {
        sqlx::query_scalar(
            "SELECT (SELECT digest FROM limits_schema WHERE id = 1) \
             WHERE to_regclass('limits_schema') IS NOT NULL",
        )
        .fetch_optional(&mut *tx)
        .await?
        .flatten()
    } else {
        None
    };
    if applied.as_deref() != Some(digest.as_str()) {
        sqlx::raw_sql(SCHEMA_POSTGRES).execute(&mut *tx).await?;
        sqlx::query(
            "INSERT INTO limits_schema (id, digest) VALUES (1, $1) \
             ON CONFLICT (id) DO UPDATE SET digest = EXCLUDED.digest",
        )
        .bind(&digest)
        .execute(&mut *tx)
        .await?;
    }
    if !exists {
        let row = default_row().stored();
        bound!(
            sqlx::query(sqlx::AssertSqlSafe(numbered(INSERT))),
            &insert_binds(&row)
        )
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await
}

/// A digest of the schema script (64-bit FNV-1a, in hex): another script
/// gives another digest, and the same one the same in every build.
fn schema_digest(script: &str) -> String {
    let hash = script.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{hash:016x}")
}

/// Whether PostgreSQL aborted the statement to break a deadlock.
fn is_deadlock(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|code| code == "40P01")
}
