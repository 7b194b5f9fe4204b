//! Who holds the table: counted by the sweep, one pass over every bucket at a time, so an
//! operator sees the heaviest caller's share without a request paying for it.

use crate::caller::Caller;
use crate::ids::IdMap;

/// Callers counted one by one in a pass; past this many, the rest count in the totals only
/// (a caller that floods is met in the first buckets: its keys are everywhere).
pub const CENSUS_CALLERS: usize = 256;

/// The heaviest caller of a finished pass, and its share in thousandths.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Heaviest {
    pub caller: Caller,
    pub entries_permille: u64,
    pub bytes_permille: u64,
}

/// What one pass has counted so far.
#[derive(Debug, Default)]
pub struct Census {
    held: IdMap<u32, (u64, u64)>,
    entries: u64,
    bytes: u64,
    buckets: u32,
}

impl Census {
    /// A live entry of `caller` holding `bytes`.
    pub fn add(&mut self, caller: Caller, bytes: u64) {
        self.entries += 1;
        self.bytes += bytes;
        let tag = caller.bits() as u32;
        if let Some((e, b)) = self.held.get_mut(&tag) {
            *e += 1;
            *b += bytes;
        } else if self.held.len() < CENSUS_CALLERS {
            self.held.insert(tag, (1, bytes));
        }
    }

    /// One more bucket counted; at `of` buckets the pass is over: its figures come out and
    /// the next pass starts from nothing.
    pub fn bucket_done(&mut self, of: u32) -> Option<Heaviest> {
        self.buckets += 1;
        if self.buckets < of {
            return None;
        }
        let done = std::mem::take(self);
        let permille = |part: u64, whole: u64| (part * 1000).checked_div(whole).unwrap_or(0);
        let by_entries = done.held.iter().max_by_key(|(tag, (e, b))| (*e, *b, std::cmp::Reverse(**tag)));
        Some(match by_entries {
            Some((tag, (e, b))) => Heaviest {
                caller: Caller::from_bits(u64::from(*tag)),
                entries_permille: permille(*e, done.entries),
                bytes_permille: permille(*b, done.bytes),
            },
            None => Heaviest::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pass_names_the_heaviest_caller_and_its_shares() {
        let mut c = Census::default();
        let (a, b) = (Caller::from_bits(7), Caller::from_bits(9));
        for _ in 0..3 {
            c.add(a, 10);
        }
        c.add(b, 70);
        assert_eq!(c.bucket_done(2), None);
        let h = c.bucket_done(2).unwrap();
        assert_eq!(h, Heaviest { caller: a, entries_permille: 750, bytes_permille: 300 });
        assert_eq!(c.bucket_done(1), Some(Heaviest::default()), "the next pass starts empty");
    }

    #[test]
    fn callers_past_the_bound_count_in_the_totals_only() {
        let mut c = Census::default();
        for n in 0..(CENSUS_CALLERS as u64 + 10) {
            c.add(Caller::from_bits(n + 1), 1);
        }
        assert_eq!(c.held.len(), CENSUS_CALLERS);
        assert_eq!(c.entries, CENSUS_CALLERS as u64 + 10);
    }
}
