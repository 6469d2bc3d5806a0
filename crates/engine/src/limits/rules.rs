//! The rules in force ([`RuleSet`]), indexed for the hot path, and how a
//! batch of changed owners turns one snapshot into the next ([`Loader`]).
//!
//! A snapshot holds the default rules, the plans' rules (by plan id) and the
//! tenants, spread over [`SHARDS`] shards by a hash of the tenant's name;
//! each shard is a sorted slice behind its own `Arc`. A batch that changes
//! a few tenants copies only their shards (and the array of shard
//! pointers); everything else is shared with the snapshot before. A
//! decision reads one snapshot (one atomic pointer load, no lock), so it
//! sees a batch, which is one or more whole transactions, entirely or not
//! at all.
//!
//! Memory grows with what is stored, not with what could be: a tenant
//! costs its entry (name, plan id, rule pointers: 40 bytes) and its own
//! rules (48 bytes each plus the name); a tenant that only has a plan holds
//! no rule of its own, and rules of the same shape share one [`Shape`].

use std::collections::{HashMap, HashSet};
use std::hash::BuildHasher;
use std::sync::{Arc, LazyLock};

use super::table::TenantRow;
use super::{Kind, Mode, RowError, Rule, Scope, Shape, StoredRow, check_label};
use crate::algorithm::calendar::Cycle;

/// How many shards the tenants are spread over.
pub const SHARDS: usize = 4096;

/// Whose rules a row is.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Owner {
    /// A tenant's own rows; the tenant `""` holds the default rows.
    Tenant(Box<str>),
    /// A plan's rows.
    Plan(Box<str>),
}

impl Owner {
    /// The owner of a row with these `tenant` and `plan` columns: the plan
    /// when one is named (a row naming both is invalid, and reported as
    /// one of the plan's).
    pub fn of(tenant: &str, plan: &str) -> Self {
        if plan.is_empty() {
            Self::Tenant(tenant.into())
        } else {
            Self::Plan(plan.into())
        }
    }

    /// How messages name the owner.
    pub fn describe(&self) -> String {
        match self {
            Self::Tenant(t) if t.is_empty() => "the default rows".into(),
            Self::Tenant(t) => format!("tenant {:?}", super::short(t)),
            Self::Plan(p) => format!("plan {:?}", super::short(p)),
        }
    }
}

type Rules = Box<[Arc<Rule>]>;

/// A tenant's rule as a full load reads it: `true` for a rejected row's
/// last valid version.
type ReadRule = (Box<str>, Arc<Rule>, bool);

/// A tenant with rules of its own or a plan. A shard's entries are sorted
/// by `(order, name)`: a lookup's binary search compares numbers held in
/// the entries, and reads one name, the match's, instead of one per probe
/// (each a cache miss among a million tenants).
#[derive(Debug, Clone)]
struct TenantEntry {
    name: Box<str>,
    rules: Rules,
    /// The high half of the name's hash.
    order: u32,
    /// The plan's id, or [`NO_PLAN`].
    plan: u32,
    /// Its billing cycle, when not the default (shared by every tenant
    /// with the same one).
    cycle: Option<Arc<Cycle>>,
}

const NO_PLAN: u32 = u32::MAX;

impl TenantEntry {
    fn new(name: Box<str>, plan: Option<u32>, rules: Rules, cycle: Option<Arc<Cycle>>) -> Self {
        Self {
            order: place(&name).1,
            name,
            rules,
            plan: plan.unwrap_or(NO_PLAN),
            cycle,
        }
    }

    fn plan(&self) -> Option<u32> {
        (self.plan != NO_PLAN).then_some(self.plan)
    }

    fn key(&self) -> (u32, &str) {
        (self.order, &self.name)
    }
}

/// One snapshot of every rule in force.
#[derive(Debug, Clone)]
pub struct RuleSet {
    defaults: Rules,
    /// By plan id; `None` for a plan that does not exist (any more).
    plans: Arc<[Option<Rules>]>,
    shards: Arc<[Arc<[TenantEntry]>]>,
    rules: usize,
    tenants: usize,
}

impl Default for RuleSet {
    fn default() -> Self {
        let empty: Arc<[TenantEntry]> = Arc::from(Vec::new());
        Self {
            defaults: Box::default(),
            plans: Arc::from(Vec::new()),
            shards: (0..SHARDS).map(|_| empty.clone()).collect(),
            rules: 0,
            tenants: 0,
        }
    }
}

/// A tenant's shard and order in it, from one hash of its name (fixed
/// seed: the same tenant has the same place in every batch).
fn place(tenant: &str) -> (usize, u32) {
    let hash = foldhash::fast::FixedState::with_seed(0x7011_6a7e).hash_one(tenant);
    ((hash as usize) & (SHARDS - 1), (hash >> 32) as u32)
}

fn shard_of(tenant: &str) -> usize {
    place(tenant).0
}

/// The sort key of a tenant's name.
fn key_of(tenant: &str) -> (u32, &str) {
    (place(tenant).1, tenant)
}

