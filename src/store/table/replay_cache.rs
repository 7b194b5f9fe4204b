//! Responses one VM has replayed, kept (`replay_cache_bytes`). A retry storm on one key is
//! then answered without reading shared data at all for a second after each bucket read, and
//! with one read (the bucket, not the data key) otherwise.
//!
//! Sound because a completed entry never changes before its retention ends; it can only be
//! evicted to make room (docs/behaviour.md §3.8). So:
//! - after a bucket read, a kept response is used only when the bucket, read just now, shows
//!   its entry completed for the same claim (slot, token and key tag): the data key of one
//!   claim never changes (its owner writes it once before it completes; a later writer of the
//!   slot is a later claim, or a blank once the entry is freed);
//! - without one, for [`TRUST_MS`] after the last bucket read that confirmed it, and never past
//!   the entry's retention, for the same key and fingerprint only. An eviction is seen at
//!   most [`TRUST_MS`] late (at once when this VM's own claim or completion made it): a retry
//!   of the evicted key elsewhere runs again, here it is replayed the first answer meanwhile.

use std::collections::VecDeque;
use std::rc::Rc;

use crate::encoding::{Entry, KeyTag, StoredResponse};
use crate::fingerprint::Fingerprint;
use crate::ids::IdMap;

/// What one kept response costs beyond its stored bytes (two map slots, an order entry, the
/// Vec header, the claim's fields).
const OVERHEAD_BYTES: usize = 160;
/// How long a kept response answers without a bucket read confirming it.
pub const TRUST_MS: u64 = 1_000;

struct Kept {
    gen: u64,
    key: KeyTag,
    fingerprint: Fingerprint,
    deadline_ms: u64,
    /// The last bucket read that showed this claim completed.
    confirmed_ms: u64,
    response: Rc<StoredResponse>,
}

/// At most `max_bytes` of responses (and their overhead), the oldest dropped first.
#[derive(Default)]
pub struct ReplayCache {
    max_bytes: usize,
    bytes: usize,
    by_slot: IdMap<u32, Kept>,
    /// The slot each kept key is in, by the first 8 bytes of its tag (a SHA-256's: no caller
    /// chooses them; two that meet only miss).
    by_key: IdMap<u64, u32>,
    /// Insertion order, (slot, gen); pairs whose slot was replaced since are skipped.
    order: VecDeque<(u32, u64)>,
}

impl ReplayCache {
    /// A cache of `max_bytes`; 0 keeps nothing.
    pub fn new(max_bytes: usize) -> Self {
        ReplayCache { max_bytes, ..ReplayCache::default() }
    }

    /// The response of `entry` (completed, in `slot`, read from its bucket just now), if this
    /// VM replayed it before; confirmed until `now + TRUST_MS`.
    pub fn get(&mut self, slot: u32, entry: &Entry, now_ms: u64) -> Option<Rc<StoredResponse>> {
        let kept = self.by_slot.get_mut(&slot)?;
        if kept.gen != entry.gen || kept.key != entry.key {
            return None;
        }
        kept.confirmed_ms = now_ms;
        kept.deadline_ms = entry.deadline_ms;
        Some(Rc::clone(&kept.response))
    }

    /// The kept response of `key`, without a bucket read: confirmed less than `TRUST_MS` ago,
    /// within its retention, for the same fingerprint.
    pub fn trusted(&self, key: &KeyTag, fingerprint: &Fingerprint, now_ms: u64) -> Option<Rc<StoredResponse>> {
        let kept = self.by_slot.get(self.by_key.get(&short(key))?)?;
        let fresh = now_ms < kept.confirmed_ms.saturating_add(TRUST_MS) && now_ms < kept.deadline_ms;
        (kept.key == *key && kept.fingerprint == *fingerprint && fresh).then(|| Rc::clone(&kept.response))
    }

    /// Keeps the response of `entry` (completed, in `slot`), read at `now`.
    pub fn put(&mut self, slot: u32, entry: &Entry, response: &Rc<StoredResponse>, now_ms: u64) {
        self.forget(slot);
        let cost = response.stored_len() + OVERHEAD_BYTES;
        if cost > self.max_bytes {
            return;
        }
        let kept = Kept {
            gen: entry.gen,
            key: entry.key,
            fingerprint: entry.fingerprint,
            deadline_ms: entry.deadline_ms,
            confirmed_ms: now_ms,
            response: Rc::clone(response),
        };
        self.by_slot.insert(slot, kept);
        self.by_key.insert(short(&entry.key), slot);
        self.bytes += cost;
        self.order.push_back((slot, entry.gen));
        while self.bytes > self.max_bytes {
            let Some((slot, gen)) = self.order.pop_front() else { break };
            if self.by_slot.get(&slot).is_some_and(|k| k.gen == gen) {
                self.forget(slot);
            }
        }
        // Replaced slots leave stale pairs behind: keep the order at most twice the map.
        if self.order.len() > 2 * self.by_slot.len() + 16 {
            let by_slot = &self.by_slot;
            self.order.retain(|(slot, gen)| by_slot.get(slot).is_some_and(|k| k.gen == *gen));
        }
    }

    /// Drops the kept response of `key`, wherever it is: this VM claimed the key, so what was
    /// kept of it is no longer its entry.
    pub fn forget_key(&mut self, key: &KeyTag) {
        let Some(&slot) = self.by_key.get(&short(key)) else { return };
        if self.by_slot.get(&slot).is_some_and(|k| k.key == *key) {
            self.forget(slot);
        }
    }

