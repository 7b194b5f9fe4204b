//! The one driver of the lifecycle's tests: what an Envoy worker does with a `Lifecycle`, as
//! `plugin/vm.rs` does it, step by step under the test's control. The simulator's world
//! (`src/sim/world.rs`) delivers its etcd answers with [`deliver_store_answer`]; the lifecycle's
//! hand-written tests (`src/lifecycle/*_tests.rs`) send requests, answer calls and settle the
//! root with the rest. Each step returns the effects it produced, for the test to assert on.

use crate::host::Flow;
use crate::lifecycle::{CallId, Effect, Lifecycle, Reply};
use crate::metrics::Counter;
use crate::store::etcd::model::Model;
use crate::store::{CallAnswer, CallRequest, Store};
use crate::test_host::TestHost;

/// A whole request on stream `id`, as Envoy delivers it: headers (the plugin pauses them),
/// then the body at its end.
pub fn send<S: Store>(l: &mut Lifecycle<S>, id: u32, host: &TestHost, now: u64) -> (Flow, Vec<Effect>) {
    let host = &at(host, now);
    assert_eq!(l.on_request_headers(host, id, false), Flow::Pause);
    let flow = l.on_request_body(host, id, host.body.len(), true);
    (flow, l.take_effects())
}

/// `host` at time `now`.
pub fn at(host: &TestHost, now: u64) -> TestHost {
    TestHost { now, ..host.clone() }
}

/// Sends the detached call the root has queued and answers it with `answer` (the upstream's
/// headers and body in `call_headers`/`call_body`); the effects of the answer.
pub fn answer_detached<S: Store>(l: &mut Lifecycle<S>, answer: &TestHost, now: u64) -> Vec<Effect> {
    l.on_wake(now);
    let calls = dispatched(&l.take_effects());
    assert_eq!(calls.len(), 1, "one detached call");
    let (call, _) = calls[0].clone();
    l.on_call_answer(answer, call, !answer.call_headers.is_empty(), answer.call_body.len(), now);
    l.take_effects()
}

/// Hands an etcd call's answer to the lifecycle as the adapter does: the `grpc-status` and
/// `grpc-message` of the answer's trailers, its message (UNAVAILABLE when no status came).
pub fn deliver_store_answer<S: Store>(l: &mut Lifecycle<S>, call: CallId, answer: &CallAnswer, now: u64) {
    let header = |name: &str| answer.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
    let status = header("grpc-status").and_then(|v| std::str::from_utf8(&v).ok()?.parse().ok()).unwrap_or(14);
    let host = TestHost {
        now,
        call_body: answer.body.clone(),
        grpc_text: header("grpc-message").unwrap_or_default(),
        ..TestHost::default()
    };
    l.on_grpc_call_answer(&host, call, status, answer.body.len(), now);
}

/// Runs the root's events after `effects`: wakes it when asked, answers every etcd call it
/// makes from `etcd` at once, until none is left; the other effects, in order.
pub fn settle<S: Store>(l: &mut Lifecycle<S>, etcd: &mut Model, mut effects: Vec<Effect>, now: u64) -> Vec<Effect> {
    let mut out = Vec::new();
    loop {
        if effects.contains(&Effect::WakeRoot) {
            l.on_wake(now);
        }
        let mut answered = false;
        for effect in std::mem::take(&mut effects) {
            match effect {
                Effect::Dispatch { call: call @ CallId::Store(_), request } => {
                    let answer = etcd.handle(&request, now);
                    deliver_store_answer(l, call, &answer, now);
                    answered = true;
                }
                Effect::WakeRoot => {}
                other => out.push(other),
            }
        }
        effects = l.take_effects();
        if !answered && effects.is_empty() {
            return out;
        }
    }
}

/// The calls among `effects`.
pub fn dispatched(effects: &[Effect]) -> Vec<(CallId, CallRequest)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Dispatch { call, request } => Some((*call, request.clone())),
            _ => None,
        })
        .collect()
}

/// The local replies among `effects`, by stream.
pub fn replies(effects: &[Effect]) -> Vec<(u32, Reply)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Reply { stream, reply } => Some((*stream, reply.clone())),
            _ => None,
        })
        .collect()
}

/// How much `counter` grew in `effects`.
pub fn count(effects: &[Effect], counter: Counter) -> u32 {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Count { counter: c, n } if *c == counter => Some(*n),
            _ => None,
        })
        .sum()
}
