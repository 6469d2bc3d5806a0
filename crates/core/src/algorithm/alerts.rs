//! A quota's alert thresholds: whole percentages of its count per period
//! (`50,80,100`). The decision whose count reaches a threshold's level
//! (`⌈count × percent / 100⌉`) detects it, in the same atomic step as the
//! decision (`crate::store::journal`); each threshold fires once per
//! counter per period.

use std::fmt;
use std::str::FromStr;

/// At most this many thresholds per quota.
pub const MAX_ALERTS: usize = 6;
/// The highest threshold: 999 % (a quota whose debt lets usage run past
/// it may alert at 150 % or 200 %).
pub const MAX_PERCENT: u16 = 999;

/// Up to [`MAX_ALERTS`] thresholds, ascending, each 1 to [`MAX_PERCENT`],
/// packed in ten bits apiece (0: none), so a limit stays `Copy` and small.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Alerts(u64);

impl Alerts {
    /// No thresholds.
    pub const NONE: Self = Self(0);

    /// The thresholds `percents`, in any order; duplicates count once.
    pub fn new(percents: &[u16]) -> Result<Self, String> {
        let mut sorted = percents.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if let Some(&p) = sorted.iter().find(|&&p| p == 0 || p > MAX_PERCENT) {
            return Err(out_of_range(u32::from(p)));
        }
        if sorted.len() > MAX_ALERTS {
            return Err(format!(
                "{} alert thresholds given; a quota has at most {MAX_ALERTS}",
                sorted.len()
            ));
        }
        let packed = sorted
            .iter()
            .enumerate()
            .fold(0, |acc, (i, &p)| acc | (u64::from(p) << (10 * i)));
        Ok(Self(packed))
    }

    /// The thresholds, ascending.
    pub fn iter(self) -> impl Iterator<Item = u16> {
        (0..MAX_ALERTS)
            .map(move |i| ((self.0 >> (10 * i)) & 0x3ff) as u16)
            .take_while(|&p| p > 0)
    }

    /// True without thresholds.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The count at which `percent` of `quota` is reached: ⌈quota ×
    /// percent / 100⌉, computed as the decision script does (exact in a
    /// double for every quota a limit allows).
    pub fn level(quota: u64, percent: u16) -> u64 {
        let p = u64::from(percent);
        (quota / 100) * p + ((quota % 100) * p).div_ceil(100)
    }

    /// The thresholds a count that went from `before` to `after` reached.
    pub fn crossed(self, quota: u64, before: u64, after: u64) -> impl Iterator<Item = u16> {
        self.iter().filter(move |&p| {
            let level = Self::level(quota, p);
            before < level && level <= after
        })
    }

    /// As the decision script reads them: `50.80.100`.
    pub fn script_field(self) -> String {
        let parts: Vec<String> = self.iter().map(|p| p.to_string()).collect();
        parts.join(".")
    }
}

fn out_of_range(p: u32) -> String {
    format!(
        "alert threshold {p} % is out of range; thresholds are whole percentages of the quota \
         from 1 to {MAX_PERCENT}"
    )
}

impl FromStr for Alerts {
    type Err = String;

    /// `50,80,100` (spaces allowed; `%` signs too); empty for none.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut percents = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let digits = part.trim_end_matches('%').trim();
            let p: u32 = digits.parse().map_err(|_| {
                format!(
                    "alert threshold {part:?} is not a whole percentage; write them as \
                     50,80,100"
                )
            })?;
            if p == 0 || p > u32::from(MAX_PERCENT) {
                return Err(out_of_range(p));
            }
            percents.push(p as u16);
        }
        Self::new(&percents)
    }
}

impl fmt::Display for Alerts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.iter().map(|p| p.to_string()).collect();
        f.write_str(&parts.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thresholds_read_sorted_once_each_and_print_back() {
        let a: Alerts = "100, 50,80%,50".parse().unwrap();
        assert_eq!(a.iter().collect::<Vec<_>>(), [50, 80, 100]);
        assert_eq!(a.to_string(), "50,80,100");
        assert_eq!(a.script_field(), "50.80.100");
        assert_eq!("".parse::<Alerts>().unwrap(), Alerts::NONE);
        assert!(Alerts::NONE.is_empty() && !a.is_empty());
        let all: Alerts = "1,2,3,997,998,999".parse().unwrap();
        assert_eq!(all.iter().collect::<Vec<_>>(), [1, 2, 3, 997, 998, 999]);
    }

    #[test]
    fn thresholds_out_of_range_are_refused_saying_why() {
        for (s, says) in [
            ("0", "0 % is out of range"),
            ("1000", "1000 % is out of range"),
            ("80,100000", "100000 % is out of range"),
            ("eighty", "\"eighty\" is not a whole percentage"),
            ("-5", "\"-5\" is not a whole percentage"),
            ("10,20,30,40,50,60,70", "7 alert thresholds given"),
        ] {
            let err = s.parse::<Alerts>().unwrap_err();
            assert!(err.contains(says), "{s}: {err}");
        }
    }

    #[test]
    fn a_threshold_fires_on_the_count_that_reaches_its_level() {
        let a: Alerts = "50,80,100".parse().unwrap();
        // Levels of a quota of 7: 4 (3.5 up), 6 (5.6 up), 7.
        assert_eq!(Alerts::level(7, 50), 4);
        assert_eq!(Alerts::level(7, 80), 6);
        assert_eq!(Alerts::level(1_000_001, 150), 1_500_002);
        assert_eq!(a.crossed(7, 3, 4).collect::<Vec<_>>(), [50]);
        assert_eq!(a.crossed(7, 0, 7).collect::<Vec<_>>(), [50, 80, 100]);
        assert_eq!(a.crossed(7, 4, 5).count(), 0);
        assert_eq!(a.crossed(7, 6, 9).collect::<Vec<_>>(), [100]);
        assert_eq!(a.crossed(7, 7, 9).count(), 0);
    }
}