    /// Drops what `slot` holds: this VM evicted or reclaimed its entry.
    pub fn forget(&mut self, slot: u32) {
        if let Some(old) = self.by_slot.remove(&slot) {
            self.bytes -= old.response.stored_len() + OVERHEAD_BYTES;
            if self.by_key.get(&short(&old.key)) == Some(&slot) {
                self.by_key.remove(&short(&old.key));
            }
        }
    }

    /// Bytes held, overhead included.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

fn short(key: &KeyTag) -> u64 {
    crate::bytes::u64_at(key, 0)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;
    use crate::encoding::State;

    fn response(body: &str) -> Rc<StoredResponse> {
        Rc::new(StoredResponse::new(201, [("content-type", &b"text/plain"[..])], body.as_bytes().to_vec()))
    }

    /// A completed entry of claim `gen` for key tag `[k; 16]`, fingerprint `[1; 16]`.
    fn entry(gen: u64, k: u8) -> Entry {
        Entry {
            state: State::Completed,
            gen,
            key: [k; 16],
            fingerprint: Fingerprint([1; 16]),
            deadline_ms: 100_000,
            since_ms: 0,
            bytes: 1,
            caller: crate::caller::Caller::ANONYMOUS,
        }
    }

    #[test]
    fn a_kept_response_answers_only_for_its_own_claim() {
        let mut c = ReplayCache::new(4096);
        c.put(7, &entry(3, 1), &response("three"), 0);
        assert_eq!(c.get(7, &entry(3, 1), 0).unwrap().body(), b"three");
        assert!(c.get(7, &entry(4, 1), 0).is_none(), "a later claim of the slot");
        assert!(c.get(7, &entry(3, 2), 0).is_none(), "another key");
        assert!(c.get(8, &entry(3, 1), 0).is_none(), "another slot");
        c.put(7, &entry(4, 2), &response("four"), 0);
        assert!(c.get(7, &entry(3, 1), 0).is_none(), "replaced");
        assert!(c.trusted(&[1; 16], &Fingerprint([1; 16]), 0).is_none(), "replaced");
        assert_eq!(c.get(7, &entry(4, 2), 0).unwrap().body(), b"four");
    }

    /// Without a bucket read: the same key and fingerprint, within `TRUST_MS` of the last read
    /// that confirmed it and within its retention; never after this VM forgot the slot.
    #[test]
    fn a_kept_response_is_trusted_for_a_while_after_a_bucket_read() {
        let mut c = ReplayCache::new(4096);
        let e = entry(3, 1);
        let fp = Fingerprint([1; 16]);
        c.put(7, &e, &response("three"), 1_000);
        assert_eq!(c.trusted(&[1; 16], &fp, 1_000 + TRUST_MS - 1).unwrap().body(), b"three");
        assert!(c.trusted(&[1; 16], &fp, 1_000 + TRUST_MS).is_none(), "not confirmed for too long");
        assert!(c.trusted(&[1; 16], &Fingerprint([2; 16]), 1_000).is_none(), "another request: the bucket says 422");
        assert!(c.trusted(&[2; 16], &fp, 1_000).is_none(), "another key");
        // A bucket read confirms it again.
        c.get(7, &e, 5_000).unwrap();
        assert!(c.trusted(&[1; 16], &fp, 5_000 + TRUST_MS - 1).is_some());
        // Never past its retention.
        c.get(7, &Entry { deadline_ms: 5_500, ..e }, 5_000).unwrap();
        assert!(c.trusted(&[1; 16], &fp, 5_499).is_some());
        assert!(c.trusted(&[1; 16], &fp, 5_500).is_none());
        c.forget(7);
        assert!(c.trusted(&[1; 16], &fp, 5_000).is_none(), "forgotten");
        assert_eq!(c.bytes(), 0);
    }

    #[test]
    fn it_holds_at_most_its_bytes_and_drops_the_oldest_first() {
        let one = response("x").stored_len() + OVERHEAD_BYTES;
        let mut c = ReplayCache::new(3 * one);
        for slot in 0..10 {
            c.put(slot, &entry(1, slot as u8), &response("x"), 0);
            assert!(c.bytes() <= 3 * one);
        }
        assert!(c.get(6, &entry(1, 6), 0).is_none());
        assert!((7..10).all(|s| c.get(s, &entry(1, s as u8), 0).is_some()));
        assert_eq!(c.by_key.len(), 3, "the index holds the kept keys only");
        // One slot replaced a thousand times: the order does not grow with it.
        for gen in 2..1002 {
            c.put(9, &entry(gen, (gen % 200 + 20) as u8), &response("x"), 0);
        }
        assert!(c.order.len() <= 2 * c.by_slot.len() + 16);
        assert_eq!(c.bytes(), 3 * one);
        assert_eq!(c.by_key.len(), 3);
        assert!(ReplayCache::new(0).get(0, &entry(0, 0), 0).is_none());
        // A later claim of a slot whose response is too large to keep still drops the old one.
        c.put(8, &entry(1, 8), &response(&"y".repeat(4 * one)), 0);
        assert!(c.get(8, &entry(1, 8), 0).is_none() && c.trusted(&[8; 16], &Fingerprint([1; 16]), 0).is_none());
        let mut none = ReplayCache::new(one - 1);
        none.put(0, &entry(1, 0), &response("x"), 0);
        assert_eq!(none.bytes(), 0, "a response larger than the cache is not kept");
    }
}
