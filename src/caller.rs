//! Who a key belongs to, as the store tells callers apart for fair share
//! (docs/memory.md, "Fair share"): a 20-bit digest of the request's scope values, keyed with a
//! secret of the Envoy ([`TagKey`]) so that no client can compute another caller's tag. The
//! scope itself is never stored; the digest is what logs and figures show.

/// A caller's tag. `ANONYMOUS` (0) is every request without a scope: no scope configured, or
/// `missing_scope: "share"`. Those keys are shared on purpose and form one caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Caller(u32);

/// Bits of a tag: an entry keeps it in the unused top of its age field (encoding.rs).
pub const CALLER_BITS: u32 = 20;
const MASK: u64 = (1 << CALLER_BITS) - 1;

/// The secret a caller's tag is keyed with: made once per Envoy and shared by its workers (in
/// its shared data), so that tags cannot be computed, or a victim's matched, without it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TagKey(pub [u8; 16]);

impl TagKey {
    fn halves(&self) -> (u64, u64) {
        let (a, b) = self.0.split_at(8);
        let word = |half: &[u8]| half.iter().rev().fold(0u64, |w, b| (w << 8) | u64::from(*b));
        (word(a), word(b))
    }

    /// 32 hex digits, as the log at configure and `tools/caller_tag.py --key` write it.
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn from_hex(text: &str) -> Option<TagKey> {
        let digits = text.trim().as_bytes();
        if digits.len() != 32 {
            return None;
        }
        let mut key = [0u8; 16];
        for (byte, pair) in key.iter_mut().zip(digits.chunks(2)) {
            *byte = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
        }
        Some(TagKey(key))
    }
}

impl Caller {
    pub const ANONYMOUS: Caller = Caller(0);

    /// The tag of `scopes` (the values `StoreKey::derive` hashes): SipHash-2-4, keyed with
    /// `key`, over the length-prefixed values (an absent value as eight `0xff`), folded to 20
    /// bits. A scope whose values are all absent, or no scope at all, is the anonymous caller.
    /// Two callers share a tag once in about a million pairs; they then share one fair share
    /// (docs/limits.md).
    // std's SipHasher is deprecated as a `HashMap` default only; it is the keyed hash this needs.
    #[allow(deprecated)]
    pub fn of(key: &TagKey, scopes: &[Option<&[u8]>]) -> Caller {
        use std::hash::Hasher;
        if scopes.iter().all(Option::is_none) {
            return Caller::ANONYMOUS;
        }
        let (k0, k1) = key.halves();
        let mut h = std::hash::SipHasher::new_with_keys(k0, k1);
        for scope in scopes {
            match scope {
                None => h.write(b"\xff\xff\xff\xff\xff\xff\xff\xff"),
                Some(v) => {
                    h.write(&(v.len() as u64).to_le_bytes());
                    h.write(v);
                }
            }
        }
        let hash = h.finish();
        let folded = (hash ^ (hash >> 20) ^ (hash >> 40)) & MASK;
        Caller(if folded == 0 { 1 } else { folded as u32 })
    }

