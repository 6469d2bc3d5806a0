//! The quota journal on Redis: a list per hash tag beside the counters
//! (`PREFIX{TAG}:qj::`), appended by the decision script in the step that
//! writes the counter (see [`crate::store::journal`]).
//!
//! A script call that appended reports how many lines it did; the journal
//! it wrote to is then pending here until the ledger asks. Journals left
//! by an instance that died before its ledger recorded them are found by
//! a sweep: `SCAN` over every primary for keys ending `:qj::`.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{RedisStore, Shared};
use crate::store::journal::{Entry, Journal, JournalFuture, QuotaCount};
use crate::store::{BucketKey, StoreError};

/// The journals script calls reported appending to, since the ledger last
/// asked.
#[derive(Default)]
pub(super) struct Pending {
    journals: Mutex<HashSet<String>>,
    notify: Notify,
}

/// Keys one `SCAN` step looks at.
const SCAN_COUNT: usize = 1_000;

/// The journal key beside a call's first key (`PREFIX{TAG}:…`): the call's
/// keys share its slot, so the script may append to it.
pub(super) fn journal_of(first_key: &str) -> Option<String> {
    let close = first_key.find('}')?;
    let mut key = String::with_capacity(close + 6);
    key.push_str(&first_key[..=close]);
    key.push_str(":qj::");
    Some(key)
}

impl Pending {
    /// A call appended `lines` to `journal`.
    pub(super) fn appended(&self, journal: &str, lines: i64) {
        if lines > 0 {
            self.journals.lock().insert(journal.to_owned());
            self.notify.notify_one();
        }
    }
}

impl Shared {
    /// The counter a Redis key names (`PREFIX{TENANT[/SPREAD]}:tag:…`).
    fn bucket_of(&self, key: &str) -> Option<BucketKey> {
        let rest = key.strip_prefix(self.config.prefix.as_str())?;
        let rest = rest.strip_prefix('{')?;
        let close = rest.find('}')?;
        let tag = &rest[..close];
        let tenant = tag.split('/').next().unwrap_or_default();
        let tenant = if tenant == "@default" { "" } else { tenant };
        let name = rest.get(close + 2..)?;
        BucketKey::parse(&format!("{tenant}:{name}"))
    }

    /// Every journal key on every primary, by `SCAN`.
    async fn sweep(&self) -> Result<Vec<String>, StoreError> {
        let deadline = || Instant::now() + self.config.timeout;
        let map = self.routes.map();
        let mut nodes: Vec<_> = map.primaries.iter().map(|(n, ..)| n.clone()).collect();
        if nodes.is_empty() {
            nodes.push(self.routes.route(0, deadline()).await?);
        }
        let pattern = format!("{}{{*}}:qj::", glob_escaped(&self.config.prefix));
        let mut found = Vec::new();
        for node in nodes {
            let mut cursor = 0u64;
            loop {
                let reply = node
                    .query(
                        redis::cmd("SCAN")
                            .arg(cursor)
                            .arg("MATCH")
                            .arg(&pattern)
                            .arg("COUNT")
                            .arg(SCAN_COUNT),
                        deadline(),
                    )
                    .await?;
                let (next, keys): (u64, Vec<String>) = redis::from_redis_value(reply)
                    .map_err(|e| StoreError::Protocol(format!("Redis answered SCAN with {e}")))?;
                found.extend(keys);
                cursor = next;
                if cursor == 0 {
                    break;
                }
            }
        }
        Ok(found)
    }
}

/// `s` with the glob characters of `SCAN MATCH` escaped.
fn glob_escaped(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

impl Journal for RedisStore {
    fn pending(&self, sweep: bool) -> JournalFuture<'_, Vec<String>> {
        Box::pin(async move {
            let mut journals: HashSet<String> =
                std::mem::take(&mut *self.shared.pending.journals.lock());
            if sweep {
                journals.extend(self.shared.sweep().await?);
            }
            Ok(journals.into_iter().collect())
        })
    }

    fn read<'a>(&'a self, journal: &'a str, max: usize) -> JournalFuture<'a, Vec<Option<Entry>>> {
        Box::pin(async move {
            let last = max.max(1) as i64 - 1;
            let lines: Vec<String> = self
                .shared
                .exec_as(
                    "journal",
                    journal,
                    redis::cmd("LRANGE").arg(journal).arg(0).arg(last),
                )
                .await?;
            Ok(lines
                .iter()
                .map(|line| Entry::parse(line, |key| self.shared.bucket_of(key)))
                .collect())
        })
    }

    fn trim<'a>(&'a self, journal: &'a str, n: usize) -> JournalFuture<'a, ()> {
        Box::pin(async move {
            let () = self
                .shared
                .exec_as(
                    "journal",
                    journal,
                    redis::cmd("LTRIM").arg(journal).arg(n).arg(-1),
                )
                .await?;
            Ok(())
        })
    }

    fn count<'a>(&'a self, bucket: &'a BucketKey) -> JournalFuture<'a, Option<QuotaCount>> {
        Box::pin(async move {
            let key = self.shared.redis_key(bucket);
            let value: Option<String> = self
                .shared
                .exec_as("journal", &key, redis::cmd("GET").arg(&key))
                .await?;
            Ok(value.and_then(|v| {
                let mut parts = v.strip_prefix("q:")?.split(':');
                Some(QuotaCount {
                    start: parts.next()?.parse().ok()?,
                    count: parts.next()?.parse().ok()?,
                })
            }))
        })
    }

    fn notified(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            let pending = &self.shared.pending;
            let notified = pending.notify.notified();
            if pending.journals.lock().is_empty() {
                notified.await;
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_journal_lives_under_its_calls_hash_tag() {
        assert_eq!(
            journal_of("tollgate:{acme}:kq:exports:alice").as_deref(),
            Some("tollgate:{acme}:qj::")
        );
        assert_eq!(
            journal_of("p:{acme/0000002a}:kq::k").as_deref(),
            Some("p:{acme/0000002a}:qj::")
        );
        assert_eq!(glob_escaped("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
    }
}
