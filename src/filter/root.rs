//! The root context of one VM: configuration, the table's creation, the timer (renewal,
//! retries, sweeping) and detached upstream calls, whose answers the SDK routes here.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::rc::Rc;
use std::time::Duration;

use super::http::Stream;
use super::{host, send_stored, Call, Vm};
use crate::config::{Config, Forward};
use crate::engine::{Finish, Layout, Table};
use crate::entry::StoredResponse;
use crate::metrics::Counter;
use crate::problem::Problem;

/// Timer period: fast enough for renewal and retries; renewal itself is throttled.
const TICK: Duration = Duration::from_millis(50);
/// Buckets swept per tick and VM: a 1,024-bucket table is swept about every 2.5 s per worker.
const SWEEP_PER_TICK: u32 = 20;

pub struct Root {
    id: u32,
    vm: Option<Rc<Vm>>,
    sweep_cursor: u32,
}

impl Root {
    pub fn new(id: u32) -> Root {
        Root { id, vm: None, sweep_cursor: 0 }
    }
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        if let Some(vm) = &self.vm {
            on_call_answer(vm, token, num_headers, body_size);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let raw = proxy_wasm::hostcalls::get_buffer(proxy_wasm::types::BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
        let config = match Config::parse(&raw) {
            Ok(c) => c,
            Err(e) => {
                log::error!("{e}");
                return false;
            }
        };
        let table = Table::new(host::SharedData, Layout::new(&config.namespace, config.capacity));
        // The base VM runs this first, before any worker VM exists (SPEC §4): it creates the
        // table; workers find it and write nothing.
        match table.create() {
            Ok(true) => log::info!(
                "idempotency: created a table of {} entries ({} buckets) in namespace {:?}",
                table.layout().entries(),
                table.layout().buckets(),
                config.namespace
            ),
            Ok(false) => {}
            Err(e) => {
                log::error!("cannot create the table in shared data: {e:?}");
                return false;
            }
        }
        let vm = Rc::new(Vm::new(config, table));
        if vm.config.forward == Forward::Detached {
            // One queue per VM, under a name no other VM uses: the last VM to register a name
            // receives all its notifications (SPEC §4).
            let mut h = RandomState::new().build_hasher();
            h.write_u32(self.id);
            let name = format!("{}:detached:{:016x}", vm.config.namespace, h.finish());
            match host::register_queue(&name) {
                Some(id) => vm.queue_id.set(Some(id)),
                None => {
                    log::error!("cannot register shared queue {name}");
                    return false;
                }
            }
        }
        self.sweep_cursor = (RandomState::new().build_hasher().finish() % u64::from(vm.table.layout().buckets())) as u32;
        self.vm = Some(vm);
        host::set_tick(TICK);
        true
    }

    fn on_tick(&mut self) {
        let Some(vm) = self.vm.clone() else { return };
        let now = vm.now_ms();
        renew(&vm, now);
        vm.retry_pending();
        let buckets = vm.table.layout().buckets();
        for _ in 0..SWEEP_PER_TICK.min(buckets) {
            match vm.table.sweep(self.sweep_cursor, now) {
                Ok(swept) => vm.held(crate::engine::Held { in_progress: -swept.freed.in_progress, completed: -swept.freed.completed }),
                Err(e) => log::debug!("sweep of bucket {} failed: {e:?}", self.sweep_cursor),
            }
            self.sweep_cursor = (self.sweep_cursor + 1) % buckets;
        }
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        host::drain_queue(queue_id);
        if let Some(vm) = self.vm.clone() {
            dispatch_outbox(&vm);
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let vm = self.vm.clone()?;
        Some(Box::new(Stream::new(context_id, vm)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// Renews the marks of live owners: router streams still open and detached calls in flight.
fn renew(vm: &Vm, now: u64) {
    let lease = vm.config.lease_ms;
    let due = |renewed: u64| now.saturating_sub(renewed) >= lease / 4;
    let tickets: Vec<_> = vm
        .owners
        .borrow()
        .iter()
        .filter(|(_, o)| due(o.renewed_ms))
        .map(|(id, o)| (Some(*id), None, o.ticket))
        .chain(vm.calls.borrow().iter().filter(|(_, c)| due(c.renewed_ms)).map(|(t, c)| (None, Some(*t), c.ticket)))
        .collect();
    for (owner, call, ticket) in tickets {
        let result = vm.table.renew(&ticket, now, lease);
        if let Err(e) = result {
            log::warn!("renewal failed: {e:?}");
            continue;
        }
        let lost = result == Ok(Finish::Lost);
        if let Some(id) = owner {
            let mut owners = vm.owners.borrow_mut();
            if lost {
                owners.remove(&id);
            } else if let Some(o) = owners.get_mut(&id) {
                o.renewed_ms = now;
            }
        }
        if let Some(token) = call {
            if let Some(c) = vm.calls.borrow_mut().get_mut(&token) {
                c.renewed_ms = now;
            }
        }
    }
}

/// Sends the queued detached calls. Runs in the root's callback, so the SDK files the answer
/// under the root, which outlives the client's stream (SPEC §4).
fn dispatch_outbox(vm: &Vm) {
    loop {
        let Some(job) = vm.outbox.borrow_mut().pop_front() else { return };
        let headers: Vec<(&str, &str)> = job.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        let timeout = Duration::from_millis(vm.config.upstream_timeout_ms);
        match host::dispatch(&job.cluster, headers, &job.body, timeout) {
            Ok(token) => {
                let call = Call { context_id: job.context_id, ticket: job.ticket, renewed_ms: vm.now_ms() };
                vm.calls.borrow_mut().insert(token, call);
            }
            Err(status) => {
                // No healthy host, unknown cluster: nothing was sent.
                log::warn!("dispatch to cluster {:?} failed: {status:?}", job.cluster);
                vm.release(&job.ticket);
                vm.count(Counter::UpstreamFailed);
                let p = Problem::upstream_failed(503, "No upstream host could take the request", vm.config.retry_after_s);
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
    let status = headers
        .iter()
        .find(|(n, _)| n == ":status")
        .and_then(|(_, v)| std::str::from_utf8(v).ok()?.parse::<u16>().ok());
    let Some(status) = status else {
        return Answer::NoAnswer { status: 502, reason: "The upstream connection broke before a complete answer" };
    };
    let from_upstream = headers.iter().any(|(n, _)| n == "x-envoy-upstream-service-time");
    if !from_upstream {
        if status == 503 && body.starts_with(b"upstream connect error or disconnect/reset before headers") {
            let connect = body.windows(b"connection failure".len()).any(|w| w == b"connection failure");
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
    let headers = headers.into_iter().filter(|(n, _)| !super::is_hop_by_hop(n)).collect();
    Answer::Upstream(StoredResponse { status, headers, body })
}

fn on_call_answer(vm: &Vm, token: u32, num_headers: usize, body_size: usize) {
    let Some(call) = vm.calls.borrow_mut().remove(&token) else { return };
    let headers = if num_headers == 0 { Vec::new() } else { host::call_response_headers() };
    let body = host::call_response_body(body_size);
    match classify(headers, body) {
        Answer::NoAnswer { status, reason } => {
            log::debug!("detached call for slot {} got no answer ({status}): released", call.ticket.slot);
            vm.release(&call.ticket);
            vm.count(Counter::UpstreamFailed);
            let p = Problem::upstream_failed(status, reason, vm.config.retry_after_s);
            answer_client(vm, call.context_id, |vm| vm.reply_problem(&p));
        }
        Answer::Upstream(response) => {
            if vm.config.release_statuses.contains(response.status) {
                vm.release(&call.ticket);
            } else {
                let keep = response.body.len() <= vm.config.max_response_bytes;
                vm.complete(&call.ticket, keep.then(|| response.clone()));
            }
            answer_client(vm, call.context_id, |_| send_stored(&response, false));
        }
    }
}

/// Answers a paused client if its stream is still open. The live set matters: after a reset,
/// Envoy keeps the stream briefly and a reply to it would re-enter a context the SDK has
/// dropped, and panic the VM (SPEC §4).
fn answer_client(vm: &Vm, context_id: u32, send: impl FnOnce(&Vm)) {
    if !vm.live.borrow().contains(&context_id) {
        return;
    }
    if host::set_effective_context(context_id) {
        send(vm);
    }
}
