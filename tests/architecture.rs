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

#[test]
fn api_wings_reach_the_store_only_through_the_engine() {
    // What only the engine (and the store's own layers) may touch.
    let store_doors = [
        ".apply(",
        "apply_now",
        "MemoryStore",
        "RedisStore",
        "store::Request",
        "Fallback",
        "DenyCache",
    ];
    let api = sources(&src("api"));
    assert!(api.len() >= 8, "the wings are under src/api");
    for (path, text) in &api {
        for door in store_doors {
            assert!(
                !text.contains(door),
                "{} uses {door:?}: an API decides only through engine::Engine",
                path.display()
            );
        }
    }
    // Outside the store, the engine is the only caller of a store.
    for (path, text) in sources(&src("")) {
        let inside = ["store", "engine"].iter().any(|m| path.starts_with(src(m)));
        if !inside && path != src("server.rs") {
            assert!(
                !text.contains(".apply(") && !text.contains("apply_now"),
                "{} calls a store directly",
                path.display()
            );
        }
    }
    // And the engine's store is private to it.
    let engine = std::fs::read_to_string(src("engine/mod.rs")).unwrap();
    assert!(engine.contains("    store: Arc<dyn Layer>,"));
    assert!(!engine.contains("pub store"));
    assert!(!engine.contains("pub fn store("));
}

#[test]
fn no_wing_imports_a_sibling() {
    let wings = ["native", "envoy", "admin"];
    for wing in wings {
        let dir = src("api").join(wing);
        let files = if dir.is_dir() {
            sources(&dir)
        } else {
            let file = src("api").join(format!("{wing}.rs"));
            vec![(file.clone(), std::fs::read_to_string(&file).unwrap())]
        };
        for (path, text) in files {
            for other in wings.iter().filter(|w| **w != wing) {
                for import in [format!("api::{other}"), format!("super::{other}")] {
                    assert!(
                        !text.contains(&import),
                        "{} imports the {other} wing ({import})",
                        path.display()
                    );
                }
            }
        }
    }
}
