//! The native wing: `tollgate.v1.RateLimiter` (single, batch and stream).
//!
//! Maps a request to a [`Demand`] (one item per request item; one line per
//! limits-table rule that applies to it) and the engine's [`crate::engine::Answer`] back
//! to the response. It decides nothing itself.

use std::sync::Arc;
use std::time::Duration;

use smallvec::SmallVec;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use super::{duration, micros, status};
use crate::algorithm::Op;
use crate::engine::{
    self, Answer, Api, DecideError, Demand, Engine, Item, ItemAnswer, Line, OverCapacity, Ttl, caps,
};
use crate::engine::{Fields, SettleStatus};
use crate::limits::table::{LimitsTable, PeriodFilter};
use crate::limits::watch::LiveLimits;
use crate::limits::{OnStoreUnavailable, Rule, RuleSet, check_label_named};
use crate::proto::v1::rate_limiter_server::RateLimiter;
use crate::proto::v1::{
    AcquireRequest, AcquireResponse, HoldResponse, ReleaseRequest, ReleaseResponse, RenewRequest,
    RenewResponse,
};
use crate::proto::v1::{
    BatchItem, ChargeRequest, ChargeResponse, Degraded, ReserveRequest, ReserveResponse,
    SettleRequest, SettleResponse, SettleStatus as ProtoSettleStatus, ShouldAllowBatchRequest,
    ShouldAllowBatchResponse, ShouldAllowRequest, ShouldAllowResponse, StreamDecision,
};
use crate::proto::v1::{ListUsageRequest, ListUsageResponse, PeriodFigure, UsagePeriod};
use crate::telemetry::traces;

pub use crate::proto::v1::rate_limiter_server::RateLimiterServer;

mod leases;

pub use crate::engine::Unmatched;

/// The rule of each line of a demand (a single decision has one to four).
type LineRules = SmallVec<[Arc<Rule>; 4]>;
/// The rule that decided each item, if any.
type Deciders = SmallVec<[Option<Arc<Rule>>; 1]>;

/// A decision as the wing reports it.
struct Decided {
    answer: Answer,
    /// The rule that decided each item.
    deciders: Deciders,
    /// Each item's header fields.
    fields: SmallVec<[Fields; 1]>,
}

impl Decided {
    /// The answer `demand` got, with the rule that decided each item (from
    /// the rule of each line) and each item's header fields.
    fn new(answer: Answer, line_rules: &LineRules, demand: &Demand<'_>, engine: &Engine) -> Self {
        let deciders = answer
            .items
            .iter()
            .map(|a| a.line.map(|l| line_rules[l].clone()))
            .collect();
        let fields = (0..answer.items.len())
            .map(|i| engine.header_fields(demand, &answer, Some(i)))
            .collect();
        Self {
            answer,
            deciders,
            fields,
        }
    }

    /// The response for item `i`, whose header fields move into it (each
    /// item's response is built once).
    fn response(&mut self, i: usize) -> ShouldAllowResponse {
        to_response(
            &self.answer.items[i],
            self.deciders[i].as_deref(),
            std::mem::take(&mut self.fields[i]),
        )
    }
}

/// `f`, inside `span` when it is traced (a disabled span costs nothing).
/// A plain function rather than an async one: `f` moves once, into the
/// future returned, instead of into an async block and again into its wait.
pub(super) fn traced<F: std::future::Future>(
    span: &tracing::Span,
    f: F,
) -> futures_util::future::Either<F, tracing::instrument::Instrumented<F>> {
    if span.is_disabled() {
        futures_util::future::Either::Left(f)
    } else {
        futures_util::future::Either::Right(f.instrument(span.clone()))
    }
}

/// One item as the wire gives it (a `ShouldAllowRequest` or a batch item).
#[derive(Clone, Copy)]
struct Asked<'a> {
    key: &'a str,
    cost: u64,
    tenant: &'a str,
    resource: &'a str,
}