impl RuleSet {
    /// A snapshot of `rows` (every plan they name exists; no tenant is
    /// assigned a plan), with invalid rows left out and returned: for
    /// tests and embedding.
    pub fn from_rows(rows: &[StoredRow]) -> (Self, Vec<RowError>) {
        let plans: Vec<&str> = rows
            .iter()
            .filter(|r| !r.plan.is_empty())
            .map(|r| r.plan.as_str())
            .collect();
        Self::from_parts(rows, &plans, &[])
    }

    /// A snapshot of `rows`, the plans that exist and the tenants' plan
    /// assignments, with invalid rows left out and returned.
    pub fn from_parts(
        rows: &[StoredRow],
        plans: &[&str],
        assignments: &[(&str, &str)],
    ) -> (Self, Vec<RowError>) {
        let mut loader = Loader::new(usize::MAX);
        let base = Self::default();
        let mut update = loader.begin(&base, true, Vec::new());
        for plan in plans {
            update.plan(plan);
        }
        let mut rows = rows.to_vec();
        // Rows of one owner must arrive together; table order otherwise.
        rows.sort_by_cached_key(StoredRow::owner);
        let mut names = HashSet::new();
        let mut errors = Vec::new();
        for row in rows {
            if !names.insert(row.name.clone()) {
                errors.push(row.error(format!("name {:?} is used by another row", row.name)));
                continue;
            }
            update.row(row);
        }
        for (tenant, plan) in assignments {
            update.tenant(TenantRow::on_plan(tenant, plan));
        }
        let (set, _) = update.finish();
        errors.extend(loader.invalid.into_values().flatten().map(|bad| bad.error));
        (set, errors)
    }

    /// Rules in force.
    pub fn len(&self) -> usize {
        self.rules
    }

    /// True when no rule is in force.
    pub fn is_empty(&self) -> bool {
        self.rules == 0
    }

    /// Tenants with rules of their own or a plan.
    pub fn tenants(&self) -> usize {
        self.tenants
    }

    fn tenant(&self, tenant: &str) -> Option<&TenantEntry> {
        let (shard, order) = place(tenant);
        let shard = &self.shards[shard];
        shard
            .binary_search_by(|e| e.order.cmp(&order).then_with(|| (*e.name).cmp(tenant)))
            .ok()
            .map(|i| &shard[i])
    }

    /// The billing cycle `tenant`'s quotas count periods of: its own, or
    /// calendar periods in UTC ([`Cycle::default`]).
    pub fn cycle_of(&self, tenant: &str) -> &Cycle {
        static UTC: LazyLock<Cycle> = LazyLock::new(Cycle::default);
        if tenant.is_empty() {
            return &UTC;
        }
        self.tenant(tenant)
            .and_then(|e| e.cycle.as_deref())
            .unwrap_or(&UTC)
    }

    /// The plan id `tenant` is assigned to, if any.
    pub fn plan_of(&self, tenant: &str) -> Option<u32> {
        self.tenant(tenant)?.plan()
    }

