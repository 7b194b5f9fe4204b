//! Wait mode (docs/behaviour.md §3.3, `on_conflict: "wait"`): duplicates held at the gateway until the
//! first call's outcome is known. The timer asks the store once per distinct request; the
//! answer goes to every waiter of it, and a claim to the first one only.

use super::claim::{LazyOutbound, Next};
use super::problem::Problem;
use super::{Effect, Lifecycle, Phase};
use crate::fingerprint::Fingerprint;
use crate::key::StoreKey;
use crate::metrics::Counter;
use crate::store::{Answer, Began, Claim, For, Store};

impl<S: Store> Lifecycle<S> {
    /// From the timer: each distinct held request that is due asks the store again.
    pub(super) fn poll_waiters(&mut self, now: u64) {
        if self.waiting == 0 {
            return;
        }
        let mut asked: Vec<(StoreKey, Fingerprint)> = Vec::new();
        let mut due: Vec<(u32, Claim)> = Vec::new();
        for (id, stream) in &mut self.streams {
            let Phase::Waiting(held) = &mut stream.phase else { continue };
            if held.polling || now < held.next_poll_ms {
                continue;
            }
            held.polling = true;
            if !asked.contains(&(held.key, held.fingerprint)) {
                asked.push((held.key, held.fingerprint));
                let lease_ms = self.config.policy(stream.policy).lease_ms;
                let established = self.known.group(held.caller) != super::budget::Group::UNKNOWN;
                let claim =
                    Claim { key: held.key, fingerprint: held.fingerprint, caller: held.caller, established, lease_ms };
                due.push((*id, claim));
            }
        }
        for (id, claim) in due {
            let asked = (claim.key, claim.fingerprint);
            match self.store.begin(For::Stream(id), &claim, now) {
                Some(Answer::Began(began)) => self.on_poll_answer(asked, Some(id), began, now),
                Some(other) => log::warn!("unexpected store answer to a held request: {other:?}"),
                // Comes later, as a claim answer for this stream: should its client leave
                // first, the answer still goes to the others that wait for it.
                None => {
                    self.asking.insert(id, asked);
                }
            }
        }
    }

    /// The store's answer for a held request, asked by `asker` (gone, if `None`): to every
    /// waiter of that request that was asking. A claim goes to the asker, else to the oldest
    /// waiter, else back to the store.
    pub(super) fn on_poll_answer(
        &mut self,
        asked: (StoreKey, Fingerprint),
        asker: Option<u32>,
        began: Began,
        now: u64,
    ) {
        let (key, fingerprint) = asked;
        if !matches!(began, Began::InProgress) {
            log::debug!("waiters of key {} -> {}", key.short(), super::claim::describe(&began));
        }
        let mut group: Vec<u32> = self
            .streams
            .iter()
            .filter(|(_, s)| matches!(&s.phase, Phase::Waiting(h) if h.polling && h.key == key && h.fingerprint == fingerprint))
            .map(|(id, _)| *id)
            .collect();
        group.sort_unstable(); // the oldest stream first
        match began {
            Began::Claimed { owner, .. } => {
                // One waiter becomes the first call; the others wait for it.
                let first = asker.filter(|id| group.contains(id)).or_else(|| group.first().copied());
                let Some(first) = first else {
                    log::debug!("key {}: claimed for waiters that all left; released", key.short());
                    return self.release(owner, now);
                };
                group.retain(|id| *id != first);
                self.decide_waiter(first, began, now);
                self.still_in_progress(&group, now)
            }
            // The first call was in progress when last seen: a held duplicate never goes
            // upstream on a store that fails or does not answer (docs/behaviour.md §3.8); it asks again
            // until `wait_max_ms`, then gets the 409.
            Began::Unavailable if crate::defects::planted(crate::defects::Defect::HeldForwardedOnFailure) => {
                for id in group {
                    self.decide_waiter(id, Began::Unavailable, now);
                }
            }
            Began::InProgress | Began::Unavailable | Began::Failed(_) => self.still_in_progress(&group, now),
            // Completed, mismatched, full: every waiter gets the same answer (a replay is
            // shared, not copied per waiter).
            _ => {
                for id in group {
                    self.decide_waiter(id, began.clone(), now);
                }
            }
        }
    }

    /// A held request stops waiting: it becomes the first call (the root sends it, or it goes
    /// on through the router), or it is answered.
    fn decide_waiter(&mut self, id: u32, began: Began, now: u64) {
        let Some(stream) = self.streams.get_mut(&id) else { return };
        let Phase::Waiting(held) = std::mem::replace(&mut stream.phase, Phase::Pass) else { return };
        self.waiter_gone(held.group);
        if let Next::Router = self.decide(id, held, began, &mut LazyOutbound::none(), now) {
            self.effects.push(Effect::Resume { stream: id });
        }
    }

    /// Still in progress: wait again, or 409 once `wait_max_ms` has passed.
    fn still_in_progress(&mut self, ids: &[u32], now: u64) {
        let poll_ms = self.store.wait_poll_ms();
        for id in ids {
            let Some(stream) = self.streams.get_mut(id) else { continue };
            let retry_after_s = self.config.policy(stream.policy).retry_after_s;
            let Phase::Waiting(held) = &mut stream.phase else { continue };
            if held.wait_deadline_ms.is_some_and(|d| now < d) {
                held.polling = false;
                held.next_poll_ms = now.saturating_add(poll_ms);
                continue;
            }
            self.count(Counter::Conflict);
            self.problem(*id, Problem::in_progress(retry_after_s));
        }
    }
}
