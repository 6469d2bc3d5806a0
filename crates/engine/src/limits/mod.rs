//! Limits as data: the rules that say how much each tenant may spend.
//!
//! Rows come from the limits table ([`table`]) as [`StoredRow`]s, the text
//! a database client wrote, and are validated one by one into [`Rule`]s,
//! which cannot hold a bad value. Rows written by Tollgate itself are typed
//! [`LimitRow`]s. A [`RuleSet`] ([`rules`]) is one snapshot of every rule in
//! force, indexed for the hot path; [`watch`] keeps it current by reading
//! only what changed.
//!
//! A row belongs to one owner: a tenant (`tenant = 'acme'`), a plan
//! (`plan = 'pro'`: a named set of rules that tenants are assigned to), or
//! the defaults (both empty). Which rules apply to a request for
//! `(tenant, resource)`: for each scope
//! (`key`: one bucket per key; `tenant`: one ceiling shared by all the
//! tenant's keys) there are two slots:
//!
//! - the any-resource slot (rows with `resource = ''`), which every request
//!   of the tenant meets, and
//! - the resource slot (rows with `resource` equal to the request's), which
//!   only requests for that resource meet, on top of the any-resource one.
//!
//! In each slot the most specific row wins: the tenant's own row, else its
//! plan's row, else the default row. Each slot holds one enforced rule and, next
//! to it, optionally one shadow rule (to try a new limit on live traffic
//! before enforcing it), with a bucket of its own. So a request meets at
//! most four enforced rules, and all of them must admit it.

pub mod file;
pub mod rules;
pub mod table;
pub mod watch;

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::algorithm::alerts::Alerts;
use crate::algorithm::calendar::Period;
use crate::algorithm::{Limit, Rate, RateUnit};

pub use rules::{Owner, RuleSet};

/// Longest tenant or resource name, in bytes.
pub const MAX_LABEL_LEN: usize = 128;

/// Checks a tenant or resource name: at most [`MAX_LABEL_LEN`] bytes of
/// ASCII letters, digits, `.`, `_` and `-` (empty is allowed and means
/// "default" or "any").
pub fn check_label(what: &str, value: &str) -> Result<(), String> {
    check_label_named(value, || what.to_owned())
}

/// [`check_label`] for a name that costs something to build (`items[3].tenant`):
/// `what` runs only when the value is bad.
pub fn check_label_named(value: &str, what: impl FnOnce() -> String) -> Result<(), String> {
    if value.len() > MAX_LABEL_LEN {
        return Err(format!(
            "{} is {} bytes; at most {MAX_LABEL_LEN} are allowed",
            what(),
            value.len()
        ));
    }
    let allowed = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-');
    if !value.bytes().all(allowed) {
        let bad = value
            .chars()
            .find(|c| !c.is_ascii() || !allowed(*c as u8))
            .unwrap_or_default();
        return Err(format!(
            "{} {value:?} contains {bad:?}; use ASCII letters, digits, '.', '_' and '-'",
            what()
        ));
    }
    Ok(())
}

/// Who shares a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// One bucket per key (a row's default).
    #[default]
    Key,
    /// One bucket shared by all the tenant's keys: a ceiling.
    Tenant,
}

impl Scope {
    /// As written in the table.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Key => "key",
            Self::Tenant => "tenant",
        }
    }
}

/// What a rule limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// How fast tokens are spent: a token bucket of `burst` refilled at
    /// `rate` (a row's default).
    #[default]
    Rate,
    /// How much runs at once: at most `burst` leases held together
    /// (`rate` is not used).
    Concurrency,
    /// How much per calendar period: `rate` is the count per day, week,
    /// month or year of the tenant's billing cycle (`burst` is 0 or that
    /// count).
    Quota,
}

impl Kind {
    /// As written in the table.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Rate => "rate",
            Self::Concurrency => "concurrency",
            Self::Quota => "quota",
        }
    }
}

impl std::str::FromStr for Kind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_enum(
            "kind",
            s,
            &[
                ("rate", Self::Rate),
                ("concurrency", Self::Concurrency),
                ("quota", Self::Quota),
            ],
        )
    }
}

