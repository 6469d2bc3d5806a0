//! Criterion benches of the decision path: the algorithm alone, the
//! in-process store on one hot key and on a million keys (1 and 2 threads),
//! and the Redis store when `redis-server` is installed.
//!
//!     cargo bench --bench decide

#![allow(clippy::disallowed_methods)] // a bench measures wall time

use std::hint::black_box;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tollgate::algorithm::{Algorithm, Charge, Limit, Op, Rate, decide, plan};
use tollgate::clock::{Clock, ManualClock};
use tollgate_core::store::{
    BucketKey, BucketKind, MemoryStore, RedisConfig, RedisStore, Request, Store,
};

const T0: u64 = 1_700_000_000_000_000;

fn limit() -> Limit {
    Limit::new(30, "600/minute".parse::<Rate>().unwrap()).unwrap()
}

fn algorithm(c: &mut Criterion) {
    let mut g = c.benchmark_group("algorithm");
    g.throughput(Throughput::Elements(1));
    let l = limit();
    let mut now = T0;
    let mut state = None;
    g.bench_function("token_bucket_decide", |b| {
        b.iter(|| {
            now += 1_000;
            let (v, s) = decide(black_box(state), &l, 1, now).unwrap();
            if v.allowed {
                state = Some(s);
            }
            v
        })
    });
    let w = Limit::window(Algorithm::SlidingWindow, "600/minute".parse().unwrap()).unwrap();
    let charges = [
        Charge {
            limit: l,
            cost: 1,
            need: 1,
            enforce: true,
        },
        Charge {
            limit: w,
            cost: 1,
            need: 1,
            enforce: true,
        },
    ];
    g.bench_function("plan_two_buckets", |b| {
        b.iter(|| plan(black_box(&[None, None]), &charges, T0, Op::SPEND))
    });
    g.finish();
}

fn memory_store(c: &mut Criterion) {
    let mut g = c.benchmark_group("memory_store");
    g.throughput(Throughput::Elements(1));
    let clock = Arc::new(ManualClock::new(T0));
    let store = Arc::new(MemoryStore::new(clock.clone(), 2_000_000));
    let charge = [Charge {
        limit: Limit::new(1_000_000, "1000000/second".parse().unwrap()).unwrap(),
        cost: 1,
        need: 1,
        enforce: true,
    }];
    let hot = [BucketKey::new("bench", BucketKind::KEY, "", "hot")];
    g.bench_function("one_hot_key", |b| {
        b.iter(|| {
            clock.advance(Duration::from_micros(1));
            store.apply_now(black_box(&hot), &charge, Op::SPEND)
        })
    });
    let keys: Vec<[BucketKey; 1]> = (0..1_000_000)
        .map(|i| [BucketKey::new("bench", BucketKind::KEY, "", &i.to_string())])
        .collect();
    for k in &keys {
        store
            .apply_now(k, &charge, Op::SPEND)
            .expect("under the cap");
    }
    let mut i = 0usize;
    g.bench_function("million_keys", |b| {
        b.iter(|| {
            i = (i + 7919) % keys.len();
            store.apply_now(black_box(&keys[i]), &charge, Op::SPEND)
        })
    });
    for threads in [1usize, 2] {
        g.throughput(Throughput::Elements(threads as u64));
        g.bench_function(format!("million_keys_{threads}_threads"), |b| {
            b.iter_custom(|iters| {
                let started = Instant::now();
                std::thread::scope(|s| {
                    for t in 0..threads {
                        let (store, keys) = (&store, &keys);
                        s.spawn(move || {
                            let mut i = t * 500_000;
                            for _ in 0..iters {
                                i = (i + 7919) % keys.len();
                                let _ = black_box(store.apply_now(&keys[i], &charge, Op::SPEND));
                            }
                        });
                    }
                });
                started.elapsed()
            })
        });
    }
    g.finish();
}

struct Redis(Child);

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn redis_store(c: &mut Criterion) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let Ok(child) = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(Stdio::null())
        .spawn()
    else {
        eprintln!("redis-server not installed: skipping the Redis benches");
        return;
    };
    let _redis = Redis(child);
    std::thread::sleep(Duration::from_millis(300));
    // The service's own runtime (src/runtime.rs), LIFO slot off.
    let runtime = tollgate::runtime::build(0, false).unwrap();
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(T0));
    let store = runtime.block_on(async {
        let config = RedisConfig {
            timeout: Duration::from_secs(5),
            ..RedisConfig::new(format!("redis://127.0.0.1:{port}"))
        };
        Arc::new(RedisStore::new(config, Some(clock)).unwrap())
    });
    let charge = [Charge {
        limit: Limit::new(1_000_000, "1000000/second".parse().unwrap()).unwrap(),
        cost: 1,
        need: 1,
        enforce: true,
    }];
    let mut g = c.benchmark_group("redis_store");
    g.throughput(Throughput::Elements(1));
    let mut i = 0u64;
    g.bench_function("sequential_round_trip", |b| {
        b.iter(|| {
            i += 1;
            let key = [BucketKey::new(
                "bench",
                BucketKind::KEY,
                "",
                &(i % 10_000).to_string(),
            )];
            runtime
                .block_on(store.apply(Request::new(&key, &charge, Op::SPEND)))
                .unwrap()
        })
    });
    // 64 decisions in flight: pipelined on the multiplexed connection.
    g.throughput(Throughput::Elements(64));
    g.bench_function("pipelined_64", |b| {
        b.iter(|| {
            runtime.block_on(async {
                let mut tasks = Vec::with_capacity(64);
                for j in 0..64u64 {
                    let store = store.clone();
                    tasks.push(tokio::spawn(async move {
                        let key = [BucketKey::new("bench", BucketKind::KEY, "", &j.to_string())];
                        store
                            .apply(Request::new(&key, &charge, Op::SPEND))
                            .await
                            .unwrap()
                    }));
                }
                for t in tasks {
                    t.await.unwrap();
                }
            })
        })
    });
    g.finish();
}

