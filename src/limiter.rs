//! From a request to a decision: rules, then charges, then one atomic store
//! call, then the answer for each item.
//!
//! The limiter knows nothing of protobuf or HTTP: the gRPC layer turns its
//! [`Decision`]s into responses and its [`DecideError`]s into statuses.

use smallvec::SmallVec;
use std::collections::HashMap;
use std::sync::Arc;

use crate::bucket::{Charge, Micros, Verdict};
use crate::deny_cache::DenyCache;
use crate::limits::watch::LiveLimits;
use crate::limits::{Mode, OnStoreUnavailable, Rule, Scope, check_label_named};
use crate::store::{BucketKey, MemoryStore, Outcome, Store, StoreError};

/// Longest key, in bytes.
pub const MAX_KEY_LEN: usize = 256;
/// Most items in one batch.
pub const MAX_BATCH_ITEMS: usize = 1000;

/// One thing to decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Item<'a> {
    /// Whose budget.
    pub key: &'a str,
    /// Tokens to spend; 0 means 1.
    pub cost: u64,
    /// Selects the tenant's rules; '' for the default rules.
    pub tenant: &'a str,
    /// The endpoint family; '' for none in particular.
    pub resource: &'a str,
}

/// What to do with a request no rule applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Unmatched {
    /// Admit it, unlimited (the default).
    #[default]
    Allow,
    /// Refuse it with FAILED_PRECONDITION.
    Deny,
}

/// Why a request could not be decided. Being over the limit is not an
/// error; it is a [`Decision`].
#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    /// A field is missing, too long or malformed. The message starts with
    /// the field's name, such as `key` or `items[2].tenant`.
    #[error("{0}")]
    InvalidField(String),
    /// The batch is empty or too large.
    #[error("{0}")]
    InvalidBatch(String),
    /// The request spends more than a rule's capacity: it could never pass.
    #[error(
        "cost {cost} of {what} exceeds the capacity (burst) {burst} of rule {rule:?}; \
         it can never be allowed, so lower the cost or raise the rule's burst"
    )]
    CostExceedsCapacity {
        /// `the request`, `items[i]`, or the items that share the bucket.
        what: String,
        /// The rule.
        rule: String,
        /// Its capacity.
        burst: u64,
        /// The cost asked for.
        cost: u64,
    },
    /// No rule applies and the server refuses unlimited requests.
    #[error(
        "no limit applies to tenant {tenant:?} (resource {resource:?}) and this server refuses \
         unlimited requests; add a row for the tenant or a default row (tenant '') to the limits table"
    )]
    NoRule {
        /// The tenant.
        tenant: String,
        /// The resource.
        resource: String,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The decision for one item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// The item may go ahead.
    pub allowed: bool,
    /// A shadow-mode rule would have rejected it.
    pub shadow: bool,
    /// Whole tokens left in the tightest bucket.
    pub remaining: u64,
    /// Zero when allowed; otherwise the exact wait until it would be.
    pub retry_after: Micros,
    /// Time until the tightest bucket is full.
    pub reset_after: Micros,
    /// The rule of the tightest bucket; `None` when no rule applied.
    pub rule: Option<Arc<Rule>>,
    /// Set when the store was unavailable and the decision followed the
    /// deciding rule's store-unavailable policy instead.
    pub degraded: Option<OnStoreUnavailable>,
}

/// The decision for a set of items decided together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchDecision {
    /// Every item was allowed and charged.
    pub allowed: bool,
    /// Zero when allowed; otherwise the longest wait among the items.
    pub retry_after: Micros,
    /// One decision per item, in order.
    pub items: Vec<Decision>,
}

/// How to decide while the shared store is unavailable; see
/// [`OnStoreUnavailable`] for the per-rule choice.
pub struct Fallback {
    /// In-process buckets for rules whose policy is `local`.
    pub local: Arc<MemoryStore>,
    /// The share of each limit a `local` rule allows in one instance, in
    /// (0, 1]; for example 1/N with N instances sharing the limit.
    pub local_fraction: f64,
    /// The `retry_after` of a request refused because its rule fails closed.
    pub deny_retry_after: Micros,
}

/// Decides requests against the rules in force, using one store.
pub struct Limiter {
    limits: Arc<LiveLimits>,
    store: Arc<dyn Store>,
    unmatched: Unmatched,
    fallback: Option<Fallback>,
    deny_cache: Option<DenyCache>,
}

/// Which charge and rule an item touches.
struct Touch {
    item: usize,
    charge: usize,
    rule: Arc<Rule>,
}

