//! The root's events: the timer (renewal, held requests, the body-delivery check, the store's
//! own work), the shared queue (calls to send), and the answers to calls.

use super::budget::Group;
use super::problem::Problem;
use super::{CallId, Effect, Lifecycle, Phase};
use crate::host::Host;
use crate::store::{CallAnswer, Store};

/// How long a covered request may wait for its first body callback before we conclude that
/// Envoy will never deliver bodies to this filter (docs/behaviour.md §4).
const BODY_WAIT_MS: u64 = 3_000;

impl<S: Store> Lifecycle<S> {
    pub fn on_tick(&mut self, now: u64) {
        self.check_body_delivery(now);
        crate::digest::forget_idle(now);
        self.expire_ends(now);
        self.poll_waiters(now);
        self.renew_due(now, true);
        let report = self.store.tick(now);
        self.apply(&report.change);
        if let Some(value) = report.effective_retention_ms {
            self.effects.push(Effect::SetGauge { gauge: crate::metrics::Gauge::EffectiveRetention, value });
        }
        if let Some(value) = report.share_used_bytes {
            self.effects.push(Effect::SetGauge { gauge: crate::metrics::Gauge::WriteBudgetUsed, value });
        }
        if let Some(h) = report.heaviest {
            use crate::metrics::Gauge::{HeaviestCallerBytes, HeaviestCallerEntries};
            self.effects.push(Effect::SetGauge { gauge: HeaviestCallerEntries, value: h.entries_permille });
            self.effects.push(Effect::SetGauge { gauge: HeaviestCallerBytes, value: h.bytes_permille });
        }
        self.flush(now);
    }

    /// The shared queue woke the root: send what streams queued.
    pub fn on_wake(&mut self, now: u64) {
        self.flush(now);
    }

    /// An HTTP call's answer (in the root's event): headers and body are read from the host.
    pub fn on_call_answer(&mut self, host: &dyn Host, call: CallId, has_headers: bool, body_size: usize, now: u64) {
        let mut headers = if has_headers { host.call_headers() } else { Vec::new() };
        if let CallId::Upstream(id) = call {
            if self.detached_call(id).is_some_and(|c| c.grpc) {
                let trailers = host.call_trailers().into_iter();
                headers.extend(trailers.map(|(n, v)| (format!("{}{n}", super::grpc_reply::TRAILER), v)));
            }
        }
        let status = super::forward::status_of(&headers);
        // A detached answer is copied into the VM only within its caller's share of the
        // worker's buffer: every byte the VM holds is bounded (docs/behaviour.md §3.8).
        let mut held = None;
        if let CallId::Upstream(id) = call {
            let group = self.detached_call(id).map_or(Group::UNKNOWN, |c| self.known.group(c.caller));
            match self.buffered.reserve(group, body_size) {
                Some(r) => held = Some(r),
                None => {
                    self.upstream_too_large(id, status, now);
                    return self.flush(now);
                }
            }
        }
        let answer = CallAnswer { status, headers, body: host.call_body(body_size) };
        match call {
            CallId::Upstream(id) => self.on_upstream_answer(id, answer, held, now),
            CallId::Store(n) => self.store.on_call_answer(n, &answer, now),
        }
        self.flush(now);
    }

    /// A gRPC call's answer (a store's: etcd), in the root's event.
    pub fn on_grpc_call_answer(&mut self, host: &dyn Host, call: CallId, status: u32, size: usize, now: u64) {
        let text = if status == 0 { Vec::new() } else { host.grpc_status_text() };
        let answer = CallAnswer::grpc(status, &text, host.grpc_message(size));
        match call {
            CallId::Store(n) => self.store.on_call_answer(n, &answer, now),
            CallId::Upstream(id) => self.on_upstream_answer(id, answer, None, now), // not sent as gRPC
        }
        self.flush(now);
    }

    /// A call could not be sent at all (`dispatch_http_call` failed).
    pub fn on_call_failed(&mut self, call: CallId, now: u64) {
        match call {
            CallId::Upstream(id) => self.upstream_not_sent(id, now),
            CallId::Store(n) => self.store.on_call_failed(n, now),
        }
        self.flush(now);
    }

    /// In the root's event: send the calls streams queued and the store's, and take in the
    /// store's answers, until nothing is left.
    fn flush(&mut self, now: u64) {
        self.wake_sent = false;
        loop {
            if let Some(id) = self.outbox.pop_front() {
                self.dispatch_upstream(id, now);
            } else if let Some((n, request)) = self.store_calls.pop_front().or_else(|| self.store.poll_call()) {
                self.effects.push(Effect::Dispatch { call: CallId::Store(n), request });
            } else if let Some((who, answer)) = self.store.poll_answer() {
                self.on_store_answer(who, answer, now);
            } else if let Some(counter) = self.store.poll_count() {
                self.count(counter);
            } else {
                return;
            }
        }
    }

    /// Renews the marks of live owners: router streams still open and detached calls in
    /// flight. From the timer, and from request callbacks too when the store answers at once:
    /// a worker busy enough to delay its timer by hundreds of milliseconds is busy with
    /// requests, and those renew the marks on time.
    pub(super) fn renew_due(&mut self, now: u64, from_root: bool) {
        if crate::defects::planted(crate::defects::Defect::RenewalSkipped) {
            return;
        }
        if (!from_root && !self.store.answers_at_once()) || now < self.next_renewal_ms {
            return;
        }
        let min_lease = self.config.policies().map(|p| p.lease_ms).min().unwrap_or(10_000);
        self.next_renewal_ms = now + (min_lease / 16).max(10);
        let config = self.config.clone();
        let lease_of = |w: &super::work::Work| config.policy(w.policy).lease_ms;
        let due: Vec<_> = self
            .work
            .values_mut()
            .filter(|w| w.renewed_ms.is_some_and(|at| now.saturating_sub(at) >= lease_of(w) / 4))
            .filter_map(|w| {
                w.renewed_ms = Some(now);
                Some((w.owner?, lease_of(w)))
            })
            .collect();
        for (owner, lease_ms) in due {
            if let Some(answer) = self.store.renew(owner, lease_ms, now) {
                self.on_owner_answer(owner, answer);
            }
        }
    }

    /// Without `allow_on_headers_stop_iteration: true`, pausing on headers stops body
    /// callbacks too, and the request would hang. Until this VM has seen one body callback,
    /// answer requests that waited too long with a 500 that names the setting, and log it.
    fn check_body_delivery(&mut self, now: u64) {
        if self.body_seen {
            return;
        }
        let stuck: Vec<u32> = self
            .streams
            .iter()
            .filter(|(_, s)| matches!(s.phase, Phase::ReadingBody { since_ms, .. } if now.saturating_sub(since_ms) >= BODY_WAIT_MS))
            .map(|(id, _)| *id)
            .collect();
        for id in stuck {
            log::error!(
                "no request body reached the plugin within {BODY_WAIT_MS} ms: set allow_on_headers_stop_iteration: true in the Wasm filter's config"
            );
            if self.config.observe {
                self.observed(id, "misconfigured");
                self.effects.push(super::Effect::Resume { stream: id });
                continue;
            }
            self.problem(id, Problem::body_unavailable());
        }
    }
}
