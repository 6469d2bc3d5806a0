//! The most recent decisions per key, in bounded memory, for the explain
//! view.
//!
//! Keys hash into [`SLOTS`] slots of [`PER_SLOT`] entries each (a few MB in
//! all, whatever the traffic). Every decision that was not admitted
//! (rejected, shadow-rejected, degraded) is recorded; admitted ones are
//! sampled: a slot records at most one every [`ALLOWED_EVERY`] and counts
//! the ones it skipped, so a busy key's history still shows its refusals,
//! and one hostile key can only push out the history of the keys that
//! share its slot. An entry names its key by a 64-bit hash of the tenant
//! and the key, so reading a key's history costs one slot's lock and
//! [`PER_SLOT`] comparisons.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::clock::Micros;
use crate::telemetry::metrics::Outcome;

/// Slots keys hash into (a power of two).
pub const SLOTS: usize = 4096;
/// Entries kept per slot.
pub const PER_SLOT: usize = 16;
/// A slot records at most one admitted decision per this many
/// microseconds.
pub const ALLOWED_EVERY: Micros = 100_000;
/// Longest rule name kept in an entry, in bytes.
const MAX_RULE_BYTES: usize = 64;

/// One decision as recorded.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RecentDecision {
    /// When it was decided (the engine's clock, microseconds).
    pub at: Micros,
    /// Its outcome label (`allowed`, `rejected`, ...).
    pub outcome: &'static str,
    /// The rule that decided ('' when none applied).
    pub rule: String,
    /// The tokens asked for.
    pub cost: u64,
}

#[derive(Debug, Clone)]
struct Entry {
    hash: u64,
    at: Micros,
    outcome: Outcome,
    rule: Box<str>,
    cost: u64,
}

#[derive(Debug, Default)]
struct Slot {
    /// Oldest first, at most [`PER_SLOT`].
    entries: std::collections::VecDeque<Entry>,
    /// Admitted decisions not recorded, by key hash, since the oldest
    /// entry of that key (reset when the key's history is read empty).
    skipped: Vec<(u64, u64)>,
}

/// The ring of recent decisions.
pub struct Recent {
    slots: Box<[Mutex<Slot>]>,
    /// When each slot last recorded an admitted decision.
    last_allowed: Box<[AtomicU64]>,
    hasher: foldhash::fast::FixedState,
}

impl Default for Recent {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Recent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recent").finish_non_exhaustive()
    }
}

/// What is recorded of one key.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct History {
    /// Newest first.
    pub decisions: Vec<RecentDecision>,
    /// Admitted decisions of the key sampled out (not in `decisions`).
    pub not_shown: u64,
}

impl Recent {
    /// An empty ring.
    pub fn new() -> Self {
        Self {
            slots: (0..SLOTS).map(|_| Mutex::new(Slot::default())).collect(),
            last_allowed: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            hasher: foldhash::fast::FixedState::with_seed(0x7011_6a7e),
        }
    }

    fn hash(&self, tenant: &str, key: &str) -> u64 {
        let mut h = self.hasher.build_hasher();
        h.write(tenant.as_bytes());
        h.write_u8(0xff);
        h.write(key.as_bytes());
        h.finish()
    }

    /// Records a decision of `tenant`'s `key` at `at` (admitted ones
    /// sampled).
    pub fn record(
        &self,
        tenant: &str,
        key: &str,
        at: Micros,
        outcome: Outcome,
        rule: &str,
        cost: u64,
    ) {
        let hash = self.hash(tenant, key);
        let n = (hash as usize) & (SLOTS - 1);
        if outcome == Outcome::Allowed {
            let last = self.last_allowed[n].load(Ordering::Relaxed);
            if at < last.saturating_add(ALLOWED_EVERY)
                || self.last_allowed[n]
                    .compare_exchange(last, at, Ordering::Relaxed, Ordering::Relaxed)
                    .is_err()
            {
                let mut slot = self.slots[n].lock();
                let skipped = &mut slot.skipped;
                match skipped.iter().position(|(h, _)| *h == hash) {
                    Some(i) => skipped[i].1 += 1,
                    None if skipped.len() < PER_SLOT => skipped.push((hash, 1)),
                    None => {}
                }
                return;
            }
        }
        let mut end = rule.len().min(MAX_RULE_BYTES);
        while !rule.is_char_boundary(end) {
            end -= 1;
        }
        let mut slot = self.slots[n].lock();
        if slot.entries.len() == PER_SLOT
            && let Some(gone) = slot.entries.pop_front()
            && !slot.entries.iter().any(|e| e.hash == gone.hash)
        {
            // The key's oldest entry left: what was skipped before it is
            // no longer "between the entries shown".
            slot.skipped.retain(|(h, _)| *h != gone.hash);
        }
        slot.entries.push_back(Entry {
            hash,
            at,
            outcome,
            rule: rule[..end].into(),
            cost,
        });
    }

