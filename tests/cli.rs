//! The command line as a user runs it: `serve`, `check`, `limits`.

use crate::common;

use std::time::Duration;

use common::process::{ServeProcess, stdout, tollgate};

#[test]
fn first_five_minutes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path();
    // A tenant whose tokens come back slowly (one every 2 minutes), so that
    // `check --repeat` below sees exactly its burst however slow the
    // machine is.
    let out = tollgate(
        path,
        &[
            "limits", "set", "--create", "--tenant", "batch", "--burst", "30", "--rate", "30/hour",
        ],
    );
    assert!(out.status.success(), "{out:?}");
    let server = ServeProcess::start(path, &["--reload-interval", "100ms"]);
    let url = format!("http://{}", server.grpc);

    // Check a key, then watch the burst run out.
    let out = tollgate(
        path,
        &[
            "check", "--server", &url, "--tenant", "acme", "--key", "alice",
        ],
    );
    assert!(out.status.success());
    let line = stdout(&out);
    assert!(line.starts_with("ALLOWED   remaining 29/30"), "{line}");
    assert!(line.contains("rule default-per-key (600/minute)"), "{line}");
    assert!(
        line.contains(
            "RateLimit: \"default-per-key\";r=29;t=1, \
             RateLimit-Policy: \"default-per-key\";q=30;w=3"
        ),
        "{line}"
    );

    let out = tollgate(
        path,
        &[
            "check", "--server", &url, "--tenant", "batch", "--key", "bob", "--repeat", "32",
        ],
    );
    let lines: Vec<String> = stdout(&out).lines().map(str::to_owned).collect();
    assert_eq!(lines.len(), 32);
    for (i, line) in lines.iter().enumerate() {
        assert_eq!(line.contains(" ALLOWED "), i < 30, "{lines:#?}");
    }
    for line in &lines[30..] {
        assert!(line.contains(" REJECTED "), "{line}");
        assert!(line.contains("Retry-After: 120"), "{line}");
    }

    // Change the tenant's limit and see it take effect, no restart.
    let out = tollgate(
        path,
        &[
            "limits",
            "set",
            "--tenant",
            "acme",
            "--burst",
            "300",
            "--rate",
            "6000/minute",
        ],
    );
    assert!(out.status.success(), "{out:?}");
    assert_eq!(stdout(&out), "set acme-any-key (burst 300, 6000/minute)\n");
    let list = stdout(&tollgate(path, &["limits", "list"]));
    let header = list.lines().next().unwrap();
    assert!(header.starts_with("NAME"), "{list}");
    assert!(
        list.lines().any(|l| l.starts_with("acme-any-key")
            && l.contains("300")
            && l.contains("6000/minute")),
        "{list}"
    );

    let mut picked_up = false;
    for i in 0..100 {
        let key = format!("carol-{i}");
        let line = stdout(&tollgate(
            path,
            &["check", "--server", &url, "--tenant", "acme", "--key", &key],
        ));
        if line.contains("rule acme-any-key") {
            assert!(line.contains("remaining 299/300"), "{line}");
            picked_up = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(picked_up, "the new limit was never applied");

    // Bad input: a clear message and a failing exit status.
    let out = tollgate(
        path,
        &[
            "limits", "set", "--tenant", "acme", "--burst", "0", "--rate", "5/second",
        ],
    );
    assert!(!out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "error: row \"acme-any-key\" (tenant \"acme\", resource \"\", scope \"key\"): burst must be at least 1\n"
    );
    let out = tollgate(
        path,
        &["limits", "set", "--burst", "5", "--rate", "5/fortnight"],
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "error: rate \"5/fortnight\": unit \"fortnight\" must be second, minute, hour, day, week, month or year\n"
    );
    let out = tollgate(path, &["check", "--server", &url, "--key", ""]);
    assert!(!out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "error: InvalidArgument: key is empty; send the caller's API key, user id or IP address\n"
    );

    let out = tollgate(path, &["limits", "delete", "--name", "acme-any-key"]);
    assert_eq!(stdout(&out), "deleted acme-any-key\n");
    let out = tollgate(path, &["limits", "delete", "--name", "acme-any-key"]);
    assert!(!out.status.success());

    // SIGTERM: a clean exit.
    let (status, logs) = server.terminate();
    assert!(status.success(), "{status:?} {logs:#?}");
    assert!(
        logs.iter().any(|l| l.contains("tollgate stopped")),
        "{logs:#?}"
    );
}

#[test]
fn serve_refuses_a_bad_store_url_or_limits_path_without_printing_passwords() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path();
    let out = tollgate(
        path,
        &["serve", "--store", "mongodb://:hunter2@127.0.0.1:27017"],
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("mongodb://:***@127.0.0.1:27017"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("hunter2"),
        "the password must not be printed: {stderr}"
    );

    let out = tollgate(
        path,
        &[
            "serve",
            "--grpc-addr",
            "127.0.0.1:0",
            "--admin-addr",
            "127.0.0.1:0",
            "--limits",
            "db/x.db",
        ],
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("error: limits table:"));
}

#[test]
fn configuration_precedence_is_flag_then_environment_then_file_then_default() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path();
    std::fs::write(
        path.join("tollgate.toml"),
        "limits = \"from-file.db\"\nmax_buckets = 5000\nlog_format = \"json\"\nreload_interval = \"10s\"\nenvoy_shadow_mode = true\n",
    )
    .unwrap();
    let server = ServeProcess::start_with_env(
        path,
        &["--config", "tollgate.toml", "--reload-interval", "100ms"],
        &[("TOLLGATE_LIMITS", "from-env.db")],
    );
    // The environment beat the file for the limits table...
    assert!(path.join("from-env.db").exists());
    assert!(!path.join("from-file.db").exists());
    // ...the file beat the default for the bucket cap...
    let metrics = server.admin_get("/metrics").unwrap();
    assert_eq!(
        common::envoy::sample(&metrics, "tollgate_buckets_max"),
        Some(5000),
        "{metrics}"
    );
    let (status, logs) = server.terminate();
    assert!(status.success());
    // ...and set JSON logs.
    assert!(
        logs.iter()
            .any(|l| l.starts_with('{') && l.contains("\"message\":\"tollgate stopped\"")),
        "{logs:#?}"
    );

    std::fs::write(path.join("bad.toml"), "grpc_adress = \"x\"\n").unwrap();
    let out = tollgate(path, &["serve", "--config", "bad.toml"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unknown option \"grpc_adress\"; known options:"),
        "{err}"
    );
    assert!(err.contains("grpc_addr"), "{err}");

    let out = tollgate(path, &["--version"]);
    assert_eq!(
        stdout(&out),
        format!("tollgate {}\n", env!("CARGO_PKG_VERSION"))
    );
}

