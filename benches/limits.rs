//! Criterion benches of the rules in force at scale: a decision's rule
//! lookup with a thousand and a million tenants (own rows, or a plan), one
//! edit applied to a snapshot of a million tenants, and a whole load of
//! 100 000 rows (validation and indexing, no database).
//!
//!     cargo bench --bench limits

use std::hint::black_box;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use tollgate::limits::rules::Loader;
use tollgate::limits::table::TenantRow;
use tollgate::limits::{Owner, RuleSet, StoredRow};

fn row(id: i64, tenant: &str, burst: i64) -> StoredRow {
    StoredRow {
        id,
        name: format!("{tenant}-key"),
        tenant: tenant.into(),
        plan: String::new(),
        resource: String::new(),
        scope: "key".into(),
        burst,
        rate: 100,
        rate_unit: "second".into(),
        mode: "enforce".into(),
        on_store_unavailable: "allow".into(),
        debt: 0,
        kind: "rate".into(),
        alerts: String::new(),
        updated_at: String::new(),
    }
}

/// `n` tenants with a row each, `n` more on plan `pro`, and a default row.
fn table(n: usize) -> (Loader, RuleSet) {
    let mut loader = Loader::new(usize::MAX);
    let base = RuleSet::default();
    let mut update = loader.begin(&base, true, Vec::new());
    update.plan("pro");
    update.row(row(1, "", 30));
    update.row(StoredRow {
        plan: "pro".into(),
        name: "pro-key".into(),
        ..row(2, "", 1000)
    });
    for i in 0..n {
        update.row(row(i as i64 + 3, &format!("t{i}"), 100 + (i % 7) as i64));
    }
    for i in 0..n {
        update.tenant(TenantRow::on_plan(&format!("p{i}"), "pro"));
    }
    let (set, _) = update.finish();
    (loader, set)
}

fn lookup(c: &mut Criterion) {
    let mut g = c.benchmark_group("limits_lookup");
    g.throughput(Throughput::Elements(1));
    for n in [1_000, 1_000_000] {
        let (_, set) = table(n);
        let tenants: Vec<String> = (0..1024).map(|i| format!("t{}", i * (n / 1024))).collect();
        let planned: Vec<String> = (0..1024).map(|i| format!("p{}", i * (n / 1024))).collect();
        let mut i = 0;
        g.bench_function(format!("own row, {n} tenants"), |b| {
            b.iter(|| {
                i = (i + 1) & 1023;
                black_box(set.applicable(black_box(&tenants[i]), "").count())
            })
        });
        g.bench_function(format!("plan, {n} tenants"), |b| {
            b.iter(|| {
                i = (i + 1) & 1023;
                black_box(set.applicable(black_box(&planned[i]), "").count())
            })
        });
    }
    g.finish();
}

fn apply(c: &mut Criterion) {
    let mut g = c.benchmark_group("limits_apply");
    let (mut loader, set) = table(1_000_000);
    g.bench_function("one edited tenant, 1000000 tenants", |b| {
        let mut n = 0;
        b.iter(|| {
            n += 1;
            let mut update = loader.begin(&set, false, vec![Owner::Tenant("t42".into())]);
            update.row(row(45, "t42", 100 + n % 50));
            black_box(update.finish())
        })
    });
    g.finish();
    let mut g = c.benchmark_group("limits_load");
    g.throughput(Throughput::Elements(100_000));
    g.sample_size(10);
    g.bench_function("100000 rows", |b| {
        b.iter_batched(
            || {
                (0..100_000)
                    .map(|i| row(i + 1, &format!("t{i}"), 100))
                    .collect::<Vec<_>>()
            },
            |rows| {
                let mut loader = Loader::new(usize::MAX);
                let base = RuleSet::default();
                let mut update = loader.begin(&base, true, Vec::new());
                for r in rows {
                    update.row(r);
                }
                black_box(update.finish())
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

criterion_group!(benches, lookup, apply);
criterion_main!(benches);
