//! Model checking of the store protocol (docs/behaviour.md §3.8) with loom: three callers claim, renew,
//! complete, release and take over one key against a store with Envoy's shared-data CAS
//! semantics, and loom runs every interleaving of their store operations (bounded by
//! `LOOM_MAX_PREEMPTIONS`, 3 by default here).
//!
//! Each caller acts at fixed times of a shared fake clock, so marks expire and are taken over
//! depending only on the interleaving.
#![cfg(not(target_family = "wasm"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)] // test code

use idempotency::encoding::StoredResponse;
use idempotency::fingerprint::Fingerprint;
use idempotency::host::{KvError, SharedKv};
use idempotency::key::StoreKey;
use idempotency::store::table::{Completion, Finish, Layout, Table, Ticket, Verdict};
use loom::sync::{Arc, Mutex};
use loom::thread;
use std::collections::HashMap;

/// Envoy's shared data (docs/behaviour.md §4) on loom's mutex: every get and set is a point where loom
/// may switch threads.
struct LoomKv {
    /// Values with their cas, and the one global cas counter.
    inner: Mutex<(Values, u32)>,
}

type Values = HashMap<String, (Vec<u8>, u32)>;

impl SharedKv for LoomKv {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), KvError> {
        let inner = self.inner.lock().unwrap();
        Ok(match inner.0.get(key) {
            None => (None, None),
            Some((v, cas)) if v.is_empty() => (None, Some(*cas)),
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
        })
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), KvError> {
        let mut inner = self.inner.lock().unwrap();
        if let (Some((_, current)), Some(expected)) = (inner.0.get(key), cas) {
            if expected != 0 && expected != *current {
                return Err(KvError::CasMismatch);
            }
        }
        inner.1 += 1;
        let next = inner.1;
        inner.0.insert(key.to_string(), (value.to_vec(), next));
        Ok(())
    }
}

const LEASE: u64 = 10;
const RETENTION: u64 = 1_000;

fn new_table() -> Arc<Table<LoomKv>> {
    let kv = LoomKv { inner: Mutex::new((HashMap::new(), 0)) };
    let table = Table::new(kv, Layout::new("m", 1, 1 << 20));
    table.create().unwrap();
    Arc::new(table)
}

fn key() -> StoreKey {
    StoreKey::derive("m", b"host", &[], b"the-key")
}

fn body(name: &str) -> StoredResponse {
    StoredResponse::new(201, [], name.as_bytes().to_vec())
}

/// Completes with `name`'s response: whether it was stored.
fn complete(t: &Table<LoomKv>, ticket: &Ticket, name: &str, now: u64) -> bool {
    match t.complete(ticket, Some(&mut body(name)), now, RETENTION).unwrap() {
        Completion::Stored(_) => true,
        Completion::Lost => false,
        other => panic!("{other:?}"),
    }
}

fn claim(t: &Table<LoomKv>, now: u64) -> Option<Ticket> {
    match t.begin(&key(), &Fingerprint::default(), now, LEASE).unwrap() {
        Verdict::Claimed { ticket, .. } => Some(ticket),
        _ => None,
    }
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(3);
    }
    builder.check(f);
}

