//! One HTTP stream: reads the key and the body, asks the table, then replies itself, lets the
//! request go upstream through the router, hands it to the root (detached forwarding), or
//! waits for the first call's outcome (wait mode).

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;
use std::rc::Rc;

use super::{describe, host, judge, send_stored, Job, Outbound, Owned, Owner, Verdict, Vm, Waiter};
use crate::budget::Reservation;
use crate::config::{Forward, MissingScope, OnConflict, Policy};
use crate::entry::StoredResponse;
use crate::fingerprint::FingerprintBuilder;
use crate::key::{parse_key, StoreKey};
use crate::metrics::Counter;
use crate::problem::Problem;

pub struct Stream {
    id: u32,
    vm: Rc<Vm>,
    /// Index of the policy (base or rule) that applies to this request.
    policy: usize,
    phase: Phase,
}

enum Phase {
    /// Not ours (not covered), or nothing left to do.
    Pass,
    /// Covered: waiting for the whole body before the claim.
    ReadingBody(Box<Pending>),
    /// Router forwarding: we own the key and watch the upstream's answer.
    Owner { owner: Owner, capture: Option<Capture> },
    /// Detached forwarding: the root sends the request and answers us.
    Detached,
    /// Held by the root: until the first call's outcome is known (wait mode), or until the
    /// store answers (etcd).
    Waiting,
    /// We answered locally; our own reply passes through our response callbacks.
    Replied,
}

struct Pending {
    key: StoreKey,
    fingerprint: FingerprintBuilder,
    /// The request's headers, kept when the root may have to send it (detached forwarding).
    headers: Option<Vec<(String, Vec<u8>)>>,
}

/// The upstream's answer as it streams past, kept for the stored response. `None` once it
/// is over `max_response_bytes` or the worker's buffer budget: it passes on, unstored.
struct Capture {
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    kept: Option<(Vec<u8>, Reservation)>,
}

/// What a captured header costs in the stored form.
fn stored_header_bytes(headers: &[(String, Vec<u8>)]) -> usize {
    crate::entry::STORED_OVERHEAD + headers.iter().map(|(n, v)| 6 + n.len() + v.len()).sum::<usize>()
}

/// A scope whose every configured value is absent: no caller to scope the key by (SPEC §3.1).
fn scope_is_missing(scopes: &[Option<Vec<u8>>]) -> bool {
    !scopes.is_empty() && scopes.iter().all(Option::is_none)
}

/// How often the missing-scope warning is logged at most.
const SCOPE_LOG_MS: u64 = 60_000;

impl Stream {
    pub fn new(id: u32, vm: Rc<Vm>) -> Stream {
        Stream { id, vm, policy: 0, phase: Phase::Pass }
    }

    fn policy(&self) -> &Policy {
        self.vm.policy(self.policy)
    }

    fn reply(&mut self, problem: &Problem) -> Action {
        self.phase = Phase::Replied;
        self.vm.live.borrow_mut().remove(&self.id);
        self.vm.reply_problem(problem);
        Action::Pause
    }

