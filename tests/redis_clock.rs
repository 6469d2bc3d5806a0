//! Decisions on Redis read Redis's clock (`TIME` inside the script), not the
//! instances': two instances whose own clocks disagree by an hour and stand
//! still enforce one bucket exactly, and its refill follows Redis's time;
//! and a Redis whose own clock steps back and forth (a real redis-server
//! with its wall clock shifted) never creates tokens.

use crate::common;

use std::time::Duration;

use common::redis::{RedisServer, ShiftedRedis};
use common::{TestServer, ask, micros, req, row};
use tokio::time::Instant;
use tollgate::clock::Clock;
use tollgate::proto::v1::Degraded;
use tollgate::server::StoreSpec;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_whose_clocks_disagree_still_enforce_one_bucket_on_redis_time() {
    let redis = RedisServer::start();
    let rules = [row("hourly", "t", "", "key", 5, "1/hour")];
    let start = |url: String| {
        TestServer::launch(Some(&rules), move |c| {
            c.store = StoreSpec::Redis(url);
            c.store_timeout = Duration::from_secs(2);
        })
    };
    let a = start(redis.url()).await;
    let b = start(redis.url()).await;
    a.wait_ready().await;
    b.wait_ready().await;
    // B's clock is an hour ahead of A's: by its own clock the bucket would
    // be full again every time it asks. Neither clock moves.
    b.clock.advance(Duration::from_secs(3600));
    let (mut ca, mut cb) = (a.client().await, b.client().await);

    let started = Instant::now();
    let mut admitted = 0;
    let mut last = None;
    for i in 0..12 {
        let client = if i % 2 == 0 { &mut ca } else { &mut cb };
        let r = ask(client, req("t", "k")).await;
        assert_eq!(r.degraded(), Degraded::None);
        admitted += u32::from(r.allowed);
        last = Some(r);
    }
    let elapsed = started.elapsed();
    assert_eq!(admitted, 5, "one bucket of 5 for both instances");
    // The wait is one token's interval on Redis's clock, less the real time
    // that passed since the bucket was first spent (which neither
    // instance's clock saw).
    let last = last.unwrap();
    assert!(!last.allowed);
    let retry = Duration::from_micros(micros(&last.retry_after));
    assert!(retry <= Duration::from_secs(3600), "{retry:?}");
    assert!(
        retry + elapsed >= Duration::from_secs(3600),
        "{retry:?} after {elapsed:?}"
    );
    a.stop().await;
    b.stop().await;
}

/// The value stored for a bucket, `FULL_AT:INTERVAL:BURST`: its full-at
/// instant.
fn full_at(port: u16, key: &str) -> u64 {
    let value = common::redis::redis_cli(port, &["GET", key]);
    value.split(':').next().unwrap().trim().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_clock_that_steps_back_never_creates_tokens() {
    let redis = ShiftedRedis::start();
    let rules = [row("hourly", "t", "", "key", 5, "1/hour")];
    let url = redis.server.url();
    let server = TestServer::launch(Some(&rules), move |c| {
        c.store = StoreSpec::Redis(url);
        c.store_timeout = Duration::from_secs(2);
    })
    .await;
    let mut client = server.client().await;
    let key = "tollgate:{t}:k::k";
    // The burst, spent on Redis's (real) time.
    for left in (0..5).rev() {
        let r = ask(&mut client, req("t", "k")).await;
        assert_eq!(
            (r.allowed, r.remaining, r.degraded()),
            (true, left, Degraded::None)
        );
    }
    let spent = full_at(redis.server.port, key);
    let refused = ask(&mut client, req("t", "k")).await;
    assert!(!refused.allowed);
    let wait = micros(&refused.retry_after);
    assert!(wait > 3_590_000_000 && wait <= 3_600_000_000, "{wait}");

    // Redis's clock steps back two hours. The bucket does not refill: the
    // wait grows by the two hours, and nothing is written.
    redis.shift(-7_200_000_000);
    let r = ask(&mut client, req("t", "k")).await;
    assert!(!r.allowed);
    assert!(
        micros(&r.retry_after) > 3 * 3_590_000_000,
        "{:?}",
        r.retry_after
    );
    // Usage charged after the fact with the clock back: seen from two hours
    // back, the bucket is already past its floor (zero: the rule allows no
    // debt), so the charge is forgiven whole and the full-at instant stays
    // where it was.
    let c = client
        .charge(tollgate::proto::v1::ChargeRequest {
            key: "k".into(),
            cost: 3,
            tenant: "t".into(),
            resource: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(c.forgiven, 3);
    assert_eq!(full_at(redis.server.port, key), spent, "never moved back");

    // Forward again, one hour past the real time: exactly one token has
    // refilled since the burst was spent, so one request passes and the
    // next waits; the step back created nothing.
    redis.shift(3_600_000_000);
    // The first call after the step reaches Redis past its deadline as the
    // old clock reckoned it; it applies nothing, the clock is learnt again
    // from its reply and the call is asked again, so Redis still answers.
    let r = ask(&mut client, req("t", "k")).await;
    assert_eq!(r.degraded(), Degraded::None, "{r:?}");
    assert!(r.allowed, "{r:?}");
    assert_eq!(r.remaining, 0);
    let r = ask(&mut client, req("t", "k")).await;
    assert!(!r.allowed);
    // Redis's clock really is an hour ahead: what the decisions read.
    let ahead = redis.time() as i64 - tollgate::clock::SystemClock.now() as i64;
    assert!((3_599_000_000..3_601_000_000).contains(&ahead), "{ahead}");
}
