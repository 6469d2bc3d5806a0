//! The limits tables on real databases: an SQLite file in a temporary
//! directory, and a PostgreSQL server started by the test (Debian's
//! `postgresql`). What a table stores, how it logs changes, what it reads
//! back, and how the watcher keeps an instance's rules current with it.
//!
//! The table checks are written once ([`checks`]) and run on both
//! databases: each on its own SQLite file, and all of them in one
//! PostgreSQL test, each on a database of its own.

// The workspace's helpers for real servers, shared by path with the root
// crate's integration tests.
#[allow(dead_code)]
#[path = "../../../tests/common/ports.rs"]
mod ports;
#[allow(dead_code)]
#[path = "../../../tests/common/postgres.rs"]
mod postgres;
#[allow(dead_code)]
#[path = "../../../tests/common/redis.rs"]
mod redis;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use tollgate_engine::algorithm::alerts::Alerts;
use tollgate_engine::algorithm::calendar::Cycle;
use tollgate_engine::algorithm::{Rate, RateUnit};
use tollgate_engine::limits::table::{
    ChangeSink, LimitsTable, PlanRow, RowFilter, TableError, TenantRow, default_row,
};
use tollgate_engine::limits::watch::{BULK_CHANGES, LiveLimits, LoadError, spawn_watch, watch};
use tollgate_engine::limits::{Kind, LimitRow, Mode, OnStoreUnavailable, Owner, Scope, StoredRow};

fn row(name: &str, tenant: &str, resource: &str, burst: u64) -> LimitRow {
    LimitRow {
        name: name.into(),
        tenant: tenant.into(),
        plan: String::new(),
        resource: resource.into(),
        scope: Scope::Key,
        burst,
        rate: Rate {
            count: 60,
            unit: RateUnit::Minute,
        },
        mode: Mode::Enforce,
        on_store_unavailable: OnStoreUnavailable::Allow,
        debt: 0,
        kind: Kind::Rate,
        alerts: Alerts::NONE,
    }
}

fn plan_row(name: &str, plan: &str, burst: u64) -> LimitRow {
    LimitRow {
        plan: plan.into(),
        ..row(name, "", "", burst)
    }
}

/// A row's values as written, without the table's id and timestamp.
fn values(r: &StoredRow) -> StoredRow {
    StoredRow {
        id: 0,
        updated_at: String::new(),
        ..r.clone()
    }
}

fn names(rows: &[StoredRow]) -> Vec<&str> {
    rows.iter().map(|r| r.name.as_str()).collect()
}

/// Everything a read of the change log fed, in order.
#[derive(Debug, Default)]
struct Recorded {
    begins: Vec<(bool, BTreeSet<String>)>,
    plans: Vec<String>,
    rows: Vec<StoredRow>,
    assignments: Vec<(String, String)>,
    cycles: Vec<(String, Result<Cycle, String>)>,
}

impl ChangeSink for Recorded {
    fn begin(&mut self, full: bool, owners: Vec<Owner>) {
        let owners = owners.iter().map(Owner::describe).collect();
        self.begins.push((full, owners));
    }
    fn plan(&mut self, name: &str) {
        self.plans.push(name.into());
    }
    fn row(&mut self, row: StoredRow) {
        self.rows.push(row);
    }
    fn tenant(&mut self, row: TenantRow<'_>) {
        self.assignments.push((row.tenant.into(), row.plan.into()));
        if !row.default_cycle() {
            self.cycles.push((row.tenant.into(), row.cycle()));
        }
    }
}

impl Recorded {
    fn row_names(&self) -> BTreeSet<&str> {
        self.rows.iter().map(|r| r.name.as_str()).collect()
    }
}

async fn read(table: &LimitsTable, since: i64, held: usize) -> (Option<i64>, Recorded) {
    let mut sink = Recorded::default();
    let version = table
        .read_changes(since, held, u64::MAX, &mut sink)
        .await
        .unwrap();
    (version, sink)
}

fn message(err: TableError) -> String {
    err.to_string()
}

/// The checks every database must pass, each on a fresh table.
mod checks {
    use super::*;

    /// A new table holds the default row alone, at version 1.
    pub async fn a_new_table_holds_the_default_row(t: &LimitsTable) {
        let rows = t.rows().await.unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(values(&rows[0]), default_row().stored());
        assert!(rows[0].id > 0);
        // ISO 8601 in UTC, to the millisecond, on both databases.
        let at = &rows[0].updated_at;
        assert_eq!(at.len(), "2026-12-03T04:23:16.123Z".len(), "{at}");
        assert!(at.ends_with('Z') && at.as_bytes()[10] == b'T', "{at}");
        assert_eq!(t.count().await.unwrap(), 1);
        assert_eq!(t.version().await.unwrap(), 1);
        assert_eq!(t.plans().await.unwrap(), Vec::<PlanRow>::new());
    }

    /// Upserts update the row of the same owner, resource, scope, mode and
    /// kind; a name taken by another owner's row, or a plan that does not
    /// exist, is refused naming what to fix; deletes say whether a row went.
    pub async fn upserts_and_deletes(t: &LimitsTable) {
        t.upsert(&row("acme-a", "acme", "", 10)).await.unwrap();
        t.upsert(&row("acme-exports", "acme", "exports", 5))
            .await
            .unwrap();
        // The same slot: updated in place, renamed.
        t.upsert(&row("acme-any", "acme", "", 20)).await.unwrap();
        let rows = t.rows().await.unwrap();
        assert_eq!(
            names(&rows),
            ["default-per-key", "acme-any", "acme-exports"]
        );
        assert_eq!(rows[1].burst, 20);
        assert_eq!(t.count().await.unwrap(), 3);

        let err = t
            .upsert(&row("acme-any", "globex", "", 1))
            .await
            .unwrap_err();
        assert!(matches!(err, TableError::Conflict(_)), "{err:?}");
        assert_eq!(
            message(err),
            "name \"acme-any\" already belongs to the row for tenant \"acme\", resource \"\", \
             scope \"key\"; pick another --name or delete that row first"
        );
        t.create_plan("gold", "").await.unwrap();
        t.upsert(&plan_row("gold-any", "gold", 7)).await.unwrap();
        let err = t
            .upsert(&row("gold-any", "globex", "", 1))
            .await
            .unwrap_err();
        assert!(message(err).contains("the row for plan \"gold\""));

        let err = t.upsert(&plan_row("x", "silver", 1)).await.unwrap_err();
        assert!(matches!(err, TableError::NotFound(_)), "{err:?}");
        assert_eq!(
            message(err),
            "plan \"silver\" does not exist; create it with `tollgate plans create silver` \
             (`tollgate plans list` shows the plans)"
        );

        assert!(t.delete("acme-exports").await.unwrap());
        assert!(!t.delete("acme-exports").await.unwrap());
        assert_eq!(
            names(&t.rows().await.unwrap()),
            ["default-per-key", "acme-any", "gold-any"]
        );
    }

