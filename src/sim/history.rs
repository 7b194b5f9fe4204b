//! What the store models held for each simulated key, over time: the world's own record of
//! who held a key when (docs/simulator.md, "The oracle"). It is read off the models' bytes
//! (Envoy's shared data, each etcd cluster) after every write they take, never off the plugin's
//! view of them.

use std::collections::BTreeMap;

use crate::encoding::{Bucket, Entry, State};

/// A simulated key: (caller, key).
pub type KeyId = (u64, u64);

/// What a key held from `at` on.
#[derive(Debug, Clone, Copy)]
pub struct Mark {
    /// True time of the write (or of etcd dropping the key with its lease).
    pub at: u64,
    /// The VM whose write it was (`None`: etcd dropped the key when its lease ended).
    pub by_vm: Option<usize>,
    /// `None`: the key holds nothing (released, never claimed, dropped).
    pub entry: Option<Entry>,
    /// etcd: the key's `mod_revision` (the fencing token of a claim); 0 on shared data.
    pub revision: i64,
    /// etcd: whether the write's answer reached its VM before the call timed out. A claim
    /// whose answer was lost is one its VM does not know it holds.
    pub acknowledged: bool,
}

impl Mark {
    /// The claim token of an in-progress mark.
    pub fn in_progress(&self) -> Option<u64> {
        self.entry.filter(|e| e.state == State::InProgress).map(|e| e.gen)
    }

    pub fn completed(&self) -> bool {
        self.entry.is_some_and(|e| e.state.is_completed())
    }
}

/// One claim of a key, as the store saw it: its first mark and the mark that ended it.
#[derive(Debug, Clone, Copy)]
pub struct Claim {
    pub gen: u64,
    pub at: u64,
    pub by_vm: Option<usize>,
    /// The fencing token the plugin must send with it: the bucket's token on shared data,
    /// the claim's revision on etcd.
    pub fence: u64,
    pub acknowledged: bool,
}

#[derive(Default)]
pub struct History {
    marks: BTreeMap<KeyId, Vec<Mark>>,
    /// Shared data: a key's bucket name and tag; etcd: its key name.
    keys: Vec<(KeyId, Locator)>,
}

#[derive(Clone)]
pub enum Locator {
    Bucket { name: String, tag: [u8; 16] },
    Etcd { name: Vec<u8> },
}

/// The entry a shared-data bucket holds for `tag`, if any (a free entry holds nothing).
pub fn bucket_entry(bytes: &[u8], tag: &[u8; 16]) -> Option<Entry> {
    let bucket = Bucket::decode(bytes.to_vec()).ok()?;
    let entry = bucket.entry(bucket.find_key(tag)?).ok()?;
    (entry.state != State::Free).then_some(entry)
}

impl History {
    pub fn new(keys: Vec<(KeyId, Locator)>) -> History {
        History { marks: BTreeMap::new(), keys }
    }

    pub fn locators(&self) -> &[(KeyId, Locator)] {
        &self.keys
    }

    /// Records what `key` holds now, if that changed (state, token, deadline or revision).
    pub fn note(&mut self, key: KeyId, mark: Mark) {
        let marks = self.marks.entry(key).or_default();
        let same = |last: &Mark| {
            let view = |e: &Option<Entry>| e.map(|e| (e.state as u8, e.gen, e.deadline_ms));
            view(&last.entry) == view(&mark.entry) && last.revision == mark.revision
        };
        if marks.last().is_some_and(same) {
            return;
        }
        if marks.is_empty() && mark.entry.is_none() {
            return;
        }
        marks.push(mark);
    }

    pub fn marks(&self, key: KeyId) -> &[Mark] {
        self.marks.get(&key).map(Vec::as_slice).unwrap_or_default()
    }

    /// What `key` held at `t` (the last write at or before it).
    pub fn at(&self, key: KeyId, t: u64) -> Option<&Mark> {
        self.marks(key).iter().rev().find(|m| m.at <= t)
    }

    /// The claim whose token is `gen`.
    pub fn claim(&self, key: KeyId, gen: u64) -> Option<Claim> {
        let first = self.marks(key).iter().find(|m| m.in_progress() == Some(gen))?;
        Some(Claim {
            gen,
            at: first.at,
            by_vm: first.by_vm,
            fence: if first.revision > 0 { first.revision as u64 } else { gen },
            acknowledged: first.acknowledged,
        })
    }

    /// The last claim of `key` that `vm` made in `from..=to` and learnt it made (its answer
    /// came back in time).
    pub fn claim_by(&self, key: KeyId, vm: usize, from: u64, to: u64) -> Option<Claim> {
        let gens = self.marks(key).iter().filter(|m| from <= m.at && m.at <= to).filter_map(Mark::in_progress);
        let claims = gens.filter_map(|gen| self.claim(key, gen));
        claims.filter(|c| c.by_vm == Some(vm) && c.acknowledged && from <= c.at && c.at <= to).max_by_key(|c| c.at)
    }

    /// How claim `gen` ended: the first mark after it began that is not it in progress.
    pub fn end_of(&self, key: KeyId, gen: u64) -> Option<&Mark> {
        let marks = self.marks(key);
        let start = marks.iter().position(|m| m.in_progress() == Some(gen))?;
        marks.iter().skip(start).find(|m| m.in_progress() != Some(gen))
    }

    /// Claim `gen`'s last deadline and the write that set it, before `t`.
    pub fn last_deadline(&self, key: KeyId, gen: u64, t: u64) -> Option<&Mark> {
        self.marks(key).iter().rev().filter(|m| m.at < t).find(|m| m.in_progress() == Some(gen))
    }

    /// Whether `key` held a completed entry all through `from..=to`.
    pub fn completed_throughout(&self, key: KeyId, from: u64, to: u64) -> bool {
        let Some(first) = self.at(key, from) else { return false };
        first.completed() && self.marks(key).iter().filter(|m| from < m.at && m.at <= to).all(Mark::completed)
    }
}
