//! The proxy-wasm adapter: it translates Envoy's callbacks into calls on the core and the
//! core's answers into replies. One [`Vm`] per root context holds what the root and its HTTP
//! contexts share (they run on one thread; borrows never span a host call, because a local
//! reply can re-enter the plugin).

mod detached;
mod etcd;
mod host;
mod http;
mod root;
mod wait;

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet, VecDeque};

use crate::budget::{Budget, Reservation};
use crate::config::{Config, Policy};
use crate::engine::{Change, Completed, Finish, StoreError, Table, Ticket};
use crate::entry::StoredResponse;
use crate::fingerprint::Fingerprint;
use crate::key::StoreKey;
use crate::metrics::{Counter, Gauge};
use crate::problem::Problem;

pub use root::Root;

/// Proof of ownership of a key, in the store that holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    Table(Ticket),
    /// An etcd claim: its state lives in the VM's etcd owners, under this id.
    Etcd(u64),
}

/// A request as the root sends it upstream itself (detached forwarding).
#[derive(Clone)]
pub struct Outbound {
    pub cluster: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// A covered request whose upstream call the root must send (detached forwarding).
pub struct Job {
    pub context_id: u32,
    pub policy: usize,
    /// `None`: forwarded without a claim (etcd unavailable, `on_unavailable: "pass"`).
    pub owner: Option<Owner>,
    /// When the owner's lease was last set (the claim): see `dispatch_outbox`.
    pub leased_ms: u64,
    pub request: Outbound,
}

/// An upstream call in flight, sent by the root (detached forwarding).
pub struct Call {
    pub context_id: u32,
    pub policy: usize,
    pub owner: Option<Owner>,
    pub renewed_ms: u64,
}

/// A router-mode owner whose mark is renewed while its stream lives.
pub struct Owned {
    pub policy: usize,
    pub owner: Owner,
    pub renewed_ms: u64,
}

/// A duplicate held until the first call's outcome is known (`on_conflict: "wait"`).
pub struct Waiter {
    pub context_id: u32,
    pub policy: usize,
    pub key: StoreKey,
    pub fingerprint: Fingerprint,
    pub deadline_ms: u64,
    /// Set when the request can be sent detached, should it become the owner.
    pub outbound: Option<Outbound>,
    /// The worker's buffer budget held by the outbound body.
    pub _buffered: Option<Reservation>,
}

/// A completion or release the store did not acknowledge: retried from `on_tick` (SPEC §3.8).
pub enum PendingWrite {
    Complete { ticket: Ticket, response: Option<StoredResponse>, now_ms: u64, retention_ms: u64 },
    Release { ticket: Ticket },
}

/// What one worker VM's root shares with its HTTP contexts.
pub struct Vm {
    pub config: Config,
    pub table: Table<host::SharedData>,
    counters: Vec<(Counter, u32)>,
    gauges: Vec<(Gauge, u32)>,
    /// Bytes this worker buffers for requests in flight (`max_buffered_bytes`).
    pub buffered: Budget,
    /// The youngest age evicted by this worker since the last tick that reported it.
    pub evicted_youngest_ms: Cell<Option<u64>>,
    /// When the missing-scope warning was last logged (once a minute).
    pub scope_logged_ms: Cell<u64>,
    pub queue_id: Cell<Option<u32>>,
    /// HTTP contexts whose stream is still open (removed in `on_done`).
    pub live: RefCell<HashSet<u32>>,
    pub owners: RefCell<HashMap<u32, Owned>>,
    pub calls: RefCell<HashMap<u32, Call>>,
    pub outbox: RefCell<VecDeque<Job>>,
    pub pending: RefCell<Vec<PendingWrite>>,
    pub waiters: RefCell<Vec<Waiter>>,
    /// Router-mode waiters the root promoted to owner: their stream picks the ticket up in its
    /// response callbacks (the root cannot reach the HTTP context object).
    pub handoff: RefCell<HashMap<u32, Owner>>,
    /// Covered requests paused on headers, waiting for their first body callback, and since
    /// when. Without `allow_on_headers_stop_iteration` that callback never comes (SPEC §4).
    pub body_waits: RefCell<HashMap<u32, u64>>,
    /// Whether this VM ever got a request body callback: then the Envoy setting is on.
    pub body_seen: Cell<bool>,
    /// Renewal runs at most this often (it is tried from every request, see `root::renew`).
    pub next_renewal_ms: Cell<u64>,
    /// The etcd store's state, when the store is etcd.
    pub etcd: Option<RefCell<etcd::Etcd>>,
}

impl Vm {
    pub fn new(config: Config, table: Table<host::SharedData>) -> Vm {
        let counters = Counter::ALL.iter().filter_map(|c| host::define_counter(c.name()).map(|id| (*c, id))).collect();
        let gauges = Gauge::ALL.iter().filter_map(|g| host::define_gauge(g.name()).map(|id| (*g, id))).collect();
        let buffered = Budget::new(config.max_buffered_bytes);
        Vm {
            config,
            table,
            counters,
            gauges,
            buffered,
            evicted_youngest_ms: Cell::new(None),
            scope_logged_ms: Cell::new(0),
            queue_id: Cell::new(None),
            live: RefCell::default(),
            owners: RefCell::default(),
            calls: RefCell::default(),
            outbox: RefCell::default(),
            pending: RefCell::default(),
            waiters: RefCell::default(),
            handoff: RefCell::default(),
            body_waits: RefCell::default(),
            body_seen: Cell::new(false),
            next_renewal_ms: Cell::new(0),
            etcd: None,
        }
    }

