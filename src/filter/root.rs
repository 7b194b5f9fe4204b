//! The root context of one VM: configuration, the table's creation, the timer (renewal,
//! retries, sweeping) and detached upstream calls, whose answers the SDK routes here.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::rc::Rc;
use std::time::Duration;

use super::http::Stream;
use super::{answer_client, detached, etcd, host, wait, Owner, Vm};
use crate::config::{Config, Forward, StoreConfig};
use crate::engine::{Finish, Layout, Table};
use crate::problem::Problem;

/// Timer period: fast enough for renewal and retries; renewal itself is throttled. Wait mode
/// polls held requests on the same timer, so it wants a faster one (SPEC §4).
const TICK: Duration = Duration::from_millis(50);
const WAIT_TICK: Duration = Duration::from_millis(20);
/// Buckets swept per second and VM: a 1,024-bucket table is swept every 2.5 s per worker.
const SWEEP_PER_SECOND: u64 = 400;

/// How often a worker adds its evictions to the effective-retention window.
const RETENTION_REPORT_MS: u64 = 1_000;

pub struct Root {
    id: u32,
    vm: Option<Rc<Vm>>,
    sweep_cursor: u32,
    sweep_per_tick: u32,
    next_retention_report_ms: u64,
}

impl Root {
    pub fn new(id: u32) -> Root {
        Root { id, vm: None, sweep_cursor: 0, sweep_per_tick: 1, next_retention_report_ms: 0 }
    }
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        if let Some(vm) = &self.vm {
            detached::on_call_answer(vm, token, num_headers, body_size);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        host::sync_log_level();
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
        let table =
            Table::new(host::SharedData, Layout::new(&config.namespace, config.capacity, config.max_store_bytes));
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
            let max_lease = vm.config.policies().map(|p| p.lease_ms).max().unwrap_or(10_000);
            vm.etcd = Some(std::cell::RefCell::new(etcd::Etcd::new(cfg.clone(), max_lease)));
        }
        let vm = Rc::new(vm);
        let detached = vm.config.policies().any(|p| p.forward == Forward::Detached);
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
        self.sweep_cursor =
            (RandomState::new().build_hasher().finish() % u64::from(vm.table.layout().buckets())) as u32;
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
        wait::poll_waiters(&vm, now);
        renew(&vm, now, true);
        if vm.etcd.is_some() {
            etcd::tick(&vm, now);
            return;
        }
        vm.retry_pending();
        let buckets = vm.table.layout().buckets();
        for _ in 0..self.sweep_per_tick.min(buckets) {
            match vm.table.sweep(self.sweep_cursor, now) {
                Ok(change) => vm.apply(&change),
                Err(e) => log::debug!("sweep of bucket {} failed: {e:?}", self.sweep_cursor),
            }
            self.sweep_cursor = (self.sweep_cursor + 1) % buckets;
        }
        if now >= self.next_retention_report_ms {
            self.next_retention_report_ms = now + RETENTION_REPORT_MS;
            vm.report_retention(now);
        }
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        host::drain_queue(queue_id);
        if let Some(vm) = self.vm.clone() {
            detached::dispatch_outbox(&vm);
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
    if (!from_root && vm.etcd.is_some()) || now < vm.next_renewal_ms.get() {
        return;
    }
    let min_lease = vm.config.policies().map(|p| p.lease_ms).min().unwrap_or(10_000);
    vm.next_renewal_ms.set(now + (min_lease / 16).max(10));
    let lease = |policy: usize| vm.policy(policy).lease_ms;
    let due = |renewed: u64, policy: usize| now.saturating_sub(renewed) >= lease(policy) / 4;
    let owners: Vec<_> = vm
        .owners
        .borrow()
        .iter()
        .filter(|(_, o)| due(o.renewed_ms, o.policy))
        .map(|(id, o)| (Some(*id), None, o.owner, o.policy))
        .chain(
            vm.calls
                .borrow()
                .iter()
                .filter(|(_, c)| due(c.renewed_ms, c.policy))
                .filter_map(|(t, c)| Some((None, Some(*t), c.owner?, c.policy))),
        )
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
