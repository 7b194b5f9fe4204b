//! One HTTP stream's callbacks, translated into lifecycle events.

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;
use std::rc::Rc;

use super::hostcalls::HostCalls;
use super::vm::Vm;
use crate::host::Flow;

pub struct Stream {
    id: u32,
    vm: Rc<Vm>,
}

impl Stream {
    pub fn new(id: u32, vm: Rc<Vm>) -> Stream {
        Stream { id, vm }
    }
}

fn action(flow: Flow) -> Action {
    match flow {
        Flow::Continue => Action::Continue,
        Flow::Pause => Action::Pause,
    }
}

impl Context for Stream {
    fn on_done(&mut self) -> bool {
        let id = self.id;
        if self.vm.read(|l| l.tracks(id)) {
            self.vm.event(Some(id), |l| l.on_stream_done(id));
        }
        true
    }
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let id = self.id;
        action(self.vm.event(Some(id), |l| l.on_request_headers(&HostCalls, id, end_of_stream)))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let id = self.id;
        action(self.vm.event(Some(id), |l| l.on_request_body(&HostCalls, id, body_size, end_of_stream)))
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        let id = self.id;
        action(self.vm.event(Some(id), |l| l.on_request_trailers(&HostCalls, id)))
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let id = self.id;
        if !self.vm.read(|l| l.watches_response(id)) {
            return Action::Continue;
        }
        action(self.vm.event(Some(id), |l| l.on_response_headers(&HostCalls, id, end_of_stream)))
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let id = self.id;
        if !self.vm.read(|l| l.watches_response(id)) {
            return Action::Continue;
        }
        action(self.vm.event(Some(id), |l| l.on_response_body(&HostCalls, id, body_size, end_of_stream)))
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        let id = self.id;
        if !self.vm.read(|l| l.watches_response(id)) {
            return Action::Continue;
        }
        action(self.vm.event(Some(id), |l| l.on_response_trailers(&HostCalls, id)))
    }
}