/// Each column's default as the table writes it, for the sources of rows
/// that may leave a column out (files, the admin API, `limits set`): the
/// `Default` of the column's type, so it is declared once.
pub mod column_default {
    use super::{Kind, Mode, OnStoreUnavailable, Scope};
    use crate::algorithm::RateUnit;

    /// `key`.
    pub fn scope() -> String {
        Scope::default().as_str().into()
    }
    /// `rate`.
    pub fn kind() -> String {
        Kind::default().as_str().into()
    }
    /// `enforce`.
    pub fn mode() -> String {
        Mode::default().as_str().into()
    }
    /// `allow`.
    pub fn on_store_unavailable() -> String {
        super::policy_str(OnStoreUnavailable::default()).into()
    }
    /// `second`.
    pub fn rate_unit() -> String {
        RateUnit::default().as_str().into()
    }
}

/// Whether a rule rejects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Rejects requests over the limit (a row's default).
    #[default]
    Enforce,
    /// Never rejects; reports `shadow: true` when it would have.
    Shadow,
}

pub use crate::store::OnStoreUnavailable;

/// The value named `value` among `allowed` (as written in the table), or
/// an error listing them.
fn parse_enum<T: Copy>(what: &str, value: &str, allowed: &[(&str, T)]) -> Result<T, String> {
    allowed
        .iter()
        .find(|(name, _)| *name == value)
        .map(|(_, v)| *v)
        .ok_or_else(|| {
            let names: Vec<&str> = allowed.iter().map(|(n, _)| *n).collect();
            format!(
                "{what} is {:?}; it must be one of {}",
                short(value),
                names.join(", ")
            )
        })
}

/// One row of the limits table as stored: text and numbers, exactly as a
/// database client may have written them. [`StoredRow::validate`] turns it
/// into a [`Rule`], or says what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredRow {
    /// The table's id of the row (0 for a row not read from a table).
    #[serde(skip)]
    pub id: i64,
    /// The row's unique name; reported as `limit_name` when it decides.
    pub name: String,
    /// The tenant the row applies to; '' for a plan's or the default rows.
    pub tenant: String,
    /// The plan the row belongs to; '' for a tenant's or the default rows.
    #[serde(default)]
    pub plan: String,
    /// The resource the row applies to; '' for any resource.
    pub resource: String,
    /// `key` or `tenant`.
    pub scope: String,
    /// Capacity: the largest burst.
    pub burst: i64,
    /// Sustained rate: tokens per `rate_unit`.
    pub rate: i64,
    /// `second`, `minute`, `hour`, `day`, `week`, `month` or `year`.
    pub rate_unit: String,
    /// `enforce` or `shadow`.
    pub mode: String,
    /// `allow`, `deny` or `local`.
    pub on_store_unavailable: String,
    /// How many tokens below zero usage charged after the work (Charge,
    /// Settle) may take a bucket; 0 for none.
    #[serde(default)]
    pub debt: i64,
    /// `rate` (a token bucket) or `concurrency` (at most `burst` leases
    /// held at once).
    #[serde(default = "column_default::kind")]
    pub kind: String,
    /// A quota's alert thresholds, in percent of its count (`50,80,100`);
    /// '' for none.
    #[serde(default)]
    pub alerts: String,
    /// When the row last changed (set by the table).
    #[serde(default)]
    pub updated_at: String,
}

/// One row of the limits table, typed: what `tollgate limits set` and
/// `POST /v1/limits` write. [`LimitRow::validate`] checks what the types
/// cannot (names, label characters, the limit's range).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitRow {
    /// The row's unique name; reported as `limit_name` when it decides.
    pub name: String,
    /// The tenant the row applies to; '' for a plan's or the default rows.
    pub tenant: String,
    /// The plan the row belongs to; '' for a tenant's or the default rows.
    pub plan: String,
    /// The resource the row applies to; '' for any resource.
    pub resource: String,
    /// Who shares a bucket.
    pub scope: Scope,
    /// Capacity: the largest burst.
    pub burst: u64,
    /// Sustained rate.
    pub rate: Rate,
    /// Enforce or shadow.
    pub mode: Mode,
    /// Behaviour when the shared store is down.
    pub on_store_unavailable: OnStoreUnavailable,
    /// Tokens below zero that charges after the work may reach.
    pub debt: u64,
    /// Rate or concurrency.
    pub kind: Kind,
    /// A quota's alert thresholds.
    pub alerts: Alerts,
}

