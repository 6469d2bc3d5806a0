//! The shape the code must keep: every API reaches the store only through
//! the engine, and no API wing imports another. Read from the source, so a
//! change that adds a second path fails here with the file named.

use std::path::{Path, PathBuf};

fn sources(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(sources(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).unwrap();
            out.push((path, text));
        }
    }
    out
}

fn src(part: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src").join(part)
}

fn root(part: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(part)
}

/// The lines of `manifest` between `header` and the next section.
fn section<'a>(manifest: &'a str, header: &str) -> &'a str {
    let start = manifest.find(header).expect(header) + header.len();
    let end = manifest[start..]
        .find("\n[")
        .map_or(manifest.len(), |e| start + e);
    &manifest[start..end]
}

/// The store is out of the wings' and the server's reach by the crate
/// graph, not by convention: this crate depends on tollgate-engine and not
/// on tollgate-core (a dev-dependency only, for the store-level tests), and
/// the engine crate keeps its path to the store crate-private and exports
/// only the store's vocabulary. So `use tollgate_core::store::...` or
/// `crate::store::...` anywhere in src/ does not compile.
#[test]
fn the_store_is_reachable_only_through_the_engine() {
    let manifest = std::fs::read_to_string(root("Cargo.toml")).unwrap();
    let deps = section(&manifest, "\n[dependencies]");
    assert!(deps.contains("tollgate-engine ="), "{deps}");
    assert!(
        !deps.contains("tollgate-core"),
        "the server crate must not depend on tollgate-core: {deps}"
    );
    let linux = section(
        &manifest,
        "[target.'cfg(target_os = \"linux\")'.dependencies]",
    );
    assert!(!linux.contains("tollgate-core"));
    let engine_lib = std::fs::read_to_string(root("crates/engine/src/lib.rs")).unwrap();
    assert!(engine_lib.contains("pub(crate) use tollgate_core::store;"));
    let public_uses: Vec<&str> = engine_lib
        .lines()
        .filter(|l| l.starts_with("pub use tollgate_core"))
        .collect();
    assert_eq!(
        public_uses,
        ["pub use tollgate_core::{algorithm, clock, telemetry};"],
        "the engine crate re-exports the store's vocabulary, not the store"
    );
    let engine = std::fs::read_to_string(root("crates/engine/src/engine/mod.rs")).unwrap();
    let vocabulary = &engine[engine.find("pub mod vocabulary").unwrap()..];
    let vocabulary = &vocabulary[..vocabulary.find("\n}").unwrap()];
    for door in [
        "Store,",
        "Layer",
        "MemoryStore",
        "RedisStore",
        "stack",
        "fallback",
        "Request",
    ] {
        assert!(!vocabulary.contains(door), "the vocabulary exports {door}");
    }
    // The engine's store is private to it.
    assert!(engine.contains("    store: Arc<dyn Layer>,"));
    assert!(!engine.contains("pub store"));
    assert!(!engine.contains("pub fn store("));
    for (path, text) in sources(&src("")) {
        assert!(
            !text.contains("tollgate_core"),
            "{} names tollgate-core",
            path.display()
        );
    }
}

/// No wing names another: not by path (`api::envoy`, `super::envoy`), and
/// not inside a braced import (`use super::{envoy::X}`), in the wing's file
/// and in its directory alike.
#[test]
fn no_wing_imports_a_sibling() {
    let wings = ["native", "envoy", "rlqs", "admin"];
    for wing in wings {
        let mut files = Vec::new();
        let dir = src("api").join(wing);
        if dir.is_dir() {
            files.extend(sources(&dir));
        }
        let file = src("api").join(format!("{wing}.rs"));
        if file.is_file() {
            files.push((file.clone(), std::fs::read_to_string(&file).unwrap()));
        }
        assert!(!files.is_empty(), "the {wing} wing has sources");
        for (path, text) in files {
            let flat: String = text.split_whitespace().collect();
            for other in wings.iter().filter(|w| **w != wing) {
                for import in [format!("api::{other}"), format!("super::{other}")] {
                    assert!(
                        !flat.contains(&import),
                        "{} imports the {other} wing ({import})",
                        path.display()
                    );
                }
                for brace in flat
                    .match_indices("api::{")
                    .chain(flat.match_indices("super::{"))
                {
                    let inside = &flat[brace.0..];
                    let inside = &inside[..inside.find('}').unwrap_or(inside.len())];
                    let named = inside
                        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                        .any(|word| word == *other);
                    assert!(
                        !named,
                        "{} imports the {other} wing in {inside}}}",
                        path.display()
                    );
                }
            }
        }
    }
}