    /// Plans count their rules and tenants; a plan with tenants is deleted
    /// only by force, its rows with it; assignments return the plan before.
    pub async fn plans_and_assignments(t: &LimitsTable) {
        t.create_plan("gold", "the gold tier").await.unwrap();
        t.create_plan("free", "").await.unwrap();
        t.create_plan("free", "the free tier").await.unwrap();
        t.upsert(&plan_row("gold-any", "gold", 100)).await.unwrap();
        t.upsert(&LimitRow {
            resource: "exports".into(),
            ..plan_row("gold-exports", "gold", 10)
        })
        .await
        .unwrap();
        assert_eq!(t.assign("acme", Some("gold")).await.unwrap(), None);
        assert_eq!(t.assign("globex", Some("free")).await.unwrap(), None);
        assert_eq!(
            t.assign("globex", Some("gold")).await.unwrap(),
            Some("free".into())
        );
        let plan = |name: &str, description: &str, rules, tenants| PlanRow {
            name: name.into(),
            description: description.into(),
            rules,
            tenants,
        };
        assert_eq!(
            t.plans().await.unwrap(),
            [
                plan("free", "the free tier", 0, 0),
                plan("gold", "the gold tier", 2, 2)
            ]
        );
        // Rows plus assignments: what an instance holds.
        assert_eq!(t.count().await.unwrap(), 3 + 2);

        let err = t.assign("acme", Some("platinum")).await.unwrap_err();
        assert!(matches!(err, TableError::NotFound(_)), "{err:?}");
        assert!(message(err).starts_with("plan \"platinum\" does not exist"));

        let err = t.delete_plan("gold", false).await.unwrap_err();
        assert!(matches!(err, TableError::Conflict(_)), "{err:?}");
        assert_eq!(
            message(err),
            "2 tenants are on plan \"gold\"; move them first (`tollgate plans assign`) or delete \
             with --force, and they get the default rows"
        );
        assert_eq!(t.plans().await.unwrap().len(), 2, "nothing deleted");
        assert_eq!(t.assign("acme", None).await.unwrap(), Some("gold".into()));
        assert_eq!(t.assign("acme", None).await.unwrap(), None);
        assert!(t.delete_plan("gold", true).await.unwrap());
        assert!(!t.delete_plan("gold", true).await.unwrap());
        assert!(t.delete_plan("free", false).await.unwrap());
        assert_eq!(names(&t.rows().await.unwrap()), ["default-per-key"]);
        assert_eq!(t.plans().await.unwrap(), []);
    }

    /// Pages in name order, filtered by tenant, plan and prefix, after a
    /// name, at most a limit.
    pub async fn pages_of_rows(t: &LimitsTable) {
        t.create_plan("gold", "").await.unwrap();
        for (name, tenant) in [("b-1", "acme"), ("a-1", "acme"), ("a-2", "globex")] {
            t.upsert(&row(name, tenant, name, 1)).await.unwrap();
        }
        t.upsert(&plan_row("a-gold", "gold", 1)).await.unwrap();
        let page = |tenant: &str, plan: &str, prefix: &str, after: &str, limit| {
            let filter = RowFilter {
                tenant: tenant.into(),
                plan: plan.into(),
                prefix: prefix.into(),
                after: after.into(),
                limit,
            };
            async move {
                let rows = t.rows_page(&filter).await.unwrap();
                rows.iter().map(|r| r.name.clone()).collect::<Vec<_>>()
            }
        };
        assert_eq!(
            page("", "", "", "", 10).await,
            ["a-1", "a-2", "a-gold", "b-1", "default-per-key"]
        );
        assert_eq!(page("acme", "", "", "", 10).await, ["a-1", "b-1"]);
        assert_eq!(page("", "gold", "", "", 10).await, ["a-gold"]);
        assert_eq!(page("", "", "a-", "", 10).await, ["a-1", "a-2", "a-gold"]);
        assert_eq!(page("", "", "a-", "a-1", 10).await, ["a-2", "a-gold"]);
        assert_eq!(page("", "", "", "", 2).await, ["a-1", "a-2"]);
        assert_eq!(page("globex", "", "b", "", 10).await, Vec::<String>::new());
        let rows = t
            .rows_page(&RowFilter {
                tenant: "globex".into(),
                limit: 1,
                ..RowFilter::default()
            })
            .await
            .unwrap();
        assert_eq!(values(&rows[0]), row("a-2", "globex", "a-2", 1).stored());
    }

    /// Every change bumps the version and logs its owner; `pending` counts
    /// the log after a version, or says everything must be read again.
    pub async fn changes_are_versioned_and_counted(t: &LimitsTable) {
        let v1 = t.version().await.unwrap();
        assert_eq!(t.pending(v1).await.unwrap(), 0);
        assert_eq!(t.pending(0).await.unwrap(), u64::MAX);
        assert_eq!(
            t.pending(v1 + 1).await.unwrap(),
            u64::MAX,
            "ahead of the table"
        );
        // SQLite logs each row's owner per row changed; PostgreSQL per
        // statement, an update's old and new owner both.
        let update = if t.is_postgres() { 2 } else { 1 };
        t.upsert(&row("acme-a", "acme", "", 1)).await.unwrap();
        // An update stamped in the same millisecond as the insert looks
        // to SQLite's touch trigger like a plain SQL edit, which it stamps
        // again (a second entry): let the millisecond pass.
        tokio::time::sleep(Duration::from_millis(2)).await;
        t.upsert(&row("acme-a", "acme", "", 2)).await.unwrap();
        t.create_plan("gold", "").await.unwrap();
        let v3 = t.version().await.unwrap();
        assert!(v3 >= v1 + 3, "{v1} {v3}");
        assert_eq!(t.pending(v1).await.unwrap(), 2 + update);
        t.assign("acme", Some("gold")).await.unwrap();
        assert!(t.delete("acme-a").await.unwrap());
        let v2 = t.version().await.unwrap();
        assert!(v2 >= v3 + 2);
        assert_eq!(t.pending(v1).await.unwrap(), 4 + update);
        assert_eq!(t.pending(v3).await.unwrap(), 2);
        assert_eq!(t.pending(v2).await.unwrap(), 0);
        // A statement that changes nothing logs nothing.
        assert_eq!(
            t.execute_sql("UPDATE limits SET burst = 1 WHERE name = 'nobody'")
                .await
                .unwrap(),
            0
        );
        assert_eq!(t.pending(v2).await.unwrap(), 0);
        let v4 = t.version().await.unwrap();
        assert_eq!(
            t.execute_sql("UPDATE limits SET burst = burst + 1")
                .await
                .unwrap(),
            1
        );
        // A plain SQL update logs its owner twice: on SQLite once for the
        // row and once for its timestamp, on PostgreSQL as old and new.
        assert_eq!(t.pending(v4).await.unwrap(), 2);
    }

