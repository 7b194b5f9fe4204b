//! SHA-256 of a whole message, remembered for messages seen again: a retry storm sends the
//! same key, scope and body again and again, and each of its requests would otherwise hash
//! them anew (three digests, five or six blocks: the largest share of a replay's or a 409's
//! work in the VM).
//!
//! A message is remembered by its exact bytes, compared in full: a hit is the digest of the
//! same bytes, whatever the cheap hash that finds it says. A store key is kept once seen
//! twice within the last `SEEN` keys, and a retry's body and fingerprint with it, so a flood
//! of new keys costs a cheap hash per key and never churns the memo. Per VM (one per worker
//! thread): at most `MAX_ENTRIES` entries and `MEMO_BYTES`, each entry's overhead counted, no
//! message over `MAX_MESSAGE` bytes (docs/memory.md).

use sha2::{Digest, Sha256};
use std::cell::RefCell;
use std::collections::VecDeque;

/// The longest message kept: a store key with a long bearer token, a small body.
pub const MAX_MESSAGE: usize = 4096;
/// The bytes the memo keeps at most, per VM: its messages, and `ENTRY_OVERHEAD` for each.
pub const MEMO_BYTES: usize = 32 * 1024;
/// Entries at most (each lookup compares the cheap hashes of all): three per key of a retry
/// storm on about twenty keys at once.
pub const MAX_ENTRIES: usize = 64;
/// What an entry holds besides its message (its owner, digest, cheap hash, vector: 104 bytes
/// on a 64-bit host, 96 on wasm32), with the allocator's header and the queue's slot.
pub const ENTRY_OVERHEAD: usize = 128;
/// How many recent messages' cheap hashes are kept to tell a message seen again.
const SEEN: usize = 32;
/// A message not used for a window of this long is dropped (`forget_idle`), the memo's copy
/// zeroed: a retry's key, scope and body stay in the memo about a second after its last retry.
pub const IDLE_WINDOW_MS: u64 = 500;

/// The digests of messages seen more than once.
#[derive(Default)]
pub struct DigestMemo {
    kept: VecDeque<Kept>,
    kept_bytes: usize,
    /// Cheap hashes of recent messages, oldest overwritten first.
    seen: Vec<u64>,
    next_seen: usize,
    /// Advanced every `IDLE_WINDOW_MS`; each entry notes the one it was last used in.
    window: u64,
    window_start_ms: u64,
}

struct Kept {
    /// The store key a retry's body or fingerprint was hashed for (zeros for a store key).
    owner: [u8; 32],
    hash: u64,
    message: Vec<u8>,
    digest: [u8; 32],
    used_in: u64,
}

impl Drop for Kept {
    fn drop(&mut self) {
        // The message may hold a bearer token or a body: not left behind in freed memory.
        self.message.fill(0);
        std::hint::black_box(&self.message);
    }
}

impl DigestMemo {
    /// The SHA-256 of `message` hashed for `owner`, from the memo when the same bytes are
    /// kept for the same owner, and whether the message was seen before. Kept once seen
    /// again, or at once with `keep_at_once`.
    pub fn sha256(&mut self, owner: &[u8; 32], message: &[u8], keep_at_once: bool) -> ([u8; 32], bool) {
        if message.len() > MAX_MESSAGE {
            return (plain(message), false);
        }
        let hash = cheap_hash(message);
        let window = self.window;
        if let Some(k) = self
            .kept
            .iter_mut()
            .find(|k| k.hash == hash && k.owner == *owner && crate::bytes::equal(&k.message, message))
        {
            k.used_in = window;
            return (k.digest, true);
        }
        let digest = plain(message);
        let seen = self.seen.contains(&hash);
        if seen || keep_at_once {
            self.keep(*owner, hash, message, digest);
        } else {
            self.saw(hash);
        }
        (digest, seen)
    }

    /// Bytes kept now, overheads included (within `MEMO_BYTES`).
    pub fn kept_bytes(&self) -> usize {
        self.kept_bytes
    }

    fn keep(&mut self, owner: [u8; 32], hash: u64, message: &[u8], digest: [u8; 32]) {
        let bytes = message.len() + ENTRY_OVERHEAD;
        while self.kept_bytes + bytes > MEMO_BYTES || self.kept.len() >= MAX_ENTRIES {
            match self.kept.pop_front() {
                Some(old) => self.kept_bytes -= old.message.len() + ENTRY_OVERHEAD,
                None => return,
            }
        }
        self.kept_bytes += bytes;
        self.kept.push_back(Kept { owner, hash, message: message.to_vec(), digest, used_in: self.window });
    }