    pub fn policy(&self, index: usize) -> &Policy {
        self.config.policy(index)
    }

    pub fn count(&self, counter: Counter) {
        self.count_n(counter, 1);
    }

    fn count_n(&self, counter: Counter, n: u32) {
        if let (Some((_, id)), true) = (self.counters.iter().find(|(c, _)| *c == counter), n > 0) {
            host::add_metric(*id, i64::from(n));
        }
    }

    fn gauge(&self, gauge: Gauge) -> Option<u32> {
        self.gauges.iter().find(|(g, _)| *g == gauge).map(|(_, id)| *id)
    }

    /// Shows what a table operation changed: gauges, evictions, expired marks.
    pub fn apply(&self, change: &Change) {
        for (gauge, delta) in [
            (Gauge::InProgress, change.in_progress),
            (Gauge::Completed, change.completed),
            (Gauge::StoredBytes, change.bytes),
        ] {
            if let (Some(id), true) = (self.gauge(gauge), delta != 0) {
                host::add_metric(id, delta);
            }
        }
        self.count_n(Counter::Evicted, change.evicted);
        self.count_n(Counter::Expired, change.expired_marks);
        if let Some(age) = change.youngest_evicted_ms {
            let youngest = self.evicted_youngest_ms.get().map_or(age, |y| y.min(age));
            self.evicted_youngest_ms.set(Some(youngest));
        }
    }

    /// Adds this worker's evictions to the process-wide window and shows the effective
    /// retention (about once a second, from the timer).
    pub fn report_retention(&self, now: u64) {
        match self.table.note_evictions(now, self.evicted_youngest_ms.get()) {
            Ok(retention_ms) => {
                self.evicted_youngest_ms.set(None);
                if let Some(id) = self.gauge(Gauge::EffectiveRetention) {
                    host::set_metric(id, retention_ms);
                }
            }
            Err(e) => log::debug!("eviction window not updated: {e:?}"),
        }
    }

    pub fn now_ms(&self) -> u64 {
        host::now_ms()
    }

    /// Wakes the root (its `on_queue_ready`) to send work queued by an HTTP context.
    pub fn kick(&self) {
        if let Some(queue) = self.queue_id.get() {
            host::enqueue(queue);
        }
    }

    /// The owner's upstream call ended without an answer, or with a status that releases.
    pub fn release(&self, owner: &Owner) {
        match owner {
            Owner::Table(ticket) => self.release_ticket(ticket),
            Owner::Etcd(id) => etcd::end(self, *id, etcd::Ending::Release),
        }
    }

    /// The upstream answered with a status that completes the key. `response` is `None` when
    /// it was larger than `max_response_bytes`.
    pub fn complete(&self, policy: usize, owner: &Owner, response: Option<StoredResponse>) {
        match owner {
            Owner::Table(ticket) => {
                let mut response = response;
                if !self.complete_ticket(policy, ticket, response.as_mut()) {
                    self.queue_completion(policy, ticket, response);
                }
            }
            Owner::Etcd(id) => etcd::end(self, *id, etcd::Ending::Complete(response)),
        }
    }