impl std::str::FromStr for Scope {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_enum("scope", s, &[("key", Self::Key), ("tenant", Self::Tenant)])
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_enum(
            "mode",
            s,
            &[("enforce", Self::Enforce), ("shadow", Self::Shadow)],
        )
    }
}

impl Mode {
    /// As written in the table.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Enforce => "enforce",
            Self::Shadow => "shadow",
        }
    }
}

/// `allow`, `deny` or `local`, as written in the table.
pub const fn policy_str(policy: OnStoreUnavailable) -> &'static str {
    match policy {
        OnStoreUnavailable::Allow => "allow",
        OnStoreUnavailable::Deny => "deny",
        OnStoreUnavailable::Local => "local",
    }
}

impl LimitRow {
    /// A row as `tollgate limits set` and `POST /v1/limits` describe it:
    /// the rate as `N/unit` (empty for a concurrency row), and a name that
    /// defaults to `TENANT-RESOURCE-SCOPE` (`default`/`any` for empty
    /// parts, `-concurrency` added for concurrency rows and `-shadow` for
    /// shadow rows). Validate it before storing it.
    #[allow(clippy::too_many_arguments)]
    pub fn from_request(
        tenant: String,
        resource: String,
        scope: &str,
        burst: i64,
        rate: &str,
        mode: &str,
        on_store_unavailable: &str,
        debt: i64,
        kind: &str,
        name: Option<String>,
    ) -> Result<Self, String> {
        let kind: Kind = kind.parse()?;
        let rate: Rate = match (kind, rate.trim()) {
            (Kind::Concurrency, "") => Rate {
                count: 0,
                unit: RateUnit::Second,
            },
            _ => rate.parse()?,
        };
        let debt = u64::try_from(debt)
            .map_err(|_| format!("debt is {debt}; it must be 0 (no debt) or more"))?;
        let scope: Scope = scope.parse()?;
        let mode: Mode = mode.parse()?;
        let on_store_unavailable = on_store_unavailable.parse()?;
        let burst =
            u64::try_from(burst).map_err(|_| format!("burst is {burst}; it must be at least 1"))?;
        let or = |s: &str, d: &str| {
            if s.is_empty() {
                d.to_owned()
            } else {
                s.to_owned()
            }
        };
        let name = name
            .unwrap_or_else(|| default_name(&or(&tenant, "default"), &resource, scope, kind, mode));
        Ok(Self {
            name,
            tenant,
            plan: String::new(),
            resource,
            scope,
            burst,
            rate,
            mode,
            on_store_unavailable,
            debt,
            kind,
            alerts: Alerts::NONE,
        })
    }

    /// The same row with alert thresholds (a quota's only: validation
    /// refuses them on other rows).
    pub fn with_alerts(mut self, alerts: Alerts) -> Self {
        self.alerts = alerts;
        self
    }

    /// The same row for plan `plan` instead of a tenant; unless `named`,
    /// its default name starts `plan-PLAN-` instead of the tenant's part.
    pub fn for_plan(mut self, plan: String, named: bool) -> Self {
        if !named && !plan.is_empty() {
            let owner = format!("plan-{plan}");
            self.name = default_name(&owner, &self.resource, self.scope, self.kind, self.mode);
        }
        self.plan = plan;
        self
    }

    /// The row as the table stores it.
    pub fn stored(&self) -> StoredRow {
        StoredRow {
            id: 0,
            name: self.name.clone(),
            tenant: self.tenant.clone(),
            plan: self.plan.clone(),
            resource: self.resource.clone(),
            scope: self.scope.as_str().into(),
            burst: i64::try_from(self.burst).unwrap_or(i64::MAX),
            rate: i64::try_from(self.rate.count).unwrap_or(i64::MAX),
            rate_unit: self.rate.unit.as_str().into(),
            mode: self.mode.as_str().into(),
            on_store_unavailable: policy_str(self.on_store_unavailable).into(),
            debt: i64::try_from(self.debt).unwrap_or(i64::MAX),
            kind: self.kind.as_str().into(),
            alerts: self.alerts.to_string(),
            updated_at: String::new(),
        }
    }

