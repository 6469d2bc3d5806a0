//! The quota journal: what a store tells the usage ledger about quota
//! periods, written in the same atomic step as the decision that caused it.
//!
//! A decision that writes a quota counter into a period it did not hold
//! before (the counter's first use, or its first use after a boundary)
//! appends one [`QuotaEvent`]: the new period, and the final count of the
//! period it replaced. A decision whose count reaches one of the quota's
//! alert thresholds ([`crate::algorithm::alerts`]) appends a [`Crossing`]. The ledger (`tollgate_engine::ledger`) records
//! events in the limits database and trims them only afterwards, so an
//! instance that dies between the decision and the write loses nothing:
//! the events wait in the store for any instance to record them.
//!
//! Redis keeps each hash tag's events in a list beside its counters
//! (`PREFIX{TAG}:qj::`, written by `lua/token_bucket.lua`); the in-process
//! store keeps one queue. Both write events as the same line:
//!
//! ```text
//! o START END QUOTA PREVIOUS_START PREVIOUS_END PREVIOUS_COUNT NAME
//! a START END QUOTA PERCENT USED NAME
//! ```
//!
//! in µs since the Unix epoch, the previous period's fields 0 when the
//! counter held no earlier period, and `NAME` the counter's name in that
//! store (last: a key may hold spaces).

use std::future::Future;
use std::pin::Pin;

use super::{BucketKey, StoreError};
use crate::algorithm::Micros;

/// A future of a journal operation.
pub type JournalFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// A quota counter entered a new period.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaEvent {
    /// The counter.
    pub bucket: BucketKey,
    /// The first instant of the period it entered.
    pub start: Micros,
    /// The next period's first instant.
    pub end: Micros,
    /// The quota per period when it was entered.
    pub quota: u64,
    /// The period it held before, with that period's final count.
    pub previous: Option<Closed>,
}

/// A decision's count reached one of its quota's alert thresholds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Crossing {
    /// The counter.
    pub bucket: BucketKey,
    /// The first instant of the period it counts in.
    pub start: Micros,
    /// The next period's first instant.
    pub end: Micros,
    /// The quota per period.
    pub quota: u64,
    /// The threshold reached, in percent of the quota.
    pub percent: u16,
    /// The count the decision left.
    pub used: u64,
}

impl Crossing {
    /// The crossing as a journal line, the counter named `name`.
    pub fn line(&self, name: &str) -> String {
        format!(
            "a {} {} {} {} {} {name}",
            self.start, self.end, self.quota, self.percent, self.used
        )
    }
}

/// One journal entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// A counter entered a period.
    Opened(QuotaEvent),
    /// A count reached an alert threshold.
    Crossed(Crossing),
}

impl Entry {
    /// Reads a journal line; `bucket_of` turns the store's name for the
    /// counter back into its key. `None`: not a line this build writes.
    pub fn parse(line: &str, bucket_of: impl FnOnce(&str) -> Option<BucketKey>) -> Option<Self> {
        if line.starts_with("o ") {
            return QuotaEvent::parse(line, bucket_of).map(Self::Opened);
        }
        let mut parts = line.strip_prefix("a ")?.splitn(6, ' ');
        let mut number = || parts.next()?.parse::<u64>().ok();
        let (start, end, quota, percent, used) =
            (number()?, number()?, number()?, number()?, number()?);
        let bucket = bucket_of(parts.next()?)?;
        let percent = u16::try_from(percent).ok()?;
        (start < end && percent > 0).then_some(Self::Crossed(Crossing {
            bucket,
            start,
            end,
            quota,
            percent,
            used,
        }))
    }
}

/// A period a counter left, and what it counted there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Closed {
    /// The period's first instant.
    pub start: Micros,
    /// The next period's first instant.
    pub end: Micros,
    /// Tokens counted in it, final.
    pub count: u64,
}

impl QuotaEvent {
    /// The event as a journal line, the counter named `name`.
    pub fn line(&self, name: &str) -> String {
        let p = self.previous.unwrap_or(Closed {
            start: 0,
            end: 0,
            count: 0,
        });
        format!(
            "o {} {} {} {} {} {} {name}",
            self.start, self.end, self.quota, p.start, p.end, p.count
        )
    }

