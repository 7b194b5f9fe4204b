//! Where the request lifecycle keeps its entries, behind one interface ([`Store`]): Envoy's
//! shared data for one Envoy process ([`shared::SharedStore`], answers at once) and etcd for a
//! fleet ([`etcd::EtcdStore`], answers when etcd does). How to add a store: ARCHITECTURE.md.

pub mod decision;
pub mod etcd;
pub mod shared;
pub mod table;

use std::rc::Rc;

use crate::caller::Caller;
use crate::encoding::StoredResponse;
use crate::fingerprint::Fingerprint;
use crate::header_map::HeaderMap;
use crate::key::StoreKey;
pub use decision::{Change, StoreError};

/// Proof of a claim: only its holder completes, releases or renews the key. `fence` is the
/// claim's fencing token (docs/behaviour.md §3.9): larger for every later claim of the same key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Owner {
    pub id: u64,
    pub fence: u64,
}

/// Whom a store's answer is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum For {
    /// The request on this stream (its claim).
    Stream(u32),
    /// The holder of this claim (its renewal, completion or release).
    Owner(Owner),
}

/// What a covered request meets (docs/behaviour.md §3.2–3.4).
#[derive(Debug, Clone)]
pub enum Began {
    /// The key is ours: go upstream. `takeover` when it held this key's expired mark;
    /// `leased_ms`: when its lease started (the claim may have waited for its answer).
    Claimed {
        owner: Owner,
        takeover: bool,
        change: Change,
        leased_ms: u64,
    },
    /// Another call with the same fingerprint is in progress: 409 (or wait).
    InProgress,
    Replay(Rc<StoredResponse>),
    /// Completed, but its response was not stored: 409, not retryable.
    CompletedWithoutBody,
    /// The key was used with a different fingerprint: 422.
    Mismatch,
    /// The key's part of the store holds nothing but live marks and answers inside their
    /// replay window: 503, retry when room frees up.
    Full {
        retry_after_s: u64,
    },
    /// A new key of a caller that wrote the most of this Envoy's full share of the store:
    /// 429, retry after this many seconds.
    OverShare {
        retry_after_s: u64,
    },
    /// The store failed or holds a value the plugin cannot read: 503.
    Failed(StoreError),
    /// The store does not answer, or refuses writes for lack of space: `on_unavailable`.
    Unavailable,
}

/// How a completion ended. `response` is handed back: the lifecycle sends it on.
#[derive(Debug, Clone)]
pub enum Completed {
    Stored {
        change: Change,
        response: Option<Rc<StoredResponse>>,
    },
    /// Completed without the response (none given, or it did not fit the store).
    WithoutBody {
        change: Change,
        response: Option<Rc<StoredResponse>>,
    },
    /// The mark was taken over: nothing changed.
    Lost {
        response: Option<Rc<StoredResponse>>,
    },
}

/// A store's answer to one operation.
#[derive(Debug, Clone)]
pub enum Answer {
    Began(Began),
    /// `false`: the mark was taken over (the owner stops renewing).
    Renewed(bool),
    Completed(Completed),
    /// `done: false`: the mark was taken over; nothing changed.
    Released {
        done: bool,
        change: Change,
    },
    /// The store refused a completion or release for now; it keeps it and retries, and the
    /// final answer comes later. `response` is handed back, as with `Completed`.
    Refused {
        error: StoreError,
        response: Option<Rc<StoredResponse>>,
    },
}

/// What a covered request needs to claim its key.
#[derive(Debug, Clone)]
pub struct Claim {
    pub key: StoreKey,
    pub fingerprint: Fingerprint,
    /// Whose key it is (fair share).
    pub caller: Caller,
    /// The caller claimed keys on this worker before (`budget::Known`): the write budget
    /// judges it on its own account even when it wrote little, and a caller not established,
    /// a new identity per request, with the light ones together (docs/fleet.md).
    pub established: bool,
    pub lease_ms: u64,
}

/// A call sent from the root context: a detached request, or a store's request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallRequest {
    pub cluster: String,
    pub kind: CallKind,
    pub body: Vec<u8>,
    pub timeout_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallKind {
    /// `dispatch_http_call`: the request's headers (`:method`, `:path`, `:authority`, …).
    Http { headers: HeaderMap },
    /// `dispatch_grpc_call`: a unary gRPC call; the body is the request message, `metadata`
    /// its initial metadata (headers for Envoy's router as well as for the service).
    Grpc { service: &'static str, method: &'static str, metadata: &'static [(&'static str, &'static str)] },
}

impl CallRequest {
    /// An HTTP request's header, if it is one.
    pub fn header(&self, name: &str) -> Option<&str> {
        match &self.kind {
            CallKind::Http { headers } => headers.get(name).and_then(|v| std::str::from_utf8(v).ok()),
            CallKind::Grpc { .. } => None,
        }
    }
}

/// What came back for a call: no headers at all (`status` 0) when the connection broke. A
/// gRPC call's status and message are its `grpc-status` and `grpc-message` headers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CallAnswer {
    pub status: u16,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
}

impl CallAnswer {
    /// A gRPC call's answer: its status and text as the `grpc-status` and `grpc-message`
    /// that HTTP/2 carries them in, the response message as the body.
    pub fn grpc(status: u32, text: &[u8], message: Vec<u8>) -> CallAnswer {
        let headers =
            vec![("grpc-status".into(), status.to_string().into_bytes()), ("grpc-message".into(), text.to_vec())];
        CallAnswer { status: 200, headers, body: message }
    }
}

