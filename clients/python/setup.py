"""Generates the gRPC stubs from Tollgate's proto while the package builds.

The proto is read from the repository (`../../proto`) or, when building
from an sdist, from the `proto/` copied into it. The stubs land in
`tollgate_client/_proto/` (with `.pyi` type stubs), importing each other
relatively, and the wheel requires at least the protobuf runtime the
generated code was made for.
"""

import pathlib
import re
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = pathlib.Path(__file__).resolve().parent
PROTO_FILE = "tollgate/v1/tollgate.proto"
GENERATED = HERE / "build" / "generated"


def proto_root():
    for root in (HERE / "proto", HERE.parent.parent / "proto"):
        if (root / PROTO_FILE).is_file():
            return root
    sys.exit(f"cannot find {PROTO_FILE} in ./proto or ../../proto")


def generate():
    """Runs protoc (grpcio-tools) and returns the protobuf version of the code."""
    root = proto_root()
    out = GENERATED / "raw"
    shutil.rmtree(GENERATED, ignore_errors=True)
    out.mkdir(parents=True)
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{root}", f"--python_out={out}",
         f"--pyi_out={out}", f"--grpc_python_out={out}", str(root / PROTO_FILE)],
        check=True,
    )
    package = GENERATED / "tollgate_client" / "_proto"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('"""gRPC stubs generated from tollgate.proto."""\n')
    for name in ("tollgate_pb2.py", "tollgate_pb2.pyi", "tollgate_pb2_grpc.py"):
        text = (out / "tollgate" / "v1" / name).read_text()
        text = text.replace("from tollgate.v1 import tollgate_pb2", "from . import tollgate_pb2")
        (package / name).write_text(text)
    found = re.search(r"# Protobuf Python Version: (\d+)\.(\d+)\.(\d+)",
                      (package / "tollgate_pb2.py").read_text())
    return tuple(int(p) for p in found.groups()) if found else None


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        target = pathlib.Path(self.build_lib) / "tollgate_client" / "_proto"
        target.mkdir(parents=True, exist_ok=True)
        for f in (GENERATED / "tollgate_client" / "_proto").iterdir():
            shutil.copy(f, target / f.name)


class SdistWithProto(sdist):
    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        dest = pathlib.Path(base_dir) / "proto" / PROTO_FILE
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(proto_root() / PROTO_FILE, dest)


version = generate()
protobuf = (f"protobuf>={version[0]}.{version[1]}.{version[2]},<{version[0] + 1}"
            if version else "protobuf>=4.25")
setup(
    install_requires=["grpcio>=1.62", protobuf],
    cmdclass={"build_py": BuildWithStubs, "sdist": SdistWithProto},
)
