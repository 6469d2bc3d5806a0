//! envoyproxy/ratelimit's YAML configuration, loaded unchanged.
//!
//! ```yaml
//! domain: edge
//! descriptors:
//!   - key: remote_address            # no value: one counter per address
//!     rate_limit: { unit: minute, requests_per_unit: 60 }
//!   - key: path
//!     value: "/api/*"                # wildcard, '*' anywhere in the value
//!     share_threshold: true          # all matching paths share one counter
//!     rate_limit: { unit: second, requests_per_unit: 100 }
//!     descriptors:                   # nested: (path, user) pairs
//!       - key: user
//!         rate_limit: { unit: second, requests_per_unit: 5 }
//! ```
//!
//! Matching follows envoyproxy/ratelimit: a request descriptor's entries are
//! walked level by level; at each level an exact `key`+`value` entry wins,
//! then a wildcard value, then a value-less `key`. The limit applies only
//! when the last entry lands on a node with a `rate_limit`. Validation gives
//! the same messages, prefixed with the file name.
//!
//! Tollgate adds, inside `rate_limit`: `algorithm` (`fixed_window`, the
//! default here as in envoyproxy/ratelimit; `token_bucket`;
//! `sliding_window`), `burst` (token bucket capacity, default
//! `requests_per_unit`), `on_store_unavailable` (`allow`, `deny`,
//! `local`; default `allow`) and `debt` (how many tokens below zero usage
//! charged after the stream may take the bucket; default 0). `algorithm:
//! quota` counts `requests_per_unit` per calendar `day`, `week`, `month`
//! or `year` (where envoyproxy/ratelimit's `unit: month` is a fixed window
//! of its own), on the billing cycle `time_zone` (IANA, default `UTC`),
//! `cycle_day`, `cycle_month` and `cycle_weekday` give it (see
//! docs/limits.md, Quotas). `refunds: true` lets Envoy give tokens back
//! (descriptors with `is_negative_hits`); at the top of a file it is every
//! rule's default there.

use std::collections::HashMap;
use std::sync::Arc;

use yaml_rust2::{Yaml, YamlLoader};

use crate::algorithm::calendar::{Bounds, Cycle, Period};
use crate::algorithm::{Algorithm, Limit, Rate, RateUnit};
use crate::limits::OnStoreUnavailable;

const VALID_KEYS: &[&str] = &[
    "domain",
    "key",
    "value",
    "descriptors",
    "rate_limit",
    "unit",
    "requests_per_unit",
    "unlimited",
    "shadow_mode",
    "name",
    "replaces",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    // Tollgate's additions.
    "algorithm",
    "burst",
    "on_store_unavailable",
    "debt",
    "time_zone",
    "cycle_day",
    "cycle_month",
    "cycle_weekday",
    "refunds",
];

/// A configuration error, `FILE: what is wrong`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}: {message}")]
pub struct ConfigError {
    /// The file.
    pub file: String,
    /// What is wrong (envoyproxy/ratelimit's wording where it has one).
    pub message: String,
}

/// What a matched rule does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleKind {
    /// `unlimited: true`: never over limit.
    Unlimited,
    /// `requests_per_unit: 0`: always over limit.
    Block,
    /// A real limit.
    Limited(Limit),
}

/// One `rate_limit` of the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvoyRule {
    /// `domain.key_value.key…`: where the rule sits.
    pub full_key: String,
    /// `rate_limit.name`; empty when unnamed.
    pub name: String,
    /// Names of rules this one replaces when both match one request.
    pub replaces: Vec<String>,
    /// What it does.
    pub kind: RuleKind,
    /// As configured, for the response's `current_limit`.
    pub requests_per_unit: u32,
    /// As configured.
    pub unit: RateUnit,
    /// Never reports over limit; only counts.
    pub shadow: bool,
    /// `detailed_metric`: metrics per descriptor value.
    pub detailed_metric: bool,
    /// Behaviour when the shared store is down.
    pub on_store_unavailable: OnStoreUnavailable,
    /// `algorithm: quota`: the calendar period and the billing cycle its
    /// periods follow.
    pub calendar: Option<(Period, Arc<Cycle>)>,
    /// `refunds`: descriptors with `is_negative_hits` give tokens back to
    /// this rule's buckets.
    pub refunds: bool,
}

