//! A request's claim on etcd: the read that comes first, the transaction when the key is
//! absent or expired, and what their answers say (docs/fleet.md, docs/how-it-works.md).

use std::rc::Rc;

use super::protocol::{ErrorKind, EtcdError, Kv, Request, TxnResult};
use super::{Backoff, EtcdOwner, EtcdStore, Op, Round, MAX_ROUNDS};
use crate::encoding::{decode_entry, encode_entry, Corrupt, Entry, State};
use crate::store::decision::{decide_entry, Change, Decision, StoreError};
use crate::store::{Answer, Began, Owner};

/// Reads of one request that may fail to reach etcd before it follows `on_unavailable`.
const RELOOKS: u8 = 2;

impl EtcdStore {
    /// A request's first step: read the key. etcd serves a Range without a raft proposal
    /// (a linearizable read confirms the leader with ReadIndex, it does not propose), so a
    /// key in progress or completed (a 409, a replay, a 422, a wait-mode poll) costs etcd no
    /// write. An absent key goes on to the claim, an expired one to the takeover. Needs no
    /// lease: a stored answer replays while no lease can be had (etcd out of space).
    pub(super) fn send_look(&mut self, round: Round, now: u64) {
        let who = round.who;
        if !self.try_look(round, now) {
            self.answer(who, Began::Unavailable);
        }
    }

    /// Sends the read of a round; `false` when nothing was sent (the backoff holds it).
    pub(super) fn try_look(&mut self, round: Round, now: u64) -> bool {
        let round = Round { looked_ms: now, ..round };
        let request = Request::Range { key: round.key.clone() };
        self.send(request, Op::Look { round }, now)
    }

    /// What the first read found: an entry is judged (an expired one is taken over), an
    /// absent key is claimed. A failed read wrote nothing: nothing to clean up.
    pub(super) fn on_look(&mut self, round: Round, answer: &crate::store::CallAnswer, now: u64) {
        match self.link.api.parse_range(answer) {
            Ok(Some(kv)) => self.judge_existing(round, kv, now, true),
            // Claimed once a VM lease is at hand (`pump`), as a takeover is; unless this
            // Envoy's share of etcd is full and this caller wrote the most of it.
            Ok(None) => match self.over_share(round.caller, round.established, now) {
                Some(refused) => self.answer(round.who, refused),
                None => self.rounds.push_back(Round { takeover: None, ..round }),
            },
            // Nothing reached etcd (a member down that Envoy still sends to, until its health
            // check says so): read again when the backoff lets a call through, for a while.
            // Envoy answers a timed-out gRPC call UNAVAILABLE too: the time it took tells them apart.
            Err(err)
                if err.refused_at_once()
                    && now.saturating_sub(round.looked_ms) < self.link.timeout_ms / 2
                    && round.attempts < RELOOKS =>
            {
                log::debug!("etcd: read did not reach etcd ({err:?}); reading again");
                let deadline = now.saturating_add(2 * self.link.timeout_ms);
                self.relooks.push_back((Round { attempts: round.attempts + 1, ..round }, deadline));
            }
            Err(err) => {
                log::warn!("etcd: read failed: {err:?}");
                self.answer(round.who, Began::Unavailable);
            }
        }
    }

    /// The claim (compare: absent) or takeover (compare: the expired entry's `mod_revision`)
    /// of a key its read found absent or expired. The compare decides: a replica that wrote
    /// the key since the read wins, and this transaction's read-back is judged instead. That
    /// failed transaction is still a raft proposal (etcd serves a transaction as a read only
    /// when neither branch writes, and the success branch puts): only this rare race pays it.
    pub(super) fn send_claim(&mut self, round: Round, lease: i64, now: u64) {
        let entry = Entry {
            state: State::InProgress,
            gen: self.draw(),
            key: round.tag,
            fingerprint: round.fingerprint,
            deadline_ms: now.saturating_add(round.lease_ms),
            since_ms: now,
            bytes: 0,
            caller: round.caller,
        };
        // The token (`gen`) makes the mark's value unique: a delete-if-value only ever removes
        // our own mark.
        let value = encode_entry(&entry, None);
        let request = match round.takeover {
            Some(mod_revision) => Request::replace(&round.key, mod_revision, value.clone(), lease),
            None => Request::claim(&round.key, value.clone(), lease),
        };
        let who = round.who;
        if !self.send(request, Op::Claim { round, value, entry }, now) {
            self.answer(who, Began::Unavailable);
        }
    }

