//! Measuring a bucket's refill from outside, on a machine whose speed the
//! test does not know: empty the bucket until it refuses, wait, empty it
//! again. Between the two refusals the bucket gained one token per
//! interval and the second drain admitted exactly those, less what the
//! bucket held at each refusal (under one token). No refill is lost to a
//! full bucket as long as the wait refills fewer tokens than the burst.
//!
//! The span the store saw lies between (first refusal answered, last
//! request sent) and (first refusal sent, last request answered), both
//! read on the test's clock, so the bounds hold however slow the machine.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// What one [`measure`] saw.
#[derive(Debug)]
pub struct Refill {
    /// Admitted by the second drain.
    pub admitted: u64,
    /// µs the store certainly saw between the two refusals.
    pub inner: u64,
    /// µs the store at most saw between them.
    pub outer: u64,
}

/// Drains with `ask(i)` until a refusal, waits `wait`, drains again.
/// `ask` answers `Some(admitted)` for a decision the store made, `None`
/// for one it did not (a store call that missed its timeout while this
/// machine stalled, answered by policy): the measurement then starts over,
/// up to five times. Panics after 10,000 admissions in a row.
pub async fn measure<F, Fut>(mut ask: F, wait: Duration) -> Refill
where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = Option<bool>>,
{
    let mut n = 0usize;
    // (admitted, when the refusal was sent, when it was answered), or
    // None when an answer did not come from the store.
    let mut drain = async || {
        for admitted in 0..10_000u64 {
            let sent = Instant::now();
            n += 1;
            match ask(n).await {
                Some(true) => {}
                Some(false) => return Some((admitted, sent, Instant::now())),
                None => return None,
            }
        }
        panic!("10,000 admissions in a row: the bucket never emptied");
    };
    for _ in 0..5 {
        let Some((_, first_sent, first_answered)) = drain().await else {
            continue;
        };
        tokio::time::sleep(wait).await;
        let Some((admitted, last_sent, last_answered)) = drain().await else {
            continue;
        };
        let span =
            |from: Instant, to: Instant| to.saturating_duration_since(from).as_micros() as u64;
        return Refill {
            admitted,
            inner: span(first_answered, last_sent),
            outer: span(first_sent, last_answered),
        };
    }
    panic!("five measurements in a row met an answer the store did not make");
}

impl Refill {
    /// Asserts one token per `interval` µs, within `slack` tokens: at
    /// least the refills of `inner` (at most `burst` of them: a stall
    /// longer than the burst's refill fills the bucket), at most those of
    /// `outer`.
    pub fn assert_rate(&self, interval: u64, burst: u64, slack: u64) {
        let least = (self.inner / interval).min(burst).saturating_sub(slack);
        let most = self.outer.div_ceil(interval) + slack;
        eprintln!(
            "refilled {}; bounds [{least}, {most}] over {}..{} µs",
            self.admitted, self.inner, self.outer
        );
        assert!(
            (least..=most).contains(&self.admitted),
            "{} refills between two refusals {}..{} µs apart, expected [{least}, {most}] \
             at one per {interval} µs",
            self.admitted,
            self.inner,
            self.outer
        );
    }
}
