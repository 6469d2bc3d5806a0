//! Store call durations in process, for the status page's percentiles
//! (Prometheus has its own histogram; this one needs no scrape).
//!
//! Log-linear buckets of microseconds: exact below 16 us, then eight per
//! power of two (at most 12.5 % wide). Recording is one atomic add;
//! [`Latency::snapshot`] copies the counts, and percentiles are read from
//! the difference of two snapshots.

use std::sync::atomic::{AtomicU64, Ordering};

/// Buckets: 16 exact, then 8 per power of two from 2^4 to 2^40 us.
pub const BUCKETS: usize = 16 + 37 * 8;

/// A histogram of durations in microseconds.
pub struct Latency {
    counts: [AtomicU64; BUCKETS],
}

impl Default for Latency {
    fn default() -> Self {
        Self::new()
    }
}

fn bucket(us: u64) -> usize {
    if us < 16 {
        return us as usize;
    }
    let e = 63 - us.leading_zeros() as usize; // 4..
    let sub = ((us >> (e - 3)) & 7) as usize;
    (16 + (e - 4) * 8 + sub).min(BUCKETS - 1)
}

/// The smallest duration bucket `i` holds.
fn lower(i: usize) -> u64 {
    if i < 16 {
        return i as u64;
    }
    let e = (i - 16) / 8 + 4;
    let sub = ((i - 16) % 8) as u64;
    (1 << e) + (sub << (e - 3))
}

impl Latency {
    /// An empty histogram.
    pub const fn new() -> Self {
        Self {
            counts: [const { AtomicU64::new(0) }; BUCKETS],
        }
    }

    /// Counts one duration.
    pub fn record(&self, us: u64) {
        self.counts[bucket(us)].fetch_add(1, Ordering::Relaxed);
    }

    /// The counts now.
    pub fn snapshot(&self) -> Vec<u64> {
        self.counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }
}

/// The `q` quantiles (0..=1) of what was counted between `before` and
/// `after` (two snapshots), in microseconds (each a bucket's lower bound:
/// within 12.5 % below the true value); `None` when nothing was.
pub fn quantiles(before: &[u64], after: &[u64], qs: &[f64]) -> Option<Vec<u64>> {
    let delta: Vec<u64> = after
        .iter()
        .zip(before.iter().chain(std::iter::repeat(&0)))
        .map(|(a, b)| a.saturating_sub(*b))
        .collect();
    let total: u64 = delta.iter().sum();
    if total == 0 {
        return None;
    }
    Some(
        qs.iter()
            .map(|q| {
                let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
                let mut seen = 0;
                for (i, n) in delta.iter().enumerate() {
                    seen += n;
                    if seen >= rank {
                        return lower(i);
                    }
                }
                lower(BUCKETS - 1)
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_exact_then_within_an_eighth() {
        for us in [0, 1, 15, 16, 17, 100, 1_000, 123_456, 10_000_000] {
            let low = lower(bucket(us));
            assert!(low <= us && us - low <= us / 8, "{us} -> {low}");
        }
        assert_eq!(bucket(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn quantiles_read_the_difference_of_two_snapshots() {
        let h = Latency::new();
        for _ in 0..1_000 {
            h.record(5_000);
        }
        let before = h.snapshot();
        for us in 1..=100 {
            h.record(us * 10);
        }
        let after = h.snapshot();
        let q = quantiles(&before, &after, &[0.5, 0.9, 0.99]).unwrap();
        assert_eq!(
            q,
            vec![lower(bucket(500)), lower(bucket(900)), lower(bucket(990))]
        );
        assert_eq!(q[0], 480);
        assert_eq!(quantiles(&after, &after, &[0.5]), None);
    }
}
