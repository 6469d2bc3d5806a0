//! The native wing's leases: `Acquire`, `Release`, `Renew` and `Hold`.
//!
//! An acquire is a decision with [`Op::Acquire`] over the rate rules (when
//! it spends tokens) and the concurrency rules; the engine takes the lease.
//! `Hold` keeps one lease for the life of a stream: renewed by the server
//! while the stream is open, released as soon as the caller ends it or its
//! connection drops.

use std::time::Duration;

use tonic::{Request, Status};

use super::{Asked, Decided, LineRules, RateLimiterService, duration, traced};
use crate::algorithm::{Micros, Op};
use crate::api::{micros, status};
use crate::engine::{self, Api, Ttl};
use crate::engine::{LeaseId, LeaseOp, LeaseStatus};
use crate::proto::v1::{
    AcquireRequest, AcquireResponse, HoldResponse, LeaseStatus as ProtoLeaseStatus,
    ReleaseResponse, RenewRequest, RenewResponse,
};
use crate::telemetry::traces;

fn proto_status(status: LeaseStatus) -> ProtoLeaseStatus {
    match status {
        LeaseStatus::Done => ProtoLeaseStatus::Done,
        LeaseStatus::AlreadyReleased => ProtoLeaseStatus::AlreadyReleased,
        LeaseStatus::Expired => ProtoLeaseStatus::Expired,
        LeaseStatus::Unknown => ProtoLeaseStatus::Unknown,
    }
}

impl RateLimiterService {
    /// Acquires a lease with a time to live of `kind`: the response, and
    /// the lease taken (if any) with its time to live.
    pub(super) async fn acquire_one(
        &self,
        req: &AcquireRequest,
        metadata: &tonic::metadata::MetadataMap,
        kind: Ttl,
    ) -> Result<(AcquireResponse, Option<(LeaseId, Micros)>), Status> {
        let span = traces::decision_span("Acquire", metadata, &req.tenant, req.cost);
        let asked = [Asked {
            key: &req.key,
            cost: req.cost,
            tenant: &req.tenant,
            resource: &req.resource,
        }];
        let rules = self.limits.snapshot();
        let mut line_rules = LineRules::new();
        // The engine makes the demand an acquire (or, without a cap, a
        // plain decision over the rate rules).
        let mut demand = engine::Demand::new(Api::Native, Op::SPEND, engine::OverCapacity::Invalid);
        self.demand(
            &mut demand,
            &rules,
            &asked,
            false,
            true,
            &mut line_rules,
            &span,
        )?;
        let asked_ttl = req.ttl.as_ref().map(micros);
        let acquired = traced(
            &span,
            self.engine.acquire(&mut demand, asked_ttl, kind, &span),
        )
        .await
        .map_err(status::from_decide_error)?;
        let (ttl, in_flight, limit) = (acquired.ttl, acquired.in_flight, acquired.limit);
        let mut d = Decided::new(acquired.answer, &line_rules, &demand, &self.engine);
        let response = AcquireResponse {
            granted: d.answer.allowed,
            lease: acquired
                .lease
                .as_ref()
                .map(ToString::to_string)
                .unwrap_or_default(),
            ttl: acquired.lease.as_ref().map(|_| duration(ttl)),
            in_flight,
            limit,
            decision: Some(d.response(0)),
        };
        Ok((response, acquired.lease.map(|id| (id, ttl))))
    }

    pub(super) async fn release_one(&self, token: &str) -> Result<ReleaseResponse, Status> {
        let answer = self
            .engine
            .release(token)
            .await
            .map_err(status::from_decide_error)?;
        Ok(ReleaseResponse {
            status: proto_status(answer.status) as i32,
        })
    }

    pub(super) async fn renew_one(&self, req: &RenewRequest) -> Result<RenewResponse, Status> {
        let answer = self
            .engine
            .renew(&req.lease, req.ttl.as_ref().map(micros))
            .await
            .map_err(status::from_decide_error)?;
        Ok(RenewResponse {
            ttl: Some(duration(answer.expires_in)),
        })
    }

    /// `Hold`: acquires with the first message, then holds the lease while
    /// the stream lives.
    pub(super) async fn hold_stream(
        &self,
        request: Request<tonic::Streaming<AcquireRequest>>,
    ) -> Result<<Self as crate::proto::v1::rate_limiter_server::RateLimiter>::HoldStream, Status>
    {
        let metadata = request.metadata().clone();
        let mut inbound = request.into_inner();
        let first = match crate::api::codec::lenient(inbound.message()).await {
            Ok(Some(Ok(first))) => first,
            Ok(Some(Err(status))) | Err(status) => return Err(status),
            Ok(None) => {
                engine::refused(Api::Native, 1, &tracing::Span::none());
                return Err(Status::invalid_argument(
                    "Hold needs an AcquireRequest as its first message; the stream ended without one",
                ));
            }
        };
        let (response, lease) = self.acquire_one(&first, &metadata, Ttl::HeldLease).await?;
        let (tx, rx) = tokio::sync::mpsc::channel(2);
        let _ = tx.try_send(Ok(HoldResponse {
            acquired: Some(response),
            released: 0,
        }));
        if let Some((id, ttl)) = lease {
            let service = self.clone();
            tokio::spawn(async move {
                let status = service.hold(&id, ttl, &mut inbound, &tx).await;
                let _ = tx
                    .send(Ok(HoldResponse {
                        acquired: None,
                        released: proto_status(status) as i32,
                    }))
                    .await;
            });
        }
        Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }

    /// Holds `id` until the caller ends the stream, its connection drops or
    /// the server stops, renewing it every third of its time to live; then
    /// releases it. Returns what the release (or a failed renew) found.
    async fn hold(
        &self,
        id: &LeaseId,
        ttl: Micros,
        inbound: &mut tonic::Streaming<AcquireRequest>,
        tx: &tokio::sync::mpsc::Sender<Result<HoldResponse, Status>>,
    ) -> LeaseStatus {
        let every = Duration::from_micros(ttl / 3);
        let mut renew = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        let stopping = self.stopping();
        tokio::pin!(stopping);
        loop {
            tokio::select! {
                // Later messages are ignored; the end of the stream, or a
                // broken one, releases.
                message = inbound.message() => match message {
                    Ok(Some(_)) => continue,
                    Ok(None) | Err(_) => break,
                },
                _ = tx.closed() => break,
                _ = &mut stopping => break,
                _ = renew.tick() => {
                    match self.engine.lease(id, LeaseOp::Renew { ttl }).await {
                        Ok(_) => {}
                        // Gone (expired while the store was unreachable):
                        // nothing left to release.
                        Err(engine::DecideError::UnknownLease(_)) => return LeaseStatus::Unknown,
                        Err(engine::DecideError::LeaseGone { .. }) => return LeaseStatus::Expired,
                        // The store is unreachable: try again next tick;
                        // the lease lives until its time to live meanwhile.
                        Err(err) => tracing::debug!(error = %err, "renewing a held lease failed"),
                    }
                }
            }
        }
        match self.engine.lease(id, LeaseOp::Release).await {
            Ok(answer) => answer.status,
            Err(err) => {
                tracing::warn!(error = %err, lease = %id, "releasing a held lease failed; it expires at its time to live");
                LeaseStatus::Unknown
            }
        }
    }
}