    pub(super) fn answer(&mut self, who: crate::store::For, began: Began) {
        self.answers.push_back((who, Answer::Began(began)));
    }

    /// Another round of claim or takeover, or 503 after `MAX_ROUNDS`.
    fn next_round(&mut self, mut round: Round) {
        round.attempts += 1;
        if round.attempts >= MAX_ROUNDS {
            self.answer(round.who, Began::Failed(StoreError::Contention));
        } else {
            self.rounds.push_back(round);
        }
    }

    pub(super) fn on_claim(
        &mut self,
        mut round: Round,
        value: Vec<u8>,
        entry: Entry,
        result: Result<TxnResult, EtcdError>,
        now: u64,
    ) {
        match result {
            Ok(TxnResult { succeeded: true, revision, .. }) => self.claimed(round, value, entry, revision, now),
            Ok(TxnResult { current: None, .. }) => {
                // The key vanished between compare and read (released, or its lease ended):
                // claimed again at once, without another read.
                round.takeover = None;
                self.next_round(round);
            }
            Ok(TxnResult { current: Some(kv), .. }) => self.judge_existing(round, kv, now, true),
            Err(err) if err.kind() == ErrorKind::NoSpace => {
                // etcd refuses writes, reads still work: a stored answer replays, an in-progress
                // mark still conflicts; a new key cannot be claimed (on_unavailable). The key
                // was absent or expired when read; it is read again, in case another replica
                // wrote it since.
                self.note_no_space(&err, now);
                let request = Request::Range { key: round.key.clone() };
                let who = round.who;
                if !self.send(request, Op::Read { round }, now) {
                    self.answer(who, Began::Unavailable);
                }
            }
            Err(err) if err.is_lease_not_found() => {
                self.forget_dead_lease(&err);
                self.next_round(round);
            }
            Err(err) => {
                log::warn!("etcd: claim failed: {err:?}");
                if err.kind() == ErrorKind::Unreachable {
                    // The claim may have been applied after its answer was lost: remove our
                    // mark (only ours: the value carries our token), retried until etcd answers.
                    self.cleanups.push((round.key.clone(), value));
                }
                self.answer(round.who, Began::Unavailable);
            }
        }
    }

    /// The claim is ours. Its answer may have come so late (a paused VM, a slow etcd) that
    /// the mark is about to expire or has, and another replica may take the key over: then
    /// renew it first, and go upstream only if that still finds our mark.
    fn claimed(&mut self, round: Round, value: Vec<u8>, entry: Entry, revision: i64, now: u64) {
        let id = self.next_owner;
        self.next_owner += 1;
        let owner = Owner { id, fence: revision.max(0) as u64 };
        let late = now.saturating_add(round.lease_ms / 4) >= entry.deadline_ms;
        let busy = late;
        let record = EtcdOwner {
            owner,
            store_key: round.store_key,
            key: round.key.clone(),
            entry,
            completed: None,
            mod_revision: revision,
            busy,
            tried_ms: now,
            ending: None,
            retry: Backoff::default(),
            unanswered: false,
            renew_wanted: None,
            lease_ms: round.lease_ms,
        };
        self.owners.insert(id, record);
        if !late {
            let leased_ms = entry.deadline_ms.saturating_sub(round.lease_ms); // from when it left
            let takeover = round.takeover.is_some();
            return self.answer(round.who, Began::Claimed { owner, takeover, change: Change::default(), leased_ms });
        }
        log::info!("etcd: a claim was answered late; renewing it before going upstream");
        let fresh = Entry { deadline_ms: now.saturating_add(round.lease_ms), ..entry };
        let request = self
            .usable_lease(now)
            .map(|lease| Request::replace(&round.key, revision, encode_entry(&fresh, None), lease));
        let (who, key) = (round.who, round.key.clone());
        let sent = match request {
            Some(request) => self.send(request, Op::Verify { round, id, value: value.clone(), entry: fresh }, now),
            None => false,
        };
        if !sent {
            // Not going upstream: our mark is removed (only ours: the value carries our token),
            // rather than left to lock the key until it expires.
            self.owners.remove(&id);
            self.cleanups.push((key, value));
            self.answer(who, Began::Unavailable);
        }
    }

