//! The upstream's answer, in both forward modes (docs/behaviour.md §3.4): a release status or no answer at
//! all releases the key; any other status completes it, with the response when it fits.

use std::rc::Rc;

use super::budget::Reservation;
use super::grpc_reply;
use super::problem::Problem;
use super::work::{HeldEnd, Work, WorkId};
use super::{CallId, Effect, Lifecycle, Phase, Reply};
use crate::defects::{planted, Defect};
use crate::encoding::{StoredResponse, STORED_OVERHEAD};
use crate::header_map::is_hop_by_hop;
use crate::host::{Flow, Headers, Host};
use crate::metrics::Counter;
use crate::store::{Answer, CallAnswer, CallKind, CallRequest, Owner, Store};

/// A router-mode answer as it streams past, kept for the stored response. `kept` is `None`
/// once it is over `max_response_bytes` or the worker's buffer budget: it passes on, unstored.
pub(super) struct Capture {
    status: u16,
    headers: Headers,
    kept: Option<(Vec<u8>, Reservation)>,
    /// The stored head's bytes, so a buffered body's size is the reservation's rest.
    head: usize,
    /// A store that answers later has Envoy buffer the body: its size so far, read at the
    /// answer's end (the body's last callback, or the trailers).
    buffered: usize,
    /// A gRPC answer's status was in its headers (trailers-only).
    grpc_status: bool,
}

/// How a detached call ended. Envoy's own answers carry no `x-envoy-upstream-service-time`
/// and a telltale body (docs/behaviour.md §4).
enum Outcome {
    Answer(StoredResponse),
    NoAnswer { status: u16, reason: &'static str },
}

/// The `:status` of a header map, 0 when absent or not a number.
pub fn status_of(headers: &[(String, Vec<u8>)]) -> u16 {
    headers
        .iter()
        .find(|(n, _)| n == ":status")
        .and_then(|(_, v)| std::str::from_utf8(v).ok()?.parse::<u16>().ok())
        .unwrap_or(0)
}

fn classify(answer: CallAnswer) -> Outcome {
    let CallAnswer { status, headers, body } = answer;
    if status == 0 {
        return Outcome::NoAnswer { status: 502, reason: "The upstream connection broke before a complete answer" };
    }
    let from_upstream = headers.iter().any(|(n, _)| n == "x-envoy-upstream-service-time");
    if !from_upstream {
        if status == 503 && body.starts_with(b"upstream connect error or disconnect/reset before headers") {
            let says = |word: &[u8]| body.windows(word.len()).any(|w| w == word);
            // A connect failure, or Envoy's circuit breaker (overflow): nothing was sent.
            let connect = says(b"connection failure")
                || says(b"overflow")
                || headers.iter().any(|(n, _)| n == "x-envoy-overloaded");
            return if connect {
                Outcome::NoAnswer { status: 503, reason: "The upstream could not be reached" }
            } else {
                Outcome::NoAnswer { status: 502, reason: "The upstream reset the connection before answering" }
            };
        }
        if status == 504 && body == b"upstream request timeout" {
            return Outcome::NoAnswer { status: 504, reason: "The upstream did not answer within upstream_timeout_ms" };
        }
    }
    // The body becomes the stored form in place: the VM holds one copy of the answer.
    // A gRPC call's trailers are kept under their prefix (they are not pseudo-headers).
    let kept = headers.iter().filter(|(n, _)| !is_hop_by_hop(n) || n.starts_with(super::grpc_reply::TRAILER));
    let kept = kept.map(|(n, v)| (n.as_str(), v.as_slice()));
    Outcome::Answer(StoredResponse::new(status, kept, body))
}

impl<S: Store> Lifecycle<S> {
    /// Sends a queued detached call (in the root's event). A job that waited long (a busy
    /// event loop, etcd's round trip) renews its mark first, so that the lease counts from
    /// the moment the call leaves; a fresh one is left to the periodic renewal.
    pub(super) fn dispatch_upstream(&mut self, id: WorkId, now: u64) {
        let Some(work) = self.work.get_mut(&id) else { return };
        let Some(request) = work.call.as_mut().and_then(|c| c.outgoing.take()) else { return };
        let (stream, owner, leased_ms) = (work.stream, work.owner, work.renewed_ms);
        let p = self.config.clone();
        let p = p.policy(work.policy);
        if let Some(owner) = owner {
            if now.saturating_sub(leased_ms.unwrap_or(0)) >= p.lease_ms / 4 {
                let answer = self.store.renew(owner, p.lease_ms, now);
                let lost = matches!(answer, Some(Answer::Renewed(false)));
                if let Some(answer) = answer {
                    self.on_owner_answer(owner, answer);
                }
                if lost && !planted(Defect::SentAfterMarkLost) {
                    // The mark expired before the call left (the worker was paused or
                    // stalled past the lease): another request may hold the key now, and
                    // sending would run the work twice. Nothing was sent: safe to retry.
                    self.count(Counter::OwnerLost);
                    self.work.remove(&id);
                    let reason = "The claim expired before the request could be sent";
                    return self.problem(stream, Problem::upstream_failed(503, reason, p.retry_after_s));
                }
                if let Some(w) = self.work.get_mut(&id).filter(|w| w.renewed_ms.is_some()) {
                    w.renewed_ms = Some(now);
                }
            }
        }
        let request = CallRequest {
            cluster: request.cluster,
            kind: CallKind::Http { headers: request.headers },
            body: request.body,
            timeout_ms: p.upstream_timeout_ms,
        };
        self.effects.push(Effect::Dispatch { call: CallId::Upstream(id), request });
    }

