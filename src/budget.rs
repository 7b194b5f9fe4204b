//! Bytes a worker buffers for requests in flight (docs/behaviour.md §3.8, `max_buffered_bytes`): captures
//! of router-mode answers and the bodies of held duplicates share one total per worker. A
//! [`Reservation`] gives its bytes back when it is dropped, however its request ends.

use std::cell::Cell;
use std::rc::Rc;

#[derive(Clone, Debug)]
pub struct Budget(Rc<Inner>);

#[derive(Debug)]
struct Inner {
    used: Cell<usize>,
    limit: usize,
}

impl Budget {
    pub fn new(limit: usize) -> Budget {
        Budget(Rc::new(Inner { used: Cell::new(0), limit }))
    }

    /// `bytes` more, if they fit under the limit.
    pub fn reserve(&self, bytes: usize) -> Option<Reservation> {
        let mut r = Reservation { budget: self.clone(), bytes: 0 };
        r.grow(bytes).then_some(r)
    }

    pub fn used(&self) -> usize {
        self.0.used.get()
    }
}

#[derive(Debug)]
pub struct Reservation {
    budget: Budget,
    bytes: usize,
}

impl Reservation {
    /// Takes `more` bytes; `false` (and nothing taken) when they do not fit.
    pub fn grow(&mut self, more: usize) -> bool {
        let inner = &self.budget.0;
        match inner.used.get().checked_add(more) {
            Some(total) if total <= inner.limit => {
                inner.used.set(total);
                self.bytes += more;
                true
            }
            _ => false,
        }
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let used = &self.budget.0.used;
        used.set(used.get().saturating_sub(self.bytes));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_share_one_limit_and_give_back_on_drop() {
        let budget = Budget::new(100);
        let mut a = budget.reserve(60).unwrap();
        assert!(budget.reserve(50).is_none());
        let b = budget.reserve(40).unwrap();
        assert!(!a.grow(1), "full");
        assert_eq!(budget.used(), 100);
        drop(b);
        assert!(a.grow(30));
        assert_eq!((a.bytes(), budget.used()), (90, 90));
        drop(a);
        assert_eq!(budget.used(), 0);
        assert!(budget.reserve(usize::MAX).is_none());
    }
}