    /// A read from 0 feeds everything; a read from a version feeds the
    /// owners that changed after it, their rows and their assignments; a
    /// read at the table's version feeds nothing.
    pub async fn reads_feed_what_changed(t: &LimitsTable) {
        t.create_plan("gold", "").await.unwrap();
        t.upsert(&plan_row("gold-any", "gold", 100)).await.unwrap();
        t.upsert(&row("acme-a", "acme", "", 1)).await.unwrap();
        t.upsert(&row("acme-b", "acme", "b", 1)).await.unwrap();
        t.upsert(&row("globex-a", "globex", "", 1)).await.unwrap();
        t.assign("initech", Some("gold")).await.unwrap();
        let v1 = t.version().await.unwrap();

        let (version, all) = read(t, 0, 0).await;
        assert_eq!(version, Some(v1));
        assert_eq!(all.begins, [(true, BTreeSet::new())]);
        assert_eq!(all.plans, ["gold"]);
        assert_eq!(
            all.row_names(),
            BTreeSet::from([
                "acme-a",
                "acme-b",
                "default-per-key",
                "globex-a",
                "gold-any"
            ])
        );
        // What a chunk carries is what the table holds, id included.
        let mut rows = all.rows.clone();
        rows.sort_by_key(|r| r.id);
        let mut stored = t.rows().await.unwrap();
        for r in &mut stored {
            r.updated_at.clear();
        }
        assert_eq!(rows, stored);
        assert_eq!(all.assignments, [("initech".into(), "gold".into())]);

        let (version, none) = read(t, v1, 5).await;
        assert_eq!(version, None);
        assert!(none.begins.is_empty() && none.rows.is_empty());

        // One tenant's row changes, a tenant is assigned, a plan's row changes.
        t.upsert(&row("acme-a", "acme", "", 9)).await.unwrap();
        t.assign("hooli", Some("gold")).await.unwrap();
        t.upsert(&plan_row("gold-any", "gold", 50)).await.unwrap();
        let v2 = t.version().await.unwrap();
        let (version, some) = read(t, v1, 5).await;
        assert_eq!(version, Some(v2));
        let owners = [r#"plan "gold""#, r#"tenant "acme""#, r#"tenant "hooli""#]
            .map(String::from)
            .into();
        assert_eq!(some.begins, [(false, owners)]);
        assert_eq!(some.plans, ["gold"]);
        assert_eq!(
            some.row_names(),
            BTreeSet::from(["acme-a", "acme-b", "gold-any"])
        );
        assert_eq!(some.assignments, [("hooli".into(), "gold".into())]);
        let acme_a = some.rows.iter().find(|r| r.name == "acme-a").unwrap();
        assert_eq!(acme_a.burst, 9);

        // A plan deleted: its owner is read, and the plan is not fed.
        t.delete_plan("gold", true).await.unwrap();
        let (_, gone) = read(t, v2, 5).await;
        let owners = gone.begins[0].1.clone();
        assert!(owners.contains(r#"plan "gold""#), "{owners:?}");
        assert!(gone.plans.is_empty());
        assert!(gone.rows.is_empty());
    }

    /// More changes than half the rules held (and than 1000) read the whole
    /// table instead.
    pub async fn many_changes_read_everything(t: &LimitsTable) {
        let v1 = t.version().await.unwrap();
        let rows: Vec<(usize, StoredRow)> = (0..1000)
            .map(|i| {
                (
                    i + 1,
                    row(&format!("r{i}"), &format!("t{i}"), "", 1).stored(),
                )
            })
            .collect();
        t.import(&rows, |_| {}).await.unwrap();
        assert_eq!(t.pending(v1).await.unwrap(), 1000);
        // At most 1000 asked: 1000 are read.
        let mut sink = Recorded::default();
        assert!(
            t.read_changes(v1, 10, 1000, &mut sink)
                .await
                .unwrap()
                .is_some()
        );
        // 1000 changes: the owners alone (1000 is the floor).
        let (_, some) = read(t, v1, 10).await;
        assert!(!some.begins[0].0);
        assert_eq!(some.begins[0].1.len(), 1000);
        // Half of 2001 held is 1000: still the owners.
        let (_, some) = read(t, v1, 2001).await;
        assert!(!some.begins[0].0);
        t.upsert(&row("one-more", "t-more", "", 1)).await.unwrap();
        // At most 1000 asked of 1001 waiting, or of the whole table: none.
        let mut sink = Recorded::default();
        let err = t.read_changes(v1, 10, 1000, &mut sink).await.unwrap_err();
        assert!(matches!(err, TableError::TooManyChanges(1001)), "{err:?}");
        let err = t.read_changes(0, 10, 1000, &mut sink).await.unwrap_err();
        assert!(
            matches!(err, TableError::TooManyChanges(u64::MAX)),
            "{err:?}"
        );
        assert!(sink.begins.is_empty() && sink.rows.is_empty());
        // 1001 changes: everything.
        let (_, all) = read(t, v1, 10).await;
        assert!(all.begins[0].0);
        assert_eq!(all.rows.len(), 1002);
        // Unless that is at most half of what the instance holds.
        let (_, some) = read(t, v1, 2002).await;
        assert!(!some.begins[0].0);
        let (_, all) = read(t, v1, 2001).await;
        assert!(all.begins[0].0);
    }

    /// Any character in a value survives the chunked read.
    pub async fn odd_values_read_back_exactly(t: &LimitsTable) {
        let odd = [
            "comma,in,name",
            "12,digits",
            "quote'and\"double",
            "ünïcødé-名前",
            "",
        ];
        for (i, resource) in odd.iter().enumerate() {
            let name = format!("odd-{i}-{resource}");
            t.execute_sql(&format!(
                "INSERT INTO limits (name, tenant, resource, scope, burst, rate, rate_unit) \
                 VALUES ('{}', 'acme', '{}', 'key', {}, 5, 'second')",
                name.replace('\'', "''"),
                resource.replace('\'', "''"),
                i + 1
            ))
            .await
            .unwrap();
        }
        let (_, all) = read(t, 0, 0).await;
        for (i, resource) in odd.iter().enumerate() {
            let got = all
                .rows
                .iter()
                .find(|r| r.name == format!("odd-{i}-{resource}"))
                .unwrap_or_else(|| panic!("odd-{i} read back: {:?}", all.row_names()));
            assert_eq!(got.resource, *resource);
            assert_eq!(got.burst, i as i64 + 1);
            assert_eq!((got.rate, got.rate_unit.as_str()), (5, "second"));
        }
    }

    /// An import writes every row or none, names the line at fault, and
    /// reports its progress per 500 rows.
    pub async fn imports_are_all_or_nothing(t: &LimitsTable) {
        t.upsert(&row("taken", "acme", "", 1)).await.unwrap();
        let rows: Vec<(usize, StoredRow)> = (0..1200)
            .map(|i| {
                (
                    i + 2,
                    row(&format!("r{i}"), &format!("t{i}"), "", 3).stored(),
                )
            })
            .collect();
        let mut progress = Vec::new();
        t.import(&rows, |n| progress.push(n)).await.unwrap();
        assert_eq!(progress, [500, 1000, 1200]);
        assert_eq!(t.count().await.unwrap(), 1202);
        // Imported again with new values: updated in place.
        let again: Vec<(usize, StoredRow)> = rows
            .iter()
            .map(|(line, r)| {
                let mut r = r.clone();
                r.burst = 4;
                (*line, r)
            })
            .collect();
        t.import(&again, |_| {}).await.unwrap();
        let all = t.rows().await.unwrap();
        assert_eq!(all.len(), 1202);
        assert!(
            all.iter()
                .filter(|r| r.name.starts_with('r'))
                .all(|r| r.burst == 4)
        );

        let clash = vec![
            (2, row("fresh", "x", "", 1).stored()),
            (3, row("taken", "globex", "", 1).stored()),
        ];
        let err = t.import(&clash, |_| {}).await.unwrap_err();
        assert!(matches!(err, TableError::Conflict(_)), "{err:?}");
        assert_eq!(
            message(err),
            "line 3: name \"taken\" already belongs to a row of tenant \"acme\" with another \
             resource, scope, mode or kind; nothing was imported"
        );
        let missing = vec![
            (7, row("fresh", "x", "", 1).stored()),
            (8, plan_row("p", "silver", 1).stored()),
        ];
        let err = t.import(&missing, |_| {}).await.unwrap_err();
        assert!(matches!(err, TableError::NotFound(_)), "{err:?}");
        assert_eq!(
            message(err),
            "line 8: plan \"silver\" does not exist; create it with `tollgate plans create silver`; \
             nothing was imported"
        );
        assert!(!names(&t.rows().await.unwrap()).contains(&"fresh"));
        assert_eq!(t.count().await.unwrap(), 1202);
    }

    /// The change log keeps entries for the retention asked; once it no
    /// longer reaches back to a version, a read from it reads everything.
    pub async fn pruned_changes_mean_a_full_read(t: &LimitsTable) {
        let v1 = t.version().await.unwrap();
        t.upsert(&row("acme-a", "acme", "", 1)).await.unwrap();
        t.upsert(&row("acme-b", "acme", "b", 1)).await.unwrap();
        assert_eq!(t.prune_changes(Duration::from_secs(600)).await.unwrap(), 0);
        assert_eq!(t.pending(v1).await.unwrap(), 2);
        // Entries are stamped to the second: let one pass.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        // The seeded default's entry and both upserts.
        assert_eq!(t.prune_changes(Duration::ZERO).await.unwrap(), 3);
        assert_eq!(t.prune_changes(Duration::ZERO).await.unwrap(), 0);
        let v2 = t.version().await.unwrap();
        assert_eq!(t.pending(v1).await.unwrap(), u64::MAX);
        assert_eq!(t.pending(v2).await.unwrap(), 0);
        let (_, all) = read(t, v1, 10).await;
        assert!(all.begins[0].0, "a full read");
        // The log goes on from where it was.
        t.upsert(&row("acme-c", "acme", "c", 1)).await.unwrap();
        assert_eq!(t.pending(v2).await.unwrap(), 1);
        let (_, some) = read(t, v2, 10).await;
        assert!(!some.begins[0].0);
    }

    /// A tenant's billing cycle lives in its `tenants` row beside its plan:
    /// setting one keeps the plan, leaving a plan keeps the cycle, and a
    /// tenant with neither has no row.
    pub async fn billing_cycles_live_beside_plans(t: &LimitsTable) {
        let ny = Cycle::new("America/New_York", 15, 1, "monday").unwrap();
        t.set_cycle("acme", &ny).await.unwrap();
        assert_eq!(
            t.tenant("acme").await.unwrap(),
            Some((String::new(), ny.clone()))
        );
        assert_eq!(t.count().await.unwrap(), 2, "the default row and acme's");
        t.create_plan("gold", "").await.unwrap();
        assert_eq!(t.assign("acme", Some("gold")).await.unwrap(), None);
        assert_eq!(
            t.tenant("acme").await.unwrap(),
            Some(("gold".into(), ny.clone()))
        );
        assert_eq!(t.assign("acme", None).await.unwrap(), Some("gold".into()));
        assert_eq!(
            t.tenant("acme").await.unwrap(),
            Some((String::new(), ny.clone()))
        );
        assert_eq!(t.plans().await.unwrap()[0].tenants, 0);
        // The default cycle on a tenant with no plan: no row.
        t.set_cycle("acme", &Cycle::default()).await.unwrap();
        assert_eq!(t.tenant("acme").await.unwrap(), None);
        // On a tenant with a plan: the row stays, with the plan.
        t.assign("globex", Some("gold")).await.unwrap();
        t.set_cycle("globex", &ny).await.unwrap();
        t.set_cycle("globex", &Cycle::default()).await.unwrap();
        assert_eq!(
            t.tenant("globex").await.unwrap(),
            Some(("gold".into(), Cycle::default()))
        );
        assert_eq!(t.assign("globex", None).await.unwrap(), Some("gold".into()));
        assert_eq!(t.tenant("globex").await.unwrap(), None);
        // Reads feed the cycles, checked; a row written with plain SQL that
        // does not validate is fed as its error.
        let v = t.version().await.unwrap();
        t.set_cycle("initech", &ny).await.unwrap();
        t.execute_sql(
            "INSERT INTO tenants (tenant, plan, time_zone, cycle_day) \
             VALUES ('hooli', '', 'Mars/Olympus_Mons', 40)",
        )
        .await
        .unwrap();
        let (_, some) = read(t, v, 10).await;
        let mut cycles = some.cycles;
        cycles.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            cycles,
            [
                (
                    "hooli".into(),
                    Err(
                        "anchor day 40: use 1 to 31 (31 means the last day of shorter months)"
                            .into()
                    )
                ),
                ("initech".into(), Ok(ny.clone())),
            ]
        );
        let (_, all) = read(t, 0, 0).await;
        assert_eq!(all.cycles.len(), 2);
    }

    /// A closed handle reads nothing.
    pub async fn a_closed_table_answers_errors(t: &LimitsTable) {
        let other = t.clone();
        t.close().await;
        assert!(matches!(
            other.count().await,
            Err(TableError::Database(sqlx::Error::PoolClosed))
        ));
    }
}

macro_rules! on_sqlite {
    ($($check:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test]
                async fn $check() {
                    let dir = tempfile::tempdir().unwrap();
                    let path = dir.path().join("limits.db");
                    let table = super::LimitsTable::open(path.to_str().unwrap()).await.unwrap();
                    assert!(!table.is_postgres());
                    super::checks::$check(&table).await;
                }
            )*
        }

        /// Every check, on one PostgreSQL server, each on a database of its own.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn every_check_on_postgres() {
            let pg = postgres::Postgres::start();
            // A URL is never looked for as a file.
            let admin = LimitsTable::open_existing(&pg.url(), false).await.unwrap();
            assert!(admin.is_postgres());
            $(
                let db = stringify!($check);
                admin.execute_sql(&format!("CREATE DATABASE {db}")).await.unwrap();
                let url = format!("postgres://postgres@127.0.0.1:{}/{db}", pg.port);
                let table = LimitsTable::open(&url).await.unwrap();
                checks::$check(&table).await;
                table.close().await;
            )*
        }
    };
}

