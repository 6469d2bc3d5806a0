//! Calendar periods: where a quota's day, week, month or year starts and
//! ends on a tenant's billing cycle, in the tenant's time zone.
//!
//! A period starts at midnight, local time, of its anchor day: every day
//! for `day`; the cycle's weekday for `week`; the cycle's day of the month
//! for `month` (31 means the last day of shorter months, so a cycle
//! anchored on the 31st turns on 30 April and 28 or 29 February); the
//! cycle's day of its month for `year` (29 February means 28 February in
//! other years). A period ends where the next one starts, so periods follow
//! one another without a gap or an overlap, and a local day is 23 or 25
//! hours long across a daylight-saving change. Where a midnight does not
//! exist (a zone whose clocks jump at midnight), the period starts at the
//! first instant of that day.
//!
//! ```
//! use tollgate_core::algorithm::calendar::{Cycle, Period};
//!
//! // Billed on the 15th, in New York.
//! let cycle = Cycle::new("America/New_York", 15, 1, "monday").unwrap();
//! // 2026-03-20T12:00:00Z is in the period that began at midnight on
//! // 15 March (EDT, UTC-4) and ends at midnight on 15 April.
//! let bounds = cycle.bounds(Period::Month, 1_774_008_000_000_000);
//! assert_eq!(bounds.start, 1_773_547_200_000_000); // 2026-03-15T04:00:00Z
//! assert_eq!(bounds.end, 1_776_225_600_000_000); // 2026-04-15T04:00:00Z
//! ```

use std::fmt;

use jiff::civil::{Date, Weekday};
use jiff::tz::TimeZone;
use jiff::{Timestamp, ToSpan};

use super::Micros;

/// How long a quota's period is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Period {
    /// From one local midnight to the next.
    Day,
    /// Seven days from the cycle's weekday.
    Week,
    /// From the cycle's day of one month to that day of the next.
    Month,
    /// From the cycle's day and month of one year to the next.
    Year,
}

impl Period {
    /// As written in configuration.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Day => "day",
            Self::Week => "week",
            Self::Month => "month",
            Self::Year => "year",
        }
    }

    /// Parses `day`, `week`, `month` or `year`.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "day" => Self::Day,
            "week" => Self::Week,
            "month" => Self::Month,
            "year" => Self::Year,
            _ => return None,
        })
    }
}

impl fmt::Display for Period {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One period: `[start, end)` in microseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bounds {
    /// The first instant of the period.
    pub start: Micros,
    /// The first instant of the next period.
    pub end: Micros,
}

/// A tenant's billing cycle: the time zone its periods follow and the day
/// they turn on.
#[derive(Debug, Clone)]
pub struct Cycle {
    name: Box<str>,
    zone: TimeZone,
    day: i8,
    month: i8,
    weekday: Weekday,
}

impl PartialEq for Cycle {
    fn eq(&self, other: &Self) -> bool {
        (&self.name, self.day, self.month, self.weekday)
            == (&other.name, other.day, other.month, other.weekday)
    }
}

impl Eq for Cycle {}

impl std::hash::Hash for Cycle {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (
            &self.name,
            self.day,
            self.month,
            self.weekday.to_monday_zero_offset(),
        )
            .hash(state);
    }
}

impl Default for Cycle {
    /// Calendar periods in UTC: months from the 1st, years from 1 January,
    /// weeks from Monday.
    fn default() -> Self {
        Self {
            name: "UTC".into(),
            zone: TimeZone::UTC,
            day: 1,
            month: 1,
            weekday: Weekday::Monday,
        }
    }
}

const WEEKDAYS: [(&str, Weekday); 7] = [
    ("monday", Weekday::Monday),
    ("tuesday", Weekday::Tuesday),
    ("wednesday", Weekday::Wednesday),
    ("thursday", Weekday::Thursday),
    ("friday", Weekday::Friday),
    ("saturday", Weekday::Saturday),
    ("sunday", Weekday::Sunday),
];