/// Charges per decision held inline before the scratch space spills to the
/// heap: a key bucket, a tenant ceiling and a resource rule or two.
const INLINE: usize = 4;

/// Finds the charge already made for a bucket, so items and rules that
/// share a bucket add their costs. A linear scan while there are few
/// buckets (a single decision has one to three; no hashing, no copies of
/// the names), a hash map once a batch grows past [`BucketIndex::SCAN`].
#[derive(Default)]
struct BucketIndex {
    map: Option<HashMap<BucketKey, usize>>,
}

impl BucketIndex {
    const SCAN: usize = 16;

    fn find(&self, buckets: &[BucketKey], bucket: &BucketKey) -> Option<usize> {
        match &self.map {
            Some(map) => map.get(bucket).copied(),
            None => buckets.iter().position(|b| b == bucket),
        }
    }

    /// Records that `bucket` is about to be pushed onto `buckets`.
    fn add(&mut self, buckets: &[BucketKey], bucket: &BucketKey) {
        if let Some(map) = &mut self.map {
            map.insert(bucket.clone(), buckets.len());
        } else if buckets.len() + 1 > Self::SCAN {
            let mut map: HashMap<BucketKey, usize> = buckets
                .iter()
                .enumerate()
                .map(|(i, b)| (b.clone(), i))
                .collect();
            map.insert(bucket.clone(), buckets.len());
            self.map = Some(map);
        }
    }
}

impl Limiter {
    /// A limiter over `limits` and `store`.
    pub fn new(limits: Arc<LiveLimits>, store: Arc<dyn Store>, unmatched: Unmatched) -> Self {
        Self {
            limits,
            store,
            unmatched,
            fallback: None,
            deny_cache: None,
        }
    }

    /// Answers requests for buckets the store recently rejected from a
    /// local cache until their retry-after (see [`DenyCache`]).
    pub fn with_deny_cache(mut self, cache: DenyCache) -> Self {
        self.deny_cache = Some(cache);
        self
    }

    /// Decides by each rule's store-unavailable policy when the store fails
    /// with a transient error. Without a fallback such failures are errors.
    pub fn with_fallback(mut self, fallback: Fallback) -> Self {
        self.fallback = Some(fallback);
        self
    }

