//! The Python and Node.js middlewares in `examples/`, run against a live
//! Tollgate: the application answers until the key's burst is spent, then
//! the middleware answers 429 with Tollgate's headers.

use crate::common;

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};

use common::process::{ServeProcess, tollgate};
use common::redis::free_port;

struct App(Child);

impl Drop for App {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn get(port: u16, key: &str) -> (u16, String) {
    get_with(port, key, &[])
}

fn get_with(port: u16, key: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    write!(
        s,
        "GET / HTTP/1.1\r\nHost: app\r\nx-api-key: {key}\r\n{extra}Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut r = String::new();
    s.read_to_string(&mut r).unwrap();
    (
        r.split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0),
        r.to_ascii_lowercase(),
    )
}

/// Starts the example `command` for `tenant` against `server` (with
/// `extra` arguments after the timeout) and waits until it listens.
fn start_app(
    mut command: Command,
    server: &ServeProcess,
    tenant: &str,
    extra: &[&str],
) -> (App, u16) {
    let port = free_port(false);
    let mut child = command
        // A generous deadline: on a loaded machine the first call (which
        // also connects) can take longer than the examples' default 50 ms,
        // and they would then let the request through unlimited.
        .args([
            port.to_string(),
            server.grpc.clone(),
            tenant.into(),
            "5000".into(),
        ])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the example starts (scripts/test installs its dependencies)");
    let stdout = child.stdout.take().unwrap();
    let app = App(child);
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), format!("listening on 127.0.0.1:{port}"));
    (app, port)
}

fn check(command: Command) {
    let dir = tempfile::tempdir().unwrap();
    let out = tollgate(
        dir.path(),
        &[
            "limits", "set", "--create", "--tenant", "shop", "--burst", "2", "--rate", "1/hour",
        ],
    );
    assert!(out.status.success());
    let server = ServeProcess::start(dir.path(), &[]);
    let (_app, port) = start_app(command, &server, "shop", &[]);

    for left in ["1", "0"] {
        let (status, response) = get(port, "customer-1");
        assert_eq!(status, 200, "{response}");
        assert!(response.contains("hello from the application"));
        let state = response
            .lines()
            .find_map(|l| l.strip_prefix("ratelimit: "))
            .unwrap_or_else(|| panic!("no RateLimit field in {response}"));
        assert!(state.contains(&format!(";r={left};t=")), "{response}");
        assert!(response.contains("ratelimit-policy: "), "{response}");
    }
    let (status, response) = get(port, "customer-1");
    assert_eq!(status, 429, "{response}");
    assert!(response.contains("retry-after: 3600\r\n"), "{response}");
    assert!(
        response.contains("ratelimit-policy: \"shop-any-key\";q=2;w=7200\r\n"),
        "{response}"
    );
    assert!(
        response.contains("ratelimit: \"shop-any-key\";r=0;t=7200\r\n"),
        "{response}"
    );
    assert!(!response.contains("hello from the application"));
    assert_eq!(
        get(port, "customer-2").0,
        200,
        "another key has its own budget"
    );
}

/// The reserve -> call -> settle helper: a key of 1 000 tokens (1 000 a
/// day, one every 86.4 s) that may go 500 below zero. `error_headers`:
/// the server's error page carries the application's headers (Node's
/// does; WSGI's own error page carries none).
fn check_budget(command: Command, error_headers: bool) {
    let dir = tempfile::tempdir().unwrap();
    let out = tollgate(
        dir.path(),
        &[
            "limits", "set", "--create", "--tenant", "llm", "--burst", "1000", "--rate",
            "1000/day", "--debt", "500",
        ],
    );
    assert!(out.status.success(), "{out:?}");
    let server = ServeProcess::start(dir.path(), &[]);
    let (_app, port) = start_app(command, &server, "llm", &["budget"]);
    let call = |max: &str, used: &str, fail: bool| {
        let mut headers = vec![("x-max-tokens", max), ("x-want-tokens", used)];
        if fail {
            headers.push(("x-fail", "1"));
        }
        get_with(port, "ada", &headers)
    };
    let remaining = |response: &str| -> u64 {
        response
            .lines()
            .find_map(|l| l.strip_prefix("ratelimit: "))
            .and_then(|v| v.split(';').find_map(|p| p.strip_prefix("r=")))
            .unwrap_or_else(|| panic!("no RateLimit remaining (r=) in {response}"))
            .trim()
            .parse()
            .unwrap()
    };
    // Reserve 300, use 120: 700 left while it runs.
    let (status, response) = call("300", "120", false);
    assert_eq!(status, 200, "{response}");
    assert!(response.contains("a completion"));
    assert_eq!(remaining(&response), 700);
    // The 180 came back: reserving all 880 that are left passes, with
    // nothing to spare (a settle lands after the response; wait for it).
    let mut settled = false;
    for _ in 0..200 {
        let (status, response) = call("1", "0", false);
        assert_eq!(status, 200, "{response}");
        if remaining(&response) == 879 {
            settled = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(settled, "the settle of 120 refunded 180");
    // A failed call refunds its whole estimate.
    let (status, response) = call("500", "0", true);
    assert_eq!(status, 500, "{response}");
    if error_headers {
        assert_eq!(remaining(&response), 380);
    } else {
        assert!(!response.contains("ratelimit-remaining"), "{response}");
    }
    // 880 reserved, 1 500 used: 620 over, into debt down to -500.
    let mut refunded = false;
    for _ in 0..200 {
        let (status, response) = call("880", "1500", false);
        if status == 200 {
            assert_eq!(remaining(&response), 0);
            refunded = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(refunded, "the failed call's 500 came back");
    // In debt: refused, with a wait of 501 tokens at 86.4 s each, less
    // the few seconds this test has run.
    let mut retry = 0;
    for _ in 0..200 {
        let (status, response) = call("1", "1", false);
        if status == 429 {
            retry = response
                .lines()
                .find_map(|l| l.strip_prefix("retry-after: "))
                .unwrap()
                .trim()
                .parse()
                .unwrap();
            break;
        }
        assert_eq!(status, 200, "{response}");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let exact = (501 * 86_400_000_u64).div_ceil(1_000_000);
    assert!(
        (exact - 60..=exact).contains(&retry),
        "Retry-After {retry}, expected just under {exact}"
    );
}

#[test]
fn python_budget_helper_reserves_and_settles() {
    let mut c = Command::new("python3");
    c.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/python/tollgate_middleware.py"
    ));
    check_budget(c, false);
}

#[test]
fn node_budget_helper_reserves_and_settles() {
    let mut c = Command::new("node");
    c.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/node/server.js"
    ));
    check_budget(c, true);
}

#[test]
fn python_grpcio_middleware() {
    let mut c = Command::new("python3");
    c.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/python/tollgate_middleware.py"
    ));
    check(c);
}

