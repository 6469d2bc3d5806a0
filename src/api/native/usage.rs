//! The native wing's usage: `GetUsage`, each quota's current period as the
//! store holds it, read by the engine without spending or counting.

use tonic::Status;

use super::RateLimiterService;
use crate::algorithm::Op;
use crate::algorithm::calendar::Bounds;
use crate::api::status;
use crate::engine::caps;
use crate::engine::{Allowance, Api, BucketKey, DecideError, Demand, Item, Line, OverCapacity};
use crate::limits::{Kind, Mode, Scope, check_label_named};
use crate::proto::v1::{GetUsageRequest, GetUsageResponse, QuotaUsage};

impl RateLimiterService {
    pub(super) async fn usage_one(
        &self,
        req: &GetUsageRequest,
    ) -> Result<GetUsageResponse, Status> {
        let bad = |e: String| status::from_decide_error(DecideError::InvalidField(e));
        if req.tenant.is_empty() {
            return Err(bad(
                "tenant is empty; usage is read per tenant (the default rows' quotas count \
                 each tenant apart)"
                    .into(),
            ));
        }
        check_label_named(&req.tenant, || "tenant".into()).map_err(bad)?;
        check_label_named(&req.resource, || "resource".into()).map_err(bad)?;
        caps::check_key(|| "key".into(), &req.key).map_err(status::from_decide_error)?;
        let rules = self.limits.snapshot();
        let cycle = rules.cycle_of(&req.tenant);
        let quotas: Vec<_> = rules
            .applicable(&req.tenant, &req.resource)
            .filter(|r| r.kind == Kind::Quota)
            // A per-key quota is read only for a key.
            .filter(|r| r.scope == Scope::Tenant || !req.key.is_empty())
            .cloned()
            .collect();
        let mut demand = Demand::new(Api::Native, Op::DRY, OverCapacity::Invalid);
        demand
            .items
            .push(Item::new(&req.tenant, &req.resource, &req.key, 0));
        for rule in &quotas {
            let key = if rule.scope == Scope::Key {
                req.key.as_str()
            } else {
                ""
            };
            demand.lines.push(Line {
                item: 0,
                bucket: BucketKey::new(&req.tenant, rule.bucket_kind(), &rule.resource, key),
                allowance: Allowance::Limited(rule.limit),
                enforce: rule.mode == Mode::Enforce,
                on_store_unavailable: rule.on_store_unavailable,
                label: &rule.name,
                calendar: rule.period().map(|p| (p, cycle)),
            });
        }
        let answer = self
            .engine
            .read(&mut demand)
            .await
            .map_err(status::from_decide_error)?;
        if answer.items.iter().any(|i| i.degraded.is_some()) {
            return Err(Status::unavailable(
                "the store is unavailable: usage cannot be read until it answers again",
            ));
        }
        let timestamp = |micros: u64| prost_types::Timestamp {
            seconds: (micros / 1_000_000) as i64,
            nanos: (micros % 1_000_000) as i32 * 1000,
        };
        let quotas = quotas
            .iter()
            .zip(&demand.lines)
            .zip(&answer.lines)
            .map(|((rule, line), verdict)| {
                let period = match line.allowance {
                    Allowance::Limited(l) => l.period(),
                    _ => None,
                }
                .unwrap_or(Bounds { start: 0, end: 0 });
                let limit = rule.limit.burst();
                QuotaUsage {
                    rule: rule.name.to_string(),
                    scope: rule.scope.as_str().into(),
                    resource: rule.resource.to_string(),
                    period: rule.period().map(|p| p.as_str()).unwrap_or_default().into(),
                    period_start: Some(timestamp(period.start)),
                    period_end: Some(timestamp(period.end)),
                    used: limit - verdict.remaining + verdict.debt,
                    limit,
                    remaining: verdict.remaining,
                    debt: verdict.debt,
                    shadow: rule.mode == Mode::Shadow,
                }
            })
            .collect();
        Ok(GetUsageResponse { quotas })
    }
}
