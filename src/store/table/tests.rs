//! The core against a store with Envoy's exact CAS semantics and a fake clock (compiled under
//! #[cfg(test)] by engine.rs).

use super::*;
use crate::host::memory::MemoryKv;
#[cfg(not(target_family = "wasm"))]
use std::sync::atomic::{AtomicUsize, Ordering};
#[cfg(not(target_family = "wasm"))]
use std::sync::{Arc, Barrier};

const LEASE: u64 = 10_000;
const RETENTION: u64 = 60_000;

/// Byte budget large enough never to evict in the tests that are not about it.
const PLENTY: u64 = 1 << 40;

fn table(capacity: usize) -> Table<MemoryKv> {
    table_with_budget(capacity, PLENTY)
}

fn table_with_budget(capacity: usize, max_store_bytes: u64) -> Table<MemoryKv> {
    let t = Table::new(MemoryKv::new(), Layout::new("t", capacity, max_store_bytes));
    assert!(t.create().unwrap());
    t
}

fn key(n: u64) -> StoreKey {
    StoreKey::derive("t", b"host", &[], n.to_string().as_bytes())
}

fn fp(n: u8) -> Fingerprint {
    Fingerprint([n; 16])
}

fn response(body: &str) -> StoredResponse {
    let headers: [(&str, &[u8]); 3] =
        [("content-type", b"application/json"), ("set-cookie", b"a"), ("set-cookie", b"b")];
    StoredResponse::new(201, headers, body.as_bytes().to_vec())
}

/// What `begin` answers for a completed entry whose response is `r`.
fn replay(r: StoredResponse) -> Verdict {
    Verdict::Replay(Rc::new(r))
}

fn done(c: Completion) -> Change {
    match c {
        Completion::Stored(change) => change,
        other => panic!("expected a stored completion, got {other:?}"),
    }
}

fn complete(t: &Table<MemoryKv>, ticket: &Ticket, body: &str, now: u64, retention: u64) -> Completion {
    t.complete(ticket, Some(&mut response(body)), now, retention).unwrap()
}

fn claim(t: &Table<MemoryKv>, k: u64, now: u64) -> Ticket {
    match t.begin(&key(k), &fp(1), now, LEASE).unwrap() {
        Verdict::Claimed { ticket, .. } => ticket,
        other => panic!("expected a claim, got {other:?}"),
    }
}

fn replay_body(t: &Table<MemoryKv>, k: u64, now: u64) -> Option<Vec<u8>> {
    match t.begin(&key(k), &fp(1), now, LEASE).unwrap() {
        Verdict::Replay(r) => Some(r.body().to_vec()),
        _ => None,
    }
}

#[test]
fn first_claims_duplicate_conflicts_completion_replays() {
    let t = table(1024);
    let ticket = claim(&t, 1, 0);
    assert_eq!(t.begin(&key(1), &fp(1), 5, LEASE).unwrap(), Verdict::InProgress);
    let change = done(complete(&t, &ticket, "one", 10, RETENTION));
    assert_eq!((change.in_progress, change.completed), (-1, 1));
    assert_eq!(change.bytes, response("one").stored_len() as i64);
    assert_eq!(t.begin(&key(1), &fp(1), 20, LEASE).unwrap(), replay(response("one")));
    // Another key is independent.
    claim(&t, 2, 20);
}

#[test]
fn different_fingerprint_is_a_mismatch_in_progress_and_completed() {
    let t = table(1024);
    let ticket = claim(&t, 1, 0);
    assert_eq!(t.begin(&key(1), &fp(2), 1, LEASE).unwrap(), Verdict::Mismatch);
    complete(&t, &ticket, "x", 2, RETENTION);
    assert_eq!(t.begin(&key(1), &fp(2), 3, LEASE).unwrap(), Verdict::Mismatch);
}

#[test]
fn release_lets_a_retry_claim_at_once() {
    let t = table(1024);
    let ticket = claim(&t, 1, 0);
    assert_eq!(t.release(&ticket).unwrap(), Finish::Done);
    let again = claim(&t, 1, 1);
    assert!(again.gen > ticket.gen);
    // The old ticket can no longer act.
    assert_eq!(t.release(&ticket).unwrap(), Finish::Lost);
    assert_eq!(complete(&t, &ticket, "late", 2, RETENTION), Completion::Lost);
    assert_eq!(t.begin(&key(1), &fp(1), 3, LEASE).unwrap(), Verdict::InProgress);
}

#[test]
fn later_claims_of_a_key_carry_larger_tokens_whatever_way_they_take() {
    let t = table(ENTRIES);
    let first = claim(&t, 1, 0);
    // Other keys take the entries around it; the key's next claim lands elsewhere.
    let others: Vec<Ticket> = (2..10).map(|k| claim(&t, k, 0)).collect();
    t.release(&first).unwrap();
    t.release(&others[0]).unwrap();
    let second = claim(&t, 1, 0);
    assert!(second.gen > first.gen && second.gen > others[7].gen);
    // A takeover after expiry is larger still, and so is a claim after a restart (empty store).
    let third = match t.begin(&key(1), &fp(1), LEASE, LEASE).unwrap() {
        Verdict::Claimed { ticket, takeover: true, .. } => ticket,
        other => panic!("{other:?}"),
    };
    assert!(third.gen > second.gen);
    let restarted = table(ENTRIES);
    let after_restart = match restarted.begin(&key(1), &fp(1), LEASE + 1, LEASE).unwrap() {
        Verdict::Claimed { ticket, .. } => ticket,
        other => panic!("{other:?}"),
    };
    assert!(after_restart.gen > third.gen);
}

