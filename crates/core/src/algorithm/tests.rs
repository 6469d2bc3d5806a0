//! Properties of the bucket arithmetic, and the seed scenario.

use super::*;
use proptest::prelude::*;

const T0: Micros = 1_700_000_000_000_000;

fn limit(burst: u64, count: u64, unit: RateUnit) -> Limit {
    Limit::new(burst, Rate { count, unit }).unwrap()
}

/// Runs requests through one bucket; returns (time, cost) of each admitted one.
fn run(limit: &Limit, events: &[(Micros, u64)]) -> Vec<(Micros, u64)> {
    let mut state = None;
    let mut admitted = Vec::new();
    for &(now, cost) in events {
        let (verdict, next) = decide(state, limit, cost, now).unwrap();
        if verdict.allowed {
            state = Some(next);
            admitted.push((now, cost));
        } else {
            assert_eq!(next, state.unwrap_or(BucketState::full(limit, now)));
        }
    }
    admitted
}

#[test]
fn seed_scenario_dashboard_burst_then_ten_per_second() {
    // 600 requests/minute with a burst of 30.
    let limit = limit(30, 600, RateUnit::Minute);
    assert_eq!(limit.interval(), 100_000);
    let mut state = None;
    // A dashboard fires 30 requests at once: all pass, the 31st waits 100 ms.
    for i in 0..30 {
        let (v, next) = decide(state, &limit, 1, T0).unwrap();
        assert!(v.allowed, "request {i} of the burst");
        assert_eq!(v.remaining, 29 - i);
        state = Some(next);
    }
    let (v, _) = decide(state, &limit, 1, T0).unwrap();
    assert!(!v.allowed);
    assert_eq!(v.retry_after, 100_000);
    assert_eq!(v.reset_after, 3_000_000);
    // Then it settles at 10/s: one request every 100 ms always passes...
    for i in 1..=100 {
        let (v, next) = decide(state, &limit, 1, T0 + i * 100_000).unwrap();
        assert!(v.allowed, "steady request {i}");
        assert_eq!(v.remaining, 0);
        state = Some(next);
        // ...and an extra one in between never does.
        let (v, _) = decide(state, &limit, 1, T0 + i * 100_000 + 50_000).unwrap();
        assert!(!v.allowed);
        assert_eq!(v.retry_after, 50_000);
    }
}

#[test]
fn seed_scenario_hammering_client_gets_burst_plus_rate() {
    let limit = limit(30, 600, RateUnit::Minute);
    // 3,000 requests/s for 10 s: request i at i/3000 s.
    let events: Vec<_> = (0..30_000u64)
        .map(|i| (T0 + i * 1_000_000 / 3_000, 1))
        .collect();
    let admitted = run(&limit, &events);
    // The burst of 30, then one token every 100 ms: at 0.1 s, 0.2 s, ... 9.9 s
    // (the last request is at 9.9997 s, before the 100th refill).
    assert_eq!(admitted.len(), 30 + 99);
    assert_eq!(events.len() - admitted.len(), 29_871);
}

#[test]
fn cost_above_capacity_is_an_error_not_a_wait() {
    let limit = limit(30, 600, RateUnit::Minute);
    assert_eq!(
        decide(None, &limit, 31, T0),
        Err(CostExceedsBurst {
            cost: 31,
            burst: 30
        })
    );
    assert!(decide(None, &limit, 30, T0).unwrap().0.allowed);
}

#[test]
fn units_have_their_lengths_and_names_and_parse_every_spelling() {
    let day = 86_400_000_000;
    let units = [
        (
            RateUnit::Second,
            1_000_000,
            "second",
            &["s", "sec", "second", "seconds"][..],
        ),
        (
            RateUnit::Minute,
            60_000_000,
            "minute",
            &["m", "min", "minute", "minutes"],
        ),
        (
            RateUnit::Hour,
            3_600_000_000,
            "hour",
            &["h", "hour", "hours"],
        ),
        (RateUnit::Day, day, "day", &["d", "day", "days"]),
        (RateUnit::Week, 7 * day, "week", &["w", "week", "weeks"]),
        (RateUnit::Month, 30 * day, "month", &["month", "months"]),
        (RateUnit::Year, 365 * day, "year", &["y", "year", "years"]),
    ];
    for (unit, micros, name, spellings) in units {
        assert_eq!(unit.micros(), micros, "{name}");
        assert_eq!(unit.as_str(), name);
        assert_eq!(RateUnit::parse(name), Some(unit));
        for spelling in spellings {
            assert_eq!(RateUnit::parse(spelling), Some(unit), "{spelling}");
            assert_eq!(
                RateUnit::parse(&format!(" {} ", spelling.to_uppercase())),
                Some(unit)
            );
        }
        // A rate prints as it parses.
        let rate = Rate { count: 7, unit };
        assert_eq!(rate.to_string(), format!("7/{name}"));
        assert_eq!(rate.to_string().parse::<Rate>(), Ok(rate));
    }
    assert_eq!(RateUnit::parse("fortnight"), None);
}

