//! Runs `tests/python/client_test.py` (grpcio, stubs generated from
//! `proto/` at test time) against the real binary. Needs `python3` with
//! `grpcio` and `grpcio-tools`, which `scripts/test` installs.

use crate::common;

use std::process::Command;

use common::process::ServeProcess;

#[test]
fn a_python_grpcio_client_gets_decisions() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServeProcess::start(dir.path(), &[]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/client_test.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(&server.grpc)
        .output()
        .expect("python3 runs (scripts/test installs it and grpcio)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "python client failed\n{stdout}\n{stderr}"
    );
    assert_eq!(stdout, "python client: all checks passed\n");
}
