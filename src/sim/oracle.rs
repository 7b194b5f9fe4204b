//! The oracle: judges every upstream effect and every answer from what the world's models
//! recorded — the upstream's record of each call (key, fingerprint, token, the claim the store
//! held for its VM when it left), what each client was told, the stores' history of each key
//! (`history.rs`) and the fault log — never from the plugin's own state (docs/simulator.md,
//! "The oracle").
//!
//! A second effect of a key is a violation unless one of a few named excuses holds, each
//! checked against those facts:
//! - `released`: the earlier effect's answer released the key before its mark went;
//! - `pass`: `on_unavailable: "pass"`, the request never learnt the key was in progress or
//!   done, and its VM's store calls failed while it was being decided;
//! - `orphaned`: router mode, the earlier call's client left (the outcome is unknown, the mark
//!   stays), and the mark had expired when it was taken over;
//! - `lease_lost`: the earlier owner's mark had expired when it was taken over, and no write of
//!   its owner could have landed before: no stretch of time long enough for one was free of
//!   the owner's faults (deadline-based, per key).

use super::history::{Claim, KeyId, Mark};
use super::net::longest_clear;
use super::world::{FlightState, Got, World};
use super::LEASE_MS;
use crate::store::etcd::protocol::{BACKOFF_MAX_MS, BACKOFF_MIN_MS};
use crate::store::etcd::HEDGE_MS;

/// A margin for the world's own jitter (ticks drawn 0–3 ms late, the upstream 0–3 ms away).
const MARGIN_MS: u64 = 30;

impl World {
    pub(super) fn excuse(&mut self, name: &'static str) {
        *self.excuses.entry(name).or_default() += 1;
    }

    /// The key's etcd cluster (`None`: shared data).
    fn cluster_of(&self, key: KeyId) -> Option<usize> {
        if self.combo.is_etcd() {
            Some(self.key_cluster.get(&key).copied().unwrap_or(0))
        } else {
            None
        }
    }

    /// With fencing on: a claimed request carries its claim's token and no other; a request
    /// sent without a claim carries none. Whether the effect is judged as claimed.
    pub(super) fn judge_fence(&mut self, f: usize) -> bool {
        let pass = self.pass_excused(f);
        let (claim, fence) = (self.flights[f].claim, self.flights[f].fence);
        if self.combo.fencing {
            let wrong = match (claim, fence) {
                _ if pass && claim.is_some() => None, // it may or may not know its claim
                (Some(c), Some(token)) if token != c.fence => {
                    Some(format!("token {token}, its claim's is {}", c.fence))
                }
                (Some(c), None) => Some(format!("no token, its claim's is {}", c.fence)),
                (None, Some(token)) => Some(format!("token {token} without a claim")),
                _ => None,
            };
            if let Some(wrong) = wrong {
                self.check.fail("fence_missing", self.now, format!("flight {f}: {wrong}"));
            }
            if let Some(token) = fence {
                let key = self.flights[f].key;
                let reused =
                    self.flights.iter().enumerate().any(|(g, o)| g != f && o.key == key && o.fence == Some(token));
                if reused {
                    self.check.fail("fence_reused", self.now, format!("flight {f} token {token}"));
                }
            }
        }
        claim.is_some() && !pass
    }

    /// Whether flight `f`'s request could have been passed on without a claim
    /// (`on_unavailable: "pass"`): its store never told it that its key was in progress or
    /// done, and its VM's store was failing: a call of it failed while the request was
    /// decided, or had failed last before, or no lease was at hand to claim with.
    fn pass_excused(&self, f: usize) -> bool {
        if !self.combo.pass {
            return false;
        }
        let flight = &self.flights[f];
        let r = &self.reqs[flight.req];
        if r.knew {
            return false;
        }
        let Some(from) = r.body_at else { return false };
        let cluster = self.cluster_of(flight.key).unwrap_or(0);
        let calls = self.store_log.iter().filter(|o| o.vm == flight.vm && o.cluster == cluster);
        let failed_meanwhile = calls.clone().any(|o| !o.ok && o.sent <= flight.sent && o.ended >= from);
        let failing_before = calls.clone().filter(|o| o.seq < r.body_seq).max_by_key(|o| o.seq).is_some_and(|o| !o.ok);
        // A VM lease is used for `ttl - lease_ms - 1 s` after it was asked for, by the VM's clock
        // (etcd/mod.rs).
        let usable = (2 * LEASE_MS).max(6_000) - LEASE_MS - 1_000;
        let envoy = self.vms[flight.vm].envoy;
        let now = self.clock_of(envoy, flight.sent);
        let leased = calls
            .clone()
            .any(|o| o.grant && o.ok && o.ended <= flight.sent && self.clock_of(envoy, o.sent) + usable > now);
        failed_meanwhile || failing_before || !leased
    }