    /// Validates the row into a [`Rule`]. The error names the row.
    pub fn validate(&self) -> Result<Rule, RowError> {
        self.shape()
            .map(|shape| Rule::new(0, &self.name, Arc::new(shape)))
            .map_err(|reason| RowError {
                row: self.stored().describe(),
                reason,
            })
    }

    /// Everything of the rule but its name, checked.
    fn shape(&self) -> Result<Shape, String> {
        TypedRow {
            name: &self.name,
            tenant: &self.tenant,
            plan: &self.plan,
            resource: &self.resource,
            scope: self.scope,
            burst: self.burst,
            rate: self.rate,
            mode: self.mode,
            on_store_unavailable: self.on_store_unavailable,
            debt: self.debt,
            kind: self.kind,
            alerts: self.alerts,
        }
        .shape()
    }
}

/// `OWNER-RESOURCE-SCOPE`, with `any` for no resource, `-concurrency` for
/// a concurrency row, `-quota` for a quota and `-shadow` for a shadow row.
fn default_name(owner: &str, resource: &str, scope: Scope, kind: Kind, mode: Mode) -> String {
    let resource = if resource.is_empty() { "any" } else { resource };
    let kind = match kind {
        Kind::Rate => "",
        Kind::Concurrency => "-concurrency",
        Kind::Quota => "-quota",
    };
    let shadow = if mode == Mode::Shadow { "-shadow" } else { "" };
    format!("{owner}-{resource}-{}{kind}{shadow}", scope.as_str())
}

impl TryFrom<&StoredRow> for LimitRow {
    type Error = String;

    /// Reads the stored text into types; says which column is wrong.
    fn try_from(row: &StoredRow) -> Result<Self, String> {
        let t = row.typed()?;
        Ok(Self {
            name: t.name.to_owned(),
            tenant: t.tenant.to_owned(),
            plan: t.plan.to_owned(),
            resource: t.resource.to_owned(),
            scope: t.scope,
            burst: t.burst,
            rate: t.rate,
            mode: t.mode,
            on_store_unavailable: t.on_store_unavailable,
            debt: t.debt,
            kind: t.kind,
            alerts: t.alerts,
        })
    }
}

/// A row's columns in types, its text borrowed: what validation reads.
struct TypedRow<'a> {
    name: &'a str,
    tenant: &'a str,
    plan: &'a str,
    resource: &'a str,
    scope: Scope,
    burst: u64,
    rate: Rate,
    mode: Mode,
    on_store_unavailable: OnStoreUnavailable,
    debt: u64,
    kind: Kind,
    alerts: Alerts,
}

impl TypedRow<'_> {
    /// Everything of the rule but its name, checked.
    fn shape(&self) -> Result<Shape, String> {
        if self.name.trim().is_empty() {
            return Err("name is empty; every row needs a unique name".into());
        }
        check_label("tenant", self.tenant)?;
        check_label("plan", self.plan)?;
        // A name goes out in every answer's `limit_name` and in terminals:
        // the same characters and length as a tenant.
        check_label("name", self.name)?;
        if !self.tenant.is_empty() && !self.plan.is_empty() {
            return Err(format!(
                "the row names tenant {:?} and plan {:?}; a row belongs to a tenant or to a plan, \
                 not both (assign the tenant to the plan with `tollgate plans assign`)",
                short(self.tenant),
                short(self.plan)
            ));
        }
        check_label("resource", self.resource)?;
        let limit = match self.kind {
            Kind::Rate => Limit::new(self.burst, self.rate)
                .and_then(|l| l.with_debt(self.debt))
                .map_err(|e| e.to_string())?,
            Kind::Concurrency => {
                if self.debt != 0 {
                    return Err(
                        "debt must be 0 for a concurrency rule: a lease is one slot, \
                                never charged after the fact"
                            .into(),
                    );
                }
                if self.burst > crate::algorithm::MAX_CONCURRENCY {
                    return Err(format!(
                        "burst is {}; a concurrency rule allows at most {} leases at once",
                        self.burst,
                        crate::algorithm::MAX_CONCURRENCY
                    ));
                }
                Limit::concurrency(self.burst).map_err(|e| e.to_string())?
            }
            Kind::Quota => {
                let count = self.rate.count;
                if period_of(self.rate.unit).is_none() {
                    return Err(format!(
                        "a quota counts per day, week, month or year of the tenant's billing \
                         cycle; the rate's unit is {}",
                        self.rate.unit.as_str()
                    ));
                }
                if self.burst != 0 && self.burst != count {
                    return Err(format!(
                        "burst is {}; a quota's count is its rate ({count} per {}): leave burst 0 \
                         or make it {count}",
                        self.burst,
                        self.rate.unit.as_str()
                    ));
                }
                let bounds = crate::algorithm::calendar::Bounds {
                    start: 0,
                    end: self.rate.unit.micros(),
                };
                Limit::quota(count, bounds)
                    .and_then(|l| l.with_debt(self.debt))
                    .map_err(|e| e.to_string())?
                    .with_alerts(self.alerts)
            }
        };
        if self.kind != Kind::Quota && !self.alerts.is_empty() {
            return Err(format!(
                "alerts are {}; alert thresholds apply to quotas only (a rate or concurrency \
                 rule has no amount per period to reach): drop them or make the row a quota",
                self.alerts
            ));
        }
        let rate_text = match self.kind {
            Kind::Rate | Kind::Quota => self.rate.to_string(),
            Kind::Concurrency => format!("{} concurrent", self.burst),
        };
        Ok(Shape {
            resource: self.resource.into(),
            scope: self.scope,
            limit,
            rate: self.rate,
            rate_text: rate_text.into(),
            mode: self.mode,
            on_store_unavailable: self.on_store_unavailable,
            kind: self.kind,
        })
    }
}

