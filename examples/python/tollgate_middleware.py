"""WSGI middlewares that ask Tollgate before letting a request through.

    app = TollgateMiddleware(app, target="127.0.0.1:50051", tenant="acme",
                             key=lambda environ: environ.get("HTTP_X_API_KEY", ""))

For work whose cost is known only afterwards (LLM tokens), the budget
middleware reserves an estimate, calls the application, and settles with the
usage the application reports in a response header; it settles in a
`finally`, so a request that fails refunds its estimate:

    app = TollgateBudgetMiddleware(app, target="127.0.0.1:50051", tenant="llm",
                                   key=lambda environ: environ.get("HTTP_X_API_KEY", ""),
                                   estimate=lambda environ: int(environ.get("HTTP_X_MAX_TOKENS", "1")))

To cap how many requests of a key (or tenant) run at once, the slot
middleware holds a concurrency lease for the life of each request: it opens
Tollgate's Hold stream, and ending the stream (the request is done, or this
process died and its connection dropped) gives the slot back at once:

    app = TollgateSlotMiddleware(app, target="127.0.0.1:50051", tenant="reports",
                                 key=lambda environ: environ.get("HTTP_X_API_KEY", ""))

Allowed requests get the RateLimit header fields Tollgate returns; rejected ones
get an honest 429 with Retry-After and never reach the application. If
Tollgate cannot be reached the request is let through (fail open) and logged:
the rate limiter must not become the outage.

The gRPC stubs are generated from proto/tollgate/v1/tollgate.proto with
grpcio-tools (see generate_stubs).
"""

import logging
import pathlib
import subprocess
import sys
import tempfile
import threading

import grpc

PROTO_ROOT = pathlib.Path(__file__).resolve().parents[2] / "proto"


def generate_stubs():
    """Generates the Python stubs into a temporary directory and imports them."""
    out = tempfile.mkdtemp(prefix="tollgate-stubs-")
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_ROOT}",
         f"--python_out={out}", f"--grpc_python_out={out}",
         str(PROTO_ROOT / "tollgate/v1/tollgate.proto")],
        check=True,
    )
    sys.path.insert(0, out)
    from tollgate.v1 import tollgate_pb2, tollgate_pb2_grpc  # noqa: E402
    return tollgate_pb2, tollgate_pb2_grpc


class _Middleware:
    """What both middlewares share: the application, the stub, and how a
    request names its key."""

    def __init__(self, app, target, tenant, key, resource, timeout):
        self.app = app
        self.tenant = tenant
        self.key = key or (lambda environ: environ.get("REMOTE_ADDR", "unknown"))
        self.resource = resource
        self.timeout = timeout
        self.pb, rpc = generate_stubs()
        self.stub = rpc.RateLimiterStub(grpc.insecure_channel(target))

    @staticmethod
    def missing_key(start_response):
        start_response("400 Bad Request", [("Content-Type", "text/plain")])
        return [b"missing API key\n"]

    @staticmethod
    def refuse(start_response, headers, why):
        """An honest 429 with Tollgate's headers."""
        start_response("429 Too Many Requests", [("Content-Type", "text/plain"), *headers])
        return [why]

    @staticmethod
    def adding(start_response, headers):
        """`start_response` adding Tollgate's headers to the application's."""
        def start_with_headers(status, response_headers, exc_info=None):
            return start_response(status, list(response_headers) + headers, exc_info)
        return start_with_headers

    @staticmethod
    def then(body, done):
        """Streams the application's `body`, then calls `done`, also when
        streaming fails."""
        try:
            yield from body
        finally:
            close = getattr(body, "close", None)
            if close:
                close()
            done()


class TollgateMiddleware(_Middleware):
    """WSGI middleware: one ShouldAllow call per request."""

    def __init__(self, app, target, tenant="", key=None, cost=None, resource="", timeout=0.05):
        super().__init__(app, target, tenant, key, resource, timeout)
        self.cost = cost or (lambda environ: 1)

    def __call__(self, environ, start_response):
        key = self.key(environ)
        if not key:
            return self.missing_key(start_response)
        try:
            decision = self.stub.ShouldAllow(
                self.pb.ShouldAllowRequest(key=key, tenant=self.tenant, resource=self.resource,
                                           cost=self.cost(environ)),
                timeout=self.timeout,
            )
        except grpc.RpcError as err:
            logging.warning("tollgate unavailable (%s); letting the request through", err.code())
            return self.app(environ, start_response)
        headers = sorted(decision.headers.items())
        if not decision.allowed:
            return self.refuse(start_response, headers,
                               b"rate limited; retry after the Retry-After header\n")
        return self.app(environ, self.adding(start_response, headers))