    /// Request headers: is the request covered, is its key valid; remember what the claim
    /// needs. The claim itself waits for the body (it is part of the fingerprint).
    fn on_headers(&mut self, end_of_stream: bool) -> Action {
        let vm = self.vm.clone();
        // Requests we do not cover cost one header lookup (two or three with route rules):
        // the full header map is read only for covered methods.
        let method = host::request_header(":method").unwrap_or_default();
        if !vm.config.rules.is_empty() {
            let path = host::request_header(":path").unwrap_or_default();
            let route_name =
                if vm.config.rules.iter().any(|r| matches!(r.matcher, crate::config::RouteMatch::RouteName(_))) {
                    host::property(&["xds", "route_name"])
                } else {
                    None
                };
            self.policy = vm.config.policy_for(&path, &method, route_name.as_deref());
        }
        let policy = vm.policy(self.policy);
        if !policy.enabled || !policy.methods.iter().any(|m| m.as_bytes() == method.as_slice()) {
            return Action::Continue;
        }
        let headers = host::request_headers();
        let value_of = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_slice());
        let method = method.as_slice();
        let path = value_of(":path").unwrap_or_default();
        let mut keys = headers.iter().filter(|(n, _)| *n == policy.key_header);
        let raw_key = match (keys.next(), keys.next()) {
            (None, _) if policy.require_key => {
                vm.count(Counter::MissingKey);
                return self.reply(&Problem::missing_key(&policy.key_header));
            }
            (None, _) => return Action::Continue,
            (Some(_), Some(_)) => {
                vm.count(Counter::InvalidKey);
                return self.reply(&Problem::duplicate_key_header(&policy.key_header));
            }
            (Some((_, v)), None) => v,
        };
        let client_key = match parse_key(raw_key, policy.max_key_length) {
            Ok(k) => k,
            Err(e) => {
                vm.count(Counter::InvalidKey);
                return self.reply(&Problem::invalid_key(e.detail(policy.max_key_length)));
            }
        };
        let scopes = scope_values(policy, &headers);
        if scope_is_missing(&scopes) && policy.missing_scope != MissingScope::Share {
            vm.count(Counter::ScopeMissing);
            if policy.missing_scope == MissingScope::Reject {
                return self.reply(&Problem::scope_missing());
            }
            let now = vm.now_ms();
            if now >= vm.scope_logged_ms.get() {
                vm.scope_logged_ms.set(now + SCOPE_LOG_MS);
                log::warn!(
                    "a covered request carries none of its scope (scope_headers, scope_peer, scope_jwt_claim): passed on without idempotency (missing_scope: pass; logged once a minute)"
                );
            }
            return Action::Continue;
        }
        if scope_is_missing(&scopes) {
            vm.count(Counter::ScopeMissing);
        }
        let scope_refs: Vec<Option<&[u8]>> = scopes.iter().map(|s| s.as_deref()).collect();
        let key = StoreKey::derive(
            &vm.config.namespace,
            value_of(":authority").unwrap_or_default(),
            &scope_refs,
            &client_key,
        );
        let mut fingerprint = FingerprintBuilder::new(method, path);
        for name in &policy.fingerprint_headers {
            fingerprint.header(name, headers.iter().filter(|(n, _)| n == name).map(|(_, v)| v.as_slice()));
        }
        let headers = (policy.forward == Forward::Detached).then_some(headers);
        vm.live.borrow_mut().insert(self.id);
        self.phase = Phase::ReadingBody(Box::new(Pending { key, fingerprint, headers }));
        if end_of_stream {
            self.claim(Vec::new())
        } else {
            if !vm.body_seen.get() {
                vm.body_waits.borrow_mut().insert(self.id, vm.now_ms());
            }
            Action::Pause
        }
    }

    /// The whole request is here: claim the key or learn what holds it (SPEC §3.2–3.4).
    fn claim(&mut self, body: Vec<u8>) -> Action {
        let Phase::ReadingBody(pending) = std::mem::replace(&mut self.phase, Phase::Pass) else {
            return Action::Continue;
        };
        let Pending { key, mut fingerprint, headers } = *pending;
        let vm = self.vm.clone();
        let policy = vm.policy(self.policy);
        if policy.fingerprint_body {
            fingerprint.body(&body);
        }
        let fingerprint = fingerprint.finish();
        let now = vm.now_ms();
        super::root::renew(&vm, now, false);
        // Built only for requests that may go upstream: replays and 409s never need it.
        let outbound = move || outbound_request(headers, body);
        if vm.etcd.is_some() {
            // The fleet store answers asynchronously: the root resumes or answers us.
            let mut tag = [0u8; 16];
            tag.copy_from_slice(key.0.get(8..24).unwrap_or(&[0u8; 16]));
            let name = crate::store::etcd::key_name(&vm.config.namespace, &key.0);
            let req = super::etcd::ClaimReq {
                context_id: self.id,
                policy: self.policy,
                key: name,
                tag,
                fingerprint,
                outbound: outbound(),
                wait_deadline: None,
                next_poll_ms: 0,
                attempts: 0,
                takeover: None,
            };
            super::etcd::submit_claim(&vm, req);
            self.phase = Phase::Waiting;
            return Action::Pause;
        }
        let begin = vm.table.begin(&key, &fingerprint, now, policy.lease_ms);
        log::debug!("key {} -> {}", key.short(), describe(&begin));
        match judge(&vm, policy, begin) {
            Verdict::Claimed(owner) => match (outbound(), vm.queue_id.get()) {
                (Some(request), Some(queue)) => {
                    vm.outbox.borrow_mut().push_back(Job {
                        context_id: self.id,
                        policy: self.policy,
                        owner: Some(owner),
                        leased_ms: now,
                        request,
                    });
                    if !host::enqueue(queue) {
                        log::warn!("enqueue failed; the job waits for the next queue event");
                    }
                    self.phase = Phase::Detached;
                    Action::Pause
                }
                _ => {
                    vm.owners.borrow_mut().insert(self.id, Owned { policy: self.policy, owner, renewed_ms: now });
                    self.phase = Phase::Owner { owner, capture: None };
                    Action::Continue
                }
            },
            Verdict::InProgress => {
                let room = vm.waiters.borrow().len() < vm.config.max_waiters;
                let outbound = if policy.on_conflict == OnConflict::Wait && room { outbound() } else { None };
                // A held body counts against the worker's buffer budget; past it, 409 at once.
                let buffered = match &outbound {
                    Some(o) => vm.buffered.reserve(o.body.len()).map(Some),
                    None => Some(None),
                };
                if let (OnConflict::Wait, true, Some(buffered)) = (policy.on_conflict, room, buffered) {
                    vm.count(Counter::Waited);
                    let deadline_ms = now.saturating_add(policy.wait_max_ms);
                    let waiter = Waiter {
                        context_id: self.id,
                        policy: self.policy,
                        key,
                        fingerprint,
                        deadline_ms,
                        outbound,
                        _buffered: buffered,
                    };
                    vm.waiters.borrow_mut().push(waiter);
                    self.phase = Phase::Waiting;
                    return Action::Pause;
                }
                vm.count(Counter::Conflict);
                self.reply(&Problem::in_progress(policy.retry_after_s))
            }
            Verdict::Replay(response) => {
                self.phase = Phase::Replied;
                vm.live.borrow_mut().remove(&self.id);
                send_stored(&response, true);
                Action::Pause
            }
            Verdict::Problem(p) => self.reply(&p),
        }
    }

    /// Router forwarding: the upstream's answer (or Envoy's stand-in for it) arrives.
    fn on_owner_response_headers(&mut self, end_of_stream: bool) {
        if let Phase::Waiting = self.phase {
            // A waiter the root promoted to owner and resumed (router forwarding).
            let handed = self.vm.handoff.borrow_mut().remove(&self.id);
            if let Some(owner) = handed {
                self.phase = Phase::Owner { owner, capture: None };
            }
        }
        let Phase::Owner { owner, capture: None } = self.phase else { return };
        let vm = self.vm.clone();
        let headers = host::response_headers();
        let status = super::status_of(&headers);
        // Only an answer the upstream really gave completes the key; Envoy's own (connect
        // failure, reset, route timeout) says the work may not have happened (SPEC §4).
        let via_upstream = host::property(&["response", "code_details"]).as_deref() == Some(b"via_upstream");
        if !via_upstream || self.policy().release_statuses.contains(status) {
            if !via_upstream {
                vm.count(Counter::UpstreamFailed);
            }
            vm.owners.borrow_mut().remove(&self.id);
            vm.release(&owner);
            self.phase = Phase::Pass;
            return;
        }
        let headers: Vec<(String, Vec<u8>)> = headers.into_iter().filter(|(n, _)| !super::is_hop_by_hop(n)).collect();
        let head = stored_header_bytes(&headers);
        let kept = (head <= self.policy().max_response_bytes)
            .then(|| vm.buffered.reserve(head))
            .flatten()
            .map(|reservation| (Vec::new(), reservation));
        self.phase = Phase::Owner { owner, capture: Some(Capture { status, headers, kept }) };
        if end_of_stream {
            self.finish_capture();
        }
    }

    fn on_owner_response_body(&mut self, size: usize, end_of_stream: bool) {
        let max = self.policy().max_response_bytes;
        let Phase::Owner { capture: Some(c), .. } = &mut self.phase else { return };
        if let Some((body, reservation)) = &mut c.kept {
            // With Action::Continue each callback sees the current chunk: copy it as it
            // passes, so storing never delays or buffers the response. Past the response
            // limit or the worker's budget, stop copying: the answer passes on, unstored.
            let fits = reservation.bytes() + size <= max && reservation.grow(size);
            if fits {
                body.extend_from_slice(&host::response_body_chunk(size));
            } else {
                c.kept = None;
            }
        }
        if end_of_stream {
            self.finish_capture();
        }
    }

    fn finish_capture(&mut self) {
        let Phase::Owner { owner, capture: Some(c) } = std::mem::replace(&mut self.phase, Phase::Pass) else { return };
        self.vm.owners.borrow_mut().remove(&self.id);
        let response = c.kept.map(|(body, _reservation)| {
            StoredResponse::new(c.status, c.headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())), body)
        });
        self.vm.complete(self.policy, &owner, response);
    }
}

