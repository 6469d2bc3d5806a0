//! The explain view: why a request gets the answer it gets.
//!
//! For a tenant's key (the native API's rules) or an Envoy domain and
//! descriptors (the Envoy API's rules), it reports every rule that applies
//! and why, each bucket's live state read from the store, what a request
//! of cost N would get now, and the key's most recent decisions. It never
//! writes: the state is one read of every bucket, the answer one dry run,
//! neither counted as a decision; a call's work is bounded by the rules one
//! request can meet (16 slots; Envoy's descriptor caps) and the recent
//! ring's slot. The admin wing maps it to `GET /v1/explain` and
//! `tollgate.v1.Admin/Explain`; the Envoy half is answered by the Envoy
//! wing through [`ExplainEnvoy`].

use std::sync::Arc;

use futures_util::future::BoxFuture;
use serde::Serialize;

use crate::algorithm::calendar::rfc3339;
use crate::algorithm::{Micros, Verdict};
use crate::engine::{
    Allowance, Answer, Api, DecideError, Demand, Engine, Item, Line, OverCapacity, caps,
};
use crate::limits::rules::Tier;
use crate::limits::table::LimitsTable;
use crate::limits::watch::LiveLimits;
use crate::limits::{Kind, Mode, Rule, check_label_named};
use crate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use crate::telemetry::recent::History;

/// A rule's limit as the table holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RuleLimit {
    /// `burst` (a concurrency cap's size; a quota's count per period).
    pub burst: u64,
    /// `rate` as written (`10/second`, `1000/month`; '' for a cap).
    pub rate: String,
    /// Tokens the bucket may go below zero.
    pub debt: u64,
}

/// A row a rule in force won over.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RowRef {
    /// The row's name.
    pub name: String,
    /// `tenant`, `plan` or `default`.
    pub owner: &'static str,
    /// Its limit.
    pub limit: RuleLimit,
}

/// A bucket's state now, and what the dry run did to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BucketState {
    /// The bucket's name in the store.
    pub bucket: String,
    /// Whole tokens now (a cap: slots free; a quota: left this period).
    pub remaining: u64,
    /// Tokens below zero (0: not in debt).
    pub debt: u64,
    /// Microseconds until the bucket is full again (a cap: until every
    /// lease held has expired; a quota: until the period ends).
    pub full_in_us: Micros,
    /// A concurrency cap: leases held now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub held: Option<u64>,
    /// A full concurrency cap: microseconds until a held lease expires
    /// (sooner if one is released).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_free_in_us: Option<Micros>,
    /// A quota: tokens counted this period (debt included).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub used: Option<u64>,
    /// A quota: when the period ends (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub period_end: Option<String>,
    /// The store was unavailable: the rule's store-down policy answered.
    pub degraded: bool,
    /// The dry run: whether this bucket would admit the cost asked.
    pub would_admit: bool,
    /// The dry run: tokens left after it (all or nothing: as now when the
    /// request would be refused, by this bucket or another).
    pub remaining_after: u64,
    /// The dry run: microseconds to wait before it would (0: admitted;
    /// absent: never, the cost exceeds the bucket).
    pub retry_after_us: Option<Micros>,
}

/// One limits-table rule that applies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ExplainedRule {
    /// The row's name.
    pub name: String,
    /// Whose row: `tenant` (the tenant's own), `plan` or `default`.
    pub owner: &'static str,
    /// `rate`, `concurrency` or `quota`.
    pub kind: &'static str,
    /// `key` (a bucket per key) or `tenant` (a ceiling).
    pub scope: &'static str,
    /// The resource of its slot ('' : any resource).
    pub resource: String,
    /// `enforce` or `shadow`.
    pub mode: &'static str,
    /// Its limit.
    pub limit: RuleLimit,
    /// The rows of its slot it won over, most specific first.
    pub won_over: Vec<RowRef>,
    /// Its bucket.
    pub state: BucketState,
}