    /// Flight `f` reaches the upstream, which does its work: may it?
    pub(super) fn judge_effect(&mut self, f: usize, protected: bool) {
        let key = self.flights[f].key;
        if !protected {
            if self.pass_excused(f) {
                self.excuse("pass");
                self.flights[f].unprotected = true;
                return;
            }
            let r = self.flights[f].req;
            let others: Vec<usize> = self.earlier_effects(f);
            let invariant = if self.reqs[r].knew {
                "held_duplicate_forwarded"
            } else if others.is_empty() {
                "unclaimed_effect"
            } else {
                "duplicate_effect"
            };
            let detail =
                format!("flight {f} (req {r}) runs key {key:?} with no claim of its VM's; earlier effects {others:?}");
            return self.check.fail(invariant, self.now, detail);
        }
        let Some(claim) = self.flights[f].claim else { return };
        if let Err(why) = self.still_held(f, claim) {
            let invariant = if self.earlier_effects(f).is_empty() { "unclaimed_effect" } else { "duplicate_effect" };
            let detail = format!("flight {f} ran key {key:?} under claim {}: {why}", claim.gen);
            return self.check.fail(invariant, self.now, detail);
        }
        for g in self.earlier_effects(f) {
            let Some(theirs) = self.flights[g].claim else { continue };
            if theirs.gen == claim.gen {
                let detail = format!("flights {g} and {f} both ran under claim {} of key {key:?}", claim.gen);
                return self.check.fail("duplicate_effect", self.now, detail);
            }
            // The earlier claim must have ended so that the later one could be made.
            let (first, earlier, later) = if theirs.at <= claim.at { (g, theirs, claim) } else { (f, claim, theirs) };
            if let Err(why) = self.succeeded(first, earlier, later) {
                let detail = format!("flight {f} (claim {}) ran key {key:?} beside flight {g}: {why}", claim.gen);
                return self.check.fail("duplicate_effect", self.now, detail);
            }
        }
    }

    /// Flight `f` leaves under claim `c`: the store still holds it, or another Envoy took it
    /// over when its clock said it had expired while the owner's own clock said it had not (a
    /// late owner: the call goes, and fencing tells the upstream). Counted as `late_owner`.
    fn still_held(&mut self, f: usize, c: Claim) -> Result<(), String> {
        let key = self.flights[f].key;
        let sent = self.flights[f].sent;
        if self.history.at(key, sent).and_then(Mark::in_progress) == Some(c.gen) {
            return Ok(());
        }
        let end = self.history.end_of(key, c.gen).copied();
        let Some(end) = end.filter(|e| e.by_vm.is_some_and(|vm| Some(vm) != c.by_vm)) else {
            return Err(format!("its own VM had ended the claim ({end:?})"));
        };
        let deadline = self.history.last_deadline(key, c.gen, end.at + 1).and_then(|m| m.entry).map(|e| e.deadline_ms);
        let owner = self.vms[self.flights[f].vm].envoy;
        let believed = deadline.is_some_and(|d| self.clock_of(owner, sent) < d);
        if believed && self.expired(key, c, &end) {
            self.excuse("late_owner");
            return Ok(());
        }
        Err(format!("taken over at {} and its owner's clock knew it had expired", end.at))
    }

    /// The other flights of `f`'s key that did their work at the upstream, as claimed.
    fn earlier_effects(&self, f: usize) -> Vec<usize> {
        let key = self.flights[f].key;
        (0..self.flights.len())
            .filter(|g| *g != f)
            .filter(|g| {
                let o = &self.flights[*g];
                o.key == key && o.effect && !o.unprotected && o.state != FlightState::Fenced
            })
            .collect()
    }