    /// A detached call's answer too large for its caller's share of the worker's buffer
    /// (`max_buffered_bytes`, at most half per caller): the VM does not copy it. Its status
    /// decides as for any answer (the work ran, or the key is released); the client learns
    /// that the answer could not be relayed (docs/limits.md).
    pub(super) fn upstream_too_large(&mut self, id: WorkId, status: u16, now: u64) {
        let Some(call) = self.take_answered(id) else { return };
        let p = self.config.clone();
        let p = p.policy(call.policy);
        log::warn!("a detached call's answer is larger than its caller's share of max_buffered_bytes: not relayed");
        self.count(Counter::UpstreamFailed);
        let released = p.release_statuses.contains(status) || call.call.as_ref().is_some_and(|c| c.grpc);
        match call.owner {
            Some(owner) if released => self.release(owner, now),
            Some(owner) => {
                self.complete(owner, None, p.retention_s * 1000, now);
            }
            None => {}
        }
        let problem = Problem::answer_too_large(released.then_some(p.retry_after_s));
        self.problem(call.stream, problem);
    }

    /// No healthy host, unknown cluster: the call was not sent.
    pub(super) fn upstream_not_sent(&mut self, id: WorkId, now: u64) {
        let Some(call) = self.take_answered(id) else { return };
        log::warn!("a detached call could not be sent");
        self.no_answer(call, 503, "No upstream host could take the request", now);
    }

    fn no_answer(&mut self, call: Work, status: u16, reason: &str, now: u64) {
        if let Some(owner) = call.owner {
            self.release(owner, now);
        }
        self.count(Counter::UpstreamFailed);
        let retry_after_s = self.policy(call.policy).retry_after_s;
        self.problem(call.stream, Problem::upstream_failed(status, reason, retry_after_s));
    }

    /// A detached call's answer (in the root's event): store it, then answer the client if it
    /// is still there.
    pub(super) fn on_upstream_answer(&mut self, id: WorkId, answer: CallAnswer, held: Option<Reservation>, now: u64) {
        let Some(call) = self.take_answered(id) else { return };
        let response = match classify(answer) {
            Outcome::NoAnswer { status, reason } => {
                log::debug!("detached call got no answer ({status}): released");
                return self.no_answer(call, status, reason, now);
            }
            Outcome::Answer(response) => response,
        };
        let p = self.config.clone();
        let p = p.policy(call.policy);
        let response = Rc::new(response);
        // A gRPC call's status is in its trailers (or headers, trailers-only); none at all
        // is a broken answer.
        let grpc_failed = call.call.as_ref().is_some_and(|c| c.grpc)
            && grpc_reply::status_of(grpc_reply::trailers_and_headers(&response))
                .is_none_or(|code| p.releases_grpc(code));
        let looped = in_progress_of_an_idempotency_filter(&response);
        if looped {
            log::warn!(
                "a detached call was answered 409 in-progress by an idempotency filter (is the plugin on the listener detached_via reaches?): the key is released, not completed with it"
            );
        }
        let response = match call.owner {
            Some(owner) if grpc_failed || looped || p.release_statuses.contains(response.status()) => {
                self.release(owner, now);
                if let Some(note) = self.note_mut(call.stream) {
                    note.outcome = Some("released");
                }
                Some(response)
            }
            Some(owner) if response.stored_len() <= p.max_response_bytes => {
                self.complete_then_answer(owner, &call, response, p.retention_s * 1000, held, now);
                None
            }
            Some(owner) => {
                self.complete(owner, None, p.retention_s * 1000, now);
                if let Some(note) = self.note_mut(call.stream) {
                    note.outcome = Some("completed-not-stored");
                }
                Some(response)
            }
            None => Some(response),
        };
        if let Some(response) = response {
            self.reply(call.stream, Reply::Stored { response, replayed: false });
        }
    }