#[test]
fn algorithms_print_as_they_parse() {
    for algorithm in [
        Algorithm::TokenBucket,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::Concurrency,
    ] {
        assert_eq!(Algorithm::parse(algorithm.as_str()), Some(algorithm));
    }
    assert_eq!(Algorithm::TokenBucket.as_str(), "token_bucket");
    assert_eq!(Algorithm::FixedWindow.as_str(), "fixed_window");
    assert_eq!(Algorithm::SlidingWindow.as_str(), "sliding_window");
    assert_eq!(Algorithm::Concurrency.as_str(), "concurrency");
    assert_eq!(Algorithm::parse("leaky_bucket"), None);
    assert_eq!(Algorithm::parse("Token_Bucket"), None);
}

#[test]
fn the_largest_cost_is_above_every_capacity_and_exact_in_a_double() {
    // The largest capacity: MAX_TOLERANCE tokens at one per microsecond.
    let largest = Limit::new(
        MAX_TOLERANCE,
        Rate {
            count: 1_000_000,
            unit: RateUnit::Second,
        },
    )
    .unwrap();
    assert!(MAX_COST > largest.burst());
    // Lua holds numbers in doubles: the clamp must survive the trip.
    assert_eq!(MAX_COST as f64 as u64, MAX_COST);
    assert_ne!((MAX_COST + 1) as f64 as u64, MAX_COST + 1);
}

#[test]
fn a_sliding_window_is_refused_only_past_the_weights_exact_range() {
    // count × window in ms may reach MAX_WEIGHT, not pass it.
    let per_second = |count| Rate {
        count,
        unit: RateUnit::Second,
    };
    let at = window::MAX_WEIGHT / 1000;
    assert!(Limit::window(Algorithm::SlidingWindow, per_second(at)).is_ok());
    assert!(matches!(
        Limit::window(Algorithm::SlidingWindow, per_second(at + 1)),
        Err(LimitError::TooSlow { .. })
    ));
    // A fixed window only counts: the same count is fine.
    assert!(Limit::window(Algorithm::FixedWindow, per_second(at + 1)).is_ok());
}

#[test]
fn a_concurrency_cap_is_bounded_and_takes_no_debt() {
    assert_eq!(Limit::concurrency(0), Err(LimitError::ZeroBurst));
    let cap = Limit::concurrency(8).unwrap();
    assert!(cap.is_concurrency());
    assert_eq!((cap.algorithm(), cap.burst()), (Algorithm::Concurrency, 8));
    assert_eq!(
        Limit::concurrency(u64::MAX).unwrap().burst(),
        MAX_CONCURRENCY
    );
    assert!(!limit(8, 1, RateUnit::Second).is_concurrency());
    assert_eq!(cap.with_debt(0), Ok(cap));
    assert_eq!(
        cap.with_debt(1),
        Err(LimitError::DebtTooLarge { burst: 8, debt: 1 })
    );
}