    /// The tag the releases before 0.3.0 used: unkeyed FNV-1a, which anyone can compute (the
    /// tests show what a client could do with it).
    #[cfg(test)]
    pub fn unkeyed(scopes: &[Option<&[u8]>]) -> Caller {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |bytes: &[u8]| {
            for b in bytes {
                hash = (hash ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
            }
        };
        for scope in scopes {
            match scope {
                None => eat(b"\xff\xff\xff\xff\xff\xff\xff\xff"),
                Some(v) => {
                    eat(&(v.len() as u64).to_le_bytes());
                    eat(v);
                }
            }
        }
        let folded = (hash ^ (hash >> 20) ^ (hash >> 40)) & MASK;
        Caller(if folded == 0 { 1 } else { folded as u32 })
    }

    /// A tag as stored (`bits` above 20 are dropped).
    pub fn from_bits(bits: u64) -> Caller {
        Caller((bits & MASK) as u32)
    }

    pub fn bits(self) -> u64 {
        u64::from(self.0)
    }

    /// Five hex digits, as logs and `tools/caller_tag.py` write it.
    pub fn short(self) -> String {
        format!("{:05x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: TagKey = TagKey([7; 16]);

    #[test]
    fn no_scope_is_the_anonymous_caller() {
        assert_eq!(Caller::of(&KEY, &[]), Caller::ANONYMOUS);
        assert_eq!(Caller::of(&KEY, &[None, None]), Caller::ANONYMOUS);
        assert_ne!(Caller::of(&KEY, &[Some(b"")]), Caller::ANONYMOUS);
        assert_ne!(Caller::of(&KEY, &[None, Some(b"t")]), Caller::ANONYMOUS);
    }

    #[test]
    fn scopes_are_told_apart_by_value_and_position() {
        let a = Caller::of(&KEY, &[Some(b"Bearer alice")]);
        assert_eq!(a, Caller::of(&KEY, &[Some(b"Bearer alice")]));
        assert_ne!(a, Caller::of(&KEY, &[Some(b"Bearer bob")]));
        assert_ne!(Caller::of(&KEY, &[Some(b"ab"), Some(b"c")]), Caller::of(&KEY, &[Some(b"a"), Some(b"bc")]));
        assert_ne!(Caller::of(&KEY, &[None, Some(b"x")]), Caller::of(&KEY, &[Some(b"x"), None]));
        assert!(a.bits() < 1 << CALLER_BITS);
    }

    /// The vector `tools/caller_tag.py` is checked against (tests/test_fair_share.py).
    #[test]
    fn caller_tag_vector() {
        let key = TagKey::from_hex("000102030405060708090a0b0c0d0e0f").unwrap();
        assert_eq!(key.hex(), "000102030405060708090a0b0c0d0e0f");
        assert_eq!(Caller::of(&key, &[Some(b"Bearer e2e-caller")]).short(), "fa960");
    }

    #[test]
    fn tags_spread() {
        let tags: std::collections::HashSet<Caller> =
            (0..10_000).map(|i| Caller::of(&KEY, &[Some(format!("tenant-{i}").as_bytes())])).collect();
        assert!(tags.len() > 9_900, "{}", tags.len());
    }

    /// Defect (a review of identities): the tag was unkeyed FNV-1a, so a client could search
    /// for a scope with a victim's tag (203,000 tries of a Python loop) and share its fair
    /// share. Keyed, a scope found that way matches the victim's tag only by chance (one in a
    /// million), and which scopes do depends on each Envoy's secret.
    #[test]
    fn a_scope_matching_a_victims_unkeyed_tag_does_not_match_its_keyed_one() {
        let victim: &[u8] = b"Bearer victim";
        let target = Caller::unkeyed(&[Some(victim)]);
        let forged = (0u64..)
            .map(|n| format!("Bearer forged-{n}"))
            .find(|s| Caller::unkeyed(&[Some(s.as_bytes())]) == target)
            .unwrap();
        assert_eq!(Caller::unkeyed(&[Some(forged.as_bytes())]), target, "the old tag is matched");
        for secret in [[1u8; 16], [2; 16], [0xa5; 16]] {
            let key = TagKey(secret);
            assert_ne!(Caller::of(&key, &[Some(forged.as_bytes())]), Caller::of(&key, &[Some(victim)]));
        }
        assert_ne!(
            Caller::of(&TagKey([1; 16]), &[Some(victim)]),
            Caller::of(&TagKey([2; 16]), &[Some(victim)]),
            "each Envoy's tags are its own"
        );
    }

    #[test]
    fn a_tag_key_reads_back_from_its_hex_and_refuses_anything_else() {
        assert_eq!(TagKey::from_hex(&KEY.hex()), Some(KEY));
        assert_eq!(TagKey::from_hex("00"), None);
        assert_eq!(TagKey::from_hex(&"zz".repeat(16)), None);
    }
}