    /// The recorded decisions of `tenant`'s `key`, newest first.
    pub fn of(&self, tenant: &str, key: &str) -> History {
        let hash = self.hash(tenant, key);
        let slot = self.slots[(hash as usize) & (SLOTS - 1)].lock();
        History {
            decisions: slot
                .entries
                .iter()
                .rev()
                .filter(|e| e.hash == hash)
                .map(|e| RecentDecision {
                    at: e.at,
                    outcome: e.outcome.label(),
                    rule: e.rule.to_string(),
                    cost: e.cost,
                })
                .collect(),
            not_shown: slot
                .skipped
                .iter()
                .find(|(h, _)| *h == hash)
                .map_or(0, |(_, n)| *n),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_all_kept_and_admissions_sampled_per_slot() {
        let recent = Recent::new();
        // Ten admissions within 100 ms: the first is recorded, nine skipped.
        for i in 0..10 {
            recent.record(
                "acme",
                "alice",
                1_000_000 + i * 1_000,
                Outcome::Allowed,
                "per-key",
                1,
            );
        }
        recent.record("acme", "alice", 1_050_000, Outcome::Rejected, "per-key", 3);
        // Exactly 100 ms after the last one kept: kept.
        recent.record("acme", "alice", 1_100_000, Outcome::Allowed, "per-key", 2);
        let h = recent.of("acme", "alice");
        let got: Vec<_> = h
            .decisions
            .iter()
            .map(|d| (d.at, d.outcome, d.cost))
            .collect();
        assert_eq!(
            got,
            vec![
                (1_100_000, "allowed", 2),
                (1_050_000, "rejected", 3),
                (1_000_000, "allowed", 1)
            ]
        );
        assert_eq!(h.not_shown, 9);
        assert_eq!(h.decisions[1].rule, "per-key");
        // Another key of the same tenant, and the same key of another
        // tenant, have histories of their own.
        assert_eq!(recent.of("acme", "bob"), History::default());
        assert_eq!(recent.of("other", "alice"), History::default());
    }

    #[test]
    fn a_slot_holds_at_most_its_entries_and_keeps_the_newest() {
        let recent = Recent::new();
        for i in 0..(PER_SLOT as u64 + 5) {
            recent.record("t", "k", i, Outcome::Rejected, &"r".repeat(500), i);
        }
        let h = recent.of("t", "k");
        assert_eq!(h.decisions.len(), PER_SLOT);
        assert_eq!(h.decisions[0].cost, PER_SLOT as u64 + 4);
        assert_eq!(h.decisions[PER_SLOT - 1].cost, 5);
        assert_eq!(h.decisions[0].rule.len(), MAX_RULE_BYTES);
    }

    /// `n` keys of tenant "t" that hash to one slot.
    fn colliding(recent: &Recent, n: usize) -> Vec<String> {
        let slot = |k: &str| (recent.hash("t", k) as usize) & (SLOTS - 1);
        let target = slot("k0");
        (0..)
            .map(|i| format!("k{i}"))
            .filter(|k| slot(k) == target)
            .take(n)
            .collect()
    }

    #[test]
    fn a_rule_name_is_cut_at_a_character_boundary() {
        let recent = Recent::new();
        // Byte 64 falls inside an "é": the name is cut before it.
        let rule = format!("a{}", "é".repeat(40));
        recent.record("t", "k", 1, Outcome::Rejected, &rule, 1);
        let kept = &recent.of("t", "k").decisions[0].rule;
        assert_eq!(kept, &format!("a{}", "é".repeat(31)));
    }

    #[test]
    fn a_keys_skipped_count_leaves_with_its_last_entry() {
        let recent = Recent::new();
        let keys = colliding(&recent, 2);
        let (a, b) = (&keys[0], &keys[1]);
        recent.record("t", a, 1_000_000, Outcome::Allowed, "r", 1);
        for i in 1..=3 {
            recent.record("t", a, 1_000_000 + i, Outcome::Allowed, "r", 1);
        }
        assert_eq!(recent.of("t", a).not_shown, 3);
        // B's refusals fill the slot: A's only entry leaves, and with it
        // the count of what was skipped before it; B's own count stays.
        recent.record("t", b, 1_000_010, Outcome::Allowed, "r", 1);
        for i in 0..PER_SLOT as u64 {
            recent.record("t", b, 1_000_100 + i, Outcome::Rejected, "r", 1);
        }
        assert_eq!(recent.of("t", a), History::default());
        let hb = recent.of("t", b);
        assert_eq!((hb.decisions.len(), hb.not_shown), (PER_SLOT, 1));
    }

    #[test]
    fn a_slot_counts_skips_for_at_most_its_entries_keys() {
        let recent = Recent::new();
        let keys = colliding(&recent, PER_SLOT + 2);
        // The first admission in the slot is kept; every later one within
        // 100 ms is skipped, for PER_SLOT keys at most.
        recent.record("t", &keys[0], 1_000_000, Outcome::Allowed, "r", 1);
        for k in &keys[1..] {
            recent.record("t", k, 1_000_001, Outcome::Allowed, "r", 1);
        }
        let counted: Vec<u64> = keys[1..]
            .iter()
            .map(|k| recent.of("t", k).not_shown)
            .collect();
        assert_eq!(counted[..PER_SLOT], [1; PER_SLOT]);
        assert_eq!(counted[PER_SLOT], 0);
    }
}
