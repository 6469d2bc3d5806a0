//! The store URL's forms: one Redis, a Redis Cluster's seed nodes, or the
//! Sentinels that name a primary.

/// A parsed store URL. Each host comes back as a `redis://` (or
/// `rediss://`) URL carrying the URL's credentials and database, as the
/// Redis client takes them.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Url {
    /// `redis://…`, `rediss://…`.
    Standalone(String),
    /// `redis-cluster://[auth@]host:port,…`: the seed nodes.
    Cluster(Vec<String>),
    /// `redis-sentinel://[auth@]host:port,…/SERVICE[/db]`.
    Sentinel {
        sentinels: Vec<String>,
        service: String,
    },
}

/// Parses `url`; errors name `shown` (the URL with its password hidden)
/// and say what to fix.
pub(super) fn parse(url: &str, shown: &str) -> Result<Url, String> {
    let bad = |why: &str| format!("store URL {shown:?}: {why}");
    if let Some(hosts) = multi_host(url, "cluster") {
        let (nodes, _) = hosts.urls(&bad)?;
        return Ok(Url::Cluster(nodes));
    }
    if let Some(hosts) = multi_host(url, "sentinel") {
        if hosts.path.is_empty() {
            return Err(bad(
                "name the Sentinel service after the hosts: redis-sentinel://host:port,host:port/mymaster",
            ));
        }
        let (sentinels, service) = hosts.urls(&bad)?;
        return Ok(Url::Sentinel {
            sentinels,
            service: service.to_owned(),
        });
    }
    if url.starts_with("redis://") || url.starts_with("rediss://") {
        redis::parse_redis_url(url).ok_or_else(|| bad("not a valid redis:// URL"))?;
        return Ok(Url::Standalone(url.to_owned()));
    }
    Err(bad(
        "use redis://, rediss://, redis-cluster://, rediss-cluster://, redis-sentinel:// or rediss-sentinel://",
    ))
}

/// `redis-KIND://` or `rediss-KIND://`, taken apart.
struct MultiHost<'a> {
    kind: &'a str,
    scheme: &'static str,
    /// `user:password@`, or empty.
    auth: &'a str,
    hosts: &'a str,
    /// What follows the hosts' `/`: a Sentinel's `SERVICE[/db]`.
    path: &'a str,
}

fn multi_host<'a>(url: &'a str, kind: &'a str) -> Option<MultiHost<'a>> {
    let (scheme, rest) = ["redis", "rediss"].into_iter().find_map(|scheme| {
        let rest = url.strip_prefix(scheme)?.strip_prefix('-')?;
        Some((scheme, rest.strip_prefix(kind)?.strip_prefix("://")?))
    })?;
    let (auth, rest) = match rest.rfind('@') {
        Some(at) => rest.split_at(at + 1),
        None => ("", rest),
    };
    let (hosts, path) = rest.split_once('/').unwrap_or((rest, ""));
    Some(MultiHost {
        kind,
        scheme,
        auth,
        hosts,
        path,
    })
}

impl<'a> MultiHost<'a> {
    /// Each host as a URL (with the database of a Sentinel URL), and the
    /// Sentinel service.
    fn urls(&self, bad: &dyn Fn(&str) -> String) -> Result<(Vec<String>, &'a str), String> {
        let (service, db) = self.path.split_once('/').unwrap_or((self.path, ""));
        let db = if db.is_empty() {
            String::new()
        } else {
            format!("/{db}")
        };
        let urls: Vec<String> = self
            .hosts
            .split(',')
            .filter(|h| !h.is_empty())
            .map(|h| format!("{}://{}{h}{db}", self.scheme, self.auth))
            .collect();
        if urls.is_empty() {
            return Err(bad(&format!(
                "name at least one host:port after redis-{}://",
                self.kind
            )));
        }
        for url in &urls {
            redis::parse_redis_url(url).ok_or_else(|| bad("a host is not host:port"))?;
        }
        Ok((urls, service))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_form_parses_into_per_host_urls() {
        let p = |u: &str| parse(u, u);
        assert_eq!(
            p("redis://h:1/2"),
            Ok(Url::Standalone("redis://h:1/2".into()))
        );
        assert_eq!(
            p("rediss-cluster://:pw@a:7000,b:7000/"),
            Ok(Url::Cluster(vec![
                "rediss://:pw@a:7000".into(),
                "rediss://:pw@b:7000".into()
            ]))
        );
        assert_eq!(
            p("redis-sentinel://u:pw@s1:26379,s2:26379/mymaster/3"),
            Ok(Url::Sentinel {
                sentinels: vec![
                    "redis://u:pw@s1:26379/3".into(),
                    "redis://u:pw@s2:26379/3".into()
                ],
                service: "mymaster".into()
            })
        );
        assert_eq!(
            p("redis-cluster://"),
            Err("store URL \"redis-cluster://\": name at least one host:port after redis-cluster://".into())
        );
        assert!(p("redis-clusterx://a:1").is_err());
        assert!(p("redis-sentinel://a:1/").is_err());
    }
}
