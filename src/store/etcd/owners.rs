//! An owner's writes on etcd (renewal, completion, release), the leases, and the dispatch of
//! every answer to what it was for.

use super::protocol::{ErrorKind, EtcdError, Kv, Request, TxnResult};
use super::{slack_s, Ending, EtcdStore, Op, VmLease};
use crate::encoding::{decode_entry, encode_entry, Entry, State};
use crate::store::{Answer, CallAnswer, Completed, For};
use crate::store::{Change, StoreError};

impl EtcdStore {
    /// Routes an answer to the operation it belongs to.
    pub(super) fn on_answer(&mut self, op: Op, answer: &CallAnswer, now: u64) {
        let api = self.link.api;
        match op {
            Op::Look { round } => self.on_look(round, answer, now),
            Op::Claim { round, value, entry } => self.on_claim(round, value, entry, api.parse_txn(answer), now),
            Op::Read { round } => self.on_read(round, answer, now),
            Op::Verify { round, id, value, entry } => {
                self.on_verify(round, id, value, entry, api.parse_txn(answer), now)
            }
            Op::Renew { id, entry } => self.on_renew(id, entry, api.parse_txn(answer), now),
            Op::End { id } => self.on_end(id, api.parse_txn(answer), now),
            Op::Cleanup { key, value } => match api.parse_txn(answer) {
                Ok(_) => self.background.succeed(),
                Err(_) => {
                    self.cleanups.push((key, value));
                    let jitter = self.draw();
                    self.background.fail(now, jitter);
                }
            },
            Op::GrantReplica { sent_ms } => self.on_grant(api.parse_grant(answer), sent_ms, now),
            Op::GrantRetention(retention_s) => {
                self.retention_pending.remove(&retention_s);
                match api.parse_grant(answer) {
                    Ok(lease) => {
                        self.background.succeed();
                        self.retention.insert(retention_s, (lease, now + slack_s(retention_s) * 1000));
                    }
                    Err(_) => {
                        let jitter = self.draw();
                        self.background.fail(now, jitter);
                    }
                }
            }
        }
    }

    /// A VM lease granted: its TTL runs from no earlier than `sent_ms`.
    fn on_grant(&mut self, granted: Result<i64, EtcdError>, sent_ms: u64, now: u64) {
        self.lease_pending = false;
        match granted {
            Ok(id) => {
                let ttl_ms = self.lease_ttl_s * 1000;
                let rotate_at_ms = sent_ms + ttl_ms / 4;
                let usable_until_ms = (sent_ms + ttl_ms).saturating_sub(self.max_lease_ms + 1_000);
                self.lease = Some(VmLease { id, rotate_at_ms, usable_until_ms });
                self.background.succeed();
            }
            Err(err) => {
                log::warn!("etcd: lease grant failed: {err:?}");
                let jitter = self.draw();
                self.background.fail(now, jitter);
                self.fail_rounds();
            }
        }
    }

    /// Extends an owner's mark, unless its call ended. One that cannot go yet (etcd failing,
    /// no usable lease) stays wanted and is tried again from `pump`.
    pub(super) fn send_renew(&mut self, id: u64, lease_ms: u64, now: u64) {
        let lease = self.usable_lease(now);
        let Some(o) = self.owners.get_mut(&id) else { return };
        if o.ending.is_some() {
            o.renew_wanted = None;
            return;
        }
        o.renew_wanted = Some(lease_ms);
        let Some(lease) = lease else { return };
        let entry = Entry { deadline_ms: now.saturating_add(lease_ms), ..o.entry };
        let request = Request::replace(&o.key, o.mod_revision, encode_entry(&entry, None), lease);
        let need_by_ms = o.entry.deadline_ms;
        let was_busy = o.busy;
        o.busy = true;
        let sent = self.send_by(request, Op::Renew { id, entry }, need_by_ms, now);
        if let Some(o) = self.owners.get_mut(&id) {
            o.busy = sent || was_busy;
            if sent {
                o.renew_wanted = None;
            }
        }
    }

