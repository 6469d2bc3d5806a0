"""The blocking client (grpcio)."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import grpc

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

log = logging.getLogger("tollgate_client")


@dataclass
class Reservation:
    """An estimate reserved by :meth:`Tollgate.reserve`. Set ``used`` to
    what the work really cost; it is settled when the ``with`` block ends."""

    decision: Decision
    #: The reservation's token ('' when none was recorded: no rule applied,
    #: or Tollgate was unreachable and the policy let the work through).
    token: str
    estimate: int
    #: What to settle at; unset, the estimate when the block ends normally
    #: and 0 (a full refund) when it raises.
    used: Optional[int] = None


@dataclass
class Slot:
    """A concurrency slot held by :meth:`Tollgate.slot` for the ``with``
    block."""

    decision: Decision
    #: The lease's token ('' when none is held).
    lease: str
    in_flight: int = 0
    limit: int = 0


class Tollgate:
    """A client of Tollgate's ``tollgate.v1.RateLimiter`` API.

    ``timeout`` bounds every call (seconds); when Tollgate cannot be
    reached within it, ``on_unreachable`` decides: ``"open"`` (the default)
    lets the work through, ``"closed"`` refuses it. Bad input raises
    :class:`TollgateError`.
    """

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        tenant: str = "",
        timeout: float = 0.25,
        on_unreachable: Policy = "open",
        channel: Optional[grpc.Channel] = None,
    ):
        self.tenant = tenant
        self.timeout = timeout
        self.on_unreachable = check_policy(on_unreachable)
        self._channel = channel or grpc.insecure_channel(target)
        self._stub = rpc.RateLimiterStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Tollgate":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _tenant(self, tenant: Optional[str]) -> str:
        return self.tenant if tenant is None else tenant

    def should_allow(
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
            return Decision.of(self._stub.ShouldAllow(request, timeout=self.timeout))
        except grpc.RpcError as err:
            if unreachable(err):
                log.warning("tollgate unreachable (%s); failing %s", err.code(), self.on_unreachable)
                return Decision.unavailable(self.on_unreachable)
            raise invalid(err) from None

    def batch(self, items: Sequence[Item]) -> BatchDecision:
        """Decides every item at once: all are charged, or none is."""
        request = batch_request(items, self._tenant)
        try:
            r = self._stub.ShouldAllowBatch(request, timeout=self.timeout)
        except grpc.RpcError as err:
            if unreachable(err):
                return batch_unreachable(self.on_unreachable, len(items))
            raise invalid(err) from None
        return batch_decision(r)

    def wait_allowed(
        self,
        key: str,
        *,
        cost: int = 1,
        tenant: Optional[str] = None,
        resource: str = "",
        max_wait: float = 10.0,
        jitter: float = 0.2,
    ) -> Decision:
        """Like :meth:`should_allow`, but a refused caller sleeps for the
        decision's ``retry_after`` (plus up to ``jitter`` of it) and asks
        again, for at most ``max_wait`` seconds; returns the last decision
        (refused when the wait would be longer, or never)."""
        deadline = time.monotonic() + max_wait
        while True:
            d = self.should_allow(key, cost=cost, tenant=tenant, resource=resource)
            if d.allowed:
                return d
            pause = backoff(d, deadline - time.monotonic(), jitter)
            if pause is None:
                return d
            time.sleep(pause)

    def settle(self, token: str, actual: int) -> None:
        """Settles a reservation at ``actual`` tokens (see :meth:`reserve`)."""
        self._stub.Settle(pb.SettleRequest(reservation=token, actual=actual), timeout=self.timeout)

    @contextlib.contextmanager
    def reserve(
        self,
        key: str,
        estimate: int,
        *,
        tenant: Optional[str] = None,
        resource: str = "",
        ttl: float = 60.0,
    ) -> Iterator[Reservation]:
        """Reserves ``estimate`` tokens for work whose cost is known only
        afterwards, and settles in a ``finally`` when the block ends: at
        ``reservation.used`` if set, else the estimate (or 0, a refund,
        when the block raised). Raises :class:`RateLimited` when refused."""
        request = reserve_request(key, estimate, self._tenant(tenant), resource, ttl)
        try:
            r = self._stub.Reserve(request, timeout=self.timeout)
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
                    self.settle(token, actual)
                except grpc.RpcError as err:
                    log.warning("settle failed (%s); the reservation expires with its "
                                "estimate charged", err.code())

    @contextlib.contextmanager
    def slot(
        self,
        key: str,
        *,
        tenant: Optional[str] = None,
        resource: str = "",
        ttl: float = 60.0,
        cost: int = 0,
    ) -> Iterator[Slot]:
        """Holds a slot of the concurrency caps that apply for the ``with``
        block, through a ``Hold`` stream: the slot is given back when the
        block ends, or at once if this process dies (its connection drops).
        Raises :class:`RateLimited` when the cap is full."""
        requests: "queue.Queue[Optional[pb.AcquireRequest]]" = queue.Queue()
        requests.put(acquire_request(key, self._tenant(tenant), resource, ttl, cost))

        def send():
            while True:
                message = requests.get()
                if message is None:
                    return
                yield message

        call = self._stub.Hold(send())
        first: dict = {}

        def read_first():
            try:
                first["answer"] = next(call)
            except Exception as err:  # noqa: BLE001 - reported below
                first["error"] = err

        reader = threading.Thread(target=read_first, daemon=True)
        reader.start()
        reader.join(self.timeout)
        if "answer" not in first:
            requests.put(None)
            call.cancel()
            err = first.get("error")
            if isinstance(err, grpc.RpcError) and not unreachable(err):
                raise invalid(err)
            decision = Decision.unavailable(self.on_unreachable)
            if not decision.allowed:
                raise RateLimited(decision)
            yield Slot(decision=decision, lease="")
            return
        acquired = first["answer"].acquired
        decision = Decision.of(acquired.decision)
        if not acquired.granted:
            requests.put(None)
            call.cancel()
            raise RateLimited(decision)
        try:
            yield Slot(decision=decision, lease=acquired.lease, in_flight=acquired.in_flight,
                       limit=acquired.limit)
        finally:
            # Ending the stream releases the lease; the server's last
            # answer says so.
            requests.put(None)
            if acquired.lease:
                done = threading.Thread(target=lambda: next(call, None), daemon=True)
                done.start()
                done.join(self.timeout)
            call.cancel()