impl<'a> From<&'a ShouldAllowRequest> for Asked<'a> {
    fn from(r: &'a ShouldAllowRequest) -> Self {
        Self {
            key: &r.key,
            cost: r.cost,
            tenant: &r.tenant,
            resource: &r.resource,
        }
    }
}

impl<'a> From<&'a BatchItem> for Asked<'a> {
    fn from(r: &'a BatchItem) -> Self {
        Self {
            key: &r.key,
            cost: r.cost,
            tenant: &r.tenant,
            resource: &r.resource,
        }
    }
}

/// Implements `tollgate.v1.RateLimiter` over the [`Engine`].
#[derive(Clone)]
pub struct RateLimiterService {
    engine: Arc<Engine>,
    limits: Arc<LiveLimits>,
    /// The limits database, where recorded quota periods are read.
    table: Option<LimitsTable>,
    stop: Option<tokio::sync::watch::Receiver<bool>>,
    first_message: Duration,
}

/// How long a `ShouldAllowStream` may stay open without its first message
/// unless set otherwise ([`RateLimiterService::with_first_message_deadline`]).
pub const FIRST_MESSAGE_DEADLINE: Duration = Duration::from_secs(10);

impl RateLimiterService {
    /// The service deciding through `engine` by the rules in `limits`.
    pub fn new(engine: Arc<Engine>, limits: Arc<LiveLimits>) -> Self {
        Self {
            engine,
            limits,
            table: None,
            stop: None,
            first_message: FIRST_MESSAGE_DEADLINE,
        }
    }

    /// Ends with DEADLINE_EXCEEDED a decision stream whose first message has
    /// not come within `deadline` of its opening (the server passes
    /// `--grpc-request-timeout`): an open stream holds one of the requests
    /// in flight, and one that never asks anything only takes a slot from
    /// callers who would.
    pub fn with_first_message_deadline(mut self, deadline: Duration) -> Self {
        self.first_message = deadline;
        self
    }

    /// Reads recorded quota periods (`GetUsage`'s previous period,
    /// `ListUsage`) from `table`; without it `ListUsage` is UNIMPLEMENTED.
    pub fn with_table(mut self, table: LimitsTable) -> Self {
        self.table = Some(table);
        self
    }

    /// Ends open decision streams once `stop` turns true (at shutdown), so
    /// that a graceful shutdown does not wait for sidecars to hang up.
    pub fn with_shutdown(mut self, stop: tokio::sync::watch::Receiver<bool>) -> Self {
        self.stop = Some(stop);
        self
    }

    /// Completes when shutdown begins (never, without `with_shutdown`).
    fn stopping(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut stop = self.stop.clone();
        async move {
            match stop.as_mut() {
                Some(stop) => {
                    let _ = stop.wait_for(|s| *s).await;
                }
                None => std::future::pending().await,
            }
        }
    }

