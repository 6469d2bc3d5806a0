"""Tollgate's Python client: ask before doing expensive work.

    from tollgate_client import Tollgate

    tollgate = Tollgate("127.0.0.1:50051", tenant="acme")
    decision = tollgate.should_allow("alice", cost=1)
    if not decision.allowed:
        ...  # answer 429 with decision.headers

``AsyncTollgate`` is the same for asyncio; ``tollgate_client.asgi`` and
``tollgate_client.wsgi`` hold middleware.
"""

from ._common import (
    BatchDecision,
    Decision,
    Item,
    Policy,
    RateLimited,
    TollgateError,
)
from .aio import AsyncTollgate
from .client import Reservation, Slot, Tollgate

__all__ = [
    "AsyncTollgate",
    "BatchDecision",
    "Decision",
    "Item",
    "Policy",
    "RateLimited",
    "Reservation",
    "Slot",
    "Tollgate",
    "TollgateError",
]