    /// Drops what was not used in this window or the last (`IDLE_WINDOW_MS` each).
    pub fn forget_idle(&mut self, now_ms: u64) {
        // A clock stepped back starts a window too: entries must not outlive it.
        if now_ms >= self.window_start_ms && now_ms - self.window_start_ms < IDLE_WINDOW_MS {
            return;
        }
        self.window += 1;
        self.window_start_ms = now_ms;
        let window = self.window;
        self.kept.retain(|k| k.used_in + 1 >= window);
        self.kept_bytes = self.kept.iter().map(|k| k.message.len() + ENTRY_OVERHEAD).sum();
    }

    fn saw(&mut self, hash: u64) {
        if self.seen.len() < SEEN {
            self.seen.push(hash);
        } else if let Some(slot) = self.seen.get_mut(self.next_seen) {
            *slot = hash;
        }
        self.next_seen = (self.next_seen + 1) % SEEN;
    }
}

thread_local! {
    static MEMO: RefCell<DigestMemo> = RefCell::new(DigestMemo::default());
}

/// A store key's SHA-256 through this VM's memo, and whether the same key was seen before
/// (within the last few, or kept): a retry.
pub fn key_sha256(message: &[u8]) -> ([u8; 32], bool) {
    with_memo(|memo| memo.sha256(&NO_OWNER, message, false)).unwrap_or_else(|| (plain(message), false))
}

/// The SHA-256 of a retry's other messages (its body, its fingerprint), kept at once for its
/// store key, as the next retry brings them again: only a request of the same key and scope
/// finds them, so no caller can learn from the time it takes whether another sent some body.
/// A first call's are hashed without the memo (`plain`): its body is new more often than
/// not, and a flood of new keys must not churn the memo.
pub fn retry_sha256(key: &[u8; 32], message: &[u8]) -> [u8; 32] {
    with_memo(|memo| memo.sha256(key, message, true).0).unwrap_or_else(|| plain(message))
}

/// Called from the VM's timer: drops messages idle for a window or more.
pub fn forget_idle(now_ms: u64) {
    let _ = with_memo(|memo| memo.forget_idle(now_ms));
}

/// A store key's message holds its own scope: it is kept for no other owner.
const NO_OWNER: [u8; 32] = [0; 32];

pub fn plain(message: &[u8]) -> [u8; 32] {
    Sha256::digest(message).into()
}

fn with_memo<T>(f: impl FnOnce(&mut DigestMemo) -> T) -> Option<T> {
    MEMO.with(|m| m.try_borrow_mut().ok().map(|mut memo| f(&mut memo)))
}

