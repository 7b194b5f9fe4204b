//! The store of one Envoy process: the table over shared data ([`Table`]). Every operation
//! answers at once; a completion or release the host refused is kept and retried from the
//! timer until it is acknowledged (SPEC §3.8). The timer also sweeps expired entries and
//! reports evictions to the effective-retention window.

use std::collections::VecDeque;

use crate::ids::IdMap;
use std::rc::Rc;

use super::{Answer, Began, CallAnswer, CallRequest, Claim, Completed, For, Owner, Store, TickReport};
use crate::encoding::StoredResponse;
use crate::table::{self, Begin, Change, Finish, ReplayCache, SharedKv, Table, Ticket};

/// Buckets swept per second and VM: a 1,024-bucket table is swept every 2.5 s per worker.
const SWEEP_PER_SECOND: u64 = 400;
/// How often this VM adds its evictions to the effective-retention window.
const RETENTION_REPORT_MS: u64 = 1_000;

enum Retry {
    Complete { owner: Owner, response: Option<Rc<StoredResponse>>, now_ms: u64, retention_ms: u64 },
    Release { owner: Owner },
}

pub struct SharedStore<S> {
    table: Table<S>,
    /// This VM's replays, kept (`replay_cache_bytes`).
    replays: ReplayCache,
    tickets: IdMap<u64, Ticket>,
    next_owner: u64,
    retries: Vec<Retry>,
    answers: VecDeque<(For, Answer)>,
    sweep_cursor: u32,
    sweep_per_tick: u32,
    /// The youngest age evicted here since the last report to the window.
    youngest_evicted_ms: Option<u64>,
    next_report_ms: u64,
}

impl<S: SharedKv> SharedStore<S> {
    /// `tick_ms`: the timer's period; `sweep_from`: the first bucket this VM sweeps (VMs
    /// start at different buckets).
    pub fn new(table: Table<S>, tick_ms: u64, sweep_from: u32) -> Self {
        let buckets = table.layout().buckets();
        SharedStore {
            table,
            replays: ReplayCache::new(0),
            tickets: IdMap::default(),
            next_owner: 1,
            retries: Vec::new(),
            answers: VecDeque::new(),
            sweep_cursor: sweep_from % buckets.max(1),
            sweep_per_tick: (SWEEP_PER_SECOND * tick_ms / 1000).max(1) as u32,
            youngest_evicted_ms: None,
            next_report_ms: 0,
        }
    }

    /// Keeps up to `bytes` of this VM's replays, so that the next replay of the same entry
    /// reads its bucket only.
    pub fn with_replay_cache(mut self, bytes: usize) -> Self {
        self.replays = ReplayCache::new(bytes);
        self
    }

    pub fn table(&self) -> &Table<S> {
        &self.table
    }

    fn note(&mut self, change: &Change) {
        if let Some(age) = change.youngest_evicted_ms {
            self.youngest_evicted_ms = Some(self.youngest_evicted_ms.map_or(age, |y| y.min(age)));
        }
    }

    fn try_complete(
        &mut self,
        owner: Owner,
        mut response: Option<Rc<StoredResponse>>,
        retention_ms: u64,
        now_ms: u64,
    ) -> Answer {
        let Some(ticket) = self.tickets.get(&owner.id).copied() else {
            return Answer::Completed(Completed::Lost { response });
        };
        // The table stamps the response in place: the lifecycle does not hold it meanwhile.
        let stamped = response.as_mut().map(Rc::make_mut);
        match self.table.complete_with(&ticket, stamped, now_ms, retention_ms, &mut self.replays) {
            Ok(done) => {
                self.tickets.remove(&owner.id);
                let completed = match done {
                    table::Completed::Stored(change) => Completed::Stored { change, response },
                    table::Completed::WithoutBody(change) => Completed::WithoutBody { change, response },
                    table::Completed::Lost => Completed::Lost { response },
                };
                if let Completed::Stored { change, .. } | Completed::WithoutBody { change, .. } = &completed {
                    let change = *change;
                    self.note(&change);
                }
                Answer::Completed(completed)
            }
            Err(error) => {
                self.retries.push(Retry::Complete { owner, response: response.clone(), now_ms, retention_ms });
                Answer::Refused { error, response }
            }
        }
    }

    fn try_release(&mut self, owner: Owner) -> Answer {
        let Some(ticket) = self.tickets.get(&owner.id).copied() else {
            return Answer::Released { done: false, change: Change::default() };
        };
        match self.table.release(&ticket) {
            Ok(finish) => {
                self.tickets.remove(&owner.id);
                let done = finish == Finish::Done;
                let change = if done { Change { in_progress: -1, ..Change::default() } } else { Change::default() };
                Answer::Released { done, change }
            }
            Err(error) => {
                self.retries.push(Retry::Release { owner });
                Answer::Refused { error, response: None }
            }
        }
    }