    /// Claim `later` of a key may run after flight `g`'s effect under claim `earlier`: how
    /// `earlier` ended lets it (an excuse, counted), or why not.
    fn succeeded(&mut self, g: usize, earlier: Claim, later: Claim) -> Result<(), String> {
        let key = self.flights[g].key;
        let Some(end) = self.history.end_of(key, earlier.gen).copied() else {
            return Err(format!("claim {} still held", earlier.gen));
        };
        if end.at > later.at {
            return Err(format!("claim {} began at {} while claim {} was held", later.gen, later.at, earlier.gen));
        }
        if end.entry.is_some_and(|e| e.gen == earlier.gen && e.state.is_completed()) {
            return Err(format!("claim {} completed at {}: its answer is kept for an hour", earlier.gen, end.at));
        }
        let flight = &self.flights[g];
        let released = matches!(flight.state, FlightState::Done { storable: false })
            && flight.answered_at.is_some_and(|at| at <= end.at);
        if released {
            self.excuse("released");
            return Ok(());
        }
        if !self.expired(key, earlier, &end) {
            return Err(format!("its mark went at {} before its deadline ({end:?})", end.at));
        }
        if flight.state == FlightState::Orphaned {
            self.excuse("orphaned");
            return Ok(());
        }
        match self.owner_could_write(key, earlier, &end, g) {
            Some(why) => Err(format!("its owner could have kept it: {why}")),
            None => {
                self.excuse("lease_lost");
                Ok(())
            }
        }
    }

    /// Whether claim `c`'s mark had expired when `end` replaced or removed it, by the clock
    /// of the Envoy that did. A mark etcd dropped with its lease is judged by its owner's
    /// clock (it keeps its lease to outlive its deadline by that clock), unless that clock was
    /// stepped back while the lease was in use (it then used the lease too long: a fault).
    fn expired(&self, key: KeyId, c: Claim, end: &Mark) -> bool {
        let Some(last) = self.history.last_deadline(key, c.gen, end.at + 1).and_then(|m| m.entry) else {
            return false;
        };
        let owner = c.by_vm.map_or(0, |vm| self.vms[vm].envoy);
        let Some(vm) = end.by_vm else {
            let lease_life = (2 * LEASE_MS).max(6_000);
            let stepped_back = self
                .faults
                .steps
                .get(owner)
                .into_iter()
                .flatten()
                .any(|(at, by)| *by < 0 && c.at.saturating_sub(lease_life) <= *at && *at <= end.at);
            return stepped_back || self.clock_of(owner, end.at) >= last.deadline_ms;
        };
        // The taker read the mark before it wrote: its clock may have been stepped back since.
        let judge = self.vms[vm].envoy;
        let read_at = end.at.saturating_sub(2 * self.faults.etcd_timeout_ms + 2 * self.faults.etcd_latency_max);
        self.latest_clock(judge, read_at, end.at) >= last.deadline_ms
    }

