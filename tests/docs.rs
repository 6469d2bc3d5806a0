//! The documents say what the code does: every metric the code declares is
//! in the operations page's table, the configuration page's option table is
//! the one the declarations render (and `serve --help` lists the same
//! flags), and every link and every `file.rs::test_name` a document cites
//! exists.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use clap::CommandFactory;

use crate::common::process::BIN;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// README.md, BENCHMARKS.md, CHANGELOG.md and every page under docs/.
fn documents() -> Vec<PathBuf> {
    let mut docs: Vec<PathBuf> = ["README.md", "BENCHMARKS.md", "CHANGELOG.md"]
        .iter()
        .map(|d| root().join(d))
        .collect();
    for entry in std::fs::read_dir(root().join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            docs.push(path);
        }
    }
    docs.sort();
    docs
}

#[test]
fn the_operations_page_lists_every_metric() {
    let code = read(&root().join("crates/core/src/telemetry/metrics.rs"));
    let page = read(&root().join("docs/operations.md"));
    let declared: Vec<&str> = code
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub const "))
        .filter_map(|l| l.split_once("= \"").map(|(_, v)| v.trim_end_matches("\";")))
        .filter(|v| v.starts_with("tollgate_"))
        .collect();
    assert!(declared.len() >= 40, "{declared:?}");
    let missing: Vec<&&str> = declared
        .iter()
        .filter(|m| !page.contains(&format!("`{m}`")) && !page.contains(&format!("`{m}{{")))
        .collect();
    assert!(
        missing.is_empty(),
        "metrics missing from docs/operations.md's table: {missing:?}"
    );
}

const TABLE_BEGIN: &str = "<!-- serve-options: generated;";
const TABLE_END: &str = "<!-- end serve-options -->";

/// The option table in docs/configuration.md is what `serve`'s declarations
/// render, and `tollgate serve --help` lists the same flags. With
/// `UPDATE_DOCS=1` the test writes the table instead.
#[test]
fn the_configuration_page_lists_every_serve_option_as_declared() {
    let path = root().join("docs/configuration.md");
    let page = read(&path);
    let command = tollgate::cli::Cli::command();
    let serve = command.find_subcommand("serve").unwrap();
    let expected = tollgate::cli::options_table(serve);
    let begin = page.find(TABLE_BEGIN).expect("the table's opening marker");
    let begin = begin + page[begin..].find('\n').unwrap() + 1;
    let end = page.find(TABLE_END).expect("the table's closing marker");
    if std::env::var_os("UPDATE_DOCS").is_some() {
        let updated = format!("{}{expected}{}", &page[..begin], &page[end..]);
        std::fs::write(&path, updated).unwrap();
        return;
    }
    assert!(
        page[begin..end] == expected,
        "docs/configuration.md's option table differs from the declarations; \
         rerun this test with UPDATE_DOCS=1 to rewrite it. Expected:\n{expected}"
    );

    let flags = |text: &str| -> BTreeSet<String> {
        text.split(|c: char| c.is_whitespace() || c == '`' || c == ',' || c == '[')
            .filter(|w| w.starts_with("--"))
            .map(|w| {
                w.trim_end_matches(|c: char| !c.is_ascii_alphanumeric())
                    .to_owned()
            })
            .filter(|w| w.len() > 2)
            .collect()
    };
    let help = std::process::Command::new(BIN)
        .args(["serve", "--help"])
        .env_clear()
        .output()
        .unwrap();
    assert!(help.status.success());
    let mut in_help = flags(&String::from_utf8(help.stdout).unwrap());
    in_help.remove("--help");
    assert_eq!(in_help, flags(&expected), "serve --help against the table");
    let declared = serve
        .get_arguments()
        .filter(|a| a.get_id() != "help")
        .count();
    assert_eq!(in_help.len(), declared, "every declared option has a flag");
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces
/// turned into hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    let mut fenced = false;
    let mut out = BTreeSet::new();
    for line in text.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            out.insert(slug(line.trim_start_matches('#')));
        }
    }
    out
}

/// Relative links (`[text](path#anchor)`) and cited paths (`` `tests/x.rs` ``,
/// `` `tests/x.rs::a_test` ``) in every document.
#[test]
fn every_link_and_cited_test_in_the_documents_exists() {
    let mut broken = Vec::new();
    for doc in documents() {
        let text = read(&doc);
        let dir = doc.parent().unwrap();
        let name = doc.strip_prefix(root()).unwrap().display().to_string();
        // Markdown links.
        let mut rest = text.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let Some(close) = rest.find(')') else { break };
            let target = &rest[..close];
            if target.contains("://") || target.starts_with("mailto:") || target.contains(' ') {
                continue;
            }
            let (file, anchor) = target.split_once('#').unwrap_or((target, ""));
            let file_path = if file.is_empty() {
                doc.clone()
            } else {
                dir.join(file)
            };
            if !file_path.exists() {
                broken.push(format!("{name}: link to missing {target}"));
                continue;
            }
            if !anchor.is_empty()
                && file_path.extension().is_some_and(|e| e == "md")
                && !anchors(&read(&file_path)).contains(anchor)
            {
                broken.push(format!("{name}: link to missing anchor {target}"));
            }
        }
        // Cited paths and tests, in backticks.
        for cited in text.split('`').skip(1).step_by(2) {
            let cited = cited.trim();
            let top = [
                "tests/",
                "src/",
                "crates/",
                "scripts/",
                "deploy/",
                "lua/",
                "proto/",
                "examples/",
                "benches/",
                "bench/",
                "docs/",
            ];
            if !top.iter().any(|t| cited.starts_with(t))
                || cited.contains(' ')
                || cited.contains('*')
                || cited.contains('…')
            {
                continue;
            }
            let (path, item) = cited.split_once("::").unwrap_or((cited, ""));
            let file = root().join(path);
            if !file.exists() {
                broken.push(format!("{name}: cites missing {path}"));
                continue;
            }
            if !item.is_empty() && file.is_file() {
                let source = read(&file);
                let last = item.rsplit("::").next().unwrap();
                if !source.contains(&format!("fn {last}("))
                    && !source.contains(&format!("fn {last}<"))
                {
                    broken.push(format!(
                        "{name}: cites {cited}, which {path} does not define"
                    ));
                }
            }
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}