#[derive(Debug, Default)]
struct Node {
    /// Children by (key, value).
    exact: HashMap<(String, String), Node>,
    /// Children by key, with a wildcard value pattern; in file order.
    wildcards: Vec<(String, String, bool, Node)>,
    /// Children by key alone (value-less: one counter per value).
    any_value: HashMap<String, Node>,
    rule: Option<Arc<EnvoyRule>>,
}

/// A matched rule and the name of its counter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Match {
    /// The rule.
    pub rule: Arc<EnvoyRule>,
    /// The counter: the request's entries (`key_value.key_value`), with a
    /// shared wildcard's pattern in place of the value.
    pub counter: String,
    /// The limit came with the request (a descriptor's limit override), not
    /// from the configuration: its bucket is apart from the rule's.
    pub overridden: bool,
}

/// A loaded configuration: every domain of every file.
#[derive(Debug, Default)]
pub struct EnvoyConfig {
    domains: HashMap<String, Node>,
    rules: usize,
}

impl EnvoyConfig {
    /// Loads `(file name, contents)` pairs. Any error rejects all of them.
    pub fn load(files: &[(String, String)]) -> Result<Self, ConfigError> {
        let mut config = Self::default();
        for (file, text) in files {
            config.load_file(file, text)?;
        }
        Ok(config)
    }

    /// Number of domains.
    pub fn domains(&self) -> usize {
        self.domains.len()
    }

    /// True when `domain` is configured.
    pub fn has_domain(&self, domain: &str) -> bool {
        self.domains.contains_key(domain)
    }

    /// Number of `rate_limit`s.
    pub fn rules(&self) -> usize {
        self.rules
    }

    /// Loads documents already parsed (an xDS snapshot's resources, made
    /// into the YAML they stand for), with the files' validation and
    /// semantics. `name` stands for the file in errors.
    pub fn load_documents(documents: &[(String, Yaml)]) -> Result<Self, ConfigError> {
        let mut config = Self::default();
        for (name, root) in documents {
            config.load_document(name, root)?;
        }
        Ok(config)
    }

    fn load_file(&mut self, file: &str, text: &str) -> Result<(), ConfigError> {
        let docs = YamlLoader::load_from_str(text).map_err(|e| ConfigError {
            file: file.to_owned(),
            message: format!("error loading config file: {e}"),
        })?;
        let root = docs.into_iter().next().unwrap_or(Yaml::Null);
        self.load_document(file, &root)
    }

    fn load_document(&mut self, file: &str, root: &Yaml) -> Result<(), ConfigError> {
        let err = |message: String| ConfigError {
            file: file.to_owned(),
            message,
        };
        if let Yaml::Hash(_) = root {
            validate_keys(root).map_err(err)?;
        } else if !matches!(root, Yaml::Null) {
            return Err(err(
                "error loading config file: the document is not a map".into()
            ));
        }
        let domain = string_field(root, "domain")
            .map_err(err)?
            .unwrap_or_default();
        if domain.is_empty() {
            return Err(err("config file cannot have empty domain".into()));
        }
        if self.domains.contains_key(&domain) {
            return Err(err(format!("duplicate domain '{domain}' in config file")));
        }
        let refunds = bool_field(root, "refunds").map_err(err)?;
        let mut node = Node::default();
        let mut rules = 0;
        let parent = Parent {
            key: &domain,
            refunds,
        };
        load_descriptors(&mut node, &root["descriptors"], &parent, &mut rules).map_err(err)?;
        self.rules += rules;
        self.domains.insert(domain, node);
        Ok(())
    }

    /// The rule for one request descriptor, as envoyproxy/ratelimit finds it.
    /// `None`: unknown domain, or no `rate_limit` at the descriptor's depth.
    pub fn find(&self, domain: &str, entries: &[(&str, &str)]) -> Option<Match> {
        self.lookup(domain, entries).ok()
    }

