//! A real PostgreSQL server (Debian's `postgresql`) in a temporary
//! directory on a free loopback port, stopped when dropped. As root it runs
//! as the `postgres` user, as PostgreSQL requires.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::redis::free_port;

pub struct Postgres {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

fn bin(name: &str) -> PathBuf {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL is installed (scripts/test installs Debian's postgresql)")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .collect();
    versions.sort();
    versions
        .pop()
        .expect("a PostgreSQL version")
        .join("bin")
        .join(name)
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout.starts_with(b"0\n"))
        .unwrap_or(false)
}

/// The command, run as `postgres` when we are root.
fn as_postgres(program: PathBuf) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

impl Postgres {
    pub fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        if is_root() {
            let ok = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(dir.path())
                .status()
                .unwrap();
            assert!(ok.success());
        }
        let data = dir.path().join("data");
        let out = as_postgres(bin("initdb"))
            .arg("-D")
            .arg(&data)
            .args(["-A", "trust", "-U", "postgres", "--no-sync"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut pg = Self {
            port: free_port(false),
            dir,
            child: None,
        };
        // A port taken between choosing and binding it makes postgres exit:
        // then another one is tried.
        for _ in 0..4 {
            if pg.try_spawn().is_ok() {
                return pg;
            }
            pg.port = free_port(false);
        }
        pg.spawn();
        pg
    }

    pub fn spawn(&mut self) {
        if let Err(e) = self.try_spawn() {
            panic!("{e}");
        }
    }

    fn try_spawn(&mut self) -> Result<(), String> {
        let child = as_postgres(bin("postgres"))
            .arg("-D")
            .arg(self.dir.path().join("data"))
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(self.dir.path())
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        for _ in 0..1000 {
            let ready = Command::new(bin("pg_isready"))
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-q"])
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if ready {
                return Ok(());
            }
            if let Some(status) = super::redis::take_if_exited(&mut self.child) {
                return Err(format!("postgres on port {} exited: {status}", self.port));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(format!("postgres on port {} did not start", self.port))
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops the server at once (SIGKILL to the postmaster's process group
    /// is not needed: SIGQUIT is PostgreSQL's immediate shutdown).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pid = child.id();
            // runuser forwards signals; the postmaster stops its children.
            let _ = Command::new("pkill")
                .args(["-QUIT", "-P", &pid.to_string()])
                .status();
            let _ = Command::new("kill")
                .args(["-QUIT", &pid.to_string()])
                .status();
            let _ = child.wait();
            // Wait until the port is free again.
            for _ in 0..500 {
                if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.kill();
    }
}
