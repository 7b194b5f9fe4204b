//! The lifecycle over the etcd store, two replicas on one in-memory etcd: what a fleet
//! promises that one Envoy does not have to (read your writes across replicas).

use super::tests::{post, status_of, upstream_answer};
use super::*;
use crate::config::Config;
use crate::metrics::Counter;
use crate::store::etcd::model::Model;
use crate::store::etcd::{EtcdStore, Link};
pub(super) use crate::test_driver::settle;
use crate::test_driver::{at, count, deliver_store_answer as deliver, dispatched, replies, send};

pub(super) fn replica(config: &str, seed: u64) -> Lifecycle<EtcdStore> {
    let config = Config::parse(config.as_bytes()).unwrap();
    let link = Link::grpc("etcd", 1_000);
    let max_lease = config.policies().map(|p| p.lease_ms).max().unwrap();
    let retentions = config.policies().map(|p| p.retention_s).collect();
    let store = EtcdStore::new(link, &config.namespace, max_lease, retentions, seed);
    Lifecycle::new(config, store)
}

const ETCD: &str = r#"{"store":{"kind":"etcd","cluster":"etcd"}}"#;
const ETCD_ROUTER: &str = r#"{"forward":"router","store":{"kind":"etcd","cluster":"etcd"}}"#;

/// Read your writes: with etcd, a detached answer reaches its client only once etcd has its
/// completion; a retry sent after that, to the other replica, is replayed.
#[test]
fn a_detached_answer_leaves_after_its_completion_is_stored() {
    let mut m = Model::new();
    let (mut a, mut b) = (replica(ETCD, 1), replica(ETCD, 2));
    let (flow, effects) = send(&mut a, 1, &post("k", "{}"), 0);
    assert_eq!(flow, Flow::Pause);
    let effects = settle(&mut a, &mut m, effects, 0);
    let calls = dispatched(&effects);
    assert_eq!(calls.len(), 1, "the claim is in: the request goes upstream");
    a.on_call_answer(&upstream_answer("201", "made"), calls[0].0, true, 4, 5);
    let effects = a.take_effects();
    assert!(replies(&effects).is_empty(), "the answer waits for its completion");
    let completion: Vec<Effect> =
        effects.iter().filter(|e| matches!(e, Effect::Dispatch { call: CallId::Store(_), .. })).cloned().collect();
    assert_eq!(completion.len(), 1, "{effects:?}");
    // Nothing is stored until etcd has the completion: the other replica gets 409.
    let (_, early) = send(&mut b, 7, &post("k", "{}"), 6);
    let early = settle(&mut b, &mut m, early, 6);
    assert_eq!(replies(&early).iter().map(|(_, r)| status_of(r)).collect::<Vec<_>>(), vec![409]);
    let after = settle(&mut a, &mut m, completion, 7);
    let sent = replies(&after);
    assert_eq!(sent.len(), 1);
    assert_eq!((sent[0].0, status_of(&sent[0].1)), (1, 201));
    let (_, retry) = send(&mut b, 8, &post("k", "{}"), 8);
    let retry = settle(&mut b, &mut m, retry, 8);
    let replayed = replies(&retry);
    assert!(matches!(&replayed[..], [(8, Reply::Stored { replayed: true, .. })]), "{replayed:?}");
}

