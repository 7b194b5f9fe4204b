//! gRPC calls (docs/behaviour.md §3.10): the plugin's answers in gRPC's terms, release by `grpc-status`,
//! failed results replayed as the same status and trailers.

use super::grpc_reply::{self, GrpcAnswer};
use super::tests::{count, headers, lifecycle, replies, send, FakeHost};
use super::*;

fn call(key: &str) -> FakeHost {
    let mut host = super::tests::post(key, "\0\0\0\0\x02hi");
    for (n, v) in host.request.iter_mut() {
        if n == "content-type" {
            *v = b"application/grpc".to_vec();
        }
    }
    host.request.push(("grpc-timeout".into(), b"500m".to_vec()));
    host
}

/// The upstream's answer: messages (`body`), then trailers with `code`.
fn answer(body: &[u8], trailers: &[(&str, &str)]) -> FakeHost {
    FakeHost {
        response: headers(&[(":status", "200"), ("content-type", "application/grpc")]),
        response_body: body.to_vec(),
        response_trailers: headers(trailers),
        code_details: Some("via_upstream"),
        ..FakeHost::default()
    }
}

/// Runs stream `id`'s response: headers, body (if any), trailers.
fn respond<S: Store>(l: &mut Lifecycle<S>, id: u32, host: &FakeHost) -> Vec<Effect> {
    l.on_response_headers(host, id, false);
    if !host.response_body.is_empty() {
        l.on_response_body(host, id, host.response_body.len(), false);
    }
    l.on_response_trailers(host, id);
    l.take_effects()
}

fn grpc_reply(effects: &[Effect], id: u32) -> GrpcAnswer {
    match &replies(effects)[..] {
        [(s, Reply::Grpc(a))] if *s == id => a.clone(),
        other => panic!("expected one gRPC answer to {id}: {other:?}"),
    }
}