/// What a request of the cost asked would get now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DryRun {
    /// Admitted.
    pub allowed: bool,
    /// The rule that decides ('' when none applies).
    pub rule: String,
    /// Tokens left in the tightest bucket after it.
    pub remaining: u64,
    /// Microseconds to wait (0: admitted; absent: never).
    pub retry_after_us: Option<Micros>,
    /// A shadow rule would refuse it.
    pub shadow: bool,
    /// The store was unavailable; the named policy answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub degraded: Option<&'static str>,
    /// The header fields the answer would carry (a JSON object).
    #[serde(serialize_with = "in_order")]
    pub headers: Vec<(String, String)>,
}

/// Name-value pairs as a JSON object, in their order.
fn in_order<S: serde::Serializer>(pairs: &[(String, String)], s: S) -> Result<S::Ok, S::Error> {
    s.collect_map(pairs.iter().map(|(k, v)| (k, v)))
}

/// One recorded decision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Decision {
    /// When (RFC 3339).
    pub at: String,
    /// Microseconds before the explanation was made.
    pub ago_us: Micros,
    /// `allowed`, `rejected`, `shadow_rejected`, `failed_open`, ...
    pub outcome: &'static str,
    /// The deciding rule.
    pub rule: String,
    /// Tokens asked for.
    pub cost: u64,
}

/// The recent decisions of a key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Recent {
    /// Newest first: every refusal, admissions sampled.
    pub decisions: Vec<Decision>,
    /// Admissions sampled out.
    pub admissions_not_shown: u64,
}

impl Recent {
    /// `history` as of `now`.
    pub fn of(history: History, now: Micros) -> Self {
        Self {
            decisions: history
                .decisions
                .into_iter()
                .map(|d| Decision {
                    at: rfc3339(d.at),
                    ago_us: now.saturating_sub(d.at),
                    outcome: d.outcome,
                    rule: d.rule,
                    cost: d.cost,
                })
                .collect(),
            admissions_not_shown: history.not_shown,
        }
    }
}

/// A native request explained.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Explanation {
    /// When (RFC 3339).
    pub at: String,
    /// The tenant.
    pub tenant: String,
    /// The key.
    pub key: String,
    /// The resource ('' : none).
    pub resource: String,
    /// The cost of the dry run.
    pub cost: u64,
    /// The tenant's plan ('' : none).
    pub plan: String,
    /// Every rule that applies: rates, concurrency caps, then quotas.
    pub rules: Vec<ExplainedRule>,
    /// What `ShouldAllow` of `cost` would answer now.
    pub dry_run: DryRun,
    /// The key's recent decisions.
    pub recent: Recent,
}

/// Why an explanation could not be made.
#[derive(Debug)]
pub enum ExplainError {
    /// A field is bad: the message says which and what to fix.
    Invalid(DecideError),
    /// The limits database did not answer.
    Unavailable(String),
}

impl From<DecideError> for ExplainError {
    fn from(e: DecideError) -> Self {
        Self::Invalid(e)
    }
}

/// What the engine needs to read to explain a demand: the state of its
/// lines' buckets (a read of cost nothing) and the dry run of its cost (on
/// the lines a decision meets).
pub struct Probe {
    /// Bucket names, per line of the read.
    pub buckets: Vec<String>,
    /// Per line of the read: its verdict and, for quotas, its period's end.
    pub state: Vec<(Verdict, Option<Micros>)>,
    /// The read's answer (its items carry the degraded flags).
    pub state_answer: Answer,
    /// The dry run's answer and header fields.
    pub dry: (Answer, Vec<(String, String)>),
}

/// Reads `state` (every line, cost nothing) and dry-runs `decide` (the
/// lines of a decision, with the cost asked) through `engine`: two store
/// calls, no write, nothing counted.
pub async fn probe(
    engine: &Engine,
    mut state: Demand<'_>,
    mut decide: Demand<'_>,
) -> Result<Probe, DecideError> {
    let buckets = state
        .lines
        .iter()
        .map(|l| l.bucket.as_str().to_owned())
        .collect();
    let state_answer = engine.read(&mut state).await?;
    let verdicts = state
        .lines
        .iter()
        .zip(&state_answer.lines)
        .map(|(line, v)| {
            let end = match line.allowance {
                Allowance::Limited(l) => l.period().map(|b| b.end),
                _ => None,
            };
            (*v, end)
        })
        .collect();
    let answer = engine.dry_run(&mut decide).await?;
    let fields = engine
        .header_fields(&decide, &answer, None)
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
    Ok(Probe {
        buckets,
        state: verdicts,
        state_answer,
        dry: (answer, fields),
    })
}

