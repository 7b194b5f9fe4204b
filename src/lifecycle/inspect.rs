//! What the simulator reads of a lifecycle between events (tests only): each stream's phase,
//! the streams that hold work, and what is left in flight when traffic has stopped.

use super::{Lifecycle, Phase};
use crate::store::{Owner, Store};

/// A stream's phase, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PhaseName {
    Pass,
    ReadingBody,
    Claiming,
    Waiting,
    /// Router forwarding, as the key's owner.
    Owner,
    /// Router forwarding without a claim (`on_unavailable: "pass"`).
    Unclaimed,
    Detached,
    Replied,
    GrpcReplay,
}

impl<S: Store> Lifecycle<S> {
    pub fn phase_name(&self, id: u32) -> Option<PhaseName> {
        Some(match &self.streams.get(&id)?.phase {
            Phase::Pass => PhaseName::Pass,
            Phase::ReadingBody { .. } => PhaseName::ReadingBody,
            Phase::Claiming(_) => PhaseName::Claiming,
            Phase::Waiting(_) => PhaseName::Waiting,
            Phase::Owner { owner: Some(_), .. } => PhaseName::Owner,
            Phase::Owner { owner: None, .. } => PhaseName::Unclaimed,
            Phase::Detached => PhaseName::Detached,
            Phase::Replied => PhaseName::Replied,
            Phase::GrpcReplay { .. } => PhaseName::GrpcReplay,
        })
    }

    /// The owner a detached call (`CallId::Upstream(n)`) was sent for (`Some(None)`: sent
    /// without a claim).
    pub fn call_owner(&self, n: u64) -> Option<Option<Owner>> {
        self.calls.get(&n).map(|c| c.owner)
    }

    /// The streams whose key this VM holds or is claiming: a claim on its way, an owner
    /// upstream (router or detached, queued or sent), an answer held for its completion.
    pub fn work_streams(&self) -> Vec<u32> {
        let phases = self.streams.iter().filter(|(_, s)| {
            matches!(s.phase, Phase::Claiming(_) | Phase::Owner { owner: Some(_), .. } | Phase::Detached)
        });
        let mut ids: Vec<u32> = phases.map(|(id, _)| *id).collect();
        ids.extend(self.calls.values().filter(|c| c.owner.is_some()).map(|c| c.stream));
        ids.extend(self.outbox.iter().filter(|o| o.owner.is_some()).map(|o| o.stream));
        ids.extend(self.ends.values().map(|e| e.stream));
        ids
    }

    /// What this VM still holds, by kind (empty when it is back at its baseline).
    pub fn residue(&self) -> Vec<(&'static str, usize)> {
        let all = [
            ("streams", self.streams.len()),
            ("calls", self.calls.len()),
            ("outbox", self.outbox.len()),
            ("store_calls", self.store_calls.len()),
            ("holdings", self.holdings.len()),
            ("ends", self.ends.len()),
            ("waiting", self.waiting),
            ("asking", self.asking.len()),
            ("buffered_bytes", self.buffered.used()),
        ];
        let mut residue: Vec<_> = all.into_iter().filter(|(_, n)| *n > 0).collect();
        residue.extend(self.store.busy());
        if residue.is_empty() && !self.store.is_idle() {
            residue.push(("store_busy", 1));
        }
        residue
    }
}