impl Cycle {
    /// A cycle in IANA time zone `zone`, turning on day `day` (1 to 31) of
    /// the month, on `month` (1 to 12) for yearly periods, and on `weekday`
    /// (`monday` to `sunday`) for weekly ones. The error says what to fix.
    pub fn new(zone: &str, day: u8, month: u8, weekday: &str) -> Result<Self, String> {
        if !(1..=31).contains(&day) {
            return Err(format!(
                "anchor day {day}: use 1 to 31 (31 means the last day of shorter months)"
            ));
        }
        if !(1..=12).contains(&month) {
            return Err(format!(
                "anchor month {month}: use 1 (January) to 12 (December)"
            ));
        }
        let weekday = WEEKDAYS
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(weekday))
            .map(|(_, w)| *w)
            .ok_or_else(|| {
                format!(
                    "anchor weekday {:?}: use monday, tuesday, wednesday, thursday, friday, \
                     saturday or sunday",
                    clip(weekday)
                )
            })?;
        let tz = TimeZone::get(zone).map_err(|_| {
            format!(
                "time zone {:?} is not an IANA time zone name; use one such as \
                 America/New_York, Europe/Berlin or UTC",
                clip(zone)
            )
        })?;
        Ok(Self {
            name: zone.into(),
            zone: tz,
            day: day as i8,
            month: month as i8,
            weekday,
        })
    }

    /// The time zone's name, as given.
    pub fn zone(&self) -> &str {
        &self.name
    }

    /// The anchor day of the month.
    pub fn day(&self) -> u8 {
        self.day as u8
    }

    /// The anchor month of yearly periods.
    pub fn month(&self) -> u8 {
        self.month as u8
    }

    /// The anchor weekday of weekly periods, lower case.
    pub fn weekday(&self) -> &'static str {
        WEEKDAYS
            .iter()
            .find(|(_, w)| *w == self.weekday)
            .map_or("monday", |(name, _)| name)
    }

    /// The `period` that holds instant `now`.
    pub fn bounds(&self, period: Period, now: Micros) -> Bounds {
        let now_ts = Timestamp::from_microsecond(now.min(MAX_INSTANT) as i64)
            .unwrap_or(Timestamp::UNIX_EPOCH);
        let today = now_ts.to_zoned(self.zone.clone()).date();
        let (start, end) = match period {
            Period::Day => (today, today.tomorrow().unwrap_or(today)),
            Period::Week => {
                let back = (today.weekday().to_monday_zero_offset()
                    - self.weekday.to_monday_zero_offset())
                .rem_euclid(7);
                let start = today.checked_sub(i64::from(back).days()).unwrap_or(today);
                (start, start.checked_add(7.days()).unwrap_or(start))
            }
            Period::Month => {
                let (y, m) = (today.year(), today.month());
                let this = self.in_month(y, m);
                let start = if today >= this {
                    this
                } else {
                    let (py, pm) = if m == 1 { (y - 1, 12) } else { (y, m - 1) };
                    self.in_month(py, pm)
                };
                let (ny, nm) = if start.month() == 12 {
                    (start.year() + 1, 1)
                } else {
                    (start.year(), start.month() + 1)
                };
                (start, self.in_month(ny, nm))
            }
            Period::Year => {
                let this = self.in_month(today.year(), self.month);
                let start = if today >= this {
                    this
                } else {
                    self.in_month(today.year() - 1, self.month)
                };
                (start, self.in_month(start.year() + 1, self.month))
            }
        };
        Bounds {
            start: self.midnight(start),
            end: self.midnight(end),
        }
    }

    /// The anchor day in month `m` of year `y`, moved back to the month's
    /// last day where the month is shorter.
    fn in_month(&self, y: i16, m: i8) -> Date {
        let first = Date::new(y, m, 1).unwrap_or_default();
        Date::new(y, m, self.day.min(first.days_in_month())).unwrap_or(first)
    }

    /// The first instant of `date` in the cycle's zone.
    fn midnight(&self, date: Date) -> Micros {
        date.to_zoned(self.zone.clone())
            .map(|z| z.timestamp().as_microsecond().max(0) as Micros)
            .unwrap_or(0)
    }
}

/// An instant (µs since the Unix epoch) in RFC 3339, UTC, to the second:
/// `2026-03-15T04:00:00Z`.
pub fn rfc3339(micros: Micros) -> String {
    Timestamp::from_second((micros / 1_000_000).min(MAX_INSTANT / 1_000_000) as i64)
        .map(|t| t.to_string())
        .unwrap_or_default()
}

/// An RFC 3339 instant (`2026-03-01T00:00:00Z`) in µs since the Unix
/// epoch; an error that says what is wrong with `s` otherwise.
pub fn parse_rfc3339(s: &str) -> Result<Micros, String> {
    let t: Timestamp = s
        .parse()
        .map_err(|e| format!("{:?} is not an RFC 3339 instant: {e}", clip(s)))?;
    Micros::try_from(t.as_microsecond())
        .map_err(|_| format!("{:?} is before 1970-01-01T00:00:00Z", clip(s)))
}

/// At most the first 64 bytes of `s` (on a character boundary), for
/// messages that quote what a caller wrote.
fn clip(s: &str) -> &str {
    let end = (0..=s.len().min(64))
        .rev()
        .find(|&i| s.is_char_boundary(i))
        .unwrap_or(0);
    &s[..end]
}

