"""ASGI middleware (Starlette, FastAPI, any ASGI app): asks Tollgate before
each HTTP request, answers an honest 429 with Tollgate's headers when
refused, and adds the RateLimit headers to admitted responses.

    from fastapi import FastAPI
    from tollgate_client import AsyncTollgate
    from tollgate_client.asgi import TollgateMiddleware

    app = FastAPI()
    app.add_middleware(TollgateMiddleware, client=lambda: AsyncTollgate(tenant="acme"))
"""

from __future__ import annotations

from typing import Awaitable, Callable, Optional, Union

from ._common import Decision
from .aio import AsyncTollgate

Scope = dict
KeyFn = Callable[[Scope], Optional[str]]


def header(scope: Scope, name: str) -> Optional[str]:
    """The request header ``name`` (lower case), if sent."""
    wanted = name.lower().encode()
    for k, v in scope.get("headers", []):
        if k == wanted:
            return v.decode("latin-1")
    return None


def api_key_or_address(scope: Scope) -> Optional[str]:
    """The default key: the ``x-api-key`` header, else the client's address."""
    key = header(scope, "x-api-key")
    if key:
        return key
    client = scope.get("client")
    return client[0] if client else None


def _headers(decision: Decision) -> list:
    return [(k.lower().encode(), v.encode()) for k, v in sorted(decision.headers.items())]


class TollgateMiddleware:
    """Decides each HTTP request with ``ShouldAllow``.

    ``client`` is an :class:`AsyncTollgate`, or a function making one (it is
    called on the first request, inside the server's event loop). ``key``
    names the caller (default: ``x-api-key``, else the client address; a
    request without one gets 400); ``cost``, ``tenant`` and ``resource``
    may be fixed or functions of the scope.
    """

    def __init__(
        self,
        app,
        client: Union[AsyncTollgate, Callable[[], AsyncTollgate]],
        key: KeyFn = api_key_or_address,
        cost: Union[int, Callable[[Scope], int]] = 1,
        tenant: Union[None, str, Callable[[Scope], str]] = None,
        resource: Union[str, Callable[[Scope], str]] = "",
    ):
        self.app = app
        self._client = client
        self.key = key
        self.cost = cost
        self.tenant = tenant
        self.resource = resource

    def client(self) -> AsyncTollgate:
        if not isinstance(self._client, AsyncTollgate):
            self._client = self._client()
        return self._client

    @staticmethod
    def _value(v, scope):
        return v(scope) if callable(v) else v

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[dict]], send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        key = self.key(scope)
        if not key:
            return await self._answer(send, 400, [], b"missing API key\n")
        decision = await self.client().should_allow(
            key,
            cost=self._value(self.cost, scope),
            tenant=self._value(self.tenant, scope),
            resource=self._value(self.resource, scope),
        )
        headers = _headers(decision)
        if not decision.allowed:
            return await self._answer(send, 429, headers,
                                      b"rate limited; retry after the Retry-After header\n")

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = list(message.get("headers", [])) + headers
            await send(message)

        await self.app(scope, receive, send_with_headers)

    @staticmethod
    async def _answer(send, status: int, headers: list, body: bytes):
        await send({
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                        (b"content-length", str(len(body)).encode())] + headers,
        })
        await send({"type": "http.response.body", "body": body})
