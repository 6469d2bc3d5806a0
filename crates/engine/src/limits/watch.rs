//! The rules in force, kept current while the server runs.
//!
//! [`LiveLimits`] holds the rules in force ([`RuleSet`]) behind an atomic
//! pointer, so the hot path reads them without locks. [`watch`] catches up
//! with the table: SQLite by reading its one-row version every interval
//! (one indexed read when nothing changed), PostgreSQL at once on each
//! change notification (and every [`PG_SAFETY_POLL`] in case one was
//! missed). Catching up reads only the owners (tenants, plans, the
//! defaults) that changed after the version in force, in one snapshot, and
//! swaps in the next rules at once. A row that fails validation is
//! rejected alone: logged once, counted, listed on the admin port, and its
//! last valid version (if any) stays in force.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use serde::Serialize;

use sqlx::postgres::{PgListener, PgNotification};

use super::rules::{Loader, Update};
use super::table::{CHANGE_LOG_RETENTION, ChangeSink, LimitsTable, TableError, TenantRow};
use super::{Owner, RuleSet, StoredRow};
use crate::telemetry::metrics;

/// How often a PostgreSQL instance that listens for notifications still
/// reads the version, in case a notification was lost.
pub const PG_SAFETY_POLL: Duration = Duration::from_secs(30);

/// How often the change log is pruned.
const PRUNE_EVERY: Duration = Duration::from_secs(60);

/// How many rejected rows the status lists (all are counted).
const LISTED_REJECTED: usize = 50;

/// Why the rules could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The table could not be read.
    #[error(transparent)]
    Table(#[from] TableError),
    /// The table holds more rows than this instance keeps in memory.
    #[error(
        "the limits and tenants tables hold {rows} rows; this instance keeps at most {max} in memory \
         (raise --max-limit-rows, or move tenants onto plans: a tenant on a plan needs no rows)"
    )]
    TooLarge {
        /// Rows in the table.
        rows: u64,
        /// The bound.
        max: usize,
    },
}

/// What the admin port reports about the limits.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReloadStatus {
    /// Rules in force.
    pub rules: usize,
    /// Tenants with rules of their own or a plan.
    pub tenants: usize,
    /// The most rules kept in force (`--max-limit-rows`).
    pub max_rules: usize,
    /// Batches of changes applied (the first load included).
    pub generation: u64,
    /// The table's version the rules in force reflect.
    pub version: i64,
    /// Rows rejected by validation and not fixed since.
    pub rejected_rows: usize,
    /// The first of them (by id), each naming the row and what to fix.
    pub rejected: Vec<String>,
    /// Plans tenants are assigned to that do not exist, with the number of
    /// tenants on each (they get the default rows).
    pub missing_plans: Vec<MissingPlan>,
    /// Why the latest read of the table failed, if it did; cleared by the
    /// next success.
    pub last_error: Option<String>,
}

/// A plan that tenants are on but that does not exist.
#[derive(Debug, Clone, Serialize)]
pub struct MissingPlan {
    /// The plan's name.
    pub plan: String,
    /// Tenants assigned to it.
    pub tenants: u64,
}

struct Catchup {
    loader: Loader,
    version: i64,
    /// Snapshots replaced while decisions may still hold them. Freeing a
    /// snapshot of a million tenants takes milliseconds; they are freed
    /// here, once no decision holds them, and never by a decision that
    /// happened to let go of the last reference.
    retired: Vec<Arc<RuleSet>>,
}

/// The rules in force.
pub struct LiveLimits {
    current: ArcSwap<RuleSet>,
    catchup: tokio::sync::Mutex<Catchup>,
    status: Mutex<ReloadStatus>,
}

/// Feeds a table read into the loader.
struct Sink<'a> {
    loader: Option<&'a mut Loader>,
    base: &'a RuleSet,
    update: Option<Update<'a>>,
}

impl ChangeSink for Sink<'_> {
    fn begin(&mut self, full: bool, owners: Vec<Owner>) {
        if let Some(loader) = self.loader.take() {
            self.update = Some(loader.begin(self.base, full, owners));
        }
    }
    fn plan(&mut self, name: &str) {
        if let Some(u) = &mut self.update {
            u.plan(name);
        }
    }
    fn row(&mut self, row: StoredRow) {
        if let Some(u) = &mut self.update {
            u.row(row);
        }
    }
    fn tenant(&mut self, row: TenantRow<'_>) {
        if let Some(u) = &mut self.update {
            u.tenant(row);
        }
    }
}

