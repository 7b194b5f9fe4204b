//! The lifecycle natively, driven by the simulator's driver (`crate::test_driver`): the test
//! host, the shared-data store over an in-memory map with Envoy's semantics, a fake clock, and
//! many requests interleaved.

use std::rc::Rc;

use super::*;
use crate::config::Config;
use crate::host::memory::MemoryKv;
use crate::metrics::Counter;
use crate::store::shared::SharedStore;
use crate::store::table::{Layout, Table};

use crate::test_driver::answer_detached;
pub(super) use crate::test_driver::{at, count, dispatched, replies, send};
pub(super) use crate::test_host::TestHost as FakeHost;

pub(super) type Headers = Vec<(String, Vec<u8>)>;

pub(super) fn headers(pairs: &[(&str, &str)]) -> Headers {
    pairs.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect()
}

pub(super) fn post(key: &str, body: &str) -> FakeHost {
    let request = headers(&[
        (":method", "POST"),
        (":path", "/pay"),
        (":authority", "api"),
        ("authorization", "Bearer t"),
        ("content-type", "application/json"),
        ("idempotency-key", key),
    ]);
    FakeHost { request, body: body.as_bytes().to_vec(), ..FakeHost::default() }
}

pub(super) type Shared = SharedStore<&'static MemoryKv>;

pub(super) fn lifecycle(config: &str) -> Lifecycle<Shared> {
    let config = Config::parse(config.as_bytes()).unwrap();
    let kv: &'static MemoryKv = Box::leak(Box::new(MemoryKv::new()));
    let table = Table::new(kv, Layout::new(&config.namespace, config.capacity, config.max_store_bytes));
    table.create().unwrap();
    let tick = Lifecycle::<Shared>::tick_ms_for(&config);
    Lifecycle::new(config, SharedStore::new(table, tick, 0))
}

/// The router's answer to a first call (forward "router"): 201, text/plain, `body`.
pub(super) fn router_answer(body: &[u8]) -> FakeHost {
    FakeHost {
        response: headers(&[(":status", "201"), ("content-type", "text/plain")]),
        response_body: body.to_vec(),
        code_details: Some("via_upstream"),
        ..FakeHost::default()
    }
}

pub(super) fn upstream_answer(status: &str, body: &str) -> FakeHost {
    FakeHost {
        call_headers: headers(&[
            (":status", status),
            ("x-envoy-upstream-service-time", "1"),
            ("content-type", "text/plain"),
        ]),
        call_body: body.as_bytes().to_vec(),
        ..FakeHost::default()
    }
}

pub(super) fn status_of(reply: &Reply) -> u16 {
    match reply {
        Reply::Problem(p) => p.status,
        Reply::Stored { response, .. } => response.status(),
        Reply::Grpc(_) => 200,
    }
}

pub(super) fn body_of(reply: &Reply) -> Vec<u8> {
    match reply {
        Reply::Problem(p) => p.body().to_vec(),
        Reply::Stored { response, .. } => response.body().to_vec(),
        Reply::Grpc(a) => a.message.as_bytes().to_vec(),
    }
}

pub(super) fn is_replay(reply: &Reply) -> bool {
    matches!(reply, Reply::Stored { replayed: true, .. })
}

