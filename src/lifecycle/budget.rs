//! Bytes a worker buffers for requests in flight (docs/behaviour.md §3.8, `max_buffered_bytes`): captures
//! of router-mode answers and the bodies of held duplicates share one total per worker. A
//! [`Reservation`] gives its bytes back when it is dropped, however its request ends.
//!
//! The total is shared per caller (docs/behaviour.md §3.4): no caller holds more than half of
//! it, so one caller running it out is refused itself, and the others keep the other half.
//! Callers this worker has not seen claim twice ([`Known`]) count as one: a new identity per
//! request is not a fresh half.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use crate::caller::Caller;
use crate::ids::IdMap;

/// Who a share is counted for: a known caller's tag, or every caller not known, together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Group(u32);

impl Group {
    /// The callers this worker does not know, together.
    pub const UNKNOWN: Group = Group(u32::MAX);
}

#[derive(Clone, Debug)]
pub struct Budget(Rc<Inner>);

#[derive(Debug)]
struct Inner {
    used: Cell<usize>,
    limit: usize,
    /// Bytes held per group.
    held: RefCell<IdMap<u32, usize>>,
}

impl Budget {
    pub fn new(limit: usize) -> Budget {
        Budget(Rc::new(Inner { used: Cell::new(0), limit, held: RefCell::new(IdMap::default()) }))
    }

    /// `bytes` more for `group`, if they fit under the limit and its share.
    pub fn reserve(&self, group: Group, bytes: usize) -> Option<Reservation> {
        let mut r = Reservation { budget: self.clone(), group, bytes: 0 };
        r.grow(bytes).then_some(r)
    }

    pub fn used(&self) -> usize {
        self.0.used.get()
    }
}

/// Whether `group`, holding `held` of a resource of `limit` in all (`used` taken), may take
/// `more`: within the limit, and at most half of it (at least one unit).
pub fn fits(used: usize, held: usize, more: usize, limit: usize) -> bool {
    let share = (limit / 2).max(1).min(limit);
    used.checked_add(more).is_some_and(|t| t <= limit) && held.checked_add(more).is_some_and(|h| h <= share)
}

#[derive(Debug)]
pub struct Reservation {
    budget: Budget,
    group: Group,
    bytes: usize,
}

impl Reservation {
    /// Takes `more` bytes; `false` (and nothing taken) when they do not fit the limit or the
    /// group's share.
    pub fn grow(&mut self, more: usize) -> bool {
        let inner = &self.budget.0;
        let mut held = inner.held.borrow_mut();
        let mine = held.get(&self.group.0).copied().unwrap_or(0);
        if !fits(inner.used.get(), mine, more, inner.limit) {
            return false;
        }
        inner.used.set(inner.used.get() + more);
        held.insert(self.group.0, mine + more);
        self.bytes += more;
        true
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let inner = &self.budget.0;
        inner.used.set(inner.used.get().saturating_sub(self.bytes));
        let mut held = inner.held.borrow_mut();
        let left = held.get(&self.group.0).copied().unwrap_or(0).saturating_sub(self.bytes);
        if left == 0 {
            held.remove(&self.group.0);
        } else {
            held.insert(self.group.0, left);
        }
    }
}

/// The callers a worker has seen claim twice lately: a direct-mapped table of `SLOTS` tags
/// (a tag that meets another's slot takes it), so it is bounded whatever callers pass.
#[derive(Debug)]
pub struct Known {
    slots: Vec<(u32, u8)>,
}

const SLOTS: usize = 1_024;

impl Default for Known {
    fn default() -> Self {
        Known { slots: vec![(0, 0); SLOTS] }
    }
}

impl Known {
    /// `caller` claimed a key. A newcomer whose slot holds a known caller wears it down by
    /// one claim instead of taking it: a flood of identities that claim once each cannot make
    /// a caller that claims often a stranger (its slot goes only after as many collisions as
    /// it made claims).
    pub fn claimed(&mut self, caller: Caller) {
        let tag = caller.bits() as u32;
        if let Some(slot) = self.slots.get_mut(tag as usize % SLOTS) {
            *slot = match *slot {
                (t, n) if t == tag => (t, n.saturating_add(1)),
                (t, n) if n >= 2 => (t, n - 1),
                _ => (tag, 1),
            };
        }
    }