impl LiveLimits {
    /// Loads the table, keeping at most `max_rules` rules in memory; a
    /// table with more rows than that is an error at start-up.
    pub async fn load(table: &LimitsTable, max_rules: usize) -> Result<Self, LoadError> {
        let rows = table.count().await?;
        if rows > max_rules as u64 {
            return Err(LoadError::TooLarge {
                rows,
                max: max_rules,
            });
        }
        let live = Self::empty(max_rules);
        live.catch_up(table).await?;
        Ok(live)
    }

    fn empty(max_rules: usize) -> Self {
        Self {
            current: ArcSwap::from_pointee(RuleSet::default()),
            catchup: tokio::sync::Mutex::new(Catchup {
                loader: Loader::new(max_rules),
                version: 0,
                retired: Vec::new(),
            }),
            status: Mutex::new(ReloadStatus {
                max_rules,
                ..ReloadStatus::default()
            }),
        }
    }

    /// Rules from rows given directly (no table): for tests and embedding.
    /// Invalid rows are left out and listed in the status.
    pub fn from_rows(rows: Vec<StoredRow>) -> Self {
        let (set, rejected) = RuleSet::from_rows(&rows);
        let live = Self::empty(usize::MAX);
        {
            let mut status = live.status.lock();
            status.rules = set.len();
            status.tenants = set.tenants();
            status.generation = 1;
            status.rejected_rows = rejected.len();
            status.rejected = rejected.iter().map(ToString::to_string).collect();
        }
        live.current.store(Arc::new(set));
        live
    }

    /// The rules in force now.
    pub fn snapshot(&self) -> Arc<RuleSet> {
        self.current.load_full()
    }

    /// The reload status.
    pub fn status(&self) -> ReloadStatus {
        self.status.lock().clone()
    }

    /// Frees the replaced snapshots no decision holds any more.
    pub async fn release_retired(&self) {
        self.catchup
            .lock()
            .await
            .retired
            .retain(|old| Arc::strong_count(old) > 1);
    }

    /// Reads what changed in the table since the rules in force and applies
    /// it. Returns whether the rules changed. On error the rules in force
    /// are untouched (and the next call reads from the same version).
    pub async fn catch_up(&self, table: &LimitsTable) -> Result<bool, LoadError> {
        self.catch_up_at_most(table, u64::MAX).await
    }

    /// [`LiveLimits::catch_up`] when at most `most` changes wait; when more
    /// do, reads nothing and answers [`TableError::TooManyChanges`].
    async fn catch_up_at_most(&self, table: &LimitsTable, most: u64) -> Result<bool, LoadError> {
        let mut guard = self.catchup.lock().await;
        let Catchup {
            loader,
            version,
            retired,
        } = &mut *guard;
        retired.retain(|old| Arc::strong_count(old) > 1);
        let base = self.current.load_full();
        let started = Instant::now();
        let mut sink = Sink {
            loader: Some(loader),
            base: &base,
            update: None,
        };
        let read = table
            .read_changes(*version, base.len(), most, &mut sink)
            .await;
        let update = sink.update.take();
        let read = match read {
            Ok(read) => read,
            Err(err @ TableError::TooManyChanges(_)) => return Err(err.into()),
            Err(err) => {
                metrics::limits_reload(false, base.len(), self.status.lock().rejected_rows);
                self.status.lock().last_error = Some(err.to_string());
                return Err(err.into());
            }
        };
        let Some(next_version) = read else {
            self.status.lock().last_error = None;
            return Ok(false);
        };
        let Some(update) = update else {
            // The version moved but nothing was logged (a statement that
            // changed no row).
            *version = next_version;
            return Ok(false);
        };
        let (set, applied) = update.finish();
        let (rules, tenants) = (set.len(), set.tenants());
        self.current.store(Arc::new(set));
        // `base` still holds the snapshot replaced: freed by a later
        // catch-up once no decision holds it.
        retired.push(base.clone());
        *version = next_version;
        let current = self.current.load();
        let (rejected, rejected_rows) = loader.rejected(LISTED_REJECTED);
        let missing_plans = loader
            .missing_plans(&current)
            .into_iter()
            .map(|(plan, tenants)| MissingPlan { plan, tenants })
            .collect();
        for err in &applied.newly_rejected {
            tracing::error!(error = %err, "limits row rejected; its last valid version (if any) stays in force");
        }
        metrics::limits_reload(applied.newly_rejected.is_empty(), rules, rejected_rows);
        let generation = {
            let mut status = self.status.lock();
            status.rules = rules;
            status.tenants = tenants;
            status.generation += 1;
            status.version = next_version;
            status.rejected_rows = rejected_rows;
            status.rejected = rejected;
            status.missing_plans = missing_plans;
            status.last_error = None;
            status.generation
        };
        tracing::info!(
            rules,
            tenants,
            generation,
            version = next_version,
            whole_table = applied.full,
            elapsed_ms = started.elapsed().as_millis() as u64,
            thread = std::thread::current().name().unwrap_or_default(),
            "limits applied"
        );
        Ok(true)
    }
}