impl StoredRow {
    /// Validates the row into a [`Rule`]. The error names the row.
    pub fn validate(&self) -> Result<Rule, RowError> {
        self.shape()
            .map(|shape| Rule::new(self.id, &self.name, Arc::new(shape)))
            .map_err(|reason| self.error(reason))
    }

    /// Everything of the rule but its name, checked.
    pub fn shape(&self) -> Result<Shape, String> {
        self.typed().and_then(|row| row.shape())
    }

    /// The row's columns read into types, borrowing its text.
    fn typed(&self) -> Result<TypedRow<'_>, String> {
        let unit = RateUnit::parse(&self.rate_unit).ok_or_else(|| {
            format!(
                "rate_unit is {:?}; it must be second, minute, hour, day, week, month or year",
                short(&self.rate_unit)
            )
        })?;
        Ok(TypedRow {
            name: &self.name,
            tenant: &self.tenant,
            plan: &self.plan,
            resource: &self.resource,
            scope: self.scope.parse()?,
            burst: u64::try_from(self.burst)
                .map_err(|_| format!("burst is {}; it must be at least 1", self.burst))?,
            rate: Rate {
                count: u64::try_from(self.rate)
                    .map_err(|_| format!("rate is {}; it must be at least 1", self.rate))?,
                unit,
            },
            mode: self.mode.parse()?,
            on_store_unavailable: self.on_store_unavailable.parse()?,
            debt: u64::try_from(self.debt)
                .map_err(|_| format!("debt is {}; it must be 0 (no debt) or more", self.debt))?,
            kind: self.kind.parse()?,
            alerts: self.alerts.parse()?,
        })
    }

    /// Whose rule the row is.
    pub fn owner(&self) -> Owner {
        Owner::of(&self.tenant, &self.plan)
    }

    /// An error about this row.
    pub fn error(&self, reason: String) -> RowError {
        RowError {
            row: self.describe(),
            reason,
        }
    }

    /// How error messages name this row; a hostile row (a 10 KB tenant
    /// name) is named by its start.
    pub fn describe(&self) -> String {
        let owner = if self.plan.is_empty() {
            format!("tenant {:?}", short(&self.tenant))
        } else if self.tenant.is_empty() {
            format!("plan {:?}", short(&self.plan))
        } else {
            format!(
                "tenant {:?}, plan {:?}",
                short(&self.tenant),
                short(&self.plan)
            )
        };
        format!(
            "row {:?} ({owner}, resource {:?}, scope {:?})",
            short(&self.name),
            short(&self.resource),
            short(&self.scope)
        )
    }
}