/// `--worker-threads N` runs the service on N threads (what the runtime
/// reports), and 0, the default, on one per CPU the process may use; the
/// runtime has its LIFO slot off when the build can turn it off (the flag
/// in .cargo/config.toml) unless `--runtime-lifo-slot` keeps it.
#[test]
fn worker_threads_sizes_the_runtime() {
    let dir = tempfile::tempdir().unwrap();
    let gauge = |server: &ServeProcess, name: &str| -> usize {
        let metrics = server.admin_get("/metrics").unwrap();
        let prefix = format!("{name} ");
        let line = metrics
            .lines()
            .find(|l| l.starts_with(&prefix))
            .unwrap_or_else(|| panic!("no {name} in {metrics}"));
        line[prefix.len()..].parse().unwrap()
    };
    let workers = |server: &ServeProcess| gauge(server, "tollgate_worker_threads");
    for n in [1, 3] {
        let server = ServeProcess::start(dir.path(), &["--worker-threads", &n.to_string()]);
        server.wait_ready();
        assert_eq!(workers(&server), n);
    }
    let server = ServeProcess::start_with_env(dir.path(), &[], &[("TOLLGATE_WORKER_THREADS", "0")]);
    server.wait_ready();
    let cpus = std::thread::available_parallelism().unwrap().get();
    assert_eq!(workers(&server), cpus);
    // The binary is built with the same flags as this test: without
    // `--cfg tokio_unstable` (a RUSTFLAGS of the user's own, `cargo
    // install`) it keeps the slot and says so, and that is a correct build.
    let expected = usize::from(!tollgate::runtime::CAN_TURN_OFF_LIFO_SLOT);
    assert_eq!(gauge(&server, "tollgate_runtime_lifo_slot"), expected);
    let server = ServeProcess::start(dir.path(), &["--runtime-lifo-slot"]);
    server.wait_ready();
    assert_eq!(gauge(&server, "tollgate_runtime_lifo_slot"), 1);
    let server =
        ServeProcess::start_with_env(dir.path(), &[], &[("TOLLGATE_RUNTIME_LIFO_SLOT", "true")]);
    server.wait_ready();
    assert_eq!(gauge(&server, "tollgate_runtime_lifo_slot"), 1);

    let out = tollgate(dir.path(), &["serve", "--worker-threads", "5000"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("5000 is not in 0..=1024"), "{err}");
}

/// `tollgate limits list | head -0`: the reader is gone before the first
/// line; the command ends quietly with status 0 instead of panicking.
#[test]
fn a_closed_stdout_ends_a_command_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = std::process::Command::new(common::process::BIN)
        .current_dir(dir.path())
        .args(["limits", "list", "--create"])
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn tollgate_health_reports_serving() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(dir.path(), &[]);
    server.wait_ready();
    let out = tollgate(
        dir.path(),
        &["health", "--server", &format!("http://{}", server.grpc)],
    );
    assert!(out.status.success(), "{out:?}");
    assert_eq!(stdout(&out), "SERVING\n");
    drop(server);
    let out = tollgate(dir.path(), &["health", "--server", "http://127.0.0.1:1"]);
    assert!(!out.status.success());
}

