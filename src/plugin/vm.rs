//! What a VM's root context and its streams share: the lifecycle, the calls in flight by
//! token, the metric ids and the shared queue; and the one loop that carries out the
//! lifecycle's effects.

use crate::ids::IdMap;
use std::cell::{Cell, RefCell};
use std::time::Duration;

use super::hostcalls;
use crate::lifecycle::{is_hop_by_hop, CallId, Effect, Reply};
use crate::metrics::{Counter, Gauge};
use crate::store::{CallKind, CallRequest};

pub use crate::build::AnyLifecycle;

pub struct Vm {
    lifecycle: RefCell<AnyLifecycle>,
    /// Calls in flight by token: HTTP calls' and gRPC calls' tokens are counted apart.
    calls: RefCell<IdMap<u32, CallId>>,
    grpc_calls: RefCell<IdMap<u32, CallId>>,
    counters: Vec<(Counter, u32)>,
    gauges: Vec<(Gauge, u32)>,
    queue: Cell<Option<u32>>,
}

impl Vm {
    pub fn new(lifecycle: AnyLifecycle) -> Vm {
        let counters = Counter::ALL.iter().filter_map(|c| hostcalls::define_counter(c.name()).map(|id| (*c, id)));
        let gauges = Gauge::ALL.iter().filter_map(|g| hostcalls::define_gauge(g.name()).map(|id| (*g, id)));
        Vm {
            lifecycle: RefCell::new(lifecycle),
            calls: RefCell::default(),
            grpc_calls: RefCell::default(),
            counters: counters.collect(),
            gauges: gauges.collect(),
            queue: Cell::new(None),
        }
    }

    pub fn set_queue(&self, queue: u32) {
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
        let mut on = Target { current, switched: false };
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
                if let Some((_, id)) = self.counters.iter().find(|(c, _)| *c == counter) {
                    hostcalls::add_metric(*id, i64::from(n));
                }
            }
            Effect::AddGauge { gauge, delta } => {
                if let Some((_, id)) = self.gauges.iter().find(|(g, _)| *g == gauge) {
                    hostcalls::add_metric(*id, delta);
                }
            }
            Effect::SetGauge { gauge, value } => {
                if let Some((_, id)) = self.gauges.iter().find(|(g, _)| *g == gauge) {
                    hostcalls::set_metric(*id, value);
                }
            }
        }
    }

    /// Sends a call from the root context: the SDK files the answer under the root, which
    /// outlives the client's stream (SPEC §4).
    fn dispatch(&self, call: CallId, request: CallRequest) {
        let timeout = Duration::from_millis(request.timeout_ms);
        let sent = match &request.kind {
            CallKind::Http { headers } => {
                // Every name and value is UTF-8 (`request::outbound`, the etcd store's own).
                let headers = headers.as_text().unwrap_or_default();
                hostcalls::dispatch(&request.cluster, headers, &request.body, timeout).map(|t| (&self.calls, t))
            }
            CallKind::Grpc { service, method } => {
                hostcalls::dispatch_grpc(&request.cluster, service, method, &request.body, timeout)
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

/// Which stream the host's calls act on while effects run: the callback's own, until an
/// effect for another stream switched the context.
struct Target {
    current: Option<u32>,
    switched: bool,
}

impl Target {
    /// Makes `stream` the context; `false` when it is gone.
    fn stream(&mut self, stream: u32) -> bool {
        if self.current == Some(stream) && !self.switched {
            return true;
        }
        self.switched = self.current != Some(stream);
        hostcalls::set_effective_context(stream)
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
