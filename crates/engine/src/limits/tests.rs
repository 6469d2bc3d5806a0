//! Validation and rule selection.

use super::rules::Tier;
use super::table::TenantRow;
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
        id: 0,
        name: name.into(),
        tenant: tenant.into(),
        plan: String::new(),
        resource: resource.into(),
        scope: scope.into(),
        burst,
        rate: count.parse().unwrap(),
        rate_unit: unit.into(),
        mode: "enforce".into(),
        on_store_unavailable: "allow".into(),
        debt: 0,
        kind: "rate".into(),
        alerts: String::new(),
        updated_at: String::new(),
    }
}

fn names<'a>(set: &'a RuleSet, tenant: &str, resource: &str) -> Vec<&'a str> {
    set.applicable(tenant, resource).map(|r| &*r.name).collect()
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
fn a_bad_row_is_rejected_alone_and_duplicates_name_the_later_row() {
    let (set, errors) = RuleSet::from_rows(&[
        row("a", "", "", "key", 1, "1/second"),
        row("b", "", "", "key", 2, "1/second"),
        row("bad", "acme", "", "key", 0, "1/second"),
        row("c", "acme", "", "tenant", 5, "1/second"),
    ]);
    assert_eq!(names(&set, "acme", ""), ["a", "c"]);
    assert_eq!(set.len(), 2);
    let errors: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(
        errors.iter().any(|e| e
            == "row \"b\" (tenant \"\", resource \"\", scope \"key\"): another row already covers \
                the same owner, resource, scope, mode and kind"),
        "{errors:?}"
    );
    assert!(
        errors
            .iter()
            .any(|e| e.starts_with("row \"bad\"") && e.ends_with("burst must be at least 1")),
        "{errors:?}"
    );
    let (_, errors) = RuleSet::from_rows(&[
        row("a", "", "", "key", 1, "1/second"),
        row("a", "x", "", "key", 2, "1/second"),
    ]);
    assert!(
        errors[0]
            .reason
            .contains("name \"a\" is used by another row")
    );
}

fn plan_row(name: &str, plan: &str, scope: &str, burst: i64) -> StoredRow {
    StoredRow {
        plan: plan.into(),
        ..row(name, "", "", scope, burst, "1/second")
    }
}