    /// Reads a journal line; `bucket_of` turns the store's name for the
    /// counter back into its key. `None`: not a line this build writes.
    pub fn parse(line: &str, bucket_of: impl FnOnce(&str) -> Option<BucketKey>) -> Option<Self> {
        let mut parts = line.splitn(8, ' ');
        if parts.next()? != "o" {
            return None;
        }
        let mut number = || parts.next()?.parse::<u64>().ok();
        let (start, end, quota) = (number()?, number()?, number()?);
        let previous = Closed {
            start: number()?,
            end: number()?,
            count: number()?,
        };
        let bucket = bucket_of(parts.next()?)?;
        (start < end && (previous.start == 0 || previous.start < previous.end)).then_some(Self {
            bucket,
            start,
            end,
            quota,
            previous: (previous.start > 0).then_some(previous),
        })
    }
}

/// What a quota counter holds: the period it counts in and its count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaCount {
    /// The period's first instant.
    pub start: Micros,
    /// Tokens counted in it.
    pub count: u64,
}

/// A store's quota journal.
pub trait Journal: Send + Sync {
    /// The journals that may hold events: those decisions reported events
    /// in since the last call and, with `sweep`, every journal the store
    /// holds (for events left by an instance that died before recording
    /// them; on Redis a scan of the keyspace).
    fn pending(&self, sweep: bool) -> JournalFuture<'_, Vec<String>>;

    /// Up to `max` of the oldest entries of `journal`, parsed (`None` for
    /// an entry this build cannot read), oldest first.
    fn read<'a>(&'a self, journal: &'a str, max: usize) -> JournalFuture<'a, Vec<Option<Entry>>>;

    /// Drops the `n` oldest entries of `journal`, once recorded.
    fn trim<'a>(&'a self, journal: &'a str, n: usize) -> JournalFuture<'a, ()>;

    /// What the quota counter `bucket` holds now; `None` when it holds
    /// nothing (never written, or expired).
    fn count<'a>(&'a self, bucket: &'a BucketKey) -> JournalFuture<'a, Option<QuotaCount>>;

    /// Resolves once a decision reported events after the last
    /// [`Journal::pending`] (at once if one did).
    fn notified(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::BucketKind;

    fn bucket() -> BucketKey {
        BucketKey::new(
            "acme",
            BucketKind::Quota {
                per_key: true,
                shadow: false,
            },
            "exports",
            "a key with spaces",
        )
    }

    #[test]
    fn a_line_reads_back_as_the_event_it_was() {
        let event = QuotaEvent {
            bucket: bucket(),
            start: 1_000,
            end: 2_000,
            quota: 50,
            previous: Some(Closed {
                start: 500,
                end: 1000,
                count: 49,
            }),
        };
        let line = event.line(bucket().as_str());
        assert_eq!(
            line,
            "o 1000 2000 50 500 1000 49 acme:kq:exports:a key with spaces"
        );
        assert_eq!(QuotaEvent::parse(&line, BucketKey::parse), Some(event));
        let first = "o 1000 2000 50 0 0 0 acme:kq:exports:k";
        let parsed = QuotaEvent::parse(first, BucketKey::parse).unwrap();
        assert_eq!(parsed.previous, None);
        assert_eq!(parsed.bucket.key(), "k");
    }

    #[test]
    fn a_crossing_reads_back_as_it_was() {
        let crossing = Crossing {
            bucket: bucket(),
            start: 1_000,
            end: 2_000,
            quota: 50,
            percent: 80,
            used: 41,
        };
        let line = crossing.line(bucket().as_str());
        assert_eq!(
            line,
            "a 1000 2000 50 80 41 acme:kq:exports:a key with spaces"
        );
        assert_eq!(
            Entry::parse(&line, BucketKey::parse),
            Some(Entry::Crossed(crossing))
        );
    }

    #[test]
    fn lines_this_build_never_writes_are_not_read() {
        for line in [
            "",
            "x 1 2 3 0 0 0 acme:kq::k",
            "o 1 2 3 0 0 acme:kq::k",
            "o 2 1 3 0 0 0 acme:kq::k",
            "o 3 4 3 2 1 0 acme:kq::k",
            "o 2 2 3 0 0 0 acme:kq::k",
            "o 3 4 3 2 2 0 acme:kq::k",
            "a 2 2 3 80 5 acme:kq::k",
            "o a 2 3 0 0 0 acme:kq::k",
            "o 1 2 3 0 0 0 acme:k::k",
            "o 1 2 3 0 0 0",
            "a 1 2 3 0 5 acme:kq::k",
            "a 1 2 3 80 acme:kq::k",
            "a 2 1 3 80 5 acme:kq::k",
        ] {
            assert_eq!(Entry::parse(line, BucketKey::parse), None, "{line:?}");
        }
    }
}