#[test]
fn debt_is_kept_up_to_what_each_algorithm_can_hold() {
    // A token bucket: (burst + debt) × interval at most MAX_TOLERANCE.
    let bucket = limit(10, 1, RateUnit::Second);
    let debt = bucket.with_debt(5).unwrap();
    assert_eq!((debt.burst(), debt.debt()), (10, 5));
    assert_eq!(debt.floor(), 15 * 1_000_000);
    assert_eq!(debt.tolerance(), 10 * 1_000_000);
    let most = MAX_TOLERANCE / 1_000_000 - 10;
    assert_eq!(bucket.with_debt(most).unwrap().debt(), most);
    assert_eq!(
        bucket.with_debt(most + 1),
        Err(LimitError::DebtTooLarge {
            burst: 10,
            debt: most + 1
        })
    );
    assert!(bucket.with_debt(u64::MAX).is_err());
    // A sliding window: (burst + debt) × window in ms at most MAX_WEIGHT.
    let per_second = Rate {
        count: 10,
        unit: RateUnit::Second,
    };
    let sliding = Limit::window(Algorithm::SlidingWindow, per_second).unwrap();
    let most = window::MAX_WEIGHT / 1000 - 10;
    assert_eq!(sliding.with_debt(most).unwrap().debt(), most);
    assert!(sliding.with_debt(most + 1).is_err());
    // A fixed window only counts: up to MAX_TOLERANCE in all.
    let fixed = Limit::window(Algorithm::FixedWindow, per_second).unwrap();
    assert_eq!(
        fixed.with_debt(MAX_TOLERANCE - 10).unwrap().debt(),
        MAX_TOLERANCE - 10
    );
    assert!(fixed.with_debt(MAX_TOLERANCE - 9).is_err());
    // A window's tolerance is its length.
    assert_eq!(fixed.tolerance(), 1_000_000);
}

#[test]
fn a_scaled_limit_is_its_share_rounded_toward_the_caller() {
    // A third of 10 tokens at 10/s with a debt of 4: 4 tokens (rounded up)
    // at a third of the rate (the interval rounded up), a debt of 2.
    let base = Limit::new(
        10,
        Rate {
            count: 10,
            unit: RateUnit::Second,
        },
    )
    .unwrap()
    .with_debt(4)
    .unwrap();
    let third = base.scaled(1.0 / 3.0);
    assert_eq!(
        (third.burst(), third.interval(), third.debt()),
        (4, 300_000, 2)
    );
    assert_eq!(third.algorithm(), Algorithm::TokenBucket);
    // A share never goes below one token.
    assert_eq!(base.scaled(0.001).burst(), 1);
    // Fractions outside (0, 1) leave the limit as it is.
    for fraction in [0.0, 1.0, 1.5, -0.5, f64::NAN] {
        assert_eq!(base.scaled(fraction), base, "{fraction}");
    }
    // A window keeps its length and scales its count.
    let window = Limit::window(
        Algorithm::FixedWindow,
        Rate {
            count: 100,
            unit: RateUnit::Minute,
        },
    )
    .unwrap()
    .with_debt(10)
    .unwrap();
    let half = window.scaled(0.5);
    assert_eq!(
        (half.burst(), half.interval(), half.debt()),
        (50, 60_000_000, 5)
    );
    assert_eq!(half.algorithm(), Algorithm::FixedWindow);
    // The interval is clamped so the floor stays within MAX_TOLERANCE:
    // 36 000 a day with a debt of 500 is exactly 100 years from the floor,
    // and a third of it, rounded up, would pass it.
    let slow = Limit::new(
        36_000,
        Rate {
            count: 1,
            unit: RateUnit::Day,
        },
    )
    .unwrap()
    .with_debt(500)
    .unwrap();
    assert_eq!(slow.floor(), MAX_TOLERANCE);
    let third = slow.scaled(1.0 / 3.0);
    assert_eq!((third.burst(), third.debt()), (12_000, 167));
    assert_eq!(third.interval(), MAX_TOLERANCE / 12_167);
    assert!(third.floor() <= MAX_TOLERANCE, "{third:?}");
}

#[test]
fn verdict_durations_are_its_microseconds() {
    let verdict = Verdict {
        retry_after: 1_500,
        reset_after: 2_000_001,
        ..Verdict::admitted()
    };
    assert_eq!(verdict.retry_after(), Duration::from_micros(1_500));
    assert_eq!(verdict.reset_after(), Duration::from_micros(2_000_001));
}

#[test]
fn ops_say_whether_they_write_decide_and_spend() {
    // (op, writes, decides, spends)
    let table = [
        (Op::SPEND, true, true, true),
        (Op::DRY, false, true, false),
        (Op::Charge, true, false, false),
        (Op::Refund { since: T0 }, true, false, false),
        (Op::Acquire { ttl: 1 }, true, true, true),
    ];
    for (op, writes, decides, spends) in table {
        assert_eq!(
            (op.writes(), op.decides(), op.spends()),
            (writes, decides, spends),
            "{op:?}"
        );
    }
}

