//! The in-process store's quota journal: one bounded queue of
//! [`Entry`]s, appended under the stripe locks of the decision that
//! caused each (see [`crate::store::journal`]).

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use tokio::sync::Notify;

use super::MemoryStore;
use crate::algorithm::window::quota_end;
use crate::algorithm::{Charge, State};
use crate::store::BucketKey;
use crate::store::journal::{
    Closed, Crossing, Entry, Journal, JournalFuture, QuotaCount, QuotaEvent,
};

/// Most events the queue holds. A ledger that cannot write (its database
/// down) for long enough to fill it loses the newest events, counted in
/// [`MemoryJournal::dropped`]: a million is a million counters turning
/// their period while nothing could be recorded.
pub const MAX_EVENTS: usize = 1_000_000;

/// The name of the one journal [`Journal::pending`] reports.
const NAME: &str = "memory";

#[derive(Default)]
pub(super) struct MemoryJournal {
    events: Mutex<VecDeque<Entry>>,
    notify: Notify,
    dropped: AtomicU64,
}

impl MemoryJournal {
    /// Notes the write of `new` over `old` into a quota counter, when it
    /// enters a period `old` did not hold.
    pub(super) fn note(
        &self,
        bucket: &BucketKey,
        charge: &Charge,
        old: Option<&State>,
        new: &State,
    ) {
        if charge.limit.period().is_none() {
            return;
        }
        let State::Window(new) = new else { return };
        let old = match old {
            Some(State::Window(old)) => Some(old),
            _ => None,
        };
        let (start, end, quota) = (new.start, quota_end(*new), charge.limit.burst());
        let mut entries: Vec<Entry> = Vec::new();
        let before = match old {
            Some(old) if old.start == new.start => old.count,
            Some(old) if old.start > new.start => return,
            _ => 0,
        };
        if old.is_none_or(|old| old.start < new.start) {
            entries.push(Entry::Opened(QuotaEvent {
                bucket: bucket.clone(),
                start,
                end,
                quota,
                previous: old.map(|old| Closed {
                    start: old.start,
                    end: quota_end(*old),
                    count: old.count,
                }),
            }));
        }
        for percent in charge.limit.alerts().crossed(quota, before, new.count) {
            entries.push(Entry::Crossed(Crossing {
                bucket: bucket.clone(),
                start,
                end,
                quota,
                percent,
                used: new.count,
            }));
        }
        if entries.is_empty() {
            return;
        }
        let mut events = self.events.lock();
        for entry in entries {
            if events.len() >= MAX_EVENTS {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            } else {
                events.push_back(entry);
            }
        }
        drop(events);
        self.notify.notify_one();
    }

    /// Events lost to a full queue.
    pub(super) fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

impl MemoryStore {
    fn journal_or_none(&self) -> Option<&MemoryJournal> {
        self.journal.as_deref()
    }
}

impl Journal for MemoryStore {
    fn pending(&self, _sweep: bool) -> JournalFuture<'_, Vec<String>> {
        let waiting = self
            .journal_or_none()
            .is_some_and(|j| !j.events.lock().is_empty());
        Box::pin(std::future::ready(Ok(if waiting {
            vec![NAME.to_owned()]
        } else {
            Vec::new()
        })))
    }

    fn read<'a>(&'a self, _journal: &'a str, max: usize) -> JournalFuture<'a, Vec<Option<Entry>>> {
        let events = self.journal_or_none().map_or_else(Vec::new, |j| {
            j.events
                .lock()
                .iter()
                .take(max)
                .cloned()
                .map(Some)
                .collect()
        });
        Box::pin(std::future::ready(Ok(events)))
    }

    fn trim<'a>(&'a self, _journal: &'a str, n: usize) -> JournalFuture<'a, ()> {
        if let Some(j) = self.journal_or_none() {
            let mut events = j.events.lock();
            let n = n.min(events.len());
            events.drain(..n);
        }
        Box::pin(std::future::ready(Ok(())))
    }

    fn count<'a>(&'a self, bucket: &'a BucketKey) -> JournalFuture<'a, Option<QuotaCount>> {
        let count = match self.state(bucket) {
            Some(State::Window(w)) if !State::Window(w).is_idle(self.now()) => Some(QuotaCount {
                start: w.start,
                count: w.count,
            }),
            _ => None,
        };
        Box::pin(std::future::ready(Ok(count)))
    }

    fn notified(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            match self.journal_or_none() {
                Some(j) => {
                    let notified = j.notify.notified();
                    if j.events.lock().is_empty() {
                        notified.await;
                    }
                }
                None => std::future::pending().await,
            }
        })
    }
}