/// docs/deployment.md: with `detached_via` the root sends a detached call to that cluster
/// (an internal listener that routes it again), the client's request unchanged; a rule may
/// name another, and a rule in router mode still lets the router send it.
#[test]
fn a_detached_call_goes_through_the_cluster_detached_via_names() {
    let mut l = lifecycle(
        r#"{"detached_via":"routed","routes":[
            {"match":{"prefix":"/other"},"detached_via":"routed_other"},
            {"match":{"prefix":"/plain"},"forward":"router"}]}"#,
    );
    send(&mut l, 1, &post("k", "{}"), 0);
    l.on_wake(1);
    let calls = dispatched(&l.take_effects());
    let (_, request) = calls[0].clone();
    assert_eq!(request.cluster, "routed");
    assert_eq!(request.header(":path"), Some("/pay"));
    assert_eq!(request.header("idempotency-key"), Some("k"));
    let at = |path: &str, key: &str| {
        let mut host = post(key, "{}");
        host.request.retain(|(n, _)| n != ":path");
        host.request.push((":path".into(), path.as_bytes().to_vec()));
        host
    };
    let other = at("/other", "k2");
    send(&mut l, 3, &other, 0);
    l.on_wake(1);
    let calls = dispatched(&l.take_effects());
    assert_eq!(calls[0].1.cluster, "routed_other");
    let plain = at("/plain", "k3");
    let (flow, effects) = send(&mut l, 5, &plain, 0);
    assert_eq!(flow, Flow::Continue, "the router sends it");
    assert!(dispatched(&effects).is_empty());
}