    /// Completes with the answer, then sends it (read your writes, docs/behaviour.md §3.4), from the same
    /// bytes (the VM holds one copy). A store that answers later (etcd) has it held until it
    /// acknowledged the completion, or for `write_wait_ms` at most.
    fn complete_then_answer(
        &mut self,
        owner: Owner,
        call: &Work,
        response: Rc<StoredResponse>,
        retention_ms: u64,
        held: Option<Reservation>,
        now: u64,
    ) {
        if !self.store.answers_at_once() {
            let end = HeldEnd { since_ms: now, reply: Some(response.clone()), paused: false, _buffered: held };
            self.hold_end(owner, call.stream, call.policy, end);
            self.complete(owner, Some(response), retention_ms, now);
            return;
        }
        if let Some(response) = self.complete(owner, Some(response), retention_ms, now) {
            self.reply(call.stream, Reply::Stored { response, replayed: false });
        }
    }

    /// The store acknowledged an owner's completion, or could not for now: the answer's end
    /// goes on.
    pub(super) fn release_end(&mut self, owner: Owner, acknowledged: bool) {
        self.end_answer(WorkId::Owner(owner.id), acknowledged);
    }

    /// A held answer's end goes on (`acknowledged`: its completion was), and its record
    /// settles.
    fn end_answer(&mut self, id: WorkId, acknowledged: bool) {
        let Some(work) = self.work.get_mut(&id) else { return };
        let (stream, end) = (work.stream, work.end.take());
        self.settle(id);
        if let Some(end) = end {
            if !acknowledged {
                self.count(Counter::CompletionUnacknowledged);
            }
            self.send_end(stream, end);
        }
    }

    /// An answer's end waits for the owner's completion to be acknowledged.
    fn hold_end(&mut self, owner: Owner, stream: u32, policy: usize, end: HeldEnd) {
        let work = self.work.entry(WorkId::Owner(owner.id)).or_insert(Work {
            stream,
            policy,
            owner: Some(owner),
            renewed_ms: None,
            call: None,
            end: None,
        });
        work.end = Some(end);
    }

    /// A detached call's record, answered (or never sent): out of the map, with its call.
    fn take_answered(&mut self, id: WorkId) -> Option<Work> {
        self.work.remove(&id).filter(|w| w.call.is_some())
    }

    fn send_end(&mut self, stream: u32, end: HeldEnd) {
        match end.reply {
            Some(response) => self.reply(stream, Reply::Stored { response, replayed: false }),
            // A stream Envoy has ended must not be resumed: its callbacks would reach a
            // context the SDK has dropped (docs/behaviour.md §4).
            None if end.paused && self.streams.contains_key(&stream) => {
                self.effects.push(Effect::ResumeResponse { stream })
            }
            None => {}
        }
    }

    /// From the timer: answers whose completion the store did not acknowledge in time go on
    /// (the completion is still retried).
    pub(super) fn expire_ends(&mut self, now: u64) {
        let wait = self.store.write_wait_ms();
        let late: Vec<WorkId> = self
            .work
            .iter()
            .filter(|(_, w)| w.end.as_ref().is_some_and(|e| now >= e.since_ms + wait))
            .map(|(id, _)| *id)
            .collect();
        for id in late {
            self.end_answer(id, false);
        }
    }

