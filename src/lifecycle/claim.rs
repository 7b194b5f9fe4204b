//! The claim and what follows from the store's answer (docs/behaviour.md §3.2–3.4): go upstream (router
//! or detached), wait, or answer 409, the replay, or a problem.

use std::rc::Rc;

use super::budget::Group;
use super::problem::Problem;
use super::request::{self, Outbound, Pending};
use super::work::{DetachedCall, Work, WorkId};
use super::{Held, Lifecycle, Phase, Reply};
use crate::config::{OnConflict, OnUnavailable, StoreConfig};
use crate::defects::{planted, Defect};
use crate::encoding::StoredResponse;
use crate::host::{Flow, HeaderMap, Host};
use crate::metrics::Counter;
use crate::store::{Answer, Began, Claim, Completed, For, Owner, Store};

/// What the request does after its claim's answer.
pub(super) enum Next {
    /// Goes on through Envoy's router (claimed in router mode, or passed unprotected).
    Router,
    /// Stays paused: the root sends it, it waits, or it was answered.
    Hold,
}

/// The request's headers and body, turned into what the root sends only when it must: a
/// replay or a 409 never needs it (it costs a property read and a copy of every header).
pub(super) struct LazyOutbound<'a> {
    host: Option<&'a dyn Host>,
    parts: Option<(Option<HeaderMap>, Vec<u8>)>,
    /// The policy's `detached_via`.
    via: Option<&'a str>,
}

impl LazyOutbound<'_> {
    pub(super) fn none() -> LazyOutbound<'static> {
        LazyOutbound { host: None, parts: None, via: None }
    }

    fn take(&mut self) -> Option<Outbound> {
        let (headers, body) = self.parts.take()?;
        request::outbound(self.host?, headers, body, self.via)
    }
}

impl<S: Store> Lifecycle<S> {
    /// The whole request is here: claim the key or learn what holds it (docs/behaviour.md §3.2–3.4).
    pub(super) fn claim(&mut self, host: &dyn Host, id: u32, body: Vec<u8>, now: u64) -> Flow {
        let Some(stream) = self.streams.get_mut(&id) else { return Flow::Continue };
        let Phase::ReadingBody { pending, .. } = std::mem::replace(&mut stream.phase, Phase::Pass) else {
            return Flow::Continue;
        };
        let policy = self.config.clone();
        let policy = policy.policy(stream.policy);
        let Pending { key, mut fingerprint, headers, caller, .. } = *pending;
        if policy.fingerprint_body {
            fingerprint.body(&body);
        }
        let fingerprint = fingerprint.finish();
        self.renew_due(now, false);
        let established = self.known.group(caller) != Group::UNKNOWN;
        let claim = Claim { key, fingerprint, caller, established, lease_ms: policy.lease_ms };
        let mut held = Box::new(Held {
            key,
            fingerprint,
            caller,
            outbound: None,
            wait_deadline_ms: None,
            next_poll_ms: 0,
            polling: false,
            _buffered: None,
            group: super::budget::Group::UNKNOWN,
        });
        let mut lazy =
            LazyOutbound { host: Some(host), parts: Some((headers, body)), via: policy.detached_via.as_deref() };
        if let Some(note) = self.note_mut(id) {
            note.key = Some(key);
            note.asked_ms = now;
        }
        match self.store.begin(For::Stream(id), &claim, now) {
            Some(Answer::Began(began)) => {
                log::debug!("key {} -> {}", key.short(), describe(&began));
                match self.decide(id, held, began, &mut lazy, now) {
                    Next::Router => Flow::Continue,
                    Next::Hold => Flow::Pause,
                }
            }
            Some(other) => {
                log::warn!("unexpected store answer to a claim: {other:?}");
                if self.config.observe {
                    self.observed(id, "store-unavailable");
                    return Flow::Continue;
                }
                self.problem(id, Problem::store_unavailable(policy.retry_after_s));
                Flow::Pause
            }
            None => {
                // The store answers later, in the root's event: read what the root may need
                // to send the request now, while this is the stream's own event.
                held.outbound = lazy.take();
                self.set_phase(id, Phase::Claiming(held));
                Flow::Pause
            }
        }
    }

