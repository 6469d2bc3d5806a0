"""A WSGI middleware that asks Tollgate before letting a request through.

    app = TollgateMiddleware(app, target="127.0.0.1:50051", tenant="acme",
                             key=lambda environ: environ.get("HTTP_X_API_KEY", ""))

Allowed requests get the RateLimit-* headers Tollgate returns; rejected ones
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


class TollgateMiddleware:
    """WSGI middleware: one ShouldAllow call per request."""

    def __init__(self, app, target, tenant="", key=None, cost=None, resource="", timeout=0.05):
        self.app = app
        self.tenant = tenant
        self.key = key or (lambda environ: environ.get("REMOTE_ADDR", "unknown"))
        self.cost = cost or (lambda environ: 1)
        self.resource = resource
        self.timeout = timeout
        self.pb, rpc = generate_stubs()
        self.stub = rpc.RateLimiterStub(grpc.insecure_channel(target))

    def __call__(self, environ, start_response):
        key = self.key(environ)
        if not key:
            start_response("400 Bad Request", [("Content-Type", "text/plain")])
            return [b"missing API key\n"]
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
            start_response("429 Too Many Requests", [("Content-Type", "text/plain"), *headers])
            return [b"rate limited; retry after the Retry-After header\n"]

        def start_with_headers(status, response_headers, exc_info=None):
            return start_response(status, list(response_headers) + headers, exc_info)

        return self.app(environ, start_with_headers)


def hello(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"hello from the application\n"]


if __name__ == "__main__":
    # python3 examples/python/tollgate_middleware.py PORT TOLLGATE_ADDR TENANT
    from wsgiref.simple_server import make_server, WSGIRequestHandler

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args):
            pass

    # PORT TOLLGATE_ADDR TENANT [TIMEOUT_MS]: how long to wait for Tollgate
    # before letting the request through (50 ms by default).
    port, target, tenant = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    timeout = float(sys.argv[4]) / 1000 if len(sys.argv) > 4 else 0.05
    app = TollgateMiddleware(hello, target, tenant=tenant, timeout=timeout,
                             key=lambda environ: environ.get("HTTP_X_API_KEY", ""))
    with make_server("127.0.0.1", port, app, handler_class=Quiet) as server:
        print(f"listening on 127.0.0.1:{port}", flush=True)
        server.serve_forever()
