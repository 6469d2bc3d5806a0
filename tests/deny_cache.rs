//! The local cache of rejected buckets: an exhausted key stops costing Redis
//! anything until its retry-after, and only then is Redis asked again.

use crate::common;

use std::time::Duration;

use common::redis::{RedisServer, evalsha_calls, redis_cli};
use common::{TestServer, ask, micros, req, row};
use tollgate::server::StoreSpec;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_keys_skip_redis_until_their_retry_after() {
    let redis = RedisServer::start();
    for cache in [true, false] {
        redis_cli(redis.port, &["FLUSHALL"]);
        let url = redis.url();
        let server = TestServer::launch(
            Some(&[row("per-key", "", "", "key", 2, "1/second")]),
            move |c| {
                c.store = StoreSpec::Redis(url);
                c.redis_uses_clock = true;
                c.deny_cache = cache;
                // Every answer here is Redis's: a stall of a loaded machine
                // must not turn one into a policy's.
                c.store_timeout = std::time::Duration::from_secs(2);
            },
        )
        .await;
        let mut client = server.client().await;
        assert!(ask(&mut client, req("t", "hot")).await.allowed);
        assert!(ask(&mut client, req("t", "hot")).await.allowed);
        let r = ask(&mut client, req("t", "hot")).await;
        assert!(!r.allowed);
        assert_eq!(micros(&r.retry_after), 1_000_000);

        redis_cli(redis.port, &["CONFIG", "RESETSTAT"]);
        for _ in 0..10 {
            let r = ask(&mut client, req("t", "hot")).await;
            assert!(!r.allowed);
            assert_eq!(micros(&r.retry_after), 1_000_000);
            assert_eq!(r.limit_name, "per-key");
        }
        assert!(
            ask(&mut client, req("t", "other")).await.allowed,
            "other keys are not affected"
        );
        let expected = if cache { 1 } else { 11 };
        assert_eq!(
            evalsha_calls(redis.port),
            expected,
            "Redis calls with the cache {}",
            if cache { "on" } else { "off" }
        );

        // Once the wait is over Redis decides again.
        server.clock.advance(Duration::from_secs(1));
        assert!(ask(&mut client, req("t", "hot")).await.allowed);
        assert_eq!(evalsha_calls(redis.port), expected + 1);
        if cache {
            let (_, metrics) = server.http_get("/metrics").await.unwrap();
            assert_eq!(
                common::envoy::sample(&metrics, "tollgate_deny_cache_hits_total"),
                Some(10),
                "{metrics}"
            );
        }
        server.stop().await;
    }
}
