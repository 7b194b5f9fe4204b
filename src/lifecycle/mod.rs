//! The request's lifecycle (docs/behaviour.md §3), sans I/O: events in (request headers, body, the upstream's
//! answer, a store's answer, the timer, a stream's end), effects out (reply, resume, dispatch,
//! count). One implementation for both stores and both forward modes: what differs between
//! stores lives behind [`Store`]. It reads Envoy through [`Host`] during an event and the time
//! from the caller. See ARCHITECTURE.md.

pub mod budget;
mod claim;
mod effect;
mod forward;
pub mod grpc_reply;
pub mod problem;
mod record;
mod request;
mod root_events;
mod waiting;
mod work;

#[cfg(test)]
mod fence_tests;
#[cfg(test)]
mod fleet_tests;
#[cfg(test)]
mod grpc_tests;
#[cfg(test)]
pub mod inspect;
#[cfg(test)]
mod tests;

pub use effect::{CallId, Effect, Reply};
pub use request::Outbound;
pub use work::WorkId;

use crate::caller::{Caller, TagKey};
use std::collections::VecDeque;

use crate::ids::IdMap;
use std::rc::Rc;

use crate::config::{Config, OnConflict, Policy};
use crate::fingerprint::Fingerprint;
use crate::host::{Flow, Host};
use crate::key::StoreKey;
use crate::metrics::{Counter, Gauge};
use crate::store::Change;
use crate::store::{CallRequest, Owner, Store};
use budget::{Budget, Group, Known, Reservation};
use problem::Problem;
use request::{Covered, Pending};

/// One VM's requests and their store. The adapter feeds it events and carries out what
/// [`Lifecycle::take_effects`] returns.
///
/// Call order (what the adapter and the simulator, `src/sim/`, both keep):
/// - a stream: [`on_request_headers`](Self::on_request_headers), then
///   [`on_request_body`](Self::on_request_body) until its end (or
///   [`on_request_trailers`](Self::on_request_trailers)); for a request that went on through
///   the router and [`watches_response`](Self::watches_response),
///   [`on_response_headers`](Self::on_response_headers), `on_response_body`,
///   `on_response_trailers`; finally [`on_stream_done`](Self::on_stream_done), once, whenever
///   the stream ends (answered, reset, client gone), after which no effect names it;
/// - the root: [`on_tick`](Self::on_tick) every [`tick_ms`](Self::tick_ms),
///   [`on_wake`](Self::on_wake) after a `WakeRoot` effect, and for every `Dispatch` exactly
///   one of [`on_call_answer`](Self::on_call_answer) /
///   [`on_grpc_call_answer`](Self::on_grpc_call_answer) (a timeout is an answer) or
///   [`on_call_failed`](Self::on_call_failed);
/// - after each of these, [`take_effects`](Self::take_effects), carried out in order. A
///   `Reply` or `Resume` names only a stream that is still open; `Resume` only a request the
///   stream's callback paused, `ResumeResponse` only a response it paused.
pub struct Lifecycle<S> {
    config: Rc<Config>,
    store: S,
    /// Covered streams still open, by context id; a stream missing here is gone or not ours.
    streams: IdMap<u32, Stream>,
    /// Work forwarded under a claim (renewed, then ended) or detached without one.
    work: IdMap<WorkId, work::Work>,
    /// Detached calls waiting for the root to send them, in order.
    outbox: VecDeque<WorkId>,
    /// Store calls waiting for the root (taken from the store during a stream's event).
    store_calls: VecDeque<(u64, CallRequest)>,
    effects: Vec<Effect>,
    /// Bytes buffered for requests in flight: router captures, held bodies.
    buffered: Budget,
    next_call: u64,
    next_renewal_ms: u64,
    scope_logged_ms: u64,
    /// Whether this VM ever got a request body callback (docs/behaviour.md §4).
    body_seen: bool,
    wake_sent: bool,
    /// Streams held in wait mode (`max_waiters`), in all and per group of callers (no group
    /// holds more than half).
    waiting: usize,
    waiting_by: IdMap<Group, usize>,
    /// The callers this worker has seen claim twice: the others share one group.
    known: Known,
    /// This Envoy's secret for callers' tags.
    tag_key: TagKey,
    /// Held requests' polls on their way (etcd), by the stream that asked: its answer is for
    /// every waiter of that request, should the asker leave first.
    asking: IdMap<u32, (StoreKey, Fingerprint)>,
    tick_ms: u64,
}