    /// Whether the value a failed compare read back is this owner's own mark: a write of ours
    /// that etcd applied but did not acknowledge moved its revision on.
    fn adopt_if_ours(&mut self, id: u64, kv: &Kv) -> bool {
        let Some(o) = self.owners.get_mut(&id) else { return false };
        let Ok((entry, _)) = decode_entry(&kv.value) else { return false };
        let ours = entry.state == State::InProgress && entry.gen == o.entry.gen && entry.key == o.entry.key;
        if ours {
            o.mod_revision = kv.mod_revision;
            o.entry = entry;
        }
        ours
    }

    /// Whether what a failed compare read back shows this owner's ending applied already:
    /// the key holds our completed entry (our token, our key), or a release finds it gone.
    fn ended_already(&self, id: u64, current: Option<&Kv>) -> bool {
        let Some(o) = self.owners.get(&id) else { return false };
        match (&o.ending, current) {
            (Some(Ending::Release), None) => true,
            (Some(Ending::Complete { .. }), Some(kv)) => decode_entry(&kv.value).is_ok_and(|(entry, _)| {
                entry.state.is_completed() && entry.gen == o.entry.gen && entry.key == o.entry.key
            }),
            _ => false,
        }
    }

    fn on_renew(&mut self, id: u64, entry: Entry, result: Result<TxnResult, EtcdError>, now: u64) {
        if let Some(o) = self.owners.get_mut(&id) {
            o.busy = false;
        }
        match result {
            Ok(TxnResult { succeeded: true, revision, .. }) => {
                if let Some(o) = self.owners.get_mut(&id) {
                    o.mod_revision = revision;
                    o.entry = entry;
                    o.retry.succeed();
                    o.unanswered = false;
                }
            }
            Ok(TxnResult { current: Some(kv), .. }) if self.adopt_if_ours(id, &kv) => {
                // An earlier write of ours landed late and moved the revision on: this renewal
                // did not, and the mark keeps that write's older deadline. Renew again now.
                if let Some(o) = self.owners.get_mut(&id).filter(|o| o.ending.is_none()) {
                    o.renew_wanted = Some(o.lease_ms);
                }
            }
            // Its ending, tried beside this renewal, landed first.
            Ok(TxnResult { current, .. }) if self.ended_already(id, current.as_ref()) => {
                self.on_end(id, Ok(TxnResult { succeeded: true, revision: 0, current: None }), now)
            }
            Ok(_) => {
                // Taken over (or gone): this owner no longer holds the key. An ending that
                // waited behind the renewal is answered now, as it would have been (lost):
                // its answer's end must not wait for a write that will never be sent.
                if let Some(o) = self.owners.remove(&id) {
                    let answer = match o.ending {
                        Some(Ending::Complete { response, .. }) => Answer::Completed(Completed::Lost { response }),
                        Some(Ending::Release) => Answer::Released { done: false, change: Change::default() },
                        None => Answer::Renewed(false),
                    };
                    self.answers.push_back((For::Owner(o.owner), answer));
                }
            }
            Err(err) => {
                self.forget_dead_lease(&err);
                self.note_no_space(&err, now);
                // Tried again as the backoff lets it, early when the mark would expire first.
                let jitter = self.draw();
                if let Some(o) = self.owners.get_mut(&id) {
                    if o.ending.is_none() {
                        o.renew_wanted = Some(o.lease_ms);
                    }
                    o.retry.fail(now, jitter);
                    o.unanswered = err.kind() == ErrorKind::Unreachable;
                }
            }
        }
    }