#[test]
fn a_refund_gives_back_its_tokens_even_from_a_debt_seen_past_the_floor() {
    // 10 tokens at 1/second. The clock stepped back 2 s after the bucket
    // was emptied: a debt of 12 s, past the 10 s floor. A refund of 11
    // tokens takes 11 s off it.
    let l = limit(10, 1, RateUnit::Second);
    let stepped_back = BucketState {
        full_at: T0 + 12_000_000,
        ..BucketState::full(&l, T0)
    };
    let (v, _) = token_bucket::refund(Some(stepped_back), &l, 11, T0);
    assert_eq!(v.reset_after, 1_000_000);
    // Beyond burst + debt + 1 tokens a refund is that many (no overflow).
    let (v, _) = token_bucket::refund(Some(stepped_back), &l, u64::MAX, T0);
    assert_eq!(v.reset_after, 1_000_000);
}

#[test]
fn limit_validation() {
    let r = |count, unit| Rate { count, unit };
    assert_eq!(
        Limit::new(0, r(1, RateUnit::Second)),
        Err(LimitError::ZeroBurst)
    );
    assert_eq!(
        Limit::new(1, r(0, RateUnit::Second)),
        Err(LimitError::ZeroRate)
    );
    assert!(matches!(
        Limit::new(1, r(2_000_000, RateUnit::Second)),
        Err(LimitError::TooFast(_))
    ));
    assert!(matches!(
        Limit::new(1_000_000, r(1, RateUnit::Day)),
        Err(LimitError::TooSlow { .. })
    ));
    // 3000/s does not divide a second: the interval rounds up, never down.
    assert_eq!(
        Limit::new(1, r(3000, RateUnit::Second)).unwrap().interval(),
        334
    );
    assert_eq!("600/minute".parse::<Rate>(), Ok(r(600, RateUnit::Minute)));
    assert_eq!("5/h".parse::<Rate>(), Ok(r(5, RateUnit::Hour)));
    assert!(
        "5/fortnight"
            .parse::<Rate>()
            .unwrap_err()
            .contains("fortnight")
    );
    assert!("five/second".parse::<Rate>().is_err());
}

#[test]
fn limit_change_keeps_spent_tokens_spent_and_clamps_to_new_burst() {
    let old = limit(10, 10, RateUnit::Second); // 100 ms per token
    let (_, state) = decide(None, &old, 4, T0).unwrap(); // 6 left
    // Slower refill, same burst: still 6 left, not more.
    let slower = limit(10, 1, RateUnit::Second);
    let (v, _) = decide(Some(state), &slower, 1, T0).unwrap();
    assert_eq!(v.remaining, 5);
    // Smaller burst: 4 tokens owed exceed a burst of 3, so the bucket is
    // clamped to empty, not left owing more than it can hold.
    let small = limit(3, 10, RateUnit::Second);
    let (v, _) = decide(Some(state), &small, 1, T0).unwrap();
    assert!(!v.allowed);
    assert_eq!(v.remaining, 0);
    assert_eq!(v.reset_after, 300_000);
    assert_eq!(v.retry_after, 100_000);
}

#[test]
fn plan_is_all_or_nothing_and_reports_unspent_tokens_on_rejection() {
    let roomy = limit(10, 1, RateUnit::Second);
    let tight = limit(2, 1, RateUnit::Hour);
    let charges = [
        Charge {
            limit: roomy,
            cost: 3,
            need: 3,
            enforce: true,
        },
        Charge {
            limit: tight,
            cost: 3 - 1,
            need: 3 - 1,
            enforce: true,
        },
    ];
    let p = plan(&[None, None], &charges, T0, Op::SPEND);
    assert!(p.allowed);
    assert_eq!(p.verdicts[0].remaining, 7);
    assert_eq!(p.verdicts[1].remaining, 0);
    assert!(p.writes.iter().all(Option::is_some));
    // Second time the tight bucket is empty: nothing is spent anywhere, and
    // the roomy bucket reports the 7 it still holds.
    let states = [p.writes[0], p.writes[1]];
    let p = plan(&states, &charges, T0, Op::SPEND);
    assert!(!p.allowed);
    assert!(p.writes.iter().all(Option::is_none));
    assert!(p.verdicts[0].allowed);
    assert_eq!(p.verdicts[0].remaining, 7);
    assert_eq!(p.verdicts[0].reset_after, 3_000_000);
    assert!(!p.verdicts[1].allowed);
    assert_eq!(p.verdicts[1].retry_after, 7_200_000_000); // two tokens at 1/hour
}