on_sqlite!(
    a_new_table_holds_the_default_row,
    upserts_and_deletes,
    plans_and_assignments,
    pages_of_rows,
    changes_are_versioned_and_counted,
    reads_feed_what_changed,
    many_changes_read_everything,
    odd_values_read_back_exactly,
    imports_are_all_or_nothing,
    pruned_changes_mean_a_full_read,
    billing_cycles_live_beside_plans,
    a_closed_table_answers_errors,
);

#[tokio::test]
async fn a_file_is_named_absolute_and_fingerprinted() {
    let dir = tempfile::tempdir().unwrap();
    let canonical = std::fs::canonicalize(dir.path()).unwrap().join("limits.db");
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    let relative = dir.path().join("sub/../limits.db");
    let a = LimitsTable::open(relative.to_str().unwrap()).await.unwrap();
    assert_eq!(a.location(), canonical.to_str().unwrap());
    let url = LimitsTable::open(&format!("sqlite://{}?mode=rwc", canonical.display()))
        .await
        .unwrap();
    assert_eq!(url.location(), canonical.to_str().unwrap());
    let other = LimitsTable::open(dir.path().join("other.db").to_str().unwrap())
        .await
        .unwrap();
    // Equal for the same table, 16 hex digits, not the location.
    assert_eq!(a.fingerprint(), url.fingerprint());
    assert_ne!(a.fingerprint(), other.fingerprint());
    // FNV-1a of the location, as documented.
    let fnv = canonical
        .to_str()
        .unwrap()
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
    assert_eq!(a.fingerprint(), format!("{fnv:016x}"));
    // Opening again seeds nothing twice: one default row, one version.
    assert_eq!(url.count().await.unwrap(), 1);
    assert_eq!(url.version().await.unwrap(), 1);
}

#[tokio::test]
async fn a_missing_file_is_an_error_unless_asked_to_create_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("limits.db");
    let location = path.to_str().unwrap();
    let err = LimitsTable::open_existing(location, false)
        .await
        .unwrap_err();
    assert_eq!(
        message(err),
        format!(
            "no limits table at {location}: `tollgate serve` creates it there, or pass --create; \
             to edit a server's table, pass its --limits (or set TOLLGATE_LIMITS)"
        )
    );
    let url = format!("sqlite://{location}?mode=rwc");
    assert!(LimitsTable::open_existing(&url, false).await.is_err());
    assert!(!path.exists());
    let created = LimitsTable::open_existing(location, true).await.unwrap();
    assert!(path.exists());
    created.upsert(&row("acme-a", "acme", "", 1)).await.unwrap();
    let existing = LimitsTable::open_existing(location, false).await.unwrap();
    assert_eq!(existing.count().await.unwrap(), 2);
    let existing = LimitsTable::open_existing(&url, false).await.unwrap();
    assert_eq!(existing.count().await.unwrap(), 2);
    // In memory: nothing to look for.
    let memory = LimitsTable::open_existing("sqlite::memory:", false)
        .await
        .unwrap();
    assert_eq!(memory.count().await.unwrap(), 1);
}