/// Read your writes in router mode: the response's end is held until etcd has the
/// completion, then resumed.
#[test]
fn a_router_answer_is_held_at_its_end_until_its_completion_is_stored() {
    let mut m = Model::new();
    let (mut a, mut b) = (replica(ETCD_ROUTER, 1), replica(ETCD_ROUTER, 2));
    let (flow, effects) = send(&mut a, 1, &post("k", "{}"), 0);
    assert_eq!(flow, Flow::Pause, "the claim goes to etcd first");
    let effects = settle(&mut a, &mut m, effects, 0);
    assert!(effects.contains(&Effect::Resume { stream: 1 }), "{effects:?}");
    let response = super::tests::router_answer(b"made");
    assert_eq!(a.on_response_headers(&at(&response, 3), 1, false), Flow::Continue);
    // Every byte is held, not only the end: a client counting Content-Length has its
    // answer once the last byte arrives, whether or not the end follows.
    assert_eq!(a.on_response_body(&at(&response, 4), 1, 2, false), Flow::Pause, "the bytes wait");
    assert_eq!(a.on_response_body(&at(&response, 4), 1, 4, true), Flow::Pause, "the end waits");
    let effects = a.take_effects();
    assert!(!effects.iter().any(|e| matches!(e, Effect::ResumeResponse { .. })));
    let effects = settle(&mut a, &mut m, effects, 5);
    assert!(effects.contains(&Effect::ResumeResponse { stream: 1 }), "{effects:?}");
    let (_, retry) = send(&mut b, 9, &post("k", "{}"), 6);
    let retry = settle(&mut b, &mut m, retry, 6);
    let replayed = replies(&retry);
    let [(9, Reply::Stored { replayed: true, response })] = &replayed[..] else { panic!("{replayed:?}") };
    assert_eq!(response.body(), b"made", "the whole buffered body is stored");
}

/// etcd does not acknowledge the completion: the answer still reaches its client (never
/// lost) once the store gave up for now, counted; the completion is retried.
#[test]
fn an_unacknowledged_completion_does_not_hold_the_answer_for_ever() {
    let mut m = Model::new();
    let mut a = replica(ETCD, 1);
    let (_, effects) = send(&mut a, 1, &post("k", "{}"), 0);
    let calls = dispatched(&settle(&mut a, &mut m, effects, 0));
    a.on_call_answer(&upstream_answer("201", "made"), calls[0].0, true, 4, 5);
    let effects = a.take_effects();
    for effect in effects {
        if let Effect::Dispatch { call: call @ CallId::Store(_), .. } = effect {
            deliver(&mut a, call, &crate::store::etcd::grpc::status_answer(4, "upstream request timeout"), 1_005);
        }
    }
    let effects = a.take_effects();
    assert_eq!(replies(&effects).iter().map(|(id, r)| (*id, status_of(r))).collect::<Vec<_>>(), vec![(1, 201)]);
    assert_eq!(count(&effects, Counter::CompletionUnacknowledged), 1);
    // The completion is sent again after the backoff, and lands.
    let mut t = 1_100;
    while m.requests.get("Txn").copied().unwrap_or(0) < 3 && t < 5_000 {
        a.on_tick(t);
        let e = a.take_effects();
        settle(&mut a, &mut m, e, t);
        t += 50;
    }
    let mut b = replica(ETCD, 2);
    let (_, retry) = send(&mut b, 9, &post("k", "{}"), t);
    let retry = settle(&mut b, &mut m, retry, t);
    assert!(matches!(&replies(&retry)[..], [(9, Reply::Stored { replayed: true, .. })]), "{retry:?}");
}

/// A completion that cannot even be sent (etcd failing: the store backs off) holds the
/// answer for `write_wait_ms` at most.
#[test]
fn a_held_answer_goes_after_write_wait_ms() {
    let mut m = Model::new();
    let mut a = replica(ETCD, 1);
    let (_, effects) = send(&mut a, 1, &post("k", "{}"), 0);
    let calls = dispatched(&settle(&mut a, &mut m, effects, 0));
    a.on_call_answer(&upstream_answer("201", "made"), calls[0].0, true, 4, 5);
    let pending = a.take_effects();
    assert!(replies(&pending).is_empty());
    // The completion's call is never answered (etcd hangs); the timer lets the answer go.
    a.on_tick(1_000);
    assert!(replies(&a.take_effects()).is_empty(), "within write_wait_ms (2 s) it waits");
    a.on_tick(2_010);
    let effects = a.take_effects();
    assert_eq!(replies(&effects).iter().map(|(id, r)| (*id, status_of(r))).collect::<Vec<_>>(), vec![(1, 201)]);
    assert_eq!(count(&effects, Counter::CompletionUnacknowledged), 1);
}

