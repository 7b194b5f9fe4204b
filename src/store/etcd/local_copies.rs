//! Each Envoy's own copy of the completed entries it has seen in etcd (`store.local_replays`).
//! A completed entry never changes until its retention ends (docs/behaviour.md §3.8), so a replay, a
//! non-retryable 409 or a 422 it decides needs no round trip: only what this Envoy has not
//! seen goes to etcd. The copies live in the process's shared data, in a table of their own
//! bounded by `capacity` and `max_store_bytes` like the single-Envoy store and evicted by the
//! same fair rule (the heaviest caller's oldest copy first); an evicted copy only costs a
//! round trip.

use crate::caller::Caller;
use crate::encoding::StoredResponse;
use crate::fingerprint::Fingerprint;
use crate::host::SharedKv;
use crate::key::StoreKey;
use crate::store::table::{ReplayCache, Table, Verdict};
use crate::store::Began;
use crate::store::Change;

/// Buckets swept per tick: a 1,024-bucket cache is swept every few seconds per worker.
const SWEEP_PER_TICK: u32 = 20;

pub trait Replays {
    /// What a copy here decides for this request, if there is one.
    fn lookup(&mut self, key: &StoreKey, fingerprint: &Fingerprint, now_ms: u64) -> Option<Began>;
    /// Keeps a copy of a completed entry until `deadline_ms`.
    fn keep(
        &mut self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        caller: Caller,
        response: Option<&StoredResponse>,
        deadline_ms: u64,
        now_ms: u64,
    );
    /// Frees expired copies, a few buckets at a time; what the copies changed since the last
    /// call (for the gauges).
    fn tick(&mut self, now_ms: u64) -> Change;
}

pub struct LocalReplays<S> {
    table: Table<S>,
    /// This VM's replays of copies, kept (`replay_cache_bytes`).
    cache: ReplayCache,
    cursor: u32,
    change: Change,
}

impl<S: SharedKv> LocalReplays<S> {
    pub fn new(table: Table<S>, sweep_from: u32, cache_bytes: usize) -> Self {
        let cursor = sweep_from % table.layout().buckets().max(1);
        LocalReplays { table, cache: ReplayCache::new(cache_bytes), cursor, change: Change::default() }
    }

    fn add(&mut self, c: Change) {
        self.change.in_progress += c.in_progress;
        self.change.completed += c.completed;
        self.change.bytes += c.bytes;
        self.change.evicted += c.evicted;
        self.change.evicted_below_share += c.evicted_below_share;
        self.change.expired_marks += c.expired_marks;
    }
}

impl<S: SharedKv> Replays for LocalReplays<S> {
    fn lookup(&mut self, key: &StoreKey, fingerprint: &Fingerprint, now_ms: u64) -> Option<Began> {
        match self.table.lookup_with(key, fingerprint, now_ms, &mut self.cache) {
            Ok(Some(Verdict::Replay(r))) => Some(Began::Replay(r)),
            Ok(Some(Verdict::CompletedWithoutBody)) => Some(Began::CompletedWithoutBody),
            Ok(Some(Verdict::Mismatch)) => Some(Began::Mismatch),
            Ok(_) => None,
            Err(e) => {
                log::debug!("local replays: lookup failed ({e:?}); asking etcd");
                None
            }
        }
    }

    fn keep(
        &mut self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        caller: Caller,
        response: Option<&StoredResponse>,
        deadline_ms: u64,
        now_ms: u64,
    ) {
        match self.table.keep(key, fingerprint, caller, response, deadline_ms, now_ms) {
            Ok(change) => self.add(change),
            Err(e) => log::debug!("local replays: keeping a copy failed ({e:?})"),
        }
    }

    fn tick(&mut self, now_ms: u64) -> Change {
        let buckets = self.table.layout().buckets();
        for _ in 0..SWEEP_PER_TICK.min(buckets) {
            match self.table.sweep(self.cursor, now_ms, None) {
                Ok(c) => self.add(c),
                Err(e) => log::debug!("local replays: sweep failed ({e:?})"),
            }
            self.cursor = (self.cursor + 1) % buckets;
        }
        // Marks here are transient (a copy being written), not work in progress: not shown.
        let change = Change { in_progress: 0, expired_marks: 0, ..self.change };
        self.change = Change::default();
        change
    }
}
