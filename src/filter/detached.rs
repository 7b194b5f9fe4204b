//! Detached forwarding (SPEC §3.2, §4): the root sends covered requests upstream itself with
//! `dispatch_http_call`, so the SDK files the answer under the root, which outlives the
//! client's stream; the answer is stored, then sent to the client if it is still there.

use std::time::Duration;

use super::{answer_client, etcd, host, send_stored, status_of, Call, Job, Owned, Owner, Vm};
use crate::entry::StoredResponse;
use crate::metrics::Counter;
use crate::problem::Problem;

/// Sends the queued detached calls. Runs in the root's callback, so the SDK files the answer
/// under the root, which outlives the client's stream (SPEC §4).
pub(super) fn dispatch_outbox(vm: &Vm) {
    loop {
        let Some(job) = vm.outbox.borrow_mut().pop_front() else { return };
        let request = &job.request;
        let headers: Vec<(&str, &str)> = request.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        let policy = vm.policy(job.policy);
        let timeout = Duration::from_millis(policy.upstream_timeout_ms);
        // The job may have waited (a busy worker's event loop, etcd's round trip): if the lease
        // is no longer fresh, renew the mark now, so that it counts from the moment the call
        // leaves. A fresh one (the usual case) is left to the periodic renewal, due after the
        // same lease_ms / 4: one store write fewer per call (with etcd, one round trip).
        let now = vm.now_ms();
        let mut renewed_ms = job.leased_ms;
        if now.saturating_sub(job.leased_ms) >= policy.lease_ms / 4 {
            renewed_ms = now;
            match job.owner {
                Some(Owner::Table(ticket)) => {
                    if let Err(e) = vm.table.renew(&ticket, now, policy.lease_ms) {
                        log::warn!("renewal before dispatch failed: {e:?}");
                    }
                }
                Some(Owner::Etcd(id)) => etcd::renew(vm, id, now, policy.lease_ms),
                None => {}
            }
        }
        match host::dispatch(&request.cluster, headers, &request.body, timeout) {
            Ok(token) => {
                let call = Call { context_id: job.context_id, policy: job.policy, owner: job.owner, renewed_ms };
                vm.calls.borrow_mut().insert(token, call);
            }
            Err(status) => {
                // No healthy host, unknown cluster: nothing was sent.
                log::warn!("dispatch to cluster {:?} failed: {status:?}", request.cluster);
                if let Some(owner) = &job.owner {
                    vm.release(owner);
                }
                vm.count(Counter::UpstreamFailed);
                let p = Problem::upstream_failed(503, "No upstream host could take the request", policy.retry_after_s);
                answer_client(vm, job.context_id, |vm| vm.reply_problem(&p));
            }
        }
    }
}