    /// The rate rules and quotas a request for `(tenant, resource)` must
    /// pass (see the module docs of [`super`]): the rate rules per key,
    /// then the tenant ceiling; for each, the any-resource slot before the
    /// resource's own; in each slot, the enforced rule before the shadow
    /// one; then the quotas in the same order.
    pub fn applicable<'a>(
        &'a self,
        tenant: &str,
        resource: &str,
    ) -> impl Iterator<Item = &'a Arc<Rule>> + use<'a> {
        self.applicable_of(tenant, resource, &[Kind::Rate, Kind::Quota])
    }

    /// The concurrency rules an acquire for `(tenant, resource)` must pass,
    /// chosen and ordered as [`RuleSet::applicable`] chooses rate rules.
    pub fn concurrency<'a>(
        &'a self,
        tenant: &str,
        resource: &str,
    ) -> impl Iterator<Item = &'a Arc<Rule>> + use<'a> {
        self.applicable_of(tenant, resource, &[Kind::Concurrency])
    }

    fn applicable_of<'a>(
        &'a self,
        tenant: &str,
        resource: &str,
        kinds: &[Kind],
    ) -> impl Iterator<Item = &'a Arc<Rule>> + use<'a> {
        let mut found: [Option<&'a Arc<Rule>>; SLOTS] = [None; SLOTS];
        self.walk(tenant, resource, kinds, |slot, _, rule| {
            // Tiers fill only empty slots, so the most specific row of
            // each slot wins.
            if found[slot].is_none() {
                found[slot] = Some(rule);
            }
        });
        found.into_iter().flatten()
    }

    /// Every rule of every kind that applies to a request for
    /// `(tenant, resource)`, slot by slot in the order decisions meet
    /// them (rate, concurrency, quota): the row in force in each slot,
    /// whose row it is, and the less specific rows it won over. For the
    /// explain view; decisions use [`RuleSet::applicable`].
    pub fn explain<'a>(&'a self, tenant: &str, resource: &str) -> Vec<SlotRules<'a>> {
        let mut slots: [Vec<(Tier, &'a Arc<Rule>)>; SLOTS] = std::array::from_fn(|_| Vec::new());
        let kinds = [Kind::Rate, Kind::Concurrency];
        self.walk(tenant, resource, &kinds, |slot, tier, rule| {
            slots[slot].push((tier, rule));
        });
        let mut quotas: [Vec<(Tier, &'a Arc<Rule>)>; SLOTS] = std::array::from_fn(|_| Vec::new());
        self.walk(tenant, resource, &[Kind::Quota], |slot, tier, rule| {
            quotas[slot].push((tier, rule));
        });
        slots
            .into_iter()
            .chain(quotas)
            .filter_map(|mut rows| {
                if rows.is_empty() {
                    return None;
                }
                let (owner, rule) = rows.remove(0);
                Some(SlotRules {
                    rule,
                    owner,
                    over: rows,
                })
            })
            .collect()
    }

    /// Calls `visit(slot, tier, rule)` for each rule of `kinds` that
    /// applies to `(tenant, resource)`, most specific tier first: the
    /// tenant's own rows, then its plan's, then the defaults. Slot order:
    /// kind (as `kinds` lists them), scope, then any-resource before the
    /// resource's own, then enforce before shadow.
    fn walk<'a>(
        &'a self,
        tenant: &str,
        resource: &str,
        kinds: &[Kind],
        mut visit: impl FnMut(usize, Tier, &'a Arc<Rule>),
    ) {
        let entry = if tenant.is_empty() {
            None
        } else {
            self.tenant(tenant)
        };
        let own: &[Arc<Rule>] = entry.map_or(&[], |e| &e.rules);
        let plan: &[Arc<Rule>] = entry
            .and_then(TenantEntry::plan)
            .and_then(|id| self.plans.get(id as usize)?.as_deref())
            .unwrap_or(&[]);
        let tiers = [
            (Tier::Tenant, own),
            (Tier::Plan, plan),
            (Tier::Default, &self.defaults[..]),
        ];
        for (tier, rules) in tiers {
            for rule in rules {
                let Some(k) = kinds.iter().position(|k| *k == rule.kind) else {
                    continue;
                };
                let specific = if rule.resource.is_empty() {
                    0
                } else if *rule.resource == *resource {
                    1
                } else {
                    continue;
                };
                visit(
                    k * 8 + rule.scope as usize * 4 + specific * 2 + rule.mode as usize,
                    tier,
                    rule,
                );
            }
        }
    }
}

/// Slots a request's rules fill: two kinds, two scopes, any-resource or
/// the resource's own, enforce or shadow.
const SLOTS: usize = 16;

/// Whose row a rule in force is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// The tenant's own row.
    Tenant,
    /// The row of the tenant's plan.
    Plan,
    /// A default row (tenant and plan empty).
    Default,
}

impl Tier {
    /// As the explain view names it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tenant => "tenant",
            Self::Plan => "plan",
            Self::Default => "default",
        }
    }
}

/// One slot of a request's rules: the row in force and the rows it won
/// over ([`RuleSet::explain`]).
#[derive(Debug, Clone)]
pub struct SlotRules<'a> {
    /// The rule in force.
    pub rule: &'a Arc<Rule>,
    /// Whose row it is.
    pub owner: Tier,
    /// Rows of less specific owners in the same slot, most specific first.
    pub over: Vec<(Tier, &'a Arc<Rule>)>,
}

/// A row the loader rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// The row's id in the table.
    pub id: i64,
    /// What is wrong, naming the row.
    pub error: RowError,
}

/// What one batch did, for the status and the log.
#[derive(Debug, Default)]
pub struct Applied {
    /// Whether the batch read the whole table.
    pub full: bool,
    /// Rows rejected by this batch that were not rejected before (each bad
    /// edit is logged once).
    pub newly_rejected: Vec<RowError>,
}

/// The state that turns batches of changes into snapshots: plan ids,
/// shared shapes, the rows rejected so far. Only the watcher touches it;
/// decisions never do.
#[derive(Debug)]
pub struct Loader {
    plan_ids: HashMap<Box<str>, u32>,
    plan_names: Vec<Box<str>>,
    /// Tenants assigned to each plan id.
    plan_tenants: Vec<u64>,
    shapes: HashSet<Arc<Shape>>,
    shapes_after_prune: usize,
    /// Billing cycles, shared by the tenants that have the same one.
    cycles: HashSet<Arc<Cycle>>,
    invalid: HashMap<Owner, Vec<Rejected>>,
    max_rules: usize,
}

impl Loader {
    /// A loader that keeps at most `max_rules` rules in force.
    pub fn new(max_rules: usize) -> Self {
        Self {
            plan_ids: HashMap::new(),
            plan_names: Vec::new(),
            plan_tenants: Vec::new(),
            shapes: HashSet::new(),
            shapes_after_prune: 0,
            cycles: HashSet::new(),
            invalid: HashMap::new(),
            max_rules,
        }
    }

    /// The most rules kept in force.
    pub fn max_rules(&self) -> usize {
        self.max_rules
    }