/// What a store did on a timer tick, for the gauges and counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TickReport {
    pub change: Change,
    /// The effective retention to show, when the store has a new figure (ms).
    pub effective_retention_ms: Option<u64>,
    /// The heaviest caller of the table, when a sweep pass has just counted it.
    pub heaviest: Option<crate::store::table::Heaviest>,
    /// etcd: what this Envoy wrote lately by its write ledger, when it changed.
    pub share_used_bytes: Option<u64>,
}

/// The store's side of the request lifecycle. Every operation answers at once (`Some`) or
/// later, through [`Store::poll_answer`]; calls the store needs sent (etcd) come out of
/// [`Store::poll_call`] and their answers go back in through [`Store::on_call_answer`].
///
/// Call order (the lifecycle's):
/// - `begin` once per claim or wait-mode poll, `For::Stream(id)`; its answer (now or later)
///   is a `Began`. A `Claimed` answer makes the caller the owner, whether or not its stream
///   is still there: the owner then ends it with `complete` or `release`, or gives it up with
///   `forget` (outcome unknown: the mark expires). A claim whose stream has gone is released.
/// - `renew` while the owner's call lives; its later answer is `Renewed`, or, when the mark
///   was taken over while an ending waited behind the renewal, that ending's own answer.
/// - `complete` / `release` once per owner; answered `Completed` / `Released`, or `Refused`
///   first (the store retries; the final answer follows).
/// - `tick` on the root's timer; `poll_call`, `poll_answer`, `poll_count` drained after every
///   operation and every `on_call_answer` / `on_call_failed` (one per call sent).
pub trait Store {
    fn begin(&mut self, who: For, claim: &Claim, now_ms: u64) -> Option<Answer>;
    fn renew(&mut self, owner: Owner, lease_ms: u64, now_ms: u64) -> Option<Answer>;
    fn complete(
        &mut self,
        owner: Owner,
        response: Option<Rc<StoredResponse>>,
        retention_ms: u64,
        now_ms: u64,
    ) -> Option<Answer>;
    fn release(&mut self, owner: Owner, now_ms: u64) -> Option<Answer>;
    /// The owner's outcome is unknown (its client left in router mode): stop tracking it;
    /// its mark expires.
    fn forget(&mut self, owner: Owner);
    /// Sweeps, retries, leases: what the timer drives.
    fn tick(&mut self, now_ms: u64) -> TickReport;
    fn poll_answer(&mut self) -> Option<(For, Answer)>;
    fn poll_call(&mut self) -> Option<(u64, CallRequest)>;
    /// Events only the store sees, to count (etcd out of space).
    fn poll_count(&mut self) -> Option<crate::metrics::Counter>;
    fn on_call_answer(&mut self, call: u64, answer: &CallAnswer, now_ms: u64);
    /// A call could not be sent at all (no healthy host, unknown cluster).
    fn on_call_failed(&mut self, call: u64, now_ms: u64);
    /// How often a held request (wait mode) asks again, at least.
    fn wait_poll_ms(&self) -> u64;
    /// Whether every operation answers at once (shared data): then the lifecycle renews from
    /// stream events too.
    fn answers_at_once(&self) -> bool;
    /// How long an answer's end waits for its completion to be acknowledged, at most.
    fn write_wait_ms(&self) -> u64;
    /// Nothing in flight and nothing to retry: a root may end (a configuration update).
    fn is_idle(&self) -> bool;
    /// What keeps it from being idle, by kind (tests: the simulator's report).
    #[cfg(test)]
    fn busy(&self) -> Vec<(&'static str, usize)> {
        Vec::new()
    }
}

/// A store chosen at configuration time (shared data or etcd) is a boxed one.
impl<T: Store + ?Sized> Store for Box<T> {
    fn begin(&mut self, who: For, claim: &Claim, now_ms: u64) -> Option<Answer> {
        (**self).begin(who, claim, now_ms)
    }
    fn renew(&mut self, owner: Owner, lease_ms: u64, now_ms: u64) -> Option<Answer> {
        (**self).renew(owner, lease_ms, now_ms)
    }
    fn complete(
        &mut self,
        owner: Owner,
        response: Option<Rc<StoredResponse>>,
        retention_ms: u64,
        now_ms: u64,
    ) -> Option<Answer> {
        (**self).complete(owner, response, retention_ms, now_ms)
    }
    fn release(&mut self, owner: Owner, now_ms: u64) -> Option<Answer> {
        (**self).release(owner, now_ms)
    }
    fn forget(&mut self, owner: Owner) {
        (**self).forget(owner)
    }
    fn tick(&mut self, now_ms: u64) -> TickReport {
        (**self).tick(now_ms)
    }
    fn poll_answer(&mut self) -> Option<(For, Answer)> {
        (**self).poll_answer()
    }
    fn poll_call(&mut self) -> Option<(u64, CallRequest)> {
        (**self).poll_call()
    }
    fn poll_count(&mut self) -> Option<crate::metrics::Counter> {
        (**self).poll_count()
    }
    fn on_call_answer(&mut self, call: u64, answer: &CallAnswer, now_ms: u64) {
        (**self).on_call_answer(call, answer, now_ms)
    }
    fn on_call_failed(&mut self, call: u64, now_ms: u64) {
        (**self).on_call_failed(call, now_ms)
    }
    fn wait_poll_ms(&self) -> u64 {
        (**self).wait_poll_ms()
    }
    fn answers_at_once(&self) -> bool {
        (**self).answers_at_once()
    }
    fn write_wait_ms(&self) -> u64 {
        (**self).write_wait_ms()
    }
    fn is_idle(&self) -> bool {
        (**self).is_idle()
    }
    #[cfg(test)]
    fn busy(&self) -> Vec<(&'static str, usize)> {
        (**self).busy()
    }
}