    /// [`EnvoyConfig::find`], saying where the search stopped when no rule
    /// applies.
    pub fn lookup(&self, domain: &str, entries: &[(&str, &str)]) -> Result<Match, Miss> {
        let mut node = self.domains.get(domain).ok_or(Miss::Domain)?;
        let mut counter = String::new();
        let mut found = None;
        for (i, (key, value)) in entries.iter().enumerate() {
            let (next, shown) =
                if let Some(n) = node.exact.get(&(key.to_string(), value.to_string())) {
                    (n, *value)
                } else if let Some((_, pattern, shared, n)) = node
                    .wildcards
                    .iter()
                    .find(|(k, p, _, _)| k == key && glob_match(p, value))
                {
                    (n, if *shared { pattern.as_str() } else { *value })
                } else if let Some(n) = node.any_value.get(*key) {
                    (n, *value)
                } else {
                    return Err(Miss::Entry(i));
                };
            if !counter.is_empty() {
                counter.push('.');
            }
            counter.push_str(key);
            counter.push('_');
            counter.push_str(shown);
            if i == entries.len() - 1 {
                found = next.rule.clone();
            }
            node = next;
        }
        match found {
            Some(rule) => Ok(Match {
                rule,
                counter,
                overridden: false,
            }),
            None if entries.is_empty() => Err(Miss::Entry(0)),
            None => Err(Miss::NoRule),
        }
    }
}

/// Where a descriptor's search for a rule stopped ([`EnvoyConfig::lookup`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Miss {
    /// The domain is not configured.
    Domain,
    /// The entry at this index matched no descriptor at its depth (0 also
    /// for a descriptor without entries).
    Entry(usize),
    /// Every entry matched, but the deepest descriptor has no `rate_limit`.
    NoRule,
}

impl Miss {
    /// What a person reads: why no rule applies to `entries` of `domain`.
    pub fn describe(self, domain: &str, entries: &[(&str, &str)]) -> String {
        match self {
            Self::Domain => format!(
                "domain {domain:?} is not in the configuration: nothing in it is limited, \
                 limit overrides included"
            ),
            Self::Entry(_) if entries.is_empty() => "the descriptor has no entries".into(),
            Self::Entry(0) => {
                let (k, v) = entries[0];
                format!(
                    "the first entry ({k}={v}) matches no descriptor at the top of domain {domain:?}"
                )
            }
            Self::Entry(i) => {
                let (k, v) = entries[i];
                let path: Vec<String> = entries[..i]
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect();
                format!(
                    "entry {} ({k}={v}) matches no descriptor under {}",
                    i + 1,
                    path.join(", ")
                )
            }
            Self::NoRule => "every entry matches a descriptor, but the deepest one has no \
                 rate_limit (a rule applies only at the depth of the request's last entry)"
                .into(),
        }
    }
}

/// Where descriptors are loaded: under which key, with the domain's
/// default for `refunds`.
struct Parent<'a> {
    key: &'a str,
    refunds: bool,
}

fn load_descriptors(
    parent: &mut Node,
    list: &Yaml,
    at: &Parent<'_>,
    rules: &mut usize,
) -> Result<(), String> {
    let items = match list {
        Yaml::Array(items) => items.as_slice(),
        Yaml::Null | Yaml::BadValue => &[],
        _ => return Err("error loading config file: descriptors must be a list".into()),
    };
    for item in items {
        let key = string_field(item, "key")?.unwrap_or_default();
        if key.is_empty() {
            return Err("descriptor has empty key".into());
        }
        let value = string_field(item, "value")?.unwrap_or_default();
        let final_key = if value.is_empty() {
            key.clone()
        } else {
            format!("{key}_{value}")
        };
        let full_key = format!("{}.{final_key}", at.key);
        let duplicate = if value.is_empty() {
            parent.any_value.contains_key(&key)
        } else {
            parent.exact.contains_key(&(key.clone(), value.clone()))
                || parent
                    .wildcards
                    .iter()
                    .any(|(k, p, _, _)| *k == key && *p == value)
        };
        if duplicate {
            return Err(format!("duplicate descriptor composite key '{full_key}'"));
        }
        let shadow = bool_field(item, "shadow_mode")?;
        let detailed_metric = bool_field(item, "detailed_metric")?;
        let share_threshold = bool_field(item, "share_threshold")?;
        let mut node = Node::default();
        if let rate_limit @ Yaml::Hash(_) = &item["rate_limit"] {
            node.rule = Some(Arc::new(load_rule(
                rate_limit,
                &full_key,
                shadow,
                detailed_metric,
                at.refunds,
            )?));
            *rules += 1;
        }
        let below = Parent {
            key: &full_key,
            refunds: at.refunds,
        };
        load_descriptors(&mut node, &item["descriptors"], &below, rules)?;
        if value.is_empty() {
            parent.any_value.insert(key, node);
        } else if value.contains('*') {
            parent.wildcards.push((key, value, share_threshold, node));
        } else {
            parent.exact.insert((key, value), node);
        }
    }
    Ok(())
}

