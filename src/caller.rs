//! Who a key belongs to, as the store tells callers apart for fair share
//! (docs/memory.md, "Fair share"): a 20-bit digest of the request's scope values. The
//! scope itself is never stored; the digest is what logs and figures show.

/// A caller's tag. `ANONYMOUS` (0) is every request without a scope: no scope configured, or
/// `missing_scope: "share"`. Those keys are shared on purpose and form one caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Caller(u32);

/// Bits of a tag: an entry keeps it in the unused top of its age field (encoding.rs).
pub const CALLER_BITS: u32 = 20;
const MASK: u64 = (1 << CALLER_BITS) - 1;

impl Caller {
    pub const ANONYMOUS: Caller = Caller(0);

    /// The tag of `scopes` (the values `StoreKey::derive` hashes): FNV-1a over the
    /// length-prefixed values, folded to 20 bits. A scope whose values are all absent, or no
    /// scope at all, is the anonymous caller. Two callers share a tag once in about a million
    /// pairs; they then share one fair share (docs/limits.md).
    pub fn of(scopes: &[Option<&[u8]>]) -> Caller {
        if scopes.iter().all(Option::is_none) {
            return Caller::ANONYMOUS;
        }
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

    #[test]
    fn no_scope_is_the_anonymous_caller() {
        assert_eq!(Caller::of(&[]), Caller::ANONYMOUS);
        assert_eq!(Caller::of(&[None, None]), Caller::ANONYMOUS);
        assert_ne!(Caller::of(&[Some(b"")]), Caller::ANONYMOUS);
        assert_ne!(Caller::of(&[None, Some(b"t")]), Caller::ANONYMOUS);
    }

    #[test]
    fn scopes_are_told_apart_by_value_and_position() {
        let a = Caller::of(&[Some(b"Bearer alice")]);
        assert_eq!(a, Caller::of(&[Some(b"Bearer alice")]));
        assert_ne!(a, Caller::of(&[Some(b"Bearer bob")]));
        assert_ne!(Caller::of(&[Some(b"ab"), Some(b"c")]), Caller::of(&[Some(b"a"), Some(b"bc")]));
        assert_ne!(Caller::of(&[None, Some(b"x")]), Caller::of(&[Some(b"x"), None]));
        assert!(a.bits() < 1 << CALLER_BITS);
    }

    /// The vector `tools/caller_tag.py` is checked against (tests/test_fair_share.py).
    #[test]
    fn caller_tag_vector() {
        assert_eq!(Caller::of(&[Some(b"Bearer e2e-caller")]).short(), "d4abf");
    }

    #[test]
    fn tags_spread() {
        let tags: std::collections::HashSet<Caller> =
            (0..10_000).map(|i| Caller::of(&[Some(format!("tenant-{i}").as_bytes())])).collect();
        assert!(tags.len() > 9_900, "{}", tags.len());
    }
}