/// docs/deployment.md: the filter also on the internal listener answers the hop 409 in
/// progress (it meets the outer claim). Stored, that 409 would replay for `retention_s`; the
/// key is released instead, and the retry runs. Another 409 of the upstream is an answer.
#[test]
fn an_in_progress_409_of_an_idempotency_filter_releases_the_key() {
    let mut l = lifecycle(r#"{"detached_via":"routed"}"#);
    send(&mut l, 1, &post("k", "{}"), 0);
    l.on_wake(1);
    let (call, _) = dispatched(&l.take_effects())[0].clone();
    let looped = r#"{"status":409,"type":"urn:idempotency-filter:problem:in-progress"}"#;
    l.on_call_answer(&upstream_answer("409", looped), call, true, looped.len(), 2);
    let effects = l.take_effects();
    assert_eq!(count(&effects, Counter::Released), 1, "{effects:?}");
    let (flow, effects) = send(&mut l, 3, &post("k", "{}"), 10);
    assert_eq!(flow, Flow::Pause);
    assert_eq!(count(&effects, Counter::Claimed), 1, "the retry runs: {effects:?}");
    // The upstream's own 409 is an answer like any other: stored.
    let mut l = lifecycle(r#"{"detached_via":"routed"}"#);
    send(&mut l, 1, &post("k", "{}"), 0);
    l.on_wake(1);
    let (call, _) = dispatched(&l.take_effects())[0].clone();
    l.on_call_answer(&upstream_answer("409", "already paid"), call, true, 12, 2);
    assert_eq!(count(&l.take_effects(), Counter::Released), 0);
}

#[test]
fn detached_first_call_is_sent_by_the_root_stored_then_replayed() {
    let mut l = lifecycle("{}");
    let (flow, effects) = send(&mut l, 1, &post("k", "{}"), 0);
    assert_eq!(flow, Flow::Pause);
    assert!(effects.contains(&Effect::WakeRoot));
    assert_eq!(count(&effects, Counter::Claimed), 1);
    l.on_wake(1);
    let calls = dispatched(&l.take_effects());
    let (call, request) = calls[0].clone();
    assert_eq!(request.cluster, "upstream");
    assert_eq!(request.header("idempotency-key"), Some("k"));
    assert_eq!(request.body, b"{}");
    l.on_call_answer(&upstream_answer("201", "made"), call, true, 4, 2);
    let effects = l.take_effects();
    let sent = replies(&effects);
    assert_eq!(sent.len(), 1);
    assert_eq!((sent[0].0, status_of(&sent[0].1), body_of(&sent[0].1)), (1, 201, b"made".to_vec()));
    assert!(!is_replay(&sent[0].1));
    assert_eq!(count(&effects, Counter::Completed), 1);
    l.on_stream_done(1);

    let (_, effects) = send(&mut l, 2, &post("k", "{}"), 3);
    let sent = replies(&effects);
    assert!(is_replay(&sent[0].1) && body_of(&sent[0].1) == b"made");
    assert!(!l.is_idle(), "a stream still open keeps its root");
    l.on_stream_done(2);
    assert!(l.is_idle());
}

#[test]
fn the_roots_call_carries_the_clients_headers_as_they_came_and_odd_bytes_go_by_the_router() {
    let mut l = lifecycle("{}");
    let mut request = post("k", "{}");
    request.request.push(("x-note".into(), b"a".to_vec()));
    request.request.push(("x-note".into(), b"".to_vec()));
    send(&mut l, 1, &request, 0);
    l.on_wake(1);
    let (_, call) = dispatched(&l.take_effects())[0].clone();
    let crate::store::CallKind::Http { headers } = &call.kind else { panic!("{call:?}") };
    let sent: Vec<(String, Vec<u8>)> =
        headers.iter().map(|(n, v)| (String::from_utf8(n.to_vec()).unwrap(), v.to_vec())).collect();
    assert_eq!(sent, request.request, "every header, in order, repeats kept");

    // `dispatch_http_call` takes text: a value that is not UTF-8 goes on through the router,
    // claimed all the same.
    let mut odd = post("k2", "{}");
    odd.request.push(("x-note".into(), b"caf\xe9".to_vec()));
    let (flow, effects) = send(&mut l, 2, &odd, 2);
    assert_eq!(count(&effects, Counter::Claimed), 1);
    assert!(!effects.contains(&Effect::WakeRoot), "{effects:?}");
    assert_eq!(flow, Flow::Continue, "{effects:?}");
    l.on_wake(3);
    assert!(dispatched(&l.take_effects()).is_empty());
}

#[test]
fn router_first_call_is_captured_as_it_passes_then_replayed() {
    let mut l = lifecycle(r#"{"forward":"router"}"#);
    let (flow, _) = send(&mut l, 1, &post("k", "{}"), 0);
    assert_eq!(flow, Flow::Continue);
    let answer = FakeHost {
        response: headers(&[(":status", "201"), ("content-type", "text/plain"), ("content-length", "4")]),
        response_body: b"made".to_vec(),
        code_details: Some("via_upstream"),
        ..FakeHost::default()
    };
    l.on_response_headers(&at(&answer, 1), 1, false);
    l.on_response_body(&at(&answer, 2), 1, 4, true);
    assert_eq!(count(&l.take_effects(), Counter::Completed), 1);
    let (_, effects) = send(&mut l, 2, &post("k", "{}"), 3);
    let sent = replies(&effects);
    assert!(is_replay(&sent[0].1) && body_of(&sent[0].1) == b"made");
}

#[test]
fn router_a_filters_own_reply_relaying_a_side_calls_headers_releases_the_key() {
    // ext_authz's denial copies its server's answer headers, the async client's service time
    // among them: only `response.code_details` tells it from the upstream's own.
    let mut l = lifecycle(r#"{"forward":"router"}"#);
    send(&mut l, 1, &post("k", "{}"), 0);
    let denied = FakeHost {
        response: headers(&[(":status", "403"), ("x-envoy-upstream-service-time", "3")]),
        response_body: b"denied".to_vec(),
        code_details: Some("ext_authz_denied"),
        ..FakeHost::default()
    };
    l.on_response_headers(&at(&denied, 1), 1, false);
    l.on_response_body(&at(&denied, 2), 1, 6, true);
    let effects = l.take_effects();
    assert_eq!((count(&effects, Counter::Completed), count(&effects, Counter::Released)), (0, 1));
    let (flow, _) = send(&mut l, 2, &post("k", "{}"), 3);
    assert_eq!(flow, Flow::Continue, "released: the retry does the work");
}

#[test]
fn router_answers_envoy_made_up_release_the_key() {
    let mut l = lifecycle(r#"{"forward":"router"}"#);
    send(&mut l, 1, &post("k", "{}"), 0);
    let reset = FakeHost {
        response: headers(&[(":status", "503")]),
        code_details: Some("upstream_reset_before_response_started{connection_failure}"),
        ..FakeHost::default()
    };
    l.on_response_headers(&at(&reset, 1), 1, true);
    let effects = l.take_effects();
    assert_eq!((count(&effects, Counter::UpstreamFailed), count(&effects, Counter::Released)), (1, 1));
    let (flow, _) = send(&mut l, 2, &post("k", "{}"), 2);
    assert_eq!(flow, Flow::Continue, "released: the retry does the work");
}

#[test]
fn a_retry_storm_decides_alike_with_its_digests_from_the_memo() {
    // From the third request on, a retry's key, body and fingerprint digests come from the
    // VM's digest memo: the same decisions, and a changed body or another caller is told apart.
    let mut l = lifecycle("{}");
    send(&mut l, 1, &post("storm", "{}"), 0);
    let mut conflicts = 0;
    for id in 2..8 {
        let (_, effects) = send(&mut l, id, &post("storm", "{}"), 1);
        conflicts += usize::from(status_of(&replies(&effects)[0].1) == 409);
    }
    assert_eq!(conflicts, 6);
    answer_detached(&mut l, &upstream_answer("201", "made"), 2);
    for id in 10..16 {
        let (_, effects) = send(&mut l, id, &post("storm", "{}"), 3);
        let sent = replies(&effects);
        assert!(is_replay(&sent[0].1) && body_of(&sent[0].1) == b"made", "{id}");
        let (_, effects) = send(&mut l, id + 100, &post("storm", r#"{"x":1}"#), 3);
        assert_eq!(status_of(&replies(&effects)[0].1), 422, "another body of the key");
    }
    let mut other_caller = post("storm", "{}");
    other_caller.request.retain(|(n, _)| n != "authorization");
    other_caller.request.push(("authorization".into(), b"Bearer u".to_vec()));
    let (_, effects) = send(&mut l, 200, &other_caller, 4);
    assert_eq!(count(&effects, Counter::Claimed), 1, "another caller's key of the same name");
}

#[test]
fn duplicates_in_progress_get_409_and_a_failure_releases() {
    let mut l = lifecycle("{}");
    send(&mut l, 1, &post("k", "{}"), 0);
    let (_, effects) = send(&mut l, 2, &post("k", "{}"), 1);
    let sent = replies(&effects);
    assert_eq!(status_of(&sent[0].1), 409);
    assert_eq!(count(&effects, Counter::Conflict), 1);
    let (_, other) = send(&mut l, 3, &post("k", r#"{"other":1}"#), 1);
    assert_eq!(status_of(&replies(&other)[0].1), 422);
    let effects = answer_detached(&mut l, &upstream_answer("503", "busy"), 2);
    assert_eq!(count(&effects, Counter::Released), 1);
    assert_eq!(status_of(&replies(&effects)[0].1), 503, "the upstream's own answer passes on");
    let (_, effects) = send(&mut l, 4, &post("k", "{}"), 3);
    assert_eq!(count(&effects, Counter::Claimed), 1);
}

#[test]
fn no_answer_from_the_upstream_releases_and_answers_a_problem() {
    let mut l = lifecycle("{}");
    send(&mut l, 1, &post("k", "{}"), 0);
    let broken = FakeHost::default(); // no headers at all
    let effects = answer_detached(&mut l, &broken, 1);
    let sent = replies(&effects);
    assert_eq!(status_of(&sent[0].1), 502);
    assert_eq!((count(&effects, Counter::UpstreamFailed), count(&effects, Counter::Released)), (1, 1));
    // A call that could not even be sent: 503, released.
    send(&mut l, 2, &post("k2", "{}"), 2);
    l.on_wake(2);
    let (call, _) = dispatched(&l.take_effects())[0].clone();
    l.on_call_failed(call, 3);
    let effects = l.take_effects();
    assert_eq!(status_of(&replies(&effects)[0].1), 503);
    assert_eq!(count(&effects, Counter::Released), 1);
}

#[test]
fn wait_mode_holds_a_duplicate_and_answers_it_with_the_replay() {
    let mut l = lifecycle(r#"{"on_conflict":"wait"}"#);
    send(&mut l, 1, &post("k", "{}"), 0);
    l.on_wake(0);
    let (call, _) = dispatched(&l.take_effects())[0].clone();
    let (flow, effects) = send(&mut l, 2, &post("k", "{}"), 1);
    assert_eq!(flow, Flow::Pause);
    assert!(replies(&effects).is_empty());
    assert_eq!(count(&effects, Counter::Waited), 1);
    l.on_tick(20);
    assert!(replies(&l.take_effects()).is_empty(), "still in progress");
    let answer = upstream_answer("201", "made");
    l.on_call_answer(&answer, call, true, 4, 30);
    assert_eq!(replies(&l.take_effects()).len(), 1, "the first call's own answer");
    l.on_tick(40);
    let sent = replies(&l.take_effects());
    assert_eq!(sent.len(), 1);
    assert!(sent[0].0 == 2 && is_replay(&sent[0].1));
}

#[test]
fn wait_mode_gives_409_after_wait_max_ms_and_409_at_once_past_the_buffer_budget() {
    // A held request's headers and body count (about 130 bytes here); a caller holds half.
    let mut l = lifecycle(r#"{"on_conflict":"wait","wait_max_ms":100,"max_buffered_bytes":400}"#);
    send(&mut l, 1, &post("k", "{}"), 0);
    send(&mut l, 2, &post("k", "{}"), 1);
    l.on_tick(50);
    assert!(replies(&l.take_effects()).is_empty());
    l.on_tick(120);
    let sent = replies(&l.take_effects());
    assert_eq!((sent[0].0, status_of(&sent[0].1)), (2, 409));
    // A body larger than the caller's half of the budget is not held.
    let big = "x".repeat(100);
    send(&mut l, 3, &post("big", &big), 130);
    let (_, effects) = send(&mut l, 4, &post("big", &big), 131);
    assert_eq!(status_of(&replies(&effects)[0].1), 409);
}

/// Defect: a request with trailers and no body was claimed from the trailers callback, but
/// its body-arrival guard was never cleared: 3 s later the "misconfigured" 500 went onto a
/// stream already upstream (and in router mode that 500 released the key).
#[test]
fn a_request_claimed_from_its_trailers_is_not_taken_for_a_missing_body() {
    let mut l = lifecycle(r#"{"forward":"router"}"#);
    let host = post("k", "");
    assert_eq!(l.on_request_headers(&at(&host, 0), 1, false), Flow::Pause);
    assert_eq!(l.on_request_trailers(&at(&host, 0), 1), Flow::Continue);
    l.take_effects();
    l.on_tick(4_000);
    assert!(replies(&l.take_effects()).is_empty(), "a 500 onto a stream already upstream");
    // The guard itself: a request whose body never comes gets the 500 naming the setting.
    assert_eq!(l.on_request_headers(&at(&post("k2", ""), 5_000), 2, false), Flow::Pause);
    l.on_tick(8_001);
    let sent = replies(&l.take_effects());
    assert_eq!((sent[0].0, status_of(&sent[0].1)), (2, 500));
}

/// Defect: a configuration update tore down the old root while its detached calls were in
/// flight; their results were lost. A root now ends only once the lifecycle is idle.
#[test]
fn the_lifecycle_is_idle_only_when_its_calls_are_done() {
    let mut l = lifecycle("{}");
    assert!(l.is_idle());
    send(&mut l, 1, &post("k", "{}"), 0);
    assert!(!l.is_idle(), "a call waits for the root");
    l.on_wake(1);
    let (call, _) = dispatched(&l.take_effects())[0].clone();
    assert!(!l.is_idle(), "a call is in flight");
    l.on_stream_done(1); // the client left; the call goes on
    l.on_call_answer(&upstream_answer("201", "made"), call, true, 4, 2);
    assert!(l.is_idle());
    let effects = l.take_effects();
    assert!(replies(&effects).is_empty(), "nobody to answer");
    assert_eq!(count(&effects, Counter::Completed), 1, "the result is stored all the same");
}

#[test]
fn a_router_owner_whose_client_left_is_no_longer_renewed() {
    let mut l = lifecycle(r#"{"forward":"router","lease_ms":1000}"#);
    send(&mut l, 1, &post("k", "{}"), 0);
    l.on_stream_done(1);
    // Its mark expires after lease_ms: then the key is processed again.
    for t in (50..1_000).step_by(50) {
        l.on_tick(t);
    }
    let (_, effects) = send(&mut l, 2, &post("k", "{}"), 999);
    assert_eq!(status_of(&replies(&effects)[0].1), 409);
    let (flow, effects) = send(&mut l, 3, &post("k", "{}"), 1_001);
    assert_eq!((flow, count(&effects, Counter::ExpiredTakeover)), (Flow::Continue, 1));
}

#[test]
fn a_live_owner_is_renewed_past_its_lease() {
    let mut l = lifecycle(r#"{"forward":"router","lease_ms":1000}"#);
    send(&mut l, 1, &post("k", "{}"), 0);
    for t in (50..5_000).step_by(50) {
        l.on_tick(t);
    }
    let (_, effects) = send(&mut l, 2, &post("k", "{}"), 5_000);
    assert_eq!(status_of(&replies(&effects)[0].1), 409, "a live call's mark expired");
}

#[test]
fn many_interleaved_duplicates_claim_once() {
    let mut l = lifecycle("{}");
    let host = post("k", "{}");
    for id in 1..=50 {
        assert_eq!(l.on_request_headers(&at(&host, 0), id, false), Flow::Pause);
    }
    for id in (1..=50).rev() {
        l.on_request_body(&at(&host, 1), id, 2, true);
    }
    let effects = l.take_effects();
    assert_eq!((count(&effects, Counter::Claimed), count(&effects, Counter::Conflict)), (1, 49));
    assert!(replies(&effects).iter().all(|(id, r)| *id != 50 && status_of(r) == 409));
}

#[test]
fn keys_scopes_and_sizes_are_checked_before_the_claim() {
    let mut l = lifecycle(r#"{"require_key":true,"max_request_body_bytes":4}"#);
    let mut no_key = post("k", "{}");
    no_key.request.retain(|(n, _)| n != "idempotency-key");
    assert_eq!(l.on_request_headers(&at(&no_key, 0), 1, false), Flow::Pause);
    let mut bad = post("bad key", "{}");
    assert_eq!(l.on_request_headers(&at(&bad, 0), 2, false), Flow::Pause);
    bad.request.push(("idempotency-key".into(), b"again".to_vec()));
    assert_eq!(l.on_request_headers(&at(&bad, 0), 3, false), Flow::Pause);
    l.on_request_headers(&at(&post("k", "too long"), 0), 4, false);
    l.on_request_body(&at(&post("k", "too long"), 0), 4, 8, true);
    let statuses: Vec<u16> = replies(&l.take_effects()).iter().map(|(_, r)| status_of(r)).collect();
    assert_eq!(statuses, vec![400, 400, 400, 413]);
    let mut get = post("k", "");
    get.request[0].1 = b"GET".to_vec();
    assert_eq!(l.on_request_headers(&at(&get, 0), 5, true), Flow::Continue, "not covered");
}

#[test]
fn missing_scope_pass_reject_share() {
    let mut anonymous = post("k", "{}");
    anonymous.request.retain(|(n, _)| n != "authorization");
    let mut pass = lifecycle("{}");
    assert_eq!(pass.on_request_headers(&at(&anonymous, 0), 1, false), Flow::Continue);
    assert_eq!(count(&pass.take_effects(), Counter::ScopeMissing), 1);
    let mut reject = lifecycle(r#"{"missing_scope":"reject"}"#);
    reject.on_request_headers(&at(&anonymous, 0), 1, false);
    assert_eq!(status_of(&replies(&reject.take_effects())[0].1), 401);
    let mut share = lifecycle(r#"{"missing_scope":"share"}"#);
    let (_, effects) = send(&mut share, 1, &anonymous, 0);
    assert_eq!((count(&effects, Counter::Claimed), count(&effects, Counter::ScopeMissing)), (1, 1));
}

/// Defect (a review of identities): an empty `Authorization:` was a scope, shared by everyone
/// who sent one, and it passed `missing_scope: "reject"`. An empty value is absent.
#[test]
fn an_empty_scope_value_is_no_caller() {
    let mut empty = post("k", "{}");
    empty.request.retain(|(n, _)| n != "authorization");
    empty.request.push(("authorization".into(), Vec::new()));
    let mut reject = lifecycle(r#"{"missing_scope":"reject"}"#);
    reject.on_request_headers(&at(&empty, 0), 1, false);
    assert_eq!(status_of(&replies(&reject.take_effects())[0].1), 401);
    let mut pass = lifecycle("{}");
    assert_eq!(pass.on_request_headers(&at(&empty, 0), 1, false), Flow::Continue);
    assert_eq!(count(&pass.take_effects(), Counter::ScopeMissing), 1);
}

/// Defect (a review of identities): the store key hashed scope values, not where they came
/// from: a header value on one route named the same key as an equal JWT claim on another.
/// When the policies read different sources, the key binds each value's source.
#[test]
fn a_header_and_a_claim_of_equal_value_name_different_keys() {
    let config = r#"{"routes":[{"match":{"prefix":"/jwt/"},"scope_headers":["x-who"]}]}"#;
    let parsed = Config::parse(config.as_bytes()).unwrap();
    assert!(parsed.policies().all(|p| p.scope_source.is_some()), "mixed sources are bound");
    assert!(Config::parse(b"{}").unwrap().policy.scope_source.is_none(), "one source: keys as before");
    let mut l = lifecycle(config);
    let mut by_header = post("k", "{}");
    by_header.request.retain(|(n, _)| n != "authorization");
    by_header.request.push(("x-who".into(), b"alice".to_vec()));
    by_header.request[1].1 = b"/jwt/pay".to_vec();
    let mut by_authorization = post("k", "{}");
    by_authorization.request.retain(|(n, _)| n != "authorization");
    by_authorization.request.push(("authorization".into(), b"alice".to_vec()));
    by_authorization.request[1].1 = b"/jwt/pay".to_vec();
    let (_, effects) = send(&mut l, 1, &by_header, 0);
    assert_eq!(count(&effects, Counter::Claimed), 1);
    // The same value from another source, on another policy: its own key, not a 409 or 422.
    by_authorization.request[1].1 = b"/pay".to_vec();
    let (_, effects) = send(&mut l, 2, &by_authorization, 1);
    assert_eq!(count(&effects, Counter::Claimed), 1, "{effects:?}");
}

#[test]
fn one_replay_serves_many_waiters_without_a_copy_each() {
    let mut l = lifecycle(r#"{"on_conflict":"wait"}"#);
    send(&mut l, 1, &post("k", "{}"), 0);
    for id in 2..=10 {
        send(&mut l, id, &post("k", "{}"), 1);
    }
    answer_detached(&mut l, &upstream_answer("201", "made"), 2);
    l.on_tick(20);
    let sent = replies(&l.take_effects());
    assert_eq!(sent.len(), 9);
    let first = match &sent[0].1 {
        Reply::Stored { response, .. } => response.clone(),
        other => panic!("{other:?}"),
    };
    assert!(sent
        .iter()
        .all(|(_, r)| matches!(r, Reply::Stored { response, replayed: true } if Rc::ptr_eq(response, &first))));
}

/// docs/behaviour.md §3.8: a detached answer is copied into the VM only within its caller's
/// share of the worker's buffer. A larger one is not read: the work ran, so its key completes
/// (a retry gets the 409 `response-not-stored`), and the client learns the answer could not be
/// relayed.
#[test]
fn a_detached_answer_too_large_for_the_buffer_share_completes_unrelayed() {
    let mut l = lifecycle(r#"{"max_buffered_bytes":1000}"#);
    send(&mut l, 1, &post("k", "{}"), 0);
    let effects = answer_detached(&mut l, &upstream_answer("201", &"x".repeat(600)), 10);
    let sent = replies(&effects);
    assert_eq!((sent[0].0, status_of(&sent[0].1)), (1, 502), "{:?}", sent);
    assert_eq!(count(&effects, Counter::Completed), 1);
    let (_, effects) = send(&mut l, 2, &post("k", "{}"), 20);
    assert_eq!(status_of(&replies(&effects)[0].1), 409, "completed, its answer not stored");
    // An answer within the share is relayed and stored as before.
    send(&mut l, 3, &post("small", "{}"), 30);
    let effects = answer_detached(&mut l, &upstream_answer("201", &"x".repeat(400)), 40);
    assert_eq!(status_of(&replies(&effects)[0].1), 201);
}

/// docs/behaviour.md §3.4: a worker's wait slots are shared per caller. One caller holding
/// half of them gets its next duplicate answered 409 at once; another caller's duplicate is
/// still held.
#[test]
fn one_caller_running_the_wait_slots_out_is_refused_itself() {
    let mut l = lifecycle(r#"{"on_conflict":"wait","max_waiters":4}"#);
    let as_caller = |who: &str, key: &str| {
        let mut r = post(key, "{}");
        r.request.retain(|(n, _)| n != "authorization");
        r.request.push(("authorization".into(), who.as_bytes().to_vec()));
        r
    };
    // Both callers are known (each claimed twice), so each has its own half.
    let firsts = [("Bearer a", "a1"), ("Bearer a", "a2"), ("Bearer b", "b1"), ("Bearer b", "b2")];
    for (id, (who, key)) in (1..).zip(firsts) {
        send(&mut l, id, &as_caller(who, key), 0);
    }
    for n in 0..2 {
        let (_, effects) = send(&mut l, 10 + n, &as_caller("Bearer a", "a1"), 1);
        assert_eq!(count(&effects, Counter::Waited), 1, "a's duplicate {n} held");
    }
    let (_, effects) = send(&mut l, 20, &as_caller("Bearer a", "a1"), 2);
    assert_eq!(status_of(&replies(&effects)[0].1), 409, "a holds its half: 409 at once");
    let (_, effects) = send(&mut l, 21, &as_caller("Bearer b", "b1"), 3);
    assert_eq!(count(&effects, Counter::Waited), 1, "b's duplicate is still held");
}

/// Wait mode polls held requests on the timer: any policy in wait mode, the base or a rule,
/// makes it tick every 20 ms; otherwise 50 ms is enough for renewals (docs/behaviour.md §4).
#[test]
fn the_timer_ticks_faster_only_when_a_policy_waits() {
    let tick = |json: &str| Lifecycle::<Shared>::tick_ms_for(&Config::parse(json.as_bytes()).unwrap());
    assert_eq!(tick("{}"), TICK_MS);
    assert_eq!(tick(r#"{"on_conflict": "wait"}"#), WAIT_TICK_MS);
    let rule = r#"{"routes": [{"match": {"prefix": "/slow"}, "on_conflict": "wait"}]}"#;
    assert_eq!(tick(rule), WAIT_TICK_MS);
}

/// A covered method without a key passes through untouched unless `require_key` is set, in
/// which case it gets 400 (docs/configuration.md).
#[test]
fn a_keyless_post_passes_unless_a_key_is_required() {
    let keyless = |host: &FakeHost| FakeHost {
        request: host.request.iter().filter(|(n, _)| n != "idempotency-key").cloned().collect(),
        ..host.clone()
    };
    let host = keyless(&post("unused", "{}"));
    let mut l = lifecycle("{}");
    assert_eq!(l.on_request_headers(&at(&host, 0), 1, false), Flow::Continue);
    assert!(replies(&l.take_effects()).is_empty());
    let mut l = lifecycle(r#"{"require_key": true}"#);
    l.on_request_headers(&at(&host, 0), 1, false);
    let sent = replies(&l.take_effects());
    assert_eq!(sent.iter().map(|(id, r)| (*id, status_of(r))).collect::<Vec<_>>(), vec![(1, 400)]);
}