#[test]
fn node_grpc_js_middleware() {
    let mut c = Command::new("node");
    c.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/node/server.js"
    ));
    check(c);
}

/// The hold-a-slot helper: a tenant-wide cap of one request in flight. A
/// request holds the slot while the application works, a second one meanwhile
/// gets a 429, the slot is back once the first is done; and when the app
/// process is killed mid-request, its slot is free within a second.
fn check_slot(command: impl Fn() -> Command) {
    let dir = tempfile::tempdir().unwrap();
    let out = tollgate(
        dir.path(),
        &[
            "limits",
            "set",
            "--create",
            "--tenant",
            "reports",
            "--scope",
            "tenant",
            "--concurrency",
            "1",
        ],
    );
    assert!(out.status.success(), "{out:?}");
    let server = ServeProcess::start(dir.path(), &[]);
    let (first, port) = start_app(command(), &server, "reports", &["slot"]);
    let (_second, other) = start_app(command(), &server, "reports", &["slot"]);
    let work = |port: u16, ms: &'static str| get_with(port, "alice", &[("x-work-ms", ms)]);
    // Waits (bounded) until a request through `port` is refused: the slot
    // is held.
    let wait_held = |port: u16| -> String {
        for _ in 0..500 {
            let (status, response) = work(port, "0");
            if status == 429 {
                return response;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        panic!("the slot was never held: {:?}", work(port, "0"));
    };

    // The slow request retries while a probe below happens to hold the
    // slot (bounded).
    let slow = std::thread::spawn(move || {
        for _ in 0..500 {
            let answer = work(port, "1500");
            if answer.0 != 429 {
                return answer;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        panic!("the slow request never got the slot");
    });
    let refused = wait_held(other);
    assert!(
        refused.contains(
            "ratelimit-policy: \"reports-any-tenant-concurrency\";q=1;qu=\"concurrent-requests\"\r\n"
        ),
        "{refused}"
    );
    assert!(
        refused.contains("ratelimit: \"reports-any-tenant-concurrency\";r=0;t="),
        "{refused}"
    );
    assert!(refused.contains("retry-after: "), "{refused}");
    assert!(!refused.contains("work done"));
    let (status, response) = slow.join().unwrap();
    assert_eq!(status, 200, "{response}");
    assert!(response.contains("work done"));
    // Released when the response was done.
    let mut free = false;
    for _ in 0..100 {
        if work(other, "0").0 == 200 {
            free = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(free, "the slot came back after the request");

    // Killed while holding: a request that would take a minute holds the
    // slot, then its process dies.
    let _stuck = std::thread::spawn(move || {
        let _ = std::panic::catch_unwind(|| {
            for _ in 0..500 {
                if work(port, "60000").0 != 429 {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        });
    });
    wait_held(other);
    let mut app = first;
    app.0.kill().unwrap();
    app.0.wait().unwrap();
    let killed = tokio::time::Instant::now();
    let mut freed = None;
    for _ in 0..100 {
        if work(other, "0").0 == 200 {
            freed = Some(killed.elapsed());
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let freed = freed.expect("the dead process's slot was freed");
    println!("slot freed {freed:?} after its holder was killed (its ttl is 60 s)");
}

#[test]
fn python_slot_helper_holds_one_slot_per_request() {
    check_slot(|| {
        let mut c = Command::new("python3");
        c.arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/examples/python/tollgate_middleware.py"
        ));
        c
    });
}

#[test]
fn node_slot_helper_holds_one_slot_per_request() {
    check_slot(|| {
        let mut c = Command::new("node");
        c.arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/examples/node/server.js"
        ));
        c
    });
}
