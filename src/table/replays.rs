//! Responses one VM has replayed, kept so that the next replay of the same entry reads its
//! bucket only (`replay_cache_bytes`). A retry storm on one key is then one shared-data read
//! per retry instead of two.
//!
//! Sound because the bucket still decides every request: a kept response is used only when
//! the bucket, read just now, shows its entry completed for the same claim (slot, token and
//! key tag), and the data key of one claim never changes: its owner writes it once before it
//! completes, and a later writer of the slot is a later claim (a larger token, a different
//! bucket entry) or a blank once the entry is freed.

use std::collections::VecDeque;
use std::rc::Rc;

use crate::encoding::{KeyTag, StoredResponse};
use crate::ids::IdMap;

/// What one kept response costs beyond its stored bytes (map slot, order entry, Vec header).
const OVERHEAD_BYTES: usize = 96;

struct Kept {
    gen: u64,
    key: KeyTag,
    response: Rc<StoredResponse>,
}

/// At most `max_bytes` of responses (and their overhead), the oldest dropped first.
#[derive(Default)]
pub struct ReplayCache {
    max_bytes: usize,
    bytes: usize,
    by_slot: IdMap<u32, Kept>,
    /// Insertion order, (slot, gen); pairs whose slot was replaced since are skipped.
    order: VecDeque<(u32, u64)>,
}

impl ReplayCache {
    /// A cache of `max_bytes`; 0 keeps nothing.
    pub fn new(max_bytes: usize) -> Self {
        ReplayCache { max_bytes, ..ReplayCache::default() }
    }

    /// The response of the claim (`slot`, `gen`, `key`), if this VM replayed it before.
    pub fn get(&self, slot: u32, gen: u64, key: &KeyTag) -> Option<Rc<StoredResponse>> {
        let kept = self.by_slot.get(&slot)?;
        (kept.gen == gen && kept.key == *key).then(|| Rc::clone(&kept.response))
    }

    pub fn put(&mut self, slot: u32, gen: u64, key: KeyTag, response: &Rc<StoredResponse>) {
        let cost = response.stored_len() + OVERHEAD_BYTES;
        if cost > self.max_bytes {
            return;
        }
        if let Some(old) = self.by_slot.insert(slot, Kept { gen, key, response: Rc::clone(response) }) {
            self.bytes -= old.response.stored_len() + OVERHEAD_BYTES;
        }
        self.bytes += cost;
        self.order.push_back((slot, gen));
        while self.bytes > self.max_bytes {
            let Some((slot, gen)) = self.order.pop_front() else { break };
            if self.by_slot.get(&slot).is_some_and(|k| k.gen == gen) {
                if let Some(old) = self.by_slot.remove(&slot) {
                    self.bytes -= old.response.stored_len() + OVERHEAD_BYTES;
                }
            }
        }
        // Replaced slots leave stale pairs behind: keep the order at most twice the map.
        if self.order.len() > 2 * self.by_slot.len() + 16 {
            let by_slot = &self.by_slot;
            self.order.retain(|(slot, gen)| by_slot.get(slot).is_some_and(|k| k.gen == *gen));
        }
    }

    /// Bytes held, overhead included.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    fn response(body: &str) -> Rc<StoredResponse> {
        Rc::new(StoredResponse::new(201, [("content-type", &b"text/plain"[..])], body.as_bytes().to_vec()))
    }

    #[test]
    fn a_kept_response_answers_only_for_its_own_claim() {
        let mut c = ReplayCache::new(4096);
        c.put(7, 3, [1; 16], &response("three"));
        assert_eq!(c.get(7, 3, &[1; 16]).unwrap().body(), b"three");
        assert!(c.get(7, 4, &[1; 16]).is_none(), "a later claim of the slot");
        assert!(c.get(7, 3, &[2; 16]).is_none(), "another key");
        assert!(c.get(8, 3, &[1; 16]).is_none(), "another slot");
        c.put(7, 4, [2; 16], &response("four"));
        assert!(c.get(7, 3, &[1; 16]).is_none(), "replaced");
        assert_eq!(c.get(7, 4, &[2; 16]).unwrap().body(), b"four");
    }

    #[test]
    fn it_holds_at_most_its_bytes_and_drops_the_oldest_first() {
        let one = response("x").stored_len() + OVERHEAD_BYTES;
        let mut c = ReplayCache::new(3 * one);
        for slot in 0..10 {
            c.put(slot, 1, [0; 16], &response("x"));
            assert!(c.bytes() <= 3 * one);
        }
        assert!(c.get(6, 1, &[0; 16]).is_none());
        assert!((7..10).all(|s| c.get(s, 1, &[0; 16]).is_some()));
        // One slot replaced a thousand times: the order does not grow with it.
        for gen in 2..1002 {
            c.put(9, gen, [0; 16], &response("x"));
        }
        assert!(c.order.len() <= 2 * c.by_slot.len() + 16);
        assert_eq!(c.bytes(), 3 * one);
        assert!(ReplayCache::new(0).get(0, 0, &[0; 16]).is_none());
        let mut none = ReplayCache::new(one - 1);
        none.put(0, 1, [0; 16], &response("x"));
        assert_eq!(none.bytes(), 0, "a response larger than the cache is not kept");
    }
}
