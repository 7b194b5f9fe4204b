//! The request fingerprint (docs/behaviour.md §3.3, §3.6): a key reused for a different request gets 422.
//!
//! It covers the method, the raw path with its query (byte for byte: `?a=1&b=2` and `?b=2&a=1`
//! are different requests to us), the values of the configured `fingerprint_headers` looked up
//! by name (so the order of headers in the request does not matter), and the body's SHA-256.

use sha2::{Digest, Sha256};

use crate::digest;

/// A truncated SHA-256: 128 bits are plenty to tell two requests of one key apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub struct Fingerprint(pub [u8; 16]);

/// Builds a fingerprint field by field: the message is kept whole, so that a retry's is found
/// in the digest memo (`crate::digest`), unless it grows past what the memo keeps; then it is
/// hashed as it comes.
pub struct FingerprintBuilder {
    message: Vec<u8>,
    streaming: Option<Box<Sha256>>,
    /// A retry's store key: its digests go through the memo, kept for that key.
    retry_of: Option<[u8; 32]>,
}

impl FingerprintBuilder {
    pub fn new(method: &[u8], path_and_query: &[u8]) -> Self {
        let mut b = FingerprintBuilder { message: Vec::with_capacity(160), streaming: None, retry_of: None };
        b.field(method);
        b.field(path_and_query);
        b
    }

    /// The request is a retry of a key seen just before (`StoreKey::derive_noting_retries`).
    pub fn for_retry_of(mut self, key: Option<[u8; 32]>) -> Self {
        self.retry_of = key;
        self
    }

    /// One configured header, with every value it has in the request, in request order.
    pub fn header<'a>(&mut self, name: &str, values: impl Iterator<Item = &'a [u8]>) {
        self.field(name.as_bytes());
        let mut count = 0u64;
        for v in values {
            self.field(v);
            count += 1;
        }
        self.push(&count.to_le_bytes());
    }

    /// The body's SHA-256, when `fingerprint_body` is on.
    pub fn body(&mut self, body: &[u8]) {
        let digest = self.sha256(body);
        self.field(&digest);
    }

    pub fn finish(self) -> Fingerprint {
        let digest: [u8; 32] = match self.streaming {
            Some(hash) => hash.finalize().into(),
            None => self.sha256(&self.message),
        };
        let mut out = [0u8; 16];
        out.copy_from_slice(digest.get(..16).unwrap_or(&[0u8; 16]));
        Fingerprint(out)
    }

    fn sha256(&self, message: &[u8]) -> [u8; 32] {
        match &self.retry_of {
            Some(key) => digest::retry_sha256(key, message),
            None => digest::plain(message),
        }
    }

    fn field(&mut self, bytes: &[u8]) {
        self.push(&(bytes.len() as u64).to_le_bytes());
        self.push(bytes);
    }

    fn push(&mut self, bytes: &[u8]) {
        if let Some(hash) = &mut self.streaming {
            hash.update(bytes);
        } else if self.message.len() + bytes.len() > digest::MAX_MESSAGE {
            let mut hash = Box::new(Sha256::new());
            hash.update(&self.message);
            hash.update(bytes);
            self.message = Vec::new();
            self.streaming = Some(hash);
        } else {
            self.message.extend_from_slice(bytes);
        }
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
    fn a_retrys_fingerprint_from_the_memo_is_the_first_calls() {
        let first = fp("POST", "/pay", &[("content-type", &["a"])], Some("{}"));
        for _ in 0..3 {
            let mut b = FingerprintBuilder::new(b"POST", b"/pay").for_retry_of(Some([7; 32]));
            b.header("content-type", [&b"a"[..]].into_iter());
            b.body(b"{}");
            assert_eq!(b.finish(), first);
            let mut other = FingerprintBuilder::new(b"POST", b"/pay").for_retry_of(Some([7; 32]));
            other.header("content-type", [&b"a"[..]].into_iter());
            other.body(b"{ }");
            assert_ne!(other.finish(), first, "another body, from the memo or not");
        }
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
    fn a_fingerprint_is_the_sha256_of_its_fields_kept_whole_or_streamed() {
        // The same bytes as hashed field by field before the digest memo: stored entries
        // keep their fingerprints across the upgrade. Short (kept whole) and long (streamed).
        for value in ["application/json".to_string(), "x".repeat(2 * crate::digest::MAX_MESSAGE)] {
            let mut reference = Sha256::new();
            let mut field = |b: &[u8]| {
                reference.update((b.len() as u64).to_le_bytes());
                reference.update(b);
            };
            field(b"POST");
            field(b"/pay");
            field(b"content-type");
            field(value.as_bytes());
            let body: [u8; 32] = Sha256::digest(b"{}").into();
            reference.update(1u64.to_le_bytes());
            reference.update(32u64.to_le_bytes());
            reference.update(body);
            let expected: [u8; 32] = reference.finalize().into();
            let got = fp("POST", "/pay", &[("content-type", &[value.as_str()])], Some("{}"));
            assert_eq!(got.0[..], expected[..16]);
        }
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
