//! The usage ledger: every quota period, recorded in the limits database
//! (`usage_periods`) with its final count once it is over, exactly once
//! across instances, surviving instances killed and a database down.
//!
//! Two sources, both written by the store in the step that changed the
//! counter, and both read again until their write to the database commits:
//!
//! - **The journal** ([`crate::store::journal`]): a decision that moves a
//!   quota counter into a new period appends an event naming the new
//!   period and the final count of the one it left; one whose count
//!   reaches an alert threshold appends a crossing. The ledger writes
//!   events to the table (crossings to the `quota_alerts` outbox, from
//!   which `src/alerts.rs` delivers them), then trims them from the
//!   journal: an instance killed in between leaves them for the next drain
//!   (its own after a restart, or another instance's sweep of every
//!   journal).
//! - **The counters themselves**: a period that ended with no decision
//!   after it still holds its final count in its counter, which outlives
//!   its period by one more period's length. Every [`LedgerOptions::close_every`]
//!   the ledger reads the counters of open periods that ended more than
//!   [`LedgerOptions::grace`] ago and closes them at what they hold.
//!
//! A period's final count is written only while the period is open (an
//! upsert or update guarded by `closed_at IS NULL`), so instances racing
//! over the same period, and retries of a write that did commit, record it
//! once; every source yields the same figure, because a counter counts in
//! one period at a time and a newer period never goes back.

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::algorithm::Micros;
use crate::clock::Clock;
use crate::limits::table::{AlertWrite, LimitsTable, PeriodRow, PeriodWrite, TableError};
use crate::limits::watch::LiveLimits;
use crate::limits::{Kind, Scope};
use crate::store::journal::{Entry, Journal};
use crate::store::{BucketKey, BucketKind, StoreError};
use crate::telemetry::metrics;

/// How the ledger paces itself.
#[derive(Debug, Clone)]
pub struct LedgerOptions {
    /// How long after a period's end its counter is read: decisions of
    /// instances whose clocks run behind may still count in it until then.
    pub grace: Duration,
    /// How often periods past their end and grace are closed.
    pub close_every: Duration,
    /// How often every journal in the store is looked for (on Redis a
    /// `SCAN` of the keyspace), for events an instance left when it died.
    pub sweep_every: Duration,
    /// Most journal entries, or periods, handled per database transaction.
    pub batch: usize,
}

impl Default for LedgerOptions {
    fn default() -> Self {
        Self {
            grace: Duration::from_secs(15),
            close_every: Duration::from_secs(10),
            sweep_every: Duration::from_secs(600),
            batch: 500,
        }
    }
}

/// A ledger step that failed; the ledger retries it.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// The store did not answer.
    #[error("usage ledger: {0}")]
    Store(#[from] StoreError),
    /// The limits database did not.
    #[error("usage ledger: {0}")]
    Table(#[from] TableError),
}

/// What one [`Ledger::close_due`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Closing {
    /// Periods closed at the count their counter held.
    pub closed: u64,
    /// Periods closed without a count: their counter was gone.
    pub lost: u64,
    /// Periods whose counter moved on: their final count waits in a
    /// journal.
    pub waiting: u64,
}

/// The usage ledger of one instance.
pub struct Ledger {
    table: LimitsTable,
    journal: Arc<dyn Journal>,
    limits: Arc<LiveLimits>,
    clock: Arc<dyn Clock>,
    options: LedgerOptions,
    /// Journals whose last drain failed.
    retry: Mutex<HashSet<String>>,
}

impl Ledger {
    /// A ledger recording `journal`'s counters in `table`; `limits` names
    /// the rules that count there.
    pub fn new(
        table: LimitsTable,
        journal: Arc<dyn Journal>,
        limits: Arc<LiveLimits>,
        clock: Arc<dyn Clock>,
        options: LedgerOptions,
    ) -> Self {
        Self {
            table,
            journal,
            limits,
            clock,
            options,
            retry: Mutex::default(),
        }
    }

    /// The table it writes.
    pub fn table(&self) -> &LimitsTable {
        &self.table
    }