fn load_rule(
    y: &Yaml,
    full_key: &str,
    shadow: bool,
    detailed_metric: bool,
    domain_refunds: bool,
) -> Result<EnvoyRule, String> {
    let unlimited = bool_field(y, "unlimited")?;
    let unit_text = string_field(y, "unit")?.unwrap_or_default();
    let unit = match unit_text.to_ascii_lowercase().as_str() {
        "second" => Some(RateUnit::Second),
        "minute" => Some(RateUnit::Minute),
        "hour" => Some(RateUnit::Hour),
        "day" => Some(RateUnit::Day),
        "week" => Some(RateUnit::Week),
        "month" => Some(RateUnit::Month),
        "year" => Some(RateUnit::Year),
        _ => None,
    };
    if unlimited && unit.is_some() {
        return Err("should not specify rate limit unit when unlimited".into());
    }
    let unit = match (unlimited, unit) {
        (_, Some(unit)) => unit,
        (true, None) => RateUnit::Second,
        (false, None) => return Err(format!("invalid rate limit unit '{unit_text}'")),
    };
    let requests_per_unit = match &y["requests_per_unit"] {
        Yaml::Integer(n) => u32::try_from(*n).map_err(|_| {
            format!(
                "requests_per_unit must be between 0 and {}, got {n}",
                u32::MAX
            )
        })?,
        Yaml::Null | Yaml::BadValue => 0,
        other => {
            return Err(format!(
                "requests_per_unit must be a whole number, got {}",
                show(other)
            ));
        }
    };
    let name = string_field(y, "name")?.unwrap_or_default();
    let mut replaces = Vec::new();
    match &y["replaces"] {
        Yaml::Array(items) => {
            for r in items {
                let r = string_field(r, "name")?.unwrap_or_default();
                if r.is_empty() {
                    return Err("should not have an empty replaces entry".into());
                }
                if !name.is_empty() && r == name {
                    return Err("replaces should not contain name of same descriptor".into());
                }
                replaces.push(r);
            }
        }
        Yaml::Null | Yaml::BadValue => {}
        other => {
            return Err(format!(
                "replaces must be a list of {{name: …}}, got {}",
                show(other)
            ));
        }
    }
    let algorithm_text = string_field(y, "algorithm")?.unwrap_or_else(|| "fixed_window".into());
    let algorithm = Algorithm::parse(&algorithm_text)
        .filter(|a| *a != Algorithm::Concurrency)
        .ok_or_else(|| {
            format!(
                "invalid algorithm '{algorithm_text}'; use fixed_window, token_bucket, \
                 sliding_window or quota"
            )
        })?;
    let calendar = if algorithm == Algorithm::Quota {
        let period = match unit {
            RateUnit::Day => Period::Day,
            RateUnit::Week => Period::Week,
            RateUnit::Month => Period::Month,
            RateUnit::Year => Period::Year,
            other => {
                return Err(format!(
                    "algorithm quota counts per day, week, month or year; unit is {}",
                    other.as_str()
                ));
            }
        };
        let number = |field: &str| -> Result<u8, String> {
            match &y[field] {
                Yaml::Null | Yaml::BadValue => Ok(1),
                Yaml::Integer(n) if (0..=255).contains(n) => Ok(*n as u8),
                other => Err(format!(
                    "{field} must be a whole number, got {}",
                    show(other)
                )),
            }
        };
        let zone = string_field(y, "time_zone")?.unwrap_or_else(|| "UTC".into());
        let weekday = string_field(y, "cycle_weekday")?.unwrap_or_else(|| "monday".into());
        let cycle = Cycle::new(
            &zone,
            number("cycle_day")?,
            number("cycle_month")?,
            &weekday,
        )?;
        Some((period, Arc::new(cycle)))
    } else {
        for field in ["time_zone", "cycle_day", "cycle_month", "cycle_weekday"] {
            if !matches!(y[field], Yaml::Null | Yaml::BadValue) {
                return Err(format!("{field} is only for algorithm quota"));
            }
        }
        None
    };
    let burst = match &y["burst"] {
        Yaml::Integer(n) if algorithm == Algorithm::TokenBucket && *n >= 1 => Some(*n as u64),
        Yaml::Null | Yaml::BadValue => None,
        Yaml::Integer(_) if algorithm != Algorithm::TokenBucket => {
            return Err("burst is only for algorithm token_bucket".into());
        }
        other => {
            return Err(format!(
                "burst must be a whole number of at least 1, got {}",
                show(other)
            ));
        }
    };
    let policy_text = string_field(y, "on_store_unavailable")?.unwrap_or_else(|| "allow".into());
    let on_store_unavailable = match policy_text.as_str() {
        "allow" => OnStoreUnavailable::Allow,
        "deny" => OnStoreUnavailable::Deny,
        "local" => OnStoreUnavailable::Local,
        other => {
            return Err(format!(
                "invalid on_store_unavailable '{other}'; use allow, deny or local"
            ));
        }
    };
    let debt = match &y["debt"] {
        Yaml::Null | Yaml::BadValue => 0,
        Yaml::Integer(n) if *n >= 0 => *n as u64,
        other => {
            return Err(format!(
                "debt must be a whole number of 0 or more, got {}",
                show(other)
            ));
        }
    };
    let refunds = match &y["refunds"] {
        Yaml::Boolean(b) => *b,
        Yaml::Null | Yaml::BadValue => domain_refunds,
        other => {
            return Err(format!(
                "refunds must be true or false, got {}",
                show(other)
            ));
        }
    };
    let kind = if unlimited {
        RuleKind::Unlimited
    } else if requests_per_unit == 0 {
        RuleKind::Block
    } else {
        let rate = Rate {
            count: u64::from(requests_per_unit),
            unit,
        };
        let limit = match (burst, calendar.is_some()) {
            (Some(burst), _) => Limit::new(burst, rate),
            // The period is the decision's (see `EnvoyRule::calendar`).
            (None, true) => Limit::quota(
                rate.count,
                Bounds {
                    start: 0,
                    end: unit.micros(),
                },
            ),
            (None, false) => Limit::window(algorithm, rate),
        }
        .and_then(|limit| limit.with_debt(debt))
        .map_err(|e| format!("rate limit {full_key}: {e}"))?;
        RuleKind::Limited(limit)
    };
    Ok(EnvoyRule {
        full_key: full_key.to_owned(),
        name,
        replaces,
        kind,
        requests_per_unit,
        unit,
        shadow,
        detailed_metric,
        on_store_unavailable,
        calendar,
        refunds,
    })
}