struct Stream {
    policy: usize,
    phase: Phase,
    /// Whose key it is: its shares of the worker's buffer and wait slots count for it.
    caller: Caller,
    /// A gRPC call: the plugin's answers are gRPC's (docs/behaviour.md §3.10).
    grpc: bool,
    /// What its record (filter state) will say besides the decision.
    note: record::Note,
}

enum Phase {
    /// Nothing left to do (passed through, answered by the upstream).
    Pass,
    /// Covered: the body is coming; `since_ms` for the body-delivery check (0 once it is over).
    ReadingBody { pending: Box<Pending>, since_ms: u64 },
    /// Waiting for the store's first answer (etcd).
    Claiming(Box<Held>),
    /// A duplicate held until the first call's outcome is known (wait mode).
    Waiting(Box<Held>),
    /// Router forwarding: we own the key and watch the upstream's answer.
    Owner { owner: Option<Owner>, capture: Option<forward::Capture> },
    /// Detached forwarding: the root sends the request and answers us.
    Detached,
    /// We answered locally; our own reply passes through our response callbacks.
    Replied,
    /// A gRPC replay with messages: the request went to the replay loopback, whose answer
    /// becomes the stored one (docs/behaviour.md §3.10).
    GrpcReplay { response: Rc<crate::encoding::StoredResponse>, replayed: bool },
}

/// A covered request between its body and its claim's outcome.
struct Held {
    key: StoreKey,
    fingerprint: Fingerprint,
    caller: Caller,
    /// Set when the request can be sent detached, should it become the owner.
    outbound: Option<Outbound>,
    /// Wait mode: when it stops waiting; when it asks the store again; whether it is asking.
    wait_deadline_ms: Option<u64>,
    next_poll_ms: u64,
    polling: bool,
    /// The buffer budget held by its body while it waits.
    _buffered: Option<Reservation>,
    /// The group its wait slot counts for.
    group: Group,
}

/// Timer periods: renewal and retries want 50 ms; wait mode polls held requests on the same
/// timer, so it wants 20 ms (docs/behaviour.md §4).
pub const TICK_MS: u64 = 50;
pub const WAIT_TICK_MS: u64 = 20;

impl<S: Store> Lifecycle<S> {
    pub fn new(config: Config, store: S) -> Self {
        let buffered = Budget::new(config.max_buffered_bytes);
        let tick_ms = Self::tick_ms_for(&config);
        Lifecycle {
            config: Rc::new(config),
            store,
            streams: IdMap::default(),
            work: IdMap::default(),
            outbox: VecDeque::new(),
            store_calls: VecDeque::new(),
            effects: Vec::new(),
            buffered,
            next_call: 1,
            next_renewal_ms: 0,
            scope_logged_ms: 0,
            body_seen: false,
            wake_sent: false,
            waiting: 0,
            waiting_by: IdMap::default(),
            known: Known::default(),
            tag_key: TagKey::default(),
            asking: IdMap::default(),
            tick_ms,
        }
    }