    /// Rows rejected and not fixed since, in id order (at most `limit`),
    /// and how many there are.
    pub fn rejected(&self, limit: usize) -> (Vec<String>, usize) {
        let mut all: Vec<&Rejected> = self.invalid.values().flatten().collect();
        all.sort_by_key(|r| r.id);
        let total = all.len();
        (
            all.into_iter()
                .take(limit)
                .map(|r| r.error.to_string())
                .collect(),
            total,
        )
    }

    /// Plans that tenants are assigned to but that do not exist, with how
    /// many tenants each (those tenants get the default rows).
    pub fn missing_plans(&self, set: &RuleSet) -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = self
            .plan_tenants
            .iter()
            .enumerate()
            .filter(|(id, n)| **n > 0 && set.plans.get(*id).is_none_or(Option::is_none))
            .map(|(id, n)| (self.plan_names[id].to_string(), *n))
            .collect();
        out.sort();
        out
    }

    /// The plan's name of an id.
    pub fn plan_name(&self, id: u32) -> Option<&str> {
        self.plan_names.get(id as usize).map(|s| &**s)
    }

    fn plan_id(&mut self, name: &str) -> u32 {
        if let Some(id) = self.plan_ids.get(name) {
            return *id;
        }
        let id = self.plan_names.len() as u32;
        self.plan_names.push(name.into());
        self.plan_tenants.push(0);
        self.plan_ids.insert(name.into(), id);
        id
    }

    fn intern_cycle(&mut self, cycle: Cycle) -> Arc<Cycle> {
        interned(&mut self.cycles, cycle)
    }

    fn intern(&mut self, shape: Shape) -> Arc<Shape> {
        interned(&mut self.shapes, shape)
    }

    /// Starts a batch on top of `base`: all of the table when `full`, else
    /// the state of `owners` (the owners that changed; each is replaced
    /// whole by what the batch then reads of it, so an owner with no rows
    /// read loses its rules).
    pub fn begin<'a>(
        &'a mut self,
        base: &'a RuleSet,
        full: bool,
        owners: Vec<Owner>,
    ) -> Update<'a> {
        let mut changed_tenants = HashMap::new();
        let mut changed_plans = HashMap::new();
        let previous_invalid = if full {
            self.plan_tenants.iter_mut().for_each(|n| *n = 0);
            std::mem::take(&mut self.invalid)
        } else {
            HashMap::new()
        };
        let mut defaults_changed = false;
        for owner in owners {
            match owner {
                Owner::Tenant(t) if t.is_empty() => defaults_changed = true,
                Owner::Tenant(t) => {
                    changed_tenants.insert(t, TenantChange::default());
                }
                Owner::Plan(p) => {
                    if check_label("plan", &p).is_ok() {
                        let id = self.plan_id(&p);
                        changed_plans.insert(id, PlanChange::default());
                    }
                }
            }
        }
        let rules = if full { 0 } else { base.rules };
        let assigned = self.plan_tenants.iter().sum();
        Update {
            loader: self,
            base,
            full,
            changed_tenants,
            changed_plans,
            defaults: None,
            defaults_changed,
            full_rules: if full {
                (0..SHARDS).map(|_| Vec::new()).collect()
            } else {
                Vec::new()
            },
            previous_invalid,
            full_assignments: if full {
                (0..SHARDS).map(|_| Vec::new()).collect()
            } else {
                Vec::new()
            },
            group: None,
            plan_rows: HashMap::new(),
            default_rows: Vec::new(),
            rules,
            assigned,
            newly_rejected: Vec::new(),
        }
    }
}

#[derive(Debug, Default)]
struct TenantChange {
    rules: Option<Rules>,
    plan: Option<u32>,
    cycle: CycleRead,
}

/// A `tenants` row as read while loading everything: the tenant, its plan
/// and its cycle.
type TenantRead = (Box<str>, Option<u32>, CycleRead);

/// A tenant's billing cycle as read: the default, a valid one, or a row
/// that does not validate (reported when the batch is built; the tenant
/// counts in UTC meanwhile).
#[derive(Debug, Default, Clone)]
enum CycleRead {
    #[default]
    Default,
    Valid(Arc<Cycle>),
    Invalid(String),
}

impl CycleRead {
    fn valid(&self) -> Option<Arc<Cycle>> {
        match self {
            Self::Valid(c) => Some(c.clone()),
            _ => None,
        }
    }
}

#[derive(Debug, Default)]
struct PlanChange {
    exists: bool,
    rules: Option<Rules>,
}