/// Checks every map key against the known keys, as envoyproxy/ratelimit does.
fn validate_keys(y: &Yaml) -> Result<(), String> {
    let Yaml::Hash(map) = y else { return Ok(()) };
    for (k, v) in map {
        let Yaml::String(k) = k else {
            return Err(format!(
                "config error, key is not of type string: {}",
                show(k)
            ));
        };
        if !VALID_KEYS.contains(&k.as_str()) {
            return Err(format!("config error, unknown key '{k}'"));
        }
        match v {
            Yaml::Array(items) => {
                for e in items {
                    if !matches!(e, Yaml::Hash(_)) {
                        return Err(format!(
                            "config error, yaml file contains list of type other than map: {}",
                            show(e)
                        ));
                    }
                    validate_keys(e)?;
                }
            }
            Yaml::Hash(_) => validate_keys(v)?,
            _ => {}
        }
    }
    Ok(())
}

fn string_field(y: &Yaml, field: &str) -> Result<Option<String>, String> {
    match &y[field] {
        Yaml::String(s) => Ok(Some(s.clone())),
        Yaml::Integer(n) => Ok(Some(n.to_string())),
        Yaml::Real(r) => Ok(Some(r.clone())),
        Yaml::Boolean(b) => Ok(Some(b.to_string())),
        Yaml::Null | Yaml::BadValue => Ok(None),
        other => Err(format!(
            "error loading config file: {field} must be a string, got {}",
            show(other)
        )),
    }
}

fn bool_field(y: &Yaml, field: &str) -> Result<bool, String> {
    match &y[field] {
        Yaml::Boolean(b) => Ok(*b),
        Yaml::Null | Yaml::BadValue => Ok(false),
        other => Err(format!(
            "error loading config file: {field} must be true or false, got {}",
            show(other)
        )),
    }
}

fn show(y: &Yaml) -> String {
    match y {
        Yaml::String(s) | Yaml::Real(s) => s.clone(),
        Yaml::Integer(n) => n.to_string(),
        Yaml::Boolean(b) => b.to_string(),
        Yaml::Array(_) => "a list".into(),
        Yaml::Hash(_) => "a map".into(),
        _ => "null".into(),
    }
}

