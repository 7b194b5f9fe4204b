//! The store of one Envoy process: the table over shared data ([`Table`]). Every operation
//! answers at once; a completion or release the host refused is kept and retried from the
//! timer until it is acknowledged (docs/behaviour.md §3.8). The timer also sweeps expired entries and
//! reports evictions to the effective-retention window.

use std::collections::VecDeque;

use crate::ids::IdMap;
use std::rc::Rc;

use super::{Answer, Began, CallAnswer, CallRequest, Claim, Completed, For, Owner, Store, TickReport};
use crate::encoding::StoredResponse;
use crate::fingerprint::Fingerprint;
use crate::host::SharedKv;
use crate::key::StoreKey;
use crate::store::table::{self, Census, Finish, Heaviest, ReplayCache, Table, Ticket, Verdict};
use crate::store::Change;

/// Buckets swept per second and VM: a 1,024-bucket table is swept every 2.5 s per worker.
const SWEEP_PER_SECOND: u64 = 400;
/// How often this VM adds its evictions to the effective-retention window.
const RETENTION_REPORT_MS: u64 = 1_000;
/// A caller holding more than this share (thousandths) of the table's entries or bytes while
/// it evicts is logged as flooding, once a minute per Envoy.
const FLOOD_PERMILLE: u64 = 500;
const FLOOD_LOG_MS: u64 = 60_000;

enum Retry {
    Complete { owner: Owner, response: Option<Rc<StoredResponse>>, now_ms: u64, retention_ms: u64 },
    Release { owner: Owner },
}

/// A claim this VM holds, as its last acknowledged write left it in the table.
struct HeldClaim {
    key: StoreKey,
    fingerprint: Fingerprint,
    /// The entry's deadline as this VM last wrote it: until then no other worker can take the
    /// entry over (a takeover needs the deadline passed) and only this VM completes or
    /// releases it, so the entry is in progress without reading its bucket.
    live_until_ms: u64,
}

pub struct SharedStore<S> {
    table: Table<S>,
    /// This VM's replays, kept (`replay_cache_bytes`).
    replays: ReplayCache,
    tickets: IdMap<u64, Ticket>,
    /// The claims this VM holds (by owner id), and the owner of each by the first 8 bytes of
    /// its store key (a SHA-256's: no caller chooses them; two that meet only miss).
    held: IdMap<u64, HeldClaim>,
    held_by_key: IdMap<u64, u64>,
    /// The latest time this VM has read: a clock that steps back (wall time) could make a
    /// passed deadline look ahead, so below it nothing is answered from `held`.
    clock_high_ms: u64,
    next_owner: u64,
    retries: Vec<Retry>,
    answers: VecDeque<(For, Answer)>,
    sweep_cursor: u32,
    sweep_per_tick: u32,
    /// The youngest age evicted here since the last report to the window.
    youngest_evicted_ms: Option<u64>,
    next_report_ms: u64,
    /// Who holds the table, counted by the sweep; and the Envoy's last effective retention
    /// (0: nothing evicted in the last minute).
    census: Census,
    effective_retention_ms: u64,
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
            held: IdMap::default(),
            held_by_key: IdMap::default(),
            clock_high_ms: 0,
            next_owner: 1,
            retries: Vec::new(),
            answers: VecDeque::new(),
            sweep_cursor: sweep_from % buckets.max(1),
            sweep_per_tick: (SWEEP_PER_SECOND * tick_ms / 1000).max(1) as u32,
            youngest_evicted_ms: None,
            next_report_ms: 0,
            census: Census::default(),
            effective_retention_ms: 0,
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

    /// A retry of a claim this VM holds, same fingerprint, before the deadline it wrote: in
    /// progress, and the bucket need not be read to know it (a different fingerprint, or a
    /// deadline reached, reads the bucket as any other request).
    fn holds_live(&self, claim: &Claim, now_ms: u64) -> bool {
        if now_ms < self.clock_high_ms {
            return false;
        }
        let Some(id) = self.held_by_key.get(&key_prefix(&claim.key)) else { return false };
        self.held
            .get(id)
            .is_some_and(|h| h.key == claim.key && h.fingerprint == claim.fingerprint && now_ms < h.live_until_ms)
    }