    /// The answer to a late claim's renewal.
    pub(super) fn on_verify(
        &mut self,
        round: Round,
        id: u64,
        value: Vec<u8>,
        entry: Entry,
        result: Result<TxnResult, EtcdError>,
        now: u64,
    ) {
        match result {
            Ok(TxnResult { succeeded: true, revision, .. }) => {
                let Some(o) = self.owners.get_mut(&id) else { return };
                o.busy = false;
                o.mod_revision = revision;
                o.entry = entry;
                let owner = o.owner;
                let takeover = round.takeover.is_some();
                self.answer(round.who, Began::Claimed { owner, takeover, change: Change::default(), leased_ms: now });
            }
            Ok(TxnResult { current, .. }) => {
                // Taken over (or gone) meanwhile: decide again on what the key holds now.
                self.owners.remove(&id);
                match current {
                    Some(kv) => self.judge_existing(round, kv, now, true),
                    None => self.next_round(Round { takeover: None, ..round }),
                }
            }
            Err(err) => {
                self.owners.remove(&id);
                self.cleanups.push((round.key.clone(), value));
                self.forget_dead_lease(&err);
                self.answer(round.who, Began::Unavailable);
            }
        }
    }

    /// The key holds an entry: conflict, replay, mismatch, or (expired, and `writable`)
    /// another round to take it over.
    pub(super) fn judge_existing(&mut self, mut round: Round, kv: Kv, now: u64, writable: bool) {
        // An entry must be of this key: a value copied from another key is foreign.
        let decoded = decode_entry(&kv.value).and_then(|(entry, response)| {
            if entry.key == round.tag {
                Ok((entry, response))
            } else {
                Err(Corrupt("entry: of another key"))
            }
        });
        let (entry, response) = match decoded {
            Ok(decoded) => decoded,
            Err(e) => return self.answer(round.who, Began::Failed(StoreError::Corrupt(e.0))),
        };
        if entry.state.is_completed() && entry.is_live(now) {
            self.keep_copy(&round.store_key, &entry, response.as_ref(), now);
        }
        let began = match decide_entry(Some(&entry), &round.fingerprint, now) {
            Decision::Claim { .. } if writable => match self.over_share(round.caller, round.established, now) {
                Some(refused) => refused,
                None => {
                    round.takeover = Some(kv.mod_revision);
                    return self.next_round(round);
                }
            },
            Decision::Claim { .. } => Began::Unavailable,
            Decision::InProgress => Began::InProgress,
            Decision::Completed { no_body: false, .. } => match response {
                Some(r) => Began::Replay(Rc::new(r)),
                None => Began::Failed(StoreError::Corrupt("entry: no response")),
            },
            Decision::Completed { no_body: true, .. } => Began::CompletedWithoutBody,
            Decision::Mismatch | Decision::Full { .. } => Began::Mismatch,
        };
        self.answer(round.who, began);
    }

    /// A read after a claim refused for lack of space: judged, never written.
    pub(super) fn on_read(&mut self, round: Round, answer: &crate::store::CallAnswer, now: u64) {
        match self.link.api.parse_range(answer) {
            Ok(Some(kv)) => self.judge_existing(round, kv, now, false),
            Ok(None) | Err(_) => self.answer(round.who, Began::Unavailable),
        }
    }
}
