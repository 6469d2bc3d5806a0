//! The admin port cannot be opened by accident, tried as a user runs the
//! binary: an empty token (flag, environment or config file) is a start-up
//! error, and so is a non-loopback admin address without a token unless the
//! network is declared trusted. With a token, changes need it.

use crate::common;

use std::io::{Read, Write};

use common::process::{ServeProcess, tollgate};

fn serve_fails(dir: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> String {
    let out = std::process::Command::new(common::process::BIN)
        .current_dir(dir)
        .args(["serve", "--grpc-addr", "127.0.0.1:0"])
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(!out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

const EMPTY: &str = "error: the admin token is empty; set a non-empty --admin-token \
                     (TOLLGATE_ADMIN_TOKEN, admin_token), or leave it unset to turn the \
                     changing endpoints off";

#[test]
fn an_empty_token_is_refused_from_every_source() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path();
    let loopback = ["--admin-addr", "127.0.0.1:0"];
    let err = serve_fails(path, &[&loopback[..], &["--admin-token", ""]].concat(), &[]);
    assert!(err.trim_end().ends_with(EMPTY), "{err}");
    let err = serve_fails(path, &loopback, &[("TOLLGATE_ADMIN_TOKEN", "")]);
    assert!(err.trim_end().ends_with(EMPTY), "{err}");
    std::fs::write(path.join("t.toml"), "admin_token = \"  \"\n").unwrap();
    let err = serve_fails(
        path,
        &[&loopback[..], &["--config", "t.toml"]].concat(),
        &[],
    );
    assert!(err.trim_end().ends_with(EMPTY), "{err}");
    // Nothing was served: the limits table was never created.
    assert!(!path.join("tollgate-limits.db").exists());
}

#[test]
fn a_reachable_admin_port_needs_a_token_or_a_trusted_network() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path();
    let err = serve_fails(path, &["--admin-addr", "0.0.0.0:0"], &[]);
    assert!(
        err.contains("which is reachable from other hosts, and no admin token is set"),
        "{err}"
    );
    let trusted = ServeProcess::start(
        path,
        &["--admin-addr", "0.0.0.0:0", "--admin-trust-network"],
    );
    trusted.wait_ready();
    drop(trusted);
    let server = ServeProcess::start_with_env(
        path,
        &["--admin-addr", "0.0.0.0:0"],
        &[("TOLLGATE_ADMIN_TOKEN", "s3cret")],
    );
    server.wait_ready();
    // DELETE without the token, and with a wrong one: refused, row kept.
    assert!(http(&server.admin, "DELETE", None).starts_with("HTTP/1.1 401"));
    assert!(http(&server.admin, "DELETE", Some("s3cre")).starts_with("HTTP/1.1 401"));
    assert!(http(&server.admin, "DELETE", Some("s3cret!")).starts_with("HTTP/1.1 401"));
    let listed = tollgate(path, &["limits", "list"]);
    assert!(String::from_utf8_lossy(&listed.stdout).contains("default-per-key"));
    assert!(http(&server.admin, "DELETE", Some("s3cret")).starts_with("HTTP/1.1 200"));
}

/// `DELETE /v1/limits/default-per-key`, with `Authorization: Bearer TOKEN`
/// when given; the status line and the rest.
fn http(admin: &str, method: &str, token: Option<&str>) -> String {
    let mut stream = std::net::TcpStream::connect(admin).unwrap();
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    write!(
        stream,
        "{method} /v1/limits/default-per-key HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

#[test]
fn an_ipv4_mapped_loopback_address_counts_as_loopback() {
    use tollgate::api::admin::AdminAccess;
    let open = AdminAccess::default();
    assert_eq!(
        open.validate("[::ffff:127.0.0.1]:8090".parse().unwrap()),
        Ok(())
    );
    assert_eq!(open.validate("[::1]:8090".parse().unwrap()), Ok(()));
    let err = open
        .validate("[::ffff:10.0.0.1]:8090".parse().unwrap())
        .unwrap_err();
    assert!(err.contains("reachable from other hosts"), "{err}");
}

#[test]
fn a_zero_message_size_is_refused_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let err = serve_fails(dir.path(), &["--grpc-max-message-bytes", "0"], &[]);
    assert!(
        err.contains("--grpc-max-message-bytes must be at least 64"),
        "{err}"
    );
}
