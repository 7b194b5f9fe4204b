//! The rules every store shares: the error a store answers with, what an operation changed
//! (for the gauges), and the decision on one key's entry (docs/behaviour.md §3.2–3.5). The
//! shared-data table decides over a bucket of entries, etcd over the key's one value; both
//! judge a live entry the same way here.

use crate::defects::{planted, Defect};
use crate::encoding::{Corrupt, Entry, State};
use crate::fingerprint::Fingerprint;
use crate::host::KvError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreError {
    Kv(KvError),
    /// A value in the store is not ours or is damaged.
    Corrupt(&'static str),
    /// The table has not been created (the base VM's `on_configure` did not run).
    Missing,
    /// Too many CAS conflicts in a row.
    Contention,
    /// The store did not answer (etcd down, unreachable, timed out).
    Unavailable,
}

impl From<KvError> for StoreError {
    fn from(e: KvError) -> Self {
        StoreError::Kv(e)
    }
}

impl From<Corrupt> for StoreError {
    fn from(e: Corrupt) -> Self {
        StoreError::Corrupt(e.0)
    }
}

/// What an operation changed in a store, for the gauges and counters (docs/behaviour.md §3.7).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Change {
    pub in_progress: i64,
    pub completed: i64,
    /// Bytes of stored responses.
    pub bytes: i64,
    /// Live completed entries pushed out to make room.
    pub evicted: u32,
    /// How old the youngest of them was.
    pub youngest_evicted_ms: Option<u64>,
    /// Of `evicted`, those whose caller held less than an even share of the bucket (fair
    /// share makes this 0 unless the heavier callers hold nothing but marks).
    pub evicted_below_share: u32,
    /// In-progress marks freed after their deadline: their owner is gone.
    pub expired_marks: u32,
}

impl Change {
    /// An entry leaves the table (`evicted`: it was live, pushed out to make room).
    pub(crate) fn remove(&mut self, entry: &Entry, now_ms: u64, evicted: bool) {
        match entry.state {
            State::Free => return,
            State::InProgress => {
                self.in_progress -= 1;
                self.expired_marks += 1;
            }
            State::Completed | State::CompletedNoBody => self.completed -= 1,
        }
        self.bytes -= i64::from(entry.bytes);
        if evicted {
            self.evicted += 1;
            let age = now_ms.saturating_sub(entry.since_ms);
            self.youngest_evicted_ms = Some(self.youngest_evicted_ms.map_or(age, |y| y.min(age)));
        }
    }
}

/// The pure decision for one request against its bucket (docs/behaviour.md §3.3–3.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Take `entry`: free, expired, or the oldest completed entry of the caller holding the
    /// most of the bucket (evicted; `below_share` when that caller held less than its share,
    /// which happens only when the heavier ones hold nothing but marks).
    Claim {
        entry: usize,
        takeover: bool,
        below_share: bool,
    },
    InProgress,
    Completed {
        entry: usize,
        no_body: bool,
    },
    Mismatch,
    /// Nothing evictable: `retry_after_ms` until room frees up.
    Full {
        retry_after_ms: u64,
    },
}

/// A planted defect: a live in-progress mark taken as expired.
pub(crate) fn taken_as_expired(entry: &Entry) -> bool {
    planted(Defect::LiveMarkTakenOver) && entry.state == State::InProgress
}

/// A live entry of the request's key: conflict, replay or mismatch.
pub(crate) fn judge_live(entry: &Entry, index: usize, fingerprint: &Fingerprint) -> Decision {
    if entry.fingerprint != *fingerprint && !planted(Defect::MismatchReplayed) {
        return Decision::Mismatch;
    }
    match entry.state {
        State::InProgress => Decision::InProgress,
        State::Completed => Decision::Completed { entry: index, no_body: false },
        State::CompletedNoBody => Decision::Completed { entry: index, no_body: true },
        State::Free => Decision::Claim { entry: index, takeover: false, below_share: false },
    }
}

/// The decision for a store that keeps one value per key (etcd): `entry` is the key's value,
/// if any. A claim's `entry` is meaningless there (0).
pub fn decide_entry(entry: Option<&Entry>, fingerprint: &Fingerprint, now_ms: u64) -> Decision {
    match entry {
        Some(entry) if entry.is_live(now_ms) && !taken_as_expired(entry) => judge_live(entry, 0, fingerprint),
        Some(entry) => Decision::Claim { entry: 0, takeover: entry.state == State::InProgress, below_share: false },
        None => Decision::Claim { entry: 0, takeover: false, below_share: false },
    }
}
