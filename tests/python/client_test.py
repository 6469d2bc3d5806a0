"""Calls a running Tollgate from Python, with stubs generated from proto/ now.

Usage: python3 tests/python/client_test.py HOST:PORT

Proves the "callable from any language" promise: nothing here is shared with
the Rust code except the .proto file. Exits non-zero on the first failed check.
"""

import os
import pathlib
import subprocess
import sys
import tempfile

import grpc

ROOT = pathlib.Path(__file__).resolve().parents[2]


def generate_stubs(out_dir):
    """Runs grpc_tools.protoc on proto/tollgate/v1/tollgate.proto."""
    subprocess.run(
        [
            sys.executable, "-m", "grpc_tools.protoc",
            f"-I{ROOT / 'proto'}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(ROOT / "proto/tollgate/v1/tollgate.proto"),
        ],
        check=True,
    )
    sys.path.insert(0, str(out_dir))


def expect(condition, message):
    if not condition:
        raise AssertionError(message)


def main(address):
    with tempfile.TemporaryDirectory() as out_dir:
        generate_stubs(out_dir)
        from tollgate.v1 import tollgate_pb2 as pb
        from tollgate.v1 import tollgate_pb2_grpc as rpc

        with grpc.insecure_channel(address) as channel:
            stub = rpc.RateLimiterStub(channel)

            first = stub.ShouldAllow(pb.ShouldAllowRequest(key="py-user", tenant="python"))
            expect(first.allowed, f"first request allowed: {first}")
            expect(first.remaining == 29, f"remaining 29: {first.remaining}")
            expect(first.limit == 30, f"limit 30: {first.limit}")
            expect(first.limit_name == "default-per-key", first.limit_name)
            expect(dict(first.headers) == {
                "RateLimit-Policy": '"default-per-key";q=30;w=3',
                "RateLimit": '"default-per-key";r=29;t=1',
            }, dict(first.headers))

            # Spend the rest of the burst with one weighted request, then get a 429.
            rest = stub.ShouldAllow(pb.ShouldAllowRequest(key="py-user", tenant="python", cost=29))
            expect(rest.allowed and rest.remaining == 0, f"cost 29 spends the rest: {rest}")
            denied = stub.ShouldAllow(pb.ShouldAllowRequest(key="py-user", tenant="python"))
            expect(not denied.allowed, f"denied once empty: {denied}")
            expect(denied.headers["Retry-After"] == "1", dict(denied.headers))
            wait = denied.retry_after.seconds + denied.retry_after.nanos / 1e9
            expect(0 < wait <= 0.1, f"retry_after within one refill interval: {wait}")

            batch = stub.ShouldAllowBatch(pb.ShouldAllowBatchRequest(items=[
                pb.BatchItem(key="account-1", tenant="python"),
                pb.BatchItem(key="py-user", tenant="python"),
            ]))
            expect(not batch.allowed, "the batch fails on the empty bucket")
            expect(batch.results[0].allowed and batch.results[0].remaining == 30,
                   f"and charges nothing: {batch.results[0]}")

            try:
                stub.ShouldAllow(pb.ShouldAllowRequest(key="", tenant="python"))
                raise AssertionError("an empty key must be refused")
            except grpc.RpcError as err:
                expect(err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.code())
                expect(err.details().startswith("key is empty"), err.details())
    print("python client: all checks passed")


if __name__ == "__main__":
    main(sys.argv[1])
