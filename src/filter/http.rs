//! One HTTP stream: reads the key and the body, asks the table, then replies itself, lets the
//! request go upstream through the router, or hands it to the root (detached forwarding).

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;
use std::rc::Rc;

use super::{host, send_stored, Job, Owned, Vm};
use crate::config::Forward;
use crate::engine::{Begin, Held};
use crate::entry::{State, StoredResponse};
use crate::fingerprint::FingerprintBuilder;
use crate::key::{parse_key, StoreKey};
use crate::metrics::Counter;
use crate::problem::Problem;

pub struct Stream {
    id: u32,
    vm: Rc<Vm>,
    phase: Phase,
}

enum Phase {
    /// Not ours (not covered), or nothing left to do.
    Pass,
    /// Covered: waiting for the whole body before the claim.
    ReadingBody(Box<Pending>),
    /// Router forwarding: we own the key and watch the upstream's answer.
    Owner { ticket: crate::engine::Ticket, capture: Option<Capture> },
    /// Detached forwarding: the root sends the request and answers us.
    Detached,
    /// We answered locally; our own reply passes through our response callbacks.
    Replied,
}

struct Pending {
    key: StoreKey,
    fingerprint: FingerprintBuilder,
    /// The request as the root will send it, when it can be detached.
    detached: Option<(String, Vec<(String, String)>)>,
}

/// The upstream's answer as it streams past, kept for the stored response.
struct Capture {
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
    too_large: bool,
}

impl Stream {
    pub fn new(id: u32, vm: Rc<Vm>) -> Stream {
        Stream { id, vm, phase: Phase::Pass }
    }

    fn reply(&mut self, problem: &Problem) -> Action {
        self.phase = Phase::Replied;
        self.vm.reply_problem(problem);
        Action::Pause
    }