/// A slow owner (its mark expires), a taker-over, and an observer. At most one completion
/// succeeds; whatever is replayed, during and after, is that completion's response.
#[test]
fn late_owner_takeover_and_observer() {
    model(|| {
        let t = new_table();
        let a = {
            let t = t.clone();
            thread::spawn(move || {
                let ticket = claim(&t, 0)?;
                // Finishes at 20: its mark (deadline 10) may have been taken over.
                Some(complete(&t, &ticket, "A", 20))
            })
        };
        let b = {
            let t = t.clone();
            thread::spawn(move || {
                let ticket = claim(&t, 15)?;
                Some(complete(&t, &ticket, "B", 16))
            })
        };
        let c = {
            let t = t.clone();
            thread::spawn(move || match t.begin(&key(), &Fingerprint::default(), 17, LEASE).unwrap() {
                Verdict::Replay(r) => Some(r.body().to_vec()),
                _ => None,
            })
        };
        let (a, b, seen) = (a.join().unwrap(), b.join().unwrap(), c.join().unwrap());
        let winners: Vec<&str> =
            [(a, "A"), (b, "B")].iter().filter(|(r, _)| *r == Some(true)).map(|(_, n)| *n).collect();
        assert!(winners.len() <= 1, "two owners completed: {winners:?}");
        let last = t.begin(&key(), &Fingerprint::default(), 18, LEASE).unwrap();
        match winners.first() {
            Some(w) => {
                assert_eq!(last, Verdict::Replay(std::rc::Rc::new(body(w))), "the stored response is the winner's");
                if let Some(seen) = seen {
                    assert_eq!(seen, w.as_bytes(), "an observer saw another response");
                }
            }
            None => assert!(!matches!(last, Verdict::Replay(_)), "a replay without a completion"),
        }
    });
}

/// An owner that renews keeps its key: a later caller can only take over if the renewal came
/// too late, and then the renewal fails and the first owner cannot complete.
#[test]
fn renewal_against_takeover() {
    model(|| {
        let t = new_table();
        let a = {
            let t = t.clone();
            thread::spawn(move || {
                let ticket = claim(&t, 0)?;
                let renewed = t.renew(&ticket, 8, LEASE).unwrap(); // deadline 18 if in time
                let done = complete(&t, &ticket, "A", 16);
                Some((renewed, done))
            })
        };
        let b = {
            let t = t.clone();
            thread::spawn(move || {
                let ticket = claim(&t, 12)?; // after A's first deadline, before its renewed one
                Some(complete(&t, &ticket, "B", 13))
            })
        };
        let (a, b) = (a.join().unwrap(), b.join().unwrap());
        let last = t.begin(&key(), &Fingerprint::default(), 14, LEASE).unwrap();
        match (a, b) {
            // B took the expired mark over: A's renewal and completion change nothing.
            (Some(a), Some(b)) => {
                assert_eq!(a, (Finish::Lost, false), "the taken-over owner still acted");
                assert!(b, "the new owner could not complete");
                assert_eq!(last, Verdict::Replay(std::rc::Rc::new(body("B"))));
            }
            // A renewed in time (B met its mark), or B claimed first (A met B's): one owner.
            (Some(a), None) => {
                assert_eq!(a, (Finish::Done, true));
                assert_eq!(last, Verdict::Replay(std::rc::Rc::new(body("A"))));
            }
            (None, Some(b)) => {
                assert!(b);
                assert_eq!(last, Verdict::Replay(std::rc::Rc::new(body("B"))));
            }
            (None, None) => panic!("nobody got the key"),
        }
    });
}

/// Release lets exactly one of the retries in; an owner never completes after releasing.
#[test]
fn release_then_two_retries() {
    model(|| {
        let t = new_table();
        let a = {
            let t = t.clone();
            thread::spawn(move || {
                let ticket = claim(&t, 0)?;
                assert_eq!(t.release(&ticket).unwrap(), Finish::Done);
                Some(complete(&t, &ticket, "A", 1))
            })
        };
        let retries: Vec<_> = ["B", "C"]
            .into_iter()
            .map(|name| {
                let t = t.clone();
                thread::spawn(move || {
                    let ticket = claim(&t, 2)?;
                    Some((name, complete(&t, &ticket, name, 3)))
                })
            })
            .collect();
        assert_ne!(a.join().unwrap(), Some(true), "completed after its own release");
        let claimed: Vec<_> = retries.into_iter().filter_map(|h| h.join().unwrap()).collect();
        // A holds the key from 0 until its release: both retries may find it in progress, but
        // two retries can never both own it.
        assert!(claimed.len() <= 1, "two owners at once: {claimed:?}");
        if let Some((name, true)) = claimed.first() {
            assert_eq!(
                t.begin(&key(), &Fingerprint::default(), 4, LEASE).unwrap(),
                Verdict::Replay(std::rc::Rc::new(body(name)))
            );
        }
    });
}