    /// Whether the owner of claim `c` (flight `g`'s) could have landed a write that kept its
    /// mark before `end` took it: `Some(why)` when a stretch of time long enough for one was
    /// free of its faults, `None` when none was.
    fn owner_could_write(&self, key: KeyId, c: Claim, end: &Mark, g: usize) -> Option<String> {
        let vm = c.by_vm?;
        let envoy = self.vms[vm].envoy;
        let cluster = self.cluster_of(key);
        let last = self.history.last_deadline(key, c.gen, end.at + 1)?;
        let deadline = last.entry?.deadline_ms;
        let busy = self.faults.impaired(envoy, vm, cluster);
        let tick = self.vms[vm].lifecycle_tick_ms();
        // Stretches of time, each with how long a clear stretch within it must be for a write.
        let windows: Vec<(u64, u64, u64)> = match cluster {
            // Renewals every quarter lease, asked each sixteenth, from the timer: a clear
            // stretch that long renews the mark (shared data answers at once).
            None => vec![(last.at, end.at, LEASE_MS / 4 + LEASE_MS / 16 + tick + MARGIN_MS)],
            // From one timeout before its deadline to one lease after it (by its own clock) an
            // owner's write is urgent: it goes after the shortest backoff, or beside a try that
            // hangs; it may need a lease first: two round trips. Then on its backoff only.
            Some(_) => {
                let urgent_from = self.true_time(envoy, deadline.saturating_sub(self.faults.etcd_timeout_ms));
                let urgent_to = self.true_time(envoy, deadline.saturating_add(LEASE_MS));
                let round_trip = 2 * self.faults.etcd_latency_max;
                let urgent = tick + BACKOFF_MIN_MS.max(HEDGE_MS) + 2 * round_trip + MARGIN_MS;
                let calm = tick + BACKOFF_MAX_MS + 2 * round_trip + MARGIN_MS;
                vec![(urgent_from.max(last.at), urgent_to.min(end.at), urgent), (urgent_to, end.at, calm)]
            }
        };
        windows.into_iter().filter(|(from, to, _)| from < to).find_map(|(from, to, needed)| {
            let clear = longest_clear(busy.clone(), from, to);
            (clear >= needed).then(|| {
                format!(
                    "vm {vm} was clear for {clear} ms of {from}..{to} (needs {needed}); flight {g} answered at {:?}",
                    self.flights[g].answered_at
                )
            })
        })
    }

    /// A write landed for a claim after another claim took its key: a late owner overwrote
    /// the newer entry. And an in-progress mark went before its deadline by a write of
    /// another VM than its owner's.
    pub(super) fn check_overwrite(&mut self, key: KeyId, before: Option<u64>, mark: &Mark) {
        let Some(entry) = mark.entry else {
            if let (Some(gen), Some(vm)) = (before, mark.by_vm) {
                let owner = self.history.claim(key, gen).and_then(|c| c.by_vm);
                if owner != Some(vm) {
                    let claim = self.history.claim(key, gen);
                    let end = *mark;
                    if claim.is_some_and(|c| !self.expired(key, c, &end)) {
                        let detail = format!("vm {vm} removed key {key:?}'s live mark {gen} (owner vm {owner:?})");
                        self.check.fail("mark_removed_early", self.now, detail);
                    }
                }
            }
            return;
        };
        let Some(current) = before else { return };
        if entry.gen == current {
            return;
        }
        // A token seen before, now back: an older claim's write landed over a newer one.
        let older = self.history.claim(key, entry.gen).zip(self.history.claim(key, current));
        if older.is_some_and(|(old, new)| old.at < new.at) {
            let detail = format!("key {key:?}: claim {} wrote over claim {current}", entry.gen);
            self.check.fail("late_owner_overwrote", self.now, detail);
        }
    }

    /// The answer a client got: a replay is the stored answer of a completed call of the
    /// same key, caller and request; a 409 or 429 is what the store held.
    pub(super) fn check_answer(&mut self, r: usize, key: KeyId, got: &Got) {
        let done: Vec<usize> = (0..self.flights.len())
            .filter(|g| {
                let o = &self.flights[*g];
                o.key == key && !o.loopback && matches!(o.state, FlightState::Done { storable: true })
            })
            .collect();
        let tag = super::world::parse_tag(&got.body);
        if got.replayed && got.problem.is_none() {
            return self.check_replay(r, key, got, &done, tag);
        }
        if let Some((g, _, _)) = tag.filter(|_| got.problem.is_none()) {
            if self.flights.get(g).is_none_or(|o| o.req != r) {
                self.check.fail("answer_crossed", self.now, format!("req {r} got flight {g}'s answer"));
            }
        }
        let from = self.reqs[r].body_at.unwrap_or(self.reqs[r].sent);
        match got.problem {
            Some("response-not-stored") if done.is_empty() => {
                self.check.fail("completed_without_completion", self.now, format!("req {r} of {key:?}"));
            }
            // A full write budget refuses new keys only: the read of a key whose answer the
            // store held all along finds it.
            Some("share-full") if self.history.completed_throughout(key, from, self.now) => {
                self.check.fail("share_full_for_a_stored_key", self.now, format!("req {r} of {key:?}"));
            }
            Some("in-progress") => {
                if let Err(why) = self.held_by_someone(key, from, self.reqs[r].vm) {
                    self.check.fail("locked_without_owner", self.now, format!("req {r}: 409 for {key:?}: {why}"));
                }
            }
            _ => {}
        }
    }

