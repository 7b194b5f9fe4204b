//! Fencing tokens (docs/behaviour.md §3.9): every first call carries one, larger for every later claim of
//! its key, in both stores and both forward modes; the client's own value never goes on.

use super::fleet_tests::{replica, settle};
use super::tests::{at, dispatched, headers, lifecycle, post, send, upstream_answer, FakeHost};
use super::*;
use crate::store::etcd::model::Model;
use crate::store::CallKind;

const FENCE: &str = "x-fence";

/// A request whose client tries to pass a token of its own.
fn forged(key: &str) -> FakeHost {
    let mut host = post(key, "{}");
    host.request.push((FENCE.into(), b"99999999999999".to_vec()));
    host
}

/// The tokens `effects` set on `stream`'s request (`None`: the header removed).
fn set_on(effects: &[Effect], stream: u32) -> Vec<Option<String>> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::SetRequestHeader { stream: s, name, value } if *s == stream && name == FENCE => Some(value.clone()),
            _ => None,
        })
        .collect()
}

fn token(values: &[Option<String>]) -> u64 {
    match values {
        [None, Some(t)] => t.parse().unwrap(),
        other => panic!("expected the client's value removed, then a token: {other:?}"),
    }
}

#[test]
fn router_first_calls_carry_growing_tokens_and_never_the_clients() {
    let mut l = lifecycle(r#"{"forward":"router","fencing_header":"X-Fence","lease_ms":1000}"#);
    let (flow, effects) = send(&mut l, 1, &forged("k"), 0);
    assert_eq!(flow, Flow::Continue);
    let first = token(&set_on(&effects, 1));
    // Released (the upstream failed): the next claim's token is larger.
    let reset = FakeHost {
        response: headers(&[(":status", "503")]),
        code_details: Some("upstream_reset_before_response_started{connection_failure}"),
        ..FakeHost::default()
    };
    l.on_response_headers(&at(&reset, 1), 1, true);
    let (_, effects) = send(&mut l, 2, &forged("k"), 2);
    let second = token(&set_on(&effects, 2));
    assert!(second > first, "{second} after {first}");
    // (Takeovers and restarts: table::tests::later_claims_of_a_key_carry_larger_tokens…;
    // this VM renews its own live owner's lease, so it never takes it over.)
    // A duplicate answered 409 and a request not covered lose the client's value too.
    let (_, effects) = send(&mut l, 4, &forged("k"), 3);
    assert_eq!(set_on(&effects, 4), vec![None]);
    let mut get = forged("");
    get.request.retain(|(n, _)| n != ":method");
    get.request.push((":method".into(), b"GET".to_vec()));
    l.on_request_headers(&get, 5, true);
    assert_eq!(set_on(&l.take_effects(), 5), vec![None]);
}

#[test]
fn a_detached_call_carries_the_token_in_place_of_the_clients_value() {
    let mut l = lifecycle(r#"{"fencing_header":"x-fence"}"#);
    send(&mut l, 1, &forged("k"), 0);
    l.on_wake(1);
    let calls = dispatched(&l.take_effects());
    let (call, request) = calls[0].clone();
    let CallKind::Http { headers } = &request.kind else { panic!("{request:?}") };
    let values: Vec<&str> = headers.values(FENCE).map(|v| std::str::from_utf8(v).unwrap()).collect();
    let [first] = values[..] else { panic!("one token, not the client's: {values:?}") };
    assert_ne!(first, "99999999999999");
    l.on_call_answer(&upstream_answer("503", "busy"), call, true, 4, 2);
    send(&mut l, 2, &forged("k"), 3);
    l.on_wake(3);
    let (_, again) = dispatched(&l.take_effects())[0].clone();
    let second: u64 = again.header(FENCE).unwrap().parse().unwrap();
    assert!(second > first.parse().unwrap(), "{second} after {first}");
}

/// With etcd the token is the claim's revision: a replica that takes a key over after its
/// owner's lease ran out sends a larger one than the paused owner did.
#[test]
fn with_etcd_a_takeover_on_another_replica_carries_a_larger_token() {
    let config = r#"{"forward":"router","fencing_header":"x-fence","lease_ms":3000,
        "store":{"kind":"etcd","cluster":"etcd","timeout_ms":1000}}"#;
    let mut m = Model::new();
    let (mut a, mut b) = (replica(config, 1), replica(config, 2));
    let (_, effects) = send(&mut a, 1, &forged("k"), 0);
    let paused = token(&set_on(&settle(&mut a, &mut m, effects, 0), 1));
    let (_, effects) = send(&mut b, 7, &forged("k"), 10_000);
    let effects = settle(&mut b, &mut m, effects, 10_000);
    assert!(effects.contains(&Effect::Resume { stream: 7 }), "taken over: {effects:?}");
    let later = token(&set_on(&effects, 7));
    assert!(later > paused, "{later} after {paused}");
}

#[test]
fn the_fencing_header_may_not_be_one_the_plugin_reads() {
    for name in ["idempotency-key", "authorization", "content-type", "host", "content-length", "connection"] {
        let e = Config::parse(format!(r#"{{"fencing_header":"{name}"}}"#).as_bytes()).unwrap_err();
        assert_eq!(e.field, "fencing_header", "{name}");
    }
    assert!(Config::parse(br#"{"fencing_header":"bad name"}"#).is_err());
}
