//! Redis with a password, and over TLS: decisions work, and the password
//! never appears in what Tollgate prints.

use crate::common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::process::ServeProcess;
use common::redis::{free_port, redis_cli};
use tollgate::proto::v1::ShouldAllowRequest;
use tollgate::proto::v1::rate_limiter_client::RateLimiterClient;

const PASSWORD: &str = "s3cret-Pa55word";

/// A redis-server's TLS settings: the certificates of `tls::certificates`,
/// clients not asked for theirs.
const TLS: [&str; 8] = [
    "--tls-cert-file",
    "server.pem",
    "--tls-key-file",
    "server.key",
    "--tls-ca-cert-file",
    "ca.pem",
    "--tls-auth-clients",
    "no",
];

struct Redis {
    child: std::process::Child,
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_redis(dir: &std::path::Path, args: &[&str]) -> Redis {
    let child = Command::new("redis-server")
        .current_dir(dir)
        .args([
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--requirepass",
            PASSWORD,
        ])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Redis { child }
}

async fn decide(grpc: &str) -> tollgate::proto::v1::ShouldAllowResponse {
    let mut client = RateLimiterClient::connect(format!("http://{grpc}"))
        .await
        .unwrap();
    let request = ShouldAllowRequest {
        key: "k".into(),
        cost: 1,
        tenant: "t".into(),
        resource: String::new(),
        dry_run: false,
    };
    client.should_allow(request).await.unwrap().into_inner()
}

fn wait_for(port: u16, extra: &[&str]) {
    for _ in 0..500 {
        let mut args = vec!["-a", PASSWORD, "--no-auth-warning"];
        args.extend_from_slice(extra);
        args.push("PING");
        if redis_cli(port, &args) == "PONG" {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("redis on {port} did not start");
}

fn logs_of(server: ServeProcess) -> String {
    let (_, logs) = server.terminate();
    logs.join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_protected_redis() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port(false);
    let _redis = start_redis(dir.path(), &["--port", &port.to_string()]);
    wait_for(port, &[]);

    let good = format!("redis://:{PASSWORD}@127.0.0.1:{port}");
    let server = ServeProcess::start(dir.path(), &["--store", &good]);
    server.wait_ready();
    let r = decide(&server.grpc).await;
    assert!(r.allowed);
    assert_eq!(r.degraded, 0, "decided by Redis");
    assert_eq!(r.remaining, 29);
    // The store is logged, with the password masked.
    let listening = server.listening.clone();
    assert!(
        listening.contains(&format!("store=redis://:***@127.0.0.1:{port} ")),
        "{listening}"
    );
    let logs = logs_of(server);
    assert!(!logs.contains(PASSWORD), "{logs}");

    // A wrong password: the service runs degraded and says so, without
    // printing either password.
    let bad = format!("redis://:wrong-{PASSWORD}@127.0.0.1:{port}");
    let server = ServeProcess::start(dir.path(), &["--store", &bad, "--store-timeout", "200ms"]);
    let r = decide(&server.grpc).await;
    assert_eq!(r.degraded, 1, "fails open by the default rule's policy");
    std::thread::sleep(Duration::from_millis(300));
    let listening = server.listening.clone();
    assert!(
        listening.contains(&format!("store=redis://:***@127.0.0.1:{port} ")),
        "{listening}"
    );
    assert!(!listening.contains(PASSWORD), "{listening}");
    let logs = logs_of(server);
    assert!(logs.contains("store not reachable yet"), "{logs}");
    assert!(
        !logs.contains(PASSWORD),
        "the password leaked into the logs: {logs}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_over_tls_with_a_private_ca() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    common::tls::certificates(d);
    let port = free_port(false);
    let port_text = port.to_string();
    let mut args = vec!["--port", "0", "--tls-port", &port_text];
    args.extend(TLS);
    let _redis = start_redis(d, &args);
    wait_for(
        port,
        &["--tls", "--cacert", d.join("ca.pem").to_str().unwrap()],
    );

    let url = format!("rediss://:{PASSWORD}@127.0.0.1:{port}");
    let ca = d.join("ca.pem");
    let server = ServeProcess::start(
        d,
        &["--store", &url, "--redis-ca-cert", ca.to_str().unwrap()],
    );
    server.wait_ready();
    let r = decide(&server.grpc).await;
    if r.degraded != 0 {
        panic!("not decided by Redis over TLS: {r:?}\n{}", logs_of(server));
    }
    assert!(r.allowed);
    let r = decide(&server.grpc).await;
    assert_eq!(r.remaining, 28);
    let logs = logs_of(server);
    assert!(!logs.contains(PASSWORD), "{logs}");
}

/// A Sentinel-managed primary with a password, reached over TLS through a
/// Sentinel that also speaks TLS: `rediss-sentinel://:PASSWORD@…/mymaster`.
/// The password goes to the primary (the Sentinel is asked without it) and
/// never appears in what Tollgate prints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_over_tls_with_a_password() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    common::tls::certificates(d);
    let cacert = ["--tls", "--cacert", d.join("ca.pem").to_str().unwrap()].map(String::from);
    let cacert: Vec<&str> = cacert.iter().map(String::as_str).collect();
    let port = free_port(false);
    let mut args = vec!["--port", "0", "--tls-port"];
    let port_text = port.to_string();
    args.push(&port_text);
    args.extend(TLS);
    let _redis = start_redis(d, &args);
    wait_for(port, &cacert);

    let sentinel_port = free_port(false);
    let conf = d.join("sentinel.conf");
    std::fs::write(
        &conf,
        format!(
            "port 0\ntls-port {sentinel_port}\nbind 127.0.0.1\nprotected-mode no\n\
             tls-cert-file server.pem\ntls-key-file server.key\ntls-ca-cert-file ca.pem\n\
             tls-auth-clients no\ntls-replication yes\n\
             sentinel monitor mymaster 127.0.0.1 {port} 1\n\
             sentinel auth-pass mymaster {PASSWORD}\n"
        ),
    )
    .unwrap();
    let _sentinel = Redis {
        child: Command::new("redis-server")
            .current_dir(d)
            .arg(&conf)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    };
    for _ in 0..500 {
        let mut cli = vec!["-h", "127.0.0.1", "-p"];
        let sp = sentinel_port.to_string();
        cli.push(&sp);
        cli.extend(&cacert);
        cli.extend(["SENTINEL", "get-master-addr-by-name", "mymaster"]);
        let out = Command::new("redis-cli").args(&cli).output().unwrap();
        if String::from_utf8_lossy(&out.stdout).contains(&port_text) {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }

    let url = format!("rediss-sentinel://:{PASSWORD}@127.0.0.1:{sentinel_port}/mymaster");
    let ca = d.join("ca.pem");
    let server = ServeProcess::start(
        d,
        &["--store", &url, "--redis-ca-cert", ca.to_str().unwrap()],
    );
    server.wait_ready();
    let r = decide(&server.grpc).await;
    if r.degraded != 0 {
        panic!(
            "not decided by Redis through Sentinel: {r:?}\n{}",
            logs_of(server)
        );
    }
    assert!(r.allowed);
    assert_eq!(decide(&server.grpc).await.remaining, 28);
    let listening = server.listening.clone();
    assert!(
        listening.contains(&format!(
            "store=rediss-sentinel://:***@127.0.0.1:{sentinel_port}/mymaster "
        )),
        "{listening}"
    );
    let logs = logs_of(server);
    assert!(!logs.contains(PASSWORD), "{logs}");
}

/// An ACL user and a database other than 0 (`redis://USER:PASSWORD@…/5`):
/// the buckets live in that database, a wrong password for the user
/// leaves the service degraded, and a connection Redis closes under a
/// running Tollgate is replaced with the same user and database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acl_user_and_a_database() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port(false);
    let _redis = start_redis(dir.path(), &["--port", &port.to_string()]);
    wait_for(port, &[]);
    let admin = |args: &[&str]| {
        let mut all = vec!["-a", PASSWORD, "--no-auth-warning"];
        all.extend_from_slice(args);
        redis_cli(port, &all)
    };
    assert_eq!(
        admin(&[
            "ACL",
            "SETUSER",
            "limiter",
            "on",
            ">limiter-pw",
            "~*",
            "+@all"
        ]),
        "OK"
    );

    let url = format!("redis://limiter:limiter-pw@127.0.0.1:{port}/5");
    let server = ServeProcess::start(dir.path(), &["--store", &url]);
    server.wait_ready();
    let r = decide(&server.grpc).await;
    assert_eq!((r.allowed, r.degraded, r.remaining), (true, 0, 29));
    assert_eq!(
        admin(&["-n", "5", "DBSIZE"]),
        "1",
        "the bucket is in database 5"
    );
    assert_eq!(admin(&["-n", "0", "DBSIZE"]), "0");

    // Redis closes every connection of the user: the next decisions are
    // decided by Redis again, over a new connection, from the same bucket.
    let killed: u32 = admin(&["CLIENT", "KILL", "USER", "limiter"])
        .parse()
        .unwrap();
    assert!(killed >= 1, "Tollgate held a connection as limiter");
    let mut after = None;
    for _ in 0..100 {
        let r = decide(&server.grpc).await;
        if r.degraded == 0 {
            after = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = after.expect("decided by Redis again after its connection was closed");
    assert_eq!(
        (r.allowed, r.remaining),
        (true, 28),
        "the same bucket in database 5"
    );
    assert_eq!(admin(&["-n", "5", "DBSIZE"]), "1");
    assert_eq!(admin(&["-n", "0", "DBSIZE"]), "0");
    drop(server);

    let wrong = format!("redis://limiter:not-{PASSWORD}@127.0.0.1:{port}/5");
    let server = ServeProcess::start(dir.path(), &["--store", &wrong, "--store-timeout", "200ms"]);
    let r = decide(&server.grpc).await;
    assert_eq!(r.degraded, 1, "a refused AUTH leaves the store unavailable");
    let logs = logs_of(server);
    assert!(
        !logs.contains(PASSWORD),
        "the password leaked into the logs: {logs}"
    );
}