    /// The rules in force.
    pub fn limits(&self) -> &Arc<LiveLimits> {
        &self.limits
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Decides one item.
    pub async fn decide(&self, item: Item<'_>, dry_run: bool) -> Result<Decision, DecideError> {
        let mut batch = self.decide_all(&[item], dry_run, false).await?;
        Ok(batch.items.swap_remove(0))
    }

    /// Decides several items together: all are charged, or none is.
    pub async fn decide_batch(
        &self,
        items: &[Item<'_>],
        dry_run: bool,
    ) -> Result<BatchDecision, DecideError> {
        if items.is_empty() {
            return Err(DecideError::InvalidBatch(
                "items is empty; send 1 to 1000 items".into(),
            ));
        }
        if items.len() > MAX_BATCH_ITEMS {
            return Err(DecideError::InvalidBatch(format!(
                "items has {} entries; at most {MAX_BATCH_ITEMS} are allowed, so split the batch",
                items.len()
            )));
        }
        self.decide_all(items, dry_run, true).await
    }

    /// Applies charges to the store as one atomic decision; when the store
    /// is unavailable, decides by each charge's policy instead (the second
    /// value is then true). Every API reaches the store through here.
    pub async fn apply(
        &self,
        buckets: &[BucketKey],
        charges: &[Charge],
        policies: &[OnStoreUnavailable],
        spend: bool,
    ) -> Result<(Outcome, bool), DecideError> {
        if let Some(outcome) = self
            .deny_cache
            .as_ref()
            .and_then(|c| c.check(buckets, charges))
        {
            crate::telemetry::metrics::deny_cache_hit();
            return Ok((outcome, false));
        }
        match (
            self.store.apply(buckets, charges, spend).await,
            &self.fallback,
        ) {
            (Ok(outcome), _) => {
                if let Some(cache) = &self.deny_cache {
                    cache.remember(buckets, charges, &outcome);
                }
                Ok((outcome, false))
            }
            (Err(err), Some(fallback)) if err.is_transient() => {
                tracing::debug!(error = %err, "store unavailable; deciding by each rule's policy");
                Ok((degrade(fallback, buckets, charges, policies, spend), true))
            }
            (Err(err), _) => Err(err.into()),
        }
    }

    async fn decide_all(
        &self,
        items: &[Item<'_>],
        dry_run: bool,
        batch: bool,
    ) -> Result<BatchDecision, DecideError> {
        let field = |i: usize, name: &str| {
            if batch {
                format!("items[{i}].{name}")
            } else {
                name.to_owned()
            }
        };
        for (i, item) in items.iter().enumerate() {
            check_item(item, |name| field(i, name)).map_err(DecideError::InvalidField)?;
        }

        let rules = self.limits.snapshot();
        let mut buckets: SmallVec<[BucketKey; INLINE]> = SmallVec::new();
        let mut charges: SmallVec<[Charge; INLINE]> = SmallVec::new();
        let mut touches: SmallVec<[Touch; INLINE]> = SmallVec::new();
        let mut charge_rules: SmallVec<[Arc<Rule>; INLINE]> = SmallVec::new();
        let mut index = BucketIndex::default();
        for (i, item) in items.iter().enumerate() {
            let cost = item.cost.max(1);
            let mut matched = false;
            for rule in rules.applicable(item.tenant, item.resource) {
                matched = true;
                let enforce = rule.mode == Mode::Enforce;
                if enforce && cost > rule.limit.burst() {
                    return Err(DecideError::CostExceedsCapacity {
                        what: if batch {
                            format!("items[{i}]")
                        } else {
                            "the request".into()
                        },
                        rule: rule.name.clone(),
                        burst: rule.limit.burst(),
                        cost,
                    });
                }
                let key = if rule.scope == Scope::Key {
                    item.key
                } else {
                    ""
                };
                let bucket = BucketKey::new(item.tenant, rule.bucket_tag(), &rule.resource, key);
                let charge = match index.find(&buckets, &bucket) {
                    Some(c) => {
                        charges[c].cost += cost;
                        if enforce && charges[c].cost > rule.limit.burst() {
                            return Err(DecideError::CostExceedsCapacity {
                                what: format!("the items sharing bucket {:?}", bucket.as_str()),
                                rule: rule.name.clone(),
                                burst: rule.limit.burst(),
                                cost: charges[c].cost,
                            });
                        }
                        c
                    }
                    None => {
                        index.add(&buckets, &bucket);
                        buckets.push(bucket);
                        charges.push(Charge {
                            limit: rule.limit,
                            cost,
                            enforce,
                        });
                        charge_rules.push(rule.clone());
                        charges.len() - 1
                    }
                };
                touches.push(Touch {
                    item: i,
                    charge,
                    rule: rule.clone(),
                });
            }
            if !matched && self.unmatched == Unmatched::Deny {
                return Err(DecideError::NoRule {
                    tenant: item.tenant.into(),
                    resource: item.resource.into(),
                });
            }
        }

        let (plan, degraded) = if charges.is_empty() {
            (None, false)
        } else {
            let policies: SmallVec<[OnStoreUnavailable; INLINE]> = charge_rules
                .iter()
                .map(|r| r.on_store_unavailable)
                .collect();
            let (outcome, degraded) = self.apply(&buckets, &charges, &policies, !dry_run).await?;
            (Some(outcome), degraded)
        };
        let mut decisions: Vec<Decision> = (0..items.len())
            .map(|_| Decision {
                allowed: true,
                shadow: false,
                remaining: 0,
                retry_after: 0,
                reset_after: 0,
                rule: None,
                degraded: None,
            })
            .collect();
        if let Some(plan) = &plan {
            summarise(&mut decisions, &touches, &charges, &plan.verdicts);
        }
        if degraded {
            for d in &mut decisions {
                d.degraded = d.rule.as_ref().map(|r| r.on_store_unavailable);
            }
        }
        let allowed = plan.as_ref().is_none_or(|p| p.allowed);
        let retry_after = decisions.iter().map(|d| d.retry_after).max().unwrap_or(0);
        Ok(BatchDecision {
            allowed,
            retry_after,
            items: decisions,
        })
    }
}

/// Decides without the shared store, by each charge's rule: `allow` admits
/// (reporting the bucket as if full before this request), `deny` rejects
/// enforced charges, `local` decides with in-process buckets scaled to the
/// configured fraction. Still all-or-nothing: local buckets are spent only
/// when no enforced charge is denied.
fn degrade(
    fallback: &Fallback,
    buckets: &[BucketKey],
    charges: &[Charge],
    policies: &[OnStoreUnavailable],
    spend: bool,
) -> Outcome {
    let mut verdicts = Vec::with_capacity(charges.len());
    let mut local = Vec::new();
    let mut denied = false;
    for (i, (charge, policy)) in charges.iter().zip(policies).enumerate() {
        let verdict = match policy {
            OnStoreUnavailable::Allow => Verdict {
                allowed: true,
                remaining: charge.limit.burst().saturating_sub(charge.cost),
                retry_after: 0,
                reset_after: charge.cost * charge.limit.interval(),
            },
            OnStoreUnavailable::Deny => {
                denied |= charge.enforce;
                Verdict {
                    allowed: false,
                    remaining: 0,
                    retry_after: fallback.deny_retry_after,
                    reset_after: 0,
                }
            }
            OnStoreUnavailable::Local => {
                local.push(i);
                Verdict {
                    allowed: true,
                    remaining: 0,
                    retry_after: 0,
                    reset_after: 0,
                }
            }
        };
        verdicts.push(verdict);
    }
    let mut allowed = !denied;
    if !local.is_empty() {
        let local_buckets: Vec<BucketKey> = local.iter().map(|&i| buckets[i].clone()).collect();
        let local_charges: Vec<Charge> = local
            .iter()
            .map(|&i| {
                let limit = charges[i].limit.scaled(fallback.local_fraction);
                Charge {
                    limit,
                    cost: charges[i].cost.min(limit.burst()),
                    enforce: charges[i].enforce,
                }
            })
            .collect();
        let plan = fallback
            .local
            .apply_now(&local_buckets, &local_charges, spend && !denied);
        allowed &= plan.allowed;
        for (&i, verdict) in local.iter().zip(plan.verdicts) {
            verdicts[i] = verdict;
        }
    }
    Outcome { allowed, verdicts }
}

/// Fills each item's decision from the verdicts of the buckets it touched:
/// rejected by any enforced bucket; the tightest bucket is the one that must
/// wait longest when rejected, else the one with the fewest tokens left.
fn summarise(
    decisions: &mut [Decision],
    touches: &[Touch],
    charges: &[Charge],
    verdicts: &[Verdict],
) {
    // For each item: (is the pick enforced, verdict, rule).
    type Pick<'r> = Option<(bool, Verdict, &'r Arc<Rule>)>;
    let mut picks: SmallVec<[Pick; INLINE]> = smallvec::smallvec![None; decisions.len()];
    for touch in touches {
        let verdict = verdicts[touch.charge];
        let enforce = charges[touch.charge].enforce;
        let decision = &mut decisions[touch.item];
        if enforce {
            decision.allowed &= verdict.allowed;
        } else if !verdict.allowed {
            decision.shadow = true;
        }
        let candidate = (enforce, verdict, &touch.rule);
        let pick = &mut picks[touch.item];
        let better = match pick {
            None => true,
            Some((picked_enforce, picked, _)) => {
                tighter(enforce, &verdict, *picked_enforce, picked)
            }
        };
        if better {
            *pick = Some(candidate);
        }
    }
    for (decision, pick) in decisions.iter_mut().zip(picks) {
        let Some((_, verdict, rule)) = pick else {
            continue;
        };
        decision.remaining = verdict.remaining;
        decision.reset_after = verdict.reset_after;
        decision.retry_after = if decision.allowed {
            0
        } else {
            verdict.retry_after
        };
        decision.rule = Some(rule.clone());
    }
}

/// Whether bucket `a` is tighter than `b`: enforced beats shadow; a
/// rejection beats an admission; then the longer wait, then fewer tokens,
/// then the longer time to full.
fn tighter(a_enforce: bool, a: &Verdict, b_enforce: bool, b: &Verdict) -> bool {
    if a_enforce != b_enforce {
        return a_enforce;
    }
    if a.allowed != b.allowed {
        return !a.allowed;
    }
    if !a.allowed {
        return a.retry_after > b.retry_after;
    }
    (a.remaining, std::cmp::Reverse(a.reset_after))
        < (b.remaining, std::cmp::Reverse(b.reset_after))
}

fn check_item(item: &Item<'_>, field: impl Fn(&str) -> String) -> Result<(), String> {
    if item.key.is_empty() {
        return Err(format!(
            "{} is empty; send the caller's API key, user id or IP address",
            field("key")
        ));
    }
    if item.key.len() > MAX_KEY_LEN {
        return Err(format!(
            "{} is {} bytes; at most {MAX_KEY_LEN} are allowed (hash longer keys first)",
            field("key"),
            item.key.len()
        ));
    }
    check_label_named(item.tenant, || field("tenant"))?;
    check_label_named(item.resource, || field("resource"))?;
    Ok(())
}
