//! Fair shares of one limit among the members that use it.
//!
//! A share table belongs to one bucket (a rule's): each member (a data
//! plane enforcing part of the limit itself, such as an Envoy subscribed to
//! a quota bucket) reports its demand as a weight and is granted a part of
//! the limit in parts per million. Grants follow the weights, but a grant
//! only grows into what the other members' current grants leave free, so
//! the grants in force never add up to more than the whole limit: when
//! weights move, the shrinking members give their part back at their next
//! report, and the growing ones take it at theirs.
//!
//! A member's entry lives for the time to live it asks with (the time its
//! grant stays in force at the data plane); a member that stops reporting
//! leaves when it expires, and one that leaves on purpose asks with a time
//! to live of zero. Both backends compute [`grant`] the same way: the
//! memory store in Rust, Redis in `lua/shares.lua`, under one table key per
//! bucket so every instance sees every member.

use std::collections::HashMap;

use parking_lot::Mutex;

use super::BucketKey;
use crate::algorithm::Micros;

/// A whole limit, in the parts a grant is counted in.
pub const PPM: u64 = 1_000_000;

/// Most members one table holds; a member arriving at a full table is
/// granted nothing.
pub const MAX_MEMBERS: usize = 256;

/// Largest weight a member may report (a demand of a million requests per
/// second, in thousandths): keeps `weight × PPM` exact in a Lua number.
pub const MAX_WEIGHT: u64 = 1_000_000_000;

/// Most share tables the in-process store holds at once.
pub const MAX_TABLES: usize = 1_000_000;

/// A member's report to a share table.
#[derive(Debug, Clone, Copy)]
pub struct ShareAsk<'a> {
    /// The bucket whose limit is divided.
    pub table: &'a BucketKey,
    /// The member's identity (bounded: the caller hashes what it names).
    pub member: &'a str,
    /// Its demand, 1 to [`MAX_WEIGHT`].
    pub weight: u64,
    /// How long its entry and grant stay counted; 0 leaves the table.
    pub ttl: Micros,
}

/// What a member was granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Share {
    /// Its part of the limit, in parts per million.
    pub ppm: u64,
    /// Members in the table, this one included.
    pub members: u64,
    /// The table was full and the member is not in it.
    pub full: bool,
    /// The grant is short of the member's fair part by more than a tenth:
    /// the others hold the rest until they report. Asking again once they
    /// have (without waiting for this member's next report) grows it.
    pub waiting: bool,
}

/// The grant of a member of weight `weight`, when every member's weights
/// add up to `total` (this one's included) and the others' grants to
/// `others`; `current` is its grant in force, if any.
///
/// The fair part is `weight / total` of the limit, but never more than
/// the others leave free. A grant within a tenth of the fair part stays
/// as it is (when it still fits), so that a steady demand keeps a steady
/// grant: a data plane refills its bucket when its assignment changes.
pub fn grant(current: Option<u64>, weight: u64, total: u64, others: u64) -> u64 {
    let fair = fair(weight, total);
    let room = PPM.saturating_sub(others);
    match current {
        Some(cur) if cur <= room && fair.abs_diff(cur) * 10 <= cur => cur,
        _ => fair.min(room),
    }
}

/// The fair part of a member of weight `weight` among weights adding up
/// to `total`, in parts per million.
pub fn fair(weight: u64, total: u64) -> u64 {
    u64::try_from(u128::from(weight) * u128::from(PPM) / u128::from(total.max(1)))
        .unwrap_or(PPM)
        .min(PPM)
}

/// True when `ppm` is short of `fair` by more than a tenth.
pub fn waiting(ppm: u64, fair: u64) -> bool {
    ppm * 10 < fair * 9
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    weight: u64,
    ppm: u64,
    expires: Micros,
}

/// One table: each member's entry.
type Table = HashMap<Box<str>, Entry>;

/// The in-process share tables: the memory store's, and the local
/// fallback's while Redis is unavailable.
#[derive(Debug)]
pub struct ShareTables {
    tables: Mutex<HashMap<Box<str>, Table>>,
    max_tables: usize,
}

impl Default for ShareTables {
    fn default() -> Self {
        Self::with_max_tables(MAX_TABLES)
    }
}

impl ShareTables {
    /// Tables holding at most `max_tables` limits shared at once.
    pub fn with_max_tables(max_tables: usize) -> Self {
        Self {
            tables: Mutex::default(),
            max_tables,
        }
    }

    /// Applies `ask` at `now` (see the module docs).
    pub fn share(&self, ask: &ShareAsk<'_>, now: Micros) -> Result<Share, super::StoreError> {
        let mut tables = self.tables.lock();
        if !tables.contains_key(ask.table.as_str()) {
            if ask.ttl == 0 {
                return Ok(Share::default());
            }
            if tables.len() >= self.max_tables {
                tables.retain(|_, t| {
                    t.retain(|_, e| e.expires > now);
                    !t.is_empty()
                });
                if tables.len() >= self.max_tables {
                    return Err(super::StoreError::AtCapacity(format!(
                        "the in-memory share tables are full ({} limits shared at once)",
                        self.max_tables
                    )));
                }
            }
        }
        let table = tables.entry(ask.table.as_str().into()).or_default();
        table.retain(|_, e| e.expires > now);
        if ask.ttl == 0 {
            table.remove(ask.member);
            let members = table.len() as u64;
            if table.is_empty() {
                tables.remove(ask.table.as_str());
            }
            return Ok(Share {
                ppm: 0,
                members,
                full: false,
                waiting: false,
            });
        }
        let current = table.get(ask.member).map(|e| e.ppm);
        let (mut total, mut others, mut members) = (ask.weight, 0, 1u64);
        for (m, e) in table.iter() {
            if **m != *ask.member {
                total += e.weight;
                others += e.ppm;
                members += 1;
            }
        }
        if current.is_none() && table.len() >= MAX_MEMBERS {
            return Ok(Share {
                ppm: 0,
                members: members - 1,
                full: true,
                waiting: false,
            });
        }
        let ppm = grant(current, ask.weight, total, others);
        table.insert(
            ask.member.into(),
            Entry {
                weight: ask.weight,
                ppm,
                expires: now.saturating_add(ask.ttl),
            },
        );
        Ok(Share {
            ppm,
            members,
            full: false,
            waiting: waiting(ppm, fair(ask.weight, total)),
        })
    }