#[test]
fn too_large_response_completes_without_body() {
    let t = table(1024);
    let ticket = claim(&t, 1, 0);
    assert!(matches!(t.complete(&ticket, None, 1, RETENTION).unwrap(), Completion::WithoutBody(_)));
    assert_eq!(t.begin(&key(1), &fp(1), 2, LEASE).unwrap(), Verdict::CompletedWithoutBody);
}

#[test]
fn expired_mark_is_taken_over_whatever_the_fingerprint_and_the_late_owner_cannot_overwrite() {
    let t = table(1024);
    let old = claim(&t, 1, 0);
    assert_eq!(t.begin(&key(1), &fp(1), LEASE - 1, LEASE).unwrap(), Verdict::InProgress);
    // Past the deadline: a request with another body takes over and becomes the first.
    let new = match t.begin(&key(1), &fp(9), LEASE, LEASE).unwrap() {
        Verdict::Claimed { ticket, takeover: true, change } => {
            assert_eq!(change, Change::default(), "one mark replaced another");
            ticket
        }
        other => panic!("{other:?}"),
    };
    assert_eq!(new.slot, old.slot);
    complete(&t, &new, "new", LEASE + 1, RETENTION);
    // The late owner finishes: nothing changes.
    assert_eq!(complete(&t, &old, "old", LEASE + 2, RETENTION), Completion::Lost);
    assert_eq!(t.renew(&old, LEASE + 2, LEASE).unwrap(), Finish::Lost);
    assert_eq!(t.begin(&key(1), &fp(9), LEASE + 3, LEASE).unwrap(), replay(response("new")));
}

#[test]
fn late_owner_racing_the_new_owner_never_clobbers_its_response() {
    // The old owner passed its ownership check, then the new owner claims and completes,
    // then the old owner writes: the stamp check keeps the new response.
    let t = table(64);
    let old = claim(&t, 1, 0);
    let new = match t.begin(&key(1), &fp(1), LEASE + 1, LEASE).unwrap() {
        Verdict::Claimed { ticket, .. } => ticket,
        other => panic!("{other:?}"),
    };
    complete(&t, &new, "new", LEASE + 2, RETENTION);
    let mut late = response("old");
    late.stamp(old.gen, &old.key);
    assert_eq!(t.write_response(&old, &late).unwrap(), None);
    assert_eq!(t.begin(&key(1), &fp(1), LEASE + 3, LEASE).unwrap(), replay(response("new")));
}

#[test]
fn renewal_keeps_a_slow_owner() {
    let t = table(1024);
    let ticket = claim(&t, 1, 0);
    for now in (LEASE / 2..4 * LEASE).step_by((LEASE / 2) as usize) {
        assert_eq!(t.renew(&ticket, now, LEASE).unwrap(), Finish::Done);
        assert_eq!(t.begin(&key(1), &fp(1), now + LEASE / 2, LEASE).unwrap(), Verdict::InProgress);
    }
}

#[test]
fn retention_ends_replay() {
    let t = table(1024);
    let ticket = claim(&t, 1, 0);
    complete(&t, &ticket, "r", 0, RETENTION);
    assert!(matches!(t.begin(&key(1), &fp(1), RETENTION - 1, LEASE).unwrap(), Verdict::Replay(_)));
    assert!(matches!(t.begin(&key(1), &fp(7), RETENTION, LEASE).unwrap(), Verdict::Claimed { takeover: false, .. }));
}

#[test]
fn a_full_bucket_evicts_its_oldest_completed_entry_for_a_new_key() {
    let t = table(ENTRIES); // one bucket
    for k in 0..ENTRIES as u64 {
        let ticket = claim(&t, k, k);
        complete(&t, &ticket, &format!("r{k}"), 100 + k, RETENTION);
    }
    let change = match t.begin(&key(1000), &fp(1), 500, LEASE).unwrap() {
        Verdict::Claimed { change, .. } => change,
        other => panic!("{other:?}"),
    };
    assert_eq!(change.evicted, 1);
    assert_eq!(change.youngest_evicted_ms, Some(400), "key 0 completed at 100, evicted at 500");
    assert_eq!((change.in_progress, change.completed), (1, -1));
    assert_eq!(change.bytes, -(response("r0").stored_len() as i64));
    // The oldest is gone (a retry of it runs again); the others still replay.
    assert!(matches!(t.begin(&key(0), &fp(1), 501, LEASE).unwrap(), Verdict::Claimed { .. }));
    for k in 2..ENTRIES as u64 {
        assert_eq!(replay_body(&t, k, 502), Some(format!("r{k}").into_bytes()), "key {k}");
    }
}

#[test]
fn in_progress_marks_are_never_evicted() {
    let t = table(ENTRIES);
    let marks: Vec<Ticket> = (0..ENTRIES as u64 - 1).map(|k| claim(&t, k, 0)).collect();
    let last = claim(&t, 500, 0);
    complete(&t, &last, "done", 1, RETENTION);
    // The one completed entry makes room; after that only live marks are left.
    assert!(matches!(t.begin(&key(1000), &fp(1), 2, LEASE).unwrap(), Verdict::Claimed { .. }));
    assert!(matches!(t.begin(&key(1001), &fp(1), 3, LEASE).unwrap(), Verdict::Full { .. }));
    // Known keys still get their answer, and every mark's owner still owns it.
    assert_eq!(t.begin(&key(3), &fp(1), 4, LEASE).unwrap(), Verdict::InProgress);
    for m in &marks {
        assert_eq!(t.renew(m, 5, LEASE).unwrap(), Finish::Done);
    }
    // Past the leases, expired marks make room again.
    assert!(matches!(t.begin(&key(1001), &fp(1), 5 + LEASE, LEASE).unwrap(), Verdict::Claimed { .. }));
}

