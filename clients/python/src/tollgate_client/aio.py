"""The asyncio client (grpc.aio): the same surface as
:class:`tollgate_client.Tollgate`, awaited."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator, Optional, Sequence

import grpc
import grpc.aio

from ._common import (
    BatchDecision,
    Decision,
    Item,
    Policy,
    RateLimited,
    acquire_request,
    backoff,
    batch_decision,
    batch_request,
    batch_unreachable,
    check_policy,
    invalid,
    reserve_request,
    settle_at,
    should_allow_request,
    unreachable,
)
from ._proto import tollgate_pb2 as pb
from ._proto import tollgate_pb2_grpc as rpc
from .client import Reservation, Slot

log = logging.getLogger("tollgate_client")


class AsyncTollgate:
    """A client of Tollgate for asyncio code (ASGI apps). Create it inside
    the running event loop."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        tenant: str = "",
        timeout: float = 0.25,
        on_unreachable: Policy = "open",
        channel: Optional[grpc.aio.Channel] = None,
    ):
        self.tenant = tenant
        self.timeout = timeout
        self.on_unreachable = check_policy(on_unreachable)
        self._channel = channel or grpc.aio.insecure_channel(target)
        self._stub = rpc.RateLimiterStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncTollgate":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _tenant(self, tenant: Optional[str]) -> str:
        return self.tenant if tenant is None else tenant

    async def should_allow(
        self,
        key: str,
        *,
        cost: int = 1,
        tenant: Optional[str] = None,
        resource: str = "",
        dry_run: bool = False,
    ) -> Decision:
        """May ``key`` spend ``cost`` tokens now?"""
        request = should_allow_request(key, cost, self._tenant(tenant), resource, dry_run)
        try:
            return Decision.of(await self._stub.ShouldAllow(request, timeout=self.timeout))
        except grpc.RpcError as err:
            if unreachable(err):
                log.warning("tollgate unreachable (%s); failing %s", err.code(), self.on_unreachable)
                return Decision.unavailable(self.on_unreachable)
            raise invalid(err) from None

    async def batch(self, items: Sequence[Item]) -> BatchDecision:
        """Decides every item at once: all are charged, or none is."""
        request = batch_request(items, self._tenant)
        try:
            r = await self._stub.ShouldAllowBatch(request, timeout=self.timeout)
        except grpc.RpcError as err:
            if unreachable(err):
                return batch_unreachable(self.on_unreachable, len(items))
            raise invalid(err) from None
        return batch_decision(r)

    async def wait_allowed(
        self,
        key: str,
        *,
        cost: int = 1,
        tenant: Optional[str] = None,
        resource: str = "",
        max_wait: float = 10.0,
        jitter: float = 0.2,
    ) -> Decision:
        """Asks until allowed, sleeping each refusal's ``retry_after`` (plus
        up to ``jitter`` of it), for at most ``max_wait`` seconds."""
        deadline = time.monotonic() + max_wait
        while True:
            d = await self.should_allow(key, cost=cost, tenant=tenant, resource=resource)
            if d.allowed:
                return d
            pause = backoff(d, deadline - time.monotonic(), jitter)
            if pause is None:
                return d
            await asyncio.sleep(pause)

    async def settle(self, token: str, actual: int) -> None:
        """Settles a reservation at ``actual`` tokens."""
        await self._stub.Settle(pb.SettleRequest(reservation=token, actual=actual),
                                timeout=self.timeout)

    @contextlib.asynccontextmanager
    async def reserve(
        self,
        key: str,
        estimate: int,
        *,
        tenant: Optional[str] = None,
        resource: str = "",
        ttl: float = 60.0,
    ) -> AsyncIterator[Reservation]:
        """Reserves ``estimate`` and settles in a ``finally`` (see
        :meth:`tollgate_client.Tollgate.reserve`)."""
        request = reserve_request(key, estimate, self._tenant(tenant), resource, ttl)
        try:
            r = await self._stub.Reserve(request, timeout=self.timeout)
            decision, token = Decision.of(r.decision), r.reservation
        except grpc.RpcError as err:
            if not unreachable(err):
                raise invalid(err) from None
            decision, token = Decision.unavailable(self.on_unreachable), ""
        if not decision.allowed:
            raise RateLimited(decision)
        res = Reservation(decision=decision, token=token, estimate=estimate)
        failed = False
        try:
            yield res
        except BaseException:
            failed = True
            raise
        finally:
            if token:
                actual = settle_at(res.used, estimate, failed)
                try:
                    await self.settle(token, actual)
                except grpc.RpcError as err:
                    log.warning("settle failed (%s); the reservation expires with its "
                                "estimate charged", err.code())

    @contextlib.asynccontextmanager
    async def slot(
        self,
        key: str,
        *,
        tenant: Optional[str] = None,
        resource: str = "",
        ttl: float = 60.0,
        cost: int = 0,
    ) -> AsyncIterator[Slot]:
        """Holds a concurrency slot for the ``async with`` block through a
        ``Hold`` stream (see :meth:`tollgate_client.Tollgate.slot`)."""
        call = self._stub.Hold()
        try:
            await call.write(acquire_request(key, self._tenant(tenant), resource, ttl, cost))
            answer = await asyncio.wait_for(call.read(), self.timeout)
        except (grpc.RpcError, asyncio.TimeoutError) as err:
            call.cancel()
            if isinstance(err, grpc.RpcError) and not unreachable(err):
                raise invalid(err) from None
            decision = Decision.unavailable(self.on_unreachable)
            if not decision.allowed:
                raise RateLimited(decision) from None
            yield Slot(decision=decision, lease="")
            return
        if answer is grpc.aio.EOF:
            call.cancel()
            raise RateLimited(Decision.unavailable("closed"))
        acquired = answer.acquired
        decision = Decision.of(acquired.decision)
        if not acquired.granted:
            call.cancel()
            raise RateLimited(decision)
        try:
            yield Slot(decision=decision, lease=acquired.lease, in_flight=acquired.in_flight,
                       limit=acquired.limit)
        finally:
            try:
                await call.done_writing()
                if acquired.lease:
                    await asyncio.wait_for(call.read(), self.timeout)
            except (grpc.RpcError, asyncio.TimeoutError):
                pass
            call.cancel()