#[tokio::test]
async fn a_location_that_is_neither_file_nor_database_is_refused() {
    let err = LimitsTable::open("mysql://root:secret@db/limits")
        .await
        .unwrap_err();
    assert_eq!(
        message(err),
        "limits location \"mysql://root:***@db/limits\": give a file path, a sqlite: URL or a \
         postgres:// URL"
    );
    let err = LimitsTable::open("sqlite://x?mode=sideways")
        .await
        .unwrap_err();
    assert!(matches!(err, TableError::Location(..)), "{err:?}");
    let err = LimitsTable::open("postgres://u:pw@127.0.0.1:1/x?sslmode=sideways")
        .await
        .unwrap_err();
    assert!(matches!(err, TableError::Location(..)), "{err:?}");
    assert!(!message(err).contains("pw"), "the password is hidden");
}

#[tokio::test]
async fn a_reopened_file_has_connections_of_its_own_and_memory_shares_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("limits.db");
    let table = LimitsTable::open(path.to_str().unwrap()).await.unwrap();
    let own = table.reopen().await.unwrap();
    table.close().await;
    // The reopened handle still reads the file.
    assert_eq!(own.count().await.unwrap(), 1);
    assert_eq!(own.location(), table.location());

    let memory = LimitsTable::open("sqlite::memory:").await.unwrap();
    memory.upsert(&row("acme-a", "acme", "", 1)).await.unwrap();
    let shared = memory.reopen().await.unwrap();
    assert_eq!(shared.count().await.unwrap(), 2, "the same database");
}

/// A SQLite file `name` in `dir` made with plain SQL (as an older version
/// left it); its path.
async fn sqlite_file_of(dir: &tempfile::TempDir, name: &str, sql: &str) -> String {
    use sqlx::{Connection, Executor};
    let location = dir.path().join(name).to_str().unwrap().to_owned();
    let mut c = sqlx::SqliteConnection::connect(&format!("sqlite://{location}?mode=rwc"))
        .await
        .unwrap();
    c.execute(sqlx::AssertSqlSafe(sql.to_owned()))
        .await
        .unwrap();
    c.close().await.unwrap();
    location
}

/// A table made before plans existed (no plan, debt or kind columns) is
/// rebuilt with them, keeping its rows, ids and change triggers.
#[tokio::test]
async fn a_table_from_before_plans_is_migrated_with_its_rows() {
    let dir = tempfile::tempdir().unwrap();
    let location = sqlite_file_of(
        &dir,
        "old.db",
        "CREATE TABLE limits (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, \
         tenant TEXT NOT NULL DEFAULT '', resource TEXT NOT NULL DEFAULT '', \
         scope TEXT NOT NULL DEFAULT 'key', burst INTEGER NOT NULL, rate INTEGER NOT NULL, \
         rate_unit TEXT NOT NULL DEFAULT 'second', mode TEXT NOT NULL DEFAULT 'enforce', \
         on_store_unavailable TEXT NOT NULL DEFAULT 'allow', \
         updated_at TEXT NOT NULL DEFAULT '2025-01-01T00:00:00.000Z', \
         UNIQUE (tenant, resource, scope, mode)); \
         CREATE TRIGGER limits_touch AFTER UPDATE ON limits BEGIN SELECT 1; END; \
         INSERT INTO limits (id, name, tenant, burst, rate) VALUES (7, 'acme-old', 'acme', 9, 3);",
    )
    .await;
    let location = location.as_str();
    let table = LimitsTable::open(location).await.unwrap();
    let rows = table.rows().await.unwrap();
    assert_eq!(names(&rows), ["acme-old"], "kept, and no default added");
    let old = &rows[0];
    assert_eq!((old.id, old.burst, old.rate), (7, 9, 3));
    assert_eq!(
        (old.plan.as_str(), old.debt, old.kind.as_str()),
        ("", 0, "rate")
    );
    assert_eq!(old.updated_at, "2025-01-01T00:00:00.000Z");
    // Plans work, and changes are logged.
    let v = table.version().await.unwrap();
    table.create_plan("gold", "").await.unwrap();
    table
        .upsert(&plan_row("gold-any", "gold", 5))
        .await
        .unwrap();
    assert_eq!(table.pending(v).await.unwrap(), 2);
    // A table with a debt column but no plan column keeps its debts.
    let location = sqlite_file_of(
        &dir,
        "debt.db",
        "CREATE TABLE limits (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, \
             tenant TEXT NOT NULL DEFAULT '', resource TEXT NOT NULL DEFAULT '', \
             scope TEXT NOT NULL DEFAULT 'key', burst INTEGER NOT NULL, rate INTEGER NOT NULL, \
             rate_unit TEXT NOT NULL DEFAULT 'second', mode TEXT NOT NULL DEFAULT 'enforce', \
             on_store_unavailable TEXT NOT NULL DEFAULT 'allow', debt INTEGER NOT NULL DEFAULT 0, \
             kind TEXT NOT NULL DEFAULT 'rate', \
             updated_at TEXT NOT NULL DEFAULT '2025-01-01T00:00:00.000Z', \
             UNIQUE (tenant, resource, scope, mode, kind)); \
             INSERT INTO limits (name, tenant, burst, rate, debt, kind) \
             VALUES ('acme-slots', 'acme', 4, 0, 2, 'concurrency');",
    )
    .await;
    let location = location.as_str();
    let table = LimitsTable::open(location).await.unwrap();
    let rows = table.rows().await.unwrap();
    assert_eq!(names(&rows), ["acme-slots"]);
    assert_eq!((rows[0].debt, rows[0].kind.as_str()), (2, "concurrency"));
}

/// SQLite lets a number column hold text: the row is read, and validation
/// names the value.
#[tokio::test]
async fn text_in_a_number_column_is_read_as_a_row_that_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("limits.db");
    let table = LimitsTable::open(path.to_str().unwrap()).await.unwrap();
    table
        .execute_sql(
            "INSERT INTO limits (name, tenant, burst, rate, debt) VALUES ('b', 'acme', 'lots', 5, 0); \
             INSERT INTO limits (name, tenant, resource, burst, rate, debt) VALUES ('r', 'acme', 'x', 1, '5/s', 0); \
             INSERT INTO limits (name, tenant, resource, burst, rate, debt) VALUES ('d', 'acme', 'y', 1, 5, 'some');",
        )
        .await
        .unwrap();
    let (_, all) = read(&table, 0, 0).await;
    let scope = |name: &str| {
        all.rows
            .iter()
            .find(|r| r.name == name)
            .map(|r| r.scope.clone())
            .unwrap()
    };
    assert_eq!(
        scope("b"),
        "(the burst column holds \"lots\", not a whole number)"
    );
    assert_eq!(
        scope("r"),
        "(the rate column holds \"5/s\", not a whole number)"
    );
    assert_eq!(
        scope("d"),
        "(the debt column holds \"some\", not a whole number)"
    );
    let live = LiveLimits::load(&table, 100).await.unwrap();
    let status = live.status();
    assert_eq!(status.rejected_rows, 3);
    assert!(
        status.rejected.iter().any(|r| r.contains("lots")),
        "{status:?}"
    );
}

// --- the rules in force, kept current ---------------------------------------

