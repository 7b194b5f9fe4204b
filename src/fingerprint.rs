//! The request fingerprint (SPEC §3.3, §3.6): a key reused for a different request gets 422.
//!
//! It covers the method, the raw path with its query (byte for byte: `?a=1&b=2` and `?b=2&a=1`
//! are different requests to us), the values of the configured `fingerprint_headers` looked up
//! by name (so the order of headers in the request does not matter), and the body's SHA-256.

use sha2::{Digest, Sha256};

/// A truncated SHA-256: 128 bits are plenty to tell two requests of one key apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub struct Fingerprint(pub [u8; 16]);

/// Builds a fingerprint field by field.
pub struct FingerprintBuilder {
    hash: Sha256,
}

impl FingerprintBuilder {
    pub fn new(method: &[u8], path_and_query: &[u8]) -> Self {
        let mut b = FingerprintBuilder { hash: Sha256::new() };
        b.field(method);
        b.field(path_and_query);
        b
    }

    /// One configured header, with every value it has in the request, in request order.
    pub fn header<'a>(&mut self, name: &str, values: impl Iterator<Item = &'a [u8]>) {
        self.field(name.as_bytes());
        let mut count = 0u64;
        for v in values {
            self.field(v);
            count += 1;
        }
        self.hash.update(count.to_le_bytes());
    }

    /// The body's SHA-256, when `fingerprint_body` is on.
    pub fn body(&mut self, body: &[u8]) {
        let digest: [u8; 32] = Sha256::digest(body).into();
        self.field(&digest);
    }

    pub fn finish(self) -> Fingerprint {
        let digest = self.hash.finalize();
        let mut out = [0u8; 16];
        out.copy_from_slice(digest.get(..16).unwrap_or(&[0u8; 16]));
        Fingerprint(out)
    }

    fn field(&mut self, bytes: &[u8]) {
        self.hash.update((bytes.len() as u64).to_le_bytes());
        self.hash.update(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(method: &str, path: &str, headers: &[(&str, &[&str])], body: Option<&str>) -> Fingerprint {
        let mut b = FingerprintBuilder::new(method.as_bytes(), path.as_bytes());
        for (name, values) in headers {
            b.header(name, values.iter().map(|v| v.as_bytes()));
        }
        if let Some(body) = body {
            b.body(body.as_bytes());
        }
        b.finish()
    }

    #[test]
    fn same_request_same_fingerprint() {
        let a = fp("POST", "/pay?x=1", &[("content-type", &["application/json"])], Some("{}"));
        let b = fp("POST", "/pay?x=1", &[("content-type", &["application/json"])], Some("{}"));
        assert_eq!(a, b);
    }

    #[test]
    fn every_part_counts() {
        let base = fp("POST", "/pay?x=1", &[("content-type", &["a"])], Some("{}"));
        assert_ne!(base, fp("PATCH", "/pay?x=1", &[("content-type", &["a"])], Some("{}")));
        assert_ne!(base, fp("POST", "/pay?x=2", &[("content-type", &["a"])], Some("{}")));
        assert_ne!(base, fp("POST", "/pay", &[("content-type", &["a"])], Some("{}")));
        assert_ne!(base, fp("POST", "/pay?x=1", &[("content-type", &["b"])], Some("{}")));
        assert_ne!(base, fp("POST", "/pay?x=1", &[("content-type", &[])], Some("{}")));
        assert_ne!(base, fp("POST", "/pay?x=1", &[("content-type", &["a"])], Some("{ }")));
        assert_ne!(base, fp("POST", "/pay?x=1", &[("content-type", &["a"])], None));
    }

    #[test]
    fn query_order_is_significant() {
        assert_ne!(fp("POST", "/p?a=1&b=2", &[], None), fp("POST", "/p?b=2&a=1", &[], None));
    }

    #[test]
    fn values_do_not_run_into_each_other() {
        assert_ne!(fp("POST", "/p", &[("h", &["ab", "c"])], None), fp("POST", "/p", &[("h", &["a", "bc"])], None));
        assert_ne!(fp("POST", "/p", &[("h", &["", ""])], None), fp("POST", "/p", &[("h", &[""])], None));
    }
}