    /// Sends an owner's completion or release.
    pub(super) fn send_end(&mut self, id: u64, now: u64) {
        let Some(o) = self.owners.get(&id) else { return };
        let request = match &o.ending {
            Some(Ending::Release) => Request::delete(&o.key, o.mod_revision),
            Some(Ending::Complete { response, retention_ms }) => {
                let retention_s = retention_ms / 1000;
                let usable = self.retention.get(&retention_s).filter(|(_, until)| now < *until).map(|(l, _)| *l);
                let Some(lease) = usable else {
                    // Completed entries ride a retention lease: get one first.
                    let need_by_ms = o.entry.deadline_ms;
                    self.grant_retention(retention_s, need_by_ms, now);
                    return;
                };
                let state = if response.is_some() { State::Completed } else { State::CompletedNoBody };
                let bytes = response.as_ref().map_or(0, |r| r.stored_len() as u32);
                let entry =
                    Entry { state, deadline_ms: now.saturating_add(*retention_ms), since_ms: now, bytes, ..o.entry };
                let request =
                    Request::replace(&o.key, o.mod_revision, encode_entry(&entry, response.as_deref()), lease);
                if let Some(o) = self.owners.get_mut(&id) {
                    o.completed = Some(entry);
                }
                request
            }
            None => return,
        };
        let Some(o) = self.owners.get_mut(&id) else { return };
        let was_busy = o.busy;
        o.busy = true;
        let need_by_ms = o.entry.deadline_ms;
        if !self.send_by(request, Op::End { id }, need_by_ms, now) {
            if let Some(o) = self.owners.get_mut(&id) {
                o.busy = was_busy;
            }
        }
    }

    fn on_end(&mut self, id: u64, result: Result<TxnResult, EtcdError>, now: u64) {
        match result {
            Ok(TxnResult { current: Some(kv), succeeded: false, .. }) if self.adopt_if_ours(id, &kv) => {
                // A renewal of ours moved the revision on: send the ending again.
                if let Some(o) = self.owners.get_mut(&id) {
                    o.busy = false;
                }
            }
            Ok(TxnResult { current, succeeded: false, .. }) if self.ended_already(id, current.as_ref()) => {
                // An earlier send of this ending was applied, its answer lost: done.
                self.on_end(id, Ok(TxnResult { succeeded: true, revision: 0, current: None }), now)
            }
            Ok(TxnResult { succeeded, .. }) => {
                let Some(o) = self.owners.remove(&id) else { return };
                // etcd takes writes again: the endings it refused go now, not after their backoff.
                for other in self.owners.values_mut().filter(|o| !o.unanswered) {
                    other.retry.succeed();
                }
                if let (true, Some(entry), Some(Ending::Complete { response, .. })) =
                    (succeeded, &o.completed, &o.ending)
                {
                    self.keep_copy(&o.store_key, entry, response.as_deref(), now);
                }
                let answer = match (o.ending, succeeded) {
                    (Some(Ending::Release), done) => Answer::Released { done, change: Change::default() },
                    (Some(Ending::Complete { response, .. }), true) => {
                        let change = Change::default();
                        Answer::Completed(match response.is_some() {
                            true => Completed::Stored { change, response },
                            false => Completed::WithoutBody { change, response },
                        })
                    }
                    (Some(Ending::Complete { response, .. }), false) => Answer::Completed(Completed::Lost { response }),
                    (None, _) => return,
                };
                self.answers.push_back((For::Owner(o.owner), answer));
            }
            Err(err) => self.end_refused(id, &err, now),
        }
    }

    /// etcd did not take the ending: retried after a backoff, until it does. A response over
    /// etcd's request limit is completed without its body instead.
    fn end_refused(&mut self, id: u64, err: &EtcdError, now: u64) {
        if err.is_lease_not_found() {
            self.retention.clear();
        }
        self.note_no_space(err, now);
        let jitter = self.draw();
        let Some(o) = self.owners.get_mut(&id) else { return };
        o.busy = false;
        if err.kind() == ErrorKind::TooLarge {
            if let Some(Ending::Complete { response, .. }) = &mut o.ending {
                log::warn!("etcd: the response is over etcd's request limit; completing without it");
                *response = None;
                return;
            }
        }
        o.retry.fail(now, jitter);
        o.unanswered = err.kind() == ErrorKind::Unreachable;
        let owner = o.owner;
        log::warn!("etcd: completion or release not acknowledged ({err:?}); retrying");
        self.answers.push_back((For::Owner(owner), Answer::Refused { error: StoreError::Unavailable, response: None }));
    }
}
