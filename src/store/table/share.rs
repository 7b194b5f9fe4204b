//! Fair share inside one bucket (docs/memory.md, "Fair share"): what each caller holds
//! there, and whose entry makes room. A bucket holds at most `ENTRIES` entries, so a few
//! linear scans over at most that many callers are all it takes.

use crate::caller::Caller;

/// A live completed entry that room may be taken from.
#[derive(Debug, Clone, Copy)]
struct Evictable {
    caller: Caller,
    index: usize,
    since_ms: u64,
    amount: u64,
}

/// The entry chosen to make room, and how much its caller held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Victim {
    pub index: usize,
    pub held: u64,
    pub caller: Caller,
}

/// What each caller holds in one bucket: entries (for `capacity`) or bytes (for the budget).
#[derive(Debug, Default)]
pub(super) struct Holdings {
    totals: Vec<(Caller, u64)>,
    evictable: Vec<Evictable>,
}

impl Holdings {
    /// `caller` holds `amount` more; `evictable`: the entry's index and age, when it may be
    /// evicted (live and completed).
    pub fn add(&mut self, caller: Caller, amount: u64, evictable: Option<(usize, u64)>) {
        match self.totals.iter_mut().find(|(c, _)| *c == caller) {
            Some((_, total)) => *total += amount,
            None => self.totals.push((caller, amount)),
        }
        if let Some((index, since_ms)) = evictable {
            self.evictable.push(Evictable { caller, index, since_ms, amount });
        }
    }

    fn total(&self, caller: Caller) -> u64 {
        self.totals.iter().find(|(c, _)| *c == caller).map_or(0, |(_, t)| *t)
    }

    /// The oldest evictable entry of the caller holding the most among those that have one.
    /// A tie goes to `prefer` (the claimer or completer pays for its own room first), then
    /// to the older entry.
    pub fn victim(&self, prefer: Option<Caller>) -> Option<Victim> {
        let mut best: Option<(Evictable, u64)> = None;
        for e in &self.evictable {
            let held = self.total(e.caller);
            let better = match &best {
                None => true,
                Some((b, b_held)) => {
                    let rank = |c: Caller, h: u64| (h, prefer == Some(c));
                    let (mine, theirs) = (rank(e.caller, held), rank(b.caller, *b_held));
                    mine > theirs || (mine == theirs && e.since_ms < b.since_ms)
                }
            };
            if better {
                best = Some((*e, held));
            }
        }
        best.map(|(e, held)| Victim { index: e.index, held, caller: e.caller })
    }

    /// Takes entry `index` out (evicted): its caller holds that much less.
    pub fn remove(&mut self, index: usize) {
        if let Some(at) = self.evictable.iter().position(|e| e.index == index) {
            let e = self.evictable.swap_remove(at);
            if let Some((_, total)) = self.totals.iter_mut().find(|(c, _)| *c == e.caller) {
                *total = total.saturating_sub(e.amount);
            }
        }
    }

    /// Whether a caller holding `held` of `whole` held less than an even share of it among
    /// the callers present.
    pub fn below_share(&self, held: u64, whole: u64) -> bool {
        held.saturating_mul(self.totals.len() as u64) < whole
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller(n: u32) -> Caller {
        Caller::from_bits(u64::from(n))
    }

    #[test]
    fn room_comes_from_the_heaviest_callers_oldest_entry() {
        let mut h = Holdings::default();
        h.add(caller(1), 1, Some((0, 10)));
        h.add(caller(2), 1, Some((1, 20)));
        h.add(caller(2), 1, Some((2, 30)));
        h.add(caller(1), 1, None); // a mark: counted, never evicted
        h.add(caller(2), 1, Some((3, 5)));
        assert_eq!(h.victim(None), Some(Victim { index: 3, held: 3, caller: caller(2) }));
        h.remove(3);
        // 2 each now: the tie goes to the preferred caller, else to the older entry.
        assert_eq!(h.victim(Some(caller(2))).map(|v| v.index), Some(1));
        assert_eq!(h.victim(None).map(|v| v.index), Some(0));
    }

    #[test]
    fn a_caller_of_marks_only_is_passed_over() {
        let mut h = Holdings::default();
        for _ in 0..5 {
            h.add(caller(1), 1, None);
        }
        h.add(caller(2), 1, Some((7, 1)));
        let v = h.victim(None).unwrap();
        assert_eq!((v.index, v.caller), (7, caller(2)));
        assert!(h.below_share(v.held, 6), "1 of 6 between two callers");
        assert!(!h.below_share(5, 6));
    }

    #[test]
    fn nothing_evictable_is_no_victim() {
        let mut h = Holdings::default();
        h.add(caller(1), 1, None);
        assert_eq!(h.victim(Some(caller(1))), None);
    }
}
