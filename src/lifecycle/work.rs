//! One record per piece of work this VM forwards, from its claim (or its pass without one) to
//! its end: the claim it renews, the detached call the root sends, the answer held for the
//! store's acknowledgement (docs/behaviour.md §3.4). One map, one key: the store's answers
//! name the owner, the upstream's name the call, and both are the same [`WorkId`].

use std::rc::Rc;

use super::budget::Reservation;
use super::request::Outbound;
use super::Lifecycle;
use crate::caller::Caller;
use crate::encoding::StoredResponse;
use crate::store::{Owner, Store};

/// A piece of work's key: its claim's owner id, or, for a detached call passed on without a
/// claim (`on_unavailable: "pass"`), a number of the lifecycle's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WorkId {
    Owner(u64),
    Pass(u64),
}

pub(super) struct Work {
    pub stream: u32,
    pub policy: usize,
    /// `None`: passed on without a claim.
    pub owner: Option<Owner>,
    /// When its mark was last set, while it is renewed: from the claim until its completion,
    /// its release, or the store's word that the mark was lost.
    pub renewed_ms: Option<u64>,
    /// Detached forwarding: the call the root sends (`None`: the router forwards).
    pub call: Option<DetachedCall>,
    /// The answer's end, held until the store acknowledges the completion.
    pub end: Option<HeldEnd>,
}

/// A detached call: waiting for the root, then in flight until its answer.
pub(super) struct DetachedCall {
    /// A gRPC call: its status is in the answer's trailers.
    pub grpc: bool,
    /// Whose call it is: its answer is held within that caller's share of the buffer.
    pub caller: Caller,
    /// The request, until the root sends it.
    pub outgoing: Option<Outbound>,
}

/// The end of an answer held for its completion.
pub(super) struct HeldEnd {
    pub since_ms: u64,
    /// Detached: the answer to send (`None`: router forwarding, the response is paused).
    pub reply: Option<Rc<StoredResponse>>,
    /// Router forwarding: the response callback has returned `Pause`. Until then, a store
    /// that answers at once (an owner known lost) lets the callback return `Continue`: a
    /// resume from inside the stream's own callback would continue it twice (Envoy crashes).
    pub paused: bool,
    /// The buffer budget the answer holds while it waits.
    pub _buffered: Option<Reservation>,
}

impl Work {
    /// Nothing of it is left to do.
    fn is_over(&self) -> bool {
        self.renewed_ms.is_none() && self.call.is_none() && self.end.is_none()
    }
}

impl<S: Store> Lifecycle<S> {
    /// A record that holds nothing more goes.
    pub(super) fn settle(&mut self, id: WorkId) {
        if self.work.get(&id).is_some_and(Work::is_over) {
            self.work.remove(&id);
        }
    }

    /// The detached call of a piece of work, if it has one in flight or queued.
    pub(super) fn detached_call(&self, id: WorkId) -> Option<&DetachedCall> {
        self.work.get(&id).and_then(|w| w.call.as_ref())
    }

    /// The owner's mark is no longer renewed (completed, released, or lost).
    pub(super) fn stop_renewing(&mut self, owner: Owner) {
        let id = WorkId::Owner(owner.id);
        if let Some(work) = self.work.get_mut(&id) {
            work.renewed_ms = None;
        }
        self.settle(id);
    }
}