#[test]
fn a_plan_reads_a_caps_leases_and_charges_only_buckets() {
    let bucket = limit(10, 1, RateUnit::Second);
    let cap = Limit::concurrency(2).unwrap();
    let full = concurrency::Occupancy {
        held: 2,
        free_at: T0 + 5_000_000,
        all_free_at: T0 + 9_000_000,
    };
    let charges = [Charge::new(bucket, 1), Charge::new(cap, 1)];
    // The cap's occupancy is read from its state: two held of two.
    let states = [None, Some(State::Leases(full))];
    let p = plan(&states, &charges, T0, Op::Acquire { ttl: 1_000_000 });
    assert!(!p.allowed);
    assert_eq!(p.verdicts[1].retry_after, 5_000_000);
    assert_eq!(p.verdicts[1].reset_after, 9_000_000);
    assert!(p.writes.iter().all(Option::is_none));
    // A charge after the fact writes the bucket and only reports the cap.
    let p = plan(&states, &charges, T0, Op::Charge);
    assert!(p.allowed);
    assert!(p.writes[0].is_some());
    assert_eq!(p.writes[1], None);
    assert_eq!(p.verdicts[1].remaining, 0);
    assert_eq!(
        plan(&states, &charges, T0, Op::Refund { since: T0 }).writes[1],
        None
    );
}

#[test]
fn a_need_above_a_capacity_is_refused_for_ever_and_writes_nothing() {
    let bucket = limit(10, 1, RateUnit::Second);
    let charges = [Charge {
        limit: bucket,
        cost: 0,
        need: 11,
        enforce: true,
    }];
    let p = plan(&[None], &charges, T0, Op::SPEND);
    assert!(!p.allowed);
    assert!(!p.verdicts[0].allowed);
    assert_eq!(p.verdicts[0].retry_after, Micros::MAX);
    // The rest of the verdict is what the bucket holds: full.
    assert_eq!(p.verdicts[0].remaining, 10);
    assert_eq!(p.writes, vec![None]);
}

#[test]
fn shadow_charges_never_reject_and_are_spent_only_when_they_admit() {
    let open = limit(10, 1, RateUnit::Second);
    let empty_shadow = limit(1, 1, RateUnit::Hour);
    let charges = [
        Charge {
            limit: open,
            cost: 1,
            need: 1,
            enforce: true,
        },
        Charge {
            limit: empty_shadow,
            cost: 1,
            need: 1,
            enforce: false,
        },
    ];
    let spent_shadow = Some(BucketState {
        full_at: T0 + 3_600_000_000,
        ..BucketState::full(&empty_shadow, T0)
    });
    let p = plan(
        &[None, spent_shadow.map(State::Tokens)],
        &charges,
        T0,
        Op::SPEND,
    );
    assert!(p.allowed);
    assert!(!p.verdicts[1].allowed);
    assert!(p.writes[0].is_some());
    assert!(p.writes[1].is_none());
}

#[test]
fn dry_run_reports_as_if_spent_and_writes_nothing() {
    let l = limit(5, 1, RateUnit::Second);
    let p = plan(
        &[None],
        &[Charge {
            limit: l,
            cost: 2,
            need: 2,
            enforce: true,
        }],
        T0,
        Op::DRY,
    );
    assert!(p.allowed);
    assert_eq!(p.verdicts[0].remaining, 3);
    assert_eq!(p.writes, vec![None]);
}

fn arb_limit() -> impl Strategy<Value = Limit> {
    let everyday = (
        1u64..50,
        1u64..1_000,
        prop_oneof![
            Just(RateUnit::Second),
            Just(RateUnit::Minute),
            Just(RateUnit::Hour)
        ],
    )
        .prop_map(|(burst, count, unit)| limit(burst, count, unit));
    // Where integer arithmetic could overflow or round: 1 µs intervals with
    // bursts up to the largest tolerance (100 years of µs), year-long
    // intervals, and every long unit.
    let extreme = prop_oneof![
        (1u64..=MAX_TOLERANCE).prop_map(|burst| limit(burst, 1_000_000, RateUnit::Second)),
        (MAX_TOLERANCE - 1000..=MAX_TOLERANCE).prop_map(|burst| limit(
            burst,
            1_000_000,
            RateUnit::Second
        )),
        (1u64..=100).prop_map(|burst| limit(burst, 1, RateUnit::Year)),
        (
            1u64..100,
            1u64..1_000,
            prop_oneof![
                Just(RateUnit::Day),
                Just(RateUnit::Week),
                Just(RateUnit::Month),
                Just(RateUnit::Year)
            ],
        )
            .prop_filter_map("within the largest tolerance", |(burst, count, unit)| {
                Limit::new(burst, Rate { count, unit }).ok()
            }),
    ];
    prop_oneof![3 => everyday, 1 => extreme]
}

