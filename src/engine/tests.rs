//! The core against a store with Envoy's exact CAS semantics and a fake clock (compiled under
//! #[cfg(test)] by engine.rs).

use super::*;
use crate::store::memory::MemoryKv;
#[cfg(not(target_family = "wasm"))]
use std::sync::atomic::{AtomicUsize, Ordering};
#[cfg(not(target_family = "wasm"))]
use std::sync::{Arc, Barrier};

const LEASE: u64 = 10_000;
const RETENTION: u64 = 60_000;

fn table(capacity: usize) -> Table<MemoryKv> {
    let t = Table::new(MemoryKv::new(), Layout::new("t", capacity));
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
    StoredResponse {
        status: 201,
        headers: vec![
            ("content-type".into(), b"application/json".to_vec()),
            ("set-cookie".into(), b"a".to_vec()),
            ("set-cookie".into(), b"b".to_vec()),
        ],
        body: body.as_bytes().to_vec(),
    }
}

fn claim(t: &Table<MemoryKv>, k: u64, now: u64) -> Ticket {
    match t.begin(&key(k), &fp(1), now, LEASE).unwrap() {
        Begin::Claimed { ticket, .. } => ticket,
        other => panic!("expected a claim, got {other:?}"),
    }
}

#[test]
fn first_claims_duplicate_conflicts_completion_replays() {
    let t = table(1024);
    let ticket = claim(&t, 1, 0);
    assert_eq!(t.begin(&key(1), &fp(1), 5, LEASE).unwrap(), Begin::InProgress);
    assert_eq!(t.complete(&ticket, Some(&response("one")), 10, RETENTION).unwrap(), Finish::Done);
    assert_eq!(t.begin(&key(1), &fp(1), 20, LEASE).unwrap(), Begin::Replay(response("one")));
    // Another key is independent.
    claim(&t, 2, 20);
}

#[test]
fn different_fingerprint_is_a_mismatch_in_progress_and_completed() {
    let t = table(1024);
    let ticket = claim(&t, 1, 0);
    assert_eq!(t.begin(&key(1), &fp(2), 1, LEASE).unwrap(), Begin::Mismatch);
    t.complete(&ticket, Some(&response("x")), 2, RETENTION).unwrap();
    assert_eq!(t.begin(&key(1), &fp(2), 3, LEASE).unwrap(), Begin::Mismatch);
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
    assert_eq!(t.complete(&ticket, Some(&response("late")), 2, RETENTION).unwrap(), Finish::Lost);
    assert_eq!(t.begin(&key(1), &fp(1), 3, LEASE).unwrap(), Begin::InProgress);
}

#[test]
fn too_large_response_completes_without_body() {
    let t = table(1024);
    let ticket = claim(&t, 1, 0);
    t.complete(&ticket, None, 1, RETENTION).unwrap();
    assert_eq!(t.begin(&key(1), &fp(1), 2, LEASE).unwrap(), Begin::CompletedWithoutBody);
}

#[test]
fn expired_mark_is_taken_over_whatever_the_fingerprint_and_the_late_owner_cannot_overwrite() {
    let t = table(1024);
    let old = claim(&t, 1, 0);
    assert_eq!(t.begin(&key(1), &fp(1), LEASE - 1, LEASE).unwrap(), Begin::InProgress);
    // Past the deadline: a request with another body takes over and becomes the first.
    let new = match t.begin(&key(1), &fp(9), LEASE, LEASE).unwrap() {
        Begin::Claimed { ticket, takeover: true, evicted: State::InProgress } => ticket,
        other => panic!("{other:?}"),
    };
    assert_eq!(new.slot, old.slot);
    t.complete(&new, Some(&response("new")), LEASE + 1, RETENTION).unwrap();
    // The late owner finishes: nothing changes.
    assert_eq!(t.complete(&old, Some(&response("old")), LEASE + 2, RETENTION).unwrap(), Finish::Lost);
    assert_eq!(t.renew(&old, LEASE + 2, LEASE).unwrap(), Finish::Lost);
    assert_eq!(t.begin(&key(1), &fp(9), LEASE + 3, LEASE).unwrap(), Begin::Replay(response("new")));
}