/// Defect (found by tests/test_fencing.py): a router owner that learnt it lost its key (taken
/// over while it was paused) completes at once; the end must then go on by the callback's own
/// `Continue`, never by a resume from inside that callback (Envoy crashed: SIGSEGV).
#[test]
fn a_router_owner_known_lost_lets_its_answer_go_without_a_resume() {
    let mut m = Model::new();
    let (mut a, mut b) = (replica(ETCD_ROUTER, 1), replica(ETCD_ROUTER, 2));
    let (_, effects) = send(&mut a, 1, &post("k", "{}"), 0);
    assert!(settle(&mut a, &mut m, effects, 0).contains(&Effect::Resume { stream: 1 }));
    // A pauses past its lease; B takes the key over; A's next renewal learns it lost.
    let (_, effects) = send(&mut b, 7, &post("k", "{}"), 10_000);
    assert!(settle(&mut b, &mut m, effects, 10_000).contains(&Effect::Resume { stream: 7 }));
    for t in [10_001, 12_600] {
        a.on_tick(t); // the first rotates the VM's lease, the second renews: refused
        let effects = a.take_effects();
        settle(&mut a, &mut m, effects, t);
    }
    let response = super::tests::router_answer(b"late");
    assert_eq!(a.on_response_headers(&at(&response, 13_400), 1, false), Flow::Continue);
    assert_eq!(a.on_response_body(&at(&response, 13_400), 1, 4, true), Flow::Continue);
    let effects = a.take_effects();
    assert!(!effects.iter().any(|e| matches!(e, Effect::ResumeResponse { .. })), "{effects:?}");
    assert_eq!(count(&effects, Counter::OwnerLost), 1, "{effects:?}");
}

/// Wait mode on etcd: a duplicate held on the other replica asks etcd again every 100 ms
/// while the first call runs (`waiting.rs`), each time with a Range only: no transaction, no
/// raft proposal. Once the first call completed, the next poll's Range finds the answer.
#[test]
fn a_held_duplicates_polls_are_reads_only() {
    const WAIT: &str = r#"{"on_conflict":"wait","wait_max_ms":5000,"store":{"kind":"etcd","cluster":"etcd"}}"#;
    let mut m = Model::new();
    let (mut a, mut b) = (replica(WAIT, 1), replica(WAIT, 2));
    let (_, effects) = send(&mut a, 1, &post("k", "{}"), 0);
    let calls = dispatched(&settle(&mut a, &mut m, effects, 0));
    assert_eq!(calls.len(), 1, "A's first call goes upstream");
    let (flow, effects) = send(&mut b, 7, &post("k", "{}"), 10);
    assert_eq!(flow, Flow::Pause);
    let effects = settle(&mut b, &mut m, effects, 10);
    assert!(replies(&effects).is_empty(), "held: {effects:?}");
    assert_eq!(count(&effects, Counter::Waited), 1);
    let (from, proposals) = (m.log.len(), m.proposals);
    for t in (30..1_000).step_by(20) {
        b.on_tick(t);
        let effects = b.take_effects();
        assert!(replies(&settle(&mut b, &mut m, effects, t)).is_empty(), "still held at {t}");
    }
    let polls = m.log.get(from..).unwrap_or_default().to_vec();
    assert!(polls.len() >= 8, "{polls:?}");
    assert!(polls.iter().all(|k| *k == "Range"), "{polls:?}");
    assert_eq!(m.proposals, proposals, "a poll proposed");
    a.on_call_answer(&upstream_answer("201", "made"), calls[0].0, true, 4, 1_000);
    let effects = a.take_effects();
    let sent = replies(&settle(&mut a, &mut m, effects, 1_000));
    assert_eq!(sent.iter().map(|(id, r)| (*id, status_of(r))).collect::<Vec<_>>(), vec![(1, 201)]);
    let (from, proposals) = (m.log.len(), m.proposals);
    let mut replayed = Vec::new();
    for t in (1_000..1_300).step_by(20) {
        b.on_tick(t);
        let effects = b.take_effects();
        replayed.extend(replies(&settle(&mut b, &mut m, effects, t)));
    }
    assert!(matches!(&replayed[..], [(7, Reply::Stored { replayed: true, .. })]), "{replayed:?}");
    assert_eq!(m.log.get(from..).unwrap_or_default(), ["Range"]);
    assert_eq!(m.proposals, proposals);
}