    /// Writes every event waiting in the journals decisions reported (with
    /// `sweep`, in every journal of the store) to the table, trimming each
    /// journal only after its events are committed. Returns how many
    /// events were written.
    pub async fn drain(&self, sweep: bool) -> Result<u64, LedgerError> {
        let mut journals: HashSet<String> = std::mem::take(&mut *self.retry.lock());
        let listed = self.journal.pending(sweep).await;
        let listed = match listed {
            Ok(listed) => listed,
            Err(e) => {
                self.retry.lock().extend(journals);
                return Err(e.into());
            }
        };
        journals.extend(listed);
        let (mut written, mut failed) = (0, None);
        for journal in journals {
            match self.drain_one(&journal).await {
                Ok(n) => written += n,
                Err(e) => {
                    self.retry.lock().insert(journal);
                    failed = Some(e);
                }
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(written),
        }
    }

    async fn drain_one(&self, journal: &str) -> Result<u64, LedgerError> {
        let mut written = 0;
        loop {
            let entries = self.journal.read(journal, self.options.batch).await?;
            let n = entries.len();
            let entries: Vec<Entry> = entries.into_iter().flatten().collect();
            if entries.len() < n {
                tracing::warn!(
                    journal,
                    unreadable = n - entries.len(),
                    "quota journal entries this build cannot read were dropped"
                );
            }
            self.record(&entries).await?;
            self.journal.trim(journal, n).await?;
            written += entries.len() as u64;
            if n < self.options.batch {
                return Ok(written);
            }
        }
    }

    /// Writes `entries`: each opening opens its period and closes the one
    /// it left; each crossing goes to the alert outbox.
    async fn record(&self, entries: &[Entry]) -> Result<(), LedgerError> {
        if entries.is_empty() {
            return Ok(());
        }
        let rules = self.limits.snapshot();
        let names: Vec<String> = entries
            .iter()
            .map(|e| match e {
                Entry::Opened(e) => rule_name(&rules, &e.bucket),
                Entry::Crossed(c) => rule_name(&rules, &c.bucket),
            })
            .collect();
        let mut periods = Vec::new();
        let mut alerts = Vec::new();
        let now = self.clock.now();
        for (entry, rule) in entries.iter().zip(&names) {
            match entry {
                Entry::Opened(event) => {
                    let base = PeriodWrite {
                        rule,
                        start: event.start,
                        end: event.end,
                        quota: event.quota,
                        used: None,
                        ..describe(&event.bucket)
                    };
                    if let Some(closed) = event.previous {
                        periods.push(PeriodWrite {
                            start: closed.start,
                            end: closed.end,
                            used: Some(closed.count),
                            ..base.clone()
                        });
                    }
                    periods.push(base);
                }
                Entry::Crossed(c) => {
                    let d = describe(&c.bucket);
                    alerts.push(AlertWrite {
                        counter: d.counter,
                        tenant: d.tenant,
                        scope: d.scope,
                        resource: d.resource,
                        key: d.key,
                        rule,
                        start: c.start,
                        end: c.end,
                        threshold: c.percent,
                        used: c.used,
                        quota: c.quota,
                        detected_at: now,
                    });
                }
            }
        }
        if !periods.is_empty() {
            let closed = self.table.write_periods(&periods).await?;
            let opened = entries
                .iter()
                .filter(|e| matches!(e, Entry::Opened(_)))
                .count();
            metrics::usage_periods("opened", opened as u64);
            metrics::usage_periods("closed", closed);
        }
        if !alerts.is_empty() {
            let recorded = self.table.record_alerts(&alerts).await?;
            for (alert, new) in alerts.iter().zip(recorded) {
                if new {
                    metrics::quota_alert(alert.threshold, "detected");
                    tracing::info!(
                        tenant = alert.tenant,
                        key = alert.key,
                        resource = alert.resource,
                        rule = alert.rule,
                        threshold = alert.threshold,
                        used = alert.used,
                        limit = alert.quota,
                        "quota alert: {} % of the quota reached",
                        alert.threshold
                    );
                }
            }
        }
        Ok(())
    }

    /// Closes every open period that ended more than the grace ago, at
    /// the count its counter holds.
    pub async fn close_due(&self) -> Result<Closing, LedgerError> {
        let now = self.clock.now();
        let before = now.saturating_sub(self.options.grace.as_micros() as Micros);
        let mut done = Closing::default();
        let mut after: Option<(Micros, String)> = None;
        loop {
            let due = self
                .table
                .due_periods(
                    before,
                    after.as_ref().map(|(e, c)| (*e, c.as_str())),
                    self.options.batch,
                )
                .await?;
            for period in &due {
                self.close_one(period, now, &mut done).await?;
            }
            match due.last() {
                Some(last) if due.len() == self.options.batch => {
                    after = Some((last.end, last.counter.clone()))
                }
                _ => break,
            }
        }
        metrics::usage_periods("closed", done.closed);
        metrics::usage_periods("lost", done.lost);
        Ok(done)
    }

    async fn close_one(
        &self,
        period: &PeriodRow,
        now: Micros,
        done: &mut Closing,
    ) -> Result<(), LedgerError> {
        let Some(bucket) = BucketKey::parse(&period.counter) else {
            // Not a counter this build names: closed without a count.
            done.lost += u64::from(
                self.table
                    .close_period(&period.counter, period.start, None)
                    .await?,
            );
            return Ok(());
        };
        let used = match self.journal.count(&bucket).await? {
            Some(c) if c.start == period.start => Some(c.count),
            // Moved on: the decision that moved it journaled this
            // period's final count, which a drain writes.
            Some(c) if c.start > period.start && !past_keeping(period, now) => {
                done.waiting += 1;
                return Ok(());
            }
            _ => None,
        };
        let closed = self
            .table
            .close_period(&period.counter, period.start, used)
            .await?;
        match (closed, used) {
            (true, Some(_)) => done.closed += 1,
            (true, None) => {
                tracing::warn!(
                    counter = period.counter,
                    period_start = period.start,
                    "a quota period was closed without its final count: its counter is gone \
                     from the store"
                );
                done.lost += 1;
            }
            (false, _) => {}
        }
        Ok(())
    }

    /// The row of one counter's period, if recorded.
    pub async fn period(
        &self,
        bucket: &BucketKey,
        start: Micros,
    ) -> Result<Option<PeriodRow>, TableError> {
        self.table.period(bucket.as_str(), start).await
    }

    /// Runs the ledger until `stop`: drains journals as decisions report
    /// events (and every second those whose drain failed), sweeps every
    /// journal at start and every [`LedgerOptions::sweep_every`], closes
    /// due periods every [`LedgerOptions::close_every`]. Failures are
    /// logged, counted and retried.
    pub fn spawn(
        self: Arc<Self>,
        stop: impl Future<Output = ()> + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            tokio::pin!(stop);
            let start = tokio::time::Instant::now();
            let mut next_sweep = start;
            let mut next_close = start + self.options.close_every;
            loop {
                let now = tokio::time::Instant::now();
                let sweep = now >= next_sweep;
                if let Err(e) = self.drain(sweep).await {
                    metrics::ledger_error("journal");
                    tracing::warn!(error = %e, "quota journal not recorded yet; retrying");
                } else if sweep {
                    next_sweep = now + self.options.sweep_every;
                }
                if now >= next_close {
                    match self.close_due().await {
                        Ok(_) => next_close = now + self.options.close_every,
                        Err(e) => {
                            metrics::ledger_error("close");
                            tracing::warn!(error = %e, "quota periods not closed yet; retrying");
                        }
                    }
                }
                tokio::select! {
                    () = &mut stop => return,
                    () = self.journal.notified() => {}
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        })
    }
}

/// True once a period's counter has expired from any store: one more
/// period's length after its end.
fn past_keeping(period: &PeriodRow, now: Micros) -> bool {
    now >= period.end + (period.end - period.start)
}

/// The tenant, scope, resource, key and shadow of a counter.
fn describe(bucket: &BucketKey) -> PeriodWrite<'_> {
    let (scope, shadow) = match bucket.kind() {
        BucketKind::Quota { per_key, shadow } => (
            if per_key { Scope::Key } else { Scope::Tenant }.as_str(),
            shadow,
        ),
        // An Envoy descriptor's counter: its tenant is the domain.
        _ => ("descriptor", false),
    };
    PeriodWrite {
        counter: bucket.as_str(),
        tenant: bucket.tenant(),
        scope,
        resource: bucket.resource(),
        key: bucket.key(),
        shadow,
        rule: "",
        start: 0,
        end: 0,
        quota: 0,
        used: None,
    }
}

/// The quota row that counts in `bucket` under `rules` ('' if none does
/// now).
fn rule_name(rules: &crate::limits::rules::RuleSet, bucket: &BucketKey) -> String {
    rules
        .applicable(bucket.tenant(), bucket.resource())
        .find(|r| {
            r.kind == Kind::Quota
                && r.bucket_kind() == bucket.kind()
                && *r.resource == *bucket.resource()
        })
        .map(|r| r.name.to_string())
        .unwrap_or_default()
}
