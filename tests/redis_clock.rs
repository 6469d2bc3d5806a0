//! Decisions on Redis read Redis's clock (`TIME` inside the script), not the
//! instances': two instances whose own clocks disagree by an hour and stand
//! still enforce one bucket exactly, and its refill follows Redis's time.

mod common;

use std::time::Duration;

use common::redis::RedisServer;
use common::{TestServer, ask, micros, req, row};
use tokio::time::Instant;
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