    /// A claim's answer that came later (etcd), in the root's event. Its stream may have
    /// ended meanwhile: a held request's poll still answers the others that wait for it, and
    /// a claim nobody takes is given back at once (nothing went upstream), never left to
    /// lock the key until its mark expires.
    pub(super) fn on_claim_answer(&mut self, id: u32, began: Began, now: u64) {
        let asked = self.asking.remove(&id);
        let phase = self.streams.get_mut(&id).map(|s| std::mem::replace(&mut s.phase, Phase::Pass));
        let held = match phase {
            Some(Phase::Claiming(held)) => held,
            Some(Phase::Waiting(held)) => {
                let request = (held.key, held.fingerprint);
                self.set_phase_quietly(id, Phase::Waiting(held));
                return self.on_poll_answer(request, Some(id), began, now);
            }
            other => {
                if let Some(phase) = other {
                    self.set_phase_quietly(id, phase);
                }
                return match (asked, began) {
                    (Some(request), began) => self.on_poll_answer(request, None, began, now),
                    (None, Began::Claimed { owner, .. }) => {
                        log::debug!("a claim was answered after its client left; released");
                        self.release(owner, now)
                    }
                    (None, _) => {}
                };
            }
        };
        log::debug!("key {} -> {}", held.key.short(), describe(&began));
        if let Next::Router = self.decide(id, held, began, &mut LazyOutbound::none(), now) {
            self.effects.push(super::Effect::Resume { stream: id });
        }
    }

    /// What the request does with its claim's answer; counted here.
    pub(super) fn decide(&mut self, id: u32, held: Box<Held>, began: Began, lazy: &mut LazyOutbound, now: u64) -> Next {
        let Some(policy) = self.streams.get(&id).map(|s| s.policy) else { return Next::Hold };
        let retry_after_s = self.policy(policy).retry_after_s;
        let fencing = self.config.fencing_header.is_some();
        if let Some(note) = self.note_mut(id) {
            note.store_ms = Some(now.saturating_sub(note.asked_ms));
            if let (true, Began::Claimed { owner, .. }) = (fencing, &began) {
                note.fence = Some(owner.fence);
            }
        }
        match began {
            Began::Claimed { owner, takeover, change, leased_ms } => {
                self.known.claimed(held.caller);
                self.count(Counter::Claimed);
                if takeover {
                    self.count(Counter::ExpiredTakeover);
                }
                self.apply(&change);
                let outbound = held.outbound.or_else(|| lazy.take());
                self.go_upstream(id, policy, Some(owner), outbound, leased_ms)
            }
            Began::InProgress => self.in_progress(id, held, lazy, now),
            Began::Replay(_) if self.config.observe => {
                self.count(Counter::Replayed);
                self.observed(id, "replayed");
                Next::Router
            }
            Began::Replay(response) => {
                self.count(Counter::Replayed);
                if self.replays_through_loopback(id, &response) {
                    self.through_loopback(id, response, true, false);
                    return Next::Router;
                }
                self.reply(id, Reply::Stored { response, replayed: true });
                Next::Hold
            }
            Began::CompletedWithoutBody => self.refuse(id, Counter::Conflict, Problem::completed_without_response()),
            Began::Mismatch => self.refuse(id, Counter::FingerprintMismatch, Problem::fingerprint_mismatch()),
            Began::Full { retry_after_s } => self.refuse(id, Counter::StoreFull, Problem::store_full(retry_after_s)),
            Began::OverShare { retry_after_s } => {
                self.refuse(id, Counter::ShareFull, Problem::share_full(retry_after_s))
            }
            Began::Failed(e) => {
                log::warn!("store error {e:?}");
                self.refuse(id, Counter::StoreError, Problem::store_unavailable(retry_after_s))
            }
            Began::Unavailable => {
                let outbound = held.outbound.or_else(|| lazy.take());
                self.unavailable(id, policy, outbound)
            }
        }
    }

