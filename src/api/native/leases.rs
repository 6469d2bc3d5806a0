//! The native wing's leases: `Acquire`, `Release`, `Renew` and `Hold`.
//!
//! An acquire is a decision with [`Op::Acquire`] over the rate rules (when
//! it spends tokens) and the concurrency rules; the engine takes the lease.
//! `Hold` keeps one lease for the life of a stream: renewed by the server
//! while the stream is open, released as soon as the caller ends it or its
//! connection drops.

use std::time::Duration;

use tonic::{Request, Status};

use super::{Asked, Attach, RateLimiterService, duration, to_response, truncate_for_message};
use crate::algorithm::{Micros, Op};
use crate::api::status;
use crate::engine::{self, Api};
use crate::proto::v1::{
    AcquireRequest, AcquireResponse, HoldResponse, LeaseStatus as ProtoLeaseStatus,
    ReleaseResponse, RenewRequest, RenewResponse,
};
use crate::store::{LeaseId, LeaseOp, LeaseStatus};
use crate::telemetry::traces;

/// A lease's time to live when the request names none.
pub const DEFAULT_LEASE_TTL: Micros = 60_000_000;

/// The shortest time to live a lease may ask for.
const MIN_LEASE_TTL: Micros = 1_000;

/// The shortest time to live of a lease held by a stream (renewed every
/// third of it).
const MIN_HELD_TTL: Micros = 1_000_000;

/// A lease's requested time to live, checked.
fn lease_ttl(d: Option<&prost_types::Duration>) -> Result<Micros, Status> {
    let Some(d) = d else {
        return Ok(DEFAULT_LEASE_TTL);
    };
    let us = i128::from(d.seconds) * 1_000_000 + i128::from(d.nanos) / 1_000;
    if us < i128::from(MIN_LEASE_TTL) || us > i128::from(crate::store::lease::MAX_TTL) {
        return Err(Status::invalid_argument(format!(
            "ttl is {}.{:09} s; a lease lives from 1 ms to one hour (3600 s): renew it for longer work",
            d.seconds, d.nanos
        )));
    }
    Ok(us as Micros)
}

fn parse_lease(token: &str) -> Result<LeaseId, Status> {
    LeaseId::parse(token).ok_or_else(|| {
        Status::invalid_argument(format!(
            "lease {:?} is not a token Acquire returned (they start with \"l1.\")",
            truncate_for_message(token)
        ))
    })
}

fn proto_status(status: LeaseStatus) -> ProtoLeaseStatus {
    match status {
        LeaseStatus::Done => ProtoLeaseStatus::Done,
        LeaseStatus::AlreadyReleased => ProtoLeaseStatus::AlreadyReleased,
        LeaseStatus::Expired => ProtoLeaseStatus::Expired,
        LeaseStatus::Unknown => ProtoLeaseStatus::Unknown,
    }
}

impl RateLimiterService {
    /// Acquires a lease: the response, the lease taken (if any) and its
    /// time to live.
    pub(super) async fn acquire_one(
        &self,
        req: &AcquireRequest,
        metadata: &tonic::metadata::MetadataMap,
    ) -> Result<(AcquireResponse, Option<LeaseId>, Micros), Status> {
        let ttl = lease_ttl(req.ttl.as_ref())?;
        let span = traces::decision_span("Acquire", metadata, &req.tenant, req.cost);
        let asked = [Asked {
            key: &req.key,
            cost: req.cost,
            tenant: &req.tenant,
            resource: &req.resource,
        }];
        let op = Op::Acquire { ttl };
        let d = self
            .decide(&asked, false, op, Attach::Lease(ttl), &span)
            .await?;
        // The fullest concurrency cap: the fewest slots left.
        let fullest = d
            .answer
            .lines
            .iter()
            .zip(&d.line_rules)
            .filter(|(_, rule)| rule.limit.is_concurrency())
            .min_by_key(|(v, _)| v.remaining);
        let (in_flight, limit) = fullest.map_or((0, 0), |(v, rule)| {
            let cap = rule.limit.burst();
            (cap.saturating_sub(v.remaining), cap)
        });
        let lease = d.token.as_deref().and_then(LeaseId::parse);
        let response = AcquireResponse {
            granted: d.answer.allowed,
            lease: d.token.clone().unwrap_or_default(),
            ttl: lease.as_ref().map(|_| duration(ttl)),
            in_flight,
            limit,
            decision: Some(to_response(&d.answer.items[0], d.deciders[0].as_deref())),
        };
        Ok((response, lease, ttl))
    }

    pub(super) async fn release_one(&self, token: &str) -> Result<ReleaseResponse, Status> {
        let id = parse_lease(token).inspect_err(|_| {
            crate::telemetry::metrics::lease_op("release", "invalid");
        })?;
        let answer = self
            .engine
            .lease(&id, LeaseOp::Release)
            .await
            .map_err(status::from_decide_error)?;
        Ok(ReleaseResponse {
            status: proto_status(answer.status) as i32,
        })
    }

    pub(super) async fn renew_one(&self, req: &RenewRequest) -> Result<RenewResponse, Status> {
        let id = parse_lease(&req.lease).inspect_err(|_| {
            crate::telemetry::metrics::lease_op("renew", "invalid");
        })?;
        let ttl = lease_ttl(req.ttl.as_ref())?;
        let answer = self
            .engine
            .lease(&id, LeaseOp::Renew { ttl })
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
        if lease_ttl(first.ttl.as_ref())? < MIN_HELD_TTL {
            engine::refused(Api::Native, 1, &tracing::Span::none());
            return Err(Status::invalid_argument(
                "ttl of a held lease must be at least 1 s: it is renewed every third of it, and \
                 it is the backstop that frees the slot if this Tollgate instance dies",
            ));
        }
        let (response, lease, ttl) = self.acquire_one(&first, &metadata).await?;
        let (tx, rx) = tokio::sync::mpsc::channel(2);
        let _ = tx.try_send(Ok(HoldResponse {
            acquired: Some(response),
            released: 0,
        }));
        if let Some(id) = lease {
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
