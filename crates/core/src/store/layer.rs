//! The store as the engine calls it: a [`Layer`] is a backend, or a
//! backend wrapped in layers that each add one behaviour ([`super::stack`]
//! composes them).
//!
//! A layer that changes only some calls implements [`Wrapper`]: it names
//! the layer it wraps and overrides what it changes; every other call
//! passes through to the next layer unchanged.

use std::future::Future;
use std::pin::Pin;

use super::{
    LeaseFuture, LeaseId, LeaseOp, PingFuture, Request, ReservationId, SettleFuture, Share,
    ShareAsk, StoreError, StoreStatus, Verdicts,
};

/// What a layered store answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// The verdicts.
    pub outcome: Verdicts,
    /// True when the backend was unavailable and the verdicts follow each
    /// charge's store-unavailable policy.
    pub degraded: bool,
}

/// The future of [`Layer::apply`].
pub type LayerFuture<'a> = Pin<Box<dyn Future<Output = Result<Applied, StoreError>> + Send + 'a>>;

/// What a layered store grants a share table's member.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shared {
    /// The grant.
    pub share: Share,
    /// True when the backend was unavailable and the in-process tables of
    /// the local fallback answered.
    pub degraded: bool,
    /// The part of each limit the grant divides: 1, or while degraded the
    /// local fallback's fraction (what one instance may allow alone).
    pub scale: f64,
}

/// The future of [`Layer::share`].
pub type SharedFuture<'a> = Pin<Box<dyn Future<Output = Result<Shared, StoreError>> + Send + 'a>>;

/// A store, possibly wrapped: what the engine calls.
pub trait Layer: Send + Sync + 'static {
    /// Applies `request` as one atomic decision (see
    /// [`super::Store::apply`]).
    fn apply<'a>(&'a self, request: Request<'a>) -> LayerFuture<'a>;

    /// Applies `request` at once, when the stack can without waiting (an
    /// in-process backend): the same answer as [`Layer::apply`] without
    /// its boxed futures. `None`: use `apply`.
    fn apply_now(&self, request: Request<'_>) -> Option<Result<Applied, StoreError>>;

    /// Settles a reservation (see [`super::Store::settle`]).
    fn settle<'a>(&'a self, id: &'a ReservationId, actual: u64) -> SettleFuture<'a>;

    /// Releases or renews a lease (see [`super::Store::lease`]).
    fn lease<'a>(&'a self, id: &'a LeaseId, op: LeaseOp) -> LeaseFuture<'a>;

    /// Reports to a share table (see [`super::Store::share`]).
    fn share<'a>(&'a self, ask: ShareAsk<'a>) -> SharedFuture<'a>;

    /// Checks that the backend answers.
    fn ping(&self) -> PingFuture<'_>;

    /// Health and figures of the backend (and of the in-process buckets
    /// of the local fallback).
    fn status(&self) -> StoreStatus;
}

/// A layer around another: overrides what it changes, and every call it
/// does not override passes to [`Wrapper::inner`] unchanged.
pub trait Wrapper: Send + Sync + 'static {
    /// The layer this one wraps.
    fn inner(&self) -> &dyn Layer;

    /// See [`Layer::apply`].
    fn apply<'a>(&'a self, request: Request<'a>) -> LayerFuture<'a> {
        self.inner().apply(request)
    }

    /// See [`Layer::apply_now`].
    fn apply_now(&self, request: Request<'_>) -> Option<Result<Applied, StoreError>> {
        self.inner().apply_now(request)
    }

    /// See [`Layer::settle`].
    fn settle<'a>(&'a self, id: &'a ReservationId, actual: u64) -> SettleFuture<'a> {
        self.inner().settle(id, actual)
    }

    /// See [`Layer::lease`].
    fn lease<'a>(&'a self, id: &'a LeaseId, op: LeaseOp) -> LeaseFuture<'a> {
        self.inner().lease(id, op)
    }

    /// See [`Layer::share`].
    fn share<'a>(&'a self, ask: ShareAsk<'a>) -> SharedFuture<'a> {
        self.inner().share(ask)
    }

    /// See [`Layer::ping`].
    fn ping(&self) -> PingFuture<'_> {
        self.inner().ping()
    }

    /// See [`Layer::status`].
    fn status(&self) -> StoreStatus {
        self.inner().status()
    }
}

impl<W: Wrapper> Layer for W {
    fn apply<'a>(&'a self, request: Request<'a>) -> LayerFuture<'a> {
        Wrapper::apply(self, request)
    }

    fn apply_now(&self, request: Request<'_>) -> Option<Result<Applied, StoreError>> {
        Wrapper::apply_now(self, request)
    }

    fn settle<'a>(&'a self, id: &'a ReservationId, actual: u64) -> SettleFuture<'a> {
        Wrapper::settle(self, id, actual)
    }

    fn lease<'a>(&'a self, id: &'a LeaseId, op: LeaseOp) -> LeaseFuture<'a> {
        Wrapper::lease(self, id, op)
    }

    fn share<'a>(&'a self, ask: ShareAsk<'a>) -> SharedFuture<'a> {
        Wrapper::share(self, ask)
    }

    fn ping(&self) -> PingFuture<'_> {
        Wrapper::ping(self)
    }

    fn status(&self) -> StoreStatus {
        Wrapper::status(self)
    }
}