/// The state of a line's bucket: `now` from the read, `dry` from the dry
/// run (`None`: the dry run does not meet it; a concurrency cap reports
/// whether one more lease fits).
pub fn bucket_state(
    bucket: String,
    rule_kind: Kind,
    limit_burst: u64,
    now: (Verdict, Option<Micros>),
    dry: Option<Verdict>,
    degraded: bool,
) -> BucketState {
    let (v, period_end) = now;
    let dry = dry.unwrap_or(v);
    let concurrency = rule_kind == Kind::Concurrency;
    BucketState {
        bucket,
        remaining: v.remaining,
        debt: v.debt,
        full_in_us: v.reset_after,
        held: concurrency.then(|| limit_burst.saturating_sub(v.remaining)),
        next_free_in_us: (concurrency && !v.allowed).then_some(v.retry_after),
        used: (rule_kind == Kind::Quota)
            .then(|| limit_burst.saturating_sub(v.remaining.min(limit_burst)) + v.debt),
        period_end: period_end.map(rfc3339),
        degraded,
        would_admit: dry.allowed,
        remaining_after: dry.remaining,
        retry_after_us: finite(dry.retry_after),
    }
}

/// A wait, `None` when it is forever.
pub fn finite(us: Micros) -> Option<Micros> {
    (us != Micros::MAX).then_some(us)
}

/// The dry run's summary from its answer: its first refused item's
/// figures, or the first item's.
pub fn dry_run(answer: &Answer, headers: Vec<(String, String)>, rule: String) -> DryRun {
    let item = answer
        .items
        .iter()
        .find(|i| !i.allowed)
        .or(answer.items.first());
    DryRun {
        allowed: answer.allowed,
        rule,
        remaining: item.map_or(0, |i| i.remaining),
        retry_after_us: match item {
            Some(i) if !answer.allowed => finite(i.retry_after),
            _ => finite(answer.retry_after),
        },
        shadow: item.is_some_and(|i| i.shadow),
        degraded: item.and_then(|i| i.degraded).map(|p| match p {
            crate::engine::OnStoreUnavailable::Allow => "allow",
            crate::engine::OnStoreUnavailable::Deny => "deny",
            crate::engine::OnStoreUnavailable::Local => "local",
        }),
        headers,
    }
}

fn limit_of(rule: &Rule) -> RuleLimit {
    RuleLimit {
        burst: rule.limit.burst(),
        rate: rule.rate_text.to_string(),
        debt: rule.limit.debt(),
    }
}

