//! Validation and rule selection.

use super::*;

pub(crate) fn row(
    name: &str,
    tenant: &str,
    resource: &str,
    scope: &str,
    burst: i64,
    rate: &str,
) -> StoredRow {
    let (count, unit) = rate.split_once('/').unwrap();
    StoredRow {
        name: name.into(),
        tenant: tenant.into(),
        resource: resource.into(),
        scope: scope.into(),
        burst,
        rate: count.parse().unwrap(),
        rate_unit: unit.into(),
        mode: "enforce".into(),
        on_store_unavailable: "allow".into(),
        debt: 0,
        kind: "rate".into(),
        updated_at: String::new(),
    }
}

fn names<'a>(set: &'a RuleSet, tenant: &str, resource: &str) -> Vec<&'a str> {
    set.applicable(tenant, resource)
        .map(|r| r.name.as_str())
        .collect()
}

#[test]
fn most_specific_row_wins_per_slot_and_resource_rules_add_up() {
    let set = RuleSet::from_rules_for_test(&[
        row("default-key", "", "", "key", 30, "600/minute"),
        row("default-ceiling", "", "", "tenant", 1000, "10000/minute"),
        row("default-exports", "", "exports", "key", 5, "10/hour"),
        row("acme-key", "acme", "", "key", 300, "6000/minute"),
        row(
            "acme-exports-ceiling",
            "acme",
            "exports",
            "tenant",
            50,
            "100/hour",
        ),
    ]);
    assert_eq!(names(&set, "", ""), ["default-key", "default-ceiling"]);
    assert_eq!(
        names(&set, "unknown", "search"),
        ["default-key", "default-ceiling"]
    );
    assert_eq!(
        names(&set, "unknown", "exports"),
        ["default-key", "default-exports", "default-ceiling"]
    );
    assert_eq!(names(&set, "acme", ""), ["acme-key", "default-ceiling"]);
    assert_eq!(
        names(&set, "acme", "exports"),
        [
            "acme-key",
            "default-exports",
            "default-ceiling",
            "acme-exports-ceiling"
        ]
    );
}

#[test]
fn no_default_rows_means_no_rules() {
    let set = RuleSet::from_rules_for_test(&[row("acme-key", "acme", "", "key", 3, "1/second")]);
    assert!(names(&set, "other", "").is_empty());
    assert_eq!(names(&set, "acme", "x"), ["acme-key"]);
}

#[test]
fn invalid_rows_are_named_with_what_to_fix() {
    let cases = [
        (row("", "", "", "key", 1, "1/second"), "name is empty"),
        (
            row("r", "ac me", "", "key", 1, "1/second"),
            "tenant \"ac me\" contains ' '",
        ),
        (
            row("r", "", "", "global", 1, "1/second"),
            "scope is \"global\"; it must be one of key, tenant",
        ),
        (
            row("r", "", "", "key", 0, "1/second"),
            "burst must be at least 1",
        ),
        (
            row("r", "", "", "key", -3, "1/second"),
            "burst is -3; it must be at least 1",
        ),
        (
            row("r", "", "", "key", 1, "0/second"),
            "rate must be at least 1 per unit",
        ),
        (
            row("r", "", "", "key", 1, "1/fortnight"),
            "rate_unit is \"fortnight\"",
        ),
    ];
    for (row, expected) in cases {
        let err = row.validate().unwrap_err().to_string();
        assert!(err.starts_with(&format!("row {:?}", row.name)), "{err}");
        assert!(
            err.contains(expected),
            "{err:?} should contain {expected:?}"
        );
    }
    let mut shadow = row("r", "", "", "key", 1, "1/second");
    shadow.mode = "dry".into();
    assert!(
        shadow
            .validate()
            .unwrap_err()
            .to_string()
            .contains("mode is \"dry\"; it must be one of enforce, shadow")
    );
}

#[test]
fn duplicates_reject_the_whole_set() {
    let err = RuleSet::from_rows(&[
        row("a", "", "", "key", 1, "1/second"),
        row("b", "", "", "key", 2, "1/second"),
    ])
    .unwrap_err();
    assert_eq!(
        err.row,
        "row \"b\" (tenant \"\", resource \"\", scope \"key\")"
    );
    assert!(err.reason.contains("rule \"a\" already covers"));
    let err = RuleSet::from_rows(&[
        row("a", "", "", "key", 1, "1/second"),
        row("a", "x", "", "key", 2, "1/second"),
    ])
    .unwrap_err();
    assert!(err.reason.contains("name \"a\" is also used"), "{err}");
}

impl RuleSet {
    fn from_rules_for_test(rows: &[StoredRow]) -> Self {
        Self::from_rows(rows).unwrap()
    }
}
