"""What the sync and async clients share: answers, errors, the policy
for an unreachable Tollgate, and the backoff."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Dict, List, Literal, Optional

import grpc

from ._proto import tollgate_pb2 as pb

#: What a caller gets when Tollgate cannot be reached in time: ``"open"``
#: lets the work through, ``"closed"`` refuses it.
Policy = Literal["open", "closed"]

# Codes that mean "Tollgate did not answer", not "the request is wrong".
_UNREACHABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
}

_DEGRADED = {
    pb.DEGRADED_FAILED_OPEN: "failed_open",
    pb.DEGRADED_FAILED_CLOSED: "failed_closed",
    pb.DEGRADED_LOCAL: "local",
}


def _seconds(d) -> float:
    return d.seconds + d.nanos / 1e9


@dataclass(frozen=True)
class Decision:
    """Tollgate's answer to one request (or the policy's, when it was
    unreachable)."""

    allowed: bool
    #: Tokens (or slots) left in the tightest bucket.
    remaining: int = 0
    #: That bucket's capacity.
    limit: int = 0
    #: Seconds to wait before the same request would be allowed (0 when
    #: allowed).
    retry_after: float = 0.0
    #: Seconds until the bucket is full again.
    reset_after: float = 0.0
    #: The rule that decided.
    rule: str = ""
    #: Header fields to send with the response (``RateLimit``,
    #: ``RateLimit-Policy``, ``Retry-After`` ...).
    headers: Dict[str, str] = field(default_factory=dict)
    #: A shadow rule would have refused it.
    shadow: bool = False
    #: Set when Tollgate's store was down and the rule's policy answered:
    #: ``failed_open``, ``failed_closed`` or ``local``.
    degraded: Optional[str] = None
    #: Tollgate itself was unreachable; the client's policy answered.
    unreachable: bool = False

    @staticmethod
    def of(r: "pb.ShouldAllowResponse") -> "Decision":
        return Decision(
            allowed=r.allowed,
            remaining=r.remaining,
            limit=r.limit,
            retry_after=_seconds(r.retry_after),
            reset_after=_seconds(r.reset_after),
            rule=r.limit_name,
            headers=dict(r.headers),
            shadow=r.shadow,
            degraded=_DEGRADED.get(r.degraded),
        )

    @staticmethod
    def unavailable(policy: Policy) -> "Decision":
        return Decision(allowed=policy == "open", unreachable=True)


@dataclass(frozen=True)
class Item:
    """One item of a batch."""

    key: str
    cost: int = 1
    tenant: Optional[str] = None
    resource: str = ""


@dataclass(frozen=True)
class BatchDecision:
    """A batch is admitted whole or not at all."""

    allowed: bool
    items: List[Decision]
    retry_after: float = 0.0
    unreachable: bool = False


class TollgateError(Exception):
    """Tollgate refused the request as invalid (a caller's bug): ``code``
    is the gRPC status, ``message`` says what to fix."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class RateLimited(Exception):
    """Raised by ``reserve`` and ``slot`` when Tollgate (or the closed
    policy) refuses: ``decision`` holds the headers for an honest 429."""

    def __init__(self, decision: Decision):
        super().__init__(f"rate limited by {decision.rule or 'tollgate'}; "
                         f"retry after {decision.retry_after:.3f} s")
        self.decision = decision


def unreachable(err: grpc.RpcError) -> bool:
    """True when the error means Tollgate did not answer."""
    return err.code() in _UNREACHABLE


def invalid(err: grpc.RpcError) -> TollgateError:
    return TollgateError(err.code(), err.details() or "")


def backoff(decision: Decision, left: float, jitter: float) -> Optional[float]:
    """How long to sleep before asking again, or None to give up: the
    decision's retry_after stretched by up to ``jitter`` (a fraction), so
    callers refused together do not come back together; None when that is
    longer than the ``left`` seconds the caller still waits, or never."""
    if decision.unreachable or decision.retry_after <= 0:
        return None
    wait = decision.retry_after * (1 + random.uniform(0, jitter))
    return wait if wait <= left else None


def check_policy(policy: str) -> Policy:
    if policy not in ("open", "closed"):
        raise ValueError(f"on_unreachable is {policy!r}; use 'open' or 'closed'")
    return policy  # type: ignore[return-value]


def duration(seconds: float) -> dict:
    whole = int(seconds)
    return {"seconds": whole, "nanos": int((seconds - whole) * 1e9)}


# The requests, built once for both clients.

def should_allow_request(key, cost, tenant, resource, dry_run) -> "pb.ShouldAllowRequest":
    return pb.ShouldAllowRequest(key=key, cost=cost, tenant=tenant, resource=resource,
                                 dry_run=dry_run)


def batch_request(items, tenant_of) -> "pb.ShouldAllowBatchRequest":
    return pb.ShouldAllowBatchRequest(items=[
        pb.BatchItem(key=i.key, cost=i.cost, tenant=tenant_of(i.tenant), resource=i.resource)
        for i in items
    ])


def batch_decision(r: "pb.ShouldAllowBatchResponse") -> BatchDecision:
    return BatchDecision(allowed=r.allowed, items=[Decision.of(i) for i in r.results],
                         retry_after=_seconds(r.retry_after))


def batch_unreachable(policy: Policy, n: int) -> BatchDecision:
    d = Decision.unavailable(policy)
    return BatchDecision(d.allowed, [d] * n, unreachable=True)


def reserve_request(key, estimate, tenant, resource, ttl) -> "pb.ReserveRequest":
    return pb.ReserveRequest(key=key, estimate=estimate, tenant=tenant, resource=resource,
                             ttl=duration(ttl))


def acquire_request(key, tenant, resource, ttl, cost) -> "pb.AcquireRequest":
    # A Hold's lease lives at least a second.
    return pb.AcquireRequest(key=key, tenant=tenant, resource=resource,
                             ttl=duration(max(ttl, 1.0)), cost=cost)


def settle_at(used: Optional[int], estimate: int, failed: bool) -> int:
    """What a reservation settles at: the usage set, else the estimate, or
    0 (a refund) when the work raised."""
    if used is not None:
        return used
    return 0 if failed else estimate