/// Explains a request for `tenant`'s `key` on `resource` of `cost` tokens
/// (0 counts as 1, as `ShouldAllow` counts it) by the limits-table rules.
pub async fn explain(
    engine: &Engine,
    limits: &LiveLimits,
    table: Option<&LimitsTable>,
    tenant: &str,
    key: &str,
    resource: &str,
    cost: u64,
) -> Result<Explanation, ExplainError> {
    let invalid = |e: String| ExplainError::Invalid(DecideError::InvalidField(e));
    if key.is_empty() {
        return Err(invalid(
            "key is empty; name the caller's key (API key, user id, IP address) to explain".into(),
        ));
    }
    caps::check_key(|| "key".into(), key)?;
    check_label_named(tenant, || "tenant".into()).map_err(invalid)?;
    check_label_named(resource, || "resource".into()).map_err(invalid)?;
    let cost = cost.clamp(1, caps::MAX_COST);
    let plan = match table {
        Some(table) if !tenant.is_empty() => table
            .tenant(tenant)
            .await
            .map_err(|e| ExplainError::Unavailable(e.to_string()))?
            .map(|(plan, _)| plan)
            .unwrap_or_default(),
        _ => String::new(),
    };
    let rules = limits.snapshot();
    let slots = rules.explain(tenant, resource);
    let mut state = Demand::new(Api::Native, crate::algorithm::Op::DRY, OverCapacity::Reject);
    state.items.push(Item::new(tenant, resource, key, 0));
    let mut decide = Demand::new(Api::Native, crate::algorithm::Op::DRY, OverCapacity::Reject);
    decide.items.push(Item::new(tenant, resource, key, cost));
    // Which line of the dry run each slot's rule is (concurrency caps are
    // not met by a decision).
    let mut dry_line = Vec::with_capacity(slots.len());
    let mut dry_rules = Vec::new();
    for slot in &slots {
        state
            .lines
            .push(Line::of_rule(&rules, 0, tenant, key, slot.rule));
        if slot.rule.kind == Kind::Concurrency {
            dry_line.push(None);
        } else {
            dry_line.push(Some(decide.lines.len()));
            dry_rules.push(slot.rule.name.to_string());
            decide
                .lines
                .push(Line::of_rule(&rules, 0, tenant, key, slot.rule));
        }
    }
    let probe = probe(engine, state, decide).await?;
    let (answer, headers) = probe.dry;
    let degraded = probe
        .state_answer
        .items
        .first()
        .is_some_and(|i| i.degraded.is_some());
    let explained = slots
        .iter()
        .enumerate()
        .map(|(n, slot)| {
            let rule = slot.rule;
            ExplainedRule {
                name: rule.name.to_string(),
                owner: slot.owner.as_str(),
                kind: rule.kind.as_str(),
                scope: rule.scope.as_str(),
                resource: rule.resource.to_string(),
                mode: match rule.mode {
                    Mode::Enforce => "enforce",
                    Mode::Shadow => "shadow",
                },
                limit: limit_of(rule),
                won_over: slot
                    .over
                    .iter()
                    .map(|(tier, r): &(Tier, &Arc<Rule>)| RowRef {
                        name: r.name.to_string(),
                        owner: tier.as_str(),
                        limit: limit_of(r),
                    })
                    .collect(),
                state: bucket_state(
                    probe.buckets[n].clone(),
                    rule.kind,
                    rule.limit.burst(),
                    probe.state[n],
                    dry_line[n].map(|d| answer.lines[d]),
                    degraded,
                ),
            }
        })
        .collect();
    let deciding = answer
        .items
        .first()
        .and_then(|i| i.line)
        .map(|l| dry_rules[l].clone())
        .unwrap_or_default();
    let now = engine.now();
    Ok(Explanation {
        at: rfc3339(now),
        tenant: tenant.to_owned(),
        key: key.to_owned(),
        resource: resource.to_owned(),
        cost,
        plan,
        rules: explained,
        dry_run: dry_run(&answer, headers, deciding),
        recent: Recent::of(engine.recent().of(tenant, key), now),
    })
}

/// How an Envoy descriptor's rule was found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EnvoyRuleView {
    /// Where it sits in the configuration (`domain.key_value...`; '' for a
    /// limit sent with the descriptor).
    pub key: String,
    /// `rate_limit.name` ('' unnamed).
    pub name: String,
    /// `requests_per_unit` and `unit`, or `unlimited`.
    pub limit: String,
    /// The algorithm (`fixed_window`, `token_bucket`, ...).
    pub algorithm: String,
    /// `shadow_mode: true`.
    pub shadow: bool,
    /// The limit came with the request (a descriptor's `limit` override).
    pub overridden: bool,
    /// The counter's name: the entries, with a shared wildcard's pattern.
    pub counter: String,
}

/// One Envoy descriptor explained.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ExplainedDescriptor {
    /// Its entries, `key=value`.
    pub entries: Vec<String>,
    /// Hits it asks for.
    pub hits: u64,
    /// The rule that applies, if one does.
    pub rule: Option<EnvoyRuleView>,
    /// Why no rule applies (when none does), or what else to know.
    pub why: String,
    /// Its bucket, when a limited rule applies.
    pub state: Option<BucketState>,
    /// Its counter's recent decisions.
    pub recent: Option<Recent>,
}

/// An Envoy request explained.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EnvoyExplanation {
    /// When (RFC 3339).
    pub at: String,
    /// The domain.
    pub domain: String,
    /// The domain is configured.
    pub domain_known: bool,
    /// One per descriptor, in order.
    pub descriptors: Vec<ExplainedDescriptor>,
    /// What `ShouldRateLimit` would answer now (`rule`: the deciding
    /// descriptor's rule key).
    pub dry_run: DryRun,
}