    /// A gRPC result with messages: a local reply cannot carry them (docs/behaviour.md §4), a response
    /// through the router can.
    fn replays_through_loopback(&self, id: u32, response: &StoredResponse) -> bool {
        self.config.grpc_replay_loopback
            && self.streams.get(&id).is_some_and(|s| s.grpc)
            && super::grpc_reply::trailers_only_status(response).is_none()
    }

    fn refuse(&mut self, id: u32, counter: Counter, problem: Problem) -> Next {
        self.count(counter);
        if self.config.observe {
            self.observed(id, problem.slug());
            return Next::Router;
        }
        self.problem(id, problem);
        Next::Hold
    }

    /// Claimed (or passed without a claim): the root sends it, or the router does.
    pub(super) fn go_upstream(
        &mut self,
        id: u32,
        policy: usize,
        owner: Option<Owner>,
        outbound: Option<Outbound>,
        leased_ms: u64,
    ) -> Next {
        let mut work = Work { stream: id, policy, owner, renewed_ms: owner.map(|_| leased_ms), call: None, end: None };
        let skew = u64::from(planted(Defect::FenceNotTheClaims));
        let fence = self.config.fencing_header.clone().map(|name| (name, owner.map(|o| (o.fence + skew).to_string())));
        match outbound {
            Some(mut request) => {
                if let Some((name, token)) = fence {
                    // The client's value never goes on; the claim's token does (docs/behaviour.md §3.9).
                    request.headers = request.headers.replaced(&name, token.as_deref());
                }
                let grpc = self.streams.get(&id).is_some_and(|s| s.grpc);
                if grpc {
                    // The client's deadline is not the call's: it goes on after its client
                    // left, within upstream_timeout_ms (an upstream told the deadline would
                    // give up with it, and DEADLINE_EXCEEDED releases the key).
                    request.headers = request.headers.replaced("grpc-timeout", None);
                }
                let caller = self.streams.get(&id).map_or(crate::caller::Caller::ANONYMOUS, |s| s.caller);
                work.call = Some(DetachedCall { grpc, caller, outgoing: Some(request) });
                let work_id = owner.map_or_else(|| WorkId::Pass(self.new_call_id()), |o| WorkId::Owner(o.id));
                self.work.insert(work_id, work);
                self.outbox.push_back(work_id);
                self.set_phase(id, Phase::Detached);
                Next::Hold
            }
            None => {
                if let Some(o) = owner {
                    self.work.insert(WorkId::Owner(o.id), work);
                }
                if let Some((name, Some(token))) = fence {
                    self.effects.push(super::Effect::SetRequestHeader { stream: id, name, value: Some(token) });
                }
                self.set_phase(id, Phase::Owner { owner, capture: None });
                Next::Router
            }
        }
    }

    /// Same fingerprint, in progress: hold it (wait mode, while there is room) or 409.
    fn in_progress(&mut self, id: u32, mut held: Box<Held>, lazy: &mut LazyOutbound, now: u64) -> Next {
        let Some(policy) = self.streams.get(&id).map(|s| s.policy) else { return Next::Hold };
        if planted(Defect::DuplicateForwarded) {
            let outbound = held.outbound.take().or_else(|| lazy.take());
            return self.go_upstream(id, policy, None, outbound, 0);
        }
        let p = self.config.clone();
        let p = p.policy(policy);
        // A caller (callers not known, together) holds at most half the wait slots and half
        // the buffer: one caller running them out gets its 409 itself.
        let group = self.known.group(held.caller);
        let slots = super::budget::fits(
            self.waiting,
            self.waiting_by.get(&group).copied().unwrap_or(0),
            1,
            self.config.max_waiters,
        );
        if p.on_conflict == OnConflict::Wait && slots {
            let outbound = held.outbound.take().or_else(|| lazy.take());
            // A held request's body and headers count against the worker's buffer budget (an
            // HTTP/2 client makes a few bytes on the wire into tens of KiB of headers); past
            // it, 409 at once.
            let reserved = match &outbound {
                Some(o) => self.buffered.reserve(group, o.body.len() + o.headers.as_bytes().len()).map(Some),
                None => Some(None),
            };
            if let Some(reservation) = reserved {
                self.count(Counter::Waited);
                held.outbound = outbound;
                held._buffered = reservation;
                held.group = group;
                held.wait_deadline_ms = Some(now.saturating_add(p.wait_max_ms));
                held.next_poll_ms = now.saturating_add(self.store.wait_poll_ms());
                self.set_phase(id, Phase::Waiting(held));
                return Next::Hold;
            }
        }
        self.refuse(id, Counter::Conflict, Problem::in_progress(p.retry_after_s))
    }