/// Time steps from 0 µs to a few intervals, one in ten of them backwards by
/// up to an interval (a clock stepped back), and costs from 0 to the burst.
fn arb_events(limit: Limit) -> impl Strategy<Value = Vec<(Micros, u64)>> {
    let max_step = limit.interval().saturating_mul(3);
    let step = prop_oneof![
        9 => (0..=max_step).prop_map(|dt| dt as i128),
        1 => (1..=limit.interval()).prop_map(|dt| -(dt as i128)),
    ];
    prop::collection::vec((step, 0..=limit.burst()), 1..200).prop_map(|steps| {
        let mut now = T0 as i128;
        steps
            .into_iter()
            .map(|(dt, cost)| {
                now = (now + dt).max(0);
                (now as Micros, cost)
            })
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// In any interval [a, b] the bucket admits at most burst + rate × (b − a).
    #[test]
    fn never_admits_more_than_burst_plus_rate_times_elapsed(
        (limit, events) in arb_limit().prop_flat_map(|l| (Just(l), arb_events(l)))
    ) {
        let admitted = run(&limit, &events);
        for i in 0..admitted.len() {
            let (mut spent, mut earliest, mut latest) = (0u128, admitted[i].0, admitted[i].0);
            for &(t, cost) in &admitted[i..] {
                spent += u128::from(cost);
                // With a clock that steps back, the span is that of the
                // readings seen, not last minus first.
                earliest = earliest.min(t);
                latest = latest.max(t);
                let elapsed = u128::from(latest - earliest);
                // cost × interval ≤ tolerance + elapsed, i.e. in tokens:
                prop_assert!(
                    spent * u128::from(limit.interval()) <= u128::from(limit.tolerance()) + elapsed,
                    "spent {} within {} µs", spent, elapsed
                );
            }
        }
    }

    /// After waiting exactly `retry_after` the same request is admitted; one
    /// microsecond earlier it is not. Rounding never makes it early.
    #[test]
    fn retry_after_is_exact(
        (limit, events) in arb_limit().prop_flat_map(|l| (Just(l), arb_events(l))),
        cost_pick in 0u64..1000,
    ) {
        let mut state = None;
        for &(now, cost) in &events {
            let (v, next) = decide(state, &limit, cost, now).unwrap();
            if v.allowed { state = Some(next); }
        }
        let now = events.last().unwrap().0;
        let cost = 1 + cost_pick % limit.burst();
        let (v, _) = decide(state, &limit, cost, now).unwrap();
        if !v.allowed {
            prop_assert!(v.retry_after > 0);
            let (later, _) = decide(state, &limit, cost, now + v.retry_after).unwrap();
            prop_assert!(later.allowed);
            let (early, _) = decide(state, &limit, cost, now + v.retry_after - 1).unwrap();
            prop_assert!(!early.allowed);
            // The whole-second Retry-After built from it is checked where the
            // headers are built (engine::summary's tests).
        } else {
            prop_assert_eq!(v.retry_after, 0);
        }
    }

    /// A clock that steps backwards never creates tokens: the stored instant
    /// never moves back, and admissions stay within burst + rate × the span of
    /// clock readings seen (a step back and forth again adds nothing).
    #[test]
    fn backwards_clock_never_creates_tokens(
        limit in arb_limit(),
        steps in prop::collection::vec((-5_000_000i64..5_000_000, 1u64..10), 1..200),
    ) {
        let mut now = T0 as i64;
        let (mut earliest, mut latest) = (T0, T0);
        let mut state: Option<BucketState> = None;
        let mut spent = 0u64;
        for (dt, cost) in steps {
            now = (now + dt).max(0);
            latest = latest.max(now as Micros);
            earliest = earliest.min(now as Micros);
            let cost = cost.min(limit.burst());
            let (v, next) = decide(state, &limit, cost, now as Micros).unwrap();
            if v.allowed {
                if let Some(prev) = state {
                    prop_assert!(next.full_at >= prev.full_at);
                }
                state = Some(next);
                spent += cost;
            } else {
                prop_assert_eq!(Some(next), state);
            }
            prop_assert!(
                u128::from(spent) * u128::from(limit.interval())
                    <= u128::from(limit.tolerance()) + u128::from(latest - earliest)
            );
        }
    }

    /// A rejected request leaves the bucket exactly as it was: the state it
    /// returns is the one it was given (a missing bucket is a full one),
    /// and every later request sees the bucket as if the rejected one had
    /// never come.
    #[test]
    fn denied_request_spends_nothing(
        (limit, events) in arb_limit().prop_flat_map(|l| (Just(l), arb_events(l)))
    ) {
        let mut state = None;
        for &(now, cost) in &events {
            let (v, next) = decide(state, &limit, cost, now).unwrap();
            if v.allowed {
                state = Some(next);
            } else {
                let before = state.unwrap_or_else(|| BucketState::full(&limit, now));
                prop_assert_eq!(next, before);
                prop_assert_eq!(v.remaining, decide(Some(before), &limit, 0, now).unwrap().0.remaining);
                for later in [now, now + 1, now + limit.interval(), now + v.retry_after] {
                    for c in [1, cost] {
                        prop_assert_eq!(
                            decide(Some(next), &limit, c, later).unwrap(),
                            decide(state, &limit, c, later).unwrap()
                        );
                    }
                }
            }
        }
    }
}

/// A limit that allows debt: any of [`arb_limit`]'s with a debt of up to
/// twice its burst (where the floor still fits), or the largest debt the
/// floor allows.
fn arb_debt_limit() -> impl Strategy<Value = Limit> {
    (arb_limit(), 0u64..=2, any::<bool>()).prop_map(|(limit, times, largest)| {
        let fits = MAX_TOLERANCE / limit.interval() - limit.burst();
        let debt = if largest {
            fits
        } else {
            limit.burst().saturating_mul(times).min(fits)
        };
        limit.with_debt(debt).unwrap()
    })
}

/// What a debt property does at one step.
#[derive(Debug, Clone, Copy)]
enum DebtStep {
    /// Decide a cost that needs this much more than it spends.
    Decide { extra_need: u64 },
    /// Charge after the fact.
    Charge,
    /// Refund.
    Refund,
}

fn arb_debt_steps(limit: Limit) -> impl Strategy<Value = Vec<(Micros, DebtStep, u64)>> {
    let max_step = limit.interval().saturating_mul(3);
    let step = prop_oneof![
        4 => (0u64..3).prop_map(|extra_need| DebtStep::Decide { extra_need }),
        3 => Just(DebtStep::Charge),
        1 => Just(DebtStep::Refund),
    ];
    // Amounts from 0 to past burst + debt, and now and then the largest.
    let depth = limit.burst() + limit.debt();
    let amount = prop_oneof![
        8 => 0..=depth.saturating_mul(2).max(1),
        1 => Just(crate::algorithm::MAX_COST),
    ];
    prop::collection::vec((0..=max_step, step, amount), 1..150)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// With debt, on a clock that only moves forward: a charge is applied
    /// exactly once and in full down to the floor (the debt after is
    /// `min(debt + cost × interval, floor)`), the part beyond the floor is
    /// reported as forgiven, to the token; the balance never goes below
    /// `-debt`; a refund never fills the bucket past its capacity; and the
    /// reported debt is the whole tokens below zero.
    #[test]
    fn charges_are_applied_once_in_full_down_to_the_floor(
        (limit, steps) in arb_debt_limit().prop_flat_map(|l| (Just(l), arb_debt_steps(l)))
    ) {
        let (t, i, floor) = (limit.tolerance(), limit.interval(), limit.floor());
        let mut now = T0;
        let mut state: Option<BucketState> = None;
        let debt_of = |s: Option<BucketState>, now: Micros| s.map_or(0, |s| s.full_at.saturating_sub(now));
        for (dt, step, amount) in steps {
            now += dt;
            let before = debt_of(state, now);
            prop_assert!(before <= floor);
            let (v, next) = match step {
                DebtStep::Charge => token_bucket::charge(state, &limit, amount, now),
                DebtStep::Refund => token_bucket::refund(state, &limit, amount, now),
                DebtStep::Decide { extra_need } => {
                    let need = amount.saturating_add(extra_need);
                    match token_bucket::decide_need(state, &limit, amount, need, now) {
                        Ok(decided) => decided,
                        Err(_) => {
                            prop_assert!(need > limit.burst());
                            continue;
                        }
                    }
                }
            };
            let after = next.full_at - now;
            match step {
                DebtStep::Charge => {
                    let want = before.saturating_add(amount.saturating_mul(i)).min(floor);
                    prop_assert_eq!(after, want);
                    prop_assert_eq!(v.forgiven, amount - (want - before).div_ceil(i));
                    prop_assert!(v.allowed);
                }
                DebtStep::Refund => {
                    prop_assert_eq!(after, before.saturating_sub(amount.saturating_mul(i)));
                    prop_assert_eq!(v.forgiven, 0);
                }
                DebtStep::Decide { .. } if v.allowed => {
                    prop_assert_eq!(after, before + amount * i);
                    prop_assert!(after <= t, "an admission never takes the balance below zero");
                }
                DebtStep::Decide { .. } => {
                    prop_assert_eq!(next.full_at, state.map_or(now, |s| s.full_at));
                }
            }
            let shown = if matches!(step, DebtStep::Decide { .. }) && !v.allowed { before } else { after };
            prop_assert_eq!(v.debt, shown.saturating_sub(t).div_ceil(i));
            prop_assert_eq!(v.remaining, t.saturating_sub(shown) / i);
            prop_assert!(after <= floor);
            if !matches!(step, DebtStep::Decide { .. }) || v.allowed {
                state = Some(next);
            }
        }
    }

    /// In debt, `retry_after` is exact: after waiting it the request is
    /// admitted, one microsecond earlier it is not.
    #[test]
    fn retry_after_is_exact_in_debt(
        (limit, steps) in arb_debt_limit().prop_flat_map(|l| (Just(l), arb_debt_steps(l))),
        cost_pick in 0u64..1000,
        ask in any::<bool>(),
    ) {
        let mut now = T0;
        let mut state = None;
        for (dt, step, amount) in steps {
            now += dt;
            state = Some(match step {
                DebtStep::Charge => token_bucket::charge(state, &limit, amount, now).1,
                DebtStep::Refund => token_bucket::refund(state, &limit, amount, now).1,
                DebtStep::Decide { .. } => match decide(state, &limit, amount, now) {
                    Ok((v, next)) if v.allowed => next,
                    _ => continue,
                },
            });
        }
        // An ask (spend nothing, need one token) or a plain request.
        let need = 1 + cost_pick % limit.burst();
        let cost = if ask { 0 } else { need };
        let (v, _) = token_bucket::decide_need(state, &limit, cost, need, now).unwrap();
        if v.allowed {
            prop_assert_eq!(v.retry_after, 0);
        } else {
            let at = |t| token_bucket::decide_need(state, &limit, cost, need, t).unwrap().0.allowed;
            prop_assert!(at(now + v.retry_after));
            prop_assert!(!at(now + v.retry_after - 1));
        }
    }

    /// With debt and a clock that steps back: charges and decisions never
    /// move the full-again instant back (only a refund does), and the
    /// tokens applied stay within `burst + debt + rate × the span of clock
    /// readings seen`.
    #[test]
    fn backwards_clock_creates_nothing_in_debt(
        limit in arb_debt_limit(),
        steps in prop::collection::vec((-5_000_000i64..5_000_000, 0u64..3, 0u64..20), 1..200),
    ) {
        let mut now = T0 as i64;
        let (mut earliest, mut latest) = (T0, T0);
        let mut state: Option<BucketState> = None;
        let mut applied: u128 = 0;
        for (dt, kind, amount) in steps {
            now = (now + dt).max(0);
            let at = now as Micros;
            latest = latest.max(at);
            earliest = earliest.min(at);
            let before_full = state.map_or(at, |s| s.full_at);
            let next = if kind == 0 {
                let (_, next) = token_bucket::charge(state, &limit, amount, at);
                prop_assert!(next.full_at >= before_full);
                next
            } else {
                match decide(state, &limit, amount.min(limit.burst()), at) {
                    Ok((v, next)) if v.allowed => {
                        prop_assert!(next.full_at >= before_full);
                        next
                    }
                    _ => continue,
                }
            };
            // What the step added on top of the debt it found (a full
            // bucket's debt is zero: it starts from now).
            applied += u128::from(next.full_at - before_full.max(at));
            state = Some(next);
            prop_assert!(
                applied <= u128::from(limit.floor()) + u128::from(latest - earliest),
                "applied {} µs of tokens within {} µs", applied, latest - earliest
            );
        }
    }
}