    fn hold(&mut self, id: u64, claim: &Claim, now_ms: u64) {
        let live_until_ms = now_ms.saturating_add(claim.lease_ms);
        self.held.insert(id, HeldClaim { key: claim.key, fingerprint: claim.fingerprint, live_until_ms });
        self.held_by_key.insert(key_prefix(&claim.key), id);
    }

    fn unhold(&mut self, id: u64) {
        if let Some(h) = self.held.remove(&id) {
            let prefix = key_prefix(&h.key);
            if self.held_by_key.get(&prefix) == Some(&id) {
                self.held_by_key.remove(&prefix);
            }
        }
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
        // From here on the bucket says what became of the claim (a write refused by the host
        // may still have landed in part).
        self.unhold(owner.id);
        let Some(ticket) = self.tickets.get(&owner.id).copied() else {
            return Answer::Completed(Completed::Lost { response });
        };
        // The table stamps the response in place: the lifecycle does not hold it meanwhile.
        let stamped = response.as_mut().map(Rc::make_mut);
        match self.table.complete_with(&ticket, stamped, now_ms, retention_ms, &mut self.replays) {
            Ok(done) => {
                self.tickets.remove(&owner.id);
                let completed = match done {
                    table::Completion::Stored(change) => Completed::Stored { change, response },
                    table::Completion::WithoutBody(change) => Completed::WithoutBody { change, response },
                    table::Completion::Lost => Completed::Lost { response },
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
        self.unhold(owner.id);
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

    /// Frees expired entries a few buckets at a time; at the end of a pass over the table,
    /// who held it.
    fn sweep(&mut self, now_ms: u64) -> (Change, Option<Heaviest>) {
        let buckets = self.table.layout().buckets();
        let mut total = Change::default();
        let mut heaviest = None;
        for _ in 0..self.sweep_per_tick.min(buckets) {
            let swept = self.table.sweep(self.sweep_cursor, now_ms, Some(&mut self.census));
            heaviest = self.census.bucket_done(buckets).or(heaviest);
            match swept {
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
        (total, heaviest)
    }

    /// A caller that holds most of the table while it evicts is named in the log (by its tag,
    /// never its scope), once a minute per Envoy.
    fn tell_flood(&self, heaviest: &Heaviest, now_ms: u64) {
        let most = heaviest.entries_permille.max(heaviest.bytes_permille);
        if self.effective_retention_ms == 0
            || most <= FLOOD_PERMILLE
            || !self.table.take_turn("flood", now_ms, FLOOD_LOG_MS)
        {
            return;
        }
        log::warn!(
            "fair share: caller {} holds {}.{}% of the table's entries and {}.{}% of its stored bytes while the table evicts (answers {} ms old are being evicted); evictions take its own oldest answers first. tools/caller_tag.py --key <this Envoy's secret, logged at start> gives a scope's tag. Logged once a minute",
            heaviest.caller.short(),
            heaviest.entries_permille / 10,
            heaviest.entries_permille % 10,
            heaviest.bytes_permille / 10,
            heaviest.bytes_permille % 10,
            self.effective_retention_ms,
        );
    }
}

fn key_prefix(key: &StoreKey) -> u64 {
    crate::bytes::u64_at(&key.0, 0)
}

fn began(begin: Verdict, owner: Option<Owner>, now_ms: u64) -> Began {
    match (begin, owner) {
        (Verdict::Claimed { takeover, change, .. }, Some(owner)) => {
            Began::Claimed { owner, takeover, change, leased_ms: now_ms }
        }
        (Verdict::Claimed { .. }, None) | (Verdict::InProgress, _) => Began::InProgress,
        (Verdict::Replay(r), _) => Began::Replay(r),
        (Verdict::CompletedWithoutBody, _) => Began::CompletedWithoutBody,
        (Verdict::Mismatch, _) => Began::Mismatch,
        (Verdict::Full { retry_after_ms }, _) => Began::Full { retry_after_s: retry_after_ms.div_ceil(1000).max(1) },
    }
}

impl<S: SharedKv> Store for SharedStore<S> {
    fn begin(&mut self, _who: For, claim: &Claim, now_ms: u64) -> Option<Answer> {
        let held = self.holds_live(claim, now_ms);
        self.clock_high_ms = self.clock_high_ms.max(now_ms);
        if held {
            return Some(Answer::Began(Began::InProgress));
        }
        let begin = match self.table.begin_with(
            &claim.key,
            &claim.fingerprint,
            claim.caller,
            now_ms,
            claim.lease_ms,
            &mut self.replays,
        ) {
            Ok(begin) => begin,
            Err(e) => return Some(Answer::Began(Began::Failed(e))),
        };
        let owner = match &begin {
            Verdict::Claimed { ticket, change, .. } => {
                let change = *change;
                self.note(&change);
                let id = self.next_owner;
                self.next_owner += 1;
                self.tickets.insert(id, *ticket);
                self.hold(id, claim, now_ms);
                Some(Owner { id, fence: ticket.gen })
            }
            _ => None,
        };
        Some(Answer::Began(began(begin, owner, now_ms)))
    }

    fn renew(&mut self, owner: Owner, lease_ms: u64, now_ms: u64) -> Option<Answer> {
        let Some(ticket) = self.tickets.get(&owner.id) else { return Some(Answer::Renewed(false)) };
        Some(match self.table.renew(ticket, now_ms, lease_ms) {
            Ok(Finish::Done) => {
                if let Some(h) = self.held.get_mut(&owner.id) {
                    h.live_until_ms = h.live_until_ms.max(now_ms.saturating_add(lease_ms));
                }
                Answer::Renewed(true)
            }
            Ok(Finish::Lost) => {
                self.unhold(owner.id);
                Answer::Renewed(false)
            }
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
        self.unhold(owner.id);
    }

    fn tick(&mut self, now_ms: u64) -> TickReport {
        self.clock_high_ms = self.clock_high_ms.max(now_ms);
        self.retry();
        let (change, heaviest) = self.sweep(now_ms);
        if let Some(h) = &heaviest {
            self.tell_flood(h, now_ms);
        }
        let mut report = TickReport { change, heaviest, ..TickReport::default() };
        if now_ms >= self.next_report_ms {
            self.next_report_ms = now_ms + RETENTION_REPORT_MS;
            match self.table.note_evictions(now_ms, self.youngest_evicted_ms) {
                Ok(ms) => {
                    self.youngest_evicted_ms = None;
                    self.effective_retention_ms = ms;
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

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::rc::Rc;

    use super::*;
    use crate::host::memory::MemoryKv;
    use crate::host::KvError;
    use crate::store::table::Layout;

    /// Shared data that counts its reads: a retry of this VM's claim must not need one.
    #[derive(Default)]
    struct CountingKv {
        kv: MemoryKv,
        reads: Cell<usize>,
        refuse_writes: Cell<bool>,
    }

    impl SharedKv for CountingKv {
        fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), KvError> {
            self.reads.set(self.reads.get() + 1);
            self.kv.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), KvError> {
            if self.refuse_writes.get() {
                return Err(KvError::Host(10));
            }
            self.kv.set(key, value, cas)
        }
    }

    const LEASE_MS: u64 = 2_000;

    fn kv() -> &'static CountingKv {
        Box::leak(Box::new(CountingKv::default()))
    }

    fn store(kv: &'static CountingKv) -> SharedStore<&'static CountingKv> {
        let table = Table::new(kv, Layout::new("t", 256, 1 << 20));
        table.create().unwrap();
        SharedStore::new(table, 50, 0)
    }

    fn claim(key: &str, fingerprint: u8) -> Claim {
        let key = StoreKey::derive("t", b"api", &[Some(b"caller")], key.as_bytes());
        Claim {
            key,
            fingerprint: Fingerprint([fingerprint; 16]),
            caller: crate::caller::Caller::ANONYMOUS,
            established: true,
            lease_ms: LEASE_MS,
        }
    }

    fn response() -> Rc<StoredResponse> {
        Rc::new(StoredResponse::new(201, [("content-type", b"application/json".as_slice())], b"{}".to_vec()))
    }

    fn begin(s: &mut SharedStore<&'static CountingKv>, c: &Claim, now: u64) -> Began {
        match s.begin(For::Stream(1), c, now) {
            Some(Answer::Began(b)) => b,
            other => panic!("not an answer to a claim: {other:?}"),
        }
    }

    fn owner(b: &Began) -> Owner {
        match b {
            Began::Claimed { owner, .. } => *owner,
            other => panic!("not claimed: {other:?}"),
        }
    }

    #[test]
    fn a_retry_of_this_vms_claim_is_in_progress_without_a_read() {
        let kv = kv();
        let mut s = store(kv);
        let c = claim("k", 1);
        owner(&begin(&mut s, &c, 1_000));
        let reads = kv.reads.get();
        for now in [1_000, 1_500, 2_999] {
            assert!(matches!(begin(&mut s, &c, now), Began::InProgress));
        }
        assert_eq!(kv.reads.get(), reads, "answered from what this VM holds");
    }

    #[test]
    fn another_fingerprint_or_another_vm_reads_the_bucket() {
        let kv = kv();
        let mut s = store(kv);
        owner(&begin(&mut s, &claim("k", 1), 1_000));
        let reads = kv.reads.get();
        assert!(matches!(begin(&mut s, &claim("k", 2), 1_100), Began::Mismatch));
        assert!(kv.reads.get() > reads);
        // Another worker's VM holds nothing of it: its bucket says in progress.
        let mut other = store(kv);
        let reads = kv.reads.get();
        assert!(matches!(begin(&mut other, &claim("k", 1), 1_200), Began::InProgress));
        assert!(kv.reads.get() > reads);
    }

    #[test]
    fn at_the_deadline_it_wrote_the_bucket_decides_and_a_renewal_moves_it() {
        let kv = kv();
        let mut s = store(kv);
        let c = claim("k", 1);
        let first = owner(&begin(&mut s, &c, 1_000));
        // Renewed at 2,000: the entry lives until 4,000, and so does what this VM knows.
        assert!(matches!(s.renew(first, LEASE_MS, 2_000), Some(Answer::Renewed(true))));
        let reads = kv.reads.get();
        assert!(matches!(begin(&mut s, &c, 3_999), Began::InProgress));
        assert_eq!(kv.reads.get(), reads);
        // At its deadline the mark has expired: the retry reads the bucket and takes it over.
        match begin(&mut s, &c, 4_000) {
            Began::Claimed { takeover, .. } => assert!(takeover),
            other => panic!("expected a takeover, got {other:?}"),
        }
        assert!(kv.reads.get() > reads);
        // The first owner's renewal finds its mark lost, and nothing of it answers a retry.
        assert!(matches!(s.renew(first, LEASE_MS, 4_100), Some(Answer::Renewed(false))));
        assert!(!s.held.contains_key(&first.id));
    }

    #[test]
    fn completed_or_released_the_retry_reads_the_bucket_again() {
        let kv = kv();
        let mut s = store(kv);
        let c = claim("done", 1);
        let o = owner(&begin(&mut s, &c, 1_000));
        assert!(matches!(
            s.complete(o, Some(response()), 60_000, 1_100),
            Some(Answer::Completed(Completed::Stored { .. }))
        ));
        assert!(matches!(begin(&mut s, &c, 1_200), Began::Replay(_)));
        let c = claim("released", 1);
        let o = owner(&begin(&mut s, &c, 1_000));
        assert!(matches!(s.release(o, 1_100), Some(Answer::Released { done: true, .. })));
        owner(&begin(&mut s, &c, 1_200));
        assert!(s.held.len() == 1 && s.held_by_key.len() == 1, "one claim held: the last");
    }

    #[test]
    fn a_forgotten_claim_is_no_longer_answered_for() {
        let kv = kv();
        let mut s = store(kv);
        let c = claim("k", 1);
        let o = owner(&begin(&mut s, &c, 1_000));
        s.forget(o);
        let reads = kv.reads.get();
        assert!(matches!(begin(&mut s, &c, 1_100), Began::InProgress), "its mark stays until it expires");
        assert!(kv.reads.get() > reads);
        assert!(s.held.is_empty() && s.held_by_key.is_empty());
    }

    #[test]
    fn once_its_owner_completes_or_releases_the_bucket_answers_even_if_the_write_was_refused() {
        let kv = kv();
        let mut s = store(kv);
        let c = claim("k", 1);
        let o = owner(&begin(&mut s, &c, 1_000));
        kv.refuse_writes.set(true);
        assert!(matches!(s.complete(o, Some(response()), 60_000, 1_100), Some(Answer::Refused { .. })));
        kv.refuse_writes.set(false);
        let reads = kv.reads.get();
        assert!(matches!(begin(&mut s, &c, 1_200), Began::InProgress), "the refused write left it in progress");
        assert!(kv.reads.get() > reads, "read, not answered from what the owner held");
        let c = claim("r", 1);
        let o = owner(&begin(&mut s, &c, 1_300));
        kv.refuse_writes.set(true);
        assert!(matches!(s.release(o, 1_400), Some(Answer::Refused { .. })));
        kv.refuse_writes.set(false);
        let reads = kv.reads.get();
        assert!(matches!(begin(&mut s, &c, 1_500), Began::InProgress));
        assert!(kv.reads.get() > reads);
    }

    #[test]
    fn a_clock_stepped_back_reads_the_bucket() {
        let kv = kv();
        let mut s = store(kv);
        let c = claim("k", 1);
        owner(&begin(&mut s, &c, 1_000));
        s.tick(2_500);
        let reads = kv.reads.get();
        assert!(matches!(begin(&mut s, &c, 1_500), Began::InProgress));
        assert!(kv.reads.get() > reads, "below the latest time seen, nothing is answered from memory");
        let reads = kv.reads.get();
        assert!(matches!(begin(&mut s, &c, 2_600), Began::InProgress));
        assert_eq!(kv.reads.get(), reads);
    }
}

#[cfg(test)]
mod census_tests {
    use std::rc::Rc;

    use super::*;
    use crate::caller::Caller;
    use crate::host::memory::MemoryKv;
    use crate::store::table::Layout;

    fn store_for(s: &mut SharedStore<MemoryKv>, scope: &str, n: u64, body: usize, now: u64) {
        let scopes = [Some(scope.as_bytes())];
        let key = StoreKey::derive("t", b"api", &scopes, n.to_string().as_bytes());
        let claim = Claim {
            key,
            fingerprint: Fingerprint([1; 16]),
            caller: Caller::of(&crate::caller::TagKey::default(), &scopes),
            established: true,
            lease_ms: 2_000,
        };
        let Some(Answer::Began(Began::Claimed { owner, .. })) = s.begin(For::Stream(1), &claim, now) else {
            panic!("not claimed")
        };
        let response = Rc::new(StoredResponse::new(200, [("a", b"b".as_slice())], vec![b'x'; body]));
        assert!(matches!(s.complete(owner, Some(response), 60_000, now), Some(Answer::Completed(_))));
    }

    #[test]
    fn a_sweep_pass_reports_the_heaviest_caller() {
        let table = Table::new(MemoryKv::new(), Layout::new("t", 256, 1 << 20));
        table.create().unwrap();
        let mut s = SharedStore::new(table, 50, 0);
        for n in 0..8 {
            store_for(&mut s, "Bearer quiet", n, 900, 1_000);
        }
        for n in 0..40 {
            store_for(&mut s, "Bearer busy", n, 10, 1_000);
        }
        // 20 buckets a tick, 4 buckets in the table: the first tick finishes a pass.
        let heaviest = s.tick(1_050).heaviest.expect("a pass over 4 buckets ends within a tick");
        assert_eq!(heaviest.caller, Caller::of(&crate::caller::TagKey::default(), &[Some(b"Bearer busy")]));
        assert_eq!(heaviest.entries_permille, 833, "40 of 48 entries");
        assert!((1..300).contains(&heaviest.bytes_permille), "its answers are small: {heaviest:?}");
        assert!(s.table().take_turn("flood", 1_050, 60_000), "the first asker speaks");
        assert!(!s.table().take_turn("flood", 2_000, 60_000), "then nobody for a minute");
        assert!(s.table().take_turn("flood", 61_050, 60_000));
    }
}