    /// The store does not answer: `on_unavailable` decides (docs/behaviour.md §2).
    fn unavailable(&mut self, id: u32, policy: usize, outbound: Option<Outbound>) -> Next {
        self.count(Counter::StoreError);
        let pass = matches!(&self.config.store, StoreConfig::Etcd(e) if e.on_unavailable == OnUnavailable::Pass);
        if self.config.observe {
            self.observed(id, if pass { "pass-store-unavailable" } else { "store-unavailable" });
            return Next::Router;
        }
        if !pass {
            let retry_after_s = self.policy(policy).retry_after_s;
            self.problem(id, Problem::store_unavailable(retry_after_s));
            return Next::Hold;
        }
        log::warn!("store unavailable: forwarding without idempotency (on_unavailable: pass)");
        self.record(id, "pass-store-unavailable");
        self.go_upstream(id, policy, None, outbound, 0)
    }

    /// What an owner's write achieved, counted.
    pub(super) fn on_owner_answer(&mut self, owner: Owner, answer: Answer) -> Option<Rc<StoredResponse>> {
        match answer {
            Answer::Renewed(true) => None,
            Answer::Renewed(false) => {
                self.stop_renewing(owner);
                None
            }
            Answer::Released { done, change } => {
                self.count(if done { Counter::Released } else { Counter::OwnerLost });
                self.apply(&change);
                None
            }
            Answer::Completed(Completed::Stored { change, response }) => {
                self.count(Counter::Completed);
                self.apply(&change);
                self.release_end(owner, true);
                response
            }
            Answer::Completed(Completed::WithoutBody { change, response }) => {
                self.count(Counter::Completed);
                self.count(Counter::ResponseNotStored);
                self.apply(&change);
                self.release_end(owner, true);
                response
            }
            Answer::Completed(Completed::Lost { response }) => {
                log::info!("a mark was taken over before its owner finished; the late result is not stored");
                self.count(Counter::OwnerLost);
                self.release_end(owner, true);
                response
            }
            Answer::Refused { error, response } => {
                log::warn!("store write refused ({error:?}); retried from the timer");
                self.count(Counter::StoreError);
                self.release_end(owner, false);
                response
            }
            Answer::Began(_) => None,
        }
    }

    /// An answer the store gave later (etcd), or a retried write's (both stores).
    pub(super) fn on_store_answer(&mut self, who: For, answer: Answer, now: u64) {
        match (who, answer) {
            (For::Stream(id), Answer::Began(began)) => self.on_claim_answer(id, began, now),
            (For::Owner(owner), answer) => {
                self.on_owner_answer(owner, answer);
            }
            (For::Stream(_), other) => log::warn!("unexpected store answer for a stream: {other:?}"),
        }
    }
}

/// A short text of a claim's answer for the debug log.
pub(super) fn describe(began: &Began) -> String {
    match began {
        Began::Claimed { owner, takeover, .. } => format!("claimed (token {}, takeover: {takeover})", owner.fence),
        Began::InProgress => "in progress".into(),
        Began::Replay(r) => format!("replay of {}", r.status()),
        Began::CompletedWithoutBody => "completed without stored response: 409".into(),
        Began::Mismatch => "fingerprint mismatch: 422".into(),
        Began::Full { .. } => "store full: 503".into(),
        Began::OverShare { .. } => "share full: 429".into(),
        Began::Failed(e) => format!("store error {e:?}: 503"),
        Began::Unavailable => "store unavailable".into(),
    }
}