#[test]
fn the_byte_budget_evicts_the_oldest_responses_first() {
    let size = response(&"b".repeat(1000)).stored_len() as u64;
    // One bucket holding at most three such responses.
    let t = table_with_budget(ENTRIES, 3 * size + 10);
    let mut evicted = 0;
    let mut bytes = 0i64;
    for k in 0..10u64 {
        let ticket = claim(&t, k, k * 10);
        let change = done(complete(&t, &ticket, &"b".repeat(1000), k * 10 + 1, RETENTION));
        evicted += change.evicted;
        bytes += change.bytes;
        assert!(bytes as u64 <= 3 * size + 10, "key {k}: {bytes} bytes held");
    }
    assert_eq!(evicted, 7);
    assert_eq!(bytes as u64, 3 * size);
    for k in 0..7 {
        assert_eq!(replay_body(&t, k, 200), None, "key {k} was evicted");
    }
    for k in 7..10 {
        assert_eq!(replay_body(&t, k, 200), Some(b"b".repeat(1000)), "key {k}");
    }
    // What the store really holds: three responses, the rest emptied.
    assert!(t.store.value_bytes() < 3 * size as usize + 2 * crate::encoding::BUCKET_BYTES);
}

#[test]
fn a_response_larger_than_a_bucket_share_completes_without_body() {
    let t = table_with_budget(ENTRIES, 500);
    let ticket = claim(&t, 1, 0);
    let c = complete(&t, &ticket, &"x".repeat(600), 1, RETENTION);
    assert!(matches!(c, Completion::WithoutBody(Change { bytes: 0, .. })), "{c:?}");
    assert_eq!(t.begin(&key(1), &fp(1), 2, LEASE).unwrap(), Verdict::CompletedWithoutBody);
}

#[test]
fn memory_is_bounded_however_many_keys_pass() {
    let t = table(256);
    let keys_after_create = t.store.key_count();
    assert_eq!(keys_after_create, 4 + 256 + 2);
    let mut now = 0;
    for k in 0..20_000u64 {
        now += 1;
        let ticket = match t.begin(&key(k), &fp(1), now, LEASE).unwrap() {
            Verdict::Claimed { ticket, .. } => ticket,
            other => panic!("key {k}: {other:?}"),
        };
        complete(&t, &ticket, &"x".repeat(100), now, 1_000_000);
    }
    // Nothing expired: every new key evicted an old one, and the store kept its size.
    assert_eq!(t.store.key_count(), keys_after_create);
    let one = response(&"x".repeat(100)).stored_len();
    assert!(t.store.value_bytes() <= 256 * one + 4 * crate::encoding::BUCKET_BYTES + 64);
}

#[test]
fn sweep_frees_expired_entries_and_their_responses() {
    let t = table(64);
    let a = claim(&t, 1, 0);
    complete(&t, &a, &"y".repeat(1000), 0, 100);
    let _b = claim(&t, 2, 0);
    let before = t.store.value_bytes();
    assert_eq!(t.sweep(0, 50, None).unwrap(), Change::default());
    let swept = t.sweep(0, LEASE, None).unwrap();
    let bytes = response(&"y".repeat(1000)).stored_len() as i64;
    assert_eq!(swept, Change { in_progress: -1, completed: -1, bytes: -bytes, expired_marks: 1, ..Change::default() });
    assert!(t.store.value_bytes() < before - 1000);
}

#[test]
fn a_claim_over_an_old_response_frees_it() {
    let t = table(64);
    let a = claim(&t, 1, 0);
    complete(&t, &a, &"z".repeat(1000), 0, 10);
    let before = t.store.value_bytes();
    let b = claim(&t, 1, 20); // reuses the expired entry
    assert_eq!(b.slot, a.slot);
    assert!(t.store.value_bytes() < before - 1000);
    t.release(&b).unwrap();
}

#[test]
fn corrupt_values_are_errors_not_panics() {
    let t = table(64);
    t.store.set("t:t2:1:b0", b"foreign", None).unwrap();
    assert!(matches!(t.begin(&key(1), &fp(1), 0, LEASE), Err(StoreError::Corrupt(_))));
    let missing = Table::new(MemoryKv::new(), Layout::new("t", 64, PLENTY));
    assert_eq!(missing.begin(&key(1), &fp(1), 0, LEASE), Err(StoreError::Missing));
}

#[test]
fn corrupt_response_is_an_error() {
    let t = table(64);
    let a = claim(&t, 1, 0);
    complete(&t, &a, "ok", 0, RETENTION);
    t.store.set(&t.layout.data_key(a.slot), b"garbage\x02R", None).unwrap();
    assert!(matches!(t.begin(&key(1), &fp(1), 1, LEASE), Err(StoreError::Corrupt(_))));
}

#[test]
fn create_is_idempotent_and_keeps_entries() {
    let t = table(64);
    let a = claim(&t, 1, 0);
    assert!(!t.create().unwrap());
    assert_eq!(t.release(&a).unwrap(), Finish::Done);
}

#[test]
fn evictions_feed_the_effective_retention() {
    let t = table(64);
    assert_eq!(t.note_evictions(1_000_000, None).unwrap(), 0);
    assert_eq!(t.note_evictions(1_000_100, Some(9_000)).unwrap(), 9_000);
    assert_eq!(t.note_evictions(1_000_200, Some(12_000)).unwrap(), 9_000, "another worker's older one");
    assert_eq!(t.note_evictions(1_300_000, None).unwrap(), 0, "nothing evicted for minutes");
}

