//! Control filters for the benchmark (bench/bench.py): what any proxy-wasm filter costs
//! Envoy, whatever it does. Envoy's native paths (no filter, direct_response) are not
//! reachable by a Wasm filter: the VM call per callback, the header map copied into the VM,
//! a local reply built through the ABI. These controls measure that floor in the same run
//! as the plugin, so the plugin's ratios can be read against it.
//!
//! The root configuration (a plain string) picks the behaviour:
//! - "noop": every callback returns Continue and calls nothing (case W0, against A GET and B1);
//! - "headers": reads the request header map (as the plugin does), then Continue;
//! - "local": waits for the whole request, reads its headers and body, and answers 201 with
//!   the upstream's JSON body itself (case W2, against C, B3 and B4).
use proxy_wasm::traits::*;
use proxy_wasm::types::*;

const BODY: &[u8] = br#"{"id":"pay_1","status":"created"}"#;

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root { mode: Mode::Noop }) });
}}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Noop,
    Headers,
    Local,
}

struct Root {
    mode: Mode,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _: usize) -> bool {
        self.mode = match self.get_plugin_configuration().unwrap_or_default().as_slice() {
            b"headers" => Mode::Headers,
            b"local" => Mode::Local,
            _ => Mode::Noop,
        };
        true
    }

    fn create_http_context(&self, _: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream { mode: self.mode }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Stream {
    mode: Mode,
}

impl Stream {
    fn answer(&self) {
        self.send_http_response(201, vec![("content-type", "application/json")], Some(BODY));
    }
}

impl Context for Stream {}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _: usize, end_of_stream: bool) -> Action {
        if self.mode == Mode::Noop {
            return Action::Continue;
        }
        std::hint::black_box(self.get_http_request_headers_bytes());
        if self.mode == Mode::Headers {
            return Action::Continue;
        }
        if end_of_stream {
            self.answer();
        }
        // Needs allow_on_headers_stop_iteration (as the plugin) to still get the body.
        Action::Pause
    }

    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        if self.mode != Mode::Local {
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        std::hint::black_box(self.get_http_request_body(0, size));
        self.answer();
        Action::Pause
    }
}