    fn check_replay(&mut self, r: usize, key: KeyId, got: &Got, done: &[usize], tag: Option<(usize, u64, u64)>) {
        let variant = self.reqs[r].variant;
        let matches = |w: &World, g: usize| {
            let o = &w.flights[g];
            let same_grpc = crate::lifecycle::grpc_reply::status_of(
                o.answer.headers.iter().chain(o.answer.trailers.iter()).map(|(n, v)| (n.as_str(), v.as_slice())),
            ) == got.grpc;
            o.variant == variant && same_grpc && (o.answer.status == got.status || w.combo.is_grpc())
        };
        if got.grpc == Some(crate::lifecycle::grpc_reply::FAILED_PRECONDITION) && self.combo.is_grpc() {
            // Not replayable over gRPC without the loopback: a completed call must exist.
            if done.is_empty() {
                self.check.fail("completed_without_completion", self.now, format!("req {r}: {got:?}"));
            }
            return;
        }
        match tag {
            Some((g, scope, k)) if (scope, k) != key => {
                self.check.fail("cross_scope", self.now, format!("req {r} of {key:?} got flight {g}'s answer"));
            }
            Some((g, _, _)) if done.contains(&g) && matches(self, g) => {}
            _ if got.body.is_empty() && got.grpc.is_some_and(|c| c != 0) && done.iter().any(|g| matches(self, *g)) => {}
            _ => {
                let detail = format!("req {r} (v{variant}) of {key:?} replayed {got:?}; completed flights {done:?}");
                self.check.fail("replay_differs", self.now, detail);
            }
        }
    }

    /// A 409 "in progress" for `key`, read at some moment since `from` (the read's answer may
    /// wait for a stalled VM): the store held a mark of it, and its owner was at work then (its
    /// call running, answered lately, orphaned, on its way), or faults held it up, or it never
    /// learnt it held the key. A VM answers a retry of its own claim without reading the
    /// store (shared data): its last claim of the key counts too.
    fn held_by_someone(&self, key: KeyId, from: u64, vm: usize) -> Result<(), String> {
        let mut gens: Vec<u64> = Vec::new();
        if let Some(gen) = self.history.at(key, from).and_then(Mark::in_progress) {
            gens.push(gen);
        }
        if let Some(own) = self.history.claim_by(key, vm, 0, self.now) {
            gens.push(own.gen);
        }
        for m in self.history.marks(key).iter().filter(|m| from < m.at && m.at <= self.now) {
            if let Some(gen) = m.in_progress() {
                gens.push(gen);
            }
        }
        if gens.is_empty() {
            return Err("the store held no mark of it".into());
        }
        let end_grace = self.grace_ms + 2 * self.faults.etcd_timeout_ms;
        for gen in &gens {
            let Some(claim) = self.history.claim(key, *gen) else { continue };
            if !claim.acknowledged || claim.at + self.grace_ms + MARGIN_MS >= from {
                return Ok(());
            }
            let working = self.flights.iter().filter(|o| o.claim.is_some_and(|c| c.gen == *gen)).any(|o| {
                matches!(o.state, FlightState::Running | FlightState::Orphaned)
                    || o.answered_at.is_none_or(|at| at + end_grace >= from)
            });
            if working {
                return Ok(());
            }
            let Some(vm) = claim.by_vm else { continue };
            let refused = self.refused_upstream.iter().any(|(v, k, at)| *v == vm && *k == key && *at >= claim.at);
            let envoy = self.vms[vm].envoy;
            let busy = self.faults.impaired(envoy, vm, self.cluster_of(key));
            let impaired = busy.iter().any(|(a, b)| *a <= self.now && claim.at <= b + end_grace);
            if refused || impaired {
                return Ok(());
            }
        }
        Err(format!("its marks {gens:?} had no owner at work"))
    }
}