/// Many threads race for the same keys against the Envoy-semantics store: exactly one claim
/// per key, everyone else sees in-progress or the replay.
#[test]
#[cfg(not(target_family = "wasm"))] // no threads on wasm32-wasip1
fn concurrent_callers_claim_each_key_once() {
    const THREADS: usize = 16;
    const KEYS: u64 = 200;
    let t = Arc::new(table(4096));
    let claims = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|i| {
            let (t, claims, barrier) = (t.clone(), claims.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                for k in 0..KEYS {
                    // Threads walk the keys in different orders to vary the interleavings.
                    let k = (k * 7 + i as u64 * 13) % KEYS;
                    match t.begin(&key(k), &fp(1), 0, LEASE).unwrap() {
                        Verdict::Claimed { ticket, .. } => {
                            claims.fetch_add(1, Ordering::SeqCst);
                            if k.is_multiple_of(2) {
                                complete(&t, &ticket, &k.to_string(), 0, RETENTION);
                            }
                        }
                        Verdict::InProgress => {}
                        Verdict::Replay(r) => assert_eq!(r.body(), k.to_string().as_bytes()),
                        other => panic!("{other:?}"),
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(claims.load(Ordering::SeqCst), KEYS as usize);
}

/// Owners complete, release and die while others claim and take over expired marks, and
/// some owners finish late, after their mark may have been taken over: every replay is a
/// response whose completion returned `Stored`, of the key asked for (docs/behaviour.md §3.8), and a late
/// owner never spoils the entry of the one that took over (a replay never fails).
#[test]
#[cfg(not(target_family = "wasm"))]
fn concurrent_owners_never_overwrite_each_other() {
    use std::collections::{HashSet, VecDeque};
    use std::sync::Mutex;
    const THREADS: usize = 8;
    let t = Arc::new(table(64)); // one bucket: maximal contention
    let barrier = Arc::new(Barrier::new(THREADS));
    let stored = Arc::new(Mutex::new(HashSet::new()));
    let handles: Vec<_> = (0..THREADS)
        .map(|i| {
            let (t, barrier, stored) = (t.clone(), barrier.clone(), stored.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let mut replays = Vec::new();
                let mut late: VecDeque<(u64, Ticket, String)> = VecDeque::new();
                let finish = |ticket: &Ticket, body: String, now: u64| {
                    if let Completion::Stored(_) = complete(&t, ticket, &body, now, 2_000) {
                        stored.lock().unwrap().insert(body);
                    }
                };
                for round in 0..400u64 {
                    // Time moves fast: marks (1.5 s) expire and are taken over all the time.
                    let now = round * 1_000;
                    let k = round % 5;
                    while late.front().is_some_and(|(due, _, _)| *due <= round) {
                        let (_, ticket, body) = late.pop_front().unwrap();
                        finish(&ticket, body, now);
                    }
                    if let Verdict::Claimed { ticket, .. } = t.begin(&key(k), &fp(1), now, 1_500).unwrap() {
                        let body = format!("key{k}-thread{i}-round{round}");
                        match (round + i as u64) % 4 {
                            0 => finish(&ticket, body, now),
                            1 => {
                                t.release(&ticket).unwrap();
                            }
                            2 => {}                                         // the owner dies: its mark expires
                            _ => late.push_back((round + 2, ticket, body)), // finishes late
                        }
                    }
                    if let Some(body) = replay_body(&t, k, now) {
                        replays.push((k, String::from_utf8(body).unwrap()));
                    }
                }
                replays
            })
        })
        .collect();
    let replays: Vec<(u64, String)> = handles.into_iter().flat_map(|h| h.join().unwrap()).collect();
    let stored = stored.lock().unwrap();
    assert!(!replays.is_empty() && !stored.is_empty());
    for (k, body) in &replays {
        assert!(stored.contains(body), "replayed {body:?}, which no completion stored");
        assert!(body.starts_with(&format!("key{k}-")), "key {k} replayed {body:?}");
    }
}

/// Counts the reads a table makes of its map.
struct Counting {
    kv: MemoryKv,
    gets: std::cell::Cell<usize>,
}

impl SharedKv for Counting {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), KvError> {
        self.gets.set(self.gets.get() + 1);
        self.kv.get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), KvError> {
        self.kv.set(key, value, cas)
    }
}

/// A kept replay: without a read within `TRUST_MS` of the bucket read that confirmed it,
/// then with the bucket's read only; never for another claim of its slot, nor past retention.
#[test]
fn a_kept_replay_reads_the_bucket_only_and_never_outlives_its_claim() {
    let t = Table::new(Counting { kv: MemoryKv::new(), gets: 0.into() }, Layout::new("t", 64, PLENTY));
    assert!(t.create().unwrap());
    let (mut cache, mut other_vm) = (ReplayCache::new(1 << 16), ReplayCache::new(1 << 16));
    let begin = |t: &Table<Counting>, k: u64, now: u64, cache: &mut ReplayCache| {
        let before = t.store().gets.get();
        let b = t.begin_with(&key(k), &fp(1), Caller::ANONYMOUS, now, LEASE, cache).unwrap();
        (b, t.store().gets.get() - before)
    };
    // One bucket of 64 completed keys; key 0 is the oldest.
    for k in 0..64 {
        let ticket = match t.begin(&key(k), &fp(1), k, LEASE).unwrap() {
            Verdict::Claimed { ticket, .. } => ticket,
            other => panic!("{other:?}"),
        };
        assert!(matches!(
            t.complete(&ticket, Some(&mut response(&k.to_string())), k, RETENTION).unwrap(),
            Completion::Stored(_)
        ));
    }
    assert_eq!(begin(&t, 0, 100, &mut cache), (replay(response("0")), 2), "bucket and data key");
    assert_eq!(begin(&t, 0, 101, &mut cache), (replay(response("0")), 0), "no read");
    assert_eq!(begin(&t, 0, 100 + TRUST_MS, &mut cache), (replay(response("0")), 1), "the bucket only");
    let now = 100 + TRUST_MS;
    // Another request with the key: the bucket decides.
    let mismatch = t.begin_with(&key(0), &fp(2), Caller::ANONYMOUS, now + 1, LEASE, &mut cache).unwrap();
    assert_eq!(mismatch, Verdict::Mismatch);
    // Key 64 evicts key 0's entry here and stores its own answer in the same slot.
    let ticket = match begin(&t, 64, now + 2, &mut cache).0 {
        Verdict::Claimed { ticket, .. } => ticket,
        other => panic!("{other:?}"),
    };
    assert!(matches!(
        t.complete(&ticket, Some(&mut response("64")), now + 3, RETENTION).unwrap(),
        Completion::Stored(_)
    ));
    assert_eq!(begin(&t, 64, now + 4, &mut cache), (replay(response("64")), 2), "not key 0's kept answer");
    assert!(matches!(begin(&t, 0, now + 5, &mut cache).0, Verdict::Claimed { .. }), "key 0 was forgotten");
    // Key 2 (now the oldest) kept here, evicted by another VM's claim: replayed here for at
    // most TRUST_MS more, then the bucket decides.
    assert_eq!(begin(&t, 2, now + 6, &mut cache).0, replay(response("2")));
    assert!(matches!(begin(&t, 65, now + 7, &mut other_vm).0, Verdict::Claimed { .. }));
    assert_eq!(begin(&t, 2, now + 6 + TRUST_MS - 1, &mut cache), (replay(response("2")), 0));
    assert!(matches!(begin(&t, 2, now + 6 + TRUST_MS, &mut cache).0, Verdict::Claimed { .. }), "key 2 was evicted");
    // Past its retention a kept answer is not replayed either: the bucket decides.
    let later = now + 3 + RETENTION;
    assert_eq!(begin(&t, 64, later - 2, &mut cache).1, 1);
    assert_eq!(begin(&t, 64, later - 1, &mut cache).1, 0, "trusted until its retention ends");
    let ticket = match begin(&t, 64, later, &mut cache).0 {
        Verdict::Claimed { ticket, .. } => ticket,
        other => panic!("{other:?}"),
    };
    // The same key claimed again in its own slot: its new answer, not the kept one.
    assert!(matches!(
        t.complete(&ticket, Some(&mut response("64 again")), later, RETENTION).unwrap(),
        Completion::Stored(_)
    ));
    assert_eq!(begin(&t, 64, later + 1, &mut cache), (replay(response("64 again")), 2));
}

/// This VM's own changes are never hidden by what it kept: a completion that evicts a kept
/// entry to make room, and a claim of a key whose kept entry another VM had evicted, each drop
/// it at once (review: both replayed the old answer for up to TRUST_MS).
#[test]
fn a_kept_replay_is_dropped_by_this_vms_own_evictions_and_claims() {
    let one = response("0").stored_len() as u64;
    // One bucket whose share of the byte budget holds three responses.
    let t = table_with_budget(64, 3 * one);
    let mut cache = ReplayCache::new(1 << 16);
    for k in 0..3 {
        let ticket = claim(&t, k, k);
        done(complete(&t, &ticket, &k.to_string(), k, RETENTION));
    }
    let begin = |k: u64, f: u8, now: u64, cache: &mut ReplayCache| {
        t.begin_with(&key(k), &fp(f), Caller::ANONYMOUS, now, LEASE, cache).unwrap()
    };
    assert_eq!(begin(0, 1, 10, &mut cache), replay(response("0")));
    // Key 3's completion here evicts key 0 (the oldest) to make room.
    let ticket = match begin(3, 1, 11, &mut cache) {
        Verdict::Claimed { ticket, .. } => ticket,
        other => panic!("{other:?}"),
    };
    let change = done(t.complete_with(&ticket, Some(&mut response("3")), 12, RETENTION, &mut cache).unwrap());
    assert_eq!(change.evicted, 1);
    assert!(matches!(begin(0, 1, 13, &mut cache), Verdict::Claimed { .. }), "key 0's kept answer replayed");

    // Key 1 kept here; another VM's completion evicts it; then this VM claims key 1 for a
    // different request: a retry of the first request meets that claim, not the kept answer.
    assert_eq!(begin(1, 1, 20, &mut cache), replay(response("1")));
    let mut other_vm = ReplayCache::new(1 << 16);
    let ticket = match t.begin_with(&key(4), &fp(1), Caller::ANONYMOUS, 21, LEASE, &mut other_vm).unwrap() {
        Verdict::Claimed { ticket, .. } => ticket,
        other => panic!("{other:?}"),
    };
    t.complete_with(&ticket, Some(&mut response("4")), 22, RETENTION, &mut other_vm).unwrap();
    // The other VM's next claim takes key 1's old slot: this VM's claim of key 1 lands elsewhere.
    assert!(matches!(
        t.begin_with(&key(5), &fp(1), Caller::ANONYMOUS, 22, LEASE, &mut other_vm).unwrap(),
        Verdict::Claimed { .. }
    ));
    assert!(matches!(begin(1, 2, 23, &mut cache), Verdict::Claimed { .. }), "key 1 was evicted");
    assert_eq!(begin(1, 1, 24, &mut cache), Verdict::Mismatch);
}

/// `decide` as it was before the scan read only states, deadlines and ages: every entry
/// decoded whole.
fn decide_decoding_all(
    bucket: &Bucket,
    key: &KeyTag,
    fingerprint: &Fingerprint,
    caller: Caller,
    now_ms: u64,
    window_ms: u64,
) -> Result<Decision, Corrupt> {
    if let Some(i) = bucket.find_key(key) {
        let entry = bucket.entry(i)?;
        if entry.is_live(now_ms) {
            return Ok(judge_live(&entry, i, fingerprint));
        }
    }
    let (mut expired_same_key, mut free, mut expired) = (None, None, None);
    let mut live = Vec::new();
    for i in 0..ENTRIES {
        let entry = bucket.entry(i)?;
        if entry.state == State::Free {
            free = free.or(Some(i));
        } else if !entry.is_live(now_ms) {
            if entry.key == *key {
                expired_same_key = Some((i, entry.state == State::InProgress));
            }
            expired = expired.or(Some(i));
        } else if entry.key == *key {
            return Ok(judge_live(&entry, i, fingerprint));
        } else {
            live.push((i, entry));
        }
    }
    let room = expired_same_key.or(free.map(|i| (i, false))).or(expired.map(|i| (i, false)));
    if let Some((entry, takeover)) = room {
        return Ok(Decision::Claim { entry, takeover, below_share: false });
    }
    // Fair share, the obvious way: count every caller's live entries, the claimer's new one too.
    let mut held: std::collections::HashMap<Caller, u64> = std::collections::HashMap::new();
    for (_, e) in &live {
        *held.entry(e.caller).or_default() += 1;
    }
    *held.entry(caller).or_default() += 1;
    // Only answers past the replay window make room; otherwise room frees up at the first
    // deadline or window's end.
    let evictable = |e: &Entry| e.state.is_completed() && e.since_ms + window_ms <= now_ms;
    let victim = live.iter().filter(|(_, e)| evictable(e)).max_by_key(|(i, e)| {
        (held[&e.caller], e.caller == caller, std::cmp::Reverse(e.since_ms), std::cmp::Reverse(*i))
    });
    let room_at = live
        .iter()
        .filter(|(_, e)| !evictable(e))
        .map(|(_, e)| if e.state.is_completed() { e.deadline_ms.min(e.since_ms + window_ms) } else { e.deadline_ms })
        .min()
        .unwrap_or(u64::MAX);
    Ok(match victim {
        Some((entry, e)) => Decision::Claim {
            entry: *entry,
            takeover: false,
            below_share: held[&e.caller] * (held.len() as u64) < ENTRIES as u64,
        },
        None => Decision::Full { retry_after_ms: room_at.saturating_sub(now_ms) },
    })
}

#[test]
fn the_claim_scan_decides_as_decoding_every_entry_would() {
    // Random buckets over a few keys, fingerprints, states and deadlines around `now`, some
    // full and some with a corrupt state byte: both scans give the same answer or error.
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let now = 1_000;
    let states = [State::Free, State::InProgress, State::Completed, State::CompletedNoBody];
    let mut decisions = std::collections::HashSet::new();
    for round in 0..3_000 {
        let mut bucket = Bucket::empty();
        let filled = if round % 3 == 0 { ENTRIES } else { next(ENTRIES as u64 + 1) as usize };
        for i in 0..filled {
            // Some buckets only in-progress marks: all live, that is Full.
            let state = if round % 42 == 0 { State::InProgress } else { states[next(4) as usize] };
            let entry = Entry {
                state: if round % 2 == 0 && state == State::Free { State::Completed } else { state },
                gen: next(100),
                key: [next(4) as u8; 16],
                fingerprint: fp(next(2) as u8),
                // Every sixth bucket all live (a full bucket decides Full or evicts).
                deadline_ms: if round % 6 == 0 { now + 1 + next(3) } else { now - 2 + next(4) },
                since_ms: next(50),
                bytes: 0,
                caller: Caller::from_bits(next(4)),
            };
            bucket.set_entry(i, &entry);
        }
        let mut bytes = bucket.as_bytes().to_vec();
        if round % 50 == 7 {
            let at = 10 + next(ENTRIES as u64) as usize * 61;
            bytes[at] = 9; // an unknown state
        }
        let bucket = Bucket::decode(bytes).unwrap();
        let (key, fingerprint) = ([next(5) as u8; 16], fp(next(2) as u8));
        let caller = Caller::from_bits(next(5));
        // Some answers inside the replay window, some past it.
        let window = 975;
        let fast = decide(&bucket, &key, &fingerprint, caller, now, window);
        assert_eq!(fast, decide_decoding_all(&bucket, &key, &fingerprint, caller, now, window), "round {round}");
        decisions.insert(format!("{:?}", fast.map(|d| std::mem::discriminant(&d))));
    }
    assert_eq!(decisions.len(), 6, "the rounds reach every kind of decision and an error: {decisions:?}");
}

/// Shared data that refuses to empty a key while `refuse` is set (the host answered an
/// unexpected status).
#[derive(Default)]
struct RefusesBlanks {
    kv: MemoryKv,
    refuse: std::cell::Cell<bool>,
}

impl SharedKv for RefusesBlanks {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), KvError> {
        self.kv.get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), KvError> {
        if value.is_empty() && self.refuse.get() {
            return Err(KvError::Host(2));
        }
        self.kv.set(key, value, cas)
    }
}

/// Defect (issue: every combination, simulated): freeing the old response after the claim's
/// CAS failed, and the claim answered an error (503) while its mark stayed, locking the key
/// for the lease though the client was told nothing was done. The bucket's write decides.
#[test]
fn a_claim_stands_when_freeing_the_old_response_fails() {
    let t = Table::new(RefusesBlanks::default(), Layout::new("t", 64, PLENTY));
    assert!(t.create().unwrap());
    let Verdict::Claimed { ticket, .. } = t.begin(&key(1), &fp(1), 0, LEASE).unwrap() else { panic!() };
    let completed = t.complete(&ticket, Some(&mut response("made")), 10, 1_000).unwrap();
    assert!(matches!(completed, Completion::Stored(_)), "{completed:?}");
    t.store.refuse.set(true);
    // Past its retention the key is claimed again: its old response must be freed.
    let again = t.begin(&key(1), &fp(2), 5_000, LEASE).unwrap();
    let Verdict::Claimed { ticket, .. } = again else { panic!("expected a claim, got {again:?}") };
    // The new owner completes and replays; the old response is never served for it.
    let completed = t.complete(&ticket, Some(&mut response("again")), 5_010, RETENTION).unwrap();
    assert!(matches!(completed, Completion::Stored(_)), "{completed:?}");
    assert!(matches!(t.begin(&key(1), &fp(2), 5_020, LEASE).unwrap(), Verdict::Replay(r) if r.body() == b"again"));
}

/// A caller's key: the store key and the caller tag, as a request of `scope` gets them.
fn scoped(scope: &str, n: u64) -> (StoreKey, Caller) {
    let scopes = [Some(scope.as_bytes())];
    (
        StoreKey::derive("t", b"host", &scopes, n.to_string().as_bytes()),
        Caller::of(&crate::caller::TagKey::default(), &scopes),
    )
}

/// Claims and completes `scope`'s key `n` with `body`; the change it made.
fn store_scoped(t: &Table<MemoryKv>, scope: &str, n: u64, body: &str, now: u64) -> Change {
    let (k, caller) = scoped(scope, n);
    let mut cache = ReplayCache::new(0);
    let (ticket, claimed) = match t.begin_with(&k, &fp(1), caller, now, LEASE, &mut cache).unwrap() {
        Verdict::Claimed { ticket, change, .. } => (ticket, change),
        other => panic!("expected a claim of {scope}'s key {n}, got {other:?}"),
    };
    let completed = done(t.complete(&ticket, Some(&mut response(body)), now, RETENTION).unwrap());
    Change {
        evicted: claimed.evicted + completed.evicted,
        evicted_below_share: claimed.evicted_below_share + completed.evicted_below_share,
        ..Change::default()
    }
}

/// Whether `scope`'s key `n` replays (a read only: a claim would make room itself).
fn replays_scoped(t: &Table<MemoryKv>, scope: &str, n: u64, now: u64) -> bool {
    matches!(t.lookup(&scoped(scope, n).0, &fp(1), now).unwrap(), Some(Verdict::Replay(_)))
}

#[test]
fn a_flood_of_new_keys_evicts_the_flooders_own_answers_only() {
    // Two buckets; the other caller stores 16 answers, then one caller sends 8 × capacity new
    // keys. Before fair share the flood evicted all 16 (the oldest completed entries).
    let t = table(128);
    for n in 0..16 {
        store_scoped(&t, "Bearer quiet", n, "kept", 1_000 + n);
    }
    let (mut evicted, mut below) = (0, 0);
    for n in 0..8 * 128 {
        let change = store_scoped(&t, "Bearer flood", n, "flood", 2_000 + n);
        evicted += change.evicted;
        below += change.evicted_below_share;
    }
    assert!((0..16).all(|n| replays_scoped(&t, "Bearer quiet", n, 5_000)), "every quiet answer replays");
    assert!(evicted >= 8 * 128 - 112, "the flood evicted its own ({evicted})");
    assert_eq!(below, 0, "no caller below its share lost an answer");
    // The flood's newest answers are still there: it keeps what its share holds.
    assert!(replays_scoped(&t, "Bearer flood", 8 * 128 - 1, 5_000));
    let kept = (0..8 * 128).filter(|n| replays_scoped(&t, "Bearer flood", *n, 5_000)).count();
    assert_eq!(kept, 128 - 16, "the rest of the table");
}

#[test]
fn a_flood_of_large_answers_evicts_the_flooders_own_bytes_only() {
    // One bucket of 64 KiB: the quiet caller keeps six answers of 4 KiB; 640 KiB of the
    // flooder's 16 KiB answers go through it.
    let t = table_with_budget(64, 64 * 1024);
    let small = "s".repeat(4 * 1024);
    let large = "L".repeat(16 * 1024);
    for n in 0..6 {
        store_scoped(&t, "Bearer quiet", n, &small, 1_000 + n);
    }
    let mut below = 0;
    for n in 0..40 {
        below += store_scoped(&t, "Bearer flood", n, &large, 2_000 + n).evicted_below_share;
    }
    assert!((0..6).all(|n| replays_scoped(&t, "Bearer quiet", n, 5_000)), "every quiet answer replays");
    assert!(replays_scoped(&t, "Bearer flood", 39, 5_000), "the flood's newest answer replays");
    assert_eq!(below, 0);
}

#[test]
fn a_caller_over_its_share_pays_for_its_own_room() {
    // Half and half: each new key of either caller evicts that caller's own oldest answer.
    let t = table(64);
    for n in 0..32 {
        store_scoped(&t, "Bearer a", n, "a", 1_000 + n);
        store_scoped(&t, "Bearer b", n, "b", 1_000 + n);
    }
    store_scoped(&t, "Bearer b", 100, "b", 3_000);
    assert!(replays_scoped(&t, "Bearer a", 0, 3_001), "a's oldest stays");
    assert!(!replays_scoped(&t, "Bearer b", 0, 3_001), "b paid with its own oldest");
}

#[test]
fn when_the_heavier_caller_holds_only_marks_the_eviction_is_counted_below_share() {
    let t = table(64);
    for n in 0..8 {
        store_scoped(&t, "Bearer quiet", n, "q", 1_000 + n);
    }
    for n in 0..56 {
        let (k, caller) = scoped("Bearer slow", n);
        let began = t.begin_with(&k, &fp(1), caller, 2_000, LEASE, &mut ReplayCache::new(0)).unwrap();
        assert!(matches!(began, Verdict::Claimed { .. }));
    }
    // A third caller's new key: the slow caller holds 56 marks (never evicted), so the quiet
    // caller's oldest answer goes, and the figure says it was under its share.
    let (k, caller) = scoped("Bearer third", 0);
    match t.begin_with(&k, &fp(1), caller, 2_001, LEASE, &mut ReplayCache::new(0)).unwrap() {
        Verdict::Claimed { change, .. } => assert_eq!((change.evicted, change.evicted_below_share), (1, 1)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn local_copies_of_a_fleet_store_follow_fair_share_too() {
    // The copies an etcd fleet keeps of completed entries go through `keep`: a flood of the
    // flooder's copies evicts its own.
    let t = table(64);
    let copy = |scope: &str, n: u64, now: u64| {
        let (k, caller) = scoped(scope, n);
        t.keep(&k, &fp(1), caller, Some(&response("c")), now + RETENTION, now).unwrap()
    };
    for n in 0..8 {
        copy("Bearer quiet", n, 1_000 + n);
    }
    let below: u32 = (0..500).map(|n| copy("Bearer flood", n, 2_000 + n).evicted_below_share).sum();
    assert_eq!(below, 0);
    assert!((0..8).all(|n| replays_scoped(&t, "Bearer quiet", n, 3_000)));
    assert!(replays_scoped(&t, "Bearer flood", 499, 3_000));
}

/// docs/behaviour.md §3.4: no answer younger than `min_retention_s` is evicted, by count or by
/// bytes, whoever needs room. A new key in a bucket that holds nothing older is refused, with
/// the time until room frees up; once the oldest answer leaves its window, it makes room.
#[test]
fn answers_inside_the_replay_window_are_never_evicted_a_new_key_waits_for_room() {
    const WINDOW: u64 = 60_000;
    let t = table(ENTRIES).with_window(WINDOW);
    for k in 0..ENTRIES as u64 {
        let ticket = claim(&t, k, 10 * k);
        complete(&t, &ticket, &format!("r{k}"), 10 * k + 5, RETENTION * 10);
    }
    // Every answer is inside its window: a new key waits until the oldest (completed at 5)
    // leaves it.
    assert_eq!(
        t.begin(&key(1000), &fp(1), 1_000, LEASE).unwrap(),
        Verdict::Full { retry_after_ms: WINDOW + 5 - 1_000 }
    );
    for k in 0..ENTRIES as u64 {
        assert_eq!(replay_body(&t, k, 1_001), Some(format!("r{k}").into_bytes()), "key {k}");
    }
    // At the window's end the oldest makes room, and only it.
    let change = match t.begin(&key(1000), &fp(1), WINDOW + 5, LEASE).unwrap() {
        Verdict::Claimed { change, .. } => change,
        other => panic!("{other:?}"),
    };
    assert_eq!(change.evicted, 1);
    assert_eq!(replay_body(&t, 0, WINDOW + 6), None);
    assert!(matches!(t.begin(&key(1001), &fp(1), WINDOW + 6, LEASE).unwrap(), Verdict::Full { retry_after_ms: 9 }));
}

/// By bytes, an answer arrives after its work ran: it cannot be refused. When its bucket's
/// share holds only answers inside their window, it completes its key without being stored
/// (a retry gets the 409 `response-not-stored`: one effect) rather than evict one of them.
#[test]
fn an_answer_meeting_only_young_answers_completes_unstored() {
    let size = response(&"b".repeat(1000)).stored_len() as u64;
    let t = table_with_budget(ENTRIES, 3 * size + 10).with_window(60_000);
    for k in 0..3u64 {
        let ticket = claim(&t, k, k);
        done(complete(&t, &ticket, &"b".repeat(1000), k + 1, RETENTION));
    }
    let ticket = claim(&t, 3, 10);
    let c = complete(&t, &ticket, &"b".repeat(1000), 11, RETENTION);
    assert!(matches!(c, Completion::WithoutBody(Change { bytes: 0, evicted: 0, .. })), "{c:?}");
    assert_eq!(t.begin(&key(3), &fp(1), 12, LEASE).unwrap(), Verdict::CompletedWithoutBody);
    for k in 0..3 {
        assert_eq!(replay_body(&t, k, 13), Some(b"b".repeat(1000)), "key {k} kept");
    }
    // Nothing of the unstored answer is left in the store.
    assert!(t.store.value_bytes() < 3 * size as usize + 2 * crate::encoding::BUCKET_BYTES);
    // Past the window, the oldest answer makes room again.
    let ticket = claim(&t, 4, 60_002);
    assert!(matches!(complete(&t, &ticket, &"b".repeat(1000), 60_003, RETENTION), Completion::Stored(_)));
    assert_eq!(replay_body(&t, 0, 60_004), None);
}
