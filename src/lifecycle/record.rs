//! What the plugin decided for a covered request, handed to Envoy once per request as filter
//! state (`wasm.idempotency`), for access logs and traces (docs/operations.md, "Decisions in
//! the access log"). One host call: the fields go in one value.

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
    // Pushed piece by piece rather than `write!`: every request makes one, and the
    // formatting machinery cost a replay several thousand instructions (docs/performance.md).
    let mut out = String::with_capacity(96);
    out.push_str("decision=");
    out.push_str(decision);
    if let Some(key) = &note.key {
        out.push_str(" key=");
        key.push_short(&mut out);
        out.push_str(" store=");
        out.push_str(store);
    }
    if let Some(ms) = note.store_ms {
        out.push_str(" store_ms=");
        push_decimal(&mut out, ms);
    }
    if let Some(fence) = note.fence {
        out.push_str(" fence=");
        push_decimal(&mut out, fence);
    }
    out
}

fn push_decimal(out: &mut String, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        if let Some(d) = digits.get_mut(at) {
            *d = b'0' + (n % 10) as u8;
        }
        n /= 10;
        if n == 0 || at == 0 {
            break;
        }
    }
    for d in digits.get(at..).unwrap_or_default() {
        out.push(char::from(*d));
    }
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
        let note = Note { key: Some(key), store_ms: Some(0), fence: Some(u64::MAX), ..Note::default() };
        assert_eq!(
            text("replayed", &note, "shared"),
            "decision=replayed key=2cf6ad973cc0 store=shared store_ms=0 fence=18446744073709551615"
        );
    }
}