#[test]
fn late_owner_racing_the_new_owner_never_clobbers_its_response() {
    // The old owner passed its ownership check, then the new owner claims and completes,
    // then the old owner writes: the stamp check keeps the new response.
    let t = table(64);
    let old = claim(&t, 1, 0);
    let new = match t.begin(&key(1), &fp(1), LEASE + 1, LEASE).unwrap() {
        Begin::Claimed { ticket, .. } => ticket,
        other => panic!("{other:?}"),
    };
    t.complete(&new, Some(&response("new")), LEASE + 2, RETENTION).unwrap();
    assert_eq!(t.write_response(&old, &response("old")).unwrap(), None);
    assert_eq!(t.begin(&key(1), &fp(1), LEASE + 3, LEASE).unwrap(), Begin::Replay(response("new")));
}

#[test]
fn renewal_keeps_a_slow_owner() {
    let t = table(1024);
    let ticket = claim(&t, 1, 0);
    for now in (LEASE / 2..4 * LEASE).step_by((LEASE / 2) as usize) {
        assert_eq!(t.renew(&ticket, now, LEASE).unwrap(), Finish::Done);
        assert_eq!(t.begin(&key(1), &fp(1), now + LEASE / 2, LEASE).unwrap(), Begin::InProgress);
    }
}

#[test]
fn retention_ends_replay() {
    let t = table(1024);
    let ticket = claim(&t, 1, 0);
    t.complete(&ticket, Some(&response("r")), 0, RETENTION).unwrap();
    assert!(matches!(t.begin(&key(1), &fp(1), RETENTION - 1, LEASE).unwrap(), Begin::Replay(_)));
    assert!(matches!(t.begin(&key(1), &fp(7), RETENTION, LEASE).unwrap(), Begin::Claimed { takeover: false, .. }));
}

#[test]
fn a_full_bucket_refuses_new_keys_until_entries_expire() {
    let t = table(WAYS); // one bucket
    for k in 0..WAYS as u64 {
        claim(&t, k, 0);
    }
    assert_eq!(t.begin(&key(1000), &fp(1), 1, LEASE).unwrap(), Begin::Full);
    // Known keys still get their answer.
    assert_eq!(t.begin(&key(3), &fp(1), 1, LEASE).unwrap(), Begin::InProgress);
    assert!(matches!(t.begin(&key(1000), &fp(1), LEASE, LEASE).unwrap(), Begin::Claimed { .. }));
}

#[test]
fn memory_is_bounded_however_many_keys_pass() {
    let t = table(256);
    let keys_after_create = t.store.key_count();
    assert_eq!(keys_after_create, 4 + 256 + 1);
    let mut now = 0;
    for k in 0..20_000u64 {
        now += 1;
        let ticket = match t.begin(&key(k), &fp(1), now, LEASE).unwrap() {
            Begin::Claimed { ticket, .. } => ticket,
            other => panic!("key {k}: {other:?}"),
        };
        t.complete(&ticket, Some(&response(&"x".repeat(100))), now, 50).unwrap();
        if k.is_multiple_of(64) {
            for b in 0..t.layout.buckets() {
                t.sweep(b, now).unwrap();
            }
        }
    }
    assert_eq!(t.store.key_count(), keys_after_create);
    assert!(t.store.value_bytes() < 256 * 300 + 4 * BUCKET_BYTES_FOR_TEST);
}

const BUCKET_BYTES_FOR_TEST: usize = entry::BUCKET_BYTES;

