//! The root context of one VM: its configuration, the timer, the shared queue, and the
//! answers to the calls it sent (detached forwarding, etcd), which the SDK routes here.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;
use std::rc::Rc;
use std::time::Duration;

use super::hostcalls::{self, HostCalls};
use super::stream::Stream;
use super::vm::Vm;
use crate::host::Host;

pub struct Root {
    id: u32,
    vm: Option<Rc<Vm>>,
    /// Envoy replaced this root (a configuration update) while work was in flight: it ends
    /// once that work is done.
    draining: bool,
}

impl Root {
    pub fn new(id: u32) -> Root {
        Root { id, vm: None, draining: false }
    }

    /// Runs a root event, then ends a draining root that has nothing left in flight.
    fn event(&mut self, f: impl FnOnce(&Vm)) {
        let Some(vm) = self.vm.clone() else { return };
        f(&vm);
        if self.draining && vm.read(|l| l.is_idle()) {
            self.draining = false;
            vm.flush_metrics();
            hostcalls::done();
        }
    }
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        self.event(|vm| {
            if let Some(call) = vm.take_call(token) {
                vm.event(None, |l| l.on_call_answer(&HostCalls, call, num_headers > 0, body_size, HostCalls.now_ms()));
            }
        });
    }

    fn on_grpc_call_response(&mut self, token: u32, status: u32, size: usize) {
        self.event(|vm| {
            if let Some(call) = vm.take_grpc_call(token) {
                vm.event(None, |l| l.on_grpc_call_answer(&HostCalls, call, status, size, HostCalls.now_ms()));
            }
        });
    }

    /// Calls in flight and unacknowledged writes would be lost with this root: it finishes
    /// them first (docs/behaviour.md §3.8).
    fn on_done(&mut self) -> bool {
        let idle = self.vm.as_ref().is_none_or(|vm| vm.read(|l| l.is_idle()));
        if let Some(vm) = &self.vm {
            vm.flush_metrics();
        }
        if !idle {
            log::info!("idempotency: root replaced; finishing the calls and writes in flight first");
            self.draining = true;
        }
        idle
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        hostcalls::sync_log_level();
        match super::configure::configure(self.id) {
            Ok(vm) => {
                let tick = Duration::from_millis(vm.read(|l| l.tick_ms()));
                self.vm = Some(Rc::new(vm));
                hostcalls::set_tick(tick);
                true
            }
            Err(e) => {
                log::error!("{e}");
                false
            }
        }
    }

    fn on_tick(&mut self) {
        self.event(|vm| {
            vm.event(None, |l| l.on_tick(HostCalls.now_ms()));
            vm.flush_metrics();
        });
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        hostcalls::take_from_queue(queue_id);
        self.event(|vm| vm.event(None, |l| l.on_wake(HostCalls.now_ms())));
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let vm = self.vm.clone()?;
        Some(Box::new(Stream::new(context_id, vm)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
