"""A small application using the installed tollgate-client package, for
tests/clients.rs.

    python python_app.py wsgi|asgi PORT TOLLGATE_ADDR TENANT open|closed

`/` is behind the package's middleware (tenant TENANT, key x-api-key);
`/reserve?key=K&estimate=N[&used=M][&fail=1]` reserves and settles with
the client's context manager; `/slot?key=K&ms=N` holds a concurrency slot
of tenant "slots" for N ms; `/wait?key=K&max_wait=S` waits for tenant
"paced" with backoff; `/batch?key=K&cost=N` asks for 1 token of K and N of
K-2 of tenant "llm" at once. The other routes pass the middleware as a tenant
without rules.
"""

import asyncio
import sys
import time
from urllib.parse import parse_qs

from tollgate_client import AsyncTollgate, Item, RateLimited, Tollgate, TollgateError

mode, port, target, tenant, policy = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]


def middleware_tenant(path):
    return tenant if path == "/" else "no-rules"


def reply(status, body, headers=()):
    return status, body.encode(), list(headers)


def rate_limited(e):
    return reply(429, "refused\n", sorted(e.decision.headers.items()))


if mode == "wsgi":
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from tollgate_client.wsgi import TollgateMiddleware

    client = Tollgate(target, timeout=0.3, on_unreachable=policy)

    def handle(path, q):
        key = q.get("key", ["k"])[0]
        if path == "/":
            return reply(200, "hello\n")
        if path == "/reserve":
            try:
                with client.reserve(key, int(q["estimate"][0]), tenant="llm") as r:
                    if "fail" in q:
                        raise RuntimeError("the work failed")
                    if "used" in q:
                        r.used = int(q["used"][0])
                return reply(200, f"reserved {r.estimate}\n")
            except RateLimited as e:
                return rate_limited(e)
        if path == "/slot":
            try:
                with client.slot(key, tenant="slots") as s:
                    time.sleep(int(q.get("ms", ["0"])[0]) / 1000)
                return reply(200, f"held {s.in_flight}/{s.limit}\n")
            except RateLimited as e:
                return rate_limited(e)
        if path == "/wait":
            d = client.wait_allowed(key, tenant="paced", max_wait=float(q["max_wait"][0]))
            return reply(200 if d.allowed else 429, f"allowed={d.allowed}\n")
        if path == "/batch":
            items = [Item(key, 1, tenant="llm"), Item(key + "-2", int(q["cost"][0]), tenant="llm")]
            try:
                b = client.batch(items)
            except TollgateError as e:
                return reply(400, f"{e.code.name}: {e.message}\n")
            return reply(200 if b.allowed else 429, f"remaining {[d.remaining for d in b.items]}\n")
        return reply(404, "no such route\n")

    def app(environ, start_response):
        try:
            status, body, headers = handle(environ["PATH_INFO"], parse_qs(environ.get("QUERY_STRING", "")))
        except RuntimeError:
            status, body, headers = 500, b"the work failed\n", []
        phrase = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests", 500: "Error"}[status]
        start_response(f"{status} {phrase}", [("Content-Type", "text/plain"), *headers])
        return [body]

    wrapped = TollgateMiddleware(app, client, tenant=lambda environ: middleware_tenant(environ["PATH_INFO"]))

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args):
            pass

    class Threaded(ThreadingMixIn, WSGIServer):
        daemon_threads = True

    with make_server("127.0.0.1", port, wrapped, server_class=Threaded, handler_class=Quiet) as server:
        print(f"listening on 127.0.0.1:{port}", flush=True)
        server.serve_forever()
else:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from tollgate_client.asgi import TollgateMiddleware

    holder = {}

    def client():
        if "c" not in holder:
            holder["c"] = AsyncTollgate(target, timeout=0.3, on_unreachable=policy)
        return holder["c"]

    def text(status, body, headers=()):
        return PlainTextResponse(body, status_code=status, headers=dict(headers))

    async def hello(request):
        return text(200, "hello\n")

    async def reserve(request):
        q = request.query_params
        try:
            async with client().reserve(q.get("key", "k"), int(q["estimate"]), tenant="llm") as r:
                if "fail" in q:
                    raise RuntimeError("the work failed")  # settled at 0: refunded
                if "used" in q:
                    r.used = int(q["used"])
            return text(200, f"reserved {r.estimate}\n")
        except RuntimeError:
            return text(500, "the work failed\n")
        except RateLimited as e:
            return text(429, "refused\n", sorted(e.decision.headers.items()))

    async def slot(request):
        q = request.query_params
        try:
            async with client().slot(q.get("key", "k"), tenant="slots") as s:
                await asyncio.sleep(int(q.get("ms", "0")) / 1000)
            return text(200, f"held {s.in_flight}/{s.limit}\n")
        except RateLimited as e:
            return text(429, "refused\n", sorted(e.decision.headers.items()))

    async def wait(request):
        q = request.query_params
        d = await client().wait_allowed(q.get("key", "k"), tenant="paced", max_wait=float(q["max_wait"]))
        return text(200 if d.allowed else 429, f"allowed={d.allowed}\n")

    async def batch(request):
        q = request.query_params
        key = q.get("key", "k")
        items = [Item(key, 1, tenant="llm"), Item(key + "-2", int(q["cost"]), tenant="llm")]
        try:
            b = await client().batch(items)
        except TollgateError as e:
            return text(400, f"{e.code.name}: {e.message}\n")
        return text(200 if b.allowed else 429, f"remaining {[d.remaining for d in b.items]}\n")

    app = Starlette(routes=[Route("/", hello), Route("/reserve", reserve), Route("/slot", slot),
                            Route("/wait", wait), Route("/batch", batch)])
    app.add_middleware(TollgateMiddleware, client=client,
                       tenant=lambda scope: middleware_tenant(scope["path"]))
    print(f"listening on 127.0.0.1:{port}", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