/// The scheduling priority (nice value) of the bulk thread where the idle
/// policy cannot be had (see [`lower_priority`]).
const BULK_NICE: i32 = 19;

/// Changes one catch-up reads on the watcher's thread; a catch-up of more
/// (a bulk edit, or the whole table again) runs on the bulk thread, in the
/// idle scheduling class.
pub const BULK_CHANGES: u64 = 1000;

/// Runs [`watch`] on a thread of its own at the process's priority, so that
/// an edit of a few rows is applied within a second however busy the
/// decision threads are; and catch-ups of more than [`BULK_CHANGES`]
/// changes on a second thread in the idle scheduling class,
/// where reading and applying a 100 000-row edit (about a second of CPU)
/// never takes a core from a decision. Each thread has connections of its
/// own to the table, made on it, so that their worker threads share its
/// priority. The receiver completes when the watcher has stopped.
pub fn spawn_watch(
    limits: Arc<LiveLimits>,
    table: LimitsTable,
    every: Duration,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<tokio::sync::oneshot::Receiver<()>> {
    let (done, stopped) = tokio::sync::oneshot::channel();
    let bulk = Bulk::spawn(limits.clone(), table.clone())?;
    on_own_thread("limits-watch", || {}, async move {
        let table = own_connections(table).await;
        watch_with(limits, table, Some(bulk), every, shutdown).await;
        let _ = done.send(());
    })?;
    Ok(stopped)
}

/// Runs `task` to completion on a new thread named `name` with a runtime of
/// its own, after `setup` (run first on that thread).
fn on_own_thread(
    name: &str,
    setup: impl FnOnce() + Send + 'static,
    task: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            setup();
            runtime.block_on(task);
        })?;
    Ok(())
}

/// A handle on `table` with connections made on the calling thread, or
/// `table` itself when none can be made.
async fn own_connections(table: LimitsTable) -> LimitsTable {
    match table.reopen().await {
        Ok(own) => own,
        Err(err) => {
            tracing::warn!(error = %err, "limits watcher shares the server's connections");
            table
        }
    }
}

/// What the bulk thread answers for one catch-up.
type BulkAnswer = tokio::sync::oneshot::Sender<Result<bool, LoadError>>;

/// The bulk thread: catches up on request, on a thread in Linux's idle
/// scheduling class ([`lower_priority`]). It stops once every handle is
/// dropped.
#[derive(Clone)]
struct Bulk {
    requests: tokio::sync::mpsc::UnboundedSender<BulkAnswer>,
}

impl Bulk {
    fn spawn(limits: Arc<LiveLimits>, table: LimitsTable) -> std::io::Result<Self> {
        let (requests, mut asked) = tokio::sync::mpsc::unbounded_channel::<BulkAnswer>();
        on_own_thread("limits-bulk", lower_priority, async move {
            let table = own_connections(table).await;
            while let Some(answer) = asked.recv().await {
                let _ = answer.send(limits.catch_up(&table).await);
            }
        })?;
        Ok(Self { requests })
    }

    /// Catches up on the bulk thread; `None` when it is gone.
    async fn catch_up(&self) -> Option<Result<bool, LoadError>> {
        let (answer, answered) = tokio::sync::oneshot::channel();
        self.requests.send(answer).ok()?;
        answered.await.ok()
    }
}