    /// Keys callers' tags with this Envoy's secret (docs/memory.md, "Fair share").
    pub fn with_tag_key(mut self, key: TagKey) -> Self {
        self.tag_key = key;
        self
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn store(&self) -> &S {
        &self.store
    }

    /// The timer period this VM wants.
    pub fn tick_ms(&self) -> u64 {
        self.tick_ms
    }

    /// The timer period for `config`: wait mode polls held requests on it.
    pub fn tick_ms_for(config: &Config) -> u64 {
        if config.policies().any(|p| p.on_conflict == OnConflict::Wait) {
            WAIT_TICK_MS
        } else {
            TICK_MS
        }
    }

    /// What the events so far asked for, in order. Taken at once after each event: a local
    /// reply re-enters the plugin, and the nested event's effects are carried out by it.
    pub fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    /// Whether `id` is a covered stream still open: the others' callbacks need nothing.
    pub fn tracks(&self, id: u32) -> bool {
        self.streams.contains_key(&id)
    }

    /// Whether `id`'s response matters: a router owner's, which completes or releases its key.
    pub fn watches_response(&self, id: u32) -> bool {
        matches!(self.streams.get(&id), Some(Stream { phase: Phase::Owner { .. } | Phase::GrpcReplay { .. }, .. }))
    }

    /// Nothing in flight and nothing to retry: a root that is being replaced may end. Its
    /// covered streams count too: a held request is polled, an owner's mark renewed and a
    /// claim's call sent from this root's timer and queue, which end with it.
    pub fn is_idle(&self) -> bool {
        self.streams.is_empty()
            && self.work.is_empty()
            && self.outbox.is_empty()
            && self.store_calls.is_empty()
            && self.asking.is_empty()
            && self.store.is_idle()
    }

    // --- stream events ------------------------------------------------------------------

    /// Request headers: is the request covered, is its key valid; remember what the claim
    /// needs. The claim itself waits for the body (it is part of the fingerprint).
    pub fn on_request_headers(&mut self, host: &dyn Host, id: u32, end_of_stream: bool) -> Flow {
        let config = self.config.clone();
        if let Some(name) = config
            .fencing_header
            .as_ref()
            .filter(|_| !crate::defects::planted(crate::defects::Defect::ForgedFencePasses))
        {
            self.effects.push(Effect::SetRequestHeader { stream: id, name: name.clone(), value: None });
        }
        let read = request::policy_for(&config, host, end_of_stream);
        let policy = read.policy;
        let p = config.policy(policy);
        if !p.enabled || !p.methods.iter().any(|m| m.as_bytes() == read.method.as_slice()) {
            return Flow::Continue;
        }
        let (covered, grpc) = request::read_headers(&config, p, &read.method, read.headers, host, &self.tag_key);
        let flow = match covered {
            Covered::No => Flow::Continue,
            Covered::Refused(problem, counter) if config.observe => {
                self.count(counter);
                self.record(id, problem.slug());
                Flow::Continue
            }
            Covered::Refused(problem, counter) => {
                self.count(counter);
                let (phase, note, caller) = (Phase::Pass, record::Note::default(), Caller::ANONYMOUS);
                self.streams.insert(id, Stream { policy, phase, caller, grpc, note });
                self.reply(id, Reply::Problem(problem));
                Flow::Pause
            }
            Covered::Unscoped => {
                self.count(Counter::ScopeMissing);
                self.log_missing_scope(host.now_ms());
                self.record(id, "pass-scope-missing");
                Flow::Continue
            }
            Covered::Yes(pending) => {
                if pending.scope_shared {
                    self.count(Counter::ScopeMissing);
                }
                // The clock is a host call: read it here only when this event claims, or
                // while the body-delivery check still needs the request's arrival.
                let now = if end_of_stream || !self.body_seen { host.now_ms() } else { 0 };
                let (note, caller) = (record::Note::default(), pending.caller);
                let phase = Phase::ReadingBody { pending, since_ms: now };
                self.streams.insert(id, Stream { policy, phase, caller, grpc, note });
                if end_of_stream {
                    self.claim(host, id, Vec::new(), now)
                } else {
                    Flow::Pause
                }
            }
        };
        self.after_stream_event();
        flow
    }

    pub fn on_request_body(&mut self, host: &dyn Host, id: u32, size: usize, end_of_stream: bool) -> Flow {
        let Some(stream) = self.streams.get(&id) else { return Flow::Continue };
        if !matches!(stream.phase, Phase::ReadingBody { .. }) {
            return Flow::Continue;
        }
        self.body_seen = true;
        let max = self.config.policy(stream.policy).max_request_body_bytes;
        let flow = if size > max {
            self.count(Counter::TooLarge);
            if self.config.observe {
                self.observed(id, "body-too-large");
                return Flow::Continue;
            }
            self.reply(id, Reply::Problem(Problem::body_too_large(max)));
            Flow::Pause
        } else if !end_of_stream {
            Flow::Pause // Envoy buffers the body until its end
        } else {
            self.claim(host, id, host.request_body(size), host.now_ms())
        };
        self.after_stream_event();
        flow
    }

    /// Trailers end the request: the body, if any, is buffered.
    pub fn on_request_trailers(&mut self, host: &dyn Host, id: u32) -> Flow {
        let Some(stream) = self.streams.get(&id) else { return Flow::Continue };
        if !matches!(stream.phase, Phase::ReadingBody { .. }) {
            return Flow::Continue;
        }
        let max = self.config.policy(stream.policy).max_request_body_bytes;
        let flow = self.claim(host, id, host.request_body(max), host.now_ms());
        self.after_stream_event();
        flow
    }

    /// The stream ended. A router owner whose client left before the answer: the outcome is
    /// unknown, so its mark is no longer renewed and expires (docs/behaviour.md §3.5). A detached call
    /// goes on.
    pub fn on_stream_done(&mut self, id: u32) {
        let Some(stream) = self.streams.remove(&id) else { return };
        match stream.phase {
            Phase::Owner { owner: Some(owner), .. } => {
                self.work.remove(&WorkId::Owner(owner.id));
                self.store.forget(owner);
            }
            Phase::Waiting(held) => self.waiter_gone(held.group), // the client left: nothing to release
            _ => {}
        }
    }

    // --- helpers --------------------------------------------------------------------------

    fn policy(&self, index: usize) -> &Policy {
        self.config.policy(index)
    }

    fn count(&mut self, counter: Counter) {
        self.count_n(counter, 1);
    }

    fn count_n(&mut self, counter: Counter, n: u32) {
        if n > 0 {
            self.effects.push(Effect::Count { counter, n });
        }
    }

    /// Shows what a store operation changed: gauges, evictions, expired marks.
    fn apply(&mut self, change: &Change) {
        let gauges = [
            (Gauge::InProgress, change.in_progress),
            (Gauge::Completed, change.completed),
            (Gauge::StoredBytes, change.bytes),
        ];
        for (gauge, delta) in gauges {
            if delta != 0 {
                self.effects.push(Effect::AddGauge { gauge, delta });
            }
        }
        self.count_n(Counter::Evicted, change.evicted);
        self.count_n(Counter::EvictedBelowShare, change.evicted_below_share);
        self.count_n(Counter::Expired, change.expired_marks);
    }

    /// Answers `id` locally, if its stream is still open (docs/behaviour.md §4: a reply to a stream Envoy
    /// has reset would re-enter a context the SDK has dropped).
    fn reply(&mut self, id: u32, reply: Reply) {
        let Some(stream) = self.streams.get(&id) else { return };
        let decision = match &reply {
            Reply::Problem(p) => p.slug(),
            Reply::Stored { replayed: true, .. } => "replayed",
            Reply::Stored { replayed: false, .. } => stream.note.outcome.unwrap_or("claimed"),
            Reply::Grpc(_) => "grpc-not-replayable",
        };
        self.record(id, decision);
        let Some(stream) = self.streams.get(&id) else { return };
        let reply = match reply {
            Reply::Problem(p) if stream.grpc => Reply::Grpc(grpc_reply::GrpcAnswer::for_problem(&p)),
            // A local reply to a gRPC call cannot carry messages and trailers (Envoy makes it
            // trailers-only): a failed call answers as its status; a result with messages
            // goes through the replay loopback, or cannot be replayed (limits.md).
            Reply::Stored { response, replayed } if stream.grpc => {
                match grpc_reply::GrpcAnswer::replay_of(&response, replayed) {
                    Some(answer) => Reply::Grpc(answer),
                    None if self.config.grpc_replay_loopback => {
                        return self.through_loopback(id, response, replayed, true)
                    }
                    None => Reply::Grpc(grpc_reply::GrpcAnswer::not_replayable()),
                }
            }
            other => other,
        };
        self.set_phase(id, Phase::Replied);
        self.effects.push(Effect::Reply { stream: id, reply });
    }

    /// Sends a paused gRPC call on to the replay loopback, whose answer becomes `response`
    /// (`resume`: from another event than the stream's own).
    fn through_loopback(
        &mut self,
        id: u32,
        response: Rc<crate::encoding::StoredResponse>,
        replayed: bool,
        resume: bool,
    ) {
        // Not gRPC on the way there: the loopback's answer must keep its body.
        let set = [(":path", grpc_reply::REPLAY_PATH), ("content-type", "application/x-idempotency-replay")];
        for (name, value) in set {
            let (name, value) = (name.to_string(), Some(value.to_string()));
            self.effects.push(Effect::SetRequestHeader { stream: id, name, value });
        }
        self.record(id, if replayed { "replayed" } else { "claimed" });
        self.set_phase(id, Phase::GrpcReplay { response, replayed });
        if resume {
            self.effects.push(Effect::Resume { stream: id });
        }
    }

    /// Puts back a phase taken out to be looked at (the count of held requests unchanged).
    fn set_phase_quietly(&mut self, id: u32, phase: Phase) {
        if let Some(stream) = self.streams.get_mut(&id) {
            stream.phase = phase;
        }
    }

    /// Moves a stream to `phase`, keeping the count of held requests.
    fn set_phase(&mut self, id: u32, phase: Phase) {
        let Some(stream) = self.streams.get_mut(&id) else { return };
        let was = match &stream.phase {
            Phase::Waiting(held) => Some(held.group),
            _ => None,
        };
        let now = match &phase {
            Phase::Waiting(held) => Some(held.group),
            _ => None,
        };
        stream.phase = phase;
        if let Some(group) = was {
            self.waiter_gone(group);
        }
        if let Some(group) = now {
            self.waiting += 1;
            *self.waiting_by.entry(group).or_default() += 1;
        }
    }

    /// A held request stops waiting (answered, sent on, or its client left).
    fn waiter_gone(&mut self, group: Group) {
        self.waiting = self.waiting.saturating_sub(1);
        if let Some(n) = self.waiting_by.get_mut(&group) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.waiting_by.remove(&group);
            }
        }
    }

    fn problem(&mut self, id: u32, problem: Problem) {
        self.reply(id, Reply::Problem(problem));
    }

    /// Observe mode: what enforcing would have answered is recorded, and the request goes on
    /// as it came (the caller lets it: `Flow::Continue` in its own callback, a resume else).
    fn observed(&mut self, id: u32, decision: &str) {
        self.record(id, decision);
        self.set_phase(id, Phase::Pass);
    }

    fn log_missing_scope(&mut self, now: u64) {
        const EVERY_MS: u64 = 60_000;
        if now >= self.scope_logged_ms {
            self.scope_logged_ms = now + EVERY_MS;
            log::warn!(
                "a covered request carries none of its scope (scope_headers, scope_peer, scope_jwt_claim): passed on without idempotency (missing_scope: pass; logged once a minute)"
            );
        }
    }

    /// A stream's event queued calls for the root: wake it (once until it runs).
    pub(super) fn after_stream_event(&mut self) {
        while let Some(call) = self.store.poll_call() {
            self.store_calls.push_back(call);
        }
        // The store's counts (a local replay's) go out now, not at the next tick.
        while let Some(counter) = self.store.poll_count() {
            self.count(counter);
        }
        let work = !self.outbox.is_empty() || !self.store_calls.is_empty();
        if work && !self.wake_sent {
            self.wake_sent = true;
            self.effects.push(Effect::WakeRoot);
        }
    }

    fn new_call_id(&mut self) -> u64 {
        let id = self.next_call;
        self.next_call += 1;
        id
    }
}