    pub(super) fn release(&mut self, owner: Owner, now: u64) {
        self.stop_renewing(owner);
        if planted(Defect::NoRelease) {
            return self.store.forget(owner);
        }
        if let Some(answer) = self.store.release(owner, now) {
            self.on_owner_answer(owner, answer);
        }
    }

    /// Completes; the response is handed back when the store is done with it.
    pub(super) fn complete(
        &mut self,
        owner: Owner,
        response: Option<Rc<StoredResponse>>,
        retention_ms: u64,
        now: u64,
    ) -> Option<Rc<StoredResponse>> {
        self.stop_renewing(owner);
        if let Some(r) = response.as_ref().filter(|_| planted(Defect::StoredAnswerDiffers)) {
            let altered = StoredResponse::new(r.status() + 1, r.headers(), r.body().to_vec());
            let kept = response.clone();
            let answer = self.store.complete(owner, Some(Rc::new(altered)), retention_ms, now)?;
            return self.on_owner_answer(owner, answer).and(kept);
        }
        let answer = self.store.complete(owner, response, retention_ms, now)?;
        self.on_owner_answer(owner, answer)
    }

    /// Router forwarding: the upstream's answer (or Envoy's stand-in for it) arrives. Its end
    /// is held (`Flow::Pause`) until the store acknowledged the completion.
    pub fn on_response_headers(&mut self, host: &dyn Host, id: u32, end_of_stream: bool) -> Flow {
        if let Some(Phase::GrpcReplay { response, replayed }) = self.streams.get(&id).map(|s| &s.phase) {
            let (headers, _) = grpc_reply::replay_parts(response, *replayed);
            self.effects.push(Effect::SetResponseHeaders { stream: id, headers });
            if end_of_stream {
                log::warn!("the gRPC replay loopback answered without a body: is its route missing?");
            }
            return Flow::Continue;
        }
        let flow = self.response_headers(host, id, end_of_stream);
        self.after_stream_event();
        flow
    }

    pub fn on_response_body(&mut self, host: &dyn Host, id: u32, size: usize, end_of_stream: bool) -> Flow {
        if let Some(Phase::GrpcReplay { response, .. }) = self.streams.get(&id).map(|s| &s.phase) {
            if !end_of_stream {
                return Flow::Pause; // the loopback's body is replaced at its end
            }
            let (_, trailers) = grpc_reply::replay_parts(response, false);
            let body = response.body().to_vec();
            self.effects.push(Effect::ReplaceResponseBody { stream: id, size, body, trailers });
            self.set_phase(id, Phase::Pass);
            return Flow::Continue;
        }
        let flow = self.response_body(host, id, size, end_of_stream);
        self.after_stream_event();
        flow
    }

    pub fn on_response_trailers(&mut self, host: &dyn Host, id: u32) -> Flow {
        self.take_buffered(host, id);
        let flow = match self.streams.get(&id) {
            Some(s) if s.grpc => self.grpc_trailers(host, id),
            Some(_) => self.finish_capture(id, host.now_ms()),
            None => Flow::Continue,
        };
        self.after_stream_event();
        flow
    }

    /// A gRPC call's end: its status is in the trailers (docs/behaviour.md §3.10). A server-side failure
    /// releases the key; a failure the client caused is stored with its trailers, to replay
    /// as the same status; a result with messages completes the key without its response,
    /// which a local reply could not replay.
    fn grpc_trailers(&mut self, host: &dyn Host, id: u32) -> Flow {
        let now = host.now_ms();
        let Some(stream) = self.streams.get_mut(&id) else { return Flow::Continue };
        let config = self.config.clone();
        let p = config.policy(stream.policy);
        let Phase::Owner { owner: Some(owner), capture: Some(c) } = &mut stream.phase else { return Flow::Continue };
        let owner = *owner;
        let trailers = host.response_trailers();
        let code = grpc_reply::status_of(trailers.iter().map(|(n, v)| (n.as_str(), v.as_slice()))).unwrap_or(2);
        if p.releases_grpc(code) {
            self.set_phase(id, Phase::Pass);
            self.release(owner, now);
            return Flow::Continue;
        }
        let loopback = self.config.grpc_replay_loopback;
        match &mut c.kept {
            Some((body, reservation)) if loopback || (code != grpc_reply::OK && body.is_empty()) => {
                let more: usize = trailers.iter().map(|(n, v)| 6 + grpc_reply::TRAILER.len() + n.len() + v.len()).sum();
                if reservation.grow(more) {
                    let kept = trailers.into_iter().filter(|(n, _)| !is_hop_by_hop(n));
                    c.headers.extend(kept.map(|(n, v)| (format!("{}{n}", grpc_reply::TRAILER), v)));
                } else {
                    c.kept = None;
                }
            }
            _ => c.kept = None,
        }
        self.finish_capture(id, now)
    }