/// The header fields of an answer, in each style, for 1 and 4 rules: what
/// `--rate-limit-headers` costs a decision.
fn header_fields(c: &mut Criterion) {
    use tollgate::engine::fields::header_fields;
    use tollgate::engine::{
        Allowance, Answer, Api, Demand, HeaderStyle, Headers, Item, ItemAnswer, Line, OverCapacity,
    };
    use tollgate::limits::OnStoreUnavailable;
    use tollgate::telemetry::metrics::Outcome;
    let mut g = c.benchmark_group("header_fields");
    g.throughput(Throughput::Elements(1));
    let names = ["r4-key", "r4-all", "r4-api-key", "r4-api-all"];
    let verdict = tollgate::algorithm::Verdict {
        allowed: true,
        remaining: 999_999_999,
        debt: 0,
        forgiven: 0,
        retry_after: 0,
        reset_after: 1_000,
    };
    for rules in [1, 4] {
        let mut demand = Demand::new(Api::Native, Op::SPEND, OverCapacity::Invalid);
        demand.items.push(Item::new("r4", "api", "k1", 1));
        for name in &names[..rules] {
            demand.lines.push(Line {
                item: 0,
                bucket: BucketKey::new("r4", BucketKind::KEY, "api", "k1"),
                allowance: Allowance::Limited(limit()),
                enforce: true,
                on_store_unavailable: OnStoreUnavailable::Allow,
                label: name,
                calendar: None,
            });
        }
        let headers = Headers {
            limit: 30,
            remaining: 29,
            reset: 1,
            retry_after: None,
        };
        let item = ItemAnswer {
            allowed: true,
            shadow: false,
            remaining: 29,
            debt: 0,
            retry_after: 0,
            reset_after: 1_000,
            line: Some(0),
            degraded: None,
            outcome: Outcome::Allowed,
            headers: Some(headers),
        };
        let answer = Answer {
            allowed: true,
            retry_after: 0,
            items: [item].into_iter().collect(),
            lines: std::iter::repeat_n(verdict, rules).collect(),
            headers: Some(headers),
            forgiven: 0,
        };
        for (style, name) in [
            (HeaderStyle::Draft11, "draft11"),
            (HeaderStyle::Legacy, "legacy"),
        ] {
            g.bench_function(format!("{name}_{rules}_rules"), |b| {
                b.iter(|| black_box(header_fields(style, &demand, &answer, Some(0))))
            });
        }
    }
    g.finish();
}

/// What the explain view's ring of recent decisions costs a decision: an
/// admission in a slot that recorded one within 100 ms (counted, not
/// kept: the common case under load), a refusal (always kept), and both
/// over a million keys (a cache miss per slot).
fn recent_decisions(c: &mut Criterion) {
    use tollgate::telemetry::metrics::Outcome;
    use tollgate::telemetry::recent::Recent;
    let mut g = c.benchmark_group("recent_decisions");
    g.throughput(Throughput::Elements(1));
    let recent = Recent::new();
    recent.record("acme", "alice", T0, Outcome::Allowed, "per-key", 1);
    g.bench_function("admitted_sampled_out", |b| {
        b.iter(|| recent.record("acme", "alice", T0 + 1, Outcome::Allowed, "per-key", 1))
    });
    g.bench_function("refused_kept", |b| {
        b.iter(|| recent.record("acme", "alice", T0 + 1, Outcome::Rejected, "per-key", 1))
    });
    let keys: Vec<String> = (0..1_000_000).map(|i| format!("key-{i}")).collect();
    let mut i = 0;
    g.bench_function("admitted_million_keys", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            recent.record("acme", &keys[i], T0 + 2, Outcome::Allowed, "per-key", 1)
        })
    });
    g.bench_function("refused_million_keys", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            recent.record("acme", &keys[i], T0 + 2, Outcome::Rejected, "per-key", 1)
        })
    });
    g.finish();
}

criterion_group!(
    benches,
    algorithm,
    memory_store,
    redis_store,
    header_fields,
    recent_decisions
);
criterion_main!(benches);