    /// Request headers: is the request covered, is its key valid; remember what the claim
    /// needs. The claim itself waits for the body (it is part of the fingerprint).
    fn on_headers(&mut self, end_of_stream: bool) -> Action {
        let cfg = &self.vm.config;
        let method = host::request_header(":method").unwrap_or_default();
        if !cfg.methods.iter().any(|m| m.as_bytes() == method.as_slice()) {
            return Action::Continue;
        }
        let headers = host::request_headers();
        let mut keys = headers.iter().filter(|(n, _)| *n == cfg.key_header);
        let raw_key = match (keys.next(), keys.next()) {
            (None, _) if cfg.require_key => {
                self.vm.count(Counter::MissingKey);
                return self.reply(&Problem::missing_key(&cfg.key_header));
            }
            (None, _) => return Action::Continue,
            (Some(_), Some(_)) => {
                self.vm.count(Counter::InvalidKey);
                return self.reply(&Problem::duplicate_key_header(&cfg.key_header));
            }
            (Some((_, v)), None) => v,
        };
        let client_key = match parse_key(raw_key, cfg.max_key_length) {
            Ok(k) => k,
            Err(e) => {
                self.vm.count(Counter::InvalidKey);
                return self.reply(&Problem::invalid_key(e.detail(cfg.max_key_length)));
            }
        };
        let value_of = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_slice());
        let all_values = |name: &str| -> Option<Vec<u8>> {
            let mut values = headers.iter().filter(|(n, _)| n == name).map(|(_, v)| v.as_slice()).peekable();
            values.peek()?;
            Some(values.collect::<Vec<_>>().join(&0u8))
        };
        let scopes: Vec<Option<Vec<u8>>> = cfg.scope_headers.iter().map(|h| all_values(h)).collect();
        let scope_refs: Vec<Option<&[u8]>> = scopes.iter().map(|s| s.as_deref()).collect();
        let key = StoreKey::derive(&cfg.namespace, value_of(":authority").unwrap_or_default(), &scope_refs, &client_key);
        let mut fingerprint = FingerprintBuilder::new(&method, value_of(":path").unwrap_or_default());
        for name in &cfg.fingerprint_headers {
            fingerprint.header(name, headers.iter().filter(|(n, _)| n == name).map(|(_, v)| v.as_slice()));
        }
        let detached = if cfg.forward == Forward::Detached { detachable(&headers) } else { None };
        self.vm.live.borrow_mut().insert(self.id);
        self.phase = Phase::ReadingBody(Box::new(Pending { key, fingerprint, detached }));
        if end_of_stream {
            self.claim(Vec::new())
        } else {
            Action::Pause
        }
    }

    /// The whole request is here: claim the key or learn what holds it (SPEC §3.2–3.4).
    fn claim(&mut self, body: Vec<u8>) -> Action {
        let Phase::ReadingBody(pending) = std::mem::replace(&mut self.phase, Phase::Pass) else {
            return Action::Continue;
        };
        let Pending { key, mut fingerprint, detached } = *pending;
        let vm = self.vm.clone();
        let cfg = &vm.config;
        if cfg.fingerprint_body {
            fingerprint.body(&body);
        }
        let now = vm.now_ms();
        let begin = vm.table.begin(&key, &fingerprint.finish(), now, cfg.lease_ms);
        log::debug!("key {} -> {}", key.short(), describe(&begin));
        match begin {
            Ok(Begin::Claimed { ticket, takeover, evicted }) => {
                vm.count(Counter::Claimed);
                if takeover {
                    vm.count(Counter::ExpiredTakeover);
                }
                vm.held(Held::of(State::InProgress, 1).plus(Held::of(evicted, -1)));
                match (detached, vm.queue_id.get()) {
                    (Some((cluster, headers)), Some(queue)) => {
                        vm.outbox.borrow_mut().push_back(Job { context_id: self.id, ticket, cluster, headers, body });
                        if !host::enqueue(queue) {
                            log::warn!("enqueue failed; the job waits for the next queue event");
                        }
                        self.phase = Phase::Detached;
                        Action::Pause
                    }
                    _ => {
                        vm.owners.borrow_mut().insert(self.id, Owned { ticket, renewed_ms: now });
                        self.phase = Phase::Owner { ticket, capture: None };
                        Action::Continue
                    }
                }
            }
            Ok(Begin::InProgress) => {
                vm.count(Counter::Conflict);
                self.reply(&Problem::in_progress(cfg.retry_after_s))
            }
            Ok(Begin::Replay(response)) => {
                vm.count(Counter::Replayed);
                self.phase = Phase::Replied;
                send_stored(&response, true);
                Action::Pause
            }
            Ok(Begin::CompletedWithoutBody) => {
                vm.count(Counter::Conflict);
                self.reply(&Problem::completed_without_response())
            }
            Ok(Begin::Mismatch) => {
                vm.count(Counter::FingerprintMismatch);
                self.reply(&Problem::fingerprint_mismatch())
            }
            Ok(Begin::Full) => {
                vm.count(Counter::StoreFull);
                self.reply(&Problem::store_full(cfg.retry_after_s))
            }
            Err(e) => {
                let p = vm.store_problem(e);
                self.reply(&p)
            }
        }
    }

    /// Router forwarding: the upstream's answer (or Envoy's stand-in for it) arrives.
    fn on_owner_response_headers(&mut self, end_of_stream: bool) {
        let Phase::Owner { ticket, capture: None } = self.phase else { return };
        let vm = self.vm.clone();
        let headers = host::response_headers();
        let status = headers
            .iter()
            .find(|(n, _)| n == ":status")
            .and_then(|(_, v)| std::str::from_utf8(v).ok()?.parse::<u16>().ok())
            .unwrap_or(0);
        // Only an answer the upstream really gave completes the key; Envoy's own (connect
        // failure, reset, route timeout) says the work may not have happened (SPEC §4).
        let via_upstream = host::property(&["response", "code_details"]).as_deref() == Some(b"via_upstream");
        if !via_upstream || vm.config.release_statuses.contains(status) {
            if !via_upstream {
                vm.count(Counter::UpstreamFailed);
            }
            vm.owners.borrow_mut().remove(&self.id);
            vm.release(&ticket);
            self.phase = Phase::Pass;
            return;
        }
        let headers = headers.into_iter().filter(|(n, _)| !super::is_hop_by_hop(n)).collect();
        self.phase = Phase::Owner { ticket, capture: Some(Capture { status, headers, body: Vec::new(), too_large: false }) };
        if end_of_stream {
            self.finish_capture();
        }
    }

    fn on_owner_response_body(&mut self, size: usize, end_of_stream: bool) {
        let max = self.vm.config.max_response_bytes;
        if let Phase::Owner { capture: Some(c), .. } = &mut self.phase {
            if !c.too_large {
                // With Action::Continue each callback sees the current chunk: copy it as it
                // passes, so storing never delays or buffers the response.
                let chunk = host::response_body_chunk(size);
                if c.body.len() + chunk.len() > max {
                    c.too_large = true;
                    c.body = Vec::new();
                } else {
                    c.body.extend_from_slice(&chunk);
                }
            }
        } else {
            return;
        }
        if end_of_stream {
            self.finish_capture();
        }
    }

    fn finish_capture(&mut self) {
        let Phase::Owner { ticket, capture: Some(c) } = std::mem::replace(&mut self.phase, Phase::Pass) else { return };
        self.vm.owners.borrow_mut().remove(&self.id);
        let response = (!c.too_large).then_some(StoredResponse { status: c.status, headers: c.headers, body: c.body });
        self.vm.complete(&ticket, response);
    }
}

