//! Test certificates made with the openssl command: a CA (`ca.pem`), a
//! server certificate for 127.0.0.1 and localhost (`server.pem`,
//! `server.key`) and a client certificate (`client.pem`, `client.key`).

use std::path::Path;
use std::process::Command;

/// A CA, a server certificate for 127.0.0.1 and a client certificate.
pub fn certificates(d: &Path) {
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl")
            .current_dir(d)
            .args(args)
            .output()
            .expect("openssl runs");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=test CA",
    ]);
    for (name, ext) in [
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ("client", "extendedKeyUsage=clientAuth"),
    ] {
        openssl(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
            "-subj",
            &format!("/CN={name}"),
        ]);
        std::fs::write(
            d.join(format!("{name}.ext")),
            format!("{ext}\nbasicConstraints=CA:FALSE\n"),
        )
        .unwrap();
        openssl(&[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &format!("{name}.pem"),
            "-days",
            "2",
            "-extfile",
            &format!("{name}.ext"),
        ]);
    }
}