async fn sqlite_table() -> (tempfile::TempDir, LimitsTable) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("limits.db");
    let table = LimitsTable::open(path.to_str().unwrap()).await.unwrap();
    (dir, table)
}

fn bursts(live: &LiveLimits, tenant: &str, resource: &str) -> Vec<(String, u64)> {
    live.snapshot()
        .applicable(tenant, resource)
        .map(|r| (r.name.to_string(), r.limit.burst()))
        .collect()
}

#[tokio::test]
async fn a_table_larger_than_the_bound_is_refused_at_load() {
    let (_dir, table) = sqlite_table().await;
    table.upsert(&row("acme-a", "acme", "", 1)).await.unwrap();
    table.create_plan("gold", "").await.unwrap();
    table.assign("globex", Some("gold")).await.unwrap();
    // Two rows and an assignment: three is the least that loads.
    let err = LiveLimits::load(&table, 2).await.err().unwrap();
    assert!(
        matches!(err, LoadError::TooLarge { rows: 3, max: 2 }),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "the limits and tenants tables hold 3 rows; this instance keeps at most 2 in memory \
         (raise --max-limit-rows, or move tenants onto plans: a tenant on a plan needs no rows)"
    );
    let live = LiveLimits::load(&table, 3).await.unwrap();
    let status = live.status();
    assert_eq!((status.rules, status.tenants, status.max_rules), (2, 2, 3));
    assert_eq!(status.generation, 1);
    assert_eq!(status.version, table.version().await.unwrap());
    assert_eq!(bursts(&live, "acme", ""), [("acme-a".into(), 1)]);
}

#[tokio::test]
async fn each_catch_up_applies_what_changed_and_counts_a_generation() {
    let (_dir, table) = sqlite_table().await;
    let live = LiveLimits::load(&table, 100).await.unwrap();
    assert!(!live.catch_up(&table).await.unwrap(), "nothing changed");
    assert_eq!(live.status().generation, 1);
    table.upsert(&row("acme-a", "acme", "", 4)).await.unwrap();
    assert!(live.catch_up(&table).await.unwrap());
    assert_eq!(bursts(&live, "acme", ""), [("acme-a".into(), 4)]);
    table.upsert(&row("acme-a", "acme", "", 5)).await.unwrap();
    table
        .upsert(&row("globex-a", "globex", "", 6))
        .await
        .unwrap();
    assert!(live.catch_up(&table).await.unwrap());
    let status = live.status();
    assert_eq!((status.generation, status.rules, status.tenants), (3, 3, 2));
    assert_eq!(status.version, table.version().await.unwrap());
    assert_eq!(bursts(&live, "acme", ""), [("acme-a".into(), 5)]);
    assert!(!live.catch_up(&table).await.unwrap());
    assert_eq!(live.status().generation, 3);
    // A statement that changed no row moves nothing.
    table
        .execute_sql("UPDATE limits SET burst = 1 WHERE name = 'nobody'")
        .await
        .unwrap();
    assert!(!live.catch_up(&table).await.unwrap());
    // An unreadable table keeps the rules in force and says why.
    table.close().await;
    assert!(live.catch_up(&table).await.is_err());
    let status = live.status();
    assert!(status.last_error.is_some());
    assert_eq!((status.generation, status.rules), (3, 3));
}

/// A replaced snapshot is freed by the next catch-up (or tidy) once no
/// decision holds it, and never while one does.
#[tokio::test]
async fn replaced_snapshots_are_freed_once_nobody_holds_them() {
    let (_dir, table) = sqlite_table().await;
    let live = LiveLimits::load(&table, 100).await.unwrap();
    let held = live.snapshot();
    table.upsert(&row("acme-a", "acme", "", 4)).await.unwrap();
    live.catch_up(&table).await.unwrap();
    // Held by this "decision" and by the retired list.
    assert_eq!(Arc::strong_count(&held), 2);
    live.release_retired().await;
    assert_eq!(Arc::strong_count(&held), 2, "kept while held");
    let weak = Arc::downgrade(&held);
    drop(held);
    live.release_retired().await;
    assert!(weak.upgrade().is_none(), "freed once let go");

    // The same by a catch-up.
    let held = live.snapshot();
    table.upsert(&row("acme-a", "acme", "", 5)).await.unwrap();
    live.catch_up(&table).await.unwrap();
    table.upsert(&row("acme-a", "acme", "", 6)).await.unwrap();
    live.catch_up(&table).await.unwrap();
    assert_eq!(Arc::strong_count(&held), 2, "kept by a catch-up while held");
    let weak = Arc::downgrade(&held);
    drop(held);
    table.upsert(&row("acme-a", "acme", "", 7)).await.unwrap();
    live.catch_up(&table).await.unwrap();
    assert!(weak.upgrade().is_none(), "freed by a catch-up");
}

/// Waits (bounded) until `done` holds.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..600 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what}: not within 30 s");
}

#[tokio::test]
async fn watch_applies_edits_until_shut_down() {
    let (_dir, table) = sqlite_table().await;
    let live = Arc::new(LiveLimits::load(&table, 100).await.unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let watcher = tokio::spawn(watch(
        live.clone(),
        table.clone(),
        Duration::from_millis(50),
        async move {
            let _ = stopped.await;
        },
    ));
    table.upsert(&row("acme-a", "acme", "", 4)).await.unwrap();
    until("the edit applied", || {
        bursts(&live, "acme", "") == [("acme-a".into(), 4)]
    })
    .await;
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(30), watcher)
        .await
        .expect("the watcher stops")
        .unwrap();
    table.upsert(&row("acme-a", "acme", "", 5)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(bursts(&live, "acme", ""), [("acme-a".into(), 4)], "stopped");
}

const ONE_PROCESS: &str = "this test records events from every thread of its process: \
                           run it under cargo nextest (a process per test)";

/// The threads that applied each batch of changes ("limits applied"
/// events), recorded from every thread of the process.
#[derive(Clone, Default)]
struct Applied(Arc<parking_lot::Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Applied {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Visit(Option<String>, bool);
        impl tracing::field::Visit for Visit {
            fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
                if field.name() == "thread" {
                    self.0 = Some(value.into());
                }
            }
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" && format!("{value:?}") == "limits applied" {
                    self.1 = true;
                }
            }
        }
        let mut visit = Visit(None, false);
        event.record(&mut visit);
        if let Visit(Some(thread), true) = visit {
            self.0.lock().push(thread);
        }
    }
}

impl Applied {
    fn install() -> Self {
        use tracing_subscriber::layer::SubscriberExt;
        let applied = Self::default();
        let subscriber = tracing_subscriber::registry().with(applied.clone());
        tracing::subscriber::set_global_default(subscriber).expect(ONE_PROCESS);
        applied
    }

    fn threads(&self) -> Vec<String> {
        self.0.lock().clone()
    }
}

/// `n` rows for new tenants, named from `from`.
fn tenants(from: usize, n: usize) -> Vec<(usize, StoredRow)> {
    (from..from + n)
        .map(|i| (i, row(&format!("r{i}"), &format!("t{i}"), "", 2).stored()))
        .collect()
}

/// The scheduling policy of this process's thread named `name`
/// (`SCHED_IDLE` is 5), from /proc.
fn policy_of_thread(name: &str) -> Option<u32> {
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let dir = task.ok()?.path();
        let comm = std::fs::read_to_string(dir.join("comm")).ok()?;
        if comm.trim_end() != name {
            continue;
        }
        let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
        // Fields after the command's closing parenthesis start at field 3;
        // the policy is field 41.
        let rest = &stat[stat.rfind(')')? + 2..];
        return rest.split(' ').nth(41 - 3)?.parse().ok();
    }
    None
}