/// `s`, or its first [`MAX_LABEL_LEN`] bytes and its length when longer.
pub fn short(s: &str) -> String {
    if s.len() <= MAX_LABEL_LEN {
        return s.to_owned();
    }
    let end = (0..=MAX_LABEL_LEN)
        .rev()
        .find(|i| s.is_char_boundary(*i))
        .unwrap_or(0);
    format!("{}... ({} bytes)", &s[..end], s.len())
}

/// A row that failed validation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{row}: {reason}")]
pub struct RowError {
    /// Which row.
    pub row: String,
    /// What is wrong and how to fix it.
    pub reason: String,
}

/// Longest row name, in bytes (names follow the rules of tenants).
pub const MAX_NAME_LEN: usize = MAX_LABEL_LEN;

/// Everything a rule says but its name: shared by every rule of the same
/// shape (a million tenants on a few tiers hold a few shapes).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Shape {
    /// '' for any resource.
    pub resource: Box<str>,
    /// Who shares a bucket.
    pub scope: Scope,
    /// The bucket shape.
    pub limit: Limit,
    /// The rate as configured (for display).
    pub rate: Rate,
    /// `rate` rendered once (`100/second`), for every response that
    /// reports it.
    pub rate_text: Box<str>,
    /// Enforce or shadow.
    pub mode: Mode,
    /// Behaviour when the shared store is down.
    pub on_store_unavailable: OnStoreUnavailable,
    /// Rate or concurrency.
    pub kind: Kind,
}

/// A validated rule: a row's id and name, and its [`Shape`] (which the
/// rule derefs to: `rule.limit`, `rule.scope`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// The table's id of the row (0 when not read from a table).
    pub id: i64,
    /// Unique name.
    pub name: Box<str>,
    shape: Arc<Shape>,
}

impl Rule {
    /// A rule named `name` of row `id`.
    pub fn new(id: i64, name: &str, shape: Arc<Shape>) -> Self {
        Self {
            id,
            name: name.into(),
            shape,
        }
    }

    /// The shape, shared with every rule like it.
    pub fn shape(&self) -> &Arc<Shape> {
        &self.shape
    }
}

impl Deref for Rule {
    type Target = Shape;
    fn deref(&self) -> &Shape {
        &self.shape
    }
}

impl Shape {
    /// The scope part of this rule's bucket names: `k` or `t`, with an `s`
    /// added for shadow rules so they count in buckets of their own.
    /// A concurrency rule's sets are tagged `kc`, `kcs`, `tc` and `tcs`,
    /// and a quota's counters `kq`, `kqs`, `tq` and `tqs`, apart from
    /// every rate bucket.
    pub fn bucket_kind(&self) -> crate::store::BucketKind {
        let (per_key, shadow) = (self.scope == Scope::Key, self.mode == Mode::Shadow);
        match self.kind {
            Kind::Quota => crate::store::BucketKind::Quota { per_key, shadow },
            _ => crate::store::BucketKind::Rule {
                per_key,
                concurrency: self.kind == Kind::Concurrency,
                shadow,
            },
        }
    }

    /// A quota's period (`None` for every other kind).
    pub fn period(&self) -> Option<Period> {
        match self.kind {
            Kind::Quota => period_of(self.rate.unit),
            _ => None,
        }
    }
}

/// The calendar period of a rate unit, for quotas: a day, week, month or
/// year.
fn period_of(unit: RateUnit) -> Option<Period> {
    match unit {
        RateUnit::Day => Some(Period::Day),
        RateUnit::Week => Some(Period::Week),
        RateUnit::Month => Some(Period::Month),
        RateUnit::Year => Some(Period::Year),
        _ => None,
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.kind == Kind::Concurrency {
            return write!(
                f,
                "{} (at most {} in flight)",
                self.name,
                self.limit.burst()
            );
        }
        if self.kind == Kind::Quota {
            write!(f, "{} (quota {}", self.name, self.rate)?;
        } else {
            write!(
                f,
                "{} (burst {}, {}",
                self.name,
                self.limit.burst(),
                self.rate
            )?;
        }
        if self.limit.debt() > 0 {
            write!(f, ", debt {}", self.limit.debt())?;
        }
        if !self.limit.alerts().is_empty() {
            write!(f, ", alerts at {} %", self.limit.alerts())?;
        }
        f.write_str(")")
    }
}

#[cfg(test)]
mod tests;
