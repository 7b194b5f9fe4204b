//! What the simulator reads of a lifecycle between events (tests only): what is left in flight
//! when traffic has stopped. Its oracle judges from the world's records, never from this.

use super::Lifecycle;
use crate::store::Store;

impl<S: Store> Lifecycle<S> {
    /// What this VM still holds, by kind (empty when it is back at its baseline).
    pub fn residue(&self) -> Vec<(&'static str, usize)> {
        let all = [
            ("streams", self.streams.len()),
            ("work", self.work.len()),
            ("outbox", self.outbox.len()),
            ("store_calls", self.store_calls.len()),
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