/// A fast non-cryptographic hash (FxHash's mix over 8-byte words) that only finds candidates:
/// a collision costs one comparison of bytes, never a wrong digest.
fn cheap_hash(bytes: &[u8]) -> u64 {
    const K: u64 = 0x517c_c1b7_2722_0a95;
    let mix = |h: u64, w: u64| (h.rotate_left(5) ^ w).wrapping_mul(K);
    let mut chunks = bytes.chunks_exact(8);
    let mut h = mix(0, bytes.len() as u64);
    for c in &mut chunks {
        h = mix(h, crate::bytes::u64_at(c, 0));
    }
    let mut tail = [0u8; 8];
    for (t, b) in tail.iter_mut().zip(chunks.remainder()) {
        *t = *b;
    }
    mix(h, u64::from_le_bytes(tail))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_is_kept_only_once_seen_again_and_answers_its_own_digest() {
        let mut memo = DigestMemo::default();
        assert_eq!(memo.sha256(&NO_OWNER, b"retry", false), (plain(b"retry"), false));
        assert_eq!(memo.kept_bytes(), 0, "seen once: only its cheap hash");
        assert_eq!(memo.sha256(&NO_OWNER, b"retry", false), (plain(b"retry"), true), "seen again");
        assert_eq!(memo.kept_bytes(), 5 + ENTRY_OVERHEAD, "seen again: kept");
        assert_eq!(memo.sha256(&NO_OWNER, b"retry", false), (plain(b"retry"), true));
        assert_eq!(memo.sha256(&NO_OWNER, b"retrx", false), (plain(b"retrx"), false), "other bytes: their own digest");
        let key = [1u8; 32];
        assert_eq!(memo.sha256(&key, b"body", true), (plain(b"body"), false));
        assert_eq!(memo.kept_bytes(), 9 + 2 * ENTRY_OVERHEAD, "a retry's other messages: kept at once");
        assert_eq!(memo.sha256(&key, b"body", true), (plain(b"body"), true));
        assert_eq!(memo.sha256(&[2u8; 32], b"body", false), (plain(b"body"), false), "kept for its key only");
    }

    #[test]
    fn a_cheap_hash_collision_never_gives_another_messages_digest() {
        let mut memo = DigestMemo::default();
        memo.sha256(&NO_OWNER, b"a", true);
        // Forge the kept entry's hash onto another message: the bytes decide.
        let hash = cheap_hash(b"b");
        if let Some(k) = memo.kept.front_mut() {
            k.hash = hash;
        }
        assert_eq!(memo.sha256(&NO_OWNER, b"b", false).0, plain(b"b"));
    }

    #[test]
    fn a_flood_of_new_messages_keeps_nothing_and_the_memo_stays_within_its_bytes() {
        let mut memo = DigestMemo::default();
        for i in 0..10_000u32 {
            memo.sha256(&NO_OWNER, format!("new-{i}").as_bytes(), false);
        }
        assert_eq!(memo.kept_bytes(), 0);
        assert!(memo.seen.len() <= SEEN);
        let big = vec![7u8; MAX_MESSAGE];
        for i in 0..40u8 {
            let mut m = big.clone();
            m[0] = i;
            memo.sha256(&NO_OWNER, &m, false);
            assert_eq!(memo.sha256(&NO_OWNER, &m, false).0, plain(&m));
            assert!(memo.kept_bytes() <= MEMO_BYTES);
        }
        assert_eq!(memo.kept.len(), MEMO_BYTES / (MAX_MESSAGE + ENTRY_OVERHEAD), "the oldest made room");
        for i in 0..2_000u32 {
            memo.sha256(&NO_OWNER, &i.to_le_bytes(), true);
            assert!(memo.kept_bytes() <= MEMO_BYTES);
        }
        assert_eq!(memo.kept.len(), MAX_ENTRIES, "tiny messages: bounded in count too");
        let huge = vec![1u8; MAX_MESSAGE + 1];
        memo.sha256(&NO_OWNER, &huge, true);
        assert_eq!(memo.sha256(&NO_OWNER, &huge, true).0, plain(&huge));
        assert!(memo.kept.iter().all(|k| k.message.len() <= MAX_MESSAGE), "too long to keep");
    }

    #[test]
    fn what_a_retry_left_is_dropped_about_a_second_after_its_last_use() {
        let mut memo = DigestMemo::default();
        memo.forget_idle(1_000);
        memo.sha256(&NO_OWNER, b"storm", true);
        memo.sha256(&NO_OWNER, b"quiet", true);
        for now in (1_100..=2_400).step_by(100) {
            memo.sha256(&NO_OWNER, b"storm", false);
            memo.forget_idle(now);
        }
        assert_eq!(memo.kept.len(), 1, "the one still retried stays");
        assert_eq!(memo.kept_bytes(), 5 + ENTRY_OVERHEAD);
        memo.forget_idle(2_900);
        memo.forget_idle(3_400);
        assert_eq!((memo.kept.len(), memo.kept_bytes()), (0, 0), "then it goes too");
        memo.sha256(&NO_OWNER, b"again", true);
        memo.forget_idle(100); // the clock stepped back
        memo.forget_idle(200);
        assert_eq!(memo.kept.len(), 1, "used in the last window");
        memo.forget_idle(50);
        assert_eq!(memo.kept.len(), 0, "a clock going back does not keep it longer");
    }

    #[test]
    fn the_cheap_hash_sees_every_byte_and_the_length() {
        assert_ne!(cheap_hash(b""), cheap_hash(b"\0"));
        assert_ne!(cheap_hash(b"12345678a"), cheap_hash(b"12345678b"));
        assert_ne!(cheap_hash(b"abcdefgh"), cheap_hash(b"abcdefgi"));
    }
}
