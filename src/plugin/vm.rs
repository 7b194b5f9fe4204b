//! What a VM's root context and its streams share: the lifecycle, the calls in flight by
//! token, the metric ids and the shared queue; and the one loop that carries out the
//! lifecycle's effects.

use crate::ids::IdMap;
use std::cell::{Cell, RefCell};
use std::time::Duration;

use super::hostcalls;
use crate::header_map::is_hop_by_hop;
use crate::lifecycle::{CallId, Effect, Reply};
use crate::metrics::{Counter, Gauge};
use crate::store::{CallKind, CallRequest};

pub use crate::assemble::AnyLifecycle;

pub struct Vm {
    lifecycle: RefCell<AnyLifecycle>,
    /// Calls in flight by token: HTTP calls' and gRPC calls' tokens are counted apart.
    calls: RefCell<IdMap<u32, CallId>>,
    grpc_calls: RefCell<IdMap<u32, CallId>>,
    counters: Vec<(Counter, u32)>,
    gauges: Vec<(Gauge, u32)>,
    /// What the counters and gauges moved by since the last flush, in the order of
    /// `counters` then `gauges`: kept in the VM and written from the root's tick, so that a
    /// request costs no metric host call (docs/operations.md: stats lag by one tick at most).
    pending: RefCell<Vec<i64>>,
    queue: Cell<Option<u32>>,
}

impl Vm {
    pub fn new(lifecycle: AnyLifecycle) -> Vm {
        let prefix = lifecycle.config().stat_prefix.clone();
        let name = |n: &str| crate::metrics::qualified(n, prefix.as_deref());
        let counters =
            Counter::ALL.iter().filter_map(|c| hostcalls::define_counter(&name(c.name())).map(|id| (*c, id)));
        let gauges = Gauge::ALL.iter().filter_map(|g| hostcalls::define_gauge(&name(g.name())).map(|id| (*g, id)));
        let (counters, gauges): (Vec<_>, Vec<_>) = (counters.collect(), gauges.collect());
        Vm {
            lifecycle: RefCell::new(lifecycle),
            calls: RefCell::default(),
            grpc_calls: RefCell::default(),
            pending: RefCell::new(vec![0; counters.len() + gauges.len()]),
            counters,
            gauges,
            queue: Cell::new(None),
        }
    }

    /// Writes what the metrics moved by since the last flush: one host call per metric that
    /// moved. Called from the root's tick and before a root ends.
    pub fn flush_metrics(&self) {
        let mut pending = self.pending.borrow_mut();
        let ids = self.counters.iter().map(|(_, id)| id).chain(self.gauges.iter().map(|(_, id)| id));
        for (delta, id) in pending.iter_mut().zip(ids) {
            if *delta != 0 {
                hostcalls::add_metric(*id, *delta);
                *delta = 0;
            }
        }
    }

    fn add_pending(&self, at: Option<usize>, delta: i64) {
        let mut pending = self.pending.borrow_mut();
        if let Some(slot) = at.and_then(|i| pending.get_mut(i)) {
            *slot = slot.saturating_add(delta);
        }
    }

    pub fn set_queue(&self, queue: u32) {
        // Notifications left by a root that was replaced before it took them.
        hostcalls::drain_queue(queue);
        self.queue.set(Some(queue));
    }

    /// Runs one event on the lifecycle, then carries out what it asked for. `current`: the
    /// stream whose callback this is (`None`: the root's). The lifecycle is not borrowed while
    /// effects run: a local reply re-enters the plugin, whose nested event runs its own.
    pub fn event<T>(&self, current: Option<u32>, f: impl FnOnce(&mut AnyLifecycle) -> T) -> T {
        let (out, effects) = {
            let mut lifecycle = self.lifecycle.borrow_mut();
            let out = f(&mut lifecycle);
            (out, lifecycle.take_effects())
        };
        let mut on = Target { active: current };
        for effect in effects {
            self.carry_out(&mut on, effect);
        }
        out
    }

    pub fn read<T>(&self, f: impl FnOnce(&AnyLifecycle) -> T) -> T {
        f(&self.lifecycle.borrow())
    }

    /// The call an HTTP call's token stands for.
    pub fn take_call(&self, token: u32) -> Option<CallId> {
        self.calls.borrow_mut().remove(&token)
    }

    /// The call a gRPC call's token stands for.
    pub fn take_grpc_call(&self, token: u32) -> Option<CallId> {
        self.grpc_calls.borrow_mut().remove(&token)
    }