/// Puts the calling thread (and the threads it starts) in Linux's idle
/// scheduling class, `SCHED_IDLE`: it runs only on a core no other thread
/// wants, and a decision thread waking up takes the core from it at once
/// (a thread at nice 19 keeps a small share and may finish its slice
/// first). So when the cores are busy, decisions go first and a bulk
/// edit's catch-up takes the CPU they leave. Where the class cannot be had,
/// nice [`BULK_NICE`].
fn lower_priority() {
    #[cfg(target_os = "linux")]
    {
        use thread_priority::{
            NormalThreadSchedulePolicy, ThreadPriority, ThreadSchedulePolicy,
            set_thread_priority_and_policy, thread_native_id,
        };
        let idle = ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Idle);
        if set_thread_priority_and_policy(thread_native_id(), ThreadPriority::Min, idle).is_ok() {
            return;
        }
        if let Err(err) =
            rustix::process::setpriority_process(Some(rustix::thread::gettid()), BULK_NICE)
        {
            tracing::debug!(error = %err, "cannot lower the limits bulk thread's priority");
        }
    }
}

/// Keeps `limits` current with `table` until `shutdown` completes: on
/// SQLite by reading the version every `every`; on PostgreSQL on every
/// change notification, and every [`PG_SAFETY_POLL`]. A lost database
/// connection keeps the rules in force; the listener reconnects, and every
/// time it starts listening the instance catches up from the version it
/// holds, so no edit made while it was not listening is missed.
pub async fn watch(
    limits: Arc<LiveLimits>,
    table: LimitsTable,
    every: Duration,
    shutdown: impl Future<Output = ()>,
) {
    watch_with(limits, table, None, every, shutdown).await;
}

/// [`watch`], with bulk catch-ups on `bulk` when given.
async fn watch_with(
    limits: Arc<LiveLimits>,
    table: LimitsTable,
    bulk: Option<Bulk>,
    every: Duration,
    shutdown: impl Future<Output = ()>,
) {
    let poll = if table.is_postgres() {
        PG_SAFETY_POLL
    } else {
        every
    };
    let mut tick = tokio::time::interval(poll);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut tidy = tokio::time::interval(every);
    tidy.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut prune = tokio::time::interval(PRUNE_EVERY);
    prune.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    let mut listener: Option<PgListener> = None;
    loop {
        if listener.is_none() && table.is_postgres() {
            match table.listener().await {
                Ok(l) => {
                    listener = l;
                    // Edits made while nobody listened sent their NOTIFY
                    // into the void: catch up now that we listen.
                    catch_up(&limits, &table, bulk.as_ref()).await;
                }
                Err(err) => {
                    tracing::warn!(error = %err, "cannot listen for limits changes; polling meanwhile")
                }
            }
        }
        tokio::select! {
            _ = &mut shutdown => return,
            _ = tick.tick() => {}
            _ = tidy.tick(), if table.is_postgres() => {
                limits.release_retired().await;
                continue;
            }
            _ = prune.tick() => {
                match table.prune_changes(CHANGE_LOG_RETENTION).await {
                    Ok(0) => {}
                    Ok(n) => tracing::debug!(entries = n, "limits change log pruned"),
                    Err(err) => tracing::debug!(error = %err, "cannot prune the limits change log"),
                }
                continue;
            }
            // Without a listener, retry (and poll) every second.
            _ = tokio::time::sleep(Duration::from_secs(1)), if listener.is_none() && table.is_postgres() => {}
            note = next_change(&mut listener) => match note {
                Ok(Some(note)) => {
                    // Already applied (another notification's catch-up read it).
                    let held = limits.status.lock().version;
                    if note.payload().parse::<i64>().is_ok_and(|v| v <= held) {
                        continue;
                    }
                }
                // The connection dropped. Listen again on a fresh connection
                // (and catch up once listening) rather than let the
                // listener reconnect by itself on the next receive: an edit
                // made between its reconnection and no catch-up would wait
                // for the safety poll.
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
        catch_up(&limits, &table, bulk.as_ref()).await;
    }
}

/// Catches up, keeping the rules in force when the table cannot be read:
/// on the bulk thread when more than [`BULK_CHANGES`] changes wait (as the
/// snapshot read here counts them, so an edit committed while deciding
/// cannot slip onto this thread).
async fn catch_up(limits: &LiveLimits, table: &LimitsTable, bulk: Option<&Bulk>) {
    let result = match bulk {
        Some(bulk) => match limits.catch_up_at_most(table, BULK_CHANGES).await {
            Err(LoadError::Table(TableError::TooManyChanges(_))) => match bulk.catch_up().await {
                Some(result) => result,
                None => limits.catch_up(table).await,
            },
            result => result,
        },
        None => limits.catch_up(table).await,
    };
    if let Err(err) = result {
        tracing::warn!(error = %err, "cannot read the limits table; the rules in force stay");
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