    /// Completes with `response`, then sends it to the client if it is still there. The VM
    /// holds one copy of the answer (a second only while a refused write waits to be retried).
    pub fn complete_then_answer(&self, policy: usize, owner: &Owner, mut response: StoredResponse, context_id: u32) {
        match owner {
            Owner::Table(ticket) => {
                if !self.complete_ticket(policy, ticket, Some(&mut response)) {
                    self.queue_completion(policy, ticket, Some(response.clone()));
                }
                answer_client(self, context_id, |_| send_stored(&response, false));
            }
            Owner::Etcd(id) => {
                answer_client(self, context_id, |_| send_stored(&response, false));
                etcd::end(self, *id, etcd::Ending::Complete(Some(response)));
            }
        }
    }

    fn queue_completion(&self, policy: usize, ticket: &Ticket, response: Option<StoredResponse>) {
        let retention_ms = self.policy(policy).retention_s * 1000;
        let now_ms = self.now_ms();
        self.pending.borrow_mut().push(PendingWrite::Complete { ticket: *ticket, response, now_ms, retention_ms });
    }

    fn release_ticket(&self, ticket: &Ticket) {
        match self.table.release(ticket) {
            Ok(Finish::Done) => {
                self.count(Counter::Released);
                self.apply(&Change { in_progress: -1, ..Change::default() });
            }
            Ok(Finish::Lost) => self.count(Counter::OwnerLost),
            Err(e) => {
                log::warn!("release failed ({e:?}); retrying from on_tick");
                self.count(Counter::StoreError);
                self.pending.borrow_mut().push(PendingWrite::Release { ticket: *ticket });
            }
        }
    }

    /// The first attempt at a completion; `false` when the store refused it (to be retried).
    fn complete_ticket(&self, policy: usize, ticket: &Ticket, response: Option<&mut StoredResponse>) -> bool {
        let retention_ms = self.policy(policy).retention_s * 1000;
        self.write_completion(*ticket, response, self.now_ms(), retention_ms, true)
    }

    /// One attempt at a completion; `false` when the store refused it.
    fn write_completion(
        &self,
        ticket: Ticket,
        response: Option<&mut StoredResponse>,
        now_ms: u64,
        retention_ms: u64,
        first_try: bool,
    ) -> bool {
        match self.table.complete(&ticket, response, now_ms, retention_ms) {
            Ok(Completed::Stored(change)) => {
                self.count(Counter::Completed);
                self.apply(&change);
            }
            Ok(Completed::WithoutBody(change)) => {
                self.count(Counter::Completed);
                self.count(Counter::ResponseNotStored);
                self.apply(&change);
            }
            Ok(Completed::Lost) => {
                log::info!(
                    "slot {} was taken over before its owner finished; the late result is not stored",
                    ticket.slot
                );
                self.count(Counter::OwnerLost);
            }
            Err(e) => {
                if first_try {
                    log::warn!("completion failed ({e:?}); retrying from on_tick");
                    self.count(Counter::StoreError);
                }
                return false;
            }
        }
        true
    }

    /// Retries writes the store refused; keeps those that fail again.
    pub fn retry_pending(&self) {
        let pending = std::mem::take(&mut *self.pending.borrow_mut());
        for write in pending {
            match write {
                PendingWrite::Release { ticket } => self.release_ticket(&ticket),
                PendingWrite::Complete { ticket, mut response, now_ms, retention_ms } => {
                    if !self.write_completion(ticket, response.as_mut(), now_ms, retention_ms, false) {
                        let retry = PendingWrite::Complete { ticket, response, now_ms, retention_ms };
                        self.pending.borrow_mut().push(retry);
                    }
                }
            }
        }
    }

    /// Sends a problem on the current stream.
    pub fn reply_problem(&self, problem: &Problem) {
        if let Err(status) = host::send_response(problem.status, &problem.headers(), &problem.body()) {
            log::warn!("local reply failed with status {status}");
        }
    }

    pub fn store_problem(&self, e: StoreError, retry_after_s: u64) -> Problem {
        log::warn!("store error {e:?}");
        self.count(Counter::StoreError);
        Problem::store_unavailable(retry_after_s)
    }