/// `spawn_watch` over `table` every `every`, until the sender is used or
/// dropped; the receiver completes once the watcher has stopped.
fn watching(
    live: &Arc<LiveLimits>,
    table: &LimitsTable,
    every: Duration,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::sync::oneshot::Receiver<()>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let done = spawn_watch(live.clone(), table.clone(), every, async move {
        let _ = stopped.await;
    })
    .unwrap();
    (stop, done)
}

/// Up to [`BULK_CHANGES`] changes are applied on the watcher's thread;
/// more on the bulk thread, which runs in the idle scheduling class.
#[test]
fn bulk_edits_are_applied_on_the_idle_thread() {
    let applied = Applied::install();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let (_dir, table) = sqlite_table().await;
        let live = Arc::new(LiveLimits::load(&table, 10_000).await.unwrap());
        let (stop, done) = watching(&live, &table, Duration::from_millis(50));
        table.upsert(&row("acme-a", "acme", "", 4)).await.unwrap();
        until("one edit", || live.status().rules == 2).await;

        let exactly = BULK_CHANGES as usize;
        table.import(&tenants(0, exactly), |_| {}).await.unwrap();
        until("the first batch", || live.status().rules == 2 + exactly).await;
        table
            .import(&tenants(exactly, exactly + 1), |_| {})
            .await
            .unwrap();
        until("the second batch", || {
            live.status().rules == 3 + 2 * exactly
        })
        .await;
        assert_eq!(
            &applied.threads()[1..],
            ["limits-watch", "limits-watch", "limits-bulk"]
        );
        assert_eq!(policy_of_thread("limits-bulk"), Some(5), "SCHED_IDLE");
        assert_eq!(policy_of_thread("limits-watch"), Some(0), "SCHED_OTHER");
        drop(stop);
        tokio::time::timeout(Duration::from_secs(30), done)
            .await
            .expect("the watcher stops")
            .unwrap();
    });
}

/// On PostgreSQL an edit is applied on its notification, long before the
/// safety poll, and a quiet listener is not taken for a lost one.
#[test]
fn postgres_edits_arrive_by_notification() {
    let warnings = Warnings::install();
    let pg = postgres::Postgres::start();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let table = LimitsTable::open(&pg.url()).await.unwrap();
        // The listener hears each change with the table's version.
        let mut listener = table.listener().await.unwrap().expect("PostgreSQL listens");
        table.upsert(&row("acme-a", "acme", "", 3)).await.unwrap();
        // An upsert is two statements' triggers (insert, then update): the
        // last notification carries the version the change ended at.
        let version = table.version().await.unwrap().to_string();
        loop {
            let note = tokio::time::timeout(Duration::from_secs(30), listener.recv())
                .await
                .expect("notified")
                .unwrap();
            assert_eq!(note.channel(), "tollgate_limits");
            if note.payload() == version {
                break;
            }
        }
        drop(listener);

        let live = Arc::new(LiveLimits::load(&table, 100).await.unwrap());
        // A poll longer than the test: only notifications can apply edits.
        let (_stop, _done) = watching(&live, &table, Duration::from_secs(3600));
        for burst in [4, 5, 6] {
            tokio::time::sleep(Duration::from_millis(400)).await;
            table
                .upsert(&row("acme-a", "acme", "", burst))
                .await
                .unwrap();
            until("the notified edit", || {
                bursts(&live, "acme", "") == [("acme-a".to_owned(), burst)]
            })
            .await;
        }
        assert_eq!(warnings.count(), 0, "{:?}", warnings.0.lock());
    });
}

/// A PostgreSQL schema that is already current is not applied again: an
/// instance starting while another reads the tables (a transaction holding
/// them) opens without waiting for that read, which the schema's ALTER
/// TABLE and DROP TRIGGER statements would (and, with the lock orders
/// crossed, deadlock with). A schema applied by another script is applied
/// again, and what it lacked is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_current_postgres_schema_is_not_applied_while_others_read() {
    use sqlx::Connection;
    let pg = postgres::Postgres::start();
    let first = LimitsTable::open(&pg.url()).await.unwrap();
    let mut reader = sqlx::PgConnection::connect(&pg.url()).await.unwrap();
    let mut read = reader.begin().await.unwrap();
    for table in ["tenants", "limits", "plans"] {
        let n: i64 =
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
                .fetch_one(&mut *read)
                .await
                .unwrap();
        assert_eq!(n, i64::from(table == "limits"), "{table}");
    }
    // Only a hang guard: the open either returns or waits for the reader.
    let second = tokio::time::timeout(Duration::from_secs(120), LimitsTable::open(&pg.url()))
        .await
        .expect("the open waited for the reader's transaction")
        .unwrap();
    assert_eq!(names(&second.rows().await.unwrap()), ["default-per-key"]);
    read.commit().await.unwrap();

    // As a table another version of the script made: a trigger missing.
    let digest: String = sqlx::query_scalar("SELECT digest FROM limits_schema")
        .fetch_one(&mut reader)
        .await
        .unwrap();
    assert_eq!(digest.len(), 16, "{digest:?}");
    first
        .execute_sql(
            "DROP TRIGGER limits_touch ON limits; UPDATE limits_schema SET digest = 'other'",
        )
        .await
        .unwrap();
    let third = LimitsTable::open(&pg.url()).await.unwrap();
    let touch: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_trigger WHERE tgname = 'limits_touch'")
            .fetch_one(&mut reader)
            .await
            .unwrap();
    assert_eq!(touch, 1);
    let again: String = sqlx::query_scalar("SELECT digest FROM limits_schema")
        .fetch_one(&mut reader)
        .await
        .unwrap();
    assert_eq!(again, digest);
    // Still the one default row, not seeded twice.
    assert_eq!(names(&third.rows().await.unwrap()), ["default-per-key"]);
    for table in [first, second, third] {
        table.close().await;
    }
}

/// Warnings logged anywhere in the process.
#[derive(Clone, Default)]
struct Warnings(Arc<parking_lot::Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Warnings {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if *event.metadata().level() == tracing::Level::WARN {
            self.0.lock().push(format!("{event:?}"));
        }
    }
}

impl Warnings {
    fn install() -> Self {
        use tracing_subscriber::layer::SubscriberExt;
        let warnings = Self::default();
        let subscriber = tracing_subscriber::registry().with(warnings.clone());
        tracing::subscriber::set_global_default(subscriber).expect(ONE_PROCESS);
        warnings
    }

    fn count(&self) -> usize {
        self.0.lock().len()
    }
}

/// A default row edited into an invalid one keeps its last valid version
/// in force, like a tenant's.
#[tokio::test]
async fn a_bad_edit_of_a_default_row_keeps_its_last_valid_version() {
    let (_dir, table) = sqlite_table().await;
    let live = LiveLimits::load(&table, 100).await.unwrap();
    assert_eq!(
        bursts(&live, "anyone", ""),
        [("default-per-key".into(), 30)]
    );
    table
        .execute_sql("UPDATE limits SET burst = 0 WHERE name = 'default-per-key'")
        .await
        .unwrap();
    assert!(live.catch_up(&table).await.unwrap());
    assert_eq!(
        bursts(&live, "anyone", ""),
        [("default-per-key".into(), 30)]
    );
    let status = live.status();
    assert_eq!(status.rejected_rows, 1);
    assert!(status.rejected[0].contains("default-per-key"), "{status:?}");
}