#[test]
fn a_duplicate_in_progress_gets_aborted_with_a_pushback_even_in_detached_mode() {
    let mut l = lifecycle(r#"{"retry_after_s":3}"#);
    let (flow, _) = send(&mut l, 1, &call("k"), 0);
    assert_eq!(flow, Flow::Continue, "gRPC calls go through the router: detached loses trailers");
    let (_, effects) = send(&mut l, 2, &call("k"), 1);
    let a = grpc_reply(&effects, 2);
    assert_eq!(a.code, grpc_reply::ABORTED);
    assert_eq!(a.metadata[0], ("grpc-retry-pushback-ms".to_string(), b"3000".to_vec()));
    assert_eq!(count(&effects, crate::metrics::Counter::Conflict), 1);
}

#[test]
fn a_server_side_failure_releases_the_key_from_the_trailers_or_a_trailers_only_answer() {
    let mut l = lifecycle(r#"{"forward":"router"}"#);
    send(&mut l, 1, &call("k"), 0);
    let effects = respond(&mut l, 1, &answer(b"", &[("grpc-status", "14"), ("grpc-message", "down")]));
    assert_eq!(count(&effects, crate::metrics::Counter::Released), 1, "{effects:?}");
    let (flow, _) = send(&mut l, 2, &call("k"), 1);
    assert_eq!(flow, Flow::Continue, "released: the retry runs");
    let trailers_only = FakeHost {
        response: headers(&[(":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "13")]),
        code_details: Some("via_upstream"),
        ..FakeHost::default()
    };
    assert_eq!(l.on_response_headers(&trailers_only, 2, true), Flow::Continue);
    assert_eq!(count(&l.take_effects(), crate::metrics::Counter::Released), 1);
}

#[test]
fn a_failure_the_client_caused_is_stored_and_replayed_as_the_same_status_and_trailers() {
    let mut l = lifecycle("{}");
    send(&mut l, 1, &call("k"), 0);
    let trailers = [("grpc-status", "5"), ("grpc-message", "no%20account"), ("x-request-cost", "7")];
    let effects = respond(&mut l, 1, &answer(b"", &trailers));
    assert_eq!(count(&effects, crate::metrics::Counter::Completed), 1);
    let (_, effects) = send(&mut l, 2, &call("k"), 1);
    let a = grpc_reply(&effects, 2);
    assert_eq!((a.code, a.message.as_str()), (5, "no account"));
    assert!(a.metadata.contains(&("x-request-cost".to_string(), b"7".to_vec())));
    assert!(a.metadata.contains(&("idempotent-replayed".to_string(), b"true".to_vec())));
    assert_eq!(count(&effects, crate::metrics::Counter::Replayed), 1);
}

#[test]
fn a_result_with_messages_completes_the_key_and_is_never_run_again() {
    let mut l = lifecycle("{}");
    send(&mut l, 1, &call("k"), 0);
    let effects = respond(&mut l, 1, &answer(b"\0\0\0\0\x02ok", &[("grpc-status", "0")]));
    assert_eq!(count(&effects, crate::metrics::Counter::Completed), 1);
    let (flow, effects) = send(&mut l, 2, &call("k"), 1);
    assert_eq!(flow, Flow::Pause, "not forwarded again");
    assert_eq!(grpc_reply(&effects, 2).code, grpc_reply::FAILED_PRECONDITION);
}

#[test]
fn release_grpc_statuses_takes_names_and_numbers() {
    let c = crate::config::Config::parse(br#"{"release_grpc_statuses":["unavailable",4]}"#).unwrap();
    assert_eq!(c.policy.release_grpc_statuses, (1 << 14) | (1 << 4));
    let e = crate::config::Config::parse(br#"{"release_grpc_statuses":["SOMETIMES"]}"#).unwrap_err();
    assert_eq!(e.field, "release_grpc_statuses[0]");
    assert!(crate::config::Config::parse(br#"{"release_grpc_statuses":[17]}"#).is_err());
}

#[test]
fn with_the_loopback_a_result_with_messages_replays_as_its_messages_and_trailers() {
    let mut l = lifecycle(r#"{"forward":"router","grpc_replays":"loopback"}"#);
    send(&mut l, 1, &call("k"), 0);
    let trailers = [("grpc-status", "0"), ("x-request-cost", "7")];
    let effects = respond(&mut l, 1, &answer(b"\0\0\0\0\x02ok", &trailers));
    assert_eq!(count(&effects, crate::metrics::Counter::Completed), 1);
    let (flow, effects) = send(&mut l, 2, &call("k"), 1);
    assert_eq!(flow, Flow::Continue, "through the router, to the loopback");
    let path = Some(grpc_reply::REPLAY_PATH.to_string());
    assert!(effects.contains(&Effect::SetRequestHeader { stream: 2, name: ":path".into(), value: path }));
    assert_eq!(
        (count(&effects, crate::metrics::Counter::Replayed), count(&effects, crate::metrics::Counter::Claimed)),
        (1, 0)
    );
    let loopback = FakeHost {
        response: headers(&[(":status", "200"), ("content-type", "text/plain"), ("content-length", "1")]),
        response_body: b"x".to_vec(),
        ..FakeHost::default()
    };
    assert_eq!(l.on_response_headers(&loopback, 2, false), Flow::Continue);
    let Some(Effect::SetResponseHeaders { stream: 2, headers }) = l.take_effects().into_iter().next() else {
        panic!("the loopback's headers are replaced")
    };
    let names: Vec<&str> = headers.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, [":status", "content-type", "idempotent-replayed"]);
    assert_eq!(l.on_response_body(&loopback, 2, 1, false), Flow::Pause);
    assert_eq!(l.on_response_body(&loopback, 2, 1, true), Flow::Continue);
    let effects = l.take_effects();
    let expected = Effect::ReplaceResponseBody {
        stream: 2,
        size: 1,
        body: b"\0\0\0\0\x02ok".to_vec(),
        trailers: vec![("grpc-status".into(), b"0".to_vec()), ("x-request-cost".into(), b"7".to_vec())],
    };
    assert_eq!(effects, vec![expected]);
}

/// Detached (the phone's story: the client may leave, the call goes on): the root's call
/// returns its trailers, the key completes, and the client's own answer goes through the
/// loopback too, without `idempotent-replayed`.
#[test]
fn with_the_loopback_a_detached_call_answers_its_client_through_it() {
    let mut l = lifecycle(r#"{"grpc_replays":"loopback"}"#);
    let (flow, _) = send(&mut l, 1, &call("k"), 0);
    assert_eq!(flow, Flow::Pause, "the root sends it");
    l.on_wake(1);
    let calls = super::tests::dispatched(&l.take_effects());
    assert_eq!(calls[0].1.header("grpc-timeout"), None, "the call outlives its client's deadline");
    assert_eq!(calls[0].1.header("content-type"), Some("application/grpc"));
    let upstream = FakeHost {
        call_headers: headers(&[
            (":status", "200"),
            ("content-type", "application/grpc"),
            ("x-envoy-upstream-service-time", "1"),
        ]),
        call_body: b"\0\0\0\0\x02ok".to_vec(),
        call_trailers: headers(&[("grpc-status", "0"), ("x-request-cost", "7")]),
        ..FakeHost::default()
    };
    l.on_call_answer(&upstream, calls[0].0, true, 7, 2);
    let effects = l.take_effects();
    assert_eq!(count(&effects, crate::metrics::Counter::Completed), 1);
    assert!(effects.contains(&Effect::Resume { stream: 1 }), "{effects:?}");
    let loopback = FakeHost {
        response: headers(&[(":status", "200"), ("content-length", "1")]),
        response_body: b"x".to_vec(),
        ..FakeHost::default()
    };
    l.on_response_headers(&loopback, 1, false);
    let Some(Effect::SetResponseHeaders { headers: set, .. }) = l.take_effects().into_iter().next() else { panic!() };
    assert!(!set.iter().any(|(n, _)| n == "idempotent-replayed"), "the first answer is no replay");
    l.on_response_body(&loopback, 1, 1, true);
    let effects = l.take_effects();
    assert!(matches!(&effects[..], [Effect::ReplaceResponseBody { body, .. }] if body == b"\0\0\0\0\x02ok"));
    // A server-side failure of a detached call releases the key and answers as itself.
    send(&mut l, 2, &call("k2"), 3);
    l.on_wake(3);
    let calls = super::tests::dispatched(&l.take_effects());
    let failed = FakeHost { call_body: Vec::new(), call_trailers: headers(&[("grpc-status", "14")]), ..upstream };
    l.on_call_answer(&failed, calls[0].0, true, 0, 4);
    let effects = l.take_effects();
    assert_eq!(count(&effects, crate::metrics::Counter::Released), 1);
    assert_eq!(grpc_reply(&effects, 2).code, grpc_reply::UNAVAILABLE);
}
