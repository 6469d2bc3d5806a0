//! `tollgate.v1.Admin`: the most limited tenants and keys, and the limits
//! table in force, over gRPC.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::algorithm::Micros;
use crate::api::duration;
use crate::api::explain::Explainer;
use crate::limits::watch::LiveLimits;
use crate::proto::v1::{ExplainRequest, ExplainResponse};
use crate::proto::v1::{
    LimitedKey, LimitedTenant, LimitsStatusRequest, LimitsStatusResponse, TenantHolding,
    TenantInDebt, TopLimitedRequest, TopLimitedResponse,
};
use crate::telemetry::top::TopLimited;

pub use crate::proto::v1::admin_server::AdminServer;

/// Implements `tollgate.v1.Admin`.
pub struct AdminService {
    top: Arc<TopLimited>,
    limits: Arc<LiveLimits>,
    table: String,
    explain: Option<(Arc<Explainer>, Option<String>)>,
}

impl AdminService {
    /// The service reading `top`, and `limits` read from `table` (its
    /// [`crate::limits::table::LimitsTable::fingerprint`]).
    pub fn new(top: Arc<TopLimited>, limits: Arc<LiveLimits>, table: String) -> Self {
        Self {
            top,
            limits,
            table,
            explain: None,
        }
    }

    /// Serves `Explain` through `explainer` to callers sending the admin
    /// `token` (none: `Explain` is refused).
    pub fn with_explain(mut self, explainer: Arc<Explainer>, token: Option<String>) -> Self {
        self.explain = Some((explainer, token));
        self
    }
}

#[tonic::async_trait]
impl crate::proto::v1::admin_server::Admin for AdminService {
    async fn limits_status(
        &self,
        _request: Request<LimitsStatusRequest>,
    ) -> Result<Response<LimitsStatusResponse>, Status> {
        let status = self.limits.status();
        Ok(Response::new(LimitsStatusResponse {
            table: self.table.clone(),
            version: status.version,
            rules: status.rules as u64,
            rejected_rows: status.rejected_rows as u64,
        }))
    }

    async fn explain(
        &self,
        request: Request<ExplainRequest>,
    ) -> Result<Response<ExplainResponse>, Status> {
        let Some((explainer, token)) = &self.explain else {
            return Err(Status::unimplemented(
                "this server does not explain decisions",
            ));
        };
        let Some(token) = token else {
            return Err(Status::failed_precondition(
                "Explain needs the admin token, and the server has none; start tollgate with \
                 --admin-token (TOLLGATE_ADMIN_TOKEN)",
            ));
        };
        let given = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if !super::bearer_matches(token, given) {
            return Err(Status::unauthenticated(
                "send the admin token as metadata: authorization: Bearer TOKEN",
            ));
        }
        super::explain::grpc(explainer, request.into_inner())
            .await
            .map(Response::new)
    }

    async fn top_limited(
        &self,
        request: Request<TopLimitedRequest>,
    ) -> Result<Response<TopLimitedResponse>, Status> {
        let r = request.get_ref();
        let pick = |n: u32, default: usize| {
            if n == 0 {
                default
            } else {
                (n as usize).min(100)
            }
        };
        let tenants = self.top.top(pick(r.tenants, 10), pick(r.keys, 5));
        let in_debt = self
            .top
            .in_debt(pick(r.tenants, 10))
            .into_iter()
            .map(|d| TenantInDebt {
                tenant: d.tenant,
                key: d.key,
                debt: d.debt,
                seen_ago: Some(duration(d.seen_ago_us)),
            })
            .collect();
        let holding = self
            .top
            .holding(pick(r.tenants, 10))
            .into_iter()
            .map(|h| TenantHolding {
                tenant: h.tenant,
                key: h.key,
                held: h.held,
                expires_in: Some(duration(h.expires_in_us)),
            })
            .collect();
        let nearest_quota = self
            .top
            .nearest_quota(pick(r.tenants, 10))
            .into_iter()
            .map(|q| crate::proto::v1::TenantNearQuota {
                tenant: q.tenant,
                rule: q.rule,
                used: q.used,
                limit: q.limit,
                resets_in: Some(duration(q.resets_in_us)),
            })
            .collect();
        Ok(Response::new(TopLimitedResponse {
            in_debt,
            holding,
            nearest_quota,
            window: Some(duration(self.top.window().as_micros() as Micros)),
            tenants: tenants
                .into_iter()
                .map(|t| LimitedTenant {
                    tenant: t.tenant,
                    rejections: t.rejections,
                    error: t.error,
                    keys: t
                        .keys
                        .into_iter()
                        .map(|k| LimitedKey {
                            key: k.name,
                            rejections: k.count,
                            error: k.error,
                        })
                        .collect(),
                })
                .collect(),
        }))
    }
}