    /// Whether any policy holds duplicates (it wants a fast timer).
    pub fn waits(&self) -> bool {
        self.config.policies().any(|p| p.on_conflict == crate::config::OnConflict::Wait)
    }
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) and those Envoy recomputes for a local reply: never
/// stored or replayed.
pub fn is_hop_by_hop(name: &str) -> bool {
    matches!(
        name,
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "content-length"
    ) || name.starts_with(':')
}

/// Sends a stored or freshly received response on the current stream.
pub fn send_stored(response: &StoredResponse, replayed: bool) {
    let mut headers: Vec<(&str, &[u8])> = response.headers().filter(|(n, _)| !is_hop_by_hop(n)).collect();
    if replayed {
        headers.push(("idempotent-replayed", b"true"));
    }
    if let Err(status) = host::send_response(response.status(), &headers, response.body()) {
        log::warn!("local reply failed with status {status}");
    }
}

/// What a request is told, from the table's answer (SPEC §3.3–3.6).
pub enum Verdict {
    Claimed(Owner),
    /// Same fingerprint, in progress: 409, or wait.
    InProgress,
    Replay(StoredResponse),
    Problem(Problem),
}

/// Turns the table's answer into a verdict and counts it.
pub fn judge(vm: &Vm, policy: &Policy, begin: Result<crate::engine::Begin, StoreError>) -> Verdict {
    use crate::engine::Begin;
    if let Some(counter) = counter_of(&begin) {
        vm.count(counter);
    }
    match begin {
        Ok(Begin::Claimed { ticket, takeover, change }) => {
            vm.count(Counter::Claimed);
            if takeover {
                vm.count(Counter::ExpiredTakeover);
            }
            vm.apply(&change);
            Verdict::Claimed(Owner::Table(ticket))
        }
        Ok(Begin::InProgress) => Verdict::InProgress,
        Ok(Begin::Replay(response)) => Verdict::Replay(response),
        Ok(Begin::CompletedWithoutBody) => Verdict::Problem(Problem::completed_without_response()),
        Ok(Begin::Mismatch) => Verdict::Problem(Problem::fingerprint_mismatch()),
        Ok(Begin::Full) => Verdict::Problem(Problem::store_full(policy.retry_after_s)),
        Err(e) => {
            log::warn!("store error {e:?}");
            Verdict::Problem(Problem::store_unavailable(policy.retry_after_s))
        }
    }
}

/// The `:status` of a header map, 0 when absent or not a number.
pub fn status_of(headers: &[(String, Vec<u8>)]) -> u16 {
    headers
        .iter()
        .find(|(n, _)| n == ":status")
        .and_then(|(_, v)| std::str::from_utf8(v).ok()?.parse::<u16>().ok())
        .unwrap_or(0)
}

/// The counter an answer adds to (claims and in-progress are counted by their callers).
pub fn counter_of(begin: &Result<crate::engine::Begin, StoreError>) -> Option<Counter> {
    use crate::engine::Begin;
    match begin {
        Ok(Begin::Replay(_)) => Some(Counter::Replayed),
        Ok(Begin::CompletedWithoutBody) => Some(Counter::Conflict),
        Ok(Begin::Mismatch) => Some(Counter::FingerprintMismatch),
        Ok(Begin::Full) => Some(Counter::StoreFull),
        Err(_) => Some(Counter::StoreError),
        Ok(Begin::Claimed { .. } | Begin::InProgress) => None,
    }
}

pub fn describe(begin: &Result<crate::engine::Begin, StoreError>) -> String {
    use crate::engine::Begin;
    match begin {
        Ok(Begin::Claimed { ticket, takeover, .. }) => {
            format!("claimed slot {} gen {} (takeover: {takeover})", ticket.slot, ticket.gen)
        }
        Ok(Begin::InProgress) => "in progress".into(),
        Ok(Begin::Replay(r)) => format!("replay of {}", r.status()),
        Ok(Begin::CompletedWithoutBody) => "completed without stored response: 409".into(),
        Ok(Begin::Mismatch) => "fingerprint mismatch: 422".into(),
        Ok(Begin::Full) => "store full: 503".into(),
        Err(e) => format!("store error {e:?}: 503"),
    }
}

/// Answers a paused client if its stream is still open. The live set matters: after a reset,
/// Envoy keeps the stream briefly and a reply to it would re-enter a context the SDK has
/// dropped, and panic the VM (SPEC §4).
pub fn answer_client(vm: &Vm, context_id: u32, send: impl FnOnce(&Vm)) {
    if !vm.live.borrow().contains(&context_id) {
        return;
    }
    if host::set_effective_context(context_id) {
        send(vm);
    }
}
