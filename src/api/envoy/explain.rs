//! The Envoy half of the explain view ([`crate::api::explain`]): which
//! configured rule each descriptor matches (or why none does), limit
//! overrides and `replaces`, each bucket's state, and what
//! `ShouldRateLimit` would answer now, by the same lookup and the same
//! rule-to-bucket mapping decisions use.

use futures_util::future::BoxFuture;

use super::config::{EnvoyRule, Match, RuleKind};
use super::service::{
    CHARGE_ENTRY, EnvoyRateLimitService, SINCE_ENTRY, check, encode_domain, line, override_rule,
    truncate,
};
use crate::algorithm::Op;
use crate::api::explain::{
    EnvoyExplanation, EnvoyRuleView, ExplainEnvoy, ExplainedDescriptor, Recent, bucket_state,
    dry_run, probe,
};
use crate::engine::{Api, DecideError, Demand, Item, OverCapacity, caps};
use crate::limits::Kind;
use crate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use crate::proto::envoy::service::ratelimit::v3::RateLimitRequest;

impl ExplainEnvoy for EnvoyRateLimitService {
    fn explain<'a>(
        &'a self,
        domain: &'a str,
        descriptors: &'a [RateLimitDescriptor],
    ) -> BoxFuture<'a, Result<EnvoyExplanation, DecideError>> {
        Box::pin(self.explain_request(domain, descriptors))
    }
}

fn view(rule: &EnvoyRule, m: &Match) -> EnvoyRuleView {
    EnvoyRuleView {
        key: rule.full_key.clone(),
        name: rule.name.clone(),
        limit: match rule.kind {
            RuleKind::Unlimited => "unlimited".into(),
            _ => format!("{}/{}", rule.requests_per_unit, rule.unit.as_str()),
        },
        algorithm: match rule.kind {
            RuleKind::Limited(limit) => limit.algorithm().as_str().into(),
            _ => "fixed_window".into(),
        },
        shadow: rule.shadow,
        overridden: m.overridden,
        counter: m.counter.clone(),
    }
}