/// The values that scope the key to a caller: configured headers (all their values), the
/// mTLS peer, a verified JWT claim. An absent value is the anonymous scope.
fn scope_values(policy: &Policy, headers: &[(String, Vec<u8>)]) -> Vec<Option<Vec<u8>>> {
    let mut scopes: Vec<Option<Vec<u8>>> = policy
        .scope_headers
        .iter()
        .map(|name| {
            let values: Vec<&[u8]> = headers.iter().filter(|(n, _)| n == name).map(|(_, v)| v.as_slice()).collect();
            (!values.is_empty()).then(|| values.join(&0u8))
        })
        .collect();
    if policy.scope_peer {
        let peer = host::property(&["connection", "uri_san_peer_certificate"])
            .filter(|v| !v.is_empty())
            .or_else(|| host::property(&["source", "principal"]).filter(|v| !v.is_empty()));
        scopes.push(peer);
    }
    if let Some(jwt) = &policy.scope_jwt_claim {
        let path =
            ["metadata", "filter_metadata", "envoy.filters.http.jwt_authn", jwt.payload.as_str(), jwt.claim.as_str()];
        scopes.push(host::property(&path).filter(|v| !v.is_empty()));
    }
    scopes
}

/// The request as the root would send it, if it can: detached forwarding applies (`headers`
/// kept), the route names a cluster and every header value is UTF-8 (`dispatch_http_call`
/// takes `&str`). Otherwise the router sends it, so nothing is altered.
fn outbound_request(headers: Option<Vec<(String, Vec<u8>)>>, body: Vec<u8>) -> Option<Outbound> {
    let headers = headers?;
    let cluster = String::from_utf8(host::property(&["xds", "cluster_name"])?).ok()?;
    if cluster.is_empty() {
        return None;
    }
    let headers =
        headers.into_iter().map(|(n, v)| Some((n, String::from_utf8(v).ok()?))).collect::<Option<Vec<_>>>()?;
    Some(Outbound { cluster, headers, body })
}