    /// Decides the items of one request (one item, or a batch's) with `op`
    /// and returns what `respond` makes of each item's answer with the rule
    /// that decided it. Log events inside belong to `span` when it is
    /// traced.
    async fn decide<R>(
        &self,
        items: &[Asked<'_>],
        batch: bool,
        op: Op,
        span: &tracing::Span,
        respond: impl FnOnce(&mut Decided) -> R,
    ) -> Result<R, Status> {
        let rules = self.limits.snapshot();
        let mut line_rules = LineRules::new();
        let mut demand = Demand::new(Api::Native, op, OverCapacity::Invalid);
        self.demand(
            &mut demand,
            &rules,
            items,
            batch,
            false,
            &mut line_rules,
            span,
        )?;
        let answer = traced(span, self.engine.decide(&mut demand, span))
            .await
            .map_err(status::from_decide_error)?;
        // The response is made here rather than the answer returned: the
        // answer is hundreds of bytes, the response what the caller sends.
        let mut decided = Decided::new(answer, &line_rules, &demand, &self.engine);
        Ok(respond(&mut decided))
    }

    /// Fills `demand` (new, of its operation): per item, a line for each
    /// rule that applies, in the order [`RuleSet::applicable`] gives them;
    /// with `caps` (an acquire), the rate rules only when it spends tokens,
    /// then the concurrency rules. A request that cannot be a demand is
    /// counted as refused. Filled in place: a demand is hundreds of bytes,
    /// and every return by value would copy it.
    #[allow(clippy::too_many_arguments)]
    fn demand<'a>(
        &self,
        demand: &mut Demand<'a>,
        rules: &'a RuleSet,
        items: &[Asked<'a>],
        batch: bool,
        caps: bool,
        line_rules: &mut LineRules,
        span: &tracing::Span,
    ) -> Result<(), Status> {
        Self::lines(demand, rules, items, batch, caps, line_rules).map_err(|err| {
            engine::refused(Api::Native, items.len(), span);
            status::from_decide_error(err)
        })
    }

    fn lines<'a>(
        demand: &mut Demand<'a>,
        rules: &'a RuleSet,
        items: &[Asked<'a>],
        batch: bool,
        caps: bool,
        line_rules: &mut LineRules,
    ) -> Result<(), DecideError> {
        let op = demand.op;
        let field = |i: usize, name: &str| {
            if batch {
                format!("items[{i}].{name}")
            } else {
                name.to_owned()
            }
        };
        caps::check_items("items", items.len())?;
        for (i, req) in items.iter().enumerate() {
            if req.key.is_empty() {
                return Err(DecideError::InvalidField(format!(
                    "{} is empty; send the caller's API key, user id or IP address",
                    field(i, "key")
                )));
            }
            caps::check_key(|| field(i, "key"), req.key)?;
            check_label_named(req.tenant, || field(i, "tenant"))
                .map_err(DecideError::InvalidField)?;
            check_label_named(req.resource, || field(i, "resource"))
                .map_err(DecideError::InvalidField)?;
            // A decision costs at least one token; a charge after the fact
            // may be of nothing, and so may an acquire (a slot, no tokens).
            let cost = match op {
                Op::Decide { .. } if !caps => req.cost.max(1),
                _ => req.cost,
            };
            demand
                .items
                .push(Item::new(req.tenant, req.resource, req.key, cost));
            // Looked up only when wanted: a decision never pays for the
            // concurrency slots' lookups.
            let rates = (!caps || cost > 0)
                .then(|| rules.applicable(req.tenant, req.resource))
                .into_iter()
                .flatten();
            let concurrency = caps
                .then(|| rules.concurrency(req.tenant, req.resource))
                .into_iter()
                .flatten();
            for rule in rates.chain(concurrency) {
                demand
                    .lines
                    .push(Line::of_rule(rules, i, req.tenant, req.key, rule));
                line_rules.push(rule.clone());
            }
        }
        Ok(())
    }

    async fn decide_one(
        &self,
        req: &ShouldAllowRequest,
        metadata: &tonic::metadata::MetadataMap,
    ) -> Result<ShouldAllowResponse, Status> {
        let span = traces::decision_span("ShouldAllow", metadata, &req.tenant, req.cost.max(1));
        let asked = [Asked::from(req)];
        let op = Op::Decide {
            spend: !req.dry_run,
        };
        self.decide(&asked, false, op, &span, |d| d.response(0))
            .await
    }

    async fn reserve_one(
        &self,
        req: &ReserveRequest,
        metadata: &tonic::metadata::MetadataMap,
    ) -> Result<ReserveResponse, Status> {
        let span = traces::decision_span("Reserve", metadata, &req.tenant, req.estimate.max(1));
        let asked = [Asked {
            key: &req.key,
            cost: req.estimate,
            tenant: &req.tenant,
            resource: &req.resource,
        }];
        let rules = self.limits.snapshot();
        let mut line_rules = LineRules::new();
        let mut demand = Demand::new(Api::Native, Op::SPEND, OverCapacity::Invalid);
        self.demand(
            &mut demand,
            &rules,
            &asked,
            false,
            false,
            &mut line_rules,
            &span,
        )?;
        let asked_ttl = req.ttl.as_ref().map(micros);
        let reserved = traced(&span, self.engine.reserve(&mut demand, asked_ttl, &span))
            .await
            .map_err(status::from_decide_error)?;
        let mut d = Decided::new(reserved.answer, &line_rules, &demand, &self.engine);
        Ok(ReserveResponse {
            decision: Some(d.response(0)),
            ttl: reserved
                .reservation
                .as_ref()
                .map(|_| duration(reserved.ttl)),
            reservation: reserved
                .reservation
                .map(|r| r.to_string())
                .unwrap_or_default(),
        })
    }

    async fn charge_one(
        &self,
        req: &ChargeRequest,
        metadata: &tonic::metadata::MetadataMap,
    ) -> Result<ChargeResponse, Status> {
        let span = traces::decision_span("Charge", metadata, &req.tenant, req.cost);
        let asked = [Asked {
            key: &req.key,
            cost: req.cost,
            tenant: &req.tenant,
            resource: &req.resource,
        }];
        self.decide(&asked, false, Op::Charge, &span, |d| {
            let item = &d.answer.items[0];
            ChargeResponse {
                remaining: item.remaining,
                debt: item.debt,
                forgiven: d.answer.lines.iter().map(|v| v.forgiven).sum(),
                reset_after: Some(duration(item.reset_after)),
                limit_name: d.deciders[0]
                    .as_ref()
                    .map(|r| String::from(&*r.name))
                    .unwrap_or_default(),
                degraded: degraded(item) as i32,
            }
        })
        .await
    }
}

#[tonic::async_trait]
impl RateLimiter for RateLimiterService {
    type ShouldAllowStreamStream =
        std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<StreamDecision, Status>> + Send>>;

