"""WSGI middleware (Flask, Django, any WSGI app): asks Tollgate before
each request, answers an honest 429 with Tollgate's headers when refused,
and adds the RateLimit headers to admitted responses.

    from tollgate_client import Tollgate
    from tollgate_client.wsgi import TollgateMiddleware

    app.wsgi_app = TollgateMiddleware(app.wsgi_app, Tollgate(tenant="acme"))
"""

from __future__ import annotations

from typing import Callable, Optional, Union

from .client import Tollgate

Environ = dict
KeyFn = Callable[[Environ], Optional[str]]


def api_key_or_address(environ: Environ) -> Optional[str]:
    """The default key: the ``X-API-Key`` header, else the client's address."""
    return environ.get("HTTP_X_API_KEY") or environ.get("REMOTE_ADDR")


class TollgateMiddleware:
    """Decides each request with ``ShouldAllow`` (see the module docs);
    ``key``, ``cost``, ``tenant`` and ``resource`` may be fixed or
    functions of the WSGI environ."""

    def __init__(
        self,
        app,
        client: Tollgate,
        key: KeyFn = api_key_or_address,
        cost: Union[int, Callable[[Environ], int]] = 1,
        tenant: Union[None, str, Callable[[Environ], str]] = None,
        resource: Union[str, Callable[[Environ], str]] = "",
    ):
        self.app = app
        self.client = client
        self.key = key
        self.cost = cost
        self.tenant = tenant
        self.resource = resource

    @staticmethod
    def _value(v, environ):
        return v(environ) if callable(v) else v

    def __call__(self, environ: Environ, start_response):
        key = self.key(environ)
        if not key:
            start_response("400 Bad Request", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"missing API key\n"]
        decision = self.client.should_allow(
            key,
            cost=self._value(self.cost, environ),
            tenant=self._value(self.tenant, environ),
            resource=self._value(self.resource, environ),
        )
        headers = sorted(decision.headers.items())
        if not decision.allowed:
            start_response("429 Too Many Requests",
                           [("Content-Type", "text/plain; charset=utf-8"), *headers])
            return [b"rate limited; retry after the Retry-After header\n"]

        def start_with_headers(status, response_headers, exc_info=None):
            return start_response(status, list(response_headers) + headers, exc_info)

        return self.app(environ, start_with_headers)