impl EnvoyRateLimitService {
    async fn explain_request(
        &self,
        domain: &str,
        descriptors: &[RateLimitDescriptor],
    ) -> Result<EnvoyExplanation, DecideError> {
        let req = RateLimitRequest {
            domain: domain.to_owned(),
            descriptors: descriptors.to_vec(),
            hits_addend: 0,
        };
        check(&req)?;
        let config = self.config().snapshot();
        let known = config.has_domain(domain);
        let tenant = encode_domain(domain);
        let mut found: Vec<Result<Match, String>> = Vec::with_capacity(descriptors.len());
        let mut shown: Vec<Vec<String>> = Vec::with_capacity(descriptors.len());
        for (i, d) in descriptors.iter().enumerate() {
            let entries: Vec<(&str, &str)> = d
                .entries
                .iter()
                .filter(|e| e.key != CHARGE_ENTRY && e.key != SINCE_ENTRY)
                .map(|e| (e.key.as_str(), e.value.as_str()))
                .collect();
            shown.push(entries.iter().map(|(k, v)| format!("{k}={v}")).collect());
            let m = match (&d.limit, known) {
                (_, false) => Err(super::config::Miss::Domain.describe(domain, &entries)),
                (Some(over), true) => Ok(override_rule(
                    i,
                    &entries,
                    over.requests_per_unit,
                    over.unit,
                )?),
                (None, true) => config
                    .lookup(domain, &entries)
                    .map_err(|miss| miss.describe(domain, &entries)),
            };
            found.push(m);
        }
        // A matched rule that `replaces` others drops them from the request.
        let replacing: Vec<(usize, String, String)> = found
            .iter()
            .enumerate()
            .filter_map(|(i, m)| m.as_ref().ok().map(|m| (i, m)))
            .flat_map(|(i, m)| {
                m.rule
                    .replaces
                    .iter()
                    .map(move |r| (i, r.clone(), m.rule.full_key.clone()))
            })
            .collect();
        let mut why = vec![String::new(); found.len()];
        for (n, m) in found.iter_mut().enumerate() {
            let replaced_by = match m {
                Ok(m) if !m.rule.name.is_empty() => {
                    replacing.iter().find(|(_, name, _)| *name == m.rule.name)
                }
                _ => None,
            };
            if let Some((i, _, by)) = replaced_by {
                let name = m
                    .as_ref()
                    .map(|m| m.rule.full_key.clone())
                    .unwrap_or_default();
                *m = Err(format!(
                    "its rule {name} is replaced by {by}, which descriptor {} matches",
                    i + 1
                ));
            }
            if let Err(reason) = m {
                why[n] = std::mem::take(reason);
            }
        }
        let mut state = Demand::new(Api::Envoy, Op::DRY, OverCapacity::Reject);
        let mut decide = Demand::new(Api::Envoy, Op::DRY, OverCapacity::Reject);
        decide.shadow = self.options().shadow_mode;
        let mut at_line = vec![None; found.len()];
        for (i, (m, d)) in found.iter().zip(descriptors).enumerate() {
            let key = m.as_ref().map_or("", |m| m.counter.as_str());
            let key = truncate(key, caps::MAX_KEY_BYTES);
            let hits = d.hits_addend.unwrap_or(1);
            state.items.push(Item::new(&tenant, "", key, 0));
            decide.items.push(Item::new(&tenant, "", key, hits));
            if let Ok(m) = m {
                at_line[i] = Some(state.lines.len());
                state.lines.push(line(&tenant, i, m));
                decide.lines.push(line(&tenant, i, m));
            }
        }
        let probe = probe(self.engine(), state, decide).await?;
        let (answer, headers) = probe.dry;
        let now = self.engine().now();
        let explained = found
            .iter()
            .zip(descriptors)
            .enumerate()
            .map(|(i, (m, d))| {
                let hits = d.hits_addend.unwrap_or(1);
                let Ok(m) = m else {
                    return ExplainedDescriptor {
                        entries: shown[i].clone(),
                        hits,
                        rule: None,
                        why: why[i].clone(),
                        state: None,
                        recent: None,
                    };
                };
                let n = at_line[i].expect("a matched descriptor has a line");
                let state = match m.rule.kind {
                    RuleKind::Limited(limit) => Some(bucket_state(
                        probe.buckets[n].clone(),
                        if m.rule.calendar.is_some() {
                            Kind::Quota
                        } else {
                            Kind::Rate
                        },
                        limit.burst(),
                        probe.state[n],
                        Some(answer.lines[n]),
                        probe.state_answer.items[i].degraded.is_some(),
                    )),
                    _ => None,
                };
                let why = match m.rule.kind {
                    RuleKind::Unlimited => "the rule is unlimited: always OK".into(),
                    RuleKind::Block => {
                        "requests_per_unit is 0: always OVER_LIMIT, nothing counted".into()
                    }
                    RuleKind::Limited(_) if m.overridden => {
                        "the descriptor carries its own limit (an override): a fixed window \
                         counted apart from the configured rule's"
                            .into()
                    }
                    RuleKind::Limited(_) => String::new(),
                };
                let key = truncate(&m.counter, caps::MAX_KEY_BYTES);
                ExplainedDescriptor {
                    entries: shown[i].clone(),
                    hits,
                    rule: Some(view(&m.rule, m)),
                    why,
                    state,
                    recent: Some(Recent::of(self.engine().recent().of(&tenant, key), now)),
                }
            })
            .collect();
        // One item per descriptor, in order: the first refused one decides.
        let deciding = answer.items.iter().position(|a| !a.allowed).unwrap_or(0);
        let deciding = found
            .get(deciding)
            .and_then(|m| m.as_ref().ok())
            .map(|m| m.rule.full_key.clone())
            .unwrap_or_default();
        Ok(EnvoyExplanation {
            at: crate::algorithm::calendar::rfc3339(now),
            domain: domain.to_owned(),
            domain_known: known,
            descriptors: explained,
            dry_run: dry_run(&answer, headers, deciding),
        })
    }
}