/// One batch being applied: feed it the plans that exist, then the rows
/// (grouped by owner), then the tenants' plan assignments; `finish` gives
/// the next snapshot.
pub struct Update<'a> {
    loader: &'a mut Loader,
    base: &'a RuleSet,
    full: bool,
    changed_tenants: HashMap<Box<str>, TenantChange>,
    changed_plans: HashMap<u32, PlanChange>,
    defaults: Option<Rules>,
    defaults_changed: bool,
    /// Loading everything: each shard's tenants' rules as read (in any
    /// order; `true` for a rejected row's last valid version), grouped by
    /// tenant at the end.
    full_rules: Vec<Vec<ReadRule>>,
    full_assignments: Vec<Vec<TenantRead>>,
    /// What was rejected before a full load, so each bad row is still
    /// logged once.
    previous_invalid: HashMap<Owner, Vec<Rejected>>,
    group: Option<(Owner, Vec<StoredRow>)>,
    plan_rows: HashMap<Box<str>, Vec<StoredRow>>,
    default_rows: Vec<StoredRow>,
    rules: usize,
    /// Tenants on a plan: with the rules, held within the bound.
    assigned: u64,
    newly_rejected: Vec<RowError>,
}

impl Update<'_> {
    /// A plan that exists (of the changed ones, or every one when full).
    pub fn plan(&mut self, name: &str) {
        if check_label("plan", name).is_err() {
            return;
        }
        let id = self.loader.plan_id(name);
        self.changed_plans.entry(id).or_default().exists = true;
    }

    /// A row of a changed owner (every row when full). When loading
    /// everything, rows may come in any order; otherwise a tenant's rows
    /// must come one after another (ordered by tenant). Plans' and the
    /// default rows may always come in any order.
    pub fn row(&mut self, row: StoredRow) {
        let owner = row.owner();
        match owner {
            Owner::Plan(plan) => {
                self.plan_rows.entry(plan).or_default().push(row);
                return;
            }
            Owner::Tenant(t) if t.is_empty() => {
                self.default_rows.push(row);
                return;
            }
            Owner::Tenant(t) if self.full => {
                self.full_row(t, row);
                return;
            }
            Owner::Tenant(_) => {}
        }
        match &mut self.group {
            Some((current, rows)) if *current == owner => rows.push(row),
            _ => {
                self.flush();
                self.group = Some((owner, vec![row]));
            }
        }
    }

    /// A tenant's `tenants` row: its plan ('' for none) and billing cycle
    /// (of the changed tenants, or every row when full).
    pub fn tenant(&mut self, row: TenantRow<'_>) {
        self.flush();
        let tenant = row.tenant;
        if tenant.is_empty() || check_label("tenant", tenant).is_err() {
            return;
        }
        if check_label("plan", row.plan).is_err() {
            return;
        }
        let plan = (!row.plan.is_empty()).then(|| self.loader.plan_id(row.plan));
        let cycle = if row.default_cycle() {
            CycleRead::Default
        } else {
            match row.cycle() {
                Ok(cycle) => CycleRead::Valid(self.loader.intern_cycle(cycle)),
                Err(reason) => CycleRead::Invalid(reason),
            }
        };
        if self.full {
            // Counted (and held to the bound) once every rule is.
            self.full_assignments[shard_of(tenant)].push((tenant.into(), plan, cycle));
        } else if let Some(change) = self.changed_tenants.get_mut(tenant) {
            change.plan = plan;
            change.cycle = cycle;
        }
    }

    /// A tenant's billing cycle that does not validate: reported; its
    /// quotas count calendar periods in UTC until it is fixed.
    fn reject_cycle(&mut self, tenant: &str, reason: &str) {
        let error = RowError {
            row: format!("tenants row (tenant {:?})", super::short(tenant)),
            reason: format!("{reason}; its quotas count periods in UTC until this is fixed"),
        };
        self.reject_tenant_row(tenant, error);
    }

    /// Reports a `tenants` row not in force (logged once, listed).
    fn reject_tenant_row(&mut self, tenant: &str, error: RowError) {
        self.newly_rejected.push(error.clone());
        self.loader
            .invalid
            .entry(Owner::Tenant(tenant.into()))
            .or_default()
            .push(Rejected { id: 0, error });
    }

    /// One tenant row while loading everything.
    fn full_row(&mut self, tenant: Box<str>, row: StoredRow) {
        let shard = shard_of(&tenant);
        let over = self.rules >= self.loader.max_rules;
        let checked = if over {
            Err(self.over_bound())
        } else {
            row.shape()
        };
        match checked {
            Ok(shape) => {
                let shape = self.loader.intern(shape);
                let rule = Arc::new(Rule::new(row.id, &row.name, shape));
                self.full_rules[shard].push((tenant, rule, false));
                self.rules += 1;
            }
            Err(reason) => {
                let kept = (!over && row.id != 0)
                    .then(|| self.base.tenant(&tenant))
                    .flatten()
                    .and_then(|e| e.rules.iter().find(|r| r.id == row.id))
                    .cloned();
                let owner = Owner::Tenant(tenant.clone());
                let bad = Rejected {
                    id: row.id,
                    error: row.error(reason),
                };
                if self
                    .previous_invalid
                    .get(&owner)
                    .is_none_or(|b| !b.contains(&bad))
                {
                    self.newly_rejected.push(bad.error.clone());
                }
                self.loader.invalid.entry(owner).or_default().push(bad);
                if let Some(rule) = kept {
                    self.full_rules[shard].push((tenant, rule, true));
                    self.rules += 1;
                }
            }
        }
    }

    /// Whether one more tenant on a plan would pass the bound.
    fn over_bound_with_one_more(&self) -> bool {
        (self.rules as u64).saturating_add(self.assigned) >= self.loader.max_rules as u64
    }

    /// A plan assignment over the bound: the tenant keeps what it had
    /// (nothing, when loading everything), and the row is reported.
    fn reject_assignment(&mut self, tenant: &str, plan: &str) {
        let error = RowError {
            row: format!(
                "tenants row (tenant {:?}, plan {:?})",
                super::short(tenant),
                super::short(plan)
            ),
            reason: format!(
                "the limits and tenants tables hold more rules and plan assignments than this \
                 instance keeps in memory (--max-limit-rows {}); the assignment is not in force",
                self.loader.max_rules
            ),
        };
        self.reject_tenant_row(tenant, error);
    }

    fn over_bound(&self) -> String {
        format!(
            "the limits table holds more rules than this instance keeps in memory \
             (--max-limit-rows {}); the row is not in force",
            self.loader.max_rules
        )
    }

    /// Validates the group of rows read last into its owner's rules.
    fn flush(&mut self) {
        let Some((owner, rows)) = self.group.take() else {
            return;
        };
        let (old, plan_missing): (&[Arc<Rule>], bool) = match &owner {
            Owner::Tenant(t) if t.is_empty() => (&self.base.defaults, false),
            Owner::Tenant(t) => (self.base.tenant(t).map_or(&[], |e| &e.rules), false),
            Owner::Plan(p) => {
                let id = self.loader.plan_ids.get(p).copied();
                let exists = id
                    .and_then(|id| self.changed_plans.get(&id))
                    .is_some_and(|c| c.exists);
                let old = id
                    .and_then(|id| self.base.plans.get(id as usize)?.as_deref())
                    .unwrap_or(&[]);
                (old, !exists)
            }
        };
        let mut rejected = Vec::new();
        let mut valid: Vec<Arc<Rule>> = Vec::with_capacity(rows.len());
        for row in &rows {
            if plan_missing {
                let reason = format!(
                    "plan {:?} does not exist; create it with `tollgate plans create {}`",
                    super::short(&row.plan),
                    super::short(&row.plan)
                );
                rejected.push(Rejected {
                    id: row.id,
                    error: row.error(reason),
                });
                continue;
            }
            match row.shape() {
                Ok(shape) => {
                    let shape = self.loader.intern(shape);
                    valid.push(Arc::new(Rule::new(row.id, &row.name, shape)));
                }
                Err(reason) => rejected.push(Rejected {
                    id: row.id,
                    error: row.error(reason),
                }),
            }
        }
        // An invalid row keeps its last valid version in force.
        let kept: Vec<Arc<Rule>> = rejected
            .iter()
            .filter_map(|bad| old.iter().find(|r| r.id == bad.id && bad.id != 0))
            .cloned()
            .collect();
        let mut taken: HashSet<(&str, usize)> = HashSet::new();
        let mut rules = Vec::with_capacity(valid.len() + kept.len());
        for (rule, is_kept) in valid
            .iter()
            .map(|r| (r, false))
            .chain(kept.iter().map(|r| (r, true)))
        {
            let slot = slot_index(rule.scope, rule.mode, rule.kind);
            if taken.insert((&rule.resource, slot)) {
                rules.push(rule.clone());
            } else if !is_kept {
                let row = rows
                    .iter()
                    .find(|r| r.id == rule.id && *r.name == *rule.name);
                if let Some(row) = row {
                    rejected.push(Rejected {
                        id: row.id,
                        error: row.error(
                            "another row already covers the same owner, resource, scope, mode and kind"
                                .into(),
                        ),
                    });
                }
            }
        }
        let old_len = if self.full { 0 } else { old.len() };
        let rules: Rules = if self
            .rules
            .saturating_sub(old_len)
            .saturating_add(rules.len())
            > self.loader.max_rules
        {
            // Over the bound: the owner keeps what it had (nothing, when
            // loading everything), and its new rows are reported.
            for row in &rows {
                if !rejected.iter().any(|r| r.id == row.id) {
                    rejected.push(Rejected {
                        id: row.id,
                        error: row.error(self.over_bound()),
                    });
                }
            }
            if self.full {
                Box::default()
            } else {
                old.into()
            }
        } else {
            rules.into()
        };
        self.record_rejected(&owner, rejected);
        match owner {
            Owner::Tenant(t) if t.is_empty() => self.defaults = Some(rules),
            Owner::Tenant(t) => {
                // Plans and the defaults are counted in `finish`.
                self.rules = self.rules - old_len + rules.len();
                if let Some(change) = self.changed_tenants.get_mut(&t) {
                    change.rules = Some(rules);
                }
            }
            Owner::Plan(p) => {
                if let Some(change) = self
                    .loader
                    .plan_ids
                    .get(&p)
                    .and_then(|id| self.changed_plans.get_mut(id))
                {
                    change.rules = Some(rules);
                }
            }
        }
    }

    fn record_rejected(&mut self, owner: &Owner, rejected: Vec<Rejected>) {
        let before = if self.full {
            self.previous_invalid.get(owner)
        } else {
            self.loader.invalid.get(owner)
        };
        for bad in &rejected {
            if before.is_none_or(|b| !b.contains(bad)) {
                self.newly_rejected.push(bad.error.clone());
            }
        }
        if rejected.is_empty() {
            self.loader.invalid.remove(owner);
        } else {
            self.loader.invalid.insert(owner.clone(), rejected);
        }
    }

    /// The next snapshot, and what the batch did.
    pub fn finish(mut self) -> (RuleSet, Applied) {
        self.flush();
        let defaults = std::mem::take(&mut self.default_rows);
        if !defaults.is_empty() {
            self.group = Some((Owner::Tenant("".into()), defaults));
            self.flush();
        }
        for (plan, rows) in std::mem::take(&mut self.plan_rows) {
            self.group = Some((Owner::Plan(plan), rows));
            self.flush();
        }
        let base = self.base;
        // Changed owners with no rows read lost their rows: clear what was
        // reported about them.
        if !self.full {
            for t in self.changed_tenants.keys() {
                if let Some(TenantChange { rules: None, .. }) = self.changed_tenants.get(t) {
                    self.loader.invalid.remove(&Owner::Tenant(t.clone()));
                }
            }
        }
        let names: Vec<(u32, Box<str>)> = self
            .changed_plans
            .iter()
            .filter(|(_, c)| c.rules.is_none())
            .map(|(id, _)| (*id, self.loader.plan_names[*id as usize].clone()))
            .collect();
        for (_, name) in names {
            self.loader.invalid.remove(&Owner::Plan(name));
        }
        let mut plans: Vec<Option<Rules>> = if self.full {
            Vec::new()
        } else {
            base.plans.to_vec()
        };
        plans.resize(self.loader.plan_names.len(), None);
        for (id, change) in std::mem::take(&mut self.changed_plans) {
            let old_len = if self.full {
                0
            } else {
                plans[id as usize].as_ref().map_or(0, |r| r.len())
            };
            let rules = change.exists.then(|| change.rules.unwrap_or_default());
            self.rules = self.rules - old_len + rules.as_ref().map_or(0, |r| r.len());
            plans[id as usize] = rules;
        }
        let defaults = match self.defaults.take() {
            Some(d) => Some(d),
            None if self.full || self.defaults_changed => Some(Box::default()),
            None => None,
        };
        let defaults = match defaults {
            Some(d) => {
                let old_len = if self.full { 0 } else { base.defaults.len() };
                self.rules = self.rules - old_len + d.len();
                d
            }
            None => base.defaults.clone(),
        };
        let (shards, tenants) = if self.full {
            self.full_shards_built()
        } else {
            self.changed_shards_built()
        };
        if self.full || self.loader.shapes.len() > 2 * self.loader.shapes_after_prune + 64 {
            self.loader.shapes.retain(|s| Arc::strong_count(s) > 1);
            self.loader.shapes_after_prune = self.loader.shapes.len();
            self.loader.cycles.retain(|c| Arc::strong_count(c) > 1);
        }
        let set = RuleSet {
            defaults,
            plans: plans.into(),
            shards,
            rules: self.rules,
            tenants,
        };
        (
            set,
            Applied {
                full: self.full,
                newly_rejected: self.newly_rejected,
            },
        )
    }

    fn full_shards_built(&mut self) -> (Arc<[Arc<[TenantEntry]>]>, usize) {
        let mut tenants = 0;
        let shards = std::mem::take(&mut self.full_rules)
            .into_iter()
            .zip(std::mem::take(&mut self.full_assignments))
            .map(|(mut rules, mut assigned)| {
                // By tenant, each tenant's valid rules before kept ones.
                rules.sort_by(|a, b| key_of(&a.0).cmp(&key_of(&b.0)).then(a.2.cmp(&b.2)));
                let mut entries: Vec<TenantEntry> = Vec::new();
                let mut group: Vec<Arc<Rule>> = Vec::new();
                let mut rules = rules.into_iter().peekable();
                while let Some((name, rule, kept)) = rules.next() {
                    // A kept version only fills a slot no valid row took.
                    let slot = slot_index(rule.scope, rule.mode, rule.kind);
                    let taken = group.iter().any(|r| {
                        slot_index(r.scope, r.mode, r.kind) == slot && r.resource == rule.resource
                    });
                    if !taken {
                        group.push(rule);
                    } else {
                        self.rules -= 1;
                        if !kept {
                            let error = RowError {
                                row: format!(
                                    "row {:?} (tenant {:?}, resource {:?}, scope {:?})",
                                    super::short(&rule.name),
                                    super::short(&name),
                                    rule.resource,
                                    rule.scope.as_str()
                                ),
                                reason: "another row already covers the same owner, resource, \
                                         scope, mode and kind"
                                    .into(),
                            };
                            self.newly_rejected.push(error.clone());
                            self.loader
                                .invalid
                                .entry(Owner::Tenant(name.clone()))
                                .or_default()
                                .push(Rejected { id: rule.id, error });
                        }
                    }
                    if rules.peek().is_none_or(|next| next.0 != name) {
                        entries.push(TenantEntry::new(
                            name,
                            None,
                            std::mem::take(&mut group).into(),
                            None,
                        ));
                    }
                }
                assigned.sort_unstable_by(|a, b| key_of(&a.0).cmp(&key_of(&b.0)));
                let mut extra = Vec::new();
                for (name, plan, cycle) in assigned {
                    if let CycleRead::Invalid(reason) = &cycle {
                        self.reject_cycle(&name, reason);
                    }
                    let plan = match plan {
                        Some(p) if self.over_bound_with_one_more() => {
                            let plan = self.loader.plan_names[p as usize].clone();
                            self.reject_assignment(&name, &plan);
                            None
                        }
                        Some(p) => {
                            self.loader.plan_tenants[p as usize] += 1;
                            self.assigned += 1;
                            Some(p)
                        }
                        None => None,
                    };
                    let cycle = cycle.valid();
                    match entries.binary_search_by(|e| e.key().cmp(&key_of(&name))) {
                        Ok(i) => {
                            entries[i].plan = plan.unwrap_or(NO_PLAN);
                            entries[i].cycle = cycle;
                        }
                        Err(_) if plan.is_some() || cycle.is_some() => {
                            extra.push(TenantEntry::new(name, plan, Box::default(), cycle));
                        }
                        Err(_) => {}
                    }
                }
                if !extra.is_empty() {
                    entries.extend(extra);
                    entries.sort_unstable_by(|a, b| a.key().cmp(&b.key()));
                }
                tenants += entries.len();
                Arc::from(entries)
            })
            .collect();
        (shards, tenants)
    }

    fn changed_shards_built(&mut self) -> (Arc<[Arc<[TenantEntry]>]>, usize) {
        let base = self.base;
        let mut tenants = base.tenants;
        let mut by_shard: HashMap<usize, Vec<(Box<str>, TenantChange)>> = HashMap::new();
        for (name, change) in std::mem::take(&mut self.changed_tenants) {
            by_shard
                .entry(shard_of(&name))
                .or_default()
                .push((name, change));
        }
        // Tenants leaving a plan (or moving) make room before any joins, so
        // the order shards are rebuilt in never decides who fits the bound.
        for change in by_shard.values().flatten() {
            if base.tenant(&change.0).and_then(TenantEntry::plan).is_some() {
                self.assigned -= 1;
            }
        }
        let mut shards: Vec<Arc<[TenantEntry]>> = base.shards.to_vec();
        for (shard, mut changes) in by_shard {
            changes.sort_unstable_by(|a, b| key_of(&a.0).cmp(&key_of(&b.0)));
            let old = &base.shards[shard];
            let mut next = Vec::with_capacity(old.len() + changes.len());
            let mut i = 0;
            for (name, mut change) in changes {
                while i < old.len() && old[i].key() < key_of(&name) {
                    next.push(old[i].clone());
                    i += 1;
                }
                let previous = (i < old.len() && old[i].name == name).then(|| {
                    i += 1;
                    &old[i - 1]
                });
                let was = previous.and_then(TenantEntry::plan);
                if let Some(p) = change.plan
                    && self.over_bound_with_one_more()
                {
                    let plan = self.loader.plan_names[p as usize].clone();
                    self.reject_assignment(&name, &plan);
                    // It keeps the plan it had, if any: that room is its own.
                    change.plan = was;
                }
                if let Some(p) = was {
                    // (Counted out of `assigned` above.)
                    self.loader.plan_tenants[p as usize] -= 1;
                }
                if let Some(p) = change.plan {
                    self.loader.plan_tenants[p as usize] += 1;
                    self.assigned += 1;
                }
                if let (None, Some(p)) = (&change.rules, previous) {
                    // No rows read: the tenant's rows are all gone.
                    self.rules -= p.rules.len();
                }
                if let CycleRead::Invalid(reason) = &change.cycle {
                    self.reject_cycle(&name, reason);
                }
                let cycle = change.cycle.valid();
                let rules = change.rules.unwrap_or_default();
                tenants -= usize::from(previous.is_some());
                if !rules.is_empty() || change.plan.is_some() || cycle.is_some() {
                    tenants += 1;
                    next.push(TenantEntry::new(name, change.plan, rules, cycle));
                }
            }
            next.extend(old[i..].iter().cloned());
            shards[shard] = Arc::from(next);
        }
        (shards.into(), tenants)
    }
}

/// The value equal to `value` in `set`, added when there is none: one
/// shared copy of each shape or cycle, however many rules or tenants hold it.
fn interned<T: std::hash::Hash + Eq>(set: &mut HashSet<Arc<T>>, value: T) -> Arc<T> {
    if let Some(shared) = set.get(&value) {
        return shared.clone();
    }
    let shared = Arc::new(value);
    set.insert(shared.clone());
    shared
}

fn slot_index(scope: Scope, mode: Mode, kind: Kind) -> usize {
    kind as usize * 4 + scope as usize * 2 + mode as usize
}