fn stderr(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn edits_name_their_table_and_return_once_the_server_applied_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path();
    let table = std::fs::canonicalize(path)
        .unwrap()
        .join("tollgate-limits.db");
    let set = |dir: &std::path::Path, extra: &[&str]| {
        let args = [
            &[
                "limits",
                "set",
                "--tenant",
                "acme",
                "--burst",
                "300",
                "--rate",
                "6000/minute",
            ][..],
            extra,
        ]
        .concat();
        tollgate(dir, &args)
    };
    // No table here yet: an error naming the file, and no file made.
    let out = set(path, &["--wait-for", "none"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains(&format!(
            "no limits table at {}: `tollgate serve` creates it there, or pass --create",
            table.display()
        )),
        "{}",
        stderr(&out)
    );
    assert!(!table.exists());

    // A server that reads the table every 3 s: without waiting for it, a
    // check right after the edit would see the old rule.
    let server = ServeProcess::start(path, &["--reload-interval", "3s"]);
    let url = format!("http://{}", server.grpc);
    let out = set(path, &["--wait-for", &url]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(stdout(&out), "set acme-any-key (burst 300, 6000/minute)\n");
    let told = stderr(&out);
    assert!(
        told.starts_with(&format!("written to {} (table version ", table.display())),
        "{told}"
    );
    assert!(
        told.ends_with(&format!("); applied by the server at {url}\n")),
        "{told}"
    );
    let check = tollgate(
        path,
        &["check", "--server", &url, "--tenant", "acme", "--key", "k"],
    );
    assert!(
        stdout(&check).contains("rule acme-any-key (6000/minute)"),
        "{}",
        stdout(&check)
    );

    // Another directory's table, made on purpose: the server reads
    // another table, and the command says so rather than wait.
    let other = tempfile::tempdir().unwrap();
    let out = set(other.path(), &["--create", "--wait-for", &url]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        stderr(&out).contains(&format!(
            "the server at {url} reads another table (its --limits), so it will not see this edit"
        )),
        "{}",
        stderr(&out)
    );
    drop(server);
    // No server: the edit is written and the command says nobody answered.
    let out = tollgate(
        path,
        &[
            "limits",
            "set",
            "--tenant",
            "initech",
            "--burst",
            "1",
            "--rate",
            "1/second",
            "--wait-for",
            &url,
        ],
    );
    assert!(out.status.success(), "{out:?}");
    assert!(
        stderr(&out).contains(&format!("; no server answers at {url} ")),
        "{}",
        stderr(&out)
    );
}

#[test]
fn acquire_and_release_try_a_concurrency_cap_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path();
    let out = tollgate(
        path,
        &[
            "limits",
            "set",
            "--create",
            "--wait-for",
            "none",
            "--tenant",
            "reports",
            "--scope",
            "tenant",
            "--concurrency",
            "1",
        ],
    );
    assert!(out.status.success(), "{out:?}");
    let server = ServeProcess::start(path, &[]);
    let url = format!("http://{}", server.grpc);
    let acquire = || {
        tollgate(
            path,
            &[
                "acquire", "--server", &url, "--tenant", "reports", "--key", "k", "--ttl", "5m",
            ],
        )
    };
    let first = acquire();
    assert!(first.status.success(), "{first:?}");
    let line = stdout(&first);
    assert!(line.starts_with("GRANTED   lease "), "{line}");
    assert!(line.contains("  in flight 1/1  "), "{line}");
    let lease = line.split_whitespace().nth(2).unwrap().to_owned();
    // The one slot is held: refused, exit status 1.
    let second = acquire();
    assert_eq!(second.status.code(), Some(1), "{second:?}");
    assert!(
        stdout(&second).starts_with("REFUSED   in flight 1/1  "),
        "{}",
        stdout(&second)
    );
    let release = || tollgate(path, &["release", "--server", &url, "--lease", &lease]);
    assert_eq!(stdout(&release()), "RELEASED\n");
    assert_eq!(stdout(&release()), "ALREADY RELEASED (nothing changed)\n");
    assert!(acquire().status.success());
}
