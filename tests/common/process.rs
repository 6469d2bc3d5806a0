//! The real `tollgate` binary as a child process, as a user runs it.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

pub const BIN: &str = env!("CARGO_BIN_EXE_tollgate");

pub struct ServeProcess {
    pub child: Child,
    pub grpc: String,
    pub admin: String,
    /// The log line that says where it listens (and which store it uses).
    pub listening: String,
    /// Log lines after the listening line.
    pub logs: mpsc::Receiver<String>,
}

impl ServeProcess {
    /// `tollgate serve` on loopback port 0 in `dir`, with `args` added.
    pub fn start(dir: &Path, args: &[&str]) -> Self {
        Self::start_with_env(dir, args, &[])
    }

    /// As `start`, with extra environment variables.
    pub fn start_with_env(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Self {
        Self::start_under(&[], dir, args, env)
    }

    /// As `start_with_env`, run by `wrapper` (a command and its arguments,
    /// such as `prlimit --nofile=64`) when it is not empty.
    pub fn start_under(wrapper: &[&str], dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut command = match wrapper.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(BIN);
                c
            }
            None => Command::new(BIN),
        };
        let mut child = command
            .current_dir(dir)
            .envs(env.iter().copied())
            .arg("serve")
            // Loopback port 0 for both, unless the test names its own.
            .args(
                ["--grpc-addr", "--admin-addr"]
                    .into_iter()
                    .filter(|flag| !args.contains(flag))
                    .flat_map(|flag| [flag, "127.0.0.1:0"]),
            )
            .args(args)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("tollgate starts");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let line = loop {
            let line = rx
                .recv_timeout(Duration::from_secs(30))
                .expect("tollgate logs its addresses");
            if line.contains("tollgate listening") {
                break line;
            }
        };
        // Text logs say `grpc=ADDR`; JSON logs say `"grpc":"ADDR"`.
        let field = |name: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{name}=")).map(str::to_owned))
                .or_else(|| {
                    let start = line.find(&format!("\"{name}\":\""))? + name.len() + 4;
                    Some(line[start..].split('"').next()?.to_owned())
                })
                .unwrap_or_else(|| panic!("no {name} in {line:?}"))
        };
        Self {
            grpc: field("grpc"),
            admin: field("admin"),
            listening: line.clone(),
            child,
            logs: rx,
        }
    }

    /// Polls `/readyz` on the admin port (bounded) until it answers 200.
    pub fn wait_ready(&self) {
        for _ in 0..1500 {
            if self
                .admin_get("/readyz")
                .is_ok_and(|r| r.starts_with("HTTP/1.1 200"))
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("tollgate on {} never became ready", self.grpc);
    }

    /// The admin port's whole HTTP response (status line, headers, body)
    /// to `GET path`.
    pub fn admin_get(&self, path: &str) -> std::io::Result<String> {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(&self.admin)?;
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            self.admin
        );
        stream.write_all(request.as_bytes())?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        Ok(response)
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(mut self) -> (std::process::ExitStatus, Vec<String>) {
        Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        let status = self.child.wait().unwrap();
        // Every line up to the end of the child's stderr: the reader thread
        // ends (and drops its sender) at end of file, so this cannot miss
        // the last lines the way a non-blocking drain right after `wait`
        // could.
        (status, self.logs.iter().collect())
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `tollgate ARGS` in `dir` and returns its output.
pub fn tollgate(dir: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .current_dir(dir)
        .args(args)
        .output()
        .unwrap()
}

pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Runs `tollgate ARGS` in `dir`, which must succeed; returns its stdout.
pub fn succeeds(dir: &Path, args: &[&str]) -> String {
    let out = tollgate(dir, args);
    assert!(
        out.status.success(),
        "tollgate {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout(&out)
}

/// Runs `tollgate ARGS` in `dir`, which must fail; returns its stderr.
pub fn fails(dir: &Path, args: &[&str]) -> String {
    let out = tollgate(dir, args);
    assert!(!out.status.success(), "tollgate {args:?} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}