    /// Retries what the host refused; a write refused again stays (and is not counted again).
    fn retry(&mut self) {
        for retry in std::mem::take(&mut self.retries) {
            let (owner, answer) = match retry {
                Retry::Release { owner } => (owner, self.try_release(owner)),
                Retry::Complete { owner, response, now_ms, retention_ms } => {
                    (owner, self.try_complete(owner, response, retention_ms, now_ms))
                }
            };
            if !matches!(answer, Answer::Refused { .. }) {
                self.answers.push_back((For::Owner(owner), answer));
            }
        }
    }

    fn sweep(&mut self, now_ms: u64) -> Change {
        let buckets = self.table.layout().buckets();
        let mut total = Change::default();
        for _ in 0..self.sweep_per_tick.min(buckets) {
            match self.table.sweep(self.sweep_cursor, now_ms) {
                Ok(c) => {
                    total.in_progress += c.in_progress;
                    total.completed += c.completed;
                    total.bytes += c.bytes;
                    total.expired_marks += c.expired_marks;
                }
                Err(e) => log::debug!("sweep of bucket {} failed: {e:?}", self.sweep_cursor),
            }
            self.sweep_cursor = (self.sweep_cursor + 1) % buckets;
        }
        total
    }
}

fn began(begin: Begin, owner: Option<Owner>, now_ms: u64) -> Began {
    match (begin, owner) {
        (Begin::Claimed { takeover, change, .. }, Some(owner)) => {
            Began::Claimed { owner, takeover, change, leased_ms: now_ms }
        }
        (Begin::Claimed { .. }, None) | (Begin::InProgress, _) => Began::InProgress,
        (Begin::Replay(r), _) => Began::Replay(r),
        (Begin::CompletedWithoutBody, _) => Began::CompletedWithoutBody,
        (Begin::Mismatch, _) => Began::Mismatch,
        (Begin::Full, _) => Began::Full,
    }
}

impl<S: SharedKv> Store for SharedStore<S> {
    fn begin(&mut self, _who: For, claim: &Claim, now_ms: u64) -> Option<Answer> {
        let begin =
            match self.table.begin_with(&claim.key, &claim.fingerprint, now_ms, claim.lease_ms, &mut self.replays) {
                Ok(begin) => begin,
                Err(e) => return Some(Answer::Began(Began::Failed(e))),
            };
        let owner = match &begin {
            Begin::Claimed { ticket, change, .. } => {
                let change = *change;
                self.note(&change);
                let id = self.next_owner;
                self.next_owner += 1;
                self.tickets.insert(id, *ticket);
                Some(Owner { id, fence: ticket.gen })
            }
            _ => None,
        };
        Some(Answer::Began(began(begin, owner, now_ms)))
    }

    fn renew(&mut self, owner: Owner, lease_ms: u64, now_ms: u64) -> Option<Answer> {
        let Some(ticket) = self.tickets.get(&owner.id) else { return Some(Answer::Renewed(false)) };
        Some(match self.table.renew(ticket, now_ms, lease_ms) {
            Ok(Finish::Done) => Answer::Renewed(true),
            Ok(Finish::Lost) => Answer::Renewed(false),
            Err(e) => {
                log::warn!("renewal failed: {e:?}");
                Answer::Renewed(true) // tried again at the next renewal
            }
        })
    }

    fn complete(
        &mut self,
        owner: Owner,
        response: Option<Rc<StoredResponse>>,
        retention_ms: u64,
        now_ms: u64,
    ) -> Option<Answer> {
        Some(self.try_complete(owner, response, retention_ms, now_ms))
    }

    fn release(&mut self, owner: Owner, _now_ms: u64) -> Option<Answer> {
        Some(self.try_release(owner))
    }

    fn forget(&mut self, owner: Owner) {
        self.tickets.remove(&owner.id);
    }

    fn tick(&mut self, now_ms: u64) -> TickReport {
        self.retry();
        let change = self.sweep(now_ms);
        let mut report = TickReport { change, effective_retention_ms: None };
        if now_ms >= self.next_report_ms {
            self.next_report_ms = now_ms + RETENTION_REPORT_MS;
            match self.table.note_evictions(now_ms, self.youngest_evicted_ms) {
                Ok(ms) => {
                    self.youngest_evicted_ms = None;
                    report.effective_retention_ms = Some(ms);
                }
                Err(e) => log::debug!("eviction window not updated: {e:?}"),
            }
        }
        report
    }

    fn poll_answer(&mut self) -> Option<(For, Answer)> {
        self.answers.pop_front()
    }

    fn poll_call(&mut self) -> Option<(u64, CallRequest)> {
        None
    }

    fn poll_count(&mut self) -> Option<crate::metrics::Counter> {
        None
    }

    fn on_call_answer(&mut self, _call: u64, _answer: &CallAnswer, _now_ms: u64) {}

    fn on_call_failed(&mut self, _call: u64, _now_ms: u64) {}

    fn wait_poll_ms(&self) -> u64 {
        0 // every tick: a table read is cheap
    }

    fn answers_at_once(&self) -> bool {
        true
    }

    fn write_wait_ms(&self) -> u64 {
        0
    }

    fn is_idle(&self) -> bool {
        self.retries.is_empty() && self.answers.is_empty()
    }
}