class TollgateBudgetMiddleware(_Middleware):
    """WSGI middleware: Reserve the estimate, call the application, Settle
    with the usage it reported in `usage_header` (0 when it reported none or
    failed, which refunds the whole estimate)."""

    def __init__(self, app, target, tenant="", key=None, estimate=None, resource="",
                 usage_header="X-Usage-Tokens", ttl_seconds=60, timeout=0.05):
        super().__init__(app, target, tenant, key, resource, timeout)
        self.estimate = estimate or (lambda environ: 1)
        self.usage_header = usage_header.lower()
        self.ttl_seconds = ttl_seconds

    def __call__(self, environ, start_response):
        key = self.key(environ)
        if not key:
            return self.missing_key(start_response)
        try:
            reserved = self.stub.Reserve(
                self.pb.ReserveRequest(key=key, tenant=self.tenant, resource=self.resource,
                                       estimate=self.estimate(environ),
                                       ttl={"seconds": self.ttl_seconds}),
                timeout=self.timeout,
            )
        except grpc.RpcError as err:
            logging.warning("tollgate unavailable (%s); letting the request through", err.code())
            return self.app(environ, start_response)
        headers = sorted(reserved.decision.headers.items())
        if not reserved.decision.allowed:
            return self.refuse(start_response, headers,
                               b"over budget; retry after the Retry-After header\n")
        usage = {"tokens": 0}

        def start_and_read_usage(status, response_headers, exc_info=None):
            for name, value in response_headers:
                if name.lower() == self.usage_header and value.isdigit():
                    usage["tokens"] = int(value)
            return start_response(status, list(response_headers) + headers, exc_info)

        try:
            body = self.app(environ, start_and_read_usage)
        except BaseException:
            self.settle(reserved.reservation, usage["tokens"])
            raise
        return self.then(body, lambda: self.settle(reserved.reservation, usage["tokens"]))

    def settle(self, reservation, actual):
        """Settles; a settle that fails is logged (the reservation then
        expires with its estimate charged)."""
        if not reservation:
            return
        try:
            self.stub.Settle(self.pb.SettleRequest(reservation=reservation, actual=actual),
                             timeout=self.timeout)
        except grpc.RpcError as err:
            logging.warning("settle failed (%s); the estimate stays charged", err.code())


class TollgateSlotMiddleware(_Middleware):
    """WSGI middleware: hold a slot of the key's concurrency rules while the
    application handles the request (and streams its body), through a Hold
    stream; a request over the cap gets a 429."""

    def __init__(self, app, target, tenant="", key=None, resource="", ttl_seconds=60,
                 timeout=0.05):
        super().__init__(app, target, tenant, key, resource, timeout)
        self.ttl_seconds = ttl_seconds

    def __call__(self, environ, start_response):
        key = self.key(environ)
        if not key:
            return self.missing_key(start_response)
        done = threading.Event()
        first = self.pb.AcquireRequest(key=key, tenant=self.tenant, resource=self.resource,
                                       ttl={"seconds": self.ttl_seconds})

        def requests():
            yield first
            # The stream stays open (and the slot held) until the request is
            # done; ending it releases the slot.
            done.wait()

        answers = self.stub.Hold(requests())
        got = {}

        def read_first():
            try:
                got["answer"] = next(answers)
            except Exception as err:  # noqa: BLE001 - reported below
                got["error"] = err

        reader = threading.Thread(target=read_first, daemon=True)
        reader.start()
        reader.join(self.timeout)
        if "answer" not in got:
            answers.cancel()
            done.set()
            logging.warning("tollgate unavailable (%s); letting the request through",
                            got.get("error", "timeout"))
            return self.app(environ, start_response)
        acquired = got["answer"].acquired
        headers = sorted(acquired.decision.headers.items())
        if not acquired.granted:
            done.set()
            return self.refuse(start_response, headers,
                               b"too many requests in flight; retry after the Retry-After header\n")
        try:
            body = self.app(environ, self.adding(start_response, headers))
        except BaseException:
            done.set()
            raise
        return self.then(body, done.set)


def hello(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"hello from the application\n"]


def completion(environ, start_response):
    """A stand-in for an LLM call: reports the usage `x-want-tokens` asks
    for, and fails when `x-fail` is set."""
    if environ.get("HTTP_X_FAIL"):
        raise RuntimeError("the model failed")
    tokens = environ.get("HTTP_X_WANT_TOKENS", "1")
    start_response("200 OK", [("Content-Type", "text/plain"), ("X-Usage-Tokens", tokens)])
    return [b"a completion\n"]


def work(environ, start_response):
    """A stand-in for slow work: takes `x-work-ms` milliseconds."""
    import time
    time.sleep(int(environ.get("HTTP_X_WORK_MS", "0")) / 1000)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"work done\n"]


if __name__ == "__main__":
    # python3 examples/python/tollgate_middleware.py PORT TOLLGATE_ADDR TENANT [TIMEOUT_MS] [budget|slot]
    # "budget": the reserve -> call -> settle middleware around a stand-in
    # LLM (estimate from x-max-tokens, usage from x-want-tokens). "slot": the
    # hold-a-slot middleware around work that takes x-work-ms.
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIServer, make_server, WSGIRequestHandler

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args):
            pass

    # PORT TOLLGATE_ADDR TENANT [TIMEOUT_MS]: how long to wait for Tollgate
    # before letting the request through (50 ms by default).
    port, target, tenant = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    timeout = float(sys.argv[4]) / 1000 if len(sys.argv) > 4 else 0.05
    api_key = lambda environ: environ.get("HTTP_X_API_KEY", "")  # noqa: E731
    mode = sys.argv[5] if len(sys.argv) > 5 else ""
    if mode == "slot":
        app = TollgateSlotMiddleware(work, target, tenant=tenant, timeout=timeout, key=api_key)
    elif mode == "budget":
        app = TollgateBudgetMiddleware(
            completion, target, tenant=tenant, timeout=timeout, key=api_key,
            estimate=lambda environ: int(environ.get("HTTP_X_MAX_TOKENS", "1")))
    else:
        app = TollgateMiddleware(hello, target, tenant=tenant, timeout=timeout, key=api_key)
    class Threaded(ThreadingMixIn, WSGIServer):
        daemon_threads = True

    with make_server("127.0.0.1", port, app, server_class=Threaded, handler_class=Quiet) as server:
        print(f"listening on 127.0.0.1:{port}", flush=True)
        server.serve_forever()
