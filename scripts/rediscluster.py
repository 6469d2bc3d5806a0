"""A throwaway Redis Cluster (and Tollgate processes) on loopback, for the
measurement scripts (scripts/shard-outage, scripts/cluster-spread). Every
process is started in a temporary directory and killed by `stop`."""

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port(with_bus=False):
    """A free port (and, for a cluster node, a free bus port: +10000)."""
    while True:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        if not with_bus:
            return port
        if port >= 55535:
            continue
        b = socket.socket()
        try:
            b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
        finally:
            b.close()


def cli(port, *args):
    out = subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True)
    return out.stdout.strip()


def slot_of(tenant):
    """Redis Cluster's slot of `{tenant}`: CRC16 (XMODEM) mod 16384."""
    crc = 0
    for b in tenant.encode():
        crc ^= b << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
            crc &= 0xFFFF
    return crc % 16384


def cpu_seconds(pid):
    """User + system CPU time of a process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Cluster:
    """`masters` masters, no replicas, cluster-require-full-coverage no."""

    def __init__(self, masters=3, node_timeout=1000):
        self.work = tempfile.mkdtemp(prefix="tollgate-cluster-")
        self.ports = [free_port(True) for _ in range(masters)]
        self.procs = []
        self.servers = []
        for p in self.ports:
            d = os.path.join(self.work, str(p))
            os.mkdir(d)
            self.procs.append(subprocess.Popen(
                ["redis-server", "--port", str(p), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 "--cluster-node-timeout", str(node_timeout), "--cluster-require-full-coverage", "no"],
                cwd=d, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for p in self.ports:
            while cli(p, "PING") != "PONG":
                time.sleep(0.01)
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True)
        while not all("cluster_state:ok" in cli(p, "CLUSTER", "INFO") for p in self.ports):
            time.sleep(0.05)

    def url(self):
        return "redis-cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def slot_ranges(self):
        """{port: [(first, last), ...]} of each master, from CLUSTER NODES."""
        out = {}
        for line in cli(self.ports[0], "CLUSTER", "NODES").splitlines():
            f = line.split()
            if len(f) < 8 or "master" not in f[2]:
                continue
            port = int(f[1].split("@")[0].rsplit(":", 1)[1])
            out[port] = []
            for r in f[8:]:
                if not r.startswith("["):
                    a, _, b = r.partition("-")
                    out[port].append((int(a), int(b or a)))
        return out

    def tenant_on(self, port, prefix):
        """A tenant name starting with `prefix` whose slot master `port` serves."""
        ranges = self.slot_ranges()[port]
        for i in range(100000):
            t = f"{prefix}{i}"
            if any(a <= slot_of(t) <= b for a, b in ranges):
                return t
        raise SystemExit("no tenant hashes to that master")

    def kill(self, i):
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait()

    def serve(self, tollgate, limits, extra=()):
        """One `tollgate serve` on this cluster (with `extra` arguments);
        returns its gRPC URL once ready."""
        grpc, admin = free_port(), free_port()
        proc = subprocess.Popen(
            [tollgate, "serve", "--limits", limits, "--grpc-addr", f"127.0.0.1:{grpc}",
             "--admin-addr", f"127.0.0.1:{admin}", "--store", self.url(), *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        proc.admin = f"http://127.0.0.1:{admin}"
        self.servers.append(proc)
        deadline = time.time() + 20
        while subprocess.run(["curl", "-sf", f"http://127.0.0.1:{admin}/readyz"],
                             capture_output=True).returncode != 0:
            if time.time() > deadline:
                raise SystemExit("tollgate never became ready")
            time.sleep(0.1)
        return f"http://127.0.0.1:{grpc}", proc

    def stop(self):
        for s in self.servers:
            s.send_signal(signal.SIGTERM)
            s.wait()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(self.work, ignore_errors=True)


def binaries():
    """The release build's tollgate (or $TOLLGATE_BIN) and tollgate-bench,
    in $CARGO_TARGET_DIR when it is set."""
    target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target")
    tollgate = os.environ.get("TOLLGATE_BIN", os.path.join(target, "release/tollgate"))
    bench = os.path.join(target, "release/tollgate-bench")
    for b in (tollgate, bench):
        if not os.path.exists(b):
            raise SystemExit(f"{b} missing: cargo build --release --bin tollgate --bin tollgate-bench")
    return tollgate, bench