/// How a detached call ended. Envoy's own answers carry no `x-envoy-upstream-service-time`
/// and a telltale body (SPEC §4).
enum Answer {
    Upstream(StoredResponse),
    NoAnswer { status: u16, reason: &'static str },
}

fn classify(headers: Vec<(String, Vec<u8>)>, body: Vec<u8>) -> Answer {
    let status = Some(status_of(&headers)).filter(|s| *s != 0);
    let Some(status) = status else {
        return Answer::NoAnswer { status: 502, reason: "The upstream connection broke before a complete answer" };
    };
    let from_upstream = headers.iter().any(|(n, _)| n == "x-envoy-upstream-service-time");
    if !from_upstream {
        if status == 503 && body.starts_with(b"upstream connect error or disconnect/reset before headers") {
            let says = |word: &[u8]| body.windows(word.len()).any(|w| w == word);
            // A connect failure, or Envoy's circuit breaker (overflow): nothing was sent.
            let connect = says(b"connection failure")
                || says(b"overflow")
                || headers.iter().any(|(n, _)| n == "x-envoy-overloaded");
            return if connect {
                Answer::NoAnswer { status: 503, reason: "The upstream could not be reached" }
            } else {
                Answer::NoAnswer { status: 502, reason: "The upstream reset the connection before answering" }
            };
        }
        if status == 504 && body == b"upstream request timeout" {
            return Answer::NoAnswer { status: 504, reason: "The upstream did not answer within upstream_timeout_ms" };
        }
    }
    // The body becomes the stored form in place: the VM holds one copy of the answer.
    let kept = headers.iter().filter(|(n, _)| !super::is_hop_by_hop(n)).map(|(n, v)| (n.as_str(), v.as_slice()));
    Answer::Upstream(StoredResponse::new(status, kept, body))
}

pub(super) fn on_call_answer(vm: &Vm, token: u32, num_headers: usize, body_size: usize) {
    let headers = if num_headers == 0 { Vec::new() } else { host::call_response_headers() };
    let body = host::call_response_body(body_size);
    if vm.etcd.is_some() {
        let status = status_of(&headers);
        if etcd::on_answer(vm, token, status, &body, vm.now_ms()) {
            return;
        }
    }
    let Some(call) = vm.calls.borrow_mut().remove(&token) else { return };
    let policy = vm.policy(call.policy);
    match classify(headers, body) {
        Answer::NoAnswer { status, reason } => {
            log::debug!("detached call got no answer ({status}): released");
            if let Some(owner) = &call.owner {
                vm.release(owner);
            }
            vm.count(Counter::UpstreamFailed);
            let p = Problem::upstream_failed(status, reason, policy.retry_after_s);
            answer_client(vm, call.context_id, |vm| vm.reply_problem(&p));
        }
        Answer::Upstream(response) => match &call.owner {
            Some(owner) if !policy.release_statuses.contains(response.status()) => {
                if response.stored_len() <= policy.max_response_bytes {
                    vm.complete_then_answer(call.policy, owner, response, call.context_id);
                    return;
                }
                vm.complete(call.policy, owner, None);
                answer_client(vm, call.context_id, |_| send_stored(&response, false));
            }
            Some(owner) => {
                vm.release(owner);
                answer_client(vm, call.context_id, |_| send_stored(&response, false));
            }
            None => answer_client(vm, call.context_id, |_| send_stored(&response, false)),
        },
    }
}

/// A held request becomes the first call: the root sends it (detached) or resumes it into the
/// router, handing it the ownership through the VM's handoff map. `leased_ms`: when the
/// owner's lease was set.
pub(super) fn promote(
    vm: &Vm,
    context_id: u32,
    policy: usize,
    outbound: Option<super::Outbound>,
    owner: Owner,
    leased_ms: u64,
) {
    match outbound {
        Some(request) => {
            vm.outbox.borrow_mut().push_back(Job { context_id, policy, owner: Some(owner), leased_ms, request });
            dispatch_outbox(vm);
        }
        None => {
            vm.owners.borrow_mut().insert(context_id, Owned { policy, owner, renewed_ms: leased_ms });
            vm.handoff.borrow_mut().insert(context_id, owner);
            if !(vm.live.borrow().contains(&context_id)
                && host::set_effective_context(context_id)
                && host::resume_request())
            {
                vm.owners.borrow_mut().remove(&context_id);
                vm.handoff.borrow_mut().remove(&context_id);
                vm.release(&owner);
            }
        }
    }
}

/// Lets a held request go upstream without a claim (`on_unavailable: "pass"`).
pub(super) fn pass_through(vm: &Vm, context_id: u32, policy: usize, outbound: Option<super::Outbound>) {
    if !vm.live.borrow().contains(&context_id) {
        return;
    }
    match outbound {
        Some(request) => {
            vm.outbox.borrow_mut().push_back(Job { context_id, policy, owner: None, leased_ms: 0, request });
            dispatch_outbox(vm);
        }
        None => {
            if host::set_effective_context(context_id) {
                host::resume_request();
            }
        }
    }
}