    async fn should_allow_stream(
        &self,
        request: Request<tonic::Streaming<ShouldAllowRequest>>,
    ) -> Result<Response<Self::ShouldAllowStreamStream>, Status> {
        let metadata = request.metadata().clone();
        let mut inbound = request.into_inner();
        let service = self.clone();
        let stopping = self.stopping();
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let first_message = self.first_message;
        tokio::spawn(async move {
            tokio::pin!(stopping);
            let first_deadline = tokio::time::sleep(first_message);
            tokio::pin!(first_deadline);
            let mut waiting_for_first = true;
            // One at a time, in order: each answer is sent before the next
            // message is read. At shutdown the stream ends between messages.
            loop {
                // A message that does not parse gets its error answer and
                // the stream goes on, as the proto promises.
                let next = tokio::select! {
                    _ = &mut stopping => return,
                    () = &mut first_deadline, if waiting_for_first => {
                        let _ = tx
                            .send(Err(Status::deadline_exceeded(format!(
                                "no message within {first_message:?} of the stream's opening; \
                                 open a ShouldAllowStream when there is a request to send"
                            ))))
                            .await;
                        return;
                    }
                    next = crate::api::codec::lenient(inbound.message()) => next,
                };
                waiting_for_first = false;
                let decided = match next {
                    Ok(Some(Ok(message))) => service.decide_one(&message, &metadata).await,
                    Ok(Some(Err(status))) => Err(status),
                    Ok(None) => return,
                    Err(status) => {
                        let _ = tx.send(Err(status)).await;
                        return;
                    }
                };
                let answer = match decided {
                    Ok(decision) => StreamDecision {
                        decision: Some(decision),
                        error_code: 0,
                        error_message: String::new(),
                    },
                    Err(status) => StreamDecision {
                        decision: None,
                        error_code: status.code() as u32,
                        error_message: status.message().to_owned(),
                    },
                };
                if tx.send(Ok(answer)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn should_allow(
        &self,
        request: Request<ShouldAllowRequest>,
    ) -> Result<Response<ShouldAllowResponse>, Status> {
        self.decide_one(request.get_ref(), request.metadata())
            .await
            .map(Response::new)
    }

    async fn should_allow_batch(
        &self,
        request: Request<ShouldAllowBatchRequest>,
    ) -> Result<Response<ShouldAllowBatchResponse>, Status> {
        let req = request.get_ref();
        let tenant = req.items.first().map_or("", |i| i.tenant.as_str());
        let span = traces::decision_span(
            "ShouldAllowBatch",
            request.metadata(),
            tenant,
            req.items.len() as u64,
        );
        let items: Vec<Asked<'_>> = req.items.iter().map(Asked::from).collect();
        let op = Op::Decide {
            spend: !req.dry_run,
        };
        self.decide(&items, true, op, &span, |d| {
            Response::new(ShouldAllowBatchResponse {
                allowed: d.answer.allowed,
                results: (0..d.answer.items.len()).map(|i| d.response(i)).collect(),
                retry_after: Some(duration(d.answer.retry_after)),
            })
        })
        .await
    }

    async fn reserve(
        &self,
        request: Request<ReserveRequest>,
    ) -> Result<Response<ReserveResponse>, Status> {
        self.reserve_one(request.get_ref(), request.metadata())
            .await
            .map(Response::new)
    }

    async fn settle(
        &self,
        request: Request<SettleRequest>,
    ) -> Result<Response<SettleResponse>, Status> {
        let req = request.get_ref();
        let settled = self
            .engine
            .settle(Api::Native, &req.reservation, req.actual)
            .await
            .map_err(status::from_decide_error)?;
        let status = match settled.status {
            SettleStatus::AlreadySettled { .. } => ProtoSettleStatus::AlreadySettled,
            _ => ProtoSettleStatus::Settled,
        };
        Ok(Response::new(SettleResponse {
            status: status as i32,
            estimate: settled.estimate,
            actual: settled.actual,
            refunded: settled.refunded,
            charged: settled.charged,
            remaining: settled.tightest.remaining,
            debt: settled.tightest.debt,
            forgiven: settled.forgiven,
        }))
    }

    async fn charge(
        &self,
        request: Request<ChargeRequest>,
    ) -> Result<Response<ChargeResponse>, Status> {
        self.charge_one(request.get_ref(), request.metadata())
            .await
            .map(Response::new)
    }

    async fn acquire(
        &self,
        request: Request<AcquireRequest>,
    ) -> Result<Response<AcquireResponse>, Status> {
        self.acquire_one(request.get_ref(), request.metadata(), Ttl::Lease)
            .await
            .map(|(response, _)| Response::new(response))
    }

    async fn release(
        &self,
        request: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        self.release_one(&request.get_ref().lease)
            .await
            .map(Response::new)
    }

    async fn renew(
        &self,
        request: Request<RenewRequest>,
    ) -> Result<Response<RenewResponse>, Status> {
        self.renew_one(request.get_ref()).await.map(Response::new)
    }

    type HoldStream =
        std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<HoldResponse, Status>> + Send>>;

    async fn hold(
        &self,
        request: Request<tonic::Streaming<AcquireRequest>>,
    ) -> Result<Response<Self::HoldStream>, Status> {
        self.hold_stream(request).await.map(Response::new)
    }

    async fn get_usage(
        &self,
        request: Request<crate::proto::v1::GetUsageRequest>,
    ) -> Result<Response<crate::proto::v1::GetUsageResponse>, Status> {
        use super::usage;
        let req = request.get_ref();
        let figures = usage::read(
            &self.engine,
            &self.limits,
            self.table.as_ref(),
            &req.tenant,
            &req.key,
            &req.resource,
        )
        .await
        .map_err(usage_status)?;
        let quotas = figures
            .into_iter()
            .map(|q| crate::proto::v1::QuotaUsage {
                rule: q.rule,
                scope: q.scope.into(),
                resource: q.resource,
                period: q.period.into(),
                period_start: Some(timestamp(q.bounds.start)),
                period_end: Some(timestamp(q.bounds.end)),
                used: q.used,
                limit: q.limit,
                remaining: q.remaining,
                debt: q.debt,
                shadow: q.shadow,
                previous: q.previous.map(|p| PeriodFigure {
                    period_start: Some(timestamp(p.bounds.start)),
                    period_end: Some(timestamp(p.bounds.end)),
                    used: p.used,
                    closed: p.closed,
                }),
            })
            .collect();
        Ok(Response::new(crate::proto::v1::GetUsageResponse { quotas }))
    }

    async fn list_usage(
        &self,
        request: Request<ListUsageRequest>,
    ) -> Result<Response<ListUsageResponse>, Status> {
        let Some(table) = &self.table else {
            return Err(Status::unimplemented(
                "this server reads no limits database; usage periods are not recorded",
            ));
        };
        let req = request.get_ref();
        let instant = |t: &Option<prost_types::Timestamp>, field: &str| match t {
            None => Ok(None),
            Some(t) if t.seconds >= 0 && (0..1_000_000_000).contains(&t.nanos) => {
                Ok(Some(t.seconds as u64 * 1_000_000 + t.nanos as u64 / 1000))
            }
            Some(_) => Err(Status::invalid_argument(format!(
                "{field} is before 1970 or has nanos outside 0..1e9; give an instant after the \
                 Unix epoch"
            ))),
        };
        let filter = PeriodFilter {
            tenant: (!req.tenant.is_empty()).then(|| req.tenant.clone()),
            since: instant(&req.since, "since")?,
            until: instant(&req.until, "until")?,
            closed_only: req.closed_only,
            after: None,
            limit: req.page_size as usize,
        };
        let (rows, next_page_token) = super::usage::list(table, filter, &req.page_token)
            .await
            .map_err(usage_status)?;
        let periods = rows
            .into_iter()
            .map(|r| UsagePeriod {
                figure: Some(PeriodFigure {
                    period_start: Some(timestamp(r.start)),
                    period_end: Some(timestamp(r.end)),
                    used: r.used,
                    closed: r.closed,
                }),
                tenant: r.tenant,
                scope: r.scope,
                resource: r.resource,
                key: r.key,
                rule: r.rule,
                shadow: r.shadow,
                limit: r.quota,
            })
            .collect();
        Ok(Response::new(ListUsageResponse {
            periods,
            next_page_token,
        }))
    }
}

fn timestamp(micros: u64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: (micros / 1_000_000) as i64,
        nanos: (micros % 1_000_000) as i32 * 1000,
    }
}

fn usage_status(e: super::usage::UsageError) -> Status {
    match e {
        super::usage::UsageError::Invalid(e) => status::from_decide_error(e),
        super::usage::UsageError::Unavailable => Status::unavailable(
            "the store or the limits database is unavailable: usage cannot be read until it \
             answers again",
        ),
    }
}

fn degraded(answer: &ItemAnswer) -> Degraded {
    match answer.degraded {
        None => Degraded::None,
        Some(OnStoreUnavailable::Allow) => Degraded::FailedOpen,
        Some(OnStoreUnavailable::Deny) => Degraded::FailedClosed,
        Some(OnStoreUnavailable::Local) => Degraded::Local,
    }
}

/// Builds the response, including the HTTP header values.
pub fn to_response(
    answer: &ItemAnswer,
    rule: Option<&Rule>,
    fields: Fields,
) -> ShouldAllowResponse {
    let Some(rule) = rule else {
        // No rule applied: unlimited, so there is no budget to report.
        return ShouldAllowResponse {
            allowed: answer.allowed,
            retry_after: Some(duration(0)),
            reset_after: Some(duration(0)),
            ..Default::default()
        };
    };
    // Inserted one by one: collecting sorts a vector first.
    let mut headers = std::collections::BTreeMap::new();
    for (name, value) in fields {
        headers.insert(name.to_owned(), value);
    }
    ShouldAllowResponse {
        allowed: answer.allowed,
        remaining: answer.remaining,
        retry_after: Some(duration(answer.retry_after)),
        reset_after: Some(duration(answer.reset_after)),
        limit: rule.limit.burst(),
        // Copied as strings: `to_string` on a boxed one would go through
        // the formatting machinery (about 200 instructions each).
        limit_name: String::from(&*rule.name),
        shadow: answer.shadow,
        headers,
        rate: String::from(&*rule.rate_text),
        degraded: degraded(answer) as i32,
        debt: answer.debt,
    }
}
