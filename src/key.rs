//! The `Idempotency-Key` header (docs/behaviour.md §3.1) and the store key derived from it.

/// Why a key header was refused with 400.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyError {
    Empty,
    TooLong,
    /// Not visible ASCII, or a malformed RFC 8941 string.
    Malformed,
}

impl KeyError {
    pub fn detail(self, max_len: usize) -> String {
        match self {
            KeyError::Empty => "The Idempotency-Key header is empty.".into(),
            KeyError::TooLong => format!("The Idempotency-Key is longer than {max_len} characters."),
            KeyError::Malformed => {
                "The Idempotency-Key must be visible ASCII, bare or as a quoted string (RFC 8941).".into()
            }
        }
    }
}

/// Parses a key header value: bare visible ASCII (`abc`) or an RFC 8941 sf-string (`"abc"`,
/// with `\"` and `\\` escapes). Both forms of the same characters name the same key.
pub fn parse_key(raw: &[u8], max_len: usize) -> Result<Vec<u8>, KeyError> {
    let key = match raw.first() {
        None => return Err(KeyError::Empty),
        Some(b'"') => parse_sf_string(raw)?,
        Some(_) => {
            if !raw.iter().all(|b| (0x21..=0x7e).contains(b)) {
                return Err(KeyError::Malformed);
            }
            raw.to_vec()
        }
    };
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > max_len {
        return Err(KeyError::TooLong);
    }
    Ok(key)
}

/// RFC 8941 §4.2.5: a string is DQUOTE, printable ASCII with `\"` and `\\` escapes, DQUOTE.
/// Nothing may follow the closing quote (we accept no parameters on the key).
fn parse_sf_string(raw: &[u8]) -> Result<Vec<u8>, KeyError> {
    let mut out = Vec::with_capacity(raw.len());
    let mut bytes = raw.iter().skip(1);
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(e),
                _ => return Err(KeyError::Malformed),
            },
            b'"' => {
                return if bytes.next().is_none() { Ok(out) } else { Err(KeyError::Malformed) };
            }
            0x20..=0x7e => out.push(b),
            _ => return Err(KeyError::Malformed),
        }
    }
    Err(KeyError::Malformed) // no closing quote
}

/// The store key: SHA-256 over the namespace, the host, the scope values and the client's key.
/// The raw key and scope values are never stored, only this hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StoreKey(pub [u8; 32]);

impl StoreKey {
    pub fn derive(namespace: &str, authority: &[u8], scopes: &[Option<&[u8]>], key: &[u8]) -> StoreKey {
        Self::derive_noting_retries(namespace, authority, scopes, key).0
    }

    /// The store key, and whether this VM saw the same one a few keys ago (a retry: its body
    /// and fingerprint go through the digest memo too).
    pub fn derive_noting_retries(
        namespace: &str,
        authority: &[u8],
        scopes: &[Option<&[u8]>],
        key: &[u8],
    ) -> (StoreKey, bool) {
        // The message whole, so that a retry's is found in the digest memo.
        let mut message = Vec::with_capacity(160);
        // Length prefixes keep ("ab","c") and ("a","bc") apart.
        let mut field = |bytes: &[u8]| {
            message.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            message.extend_from_slice(bytes);
        };
        field(namespace.as_bytes());
        field(authority);
        for scope in scopes {
            match scope {
                // An absent scope is the anonymous scope, distinct from an empty value.
                None => field(b"\x00absent"),
                Some(v) => field(v),
            }
        }
        field(key);
        let (digest, retry) = crate::digest::key_sha256(&message);
        (StoreKey(digest), retry)
    }

    /// A short hex form for logs (never the raw key).
    pub fn short(&self) -> String {
        let mut out = String::with_capacity(12);
        self.push_short(&mut out);
        out
    }

    /// Appends [`StoreKey::short`] to `out`. Written by hand: every decision record carries it,
    /// and `format!` per byte cost a replay about a tenth of its Wasm work (docs/performance.md).
    pub fn push_short(&self, out: &mut String) {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        for b in self.0.iter().take(6) {
            out.push(char::from(HEX.get(usize::from(b >> 4)).copied().unwrap_or(b'0')));
            out.push(char::from(HEX.get(usize::from(b & 15)).copied().unwrap_or(b'0')));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_and_quoted_name_the_same_key() {
        assert_eq!(parse_key(b"abc-123", 255).unwrap(), b"abc-123");
        assert_eq!(parse_key(b"\"abc-123\"", 255).unwrap(), b"abc-123");
        assert_eq!(parse_key(br#""a\"b\\c""#, 255).unwrap(), br#"a"b\c"#);
        assert_eq!(parse_key(b"\"with space\"", 255).unwrap(), b"with space");
    }

    #[test]
    fn malformed_keys_are_refused() {
        assert_eq!(parse_key(b"", 255), Err(KeyError::Empty));
        assert_eq!(parse_key(b"\"\"", 255), Err(KeyError::Empty));
        for bad in [
            &b"a b"[..],
            b"caf\xc3\xa9",
            b"tab\there",
            b"\x7f",
            b"\"unterminated",
            b"\"bad\\escape\"",
            b"\"trailing\"x",
            b"\"ctl\x01\"",
            b"\"caf\xc3\xa9\"",
        ] {
            assert_eq!(parse_key(bad, 255), Err(KeyError::Malformed), "{bad:?}");
        }
    }

    #[test]
    fn length_counts_the_decoded_key() {
        let long = vec![b'k'; 256];
        assert_eq!(parse_key(&long, 255), Err(KeyError::TooLong));
        assert!(parse_key(&long[..255], 255).is_ok());
        let mut quoted = vec![b'"'];
        quoted.extend_from_slice(&long[..255]);
        quoted.push(b'"');
        assert!(parse_key(&quoted, 255).is_ok());
    }

    /// The vector `tests/test_encodings.py` checks the Python copy (tests/chaos.py) against.
    #[test]
    fn store_key_vector() {
        let k = StoreKey::derive("idem", b"localhost", &[Some(b"Bearer e2e-caller")], b"vector-key");
        let hex: String = k.0.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "2cf6ad973cc0d74141c28f40258ea4426f5731fa10da47ab86dc3dd54cbdd879");
    }

    #[test]
    fn store_key_separates_namespace_host_scope_and_key() {
        let base = StoreKey::derive("idem", b"api", &[Some(b"tok")], b"k1");
        assert_eq!(base, StoreKey::derive("idem", b"api", &[Some(b"tok")], b"k1"));
        assert_ne!(base, StoreKey::derive("idem2", b"api", &[Some(b"tok")], b"k1"));
        assert_ne!(base, StoreKey::derive("idem", b"api2", &[Some(b"tok")], b"k1"));
        assert_ne!(base, StoreKey::derive("idem", b"api", &[Some(b"tok2")], b"k1"));
        assert_ne!(base, StoreKey::derive("idem", b"api", &[None], b"k1"));
        assert_ne!(base, StoreKey::derive("idem", b"api", &[Some(b"tok")], b"k2"));
        assert_ne!(StoreKey::derive("idem", b"ab", &[], b"c"), StoreKey::derive("idem", b"a", &[], b"bc"));
        assert_ne!(StoreKey::derive("idem", b"a", &[Some(b"")], b"k"), StoreKey::derive("idem", b"a", &[None], b"k"));
    }
}