#[test]
fn sweep_frees_expired_entries_and_their_responses() {
    let t = table(64);
    let a = claim(&t, 1, 0);
    t.complete(&a, Some(&response(&"y".repeat(1000))), 0, 100).unwrap();
    let _b = claim(&t, 2, 0);
    let before = t.store.value_bytes();
    let swept = t.sweep(0, 50).unwrap();
    assert_eq!(swept, Swept::default());
    let swept = t.sweep(0, LEASE).unwrap();
    assert_eq!(swept.freed, Held { in_progress: 1, completed: 1 });
    assert!(t.store.value_bytes() < before - 1000);
}

#[test]
fn release_frees_an_older_response_left_in_the_way() {
    let t = table(64);
    let a = claim(&t, 1, 0);
    t.complete(&a, Some(&response(&"z".repeat(1000))), 0, 10).unwrap();
    let b = claim(&t, 1, 20); // reuses the expired way
    assert_eq!(b.slot, a.slot);
    let before = t.store.value_bytes();
    t.release(&b).unwrap();
    assert!(t.store.value_bytes() < before - 1000);
}

#[test]
fn corrupt_values_are_errors_not_panics() {
    let t = table(64);
    t.store.set("t:1:b0", b"foreign", None).unwrap();
    assert!(matches!(t.begin(&key(1), &fp(1), 0, LEASE), Err(StoreError::Corrupt(_))));
    let missing = Table::new(MemoryKv::new(), Layout::new("t", 64));
    assert_eq!(missing.begin(&key(1), &fp(1), 0, LEASE), Err(StoreError::Missing));
}

#[test]
fn corrupt_response_is_an_error() {
    let t = table(64);
    let a = claim(&t, 1, 0);
    t.complete(&a, Some(&response("ok")), 0, RETENTION).unwrap();
    t.store.set(&t.layout.data_key(a.slot), b"R\x01garbage", None).unwrap();
    assert!(matches!(t.begin(&key(1), &fp(1), 1, LEASE), Err(StoreError::Corrupt(_))));
}

#[test]
fn create_is_idempotent_and_keeps_entries() {
    let t = table(64);
    let a = claim(&t, 1, 0);
    assert!(!t.create().unwrap());
    assert_eq!(t.release(&a).unwrap(), Finish::Done);
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
                        Begin::Claimed { ticket, .. } => {
                            claims.fetch_add(1, Ordering::SeqCst);
                            if k.is_multiple_of(2) {
                                t.complete(&ticket, Some(&response(&k.to_string())), 0, RETENTION).unwrap();
                            }
                        }
                        Begin::InProgress => {}
                        Begin::Replay(r) => assert_eq!(r.body, k.to_string().as_bytes()),
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

/// Owners complete, release and renew while others claim and take over expired marks: the
/// invariants of SPEC §3.8 hold at every step.
#[test]
#[cfg(not(target_family = "wasm"))]
fn concurrent_owners_never_overwrite_each_other() {
    const THREADS: usize = 8;
    let t = Arc::new(table(64)); // one bucket: maximal contention
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|i| {
            let (t, barrier) = (t.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let mut completed = 0;
                for round in 0..300u64 {
                    // Time moves fast: marks expire and are taken over all the time.
                    let now = round * 1_000;
                    if let Begin::Claimed { ticket, .. } = t.begin(&key(round % 5), &fp(1), now, 1_500).unwrap() {
                        match (round + i as u64) % 3 {
                            0 => {
                                let body = format!("{i}-{round}");
                                if t.complete(&ticket, Some(&response(&body)), now, 2_000).unwrap() == Finish::Done {
                                    completed += 1;
                                }
                            }
                            1 => {
                                t.release(&ticket).unwrap();
                            }
                            _ => {} // the owner "dies": its mark expires
                        }
                    }
                    if let Begin::Replay(r) = t.begin(&key(round % 5), &fp(1), now, 1_500).unwrap() {
                        // A replay is always a response that some owner really completed.
                        let body = String::from_utf8(r.body).unwrap();
                        assert!(body.contains('-'), "{body}");
                    }
                }
                completed
            })
        })
        .collect();
    let completed: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(completed > 0);
}