/// Instants are kept below 2^53 µs (see [`super::MAX_TOLERANCE`]): the year
/// 2255.
const MAX_INSTANT: Micros = 1 << 53;

impl fmt::Display for Cycle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}, day {}, month {}, {}",
            self.name,
            self.day,
            self.month,
            self.weekday()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Microseconds of an RFC 3339 instant.
    fn at(s: &str) -> Micros {
        s.parse::<Timestamp>().unwrap().as_microsecond() as Micros
    }

    fn bounds(cycle: &Cycle, period: Period, now: &str) -> (String, String) {
        let b = cycle.bounds(period, at(now));
        let show = |m: Micros| {
            Timestamp::from_microsecond(m as i64)
                .unwrap()
                .to_zoned(cycle.zone.clone())
                .to_string()
        };
        (show(b.start), show(b.end))
    }

    fn pair(a: &str, b: &str) -> (String, String) {
        (a.into(), b.into())
    }

    #[test]
    fn days_follow_local_midnights_and_last_23_or_25_hours_across_dst() {
        let ny = Cycle::new("America/New_York", 1, 1, "monday").unwrap();
        // 8 March 2026: clocks go from 02:00 to 03:00.
        let b = ny.bounds(Period::Day, at("2026-03-08T12:00:00Z"));
        assert_eq!(b.end - b.start, 23 * 3_600_000_000);
        assert_eq!(
            bounds(&ny, Period::Day, "2026-03-08T12:00:00Z"),
            pair(
                "2026-03-08T00:00:00-05:00[America/New_York]",
                "2026-03-09T00:00:00-04:00[America/New_York]"
            )
        );
        // 1 November 2026: 02:00 comes back to 01:00.
        let b = ny.bounds(Period::Day, at("2026-11-01T12:00:00Z"));
        assert_eq!(b.end - b.start, 25 * 3_600_000_000);
        // The instant of midnight is the new day's; a microsecond before, the old one's.
        let midnight = at("2026-03-09T04:00:00Z");
        assert_eq!(ny.bounds(Period::Day, midnight).start, midnight);
        assert_eq!(ny.bounds(Period::Day, midnight - 1).end, midnight);
    }

    #[test]
    fn months_turn_on_the_anchor_day_and_31_means_the_last_day() {
        let ny = Cycle::new("America/New_York", 15, 1, "monday").unwrap();
        // 14 March 23:00 in New York is still February's period.
        assert_eq!(
            bounds(&ny, Period::Month, "2026-03-15T03:00:00Z"),
            pair(
                "2026-02-15T00:00:00-05:00[America/New_York]",
                "2026-03-15T00:00:00-04:00[America/New_York]"
            )
        );
        assert_eq!(
            bounds(&ny, Period::Month, "2026-03-15T04:00:00Z"),
            pair(
                "2026-03-15T00:00:00-04:00[America/New_York]",
                "2026-04-15T00:00:00-04:00[America/New_York]"
            )
        );
        let last = Cycle::new("UTC", 31, 1, "monday").unwrap();
        assert_eq!(
            bounds(&last, Period::Month, "2026-02-10T00:00:00Z"),
            pair(
                "2026-01-31T00:00:00+00:00[UTC]",
                "2026-02-28T00:00:00+00:00[UTC]"
            )
        );
        assert_eq!(
            bounds(&last, Period::Month, "2026-02-28T00:00:00Z"),
            pair(
                "2026-02-28T00:00:00+00:00[UTC]",
                "2026-03-31T00:00:00+00:00[UTC]"
            )
        );
        // A leap year's February ends on the 29th.
        assert_eq!(
            bounds(&last, Period::Month, "2028-02-29T12:00:00Z"),
            pair(
                "2028-02-29T00:00:00+00:00[UTC]",
                "2028-03-31T00:00:00+00:00[UTC]"
            )
        );
        // Across the year's end.
        assert_eq!(
            bounds(&ny, Period::Month, "2027-01-03T00:00:00Z"),
            pair(
                "2026-12-15T00:00:00-05:00[America/New_York]",
                "2027-01-15T00:00:00-05:00[America/New_York]"
            )
        );
    }

    #[test]
    fn weeks_turn_on_the_anchor_weekday() {
        let berlin = Cycle::new("Europe/Berlin", 1, 1, "Wednesday").unwrap();
        // Wednesday 2026-12-02 00:30 in Berlin (23:30 UTC the day before).
        assert_eq!(
            bounds(&berlin, Period::Week, "2026-12-01T23:30:00Z"),
            pair(
                "2026-12-02T00:00:00+01:00[Europe/Berlin]",
                "2026-12-09T00:00:00+01:00[Europe/Berlin]"
            )
        );
        assert_eq!(
            bounds(&berlin, Period::Week, "2026-12-01T22:30:00Z"),
            pair(
                "2026-11-25T00:00:00+01:00[Europe/Berlin]",
                "2026-12-02T00:00:00+01:00[Europe/Berlin]"
            )
        );
        // The week with the spring change is an hour short.
        let b = berlin.bounds(Period::Week, at("2026-03-30T12:00:00Z"));
        assert_eq!(b.end - b.start, (7 * 24 - 1) * 3_600_000_000);
    }

    #[test]
    fn years_turn_on_the_anchor_day_and_month_and_29_february_elsewhere_is_the_28th() {
        let leap = Cycle::new("UTC", 29, 2, "monday").unwrap();
        assert_eq!(
            bounds(&leap, Period::Year, "2027-06-01T00:00:00Z"),
            pair(
                "2027-02-28T00:00:00+00:00[UTC]",
                "2028-02-29T00:00:00+00:00[UTC]"
            )
        );
        assert_eq!(
            bounds(&leap, Period::Year, "2028-02-28T23:59:59Z"),
            pair(
                "2027-02-28T00:00:00+00:00[UTC]",
                "2028-02-29T00:00:00+00:00[UTC]"
            )
        );
        assert_eq!(
            bounds(&Cycle::default(), Period::Year, "2026-12-03T00:00:00Z"),
            pair(
                "2026-01-01T00:00:00+00:00[UTC]",
                "2027-01-01T00:00:00+00:00[UTC]"
            )
        );
    }

    /// A zone whose clocks jumped at midnight: the day starts at 01:00.
    #[test]
    fn a_day_without_a_midnight_starts_at_its_first_instant() {
        // Chile: 2026-09-06, 00:00 became 01:00.
        let santiago = Cycle::new("America/Santiago", 1, 1, "monday").unwrap();
        assert_eq!(
            bounds(&santiago, Period::Day, "2026-09-06T12:00:00Z"),
            pair(
                "2026-09-06T01:00:00-03:00[America/Santiago]",
                "2026-09-07T00:00:00-03:00[America/Santiago]"
            )
        );
    }

    #[test]
    fn periods_follow_one_another_without_gaps() {
        let cycles = [
            Cycle::new("America/New_York", 31, 2, "sunday").unwrap(),
            Cycle::new("Australia/Lord_Howe", 29, 2, "friday").unwrap(),
            Cycle::new("Asia/Kathmandu", 1, 12, "monday").unwrap(),
        ];
        for cycle in &cycles {
            for period in [Period::Day, Period::Week, Period::Month, Period::Year] {
                let mut b = cycle.bounds(period, at("2026-01-01T00:00:00Z"));
                for _ in 0..60 {
                    assert!(b.start < b.end);
                    let next = cycle.bounds(period, b.end);
                    assert_eq!(next.start, b.end, "{cycle} {period}");
                    assert_eq!(cycle.bounds(period, b.end - 1), b, "{cycle} {period}");
                    b = next;
                }
            }
        }
    }

    #[test]
    fn instants_print_in_rfc_3339() {
        assert_eq!(rfc3339(at("2026-03-15T04:00:00Z")), "2026-03-15T04:00:00Z");
        assert_eq!(
            rfc3339(at("2026-03-15T04:00:00.999999Z")),
            "2026-03-15T04:00:00Z"
        );
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
    }

    #[test]
    fn bad_cycles_say_what_to_fix() {
        let err = |z: &str, d, m, w: &str| Cycle::new(z, d, m, w).unwrap_err();
        assert_eq!(
            err("UTC", 0, 1, "monday"),
            "anchor day 0: use 1 to 31 (31 means the last day of shorter months)"
        );
        assert_eq!(
            err("UTC", 32, 1, "monday"),
            "anchor day 32: use 1 to 31 (31 means the last day of shorter months)"
        );
        assert_eq!(
            err("UTC", 1, 13, "monday"),
            "anchor month 13: use 1 (January) to 12 (December)"
        );
        assert!(err("UTC", 1, 1, "someday").starts_with("anchor weekday \"someday\""));
        assert_eq!(
            err("Mars/Olympus_Mons", 1, 1, "monday"),
            "time zone \"Mars/Olympus_Mons\" is not an IANA time zone name; use one such as \
             America/New_York, Europe/Berlin or UTC"
        );
        assert!(Cycle::new("UTC", 1, 1, "monday").is_ok());
        assert!(Cycle::new("UTC", 31, 12, "SUNDAY").is_ok());
    }
}
