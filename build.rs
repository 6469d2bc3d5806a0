//! Generates the gRPC server and client code from `proto/` with tonic and
//! prost, using a vendored `protoc` unless `PROTOC` names one, so a plain
//! `cargo build` works on a machine with no protobuf compiler installed.

use std::{env, error::Error, path::PathBuf};

fn main() -> Result<(), Box<dyn Error>> {
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    let config = || -> Result<tonic_prost_build::Config, Box<dyn Error>> {
        let mut config = tonic_prost_build::Config::new();
        if env::var_os("PROTOC").is_none() {
            config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
        }
        Ok(config)
    };
    // The services served, whose descriptors server reflection lists.
    tonic_prost_build::configure()
        .file_descriptor_set_path(out_dir.join("tollgate_descriptor.bin"))
        // Malformed requests are the caller's mistake: answer INVALID_ARGUMENT,
        // not the INTERNAL that the stock prost codec uses.
        .codec_path("crate::api::codec::StrictProstCodec")
        // An answer's header fields (two or three) as a sorted map: built and
        // encoded on every decision, where a hash map would hash each name.
        .btree_map(".tollgate.v1")
        .compile_with_config(
            config()?,
            &[
                "proto/tollgate/v1/tollgate.proto",
                "proto/envoy/service/ratelimit/v3/rls.proto",
                "proto/envoy/service/rate_limit_quota/v3/rlqs.proto",
            ],
            &["proto"],
        )?;
    // The xDS client's (the Envoy configuration from a management server):
    // not served, so left out of the reflection descriptors. The server
    // side is generated for the tests' management server.
    tonic_prost_build::configure()
        .codec_path("crate::api::codec::StrictProstCodec")
        .compile_with_config(
            config()?,
            &[
                "proto/envoy/service/discovery/v3/discovery.proto",
                "proto/ratelimit/config/ratelimit/v3/rls_conf.proto",
            ],
            &["proto"],
        )?;
    println!("cargo:rerun-if-changed=proto");
    // .cargo/config.toml passes `--cfg tokio_unstable` (see src/runtime.rs);
    // a RUSTFLAGS variable replaces that setting instead of adding to it.
    if env::var_os("CARGO_CFG_TOKIO_UNSTABLE").is_none() {
        println!(
            "cargo:warning=built without --cfg tokio_unstable: the runtime keeps its LIFO slot \
             (about a third more CPU per decision); add it to RUSTFLAGS"
        );
    }
    Ok(())
}
