//! The client packages as a user installs them, against a live Tollgate:
//!
//! - Python: `clients/python` built into a wheel (its stubs generated from
//!   `proto/` while it builds), installed with pip into a fresh virtualenv
//!   beside Starlette and uvicorn; `tests/clients/python_app.py` runs a WSGI
//!   and an ASGI app with it.
//! - Node.js: `clients/node` packed with `npm pack` and installed from the
//!   tarball into a fresh project beside Express and Fastify;
//!   `tests/clients/node_app.js` runs an app of each.
//!
//! Each app is checked for decisions, an honest 429 with Tollgate's
//! headers, reserve/settle (a settle at the usage, a refund when the work
//! fails), a concurrency slot held by a request and released when the app
//! process is killed, backoff that waits for `retry_after`, and the
//! unreachable-server policy (fail open or closed). These tests download
//! the packages' dependencies (PyPI, npm) the first time.

use crate::common;

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::process::{ServeProcess, tollgate};
use common::redis::free_port;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

struct App(Child);

impl Drop for App {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `GET path` with `x-api-key: key`: the status and the lower-cased
/// response.
fn get(port: u16, path: &str, key: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: app\r\nx-api-key: {key}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut r = String::new();
    let _ = s.read_to_string(&mut r);
    let status = r
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, r.to_ascii_lowercase())
}