    fn response_headers(&mut self, host: &dyn Host, id: u32, end_of_stream: bool) -> Flow {
        let Some(stream) = self.streams.get_mut(&id) else { return Flow::Continue };
        let Phase::Owner { owner, capture: None } = stream.phase else { return Flow::Continue };
        let (policy, grpc_call) = (stream.policy, stream.grpc);
        let Some(owner) = owner else {
            stream.phase = Phase::Pass; // forwarded without a claim
            return Flow::Continue;
        };
        let headers = host.response_headers();
        let status = status_of(&headers);
        // Only an answer the upstream really gave completes the key; Envoy's own (connect
        // failure, reset, route timeout) says the work may not have happened (docs/behaviour.md §4). Not
        // told by `x-envoy-upstream-service-time`: a filter's own reply may relay it from a
        // side call (ext_authz's denial copies its server's headers).
        let via_upstream = host.property(&["response", "code_details"]).as_deref() == Some(b"via_upstream");
        let p = self.config.clone();
        let p = p.policy(policy);
        // A gRPC answer without messages (trailers-only) has its status in the headers; one
        // that ends without any status is broken, as the detached path also judges it.
        let grpc_status = grpc_reply::status_of(headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())));
        let grpc_failed = grpc_call && end_of_stream && grpc_status.is_none_or(|code| p.releases_grpc(code));
        if !via_upstream || p.release_statuses.contains(status) || grpc_failed {
            if !via_upstream {
                self.count(Counter::UpstreamFailed);
            }
            self.record(id, "released");
            self.set_phase(id, Phase::Pass);
            self.release(owner, host.now_ms());
            return Flow::Continue;
        }
        let headers: Headers = headers.into_iter().filter(|(n, _)| !is_hop_by_hop(n)).collect();
        let head = STORED_OVERHEAD + headers.iter().map(|(n, v)| 6 + n.len() + v.len()).sum::<usize>();
        let group = self.streams.get(&id).map_or(super::budget::Group::UNKNOWN, |s| self.known.group(s.caller));
        let kept = (head <= p.max_response_bytes)
            .then(|| self.buffered.reserve(group, head))
            .flatten()
            .map(|r| (Vec::new(), r));
        let capture = Capture { status, headers, kept, head, buffered: 0, grpc_status: grpc_status.is_some() };
        // Recorded now, while the record can still reach the access log: whether its answer
        // is stored (`completed`) is known only at its end.
        self.record(id, "claimed");
        self.set_phase(id, Phase::Owner { owner: Some(owner), capture: Some(capture) });
        if end_of_stream {
            return self.finish_capture(id, host.now_ms());
        }
        Flow::Continue
    }

    fn response_body(&mut self, host: &dyn Host, id: u32, size: usize, end_of_stream: bool) -> Flow {
        let max = match self.streams.get(&id) {
            Some(s) => self.config.policy(s.policy).max_response_bytes,
            None => return Flow::Continue,
        };
        let buffered = !self.store.answers_at_once();
        let Some(stream) = self.streams.get_mut(&id) else { return Flow::Continue };
        let grpc = stream.grpc && !self.config.grpc_replay_loopback;
        let Phase::Owner { capture: Some(c), .. } = &mut stream.phase else { return Flow::Continue };
        if grpc && size > 0 {
            c.kept = None; // without the loopback a result with messages cannot be replayed
        }
        let mut flow = Flow::Continue;
        if let Some((body, reservation)) = &mut c.kept {
            // Past the response limit or the worker's budget, stop keeping: the answer passes
            // on, unstored (and whatever Envoy buffered goes with it).
            if buffered {
                // Read-your-writes holds every byte until the store acknowledged the
                // completion: a client that counts Content-Length must not have the answer
                // before its end (docs/behaviour.md §3.4). Envoy buffers it; `size` is all so far.
                let more = size.saturating_sub(reservation.bytes().saturating_sub(c.head));
                if c.head + size <= max && reservation.grow(more) {
                    flow = Flow::Pause;
                    c.buffered = size;
                    if end_of_stream {
                        body.extend_from_slice(&host.response_body(size));
                        c.buffered = 0;
                    }
                } else {
                    c.kept = None;
                }
            } else if reservation.bytes() + size <= max && reservation.grow(size) {
                // Each callback sees the current chunk: copy it as it passes, so storing
                // never delays or buffers the response.
                body.extend_from_slice(&host.response_body(size));
            } else {
                c.kept = None;
            }
        }
        if end_of_stream {
            // A gRPC answer that ends without trailers has no status: broken, released.
            let broken = stream.grpc && !c.grpc_status;
            if broken {
                return self.release_broken(id, host.now_ms());
            }
            return self.finish_capture(id, host.now_ms());
        }
        flow
    }

    /// A router owner's answer ended without what says how the call went: released.
    fn release_broken(&mut self, id: u32, now: u64) -> Flow {
        let Some(stream) = self.streams.get_mut(&id) else { return Flow::Continue };
        let Phase::Owner { owner: Some(owner), .. } = std::mem::replace(&mut stream.phase, Phase::Pass) else {
            return Flow::Continue;
        };
        log::debug!("a gRPC answer ended without its status: released");
        self.count(Counter::UpstreamFailed);
        self.release(owner, now);
        Flow::Continue
    }

    /// The trailers end the answer: a body Envoy buffered for us is read now, whole.
    fn take_buffered(&mut self, host: &dyn Host, id: u32) {
        let Some(stream) = self.streams.get_mut(&id) else { return };
        let Phase::Owner { capture: Some(c), .. } = &mut stream.phase else { return };
        if let (Some((body, _)), true) = (&mut c.kept, c.buffered > 0) {
            *body = host.response_body(c.buffered);
            c.buffered = 0;
        }
    }

    /// The answer is all there: complete the key; with a store that answers later, hold the
    /// end until it did.
    fn finish_capture(&mut self, id: u32, now: u64) -> Flow {
        let Some(stream) = self.streams.get_mut(&id) else { return Flow::Continue };
        if !matches!(stream.phase, Phase::Owner { owner: Some(_), capture: Some(_) }) {
            return Flow::Continue;
        }
        let Phase::Owner { owner: Some(owner), capture: Some(c) } = std::mem::replace(&mut stream.phase, Phase::Pass)
        else {
            return Flow::Continue;
        };
        let policy = stream.policy;
        let retention_ms = self.config.policy(policy).retention_s * 1000;
        let response = c.kept.map(|(body, _reservation)| {
            Rc::new(StoredResponse::new(c.status, c.headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())), body))
        });
        if self.store.answers_at_once() {
            self.complete(owner, response, retention_ms, now);
            return Flow::Continue;
        }
        let end = HeldEnd { since_ms: now, reply: None, paused: false, _buffered: None };
        self.hold_end(owner, id, policy, end);
        self.complete(owner, response, retention_ms, now);
        match self.work.get_mut(&WorkId::Owner(owner.id)).and_then(|w| w.end.as_mut()) {
            Some(end) => {
                end.paused = true;
                Flow::Pause
            }
            // Answered at once after all (the owner was gone): nothing to wait for.
            None => Flow::Continue,
        }
    }
}

/// A 409 "in progress" of this plugin's own kind: the call met a claim, its own (the filter
/// also on the internal listener `detached_via` reaches) or another gateway's, and did no
/// work. Stored, it would replay a transient refusal for `retention_s`; released, the retry
/// runs (docs/deployment.md).
fn in_progress_of_an_idempotency_filter(response: &StoredResponse) -> bool {
    const TYPE: &[u8] = b"urn:idempotency-filter:problem:in-progress";
    response.status() == 409 && response.body().windows(TYPE.len()).any(|w| w == TYPE)
}