#[test]
fn explain_lists_each_slots_winner_and_the_rows_it_won_over() {
    let mut shadow = row("acme-exports-shadow", "acme", "exports", "key", 1, "1/hour");
    shadow.mode = "shadow".into();
    let mut cap = row("pro-slots", "", "", "tenant", 3, "1/second");
    cap.plan = "pro".into();
    cap.kind = "concurrency".into();
    let rows = [
        row("default-key", "", "", "key", 30, "600/minute"),
        row("default-exports", "", "exports", "key", 2, "2/hour"),
        plan_row("pro-key", "pro", "key", 300),
        row("acme-key", "acme", "", "key", 7, "1/second"),
        row("other-resource", "acme", "imports", "key", 1, "1/hour"),
        shadow,
        cap,
    ];
    let (set, errors) = RuleSet::from_parts(&rows, &["pro"], &[("acme", "pro")]);
    assert!(errors.is_empty(), "{errors:?}");
    // (the rule in force, its owner, the rows it won over)
    type Slot<'a> = (&'a str, Tier, Vec<(&'a str, Tier)>);
    let explained: Vec<Slot> = set
        .explain("acme", "exports")
        .into_iter()
        .map(|s| {
            (
                &*s.rule.name,
                s.owner,
                s.over.iter().map(|(t, r)| (&*r.name, *t)).collect(),
            )
        })
        .collect();
    assert_eq!(
        explained,
        [
            (
                "acme-key",
                Tier::Tenant,
                vec![("pro-key", Tier::Plan), ("default-key", Tier::Default)]
            ),
            ("default-exports", Tier::Default, vec![]),
            ("acme-exports-shadow", Tier::Tenant, vec![]),
            ("pro-slots", Tier::Plan, vec![]),
        ]
    );
    // The rules a decision meets are the explained ones but the cap, in
    // the same order.
    assert_eq!(
        names(&set, "acme", "exports"),
        ["acme-key", "default-exports", "acme-exports-shadow"]
    );
    // Without the plan, the default wins the key slot.
    let (set, _) = RuleSet::from_parts(&rows, &["pro"], &[]);
    let first = &set.explain("acme", "")[0];
    assert_eq!((&*first.rule.name, first.owner), ("acme-key", Tier::Tenant));
    assert_eq!(first.over.len(), 1);
}

#[test]
fn a_tenants_row_beats_its_plans_which_beats_the_defaults() {
    let rows = [
        row("default-key", "", "", "key", 30, "600/minute"),
        row("default-ceiling", "", "", "tenant", 1000, "10000/minute"),
        plan_row("pro-key", "pro", "key", 300),
        plan_row("pro-ceiling", "pro", "tenant", 5000),
        row("acme-key", "acme", "", "key", 7, "1/second"),
    ];
    let (set, errors) = RuleSet::from_parts(
        &rows,
        &["pro", "free"],
        &[
            ("acme", "pro"),
            ("globex", "pro"),
            ("initech", "free"),
            ("hooli", "gone"),
        ],
    );
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(names(&set, "acme", ""), ["acme-key", "pro-ceiling"]);
    assert_eq!(names(&set, "globex", ""), ["pro-key", "pro-ceiling"]);
    // An empty plan and a plan that does not exist: the defaults.
    assert_eq!(
        names(&set, "initech", ""),
        ["default-key", "default-ceiling"]
    );
    assert_eq!(names(&set, "hooli", ""), ["default-key", "default-ceiling"]);
    assert_eq!(set.tenants(), 4);
    // A plan's rows for a plan that does not exist are rejected.
    let (set, errors) = RuleSet::from_parts(&rows, &[], &[("acme", "pro")]);
    assert_eq!(
        names(&set, "globex", ""),
        ["default-key", "default-ceiling"]
    );
    assert_eq!(errors.len(), 2);
    assert!(
        errors[0]
            .reason
            .starts_with("plan \"pro\" does not exist; create it with `tollgate plans create pro`"),
        "{errors:?}"
    );
}

#[test]
fn a_row_naming_a_tenant_and_a_plan_is_rejected() {
    let both = StoredRow {
        plan: "pro".into(),
        ..row("x", "acme", "", "key", 1, "1/second")
    };
    let err = both.validate().unwrap_err().to_string();
    assert!(
        err.contains("a row belongs to a tenant or to a plan, not both"),
        "{err}"
    );
    let huge = row("x", &"t".repeat(10_000), "", "key", 1, "1/second");
    let err = huge.validate().unwrap_err().to_string();
    assert!(
        err.len() < 600,
        "the message names the row by its start: {err}"
    );
    assert!(
        err.contains("tenant is 10000 bytes; at most 128 are allowed"),
        "{err}"
    );
}

/// Applies one batch: `owners` changed, and these are their rows now.
fn apply(
    loader: &mut rules::Loader,
    base: &RuleSet,
    owners: &[Owner],
    plans: &[&str],
    rows: &[StoredRow],
    assignments: &[(&str, &str)],
) -> (RuleSet, Vec<RowError>) {
    let mut update = loader.begin(base, false, owners.to_vec());
    for p in plans {
        update.plan(p);
    }
    let mut rows = rows.to_vec();
    rows.sort_by_cached_key(StoredRow::owner);
    for r in rows {
        update.row(r);
    }
    for (t, p) in assignments {
        update.tenant(TenantRow::on_plan(t, p));
    }
    let (set, applied) = update.finish();
    (set, applied.newly_rejected)
}

fn with_id(id: i64, r: StoredRow) -> StoredRow {
    StoredRow { id, ..r }
}

#[test]
fn a_batch_replaces_only_the_owners_it_names() {
    let mut loader = rules::Loader::new(usize::MAX);
    let base = RuleSet::default();
    let mut update = loader.begin(&base, true, Vec::new());
    update.plan("pro");
    for (i, r) in [
        row("default-key", "", "", "key", 30, "600/minute"),
        row("acme-key", "acme", "", "key", 7, "1/second"),
        row("globex-key", "globex", "", "key", 8, "1/second"),
        plan_row("pro-key", "pro", "key", 300),
    ]
    .into_iter()
    .enumerate()
    {
        update.row(with_id(i as i64 + 1, r));
    }
    update.tenant(TenantRow::on_plan("initech", "pro"));
    let (v1, _) = update.finish();
    assert_eq!((v1.len(), v1.tenants()), (4, 3));
    assert_eq!(names(&v1, "initech", ""), ["pro-key"]);

    // acme's row deleted, globex's row changed, initech moved off its plan,
    // a new tenant.
    let (v2, rejected) = apply(
        &mut loader,
        &v1,
        &[
            Owner::Tenant("acme".into()),
            Owner::Tenant("globex".into()),
            Owner::Tenant("initech".into()),
            Owner::Tenant("hooli".into()),
        ],
        &[],
        &[
            with_id(3, row("globex-key", "globex", "", "key", 80, "1/second")),
            with_id(5, row("hooli-key", "hooli", "", "key", 9, "1/second")),
        ],
        &[],
    );
    assert!(rejected.is_empty());
    assert_eq!(names(&v2, "acme", ""), ["default-key"]);
    assert_eq!(
        v2.applicable("globex", "").next().unwrap().limit.burst(),
        80
    );
    assert_eq!(names(&v2, "initech", ""), ["default-key"]);
    assert_eq!(names(&v2, "hooli", ""), ["hooli-key"]);
    assert_eq!((v2.len(), v2.tenants()), (4, 2));
    // The snapshot before is untouched: a decision holding it sees no part
    // of the batch.
    assert_eq!(names(&v1, "acme", ""), ["acme-key"]);
    assert_eq!(v1.applicable("globex", "").next().unwrap().limit.burst(), 8);

    // A bad edit of globex's row keeps its last valid version; the same
    // batch's good edit of hooli applies.
    let (v3, rejected) = apply(
        &mut loader,
        &v2,
        &[
            Owner::Tenant("globex".into()),
            Owner::Tenant("hooli".into()),
        ],
        &[],
        &[
            with_id(3, row("globex-key", "globex", "", "key", 0, "1/second")),
            with_id(5, row("hooli-key", "hooli", "", "key", 90, "1/second")),
        ],
        &[],
    );
    assert_eq!(rejected.len(), 1);
    assert!(rejected[0].row.starts_with("row \"globex-key\""));
    assert_eq!(
        v3.applicable("globex", "").next().unwrap().limit.burst(),
        80
    );
    assert_eq!(v3.applicable("hooli", "").next().unwrap().limit.burst(), 90);
    assert_eq!(loader.rejected(10).1, 1);
    // Rejected again by a later batch: logged once only.
    let (v4, rejected) = apply(
        &mut loader,
        &v3,
        &[Owner::Tenant("globex".into())],
        &[],
        &[with_id(
            3,
            row("globex-key", "globex", "", "key", 0, "1/second"),
        )],
        &[],
    );
    assert!(rejected.is_empty());
    // Fixed: in force, and no longer listed.
    let (v5, _) = apply(
        &mut loader,
        &v4,
        &[Owner::Tenant("globex".into())],
        &[],
        &[with_id(
            3,
            row("globex-key", "globex", "", "key", 3, "1/second"),
        )],
        &[],
    );
    assert_eq!(v5.applicable("globex", "").next().unwrap().limit.burst(), 3);
    assert_eq!(loader.rejected(10).1, 0);

    // The plan's rule changes for every tenant on it in one edit; the plan
    // deleted, its tenants fall back to the defaults and are reported.
    let (v6, _) = apply(
        &mut loader,
        &v5,
        &[Owner::Plan("pro".into()), Owner::Tenant("acme".into())],
        &["pro"],
        &[with_id(4, plan_row("pro-key", "pro", "key", 301))],
        &[("acme", "pro")],
    );
    assert_eq!(v6.applicable("acme", "").next().unwrap().limit.burst(), 301);
    let (v7, _) = apply(
        &mut loader,
        &v6,
        &[Owner::Plan("pro".into())],
        &[],
        &[],
        &[],
    );
    assert_eq!(names(&v7, "acme", ""), ["default-key"]);
    assert_eq!(loader.missing_plans(&v7), [("pro".to_owned(), 1)]);
    assert_eq!(v7.len(), 3);
}

#[test]
fn rows_beyond_the_bound_are_rejected_and_the_rest_stay() {
    let mut loader = rules::Loader::new(2);
    let base = RuleSet::default();
    let mut update = loader.begin(&base, true, Vec::new());
    update.row(with_id(1, row("d", "", "", "key", 30, "600/minute")));
    update.row(with_id(2, row("a", "a", "", "key", 1, "1/second")));
    let (v1, _) = update.finish();
    assert_eq!(v1.len(), 2);
    let (v2, rejected) = apply(
        &mut loader,
        &v1,
        &[Owner::Tenant("b".into())],
        &[],
        &[with_id(3, row("b", "b", "", "key", 1, "1/second"))],
        &[],
    );
    assert_eq!(v2.len(), 2);
    assert_eq!(names(&v2, "b", ""), ["d"]);
    assert!(
        rejected[0]
            .reason
            .contains("(--max-limit-rows 2); the row is not in force"),
        "{rejected:?}"
    );
}

#[test]
fn plan_assignments_count_against_the_bound() {
    // Room for three: the default row, the plan's row and one tenant on it.
    let mut loader = rules::Loader::new(3);
    let base = RuleSet::default();
    let mut update = loader.begin(&base, true, Vec::new());
    update.plan("pro");
    update.row(with_id(1, row("d", "", "", "key", 30, "600/minute")));
    update.row(with_id(2, plan_row("pro-key", "pro", "key", 300)));
    update.tenant(TenantRow::on_plan("a", "pro"));
    update.tenant(TenantRow::on_plan("b", "pro"));
    let (v1, applied) = update.finish();
    let rejected = applied.newly_rejected;
    // One of the two is on the plan (shard order decides which), the other
    // is refused and named.
    let (on, off) = if names(&v1, "a", "") == ["pro-key"] {
        ("a", "b")
    } else {
        ("b", "a")
    };
    assert_eq!(names(&v1, on, ""), ["pro-key"]);
    assert_eq!(names(&v1, off, ""), ["d"]);
    assert_eq!(rejected.len(), 1, "{rejected:?}");
    assert_eq!(
        rejected[0].row,
        format!(r#"tenants row (tenant "{off}", plan "pro")"#)
    );
    assert!(
        rejected[0]
            .reason
            .contains("(--max-limit-rows 3); the assignment is not in force"),
        "{rejected:?}"
    );

    // While running: a new tenant on the plan is refused, a tenant moving
    // off the plan makes room for the next.
    let (v2, rejected) = apply(
        &mut loader,
        &v1,
        &[Owner::Tenant("c".into())],
        &[],
        &[],
        &[("c", "pro")],
    );
    assert_eq!(names(&v2, "c", ""), ["d"]);
    assert_eq!(rejected[0].row, r#"tenants row (tenant "c", plan "pro")"#);
    let (v3, rejected) = apply(
        &mut loader,
        &v2,
        &[Owner::Tenant(on.into()), Owner::Tenant("c".into())],
        &[],
        &[],
        &[("c", "pro")],
    );
    assert!(rejected.is_empty(), "{rejected:?}");
    assert_eq!(names(&v3, on, ""), ["d"]);
    assert_eq!(names(&v3, "c", ""), ["pro-key"]);
    // c's assignment is in force and no longer listed; the other's still is.
    assert_eq!(loader.rejected(10).1, 1);
}

#[test]
fn labels_are_checked_at_their_exact_length() {
    assert!(check_label("tenant", &"t".repeat(MAX_LABEL_LEN)).is_ok());
    assert_eq!(
        check_label("tenant", &"t".repeat(MAX_LABEL_LEN + 1)).unwrap_err(),
        "tenant is 129 bytes; at most 128 are allowed"
    );
}

#[test]
fn kinds_parse_and_a_bad_one_names_the_choices() {
    assert_eq!("rate".parse::<Kind>(), Ok(Kind::Rate));
    assert_eq!("concurrency".parse::<Kind>(), Ok(Kind::Concurrency));
    assert_eq!("quota".parse::<Kind>(), Ok(Kind::Quota));
    let err = "leases".parse::<Kind>().unwrap_err();
    assert!(err.starts_with("kind is \"leases\""), "{err}");
}

fn requested(
    tenant: &str,
    resource: &str,
    scope: &str,
    rate: &str,
    mode: &str,
    kind: &str,
) -> LimitRow {
    LimitRow::from_request(
        tenant.into(),
        resource.into(),
        scope,
        5,
        rate,
        mode,
        "allow",
        0,
        kind,
        None,
    )
    .unwrap()
}

#[test]
fn a_requested_row_is_named_by_its_owner_resource_scope_kind_and_mode() {
    let cases = [
        (
            requested("", "", "key", "1/second", "enforce", "rate"),
            "default-any-key",
        ),
        (
            requested("acme", "exports", "tenant", "1/second", "shadow", "rate"),
            "acme-exports-tenant-shadow",
        ),
        // A concurrency row needs no rate.
        (
            requested("acme", "", "key", "", "enforce", "concurrency"),
            "acme-any-key-concurrency",
        ),
        (
            requested("acme", "", "tenant", "", "shadow", "concurrency"),
            "acme-any-tenant-concurrency-shadow",
        ),
    ];
    for (row, name) in cases {
        assert_eq!(row.name, name);
    }
    let err = LimitRow::from_request(
        "acme".into(),
        String::new(),
        "key",
        5,
        "",
        "enforce",
        "allow",
        0,
        "rate",
        None,
    )
    .unwrap_err();
    assert!(!err.is_empty(), "a rate row needs its rate");
    // For a plan: renamed after the plan unless a name was given, and an
    // empty plan changes nothing.
    let row = requested("", "", "key", "1/second", "enforce", "rate");
    assert_eq!(
        row.clone().for_plan("pro".into(), false).name,
        "plan-pro-any-key"
    );
    assert_eq!(
        row.clone().for_plan("pro".into(), true).name,
        "default-any-key"
    );
    let unchanged = row.clone().for_plan(String::new(), false);
    assert_eq!(
        (unchanged.name.as_str(), unchanged.plan.as_str()),
        ("default-any-key", "")
    );
    assert_eq!(row.for_plan("pro".into(), true).plan, "pro");
}

#[test]
fn a_concurrency_row_takes_no_debt_and_at_most_its_cap() {
    let cap = |burst: i64, debt: i64| StoredRow {
        kind: "concurrency".into(),
        debt,
        ..row("c", "acme", "", "key", burst, "1/second")
    };
    let most = crate::algorithm::MAX_CONCURRENCY as i64;
    assert!(cap(most, 0).validate().is_ok());
    let err = cap(most + 1, 0).validate().unwrap_err().to_string();
    assert!(
        err.ends_with(&format!(
            "burst is {}; a concurrency rule allows at most {most} leases at once",
            most + 1
        )),
        "{err}"
    );
    let err = cap(3, 1).validate().unwrap_err().to_string();
    assert!(
        err.contains("debt must be 0 for a concurrency rule"),
        "{err}"
    );
}

#[test]
fn a_rules_buckets_are_tagged_by_scope_kind_and_mode() {
    use crate::store::BucketKind;
    let shape = |scope: &str, mode: &str, kind: &str| {
        StoredRow {
            mode: mode.into(),
            kind: kind.into(),
            ..row("r", "", "", scope, 3, "1/second")
        }
        .shape()
        .unwrap()
        .bucket_kind()
    };
    let kind = |per_key, concurrency, shadow| BucketKind::Rule {
        per_key,
        concurrency,
        shadow,
    };
    assert_eq!(shape("key", "enforce", "rate"), kind(true, false, false));
    assert_eq!(
        shape("tenant", "shadow", "concurrency"),
        kind(false, true, true)
    );
    assert_eq!(
        shape("tenant", "enforce", "rate"),
        kind(false, false, false)
    );
}

#[test]
fn a_rule_shows_its_limit() {
    let shown = |r: StoredRow| r.validate().unwrap().to_string();
    assert_eq!(
        shown(row("r", "", "", "key", 5, "10/second")),
        "r (burst 5, 10/second)"
    );
    assert_eq!(
        shown(StoredRow {
            debt: 3,
            ..row("r", "", "", "key", 5, "10/second")
        }),
        "r (burst 5, 10/second, debt 3)"
    );
    assert_eq!(
        shown(StoredRow {
            kind: "concurrency".into(),
            ..row("c", "", "", "key", 4, "1/second")
        }),
        "c (at most 4 in flight)"
    );
}

#[test]
fn owners_are_described_for_messages() {
    assert_eq!(Owner::Tenant("".into()).describe(), "the default rows");
    assert_eq!(Owner::Tenant("acme".into()).describe(), "tenant \"acme\"");
    assert_eq!(Owner::Plan("pro".into()).describe(), "plan \"pro\"");
}

#[test]
fn every_slot_is_its_own_scope_resource_and_mode() {
    let shadow = |r: StoredRow| StoredRow {
        mode: "shadow".into(),
        ..r
    };
    let set = RuleSet::from_rules_for_test(&[
        row("key", "", "", "key", 1, "1/second"),
        shadow(row("key-shadow", "", "", "key", 1, "1/second")),
        row("key-exports", "", "exports", "key", 1, "1/second"),
        shadow(row(
            "key-exports-shadow",
            "",
            "exports",
            "key",
            1,
            "1/second",
        )),
        row("tenant", "", "", "tenant", 1, "1/second"),
        shadow(row("tenant-shadow", "", "", "tenant", 1, "1/second")),
        row("tenant-exports", "", "exports", "tenant", 1, "1/second"),
        shadow(row(
            "tenant-exports-shadow",
            "",
            "exports",
            "tenant",
            1,
            "1/second",
        )),
    ]);
    assert_eq!(
        names(&set, "acme", "exports"),
        [
            "key",
            "key-shadow",
            "key-exports",
            "key-exports-shadow",
            "tenant",
            "tenant-shadow",
            "tenant-exports",
            "tenant-exports-shadow"
        ]
    );
    assert!(!set.is_empty());
    assert!(RuleSet::default().is_empty());
}

#[test]
fn concurrency_rules_are_chosen_apart_from_rate_rules() {
    let cap = StoredRow {
        kind: "concurrency".into(),
        ..row("cap", "", "", "key", 4, "1/second")
    };
    let set = RuleSet::from_rules_for_test(&[row("rate", "", "", "key", 1, "1/second"), cap]);
    let caps: Vec<&str> = set.concurrency("acme", "").map(|r| &*r.name).collect();
    assert_eq!(caps, ["cap"]);
    assert_eq!(names(&set, "acme", ""), ["rate"]);
}

#[test]
fn plans_are_named_by_id_and_rows_of_plans_found_in_rows() {
    let rows = [
        row("default-key", "", "", "key", 30, "600/minute"),
        plan_row("pro-key", "pro", "key", 300),
    ];
    // A plan named by a row exists.
    let (set, errors) = RuleSet::from_rows(&rows);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(set.len(), 2);
    let mut loader = rules::Loader::new(7);
    assert_eq!(loader.max_rules(), 7);
    let base = RuleSet::default();
    let mut update = loader.begin(&base, true, Vec::new());
    update.plan("pro");
    update.plan("free");
    for (i, r) in rows.iter().enumerate() {
        update.row(with_id(i as i64 + 1, r.clone()));
    }
    update.tenant(TenantRow::on_plan("acme", "pro"));
    update.tenant(TenantRow::on_plan("initech", "free"));
    update.tenant(TenantRow::on_plan("hooli", "gone"));
    let (set, _) = update.finish();
    let (acme, initech) = (
        set.plan_of("acme").unwrap(),
        set.plan_of("initech").unwrap(),
    );
    assert_ne!(acme, initech);
    assert_eq!(loader.plan_name(acme), Some("pro"));
    assert_eq!(loader.plan_name(initech), Some("free"));
    assert_eq!(set.plan_of("nobody"), None);
    assert_eq!(loader.plan_name(u32::MAX), None);
    // Only plans with tenants on them and no existence are missing.
    assert_eq!(loader.missing_plans(&set), [("gone".to_owned(), 1)]);
    // Its one tenant moves off it: nothing is missing.
    let (set, _) = apply(
        &mut loader,
        &set,
        &[Owner::Tenant("hooli".into())],
        &[],
        &[],
        &[],
    );
    assert_eq!(loader.missing_plans(&set), []);
}

#[test]
fn a_batch_naming_the_default_rows_changes_them() {
    let mut loader = rules::Loader::new(usize::MAX);
    let base = RuleSet::default();
    let mut update = loader.begin(&base, true, Vec::new());
    update.row(with_id(1, row("d", "", "", "key", 30, "600/minute")));
    let (v1, _) = update.finish();
    let (v2, _) = apply(
        &mut loader,
        &v1,
        &[Owner::Tenant("".into())],
        &[],
        &[with_id(1, row("d", "", "", "key", 31, "600/minute"))],
        &[],
    );
    assert_eq!(v2.applicable("acme", "").next().unwrap().limit.burst(), 31);
    let (v3, _) = apply(&mut loader, &v2, &[Owner::Tenant("".into())], &[], &[], &[]);
    assert!(v3.is_empty(), "the default rows deleted");
}

#[test]
fn a_full_reload_keeps_a_bad_rows_last_good_version_and_reports_it_once() {
    let mut loader = rules::Loader::new(usize::MAX);
    let full = |loader: &mut rules::Loader, base: &RuleSet, burst: i64| {
        let mut update = loader.begin(base, true, Vec::new());
        update.row(with_id(1, row("d", "", "", "key", 30, "600/minute")));
        update.row(with_id(3, row("g", "globex", "", "key", burst, "1/second")));
        update.row(with_id(
            4,
            row("g2", "globex", "", "tenant", 90, "1/second"),
        ));
        update.finish()
    };
    let (v1, _) = full(&mut loader, &RuleSet::default(), 80);
    let (v2, applied) = full(&mut loader, &v1, 0);
    assert_eq!(applied.newly_rejected.len(), 1);
    assert!(applied.newly_rejected[0].row.starts_with("row \"g\""));
    assert_eq!(names(&v2, "globex", ""), ["g", "g2"]);
    assert_eq!(
        v2.applicable("globex", "").next().unwrap().limit.burst(),
        80
    );
    assert_eq!(v2.len(), 3);
    let (v3, applied) = full(&mut loader, &v2, 0);
    assert!(applied.newly_rejected.is_empty(), "reported once");
    assert_eq!(v3.len(), 3);
    assert_eq!(
        v3.applicable("globex", "").next().unwrap().limit.burst(),
        80
    );
    assert_eq!(loader.rejected(10).1, 1);
}

#[test]
fn a_full_load_counts_a_tenants_rules_slot_by_slot() {
    let cap = StoredRow {
        kind: "concurrency".into(),
        ..row("cap", "acme", "", "key", 4, "1/second")
    };
    let shadow = StoredRow {
        mode: "shadow".into(),
        ..row("shadow", "acme", "", "key", 4, "1/second")
    };
    let (set, errors) = RuleSet::from_rows(&[
        row("d", "", "", "key", 30, "600/minute"),
        cap,
        shadow,
        row("key", "acme", "", "key", 5, "1/second"),
        row("again", "acme", "", "key", 6, "1/second"),
    ]);
    // The shadow rate rule and the cap are in slots of their own; the
    // second enforced key row is a duplicate.
    assert_eq!(names(&set, "acme", ""), ["key", "shadow"]);
    let caps: Vec<&str> = set.concurrency("acme", "").map(|r| &*r.name).collect();
    assert_eq!(caps, ["cap"]);
    assert_eq!(set.len(), 4);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].row.starts_with("row \"again\""), "{errors:?}");
}

#[test]
fn batches_of_many_tenants_each_find_their_own_rows() {
    let mut loader = rules::Loader::new(usize::MAX);
    let empty = RuleSet::default();
    let mut update = loader.begin(&empty, true, Vec::new());
    update.plan("pro");
    update.row(with_id(1, row("d", "", "", "key", 30, "600/minute")));
    update.row(with_id(2, plan_row("pro-key", "pro", "key", 300)));
    let (mut set, _) = update.finish();
    let mut id = 10;
    // Five batches of 200 tenants, each tenant with two rows; every
    // second tenant also on the plan.
    for batch in 0..5 {
        let tenants: Vec<String> = (0..200).map(|i| format!("t{batch}-{i}")).collect();
        let owners: Vec<Owner> = tenants
            .iter()
            .map(|t| Owner::Tenant(t.as_str().into()))
            .collect();
        let mut rows = Vec::new();
        for t in &tenants {
            id += 2;
            rows.push(with_id(
                id,
                row(&format!("{t}-ceiling"), t, "", "tenant", 9, "1/second"),
            ));
            rows.push(with_id(
                id + 1,
                row(&format!("{t}-exports"), t, "exports", "key", 8, "1/second"),
            ));
        }
        let assignments: Vec<(&str, &str)> = tenants
            .iter()
            .step_by(2)
            .map(|t| (t.as_str(), "pro"))
            .collect();
        let (next, rejected) = apply(&mut loader, &set, &owners, &[], &rows, &assignments);
        assert!(rejected.is_empty(), "{rejected:?}");
        set = next;
    }
    for batch in 0..5 {
        for i in 0..200 {
            let t = format!("t{batch}-{i}");
            let key = if i % 2 == 0 { "pro-key" } else { "d" };
            assert_eq!(
                names(&set, &t, "exports"),
                [
                    key.to_owned(),
                    format!("{t}-exports"),
                    format!("{t}-ceiling")
                ],
                "{t}"
            );
        }
    }
    assert_eq!(set.tenants(), 1000);
    // An assignment for no tenant, or for a name past the label bound, is
    // ignored.
    let long = "t".repeat(200);
    let (next, _) = apply(
        &mut loader,
        &set,
        &[],
        &[],
        &[],
        &[("", "pro"), (&long, "pro")],
    );
    assert_eq!(next.tenants(), 1000);
}

#[test]
fn over_the_bound_a_full_reload_keeps_no_old_version() {
    let mut loader = rules::Loader::new(1);
    let empty = RuleSet::default();
    let mut update = loader.begin(&empty, true, Vec::new());
    update.row(with_id(3, row("g", "globex", "", "key", 80, "1/second")));
    let (v1, _) = update.finish();
    assert_eq!(names(&v1, "globex", ""), ["g"]);
    // A new row read first takes the room; g's row, read over the bound,
    // is rejected and its old version is not kept either.
    let mut update = loader.begin(&v1, true, Vec::new());
    update.row(with_id(2, row("a", "alpha", "", "key", 5, "1/second")));
    update.row(with_id(3, row("g", "globex", "", "key", 80, "1/second")));
    // Nor are assignments of no tenant, or of a name past the bound.
    update.plan("pro");
    update.tenant(TenantRow::on_plan("", "pro"));
    update.tenant(TenantRow::on_plan(&"t".repeat(200), "pro"));
    let (v2, applied) = update.finish();
    assert_eq!(v2.len(), 1);
    assert!(names(&v2, "globex", "").is_empty());
    assert_eq!(names(&v2, "alpha", ""), ["a"]);
    assert_eq!(applied.newly_rejected.len(), 1);
    assert_eq!(v2.tenants(), 1);
}

impl RuleSet {
    fn from_rules_for_test(rows: &[StoredRow]) -> Self {
        let (set, errors) = Self::from_rows(rows);
        assert!(errors.is_empty(), "{errors:?}");
        set
    }
}

fn quota_row(name: &str, tenant: &str, burst: i64, rate: &str) -> StoredRow {
    StoredRow {
        kind: "quota".into(),
        ..row(name, tenant, "", "tenant", burst, rate)
    }
}

#[test]
fn a_quota_counts_its_rate_per_calendar_period() {
    let shape = quota_row("q", "acme", 0, "1000000/month").shape().unwrap();
    assert_eq!(shape.period(), Some(Period::Month));
    assert_eq!(shape.limit.algorithm(), crate::algorithm::Algorithm::Quota);
    assert_eq!(shape.limit.burst(), 1_000_000);
    assert_eq!(shape.bucket_kind().tag(), "tq");
    let per_key = StoredRow {
        scope: "key".into(),
        mode: "shadow".into(),
        debt: 500,
        ..quota_row("q", "acme", 50, "50/day")
    };
    let shape = per_key.shape().unwrap();
    assert_eq!(
        (shape.period(), shape.limit.debt()),
        (Some(Period::Day), 500)
    );
    assert_eq!(shape.bucket_kind().tag(), "kqs");
    for (unit, period) in [("week", Period::Week), ("year", Period::Year)] {
        let r = quota_row("q", "acme", 0, &format!("7/{unit}"));
        assert_eq!(r.shape().unwrap().period(), Some(period));
    }
    // A rate rule has no period.
    assert_eq!(
        row("r", "", "", "key", 1, "1/day")
            .shape()
            .unwrap()
            .period(),
        None
    );
    let rule = quota_row("acme-monthly", "acme", 0, "1000/month")
        .validate()
        .unwrap();
    assert_eq!(rule.to_string(), "acme-monthly (quota 1000/month)");
    assert_eq!(
        requested("acme", "", "tenant", "1000/month", "enforce", "quota").name,
        "acme-any-tenant-quota"
    );
}

#[test]
fn a_quota_row_says_what_to_fix() {
    let reason = |r: StoredRow| r.shape().unwrap_err();
    assert_eq!(
        reason(quota_row("q", "acme", 0, "100/hour")),
        "a quota counts per day, week, month or year of the tenant's billing cycle; the rate's \
         unit is hour"
    );
    assert_eq!(
        reason(quota_row("q", "acme", 5, "100/day")),
        "burst is 5; a quota's count is its rate (100 per day): leave burst 0 or make it 100"
    );
    assert_eq!(
        reason(quota_row("q", "acme", 0, "0/day")),
        "rate must be at least 1 per unit"
    );
}

/// Quotas are applicable with the rate rules, after them, each slot's most
/// specific row winning as for rates.
#[test]
fn quotas_apply_with_the_rate_rules_after_them() {
    let set = RuleSet::from_rules_for_test(&[
        row("default-key", "", "", "key", 30, "600/minute"),
        quota_row("default-monthly", "", 0, "1000/month"),
        quota_row("acme-monthly", "acme", 0, "5000/month"),
        StoredRow {
            resource: "exports".into(),
            ..quota_row("acme-exports-daily", "acme", 0, "50/day")
        },
        StoredRow {
            kind: "concurrency".into(),
            ..row("acme-slots", "acme", "", "tenant", 4, "1/second")
        },
    ]);
    assert_eq!(
        names(&set, "globex", ""),
        ["default-key", "default-monthly"]
    );
    assert_eq!(
        names(&set, "acme", "exports"),
        ["default-key", "acme-monthly", "acme-exports-daily"]
    );
    let caps: Vec<&str> = set.concurrency("acme", "").map(|r| &*r.name).collect();
    assert_eq!(caps, ["acme-slots"]);
}