/// The request's cluster and headers, if the root can send it: the route names a cluster and
/// every header value is UTF-8 (`dispatch_http_call` takes `&str`). Otherwise the router sends
/// it, so nothing is altered.
fn detachable(headers: &[(String, Vec<u8>)]) -> Option<(String, Vec<(String, String)>)> {
    let cluster = String::from_utf8(host::property(&["xds", "cluster_name"])?).ok()?;
    if cluster.is_empty() {
        return None;
    }
    let headers = headers
        .iter()
        .map(|(n, v)| Some((n.clone(), String::from_utf8(v.clone()).ok()?)))
        .collect::<Option<Vec<_>>>()?;
    Some((cluster, headers))
}

fn describe(begin: &Result<Begin, crate::engine::StoreError>) -> String {
    match begin {
        Ok(Begin::Claimed { ticket, takeover, .. }) => format!("claimed slot {} gen {} (takeover: {takeover})", ticket.slot, ticket.gen),
        Ok(Begin::InProgress) => "in progress: 409".into(),
        Ok(Begin::Replay(r)) => format!("replay of {}", r.status),
        Ok(Begin::CompletedWithoutBody) => "completed without stored response: 409".into(),
        Ok(Begin::Mismatch) => "fingerprint mismatch: 422".into(),
        Ok(Begin::Full) => "store full: 503".into(),
        Err(e) => format!("store error {e:?}: 503"),
    }
}

impl Context for Stream {
    fn on_done(&mut self) -> bool {
        // A router owner whose client left before the answer: the outcome is unknown, so its
        // mark is no longer renewed and expires (SPEC §3.5). A detached call goes on.
        self.vm.live.borrow_mut().remove(&self.id);
        self.vm.owners.borrow_mut().remove(&self.id);
        true
    }
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.on_headers(end_of_stream)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !matches!(self.phase, Phase::ReadingBody(_)) {
            return Action::Continue;
        }
        let max = self.vm.config.max_request_body_bytes;
        if body_size > max {
            self.vm.live.borrow_mut().remove(&self.id);
            self.vm.count(Counter::TooLarge);
            return self.reply(&Problem::body_too_large(max));
        }
        if !end_of_stream {
            return Action::Pause; // Envoy buffers the body until the end
        }
        self.claim(host::request_body(body_size))
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if !matches!(self.phase, Phase::ReadingBody(_)) {
            return Action::Continue;
        }
        self.claim(host::request_body(self.vm.config.max_request_body_bytes))
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.on_owner_response_headers(end_of_stream);
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.on_owner_response_body(body_size, end_of_stream);
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        self.finish_capture();
        Action::Continue
    }
}