    /// Share tables held (for the memory figures).
    pub fn len(&self) -> usize {
        self.tables.lock().len()
    }

    /// True when no table is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops expired members and empty tables.
    pub fn sweep(&self, now: Micros) {
        self.tables.lock().retain(|_, t| {
            t.retain(|_, e| e.expires > now);
            !t.is_empty()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::BucketKind;

    #[test]
    fn a_grant_follows_the_weights_within_what_the_others_leave() {
        // Alone: everything.
        assert_eq!(grant(None, 5, 5, 0), PPM);
        // Half the weight, but the other holds 800 000: only 200 000.
        assert_eq!(grant(None, 5, 10, 800_000), 200_000);
        // Within a tenth of the fair part: kept.
        assert_eq!(grant(Some(460_000), 5, 10, 500_000), 460_000);
        // More than a tenth away: the fair part.
        assert_eq!(grant(Some(400_000), 5, 10, 500_000), 500_000);
        // Kept only while it fits.
        assert_eq!(grant(Some(480_000), 5, 10, 600_000), 400_000);
        // Others holding more than everything (a limit never grows past it).
        assert_eq!(grant(None, 1, 2, 1_200_000), 0);
    }

    #[test]
    fn members_divide_a_limit_and_the_grants_never_add_up_to_more() {
        let tables = ShareTables::default();
        let table = BucketKey::new("acme", BucketKind::TENANT, "", "");
        let ask = |member: &str, weight: u64, ttl: Micros, now: Micros| {
            tables
                .share(
                    &ShareAsk {
                        table: &table,
                        member,
                        weight,
                        ttl,
                    },
                    now,
                )
                .unwrap()
        };
        assert_eq!(ask("a", 100, 10, 0).ppm, PPM);
        // b arrives: a holds everything until it reports again.
        let b = ask("b", 300, 10, 1);
        assert_eq!((b.ppm, b.members, b.waiting), (0, 2, true));
        assert_eq!(ask("a", 100, 10, 2).ppm, 250_000);
        let b = ask("b", 300, 10, 3);
        assert_eq!((b.ppm, b.waiting), (750_000, false));
        // a stops reporting: its entry expires and b takes everything.
        let alone = ask("b", 300, 10, 12);
        assert_eq!((alone.ppm, alone.members), (PPM, 1));
        // A steady weight keeps its grant.
        assert_eq!(ask("b", 290, 10, 13).ppm, PPM);
        // b leaves on purpose: the table is dropped.
        assert_eq!(ask("b", 300, 0, 14).members, 0);
        assert!(tables.is_empty());
    }

    #[test]
    fn at_most_so_many_tables_and_expired_ones_make_room() {
        let tables = ShareTables::with_max_tables(2);
        let ask = |t: &BucketKey, ttl: Micros, now: Micros| {
            tables.share(
                &ShareAsk {
                    table: t,
                    member: "m",
                    weight: 1,
                    ttl,
                },
                now,
            )
        };
        let key = |k: &str| BucketKey::new("acme", BucketKind::KEY, "", k);
        let (a, b, c) = (key("a"), key("b"), key("c"));
        assert_eq!(ask(&a, 10, 0).unwrap().ppm, PPM);
        assert_eq!(ask(&b, 20, 0).unwrap().ppm, PPM);
        // Full of live tables: a third is refused; a known one still works.
        let err = ask(&c, 10, 5).unwrap_err();
        assert!(err.to_string().contains("full (2 limits"), "{err}");
        assert!(ask(&a, 10, 5).is_ok());
        // Leaving an unknown table costs nothing and takes no room.
        assert_eq!(ask(&c, 0, 5).unwrap(), Share::default());
        // a's member expires at 15: its table makes room for c.
        assert_eq!(ask(&c, 10, 15).unwrap().ppm, PPM);
        assert_eq!(tables.len(), 2);
        assert!(!tables.is_empty());
        // Sweeping drops expired members and their tables.
        tables.sweep(22);
        assert_eq!(tables.len(), 1, "b expired at 20; c lives until 25");
        tables.sweep(25);
        assert!(tables.is_empty());
    }

    #[test]
    fn a_full_table_grants_a_newcomer_nothing_and_keeps_its_members() {
        let tables = ShareTables::default();
        let table = BucketKey::new("acme", BucketKind::TENANT, "", "");
        for i in 0..MAX_MEMBERS {
            let share = tables
                .share(
                    &ShareAsk {
                        table: &table,
                        member: &i.to_string(),
                        weight: 1,
                        ttl: 100,
                    },
                    0,
                )
                .unwrap();
            assert!(!share.full);
        }
        let late = ShareAsk {
            table: &table,
            member: "late",
            weight: 1,
            ttl: 100,
        };
        let share = tables.share(&late, 1).unwrap();
        assert_eq!(
            share,
            Share {
                ppm: 0,
                members: MAX_MEMBERS as u64,
                full: true,
                waiting: false,
            }
        );
    }
}