    fn carry_out(&self, on: &mut Target, effect: Effect) {
        match effect {
            Effect::Reply { stream, reply } => {
                if on.stream(stream) {
                    send(&reply);
                }
            }
            Effect::SetRequestHeader { stream, name, value } => {
                if on.stream(stream) {
                    hostcalls::set_request_header(&name, value.as_deref());
                }
            }
            Effect::SetResponseHeaders { stream, headers } => {
                if on.stream(stream) {
                    hostcalls::set_response_headers(&headers);
                }
            }
            Effect::ReplaceResponseBody { stream, size, body, trailers } => {
                if on.stream(stream) {
                    hostcalls::replace_response_body(size, &body);
                    for (name, value) in &trailers {
                        hostcalls::add_response_trailer(name, value);
                    }
                }
            }
            Effect::Resume { stream } => {
                if on.stream(stream) {
                    hostcalls::resume_request();
                }
            }
            Effect::ResumeResponse { stream } => {
                if on.stream(stream) {
                    hostcalls::resume_response();
                }
            }
            Effect::Dispatch { call, request } => self.dispatch(call, request),
            Effect::WakeRoot => {
                if let Some(queue) = self.queue.get() {
                    hostcalls::enqueue(queue);
                }
            }
            Effect::Count { counter, n } => {
                self.add_pending(self.counters.iter().position(|(c, _)| *c == counter), i64::from(n));
            }
            Effect::AddGauge { gauge, delta } => {
                let at = self.gauges.iter().position(|(g, _)| *g == gauge).map(|i| i + self.counters.len());
                self.add_pending(at, delta);
            }
            Effect::Record { stream, text } => {
                if on.stream(stream) {
                    hostcalls::set_filter_state(&text);
                }
            }
            Effect::SetGauge { gauge, value } => {
                if let Some(at) = self.gauges.iter().position(|(g, _)| *g == gauge) {
                    // A set replaces what was added since the last flush.
                    if let Some(slot) = self.pending.borrow_mut().get_mut(at + self.counters.len()) {
                        *slot = 0;
                    }
                    if let Some((_, id)) = self.gauges.get(at) {
                        hostcalls::set_metric(*id, value);
                    }
                }
            }
        }
    }

    /// Sends a call from the root context: the SDK files the answer under the root, which
    /// outlives the client's stream (docs/behaviour.md §4).
    fn dispatch(&self, call: CallId, request: CallRequest) {
        let timeout = Duration::from_millis(request.timeout_ms);
        let sent = match &request.kind {
            CallKind::Http { headers } => {
                // Every name and value is UTF-8 (`request::outbound`, the etcd store's own).
                let headers = headers.as_text().unwrap_or_default();
                hostcalls::dispatch(&request.cluster, headers, &request.body, timeout).map(|t| (&self.calls, t))
            }
            CallKind::Grpc { service, method, metadata } => {
                hostcalls::dispatch_grpc(&request.cluster, service, method, metadata, &request.body, timeout)
                    .map(|t| (&self.grpc_calls, t))
            }
        };
        match sent {
            Ok((calls, token)) => {
                calls.borrow_mut().insert(token, call);
            }
            Err(status) => {
                log::warn!("dispatch to cluster {:?} failed: {status:?}", request.cluster);
                self.event(None, |lifecycle| lifecycle.on_call_failed(call, hostcalls::now_ms()));
            }
        }
    }
}

/// Which stream the host's calls act on while effects run: the callback's own (`None`: the
/// root's), until an effect for another stream switched the context.
struct Target {
    active: Option<u32>,
}

impl Target {
    /// Makes `stream` the context (one host call, unless it is already); `false` when it is
    /// gone.
    fn stream(&mut self, stream: u32) -> bool {
        if self.active == Some(stream) {
            return true;
        }
        let switched = hostcalls::set_effective_context(stream);
        self.active = switched.then_some(stream);
        switched
    }
}

/// A local reply on the current stream.
fn send(reply: &Reply) {
    let sent = match reply {
        Reply::Problem(p) => hostcalls::send_response(p.status, &p.headers(), &p.body()),
        Reply::Stored { response, replayed } => {
            let mut headers: Vec<(&str, &[u8])> = response.headers().filter(|(n, _)| !is_hop_by_hop(n)).collect();
            if *replayed {
                headers.push(("idempotent-replayed", b"true"));
            }
            hostcalls::send_response(response.status(), &headers, response.body())
        }
        Reply::Grpc(answer) => hostcalls::send_grpc(answer.code, &answer.message, &answer.metadata),
    };
    if let Err(status) = sent {
        log::warn!("local reply failed with status {status}");
    }
}