fn run(command: &mut Command, what: &str) {
    let out = command.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A server whose table holds only the apps' tenants: `web` (2 an hour
/// per key), `llm` (100 an hour per key), `slots` (one request at a time)
/// and `paced` (one, then 5 a second).
fn server(dir: &Path) -> ServeProcess {
    for args in [
        &["--tenant", "web", "--burst", "2", "--rate", "1/hour"][..],
        &["--tenant", "llm", "--burst", "100", "--rate", "1/hour"][..],
        &[
            "--tenant",
            "slots",
            "--scope",
            "tenant",
            "--concurrency",
            "1",
        ][..],
        &["--tenant", "paced", "--burst", "1", "--rate", "5/second"][..],
    ] {
        let mut all = vec!["limits", "set", "--create", "--wait-for", "none"];
        all.extend_from_slice(args);
        let out = tollgate(dir, &all);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // No default row: the apps' other routes pass the middleware as a
    // tenant without rules.
    let out = tollgate(
        dir,
        &[
            "limits",
            "delete",
            "--name",
            "default-per-key",
            "--wait-for",
            "none",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let server = ServeProcess::start(dir, &[]);
    server.wait_ready();
    server
}

/// Starts `command` (an app taking `PORT TOLLGATE TENANT POLICY` last) and
/// waits until it accepts connections.
fn start(mut command: Command, target: &str, policy: &str) -> (App, u16) {
    let port = free_port(false);
    let child = command
        .args([port.to_string().as_str(), target, "web", policy])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the app starts");
    let mut app = App(child);
    let mut line = String::new();
    BufReader::new(app.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), format!("listening on 127.0.0.1:{port}"));
    for _ in 0..300 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return (app, port);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("the app never listened on {port}");
}

/// What a dry run of cost 1 leaves for `tenant`'s `key`: the tokens now,
/// less one.
fn left_after_one(server: &ServeProcess, tenant: &str, key: &str) -> String {
    let out = tollgate(
        Path::new("."),
        &[
            "check",
            "--server",
            &format!("http://{}", server.grpc),
            "--tenant",
            tenant,
            "--key",
            key,
            "--dry-run",
        ],
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.split_whitespace()
        .skip_while(|w| *w != "remaining")
        .nth(1)
        .unwrap_or_else(|| panic!("no remaining in {text}"))
        .to_owned()
}

/// Everything an app of either package must do (`app` starts one with a
/// policy, against a Tollgate address).
fn check_app(server: &ServeProcess, app: &dyn Fn(&str, &str) -> (App, u16), name: &str) {
    let target = server.grpc.clone();
    let (mut running, port) = app(&target, "open");
    let user = format!("{name}-user");

    // Decisions through the middleware: two, then an honest 429.
    for left in ["1", "0"] {
        let (status, r) = get(port, "/", &user);
        assert_eq!(status, 200, "{name}: {r}");
        assert!(r.contains("hello"), "{name}: {r}");
        assert!(r.contains(&format!(";r={left};t=")), "{name}: {r}");
    }
    let (status, r) = get(port, "/", &user);
    assert_eq!(status, 429, "{name}: {r}");
    assert!(r.contains("retry-after: 3600\r\n"), "{name}: {r}");
    assert!(
        r.contains("ratelimit-policy: \"web-any-key\";q=2;w=7200\r\n"),
        "{name}: {r}"
    );
    assert!(!r.contains("hello"), "{name}: {r}");

    // Reserve 50, settle at the 20 used: 80 left. Then a failed piece of
    // work refunds its estimate: still 80.
    let key = format!("{name}-llm");
    let (status, r) = get(
        port,
        &format!("/reserve?key={key}&estimate=50&used=20"),
        "x",
    );
    assert_eq!(status, 200, "{name}: {r}");
    assert_eq!(left_after_one(server, "llm", &key), "79/100", "{name}");
    let (status, r) = get(port, &format!("/reserve?key={key}&estimate=30&fail=1"), "x");
    assert_eq!(status, 500, "{name}: {r}");
    assert_eq!(left_after_one(server, "llm", &key), "79/100", "{name}");
    // Without a usage, the estimate is what the work cost.
    let (status, _) = get(port, &format!("/reserve?key={key}&estimate=9"), "x");
    assert_eq!(status, 200);
    assert_eq!(left_after_one(server, "llm", &key), "70/100", "{name}");
    // More than is left: refused with the headers.
    let (status, r) = get(port, &format!("/reserve?key={key}&estimate=90"), "x");
    assert_eq!(status, 429, "{name}: {r}");
    assert!(r.contains("retry-after: "), "{name}: {r}");

    // A batch: both admitted together; one that cannot fit refused whole
    // (nothing charged); one no bucket can hold is a caller's error, with
    // the message saying so.
    let batch = format!("{name}-batch");
    let (status, r) = get(port, &format!("/batch?key={batch}&cost=10"), "x");
    assert_eq!(status, 200, "{name}: {r}");
    assert!(r.contains("remaining [99, 90]"), "{name}: {r}");
    let (status, r) = get(port, &format!("/batch?key={batch}&cost=95"), "x");
    assert_eq!(status, 429, "{name}: {r}");
    assert_eq!(left_after_one(server, "llm", &batch), "98/100", "{name}");
    let (status, r) = get(port, &format!("/batch?key={batch}&cost=500"), "x");
    assert_eq!(status, 400, "{name}: {r}");
    assert!(r.contains("invalid") && r.contains("500"), "{name}: {r}");

    // Backoff: the first is admitted; the second waits for the refill
    // (a fifth of a second) instead of failing; without time to wait, it
    // is refused.
    let paced = format!("{name}-paced");
    let (status, r) = get(port, &format!("/wait?key={paced}&max_wait=0"), "x");
    assert_eq!(status, 200, "{name}: {r}");
    let (status, r) = get(port, &format!("/wait?key={paced}&max_wait=5"), "x");
    assert_eq!(status, 200, "{name}: {r}");
    let (status, r) = get(port, &format!("/wait?key={paced}&max_wait=0"), "x");
    assert_eq!(status, 429, "{name}: {r}");

    // A slot: one request holds tenant `slots`' only slot; a second is
    // refused with 429; a request that ends gives it back.
    let (status, r) = get(port, "/slot?ms=0", "x");
    assert_eq!(status, 200, "{name}: {r}");
    assert!(r.contains("held 1/1"), "{name}: {r}");
    // The holder asks until it holds the slot (a probe below may hold it
    // for a moment); then its request lasts a minute.
    let holder = std::thread::spawn(move || {
        for _ in 0..1000 {
            let (status, r) = get(port, "/slot?ms=60000", "x");
            if status != 429 {
                return (status, r);
            }
        }
        (429, String::new())
    });
    let mut refused = false;
    for _ in 0..100 {
        std::thread::sleep(Duration::from_millis(50));
        let (status, r) = get(port, "/slot?ms=0", "x");
        if status == 429 {
            assert!(r.contains("retry-after: "), "{name}: {r}");
            refused = true;
            break;
        }
    }
    assert!(
        refused,
        "{name}: a second request is refused while the slot is held"
    );
    // Kill the app while it holds the slot: its connection drops and
    // Tollgate frees the slot at once (the lease's 60 s ttl is not waited
    // for).
    running.0.kill().unwrap();
    running.0.wait().unwrap();
    let _ = holder.join();
    let (_again, port) = app(&target, "open");
    let mut freed = false;
    for _ in 0..250 {
        if get(port, "/slot?ms=0", "x").0 == 200 {
            freed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        freed,
        "{name}: the slot is free after the holder was killed"
    );
    drop(_again);

    // Tollgate unreachable: fail open lets the request through, fail
    // closed answers 429.
    let dead = format!("127.0.0.1:{}", free_port(false));
    let (_open, port) = app(&dead, "open");
    let (status, r) = get(port, "/", "anyone");
    assert_eq!(status, 200, "{name} fail open: {r}");
    let (_closed, port) = app(&dead, "closed");
    let (status, r) = get(port, "/", "anyone");
    assert_eq!(status, 429, "{name} fail closed: {r}");
}

/// Builds the wheel from a copy of `clients/python` with the proto beside
/// it (as an sdist holds it) and installs it with Starlette and uvicorn
/// into a fresh virtualenv; returns the virtualenv's python.
fn python_env(dir: &Path) -> PathBuf {
    let package = dir.join("pkg");
    copy_dir(&Path::new(ROOT).join("clients/python"), &package);
    let proto = package.join("proto/tollgate/v1");
    std::fs::create_dir_all(&proto).unwrap();
    std::fs::copy(
        Path::new(ROOT).join("proto/tollgate/v1/tollgate.proto"),
        proto.join("tollgate.proto"),
    )
    .unwrap();
    let dist = dir.join("dist");
    run(
        Command::new("python3")
            .args([
                "-m",
                "pip",
                "wheel",
                "--quiet",
                "--no-deps",
                "--no-build-isolation",
                "-w",
            ])
            .arg(&dist)
            .arg(&package),
        "building the wheel",
    );
    let wheel = std::fs::read_dir(&dist)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .expect("a wheel was built");
    let venv = dir.join("venv");
    run(
        Command::new("python3").args(["-m", "venv"]).arg(&venv),
        "creating a virtualenv",
    );
    let python = venv.join("bin/python");
    run(
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .arg(&wheel)
            .args(["starlette", "uvicorn"]),
        "pip install of the wheel",
    );
    python
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        if ["build", "node_modules", "__pycache__"].contains(&name.to_str().unwrap_or("")) {
            continue;
        }
        let path = entry.path();
        if path.is_dir() {
            copy_dir(&path, &to.join(&name));
        } else {
            std::fs::copy(&path, to.join(&name)).unwrap();
        }
    }
}

#[test]
fn the_python_package_installs_and_guards_a_wsgi_and_an_asgi_app() {
    let dir = tempfile::tempdir().unwrap();
    let python = python_env(dir.path());
    let data = tempfile::tempdir().unwrap();
    let server = server(data.path());
    let script = Path::new(ROOT).join("tests/clients/python_app.py");
    for mode in ["wsgi", "asgi"] {
        let start_app = |target: &str, policy: &str| {
            let mut c = Command::new(&python);
            c.arg(&script).arg(mode);
            start(c, target, policy)
        };
        check_app(&server, &start_app, mode);
    }
}

/// Packs `clients/node` with `npm pack` (which copies the proto in) and
/// installs the tarball with Express and Fastify into a fresh project;
/// returns the project's directory.
fn node_project(dir: &Path) -> PathBuf {
    let package = dir.join("pkg");
    copy_dir(&Path::new(ROOT).join("clients/node"), &package);
    // The prepack script reads the proto from the repository layout.
    let proto = dir.join("proto/tollgate/v1");
    std::fs::create_dir_all(&proto).unwrap();
    std::fs::copy(
        Path::new(ROOT).join("proto/tollgate/v1/tollgate.proto"),
        proto.join("tollgate.proto"),
    )
    .unwrap();
    let nested = dir.join("clients");
    std::fs::create_dir_all(&nested).unwrap();
    std::fs::rename(&package, nested.join("node")).unwrap();
    let package = nested.join("node");
    let packed = Command::new("npm")
        .args(["pack", "--silent", "--pack-destination"])
        .arg(dir)
        .current_dir(&package)
        .output()
        .expect("npm runs (scripts/test installs it)");
    assert!(
        packed.status.success(),
        "npm pack: {}",
        String::from_utf8_lossy(&packed.stderr)
    );
    let tarball = dir.join(String::from_utf8_lossy(&packed.stdout).trim());
    let project = dir.join("app");
    std::fs::create_dir_all(&project).unwrap();
    std::fs::write(
        project.join("package.json"),
        r#"{"name": "app", "version": "1.0.0", "private": true}"#,
    )
    .unwrap();
    run(
        Command::new("npm")
            .args(["install", "--silent", "--no-audit", "--no-fund"])
            .arg(&tarball)
            .args(["express@4", "fastify@4", "typescript@5", "@types/node@20"])
            .current_dir(&project),
        "npm install of the tarball",
    );
    std::fs::copy(
        Path::new(ROOT).join("tests/clients/node_app.js"),
        project.join("node_app.js"),
    )
    .unwrap();
    project
}

#[test]
fn the_node_package_installs_and_guards_an_express_and_a_fastify_app() {
    let dir = tempfile::tempdir().unwrap();
    let project = node_project(dir.path());
    // The package carries its types.
    let types = std::fs::read_to_string(project.join("node_modules/tollgate-client/index.d.ts"))
        .expect("the installed package has index.d.ts");
    assert!(types.contains("export class Tollgate"));
    assert!(
        project
            .join("node_modules/tollgate-client/proto/tollgate/v1/tollgate.proto")
            .is_file()
    );
    // A TypeScript user's code type-checks against them, strictly; a
    // misuse does not.
    let typed = "import { Tollgate, RateLimited, Decision, expressMiddleware } from \"tollgate-client\";\n\
        const t = new Tollgate(\"127.0.0.1:1\", { tenant: \"acme\", onUnreachable: \"closed\" });\n\
        async function f(): Promise<number> {\n\
          const d: Decision = await t.shouldAllow(\"alice\", { cost: 2 });\n\
          const n = await t.reserve(\"alice\", 10, async (r) => { r.used = 3; return r.estimate; });\n\
          await t.slot(\"alice\", { ttl: 5 }, (s) => s.lease.length);\n\
          try { await t.waitAllowed(\"a\", { maxWait: 10 }); } catch (e) { if (e instanceof RateLimited) return e.decision.retryAfter; }\n\
          expressMiddleware(t, { key: (req) => req.headers[\"x-api-key\"] });\n\
          return d.remaining + n;\n\
        }\n\
        f();\n";
    std::fs::write(project.join("typed.ts"), typed).unwrap();
    run(
        Command::new("npx")
            .args(["tsc", "--noEmit", "--strict", "typed.ts"])
            .current_dir(&project),
        "tsc on code using the types",
    );
    std::fs::write(
        project.join("wrong.ts"),
        "import { Tollgate } from \"tollgate-client\";\nnew Tollgate(\"x\", { onUnreachable: \"maybe\" });\n",
    )
    .unwrap();
    let wrong = Command::new("npx")
        .args(["tsc", "--noEmit", "--strict", "wrong.ts"])
        .current_dir(&project)
        .output()
        .unwrap();
    assert!(
        !wrong.status.success(),
        "a policy other than open or closed does not type-check"
    );
    let data = tempfile::tempdir().unwrap();
    let server = server(data.path());
    for mode in ["express", "fastify"] {
        let start_app = |target: &str, policy: &str| {
            let mut c = Command::new("node");
            c.arg(project.join("node_app.js"))
                .arg(mode)
                .current_dir(&project);
            start(c, target, policy)
        };
        check_app(&server, &start_app, mode);
    }
}