/// The Envoy wing's half of the explain view.
pub trait ExplainEnvoy: Send + Sync {
    /// Explains a `ShouldRateLimit` of `domain` with `descriptors` (a
    /// descriptor without `hits_addend` asks for one hit).
    fn explain<'a>(
        &'a self,
        domain: &'a str,
        descriptors: &'a [RateLimitDescriptor],
    ) -> BoxFuture<'a, Result<EnvoyExplanation, DecideError>>;
}

/// What the admin surfaces explain with.
pub struct Explainer {
    engine: Arc<Engine>,
    limits: Arc<LiveLimits>,
    table: Option<LimitsTable>,
    envoy: Arc<dyn ExplainEnvoy>,
}

impl Explainer {
    /// Explains native requests by the rules in `limits` (plans read from
    /// `table`) through `engine`, and Envoy requests through `envoy`.
    pub fn new(
        engine: Arc<Engine>,
        limits: Arc<LiveLimits>,
        table: Option<LimitsTable>,
        envoy: Arc<dyn ExplainEnvoy>,
    ) -> Self {
        Self {
            engine,
            limits,
            table,
            envoy,
        }
    }

    /// [`explain`] with this explainer's engine and limits.
    pub async fn native(
        &self,
        tenant: &str,
        key: &str,
        resource: &str,
        cost: u64,
    ) -> Result<Explanation, ExplainError> {
        explain(
            &self.engine,
            &self.limits,
            self.table.as_ref(),
            tenant,
            key,
            resource,
            cost,
        )
        .await
    }

    /// An Envoy request ([`ExplainEnvoy::explain`]).
    pub async fn envoy(
        &self,
        domain: &str,
        descriptors: &[RateLimitDescriptor],
    ) -> Result<EnvoyExplanation, ExplainError> {
        Ok(self.envoy.explain(domain, descriptors).await?)
    }
}

/// Most descriptors `GET /v1/explain` reads from a query string (the gRPC
/// call takes as many as `ShouldRateLimit` does).
pub const MAX_QUERY_DESCRIPTORS: usize = 16;

/// Parses one `descriptor` query value: `key=value` entries separated by
/// `,`; a `\` makes the next character literal (`\,`, `\=`, `\\`).
pub fn parse_descriptor(text: &str) -> Result<RateLimitDescriptor, String> {
    use crate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    let mut entries = Vec::new();
    let (mut key, mut value, mut in_value) = (String::new(), String::new(), false);
    let mut chars = text.chars();
    let mut finish = |key: &mut String, value: &mut String, in_value: &mut bool| {
        if key.is_empty() {
            return Err(format!(
                "descriptor {text:?} has an entry without a key; write key=value[,key=value...]"
            ));
        }
        entries.push(Entry {
            key: std::mem::take(key),
            value: std::mem::take(value),
        });
        *in_value = false;
        Ok(())
    };
    while let Some(c) = chars.next() {
        let c = match c {
            '\\' => chars.next().ok_or_else(|| {
                format!("descriptor {text:?} ends with a lone '\\'; write '\\\\' for a backslash")
            })?,
            ',' => {
                finish(&mut key, &mut value, &mut in_value)?;
                continue;
            }
            '=' if !in_value => {
                in_value = true;
                continue;
            }
            c => c,
        };
        if in_value {
            value.push(c);
        } else {
            key.push(c);
        }
    }
    finish(&mut key, &mut value, &mut in_value)?;
    Ok(RateLimitDescriptor {
        entries,
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_parse_with_escapes() {
        let d = parse_descriptor(r"remote_address=10.0.0.1,path=/a\,b\=c\\").unwrap();
        let got: Vec<_> = d.entries.iter().map(|e| (&*e.key, &*e.value)).collect();
        assert_eq!(got, [("remote_address", "10.0.0.1"), ("path", r"/a,b=c\")]);
        let d = parse_descriptor("database").unwrap();
        assert_eq!((&*d.entries[0].key, &*d.entries[0].value), ("database", ""));
        assert!(
            parse_descriptor("a=1,,b=2")
                .unwrap_err()
                .contains("without a key")
        );
        assert!(
            parse_descriptor("=x")
                .unwrap_err()
                .contains("without a key")
        );
        assert!(parse_descriptor(r"a=\").unwrap_err().contains("lone"));
    }
}
