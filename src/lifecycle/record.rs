//! What the plugin decided for a covered request, handed to Envoy once per request as filter
//! state (`wasm.idempotency`), for access logs and traces (docs/operations.md, "Decisions in
//! the access log"). One host call: the fields go in one value.

use std::fmt::Write;

use super::{Effect, Lifecycle};
use crate::key::StoreKey;
use crate::store::Store;

/// What a stream's record says besides its decision, gathered as the request goes.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Note {
    pub key: Option<StoreKey>,
    /// When its claim went to the store, and how long the store took to answer.
    pub asked_ms: u64,
    pub store_ms: Option<u64>,
    /// The claim's fencing token, when `fencing_header` sends it upstream.
    pub fence: Option<u64>,
    /// How the first call ended when the root answers it (detached): `claimed` (its answer
    /// is stored) unless told otherwise.
    pub outcome: Option<&'static str>,
    pub recorded: bool,
}

/// The record's text: `decision=<d> key=<12 hex> store=<shared|etcd> store_ms=<n> fence=<n>`,
/// the fields after `decision` only when known.
pub fn text(decision: &str, note: &Note, store: &str) -> String {
    let mut out = String::with_capacity(80);
    let _ = write!(out, "decision={decision}");
    if let Some(key) = &note.key {
        let _ = write!(out, " key={} store={store}", key.short());
    }
    if let Some(ms) = note.store_ms {
        let _ = write!(out, " store_ms={ms}");
    }
    if let Some(fence) = note.fence {
        let _ = write!(out, " fence={fence}");
    }
    out
}

impl<S: Store> Lifecycle<S> {
    /// Records `decision` for stream `id`, once: the first decision that reaches the client
    /// is the one it got.
    pub(super) fn record(&mut self, id: u32, decision: &str) {
        let store = if self.store.answers_at_once() { "shared" } else { "etcd" };
        let note = match self.streams.get_mut(&id) {
            Some(stream) if stream.note.recorded => return,
            Some(stream) => {
                stream.note.recorded = true;
                stream.note
            }
            None => Note::default(),
        };
        self.effects.push(Effect::Record { stream: id, text: text(decision, &note, store) });
    }

    pub(super) fn note_mut(&mut self, id: u32) -> Option<&mut Note> {
        self.streams.get_mut(&id).map(|s| &mut s.note)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_carries_what_is_known() {
        assert_eq!(text("missing-key", &Note::default(), "shared"), "decision=missing-key");
        let key = StoreKey::derive("idem", b"localhost", &[Some(b"Bearer e2e-caller")], b"vector-key");
        let note = Note { key: Some(key), store_ms: Some(3), fence: Some(42), ..Note::default() };
        assert_eq!(text("claimed", &note, "etcd"), "decision=claimed key=2cf6ad973cc0 store=etcd store_ms=3 fence=42");
    }
}
