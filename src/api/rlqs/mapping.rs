//! From a quota bucket id (the entries Envoy's bucket id builder made) to
//! Tollgate's tenant, resource and key.

use crate::engine::caps;
use crate::limits::check_label_named;
use crate::proto::envoy::service::rate_limit_quota::v3::BucketId;

use super::RlqsOptions;

/// Most entries in one bucket id.
pub const MAX_ENTRIES: usize = 16;

/// Most bytes of one bucket id's names and values together (the id is
/// echoed in every assignment).
pub const MAX_ID_BYTES: usize = 4096;

/// Which entry is which.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketMapping {
    tenant: String,
    resource: String,
    key: String,
}

/// A bucket id's tenant, resource and key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapped {
    /// The tenant entry's value ("" without one).
    pub tenant: String,
    /// The resource entry's value ("" without one).
    pub resource: String,
    /// The key entry's value; without one, every other entry as
    /// `name=value` pairs in name order, joined by `,`.
    pub key: String,
}

impl BucketMapping {
    /// The mapping `options` configure.
    pub fn new(options: &RlqsOptions) -> Self {
        Self {
            tenant: options.tenant_entry.clone(),
            resource: options.resource_entry.clone(),
            key: options.key_entry.clone(),
        }
    }

    /// Maps `id`, or says what is wrong with it.
    pub fn map(&self, id: &BucketId) -> Result<Mapped, String> {
        if id.bucket.is_empty() {
            return Err("the bucket id has no entries".into());
        }
        if id.bucket.len() > MAX_ENTRIES {
            return Err(format!(
                "the bucket id has {} entries; at most {MAX_ENTRIES}",
                id.bucket.len()
            ));
        }
        let bytes: usize = id.bucket.iter().map(|(k, v)| k.len() + v.len()).sum();
        if bytes > MAX_ID_BYTES {
            return Err(format!(
                "the bucket id is {bytes} bytes; at most {MAX_ID_BYTES}"
            ));
        }
        let entry = |name: &str| id.bucket.get(name).cloned().unwrap_or_default();
        let tenant = entry(&self.tenant);
        let resource = entry(&self.resource);
        check_label_named(&tenant, || format!("bucket entry {:?}", self.tenant))?;
        check_label_named(&resource, || format!("bucket entry {:?}", self.resource))?;
        let key = match id.bucket.get(&self.key) {
            Some(key) => key.clone(),
            None => {
                let mut rest: Vec<(&String, &String)> = id
                    .bucket
                    .iter()
                    .filter(|(k, _)| **k != self.tenant && **k != self.resource)
                    .collect();
                rest.sort();
                rest.iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(",")
            }
        };
        caps::check_key(|| format!("bucket entry {:?}", self.key), &key)
            .map_err(|e| e.to_string())?;
        Ok(Mapped {
            tenant,
            resource,
            key,
        })
    }
}

/// A bucket id's hash, the same whatever the order of its entries (Envoy
/// matches its buckets by the id's content).
pub fn hash_of(id: &BucketId) -> u64 {
    let mut entries: Vec<(&String, &String)> = id.bucket.iter().collect();
    entries.sort();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (k, v) in entries {
        for b in k.bytes().chain([0]).chain(v.bytes()).chain([0]) {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(entries: &[(&str, &str)]) -> BucketId {
        BucketId {
            bucket: entries
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    fn mapping() -> BucketMapping {
        BucketMapping::new(&RlqsOptions::default())
    }

    #[test]
    fn entries_name_the_tenant_resource_and_key() {
        let m = mapping()
            .map(&id(&[
                ("tenant", "acme"),
                ("resource", "search"),
                ("key", "alice"),
            ]))
            .unwrap();
        assert_eq!(
            (m.tenant.as_str(), m.resource.as_str(), m.key.as_str()),
            ("acme", "search", "alice")
        );
        // Without a key entry, the other entries in name order are the key.
        let m = mapping()
            .map(&id(&[
                ("tenant", "acme"),
                ("path", "/v1"),
                ("method", "GET"),
            ]))
            .unwrap();
        assert_eq!(
            (m.resource.as_str(), m.key.as_str()),
            ("", "method=GET,path=/v1")
        );
    }

    #[test]
    fn bad_ids_are_refused_with_what_is_wrong() {
        assert!(mapping().map(&id(&[])).unwrap_err().contains("no entries"));
        let colon = mapping().map(&id(&[("tenant", "a:b")])).unwrap_err();
        assert!(colon.contains("bucket entry \"tenant\""), "{colon}");
        let big = "x".repeat(MAX_ID_BYTES + 1);
        let err = mapping().map(&id(&[("key", big.as_str())])).unwrap_err();
        assert!(err.contains("4100 bytes; at most 4096"), "{err}");
        let many: Vec<(String, String)> = (0..=MAX_ENTRIES)
            .map(|i| (format!("e{i}"), "v".into()))
            .collect();
        let many: Vec<(&str, &str)> = many.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        assert!(
            mapping()
                .map(&id(&many))
                .unwrap_err()
                .contains("17 entries")
        );
    }

    #[test]
    fn the_hash_ignores_entry_order_and_tells_ids_apart() {
        let a = id(&[("tenant", "acme"), ("key", "alice")]);
        let b = id(&[("key", "alice"), ("tenant", "acme")]);
        assert_eq!(hash_of(&a), hash_of(&b));
        assert_ne!(
            hash_of(&a),
            hash_of(&id(&[("tenant", "acme"), ("key", "alicf")]))
        );
        // Entry boundaries count: "ab"="" is not "a"="b".
        assert_ne!(hash_of(&id(&[("ab", "")])), hash_of(&id(&[("a", "b")])));
    }
}