/// `*` matches any run of characters (including none), anywhere in the
/// pattern.
pub fn glob_match(pattern: &str, value: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == value;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !value.starts_with(first) || value.len() < first.len() + last.len() || !value.ends_with(last)
    {
        return false;
    }
    let mut rest = &value[first.len()..value.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<EnvoyConfig, String> {
        EnvoyConfig::load(&[("config/edge.yaml".into(), text.into())]).map_err(|e| e.to_string())
    }

    #[test]
    fn a_quota_needs_a_calendar_unit_and_a_valid_cycle() {
        let rule = |extra: &str, unit: &str| {
            load(&format!(
                "domain: x\ndescriptors:\n  - key: a\n    rate_limit: {{unit: {unit}, \
                 requests_per_unit: 5, algorithm: quota{extra}}}\n"
            ))
        };
        let config = rule(", time_zone: Europe/Berlin, cycle_day: 31", "month").unwrap();
        let found = config.find("x", &[("a", "v")]).unwrap();
        let (period, cycle) = found.rule.calendar.clone().unwrap();
        assert_eq!(period, Period::Month);
        assert_eq!(
            *cycle,
            Cycle::new("Europe/Berlin", 31, 1, "monday").unwrap()
        );
        for (extra, unit, says) in [
            (
                "",
                "minute",
                "algorithm quota counts per day, week, month or year; unit is minute",
            ),
            (
                ", time_zone: Mars/Base",
                "day",
                "time zone \"Mars/Base\" is not an IANA time zone name",
            ),
            (", cycle_day: 32", "month", "anchor day 32: use 1 to 31"),
            (", cycle_day: 0", "month", "anchor day 0: use 1 to 31"),
            (
                ", cycle_day: -3",
                "month",
                "cycle_day must be a whole number",
            ),
            (", cycle_month: 13", "year", "anchor month 13"),
            (
                ", cycle_weekday: funday",
                "week",
                "anchor weekday \"funday\"",
            ),
            (
                ", burst: 3",
                "day",
                "burst is only for algorithm token_bucket",
            ),
        ] {
            let err = rule(extra, unit).unwrap_err();
            assert!(err.contains(says), "{extra} {unit}: {err}");
        }
        let err = load(
            "domain: x\ndescriptors:\n  - key: a\n    rate_limit: {unit: day, requests_per_unit: 5, time_zone: UTC}\n",
        )
        .unwrap_err();
        assert_eq!(
            err,
            "config/edge.yaml: time_zone is only for algorithm quota"
        );
        let err = load(
            "domain: x\ndescriptors:\n  - key: a\n    rate_limit: {unit: day, requests_per_unit: 5, algorithm: concurrency}\n",
        )
        .unwrap_err();
        assert!(err.contains("invalid algorithm 'concurrency'"), "{err}");
    }

    #[test]
    fn bad_files_get_envoyproxy_ratelimit_messages() {
        let cases = [
            (
                "domain: x\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n    bogus: 1\n",
                "config/edge.yaml: config error, unknown key 'bogus'",
            ),
            (
                "descriptors: []\n",
                "config/edge.yaml: config file cannot have empty domain",
            ),
            (
                "domain: x\ndescriptors:\n  - value: v\n",
                "config/edge.yaml: descriptor has empty key",
            ),
            (
                "domain: x\ndescriptors:\n  - key: a\n  - key: a\n",
                "config/edge.yaml: duplicate descriptor composite key 'x.a'",
            ),
            (
                "domain: x\ndescriptors:\n  - key: a\n    value: b\n  - key: a\n    value: b\n",
                "config/edge.yaml: duplicate descriptor composite key 'x.a_b'",
            ),
            (
                "domain: x\ndescriptors:\n  - key: a\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n",
                "config/edge.yaml: invalid rate limit unit 'fortnight'",
            ),
            (
                "domain: x\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, unlimited: true}\n",
                "config/edge.yaml: should not specify rate limit unit when unlimited",
            ),
            (
                "domain: x\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, name: n, replaces: [{name: n}]}\n",
                "config/edge.yaml: replaces should not contain name of same descriptor",
            ),
            (
                "domain: x\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, replaces: [{name: ''}]}\n",
                "config/edge.yaml: should not have an empty replaces entry",
            ),
            (
                "domain: x\ndescriptors:\n  - 5\n",
                "config/edge.yaml: config error, yaml file contains list of type other than map: 5",
            ),
            (
                "domain: x\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, algorithm: leaky}\n",
                "config/edge.yaml: invalid algorithm 'leaky'; use fixed_window, token_bucket, sliding_window or quota",
            ),
            (
                "domain: x\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, burst: 5}\n",
                "config/edge.yaml: burst is only for algorithm token_bucket",
            ),
            (
                "domain: x\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, debt: -1}\n",
                "config/edge.yaml: debt must be a whole number of 0 or more, got -1",
            ),
            (
                "domain: x\ndescriptors:\n  - key: a\n    rate_limit: {unit: year, requests_per_unit: 1, algorithm: token_bucket, debt: 1000}\n",
                "config/edge.yaml: rate limit x.a: a debt of 1000 below a burst of 1 takes too long to refill; lower the debt",
            ),
            (
                "domain: x\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, algorithm: token_bucket, refunds: yes}\n",
                "config/edge.yaml: refunds must be true or false, got yes",
            ),
            (
                "domain: x\nrefunds: 1\ndescriptors: []\n",
                "config/edge.yaml: error loading config file: refunds must be true or false, got 1",
            ),
        ];
        for (text, expected) in cases {
            assert_eq!(load(text).unwrap_err(), expected, "{text}");
        }
        let err = load("domain: [x\n").unwrap_err();
        assert!(
            err.starts_with("config/edge.yaml: error loading config file: "),
            "{err}"
        );
        let two = EnvoyConfig::load(&[
            ("a.yaml".into(), "domain: x\n".into()),
            ("b.yaml".into(), "domain: x\n".into()),
        ]);
        assert_eq!(
            two.unwrap_err().to_string(),
            "b.yaml: duplicate domain 'x' in config file"
        );
    }

    #[test]
    fn matching_follows_envoyproxy_ratelimit() {
        let config = load(
            "domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: minute, requests_per_unit: 60}
  - key: remote_address
    value: 10.0.0.1
    rate_limit: {unit: minute, requests_per_unit: 600}
  - key: path
    value: /api/*/items
    share_threshold: true
    rate_limit: {unit: second, requests_per_unit: 100}
  - key: path
    value: /static/*
    rate_limit: {unit: second, requests_per_unit: 7}
  - key: client
    descriptors:
      - key: path
        rate_limit: {unit: second, requests_per_unit: 5}
",
        )
        .unwrap();
        let find = |entries: &[(&str, &str)]| {
            config
                .find("edge", entries)
                .map(|m| (m.rule.requests_per_unit, m.counter))
        };
        assert_eq!(
            find(&[("remote_address", "10.0.0.9")]),
            Some((60, "remote_address_10.0.0.9".into()))
        );
        assert_eq!(
            find(&[("remote_address", "10.0.0.1")]),
            Some((600, "remote_address_10.0.0.1".into()))
        );
        // Shared wildcard: one counter for every matching value.
        assert_eq!(
            find(&[("path", "/api/v1/items")]),
            Some((100, "path_/api/*/items".into()))
        );
        assert_eq!(
            find(&[("path", "/api/v2/items")]),
            Some((100, "path_/api/*/items".into()))
        );
        assert_eq!(find(&[("path", "/api/v2/other")]), None);
        // Unshared wildcard: a counter per value.
        assert_eq!(
            find(&[("path", "/static/a.css")]),
            Some((7, "path_/static/a.css".into()))
        );
        // Nested: the limit sits at the second level only.
        assert_eq!(
            find(&[("client", "c1"), ("path", "/x")]),
            Some((5, "client_c1.path_/x".into()))
        );
        assert_eq!(find(&[("client", "c1")]), None, "no rate_limit at depth 1");
        assert_eq!(
            find(&[("remote_address", "1.2.3.4"), ("path", "/x")]),
            None,
            "deeper than the config"
        );
        assert_eq!(
            config.find("other", &[("remote_address", "1.2.3.4")]),
            None,
            "unknown domain"
        );
        assert_eq!((config.domains(), config.rules()), (1, 5));
    }

    #[test]
    fn glob() {
        assert!(glob_match("a*", "abc"));
        assert!(glob_match("*c", "abc"));
        assert!(glob_match("a*c", "ac"));
        assert!(glob_match("*", ""));
        assert!(glob_match("a*b*c", "axxbyyc"));
        assert!(!glob_match("a*b*c", "axxcyyb"));
        assert!(!glob_match("ab*ba", "aba"));
    }
}
