//! Real `redis-server` processes on loopback: one server, or a 3-node
//! cluster. Each picks free ports, runs without persistence, and is killed
//! when dropped.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub use super::ports::free_port;

pub fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli runs (scripts/test installs redis-tools)");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// `EVALSHA` calls since the last `CONFIG RESETSTAT` (`INFO commandstats`).
pub fn evalsha_calls(port: u16) -> u64 {
    redis_cli(port, &["INFO", "commandstats"])
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|v| v.split(',').next())
        .map_or(0, |v| v.parse().unwrap())
}

/// Waits (bounded, 5 s) until `port` has run `want` EVALSHA calls more
/// than `before`, and returns how many more it ran: calls a frozen Redis
/// held in its sockets run once it is thawed.
pub fn wait_evalsha_calls(port: u16, before: u64, want: u64) -> u64 {
    let mut ran = 0;
    for _ in 0..500 {
        ran = evalsha_calls(port) - before;
        if ran >= want {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    ran
}

pub struct RedisServer {
    pub port: u16,
    child: Option<Child>,
    dir: tempfile::TempDir,
    extra: Vec<String>,
    env: Vec<(String, String)>,
}

impl RedisServer {
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// A server on a given port (for tests that start Redis late).
    pub fn start_on(port: u16) -> Self {
        let mut server = Self {
            port,
            child: None,
            dir: tempfile::tempdir().unwrap(),
            extra: Vec::new(),
            env: Vec::new(),
        };
        server.spawn();
        server
    }

    /// A server with `extra` arguments on a free port. A port taken by
    /// someone else between choosing and binding it makes redis-server exit
    /// at once: then another port is tried.
    pub fn start_with(extra: &[&str]) -> Self {
        Self::start_with_env(extra, &[])
    }

    /// As `start_with`, with extra environment variables.
    pub fn start_with_env(extra: &[&str], env: &[(&str, &str)]) -> Self {
        let mut last = String::new();
        for _ in 0..5 {
            let mut server = Self {
                port: free_port(extra.contains(&"--cluster-enabled")),
                child: None,
                dir: tempfile::tempdir().unwrap(),
                extra: extra.iter().map(|s| s.to_string()).collect(),
                env: env
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            };
            match server.try_spawn() {
                Ok(()) => return server,
                Err(e) => last = e,
            }
        }
        panic!("redis-server did not start on five free ports: {last}");
    }

    fn spawn(&mut self) {
        if let Err(e) = self.try_spawn() {
            panic!("{e}");
        }
    }

    fn try_spawn(&mut self) -> Result<(), String> {
        let child = Command::new("redis-server")
            .current_dir(self.dir.path())
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .args(&self.extra)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server runs (scripts/test installs it)");
        self.child = Some(child);
        for _ in 0..500 {
            if redis_cli(self.port, &["PING"]) == "PONG" {
                return Ok(());
            }
            if let Some(status) = take_if_exited(&mut self.child) {
                return Err(format!(
                    "redis-server on port {} exited: {status}",
                    self.port
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Err(format!("redis-server on port {} did not answer", self.port))
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn dir(&self) -> PathBuf {
        self.dir.path().to_owned()
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("running").id().to_string();
        Command::new("kill").args([signal, &pid]).status().unwrap();
    }

    /// SIGSTOP: the server hangs, connections stay open, nothing answers.
    pub fn freeze(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT.
    pub fn thaw(&self) {
        self.signal("-CONT");
    }

    /// SIGKILL: the server is gone (and with it every key).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port (reserved for this test,
    /// see [`super::ports`]). A port still held by the killed server's
    /// sockets for a moment is tried again.
    pub fn restart(&mut self) {
        self.kill();
        let mut last = String::new();
        for _ in 0..20 {
            match self.try_spawn() {
                Ok(()) => return,
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("redis-server did not start again on its port: {last}");
    }
}

/// A redis-server whose wall clock the test moves: `tests/fixtures/clockshift.c`,
/// compiled here with the system's `cc` and preloaded into it, adds the
/// offset written by [`ShiftedRedis::shift`] to every reading of the real
/// time (so to `TIME`, inside scripts too).
pub struct ShiftedRedis {
    pub server: RedisServer,
    offset_file: PathBuf,
    _shim: tempfile::TempDir,
}

impl ShiftedRedis {
    pub fn start() -> Self {
        let shim = tempfile::tempdir().unwrap();
        let library = shim.path().join("clockshift.so");
        let source = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/clockshift.c");
        let built = Command::new("cc")
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(&library)
            .arg(source)
            .output()
            .expect("cc runs (the Rust toolchain's linker)");
        assert!(
            built.status.success(),
            "{}",
            String::from_utf8_lossy(&built.stderr)
        );
        let offset_file = shim.path().join("offset");
        std::fs::write(&offset_file, "0").unwrap();
        let server = RedisServer::start_with_env(
            &[],
            &[
                ("LD_PRELOAD", library.to_str().unwrap()),
                ("TOLLGATE_CLOCK_OFFSET_FILE", offset_file.to_str().unwrap()),
            ],
        );
        Self {
            server,
            offset_file,
            _shim: shim,
        }
    }

    /// Sets Redis's clock `micros` µs away from the real time (negative:
    /// behind it).
    pub fn shift(&self, micros: i64) {
        std::fs::write(&self.offset_file, micros.to_string()).unwrap();
    }

    /// Redis's clock now, from `TIME`, in µs.
    pub fn time(&self) -> u64 {
        let time = redis_cli(self.server.port, &["TIME"]);
        let mut parts = time.lines().map(|l| l.trim().parse::<u64>().unwrap());
        parts.next().unwrap() * 1_000_000 + parts.next().unwrap()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A Redis Cluster on loopback: three masters (and, with
/// [`RedisCluster::start_with`], a replica each), slots spread by
/// `redis-cli --cluster create`.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Three masters, no replicas.
    pub fn start() -> Self {
        Self::start_with(0, &["--cluster-node-timeout", "2000"])
    }

    /// Three masters with `replicas` replicas each, every node started
    /// with `extra` arguments.
    pub fn start_with(replicas: usize, extra: &[&str]) -> Self {
        let mut args = vec![
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
        ];
        args.extend_from_slice(extra);
        let nodes: Vec<RedisServer> = (0..3 * (1 + replicas))
            .map(|_| RedisServer::start_with(&args))
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "cluster create: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = Self { nodes };
        for _ in 0..1500 {
            let ok = cluster
                .nodes
                .iter()
                .all(|n| redis_cli(n.port, &["CLUSTER", "INFO"]).contains("cluster_state:ok"));
            let synced = cluster.nodes.iter().all(|n| {
                let info = redis_cli(n.port, &["INFO", "replication"]);
                info.contains("role:master") || info.contains("master_link_status:up")
            });
            if ok && synced {
                return cluster;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("the cluster never reached cluster_state:ok with its replicas in sync");
    }

    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis-cluster://{}", hosts.join(","))
    }

    /// The slot of tenant `tenant`'s keys: CRC16 of the hash tag, as
    /// Redis Cluster computes it.
    pub fn slot_of(&self, tenant: &str) -> u16 {
        let mut crc: u16 = 0;
        for &b in tenant.as_bytes() {
            crc ^= u16::from(b) << 8;
            for _ in 0..8 {
                crc = if crc & 0x8000 != 0 {
                    (crc << 1) ^ 0x1021
                } else {
                    crc << 1
                };
            }
        }
        crc % 16384
    }

    /// Each live master's index with its slot ranges, from the first live
    /// node's `CLUSTER NODES`.
    pub fn slot_ranges(&self) -> Vec<(usize, Vec<(u16, u16)>)> {
        let Some(alive) = self.nodes.iter().find(|n| n.child.is_some()) else {
            return Vec::new();
        };
        let text = redis_cli(alive.port, &["CLUSTER", "NODES"]);
        let mut out = Vec::new();
        for line in text.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 8 || !fields[2].contains("master") || fields[2].contains("fail") {
                continue;
            }
            let port: u16 = fields[1]
                .split('@')
                .next()
                .and_then(|a| a.rsplit_once(':'))
                .and_then(|(_, p)| p.parse().ok())
                .unwrap_or(0);
            let Some(index) = self.nodes.iter().position(|n| n.port == port) else {
                continue;
            };
            let ranges = fields[8..]
                .iter()
                .filter(|r| !r.starts_with('['))
                .filter_map(|r| {
                    let (a, b) = r.split_once('-').unwrap_or((r, r));
                    Some((a.parse().ok()?, b.parse().ok()?))
                })
                .collect();
            out.push((index, ranges));
        }
        out
    }

    /// The index of the master serving `slot`, as the cluster says.
    pub fn owner(&self, slot: u16) -> Option<usize> {
        self.slot_ranges()
            .into_iter()
            .find(|(_, ranges)| ranges.iter().any(|&(a, b)| (a..=b).contains(&slot)))
            .map(|(index, _)| index)
    }

    /// A tenant name starting with `prefix` whose slot master `node` serves.
    pub fn tenant_on(&self, node: usize, prefix: &str) -> String {
        let ranges = self.slot_ranges();
        let mine = &ranges.iter().find(|(i, _)| *i == node).expect("a master").1;
        (0..100_000)
            .map(|i| format!("{prefix}{i}"))
            .find(|t| {
                let slot = self.slot_of(t);
                mine.iter().any(|&(a, b)| (a..=b).contains(&slot))
            })
            .expect("some tenant hashes to every master")
    }

    /// The node ID of node `node` (`CLUSTER MYID`).
    pub fn id(&self, node: usize) -> String {
        redis_cli(self.nodes[node].port, &["CLUSTER", "MYID"])
    }

    /// The indexes of `node`'s replicas.
    pub fn replicas_of(&self, node: usize) -> Vec<usize> {
        let id = self.id(node);
        (0..self.nodes.len())
            .filter(|&i| {
                i != node
                    && self.nodes[i].child.is_some()
                    && redis_cli(self.nodes[i].port, &["CLUSTER", "NODES"])
                        .lines()
                        .any(|l| l.contains("myself") && l.contains(&format!("slave {id}")))
            })
            .collect()
    }

    /// The indexes of the masters.
    pub fn masters(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| {
                self.nodes[i].child.is_some()
                    && redis_cli(self.nodes[i].port, &["ROLE"]).starts_with("master")
            })
            .collect()
    }
}

/// Takes `child` out of `slot` when it has exited (a server that could not
/// bind its port, say), with its exit status.
pub fn take_if_exited(slot: &mut Option<std::process::Child>) -> Option<std::process::ExitStatus> {
    let status = slot.as_mut()?.try_wait().ok().flatten()?;
    *slot = None;
    Some(status)
}