impl Context for Stream {
    fn on_done(&mut self) -> bool {
        // A router owner whose client left before the answer: the outcome is unknown, so its
        // mark is no longer renewed and expires (SPEC §3.5). A detached call goes on.
        self.vm.live.borrow_mut().remove(&self.id);
        self.vm.owners.borrow_mut().remove(&self.id);
        self.vm.handoff.borrow_mut().remove(&self.id);
        self.vm.body_waits.borrow_mut().remove(&self.id);
        if let Phase::Waiting = self.phase {
            self.vm.waiters.borrow_mut().retain(|w| w.context_id != self.id);
        }
        true
    }
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.on_headers(end_of_stream)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !matches!(self.phase, Phase::ReadingBody(_)) {
            return Action::Continue;
        }
        if !self.vm.body_seen.replace(true) {
            self.vm.body_waits.borrow_mut().clear();
        }
        let max = self.policy().max_request_body_bytes;
        if body_size > max {
            self.vm.count(Counter::TooLarge);
            return self.reply(&Problem::body_too_large(max));
        }
        if !end_of_stream {
            return Action::Pause; // Envoy buffers the body until the end
        }
        self.claim(host::request_body(body_size))
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if !matches!(self.phase, Phase::ReadingBody(_)) {
            return Action::Continue;
        }
        self.claim(host::request_body(self.policy().max_request_body_bytes))
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.on_owner_response_headers(end_of_stream);
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.on_owner_response_body(body_size, end_of_stream);
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        self.finish_capture();
        Action::Continue
    }
}
