//! The root context of one VM: configuration, the table's creation, the timer (renewal,
//! retries, sweeping) and detached upstream calls, whose answers the SDK routes here.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::rc::Rc;
use std::time::Duration;

use super::http::Stream;
use super::{describe, etcd, host, judge, send_stored, Call, Job, Owned, Owner, Verdict, Vm};
use crate::config::{Config, Forward, StoreConfig};
use crate::engine::{Finish, Held, Layout, Table};
use crate::entry::StoredResponse;
use crate::metrics::Counter;
use crate::problem::Problem;

/// Timer period: fast enough for renewal and retries; renewal itself is throttled. Wait mode
/// polls held requests on the same timer, so it wants a faster one (SPEC §4).
const TICK: Duration = Duration::from_millis(50);
const WAIT_TICK: Duration = Duration::from_millis(20);
/// Buckets swept per second and VM: a 1,024-bucket table is swept every 2.5 s per worker.
const SWEEP_PER_SECOND: u64 = 400;

pub struct Root {
    id: u32,
    vm: Option<Rc<Vm>>,
    sweep_cursor: u32,
    sweep_per_tick: u32,
}

impl Root {
    pub fn new(id: u32) -> Root {
        Root { id, vm: None, sweep_cursor: 0, sweep_per_tick: 1 }
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
        // table; workers find it and write nothing. The etcd store needs no table.
        let created = match config.store {
            StoreConfig::SharedData => table.create(),
            StoreConfig::Etcd(_) => Ok(false),
        };
        match created {
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
        let mut vm = Vm::new(config, table);
        if let StoreConfig::Etcd(cfg) = &vm.config.store {
            let max_lease = std::iter::once(&vm.config.policy).chain(vm.config.rules.iter().map(|r| &r.policy)).map(|p| p.lease_ms).max().unwrap_or(10_000);
            vm.etcd = Some(std::cell::RefCell::new(etcd::Etcd::new(cfg.clone(), max_lease)));
        }
        let vm = Rc::new(vm);
        let detached = std::iter::once(&vm.config.policy).chain(vm.config.rules.iter().map(|r| &r.policy)).any(|p| p.forward == Forward::Detached);
        if detached || vm.etcd.is_some() {
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
        let tick = if vm.waits() { WAIT_TICK } else { TICK };
        self.sweep_per_tick = (SWEEP_PER_SECOND * tick.as_millis() as u64 / 1000).max(1) as u32;
        self.vm = Some(vm);
        host::set_tick(tick);
        true
    }

    fn on_tick(&mut self) {
        let Some(vm) = self.vm.clone() else { return };
        let now = vm.now_ms();
        check_body_delivery(&vm, now);
        poll_waiters(&vm, now);
        renew(&vm, now, true);
        if vm.etcd.is_some() {
            etcd::tick(&vm, now);
            return;
        }
        vm.retry_pending();
        let buckets = vm.table.layout().buckets();
        for _ in 0..self.sweep_per_tick.min(buckets) {
            match vm.table.sweep(self.sweep_cursor, now) {
                Ok(swept) => {
                    vm.held(Held { in_progress: -swept.freed.in_progress, completed: -swept.freed.completed });
                    // In-progress marks past their deadline: their owner is gone.
                    for _ in 0..swept.freed.in_progress {
                        vm.count(Counter::Expired);
                    }
                }
                Err(e) => log::debug!("sweep of bucket {} failed: {e:?}", self.sweep_cursor),
            }
            self.sweep_cursor = (self.sweep_cursor + 1) % buckets;
        }
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        host::drain_queue(queue_id);
        if let Some(vm) = self.vm.clone() {
            dispatch_outbox(&vm);
            etcd::pump(&vm, vm.now_ms());
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

/// How long a covered request may wait for its first body callback before we conclude that
/// Envoy will never deliver bodies to this filter (SPEC §4).
const BODY_WAIT_MS: u64 = 3_000;

/// Without `allow_on_headers_stop_iteration: true`, pausing on headers stops body callbacks
/// too, and the request would hang. Until this VM has seen one body callback, answer requests
/// that waited too long with a 500 that names the setting, and log it.
fn check_body_delivery(vm: &Vm, now: u64) {
    if vm.body_seen.get() {
        return;
    }
    let stuck: Vec<u32> = vm
        .body_waits
        .borrow()
        .iter()
        .filter(|(_, since)| now.saturating_sub(**since) >= BODY_WAIT_MS)
        .map(|(id, _)| *id)
        .collect();
    for id in stuck {
        vm.body_waits.borrow_mut().remove(&id);
        log::error!(
            "no request body reached the plugin within {BODY_WAIT_MS} ms: set allow_on_headers_stop_iteration: true in the Wasm filter's config"
        );
        answer_client(vm, id, |vm| vm.reply_problem(&Problem::body_unavailable()));
    }
}

/// Renews the marks of live owners: router streams still open and detached calls in flight.
/// Runs from the timer, and also from request callbacks (`from_root` false): a worker busy
/// enough to delay its timer by hundreds of milliseconds is busy with requests, and those
/// renew the marks on time. etcd renewals need the root (their answers come back to it).
pub(super) fn renew(vm: &Vm, now: u64, from_root: bool) {
    if now < vm.next_renewal_ms.get() {
        return;
    }
    let min_lease = std::iter::once(&vm.config.policy).chain(vm.config.rules.iter().map(|r| &r.policy)).map(|p| p.lease_ms).min().unwrap_or(10_000);
    vm.next_renewal_ms.set(now + (min_lease / 16).max(10));
    let lease = |policy: usize| vm.policy(policy).lease_ms;
    let due = |renewed: u64, policy: usize| now.saturating_sub(renewed) >= lease(policy) / 4;
    let owners: Vec<_> = vm
        .owners
        .borrow()
        .iter()
        .filter(|(_, o)| due(o.renewed_ms, o.policy))
        .map(|(id, o)| (Some(*id), None, o.owner, o.policy))
        .chain(vm.calls.borrow().iter().filter(|(_, c)| due(c.renewed_ms, c.policy)).filter_map(|(t, c)| Some((None, Some(*t), c.owner?, c.policy))))
        .collect();
    for (stream, call, owner, policy) in owners {
        let lost = match owner {
            Owner::Table(ticket) => match vm.table.renew(&ticket, now, lease(policy)) {
                Ok(finish) => finish == Finish::Lost,
                Err(e) => {
                    log::warn!("renewal failed: {e:?}");
                    continue;
                }
            },
            Owner::Etcd(_) if !from_root => continue,
            Owner::Etcd(id) => {
                etcd::renew(vm, id, now, lease(policy));
                false
            }
        };
        if let Some(id) = stream {
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
pub(super) fn dispatch_outbox(vm: &Vm) {
    loop {
        let Some(job) = vm.outbox.borrow_mut().pop_front() else { return };
        let request = &job.request;
        let headers: Vec<(&str, &str)> = request.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        let policy = vm.policy(job.policy);
        let timeout = Duration::from_millis(policy.upstream_timeout_ms);
        // The job may have waited (a busy worker's event loop): renew the mark now, so that
        // the lease counts from the moment the call leaves, not from the claim.
        let now = vm.now_ms();
        match job.owner {
            Some(Owner::Table(ticket)) => {
                if let Err(e) = vm.table.renew(&ticket, now, policy.lease_ms) {
                    log::warn!("renewal before dispatch failed: {e:?}");
                }
            }
            Some(Owner::Etcd(id)) => etcd::renew(vm, id, now, policy.lease_ms),
            None => {}
        }
        match host::dispatch(&request.cluster, headers, &request.body, timeout) {
            Ok(token) => {
                let call = Call { context_id: job.context_id, policy: job.policy, owner: job.owner, renewed_ms: now };
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

fn status_of(headers: &[(String, Vec<u8>)]) -> u16 {
    headers.iter().find(|(n, _)| n == ":status").and_then(|(_, v)| std::str::from_utf8(v).ok()?.parse::<u16>().ok()).unwrap_or(0)
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
            let connect = says(b"connection failure") || says(b"overflow") || headers.iter().any(|(n, _)| n == "x-envoy-overloaded");
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
        Answer::Upstream(response) => {
            match &call.owner {
                Some(owner) if policy.release_statuses.contains(response.status) => vm.release(owner),
                Some(owner) => {
                    let keep = response.body.len() <= policy.max_response_bytes;
                    vm.complete(call.policy, owner, keep.then(|| response.clone()));
                }
                None => {}
            }
            answer_client(vm, call.context_id, |_| send_stored(&response, false));
        }
    }
}

/// Answers a paused client if its stream is still open. The live set matters: after a reset,
/// Envoy keeps the stream briefly and a reply to it would re-enter a context the SDK has
/// dropped, and panic the VM (SPEC §4).
pub(super) fn answer_client(vm: &Vm, context_id: u32, send: impl FnOnce(&Vm)) {
    if !vm.live.borrow().contains(&context_id) {
        return;
    }
    if host::set_effective_context(context_id) {
        send(vm);
    }
}

/// Wait mode: looks at the entry of every held request. One table read per distinct request
/// per tick; the first waiter of a key that finds it free becomes the owner (SPEC §3.3).
fn poll_waiters(vm: &Vm, now: u64) {
    let waiters = std::mem::take(&mut *vm.waiters.borrow_mut());
    if waiters.is_empty() {
        return;
    }
    let mut keep = Vec::with_capacity(waiters.len());
    // Requests already looked at in this tick, with what they found (claims excepted) and the
    // counter each answer adds to: every waiter answered counts once.
    type Memo = Option<(Verdict, Option<Counter>)>;
    let mut seen: Vec<(crate::key::StoreKey, crate::fingerprint::Fingerprint, Memo)> = Vec::new();
    for w in waiters {
        if !vm.live.borrow().contains(&w.context_id) {
            continue; // the client left: drop it, nothing to release
        }
        let policy = vm.policy(w.policy);
        let known = seen.iter().position(|(k, f, _)| *k == w.key && *f == w.fingerprint);
        let verdict = match known.and_then(|i| seen.get(i)) {
            // Another waiter of this request claimed it in this tick: keep waiting for it.
            Some((_, _, None)) => Verdict::InProgress,
            Some((_, _, Some((v, counter)))) => {
                if let Some(c) = counter {
                    vm.count(*c);
                }
                clone_verdict(v)
            }
            None => {
                let begin = vm.table.begin(&w.key, &w.fingerprint, now, policy.lease_ms);
                if !matches!(begin, Ok(crate::engine::Begin::InProgress)) {
                    log::debug!("waiter {} key {} -> {}", w.context_id, w.key.short(), describe(&begin));
                }
                let counter = super::counter_of(&begin);
                let v = judge(vm, policy, begin);
                let memo = if matches!(v, Verdict::Claimed(_)) { None } else { Some((clone_verdict(&v), counter)) };
                seen.push((w.key, w.fingerprint, memo));
                v
            }
        };
        match verdict {
            Verdict::InProgress if now < w.deadline_ms => keep.push(w),
            Verdict::InProgress => {
                vm.count(Counter::Conflict);
                let p = Problem::in_progress(policy.retry_after_s);
                answer_client(vm, w.context_id, |vm| vm.reply_problem(&p));
            }
            Verdict::Claimed(owner) => promote(vm, w.context_id, w.policy, w.outbound, owner, now),
            Verdict::Replay(response) => answer_client(vm, w.context_id, |_| send_stored(&response, true)),
            Verdict::Problem(p) => answer_client(vm, w.context_id, |vm| vm.reply_problem(&p)),
        }
    }
    // Requests that started waiting during this tick queue behind the older ones.
    let mut waiting = vm.waiters.borrow_mut();
    let newer = std::mem::replace(&mut *waiting, keep);
    waiting.extend(newer);
}

fn clone_verdict(v: &Verdict) -> Verdict {
    match v {
        Verdict::Claimed(t) => Verdict::Claimed(*t),
        Verdict::InProgress => Verdict::InProgress,
        Verdict::Replay(r) => Verdict::Replay(r.clone()),
        Verdict::Problem(p) => Verdict::Problem(p.clone()),
    }
}

/// A held request becomes the first call: the root sends it (detached) or resumes it into the
/// router, handing it the ownership through the VM's handoff map.
pub(super) fn promote(vm: &Vm, context_id: u32, policy: usize, outbound: Option<super::Outbound>, owner: Owner, now: u64) {
    match outbound {
        Some(request) => {
            vm.outbox.borrow_mut().push_back(Job { context_id, policy, owner: Some(owner), request });
            dispatch_outbox(vm);
        }
        None => {
            vm.owners.borrow_mut().insert(context_id, Owned { policy, owner, renewed_ms: now });
            vm.handoff.borrow_mut().insert(context_id, owner);
            if !(vm.live.borrow().contains(&context_id) && host::set_effective_context(context_id) && host::resume_request()) {
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
            vm.outbox.borrow_mut().push_back(Job { context_id, policy, owner: None, request });
            dispatch_outbox(vm);
        }
        None => {
            if host::set_effective_context(context_id) {
                host::resume_request();
            }
        }
    }
}
