//! What every option shares: the value parsers of durations, ratios and
//! fractions, and [`defaults`], which makes a group of options' `Default`
//! the values its declaration gives (each option is declared once, as a
//! field with its flag, environment variable, default and help; see
//! `tollgate serve`'s groups in [`crate::server::ServeConfig`]).

use std::time::Duration;

/// The options of group `T` as an empty command line leaves them: each
/// field's declared default (environment variables are not read).
pub fn defaults<T: clap::Args + clap::FromArgMatches>() -> T {
    let command = T::augment_args(clap::Command::new("defaults"))
        .mut_args(|arg| arg.env(None::<&'static str>));
    let parsed = command
        .try_get_matches_from(["defaults"])
        .and_then(|matches| T::from_arg_matches(&matches));
    match parsed {
        Ok(options) => options,
        // Only a declaration whose default its own parser refuses gets here;
        // `tests::every_group_has_defaults` parses each group.
        Err(err) => panic!("an option's declared default does not parse: {err}"),
    }
}

/// A duration as the flags take it (`250ms`, `10s`), for declaring a
/// default kept as a [`Duration`] constant.
pub fn text(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis())
    }
}

/// Parses a ratio in [0, 1].
pub fn parse_ratio(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(format!("{s:?} must be a number from 0 to 1")),
    }
}

/// Parses a fraction in (0, 1].
pub fn parse_fraction(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
        _ => Err(format!(
            "{s:?} must be a number greater than 0 and at most 1"
        )),
    }
}

/// Parses `1s`, `250ms`, `2m`, `1h`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    parse_duration_or_zero(s).and_then(|d| {
        if d.is_zero() {
            Err(format!("{s:?} must be more than zero"))
        } else {
            Ok(d)
        }
    })
}

/// As [`parse_duration`], where zero means "never" (`0s`).
pub fn parse_duration_or_zero(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("{s:?} must look like 500ms, 1s, 2m or 1h"))?;
    Ok(match unit {
        "ms" => Duration::from_millis(n),
        "s" | "" => Duration::from_secs(n),
        "m" => Duration::from_secs(n * 60),
        "h" => Duration::from_secs(n * 3600),
        _ => return Err(format!("{s:?}: unit must be ms, s, m or h")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_written_by_text_parse_back() {
        for d in [
            Duration::from_millis(100),
            Duration::from_secs(1),
            Duration::from_millis(1500),
            Duration::ZERO,
        ] {
            assert_eq!(parse_duration_or_zero(&text(d)), Ok(d), "{}", text(d));
        }
    }
}