    /// The group `caller`'s shares count in.
    pub fn group(&self, caller: Caller) -> Group {
        let tag = caller.bits() as u32;
        match self.slots.get(tag as usize % SLOTS) {
            Some((t, n)) if *t == tag && *n >= 2 => Group(tag),
            _ => Group::UNKNOWN,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Group = Group(1);
    const B: Group = Group(2);

    #[test]
    fn reservations_share_one_limit_and_give_back_on_drop() {
        let budget = Budget::new(100);
        let mut a = budget.reserve(A, 40).unwrap();
        let b = budget.reserve(B, 50).unwrap();
        assert!(budget.reserve(Group::UNKNOWN, 20).is_none(), "over the limit");
        assert!(!a.grow(11), "full");
        assert_eq!(budget.used(), 90);
        drop(b);
        assert!(a.grow(10));
        assert_eq!((a.bytes(), budget.used()), (50, 50));
        drop(a);
        assert_eq!(budget.used(), 0);
        assert!(budget.reserve(A, usize::MAX).is_none());
    }

    /// One caller running the buffer out is refused itself: it holds at most half, and the
    /// others keep the rest.
    #[test]
    fn no_group_holds_more_than_half() {
        let budget = Budget::new(100);
        let held: Vec<Reservation> = (0..10).filter_map(|_| budget.reserve(A, 10)).collect();
        assert_eq!(held.len(), 5, "a half for the first caller");
        assert!(budget.reserve(A, 1).is_none());
        assert!(budget.reserve(B, 50).is_some(), "the other half for the others");
    }

    /// A new identity per request: every caller this worker has not seen claim twice is one
    /// group.
    #[test]
    fn callers_not_seen_twice_share_one_half() {
        let mut known = Known::default();
        let (alice, bob) = (Caller::from_bits(7), Caller::from_bits(9));
        known.claimed(alice);
        assert_eq!(known.group(alice), Group::UNKNOWN, "seen once");
        known.claimed(alice);
        assert_eq!(known.group(alice), Group(7));
        let budget = Budget::new(100);
        let invented: Vec<Reservation> =
            (100..200u64).filter_map(|n| budget.reserve(known.group(Caller::from_bits(n)), 10)).collect();
        assert_eq!(invented.len(), 5, "a hundred identities, one half");
        assert!(budget.reserve(known.group(alice), 50).is_some(), "the known caller keeps its half");
        assert_eq!(known.group(bob), Group::UNKNOWN);
    }

    /// A flood of identities that claim once each, some landing in a known caller's slot,
    /// leaves that caller known; a newcomer takes a slot only from a caller seen once.
    #[test]
    fn a_flood_of_one_claim_identities_does_not_make_a_known_caller_a_stranger() {
        let mut known = Known::default();
        let alice = Caller::from_bits(7);
        for _ in 0..4 {
            known.claimed(alice);
        }
        // Three newcomers in alice's slot (same tag modulo the slots) wear her down to one.
        for n in 1..=2u64 {
            known.claimed(Caller::from_bits(7 + n * SLOTS as u64));
            assert_eq!(known.group(alice), Group(7), "after {n} collisions");
        }
        known.claimed(Caller::from_bits(7 + 3 * SLOTS as u64));
        assert_eq!(known.group(alice), Group::UNKNOWN, "worn down to one claim");
        known.claimed(Caller::from_bits(7 + 4 * SLOTS as u64));
        assert_eq!(known.group(Caller::from_bits(7 + 4 * SLOTS as u64)), Group::UNKNOWN, "seen once");
        // A flood over every slot, once each, leaves a caller with claims to spare known.
        let bob = Caller::from_bits(9);
        for _ in 0..5 {
            known.claimed(bob);
        }
        for n in 0..(2 * SLOTS as u64) {
            known.claimed(Caller::from_bits(100_000 + n));
        }
        assert_eq!(known.group(bob), Group(9));
    }

    #[test]
    fn a_share_fits_within_the_limit_and_at_most_half_of_it() {
        assert!(fits(0, 0, 50, 100) && !fits(0, 0, 51, 100));
        assert!(fits(99, 0, 1, 100) && !fits(100, 0, 1, 100));
        assert!(fits(0, 0, 1, 1), "a limit of one still admits one");
        assert!(!fits(0, 0, 1, 0));
        assert!(!fits(usize::MAX, 0, 1, usize::MAX));
    }
}