/// Of a tenant's rows, the one edited into an invalid row keeps its own
/// last valid version, not another row's.
#[tokio::test]
async fn a_bad_edit_keeps_that_rows_last_version_among_several() {
    let (_dir, table) = sqlite_table().await;
    table.upsert(&row("acme-any", "acme", "", 5)).await.unwrap();
    table.upsert(&row("acme-x", "acme", "x", 6)).await.unwrap();
    let live = LiveLimits::load(&table, 100).await.unwrap();
    let both = [("acme-any".to_owned(), 5), ("acme-x".to_owned(), 6)];
    assert_eq!(bursts(&live, "acme", "x"), both);
    table
        .execute_sql("UPDATE limits SET rate = 0 WHERE name = 'acme-x'")
        .await
        .unwrap();
    assert!(live.catch_up(&table).await.unwrap());
    assert_eq!(bursts(&live, "acme", "x"), both);
    assert_eq!(live.status().rejected_rows, 1);
}

/// A tenant whose new rows would pass the bound keeps what it had, and
/// each row left out is reported.
#[tokio::test]
async fn rows_past_the_bound_are_each_reported() {
    let (_dir, table) = sqlite_table().await;
    let live = LiveLimits::load(&table, 3).await.unwrap();
    table.upsert(&row("acme-any", "acme", "", 5)).await.unwrap();
    assert!(live.catch_up(&table).await.unwrap());
    table
        .upsert(&row("globex-any", "globex", "", 1))
        .await
        .unwrap();
    table
        .upsert(&row("globex-x", "globex", "x", 1))
        .await
        .unwrap();
    live.catch_up(&table).await.unwrap();
    let status = live.status();
    assert_eq!((status.rules, status.rejected_rows), (2, 2), "{status:?}");
    for (listed, name) in status.rejected.iter().zip(["globex-any", "globex-x"]) {
        assert!(listed.contains(name), "{listed}");
        assert!(
            listed.ends_with(
                "the limits table holds more rules than this instance keeps in memory \
                 (--max-limit-rows 3); the row is not in force"
            ),
            "{listed}"
        );
    }
    assert_eq!(
        bursts(&live, "globex", "x"),
        [("default-per-key".into(), 30)]
    );
}

/// Plan assignments count against the bound within one batch: of three
/// tenants assigned at once where two fit, the third is reported.
#[tokio::test]
async fn assignments_in_one_batch_count_against_the_bound() {
    let (_dir, table) = sqlite_table().await;
    table.create_plan("gold", "").await.unwrap();
    table
        .upsert(&plan_row("gold-any", "gold", 9))
        .await
        .unwrap();
    // The default row and the plan's: room for two assignments.
    let live = LiveLimits::load(&table, 4).await.unwrap();
    for tenant in ["t1", "t2", "t3"] {
        table.assign(tenant, Some("gold")).await.unwrap();
    }
    assert!(live.catch_up(&table).await.unwrap());
    let status = live.status();
    assert_eq!(status.rejected_rows, 1, "{status:?}");
    assert!(
        status.rejected[0].contains("plan assignments"),
        "{status:?}"
    );
    let on_gold = ["t1", "t2", "t3"]
        .iter()
        .filter(|t| bursts(&live, t, "") == [("gold-any".to_owned(), 9)])
        .count();
    assert_eq!(on_gold, 2);
}

/// A tenant's billing cycle is in force once read: its quotas count the
/// periods of its zone; a cycle that does not validate is reported and the
/// tenant counts in UTC until it is fixed.
#[tokio::test]
async fn a_tenants_billing_cycle_is_in_force_once_read() {
    let (_dir, table) = sqlite_table().await;
    let live = LiveLimits::load(&table, 100).await.unwrap();
    assert_eq!(*live.snapshot().cycle_of("acme"), Cycle::default());
    let ny = Cycle::new("America/New_York", 15, 1, "monday").unwrap();
    table.set_cycle("acme", &ny).await.unwrap();
    table.set_cycle("globex", &ny).await.unwrap();
    assert!(live.catch_up(&table).await.unwrap());
    let snapshot = live.snapshot();
    assert_eq!(*snapshot.cycle_of("acme"), ny);
    // Tenants with the same cycle share one.
    assert!(std::ptr::eq(
        snapshot.cycle_of("acme"),
        snapshot.cycle_of("globex")
    ));
    assert_eq!(*snapshot.cycle_of("initech"), Cycle::default());
    assert_eq!(live.status().tenants, 2);
    // A bad zone written with SQL: reported, UTC meanwhile.
    table
        .execute_sql("UPDATE tenants SET time_zone = 'America/Gotham' WHERE tenant = 'acme'")
        .await
        .unwrap();
    assert!(live.catch_up(&table).await.unwrap());
    assert_eq!(*live.snapshot().cycle_of("acme"), Cycle::default());
    let status = live.status();
    assert_eq!(status.rejected_rows, 1);
    assert_eq!(
        status.rejected[0],
        "tenants row (tenant \"acme\"): time zone \"America/Gotham\" is not an IANA time zone \
         name; use one such as America/New_York, Europe/Berlin or UTC; its quotas count periods in \
         UTC until this is fixed"
    );
    // Fixed: in force, and no longer reported.
    table.set_cycle("acme", &ny).await.unwrap();
    assert!(live.catch_up(&table).await.unwrap());
    assert_eq!(*live.snapshot().cycle_of("acme"), ny);
    assert_eq!(live.status().rejected_rows, 0);
    // A full reload reads the same.
    let again = LiveLimits::load(&table, 100).await.unwrap();
    assert_eq!(*again.snapshot().cycle_of("acme"), ny);
    assert_eq!(again.status().tenants, 2);
}

/// A tenants table made before billing cycles gets their columns, its rows
/// on the default cycle.
#[tokio::test]
async fn a_tenants_table_from_before_cycles_is_migrated() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("old.db");
    let location = path.to_str().unwrap();
    {
        let table = LimitsTable::open(location).await.unwrap();
        table.create_plan("gold", "").await.unwrap();
        table
            .execute_sql(
                "DROP TABLE tenants; \
                 CREATE TABLE tenants (tenant TEXT NOT NULL PRIMARY KEY, plan TEXT NOT NULL, \
                 updated_at TEXT NOT NULL DEFAULT ''); \
                 INSERT INTO tenants (tenant, plan) VALUES ('acme', 'gold');",
            )
            .await
            .unwrap();
        table.close().await;
    }
    let table = LimitsTable::open(location).await.unwrap();
    assert_eq!(
        table.tenant("acme").await.unwrap(),
        Some(("gold".into(), Cycle::default()))
    );
    let ny = Cycle::new("America/New_York", 15, 1, "monday").unwrap();
    table.set_cycle("acme", &ny).await.unwrap();
    assert_eq!(
        table.tenant("acme").await.unwrap(),
        Some(("gold".into(), ny))
    );
}

/// A limits table made before alert thresholds gets the column, its rows
/// without thresholds; a quota row then keeps the thresholds written.
#[tokio::test]
async fn a_limits_table_from_before_alerts_is_migrated() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("old.db");
    let location = path.to_str().unwrap();
    {
        let table = LimitsTable::open(location).await.unwrap();
        table
            .execute_sql("ALTER TABLE limits DROP COLUMN alerts")
            .await
            .unwrap();
        table.close().await;
    }
    let table = LimitsTable::open(location).await.unwrap();
    let rows = table.rows().await.unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].alerts, "");
    let quota = LimitRow::from_request(
        "acme".into(),
        String::new(),
        "tenant",
        0,
        "1000/month",
        "enforce",
        "allow",
        0,
        "quota",
        Some("acme-monthly".into()),
    )
    .unwrap()
    .with_alerts("80,100".parse().unwrap());
    table.upsert(&quota).await.unwrap();
    let rows = table.rows().await.unwrap();
    let stored = rows.iter().find(|r| r.name == "acme-monthly").unwrap();
    assert_eq!(stored.alerts, "80,100");
    let rule = stored.validate().unwrap();
    assert_eq!(rule.limit.alerts().to_string(), "80,100");
}
