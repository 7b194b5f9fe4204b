//! The idempotency state machine (docs/behaviour.md §3), sans I/O: it sees the store through [`SharedKv`]
//! and the time as a number the caller passes in.
//!
//! # Layout
//! The table has `buckets` buckets of [`ENTRIES`] entries. A store key hashes to one bucket; the
//! bucket is one shared-data key holding the headers of its entries (state, owner token,
//! fingerprint, deadline, age, size). Every decision about a key is taken from that one value
//! and committed with one CAS on it, the only atomic step shared data offers (docs/behaviour.md §4).
//! Responses live beside it, one data key per entry, written by the owner before it flips the
//! entry to *completed*. All keys are created once, up front, so a CAS never meets the "set on a
//! missing key ignores cas" flaw, and memory is bounded by the table size, however many
//! distinct keys pass through.
//!
//! # Room (docs/behaviour.md §3.4)
//! A bucket is also the part of the table where room is made: a new key that finds no free or
//! expired entry evicts the bucket's oldest completed entry, and a completion that would take the
//! bucket's stored responses past its share of `max_store_bytes` evicts the oldest completed
//! entries first. Both happen inside the CAS that decides. In-progress marks are never evicted:
//! a claim is refused (`Full`) only by a bucket of live marks.
//!
//! # Owners
//! Each claim takes a new token from its bucket (`gen`), larger than every earlier one; the
//! claimer's [`Ticket`] carries it. Only the holder of the current `gen` completes, releases
//! or renews. A response written to a data key is stamped with its `gen`; a writer never
//! replaces a newer stamp, so an owner whose mark was taken over cannot clobber the new
//! owner's response (docs/behaviour.md §3.8).

use crate::caller::Caller;
use crate::defects::{planted, Defect};
use crate::encoding::{Bucket, Corrupt, Entry, KeyTag, State, StoredResponse, ENTRIES};
use crate::fingerprint::Fingerprint;
use crate::host::{KvError, SharedKv};
use crate::key::StoreKey;
use crate::store::decision::{judge_live, taken_as_expired, Change, Decision, StoreError};
pub use census::{Census, Heaviest};
use retention::EvictionWindow;
use std::rc::Rc;
pub mod census;
mod replay_cache;
pub mod retention;
mod share;

pub use replay_cache::{ReplayCache, TRUST_MS};

/// CAS attempts before an operation gives up (contention on one bucket from other workers).
const MAX_ATTEMPTS: usize = 64;

/// The claim of one entry: proof of ownership for completion, release and renewal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    pub slot: u32,
    /// The claim's token: also its fencing token (docs/behaviour.md §3.9).
    pub gen: u64,
    pub key: KeyTag,
}

/// What a covered request meets (docs/behaviour.md §3.2–3.4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The key is ours: go upstream. `takeover` when it held this key's expired mark.
    Claimed { ticket: Ticket, takeover: bool, change: Change },
    /// Another call with the same fingerprint is in progress: 409 (or wait).
    InProgress,
    /// Completed: replay this (shared with the VM's kept replays, not copied).
    Replay(Rc<StoredResponse>),
    /// Completed, but its response was too large to keep: 409, not retryable.
    CompletedWithoutBody,
    /// The key was used with a different fingerprint: 422.
    Mismatch,
    /// The key's bucket holds nothing but live in-progress marks and answers inside their
    /// replay window: 503; room frees up in `retry_after_ms`.
    Full { retry_after_ms: u64 },
}

/// What the owner's renewal or release achieved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    Done,
    /// The mark was taken over (it had expired): nothing was changed.
    Lost,
}

/// What the owner's completion achieved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    /// The response is stored and replays.
    Stored(Change),
    /// The key is completed without its response (none given, larger than the bucket's share
    /// of the byte budget, or no room left by answers inside their replay window): retries get
    /// the non-retryable 409.
    WithoutBody(Change),
    /// The mark was taken over (it had expired): nothing was changed.
    Lost,
}

/// `window_ms`: the replay window (`min_retention_s`): a completed entry younger than that is
/// never evicted.
pub fn decide(
    bucket: &Bucket,
    key: &KeyTag,
    fingerprint: &Fingerprint,
    caller: Caller,
    now_ms: u64,
    window_ms: u64,
) -> Result<Decision, Corrupt> {
    // A live entry of the key decides alone (at most one exists): found by its tag first.
    if let Some(i) = bucket.find_key(key) {
        let entry = bucket.entry(i)?;
        if entry.is_live(now_ms) && !taken_as_expired(&entry) {
            return Ok(judge_live(&entry, i, fingerprint));
        }
    }
    let mut expired_same_key = None;
    let mut free = None;
    let mut expired = None;
    let mut held = share::Holdings::default();
    // When the first entry that cannot make room now could: a mark's deadline, the end of a
    // young answer's window (or of its retention).
    let mut room_at = u64::MAX;
    for i in 0..ENTRIES {
        let entry = bucket.glance(i)?;
        if entry.state == State::Free {
            free = free.or(Some(i));
            continue;
        }
        if !entry.is_live(now_ms)
            || (bucket.key_is(i, key) && planted(Defect::LiveMarkTakenOver) && entry.state == State::InProgress)
        {
            if bucket.key_is(i, key) {
                // Reuse the key's own entry: a takeover when it was an in-progress mark.
                expired_same_key = Some((i, entry.state == State::InProgress));
            }
            expired = expired.or(Some(i));
            continue;
        }
        if bucket.key_is(i, key) {
            // A live entry for this key: at most one exists, because claims are decided here.
            return Ok(judge_live(&bucket.entry(i)?, i, fingerprint));
        }
        let evictable = entry.state.is_completed() && outside_window(entry.since_ms, window_ms, now_ms);
        if !evictable {
            let window_end =
                if entry.state.is_completed() { entry.since_ms.saturating_add(window_ms) } else { u64::MAX };
            room_at = room_at.min(entry.deadline_ms.min(window_end));
        }
        held.add(entry.caller, 1, evictable.then_some((i, entry.since_ms)));
    }
    let room = expired_same_key.or(free.map(|i| (i, false))).or(expired.map(|i| (i, false)));
    if let Some((entry, takeover)) = room {
        return Ok(Decision::Claim { entry, takeover, below_share: false });
    }
    // Full of live entries: room comes from the caller holding the most, the claimer's new
    // entry counted (fair share).
    held.add(caller, 1, None);
    Ok(match held.victim(Some(caller)) {
        Some(victim) => Decision::Claim {
            entry: victim.index,
            takeover: false,
            below_share: held.below_share(victim.held, ENTRIES as u64),
        },
        None => Decision::Full { retry_after_ms: room_at.saturating_sub(now_ms) },
    })
}

/// Whether a completed entry that took its state at `since_ms` is past the replay window: only
/// then may room be taken from it (docs/behaviour.md §3.4).
fn outside_window(since_ms: u64, window_ms: u64, now_ms: u64) -> bool {
    since_ms.saturating_add(window_ms) <= now_ms
}

/// Where the table's keys are, how a store key maps onto them, and each bucket's byte budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    buckets: u32,
    /// Bytes of stored responses one bucket may hold: `max_store_bytes / buckets`.
    bucket_bytes: u64,
    /// `<namespace>:t2:<buckets>:`, the prefix of every key name (built once: names are made on
    /// every store access). `t2` is the format: a plugin of another format never reads it.
    prefix: String,
}

impl Layout {
    /// A table that holds at least `capacity` entries, `ceil(capacity / ENTRIES)` buckets, and
    /// at most `max_store_bytes` of stored responses.
    pub fn new(namespace: &str, capacity: usize, max_store_bytes: u64) -> Layout {
        let buckets = Layout::buckets_for(capacity);
        let bucket_bytes = max_store_bytes / u64::from(buckets);
        Layout { buckets, bucket_bytes, prefix: format!("{namespace}:t2:{buckets}:") }
    }

    /// The number of buckets of a table of `capacity` entries.
    pub fn buckets_for(capacity: usize) -> u32 {
        capacity.div_ceil(ENTRIES).clamp(1, u32::MAX as usize) as u32
    }

    fn name(&self, kind: char, n: u32) -> String {
        let mut name = String::with_capacity(self.prefix.len() + 11);
        name.push_str(&self.prefix);
        name.push(kind);
        push_decimal(&mut name, n);
        name
    }

    pub fn buckets(&self) -> u32 {
        self.buckets
    }

    pub fn entries(&self) -> usize {
        self.buckets as usize * ENTRIES
    }

    pub fn bucket_bytes(&self) -> u64 {
        self.bucket_bytes
    }

    // The bucket count is part of every name, so a table of another size never reads this one.
    // Public for `src/bin/idempotency-key.rs`, which names where one key lives.
    pub fn bucket_key(&self, bucket: u32) -> String {
        self.name('b', bucket)
    }

    /// The data key of `slot` (`bucket × ENTRIES + entry`).
    pub fn data_key(&self, slot: u32) -> String {
        self.name('d', slot)
    }

    fn ready_key(&self) -> String {
        format!("{}ready", self.prefix)
    }

    fn evictions_key(&self) -> String {
        format!("{}evictions", self.prefix)
    }

    /// The bucket of `key`, and the tag its entry keeps.
    pub fn locate(&self, key: &StoreKey) -> (u32, KeyTag) {
        let mut tag = [0u8; 16];
        tag.copy_from_slice(key.0.get(8..24).unwrap_or(&[0u8; 16]));
        ((crate::bytes::u64_at(&key.0, 0) % u64::from(self.buckets)) as u32, tag)
    }
}

/// Appends `n` in decimal without the formatting machinery (this is on every store access).
fn push_decimal(out: &mut String, mut n: u32) {
    let mut digits = [0u8; 10];
    let mut i = digits.len();
    loop {
        i -= 1;
        if let Some(d) = digits.get_mut(i) {
            *d = b'0' + (n % 10) as u8;
        }
        n /= 10;
        if n == 0 || i == 0 {
            break;
        }
    }
    for d in digits.get(i..).unwrap_or_default() {
        out.push(char::from(*d));
    }
}

fn split_slot(slot: u32) -> (u32, usize) {
    (slot / ENTRIES as u32, slot as usize % ENTRIES)
}

fn slot_of(bucket: u32, entry: usize) -> u32 {
    bucket * ENTRIES as u32 + entry as u32
}

/// Frees completed entries of `bucket` (other than `own`, of `caller`) until `needed` more
/// bytes fit in `budget`: expired ones first, then the oldest of the caller holding the most
/// bytes there, `caller`'s `needed` counted (fair share). Returns the freed entries (slot, gen).
#[allow(clippy::too_many_arguments)]
/// Room made for `needed` bytes: the entries freed (their slots and tokens), and whether they
/// made enough (answers inside their replay window are never taken).
struct Room {
    freed: Vec<(u32, u64)>,
    made: bool,
}

#[allow(clippy::too_many_arguments)]
fn make_room(
    bucket: &mut Bucket,
    bucket_id: u32,
    own: usize,
    caller: Caller,
    needed: u64,
    budget: u64,
    now_ms: u64,
    window_ms: u64,
    change: &mut Change,
) -> Result<Room, Corrupt> {
    let mut expired: Vec<(usize, Entry)> = Vec::new();
    let mut live: Vec<(usize, Entry)> = Vec::new();
    let mut held = share::Holdings::default();
    let mut total = 0u64;
    for i in (0..ENTRIES).filter(|i| *i != own) {
        let entry = bucket.entry(i)?;
        if entry.bytes > 0 && entry.state.is_completed() {
            total += u64::from(entry.bytes);
            if !entry.is_live(now_ms) {
                expired.push((i, entry));
            } else {
                let evictable = outside_window(entry.since_ms, window_ms, now_ms);
                held.add(entry.caller, u64::from(entry.bytes), evictable.then_some((i, entry.since_ms)));
                live.push((i, entry));
            }
        }
    }
    let mut freed = Vec::new();
    if total + needed <= budget {
        return Ok(Room { freed, made: true });
    }
    held.add(caller, needed, None);
    let mut free = |i: usize, entry: &Entry, change: &mut Change, total: &mut u64| {
        *total -= u64::from(entry.bytes);
        change.remove(entry, now_ms, entry.is_live(now_ms));
        bucket.set_entry(i, &Entry { gen: entry.gen, ..Entry::FREE });
        freed.push((slot_of(bucket_id, i), entry.gen));
    };
    for (i, entry) in &expired {
        if total + needed <= budget {
            break;
        }
        free(*i, entry, change, &mut total);
    }
    while total + needed > budget {
        let Some(victim) = held.victim(Some(caller)) else { break };
        let Some((_, entry)) = live.iter().find(|(i, _)| *i == victim.index) else { break };
        if held.below_share(victim.held, budget) {
            change.evicted_below_share += 1;
        }
        free(victim.index, entry, change, &mut total);
        held.remove(victim.index);
    }
    Ok(Room { made: total + needed <= budget, freed })
}

/// Whether `needed` more bytes fit the bucket's budget beside what its other entries hold.
fn fits_without_room(bucket: &Bucket, own: usize, needed: u64, budget: u64) -> bool {
    let held = (0..ENTRIES).filter(|i| *i != own).fold(0u64, |sum, i| sum.saturating_add(bucket.stored_bytes(i)));
    held.saturating_add(needed) <= budget
}

/// A claim decided on a bucket, about to be written.
struct Claiming<'a> {
    bucket_id: u32,
    entry: usize,
    tag: KeyTag,
    fingerprint: &'a Fingerprint,
    caller: Caller,
    takeover: bool,
    below_share: bool,
}

/// The idempotency table over a [`SharedKv`].
pub struct Table<S> {
    store: S,
    layout: Layout,
    /// The replay window (`min_retention_s`): no completed entry younger than this is evicted.
    window_ms: u64,
}

impl<S: SharedKv> Table<S> {
    pub fn new(store: S, layout: Layout) -> Self {
        Table { store, layout, window_ms: 0 }
    }

    /// Keeps every completed entry for `window_ms` at least, whatever room others need: a new
    /// key is refused (`Verdict::Full`) and an answer completes unstored rather than evict one.
    pub fn with_window(mut self, window_ms: u64) -> Self {
        self.window_ms = window_ms;
        self
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn store(&self) -> &S {
        &self.store
    }

    /// Creates every key of the table unless it exists. Run by the base VM before any worker
    /// serves (docs/behaviour.md §4), so no claim ever meets a missing key. Returns whether it created them.
    pub fn create(&self) -> Result<bool, StoreError> {
        if self.store.get(&self.layout.ready_key())?.1.is_some() {
            return Ok(false);
        }
        let empty = Bucket::empty();
        for b in 0..self.layout.buckets {
            let key = self.layout.bucket_key(b);
            if self.store.get(&key)?.1.is_none() {
                self.store.set(&key, empty.as_bytes(), None)?;
            }
        }
        for slot in 0..(self.layout.buckets as usize * ENTRIES) as u32 {
            let key = self.layout.data_key(slot);
            if self.store.get(&key)?.1.is_none() {
                self.store.set(&key, b"", None)?;
            }
        }
        let evictions = self.layout.evictions_key();
        if self.store.get(&evictions)?.1.is_none() {
            self.store.set(&evictions, &EvictionWindow::default().encode(), None)?;
        }
        self.store.set(&self.layout.ready_key(), b"1", None)?;
        Ok(true)
    }

    pub fn is_created(&self) -> Result<bool, StoreError> {
        Ok(self.store.get(&self.layout.ready_key())?.1.is_some())
    }

    fn read_bucket(&self, bucket: u32) -> Result<(Bucket, u32), StoreError> {
        match self.store.get(&self.layout.bucket_key(bucket))? {
            (Some(bytes), Some(cas)) => Ok((Bucket::decode(bytes)?, cas)),
            (None, Some(_)) => Err(StoreError::Corrupt("bucket: empty")),
            (_, None) => Err(StoreError::Missing),
        }
    }

    fn write_bucket(&self, bucket: u32, b: &Bucket, cas: u32) -> Result<bool, StoreError> {
        match self.store.set(&self.layout.bucket_key(bucket), b.as_bytes(), Some(cas)) {
            Ok(()) => Ok(true),
            Err(KvError::CasMismatch) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// The first step of every covered request: claim the key, or learn what holds it.
    pub fn begin(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        now_ms: u64,
        lease_ms: u64,
    ) -> Result<Verdict, StoreError> {
        self.begin_with(key, fingerprint, Caller::ANONYMOUS, now_ms, lease_ms, &mut ReplayCache::new(0))
    }

    /// [`Table::begin`], replaying from `cache` what this VM replayed before: without a read
    /// within [`TRUST_MS`] of the bucket read that last confirmed it, else with the
    /// bucket's read only (see [`ReplayCache`]).
    pub fn begin_with(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        caller: Caller,
        now_ms: u64,
        lease_ms: u64,
        cache: &mut ReplayCache,
    ) -> Result<Verdict, StoreError> {
        let (bucket_id, tag) = self.layout.locate(key);
        if let Some(response) = cache.trusted(&tag, fingerprint, now_ms) {
            return Ok(Verdict::Replay(response));
        }
        // A completed entry whose data key did not hold its response, last round.
        let mut unmatched: Option<(usize, u64)> = None;
        for _ in 0..MAX_ATTEMPTS {
            let (bucket, cas) = self.read_bucket(bucket_id)?;
            match decide(&bucket, &tag, fingerprint, caller, now_ms, self.window_ms)? {
                Decision::Claim { entry, takeover, below_share } => {
                    let claim = Claiming { bucket_id, entry, tag, fingerprint, caller, takeover, below_share };
                    if let Some(claimed) = self.try_claim(bucket, cas, claim, now_ms, lease_ms)? {
                        if let Verdict::Claimed { ticket, .. } = &claimed {
                            // What the slot held is gone, and so is what was kept of the key.
                            cache.forget(ticket.slot);
                            cache.forget_key(&tag);
                        }
                        return Ok(claimed);
                    }
                }
                Decision::InProgress => return Ok(Verdict::InProgress),
                Decision::Mismatch => return Ok(Verdict::Mismatch),
                Decision::Full { retry_after_ms } => return Ok(Verdict::Full { retry_after_ms }),
                Decision::Completed { no_body: true, .. } => return Ok(Verdict::CompletedWithoutBody),
                Decision::Completed { entry, no_body: false } => {
                    let expected = bucket.entry(entry)?;
                    if let Some(response) = self.kept_or_read(slot_of(bucket_id, entry), &expected, cache, now_ms)? {
                        return Ok(Verdict::Replay(response));
                    }
                    // The entry changed hands between the two reads: decide again. Twice the
                    // same entry without its response is not a race but a damaged store.
                    if unmatched == Some((entry, expected.gen)) {
                        return Err(StoreError::Corrupt("entry: its response is missing or foreign"));
                    }
                    unmatched = Some((entry, expected.gen));
                }
            }
        }
        Err(StoreError::Contention)
    }

    /// One CAS that claims `entry` of the bucket just read; `None` when another worker wrote the
    /// bucket first (decide again).
    fn try_claim(
        &self,
        mut bucket: Bucket,
        cas: u32,
        c: Claiming,
        now_ms: u64,
        lease_ms: u64,
    ) -> Result<Option<Verdict>, StoreError> {
        let old = bucket.entry(c.entry)?;
        let claimed = Entry {
            state: State::InProgress,
            gen: bucket.next_token(now_ms),
            key: c.tag,
            fingerprint: *c.fingerprint,
            deadline_ms: now_ms.saturating_add(lease_ms),
            since_ms: now_ms,
            bytes: 0,
            caller: c.caller,
        };
        bucket.set_entry(c.entry, &claimed);
        if !self.write_bucket(c.bucket_id, &bucket, cas)? {
            return Ok(None);
        }
        let slot = slot_of(c.bucket_id, c.entry);
        let mut change = Change { in_progress: 1, ..Change::default() };
        change.remove(&old, now_ms, old.is_evictable(now_ms));
        if c.below_share && old.is_evictable(now_ms) {
            change.evicted_below_share += 1;
        }
        if c.takeover {
            change.expired_marks -= 1; // counted as a takeover instead
        }
        if old.bytes > 0 {
            // Free the old response; fenced like every blank (a blind write could meet a
            // newer owner's if clocks disagreed by a lease).
            self.free_data(slot, old.gen);
        }
        let ticket = Ticket { slot, gen: claimed.gen, key: c.tag };
        Ok(Some(Verdict::Claimed { ticket, takeover: c.takeover, change }))
    }

    /// The stored response of `entry`, or `None` if the data key no longer belongs to it.
    fn read_response(&self, slot: u32, entry: &Entry) -> Result<Option<StoredResponse>, StoreError> {
        let (value, _) = self.store.get(&self.layout.data_key(slot))?;
        let Some(bytes) = value else { return Ok(None) };
        let (gen, key, response) = StoredResponse::decode(bytes)?;
        Ok((gen == entry.gen && key == entry.key).then_some(response))
    }

    /// The stored response of `entry` as [`Table::read_response`], from `cache` when this VM
    /// replayed the same claim before; a response read is kept there.
    fn kept_or_read(
        &self,
        slot: u32,
        entry: &Entry,
        cache: &mut ReplayCache,
        now_ms: u64,
    ) -> Result<Option<Rc<StoredResponse>>, StoreError> {
        if let Some(response) = cache.get(slot, entry, now_ms) {
            return Ok(Some(response));
        }
        let response = self.read_response(slot, entry)?.map(Rc::new);
        if let Some(response) = &response {
            cache.put(slot, entry, response, now_ms);
        }
        Ok(response)
    }

    /// Applies `change` to the ticket's entry if the ticket still owns it (in progress, same gen).
    fn update_owned(&self, t: &Ticket, change: impl Fn(&mut Entry)) -> Result<Finish, StoreError> {
        let (bucket_id, index) = split_slot(t.slot);
        for _ in 0..MAX_ATTEMPTS {
            let (mut bucket, cas) = self.read_bucket(bucket_id)?;
            let mut entry = bucket.entry(index)?;
            if !owns(&entry, t) {
                return Ok(Finish::Lost);
            }
            change(&mut entry);
            bucket.set_entry(index, &entry);
            if self.write_bucket(bucket_id, &bucket, cas)? {
                return Ok(Finish::Done);
            }
        }
        Err(StoreError::Contention)
    }

    /// Extends the owner's lease (docs/behaviour.md §3.5).
    pub fn renew(&self, t: &Ticket, now_ms: u64, lease_ms: u64) -> Result<Finish, StoreError> {
        let deadline = now_ms.saturating_add(lease_ms);
        self.update_owned(t, |w| w.deadline_ms = w.deadline_ms.max(deadline))
    }

    /// Releases the key at once, so a retry can do the work (docs/behaviour.md §3.4).
    pub fn release(&self, t: &Ticket) -> Result<Finish, StoreError> {
        if planted(Defect::ReleaseWithoutCompare) {
            let t = Ticket { gen: self.read_bucket(split_slot(t.slot).0)?.0.entry(split_slot(t.slot).1)?.gen, ..*t };
            return self.update_owned(&t, |w| *w = Entry { gen: w.gen, ..Entry::FREE });
        }
        let done = self.update_owned(t, |w| *w = Entry { gen: w.gen, ..Entry::FREE })?;
        if done == Finish::Done {
            // Free what a racing late writer may have left in this entry's data key.
            self.free_data(t.slot, t.gen);
        }
        Ok(done)
    }

    /// Completes the key with its response, or without one when none is given or it is larger
    /// than a bucket's share of the byte budget. Makes room first (docs/behaviour.md §3.4).
    pub fn complete(
        &self,
        t: &Ticket,
        response: Option<&mut StoredResponse>,
        now_ms: u64,
        retention_ms: u64,
    ) -> Result<Completion, StoreError> {
        self.complete_with(t, response, now_ms, retention_ms, &mut ReplayCache::new(0))
    }

    /// [`Table::complete`]; what it evicts to make room is dropped from this VM's `cache`.
    pub fn complete_with(
        &self,
        t: &Ticket,
        response: Option<&mut StoredResponse>,
        now_ms: u64,
        retention_ms: u64,
        cache: &mut ReplayCache,
    ) -> Result<Completion, StoreError> {
        let response = response.filter(|r| r.stored_len() as u64 <= self.layout.bucket_bytes);
        let mut bytes = response.as_ref().map_or(0, |r| r.stored_len() as u64);
        let mut read = None;
        if let Some(response) = response {
            response.stamp(t.gen, &t.key);
            match self.write_response(t, response)? {
                Some(bucket) => read = Some(bucket),
                None => return Ok(Completion::Lost),
            }
        }
        let (bucket_id, index) = split_slot(t.slot);
        for _ in 0..MAX_ATTEMPTS {
            // The bucket read by the ownership check is usually still current: one CAS.
            let (mut bucket, cas) = match read.take() {
                Some(fresh) => fresh,
                None => self.read_bucket(bucket_id)?,
            };
            let mut entry = bucket.entry(index)?;
            if !owns(&entry, t) {
                return Ok(Completion::Lost);
            }
            let mut change = Change { in_progress: -1, completed: 1, bytes: bytes as i64, ..Change::default() };
            let budget = self.layout.bucket_bytes;
            let (mut freed, mut dropped) = (Vec::new(), false);
            // Most answers fit beside the others: no trial copy of the bucket to make room in.
            if !fits_without_room(&bucket, index, bytes, budget) {
                let (mut trial, mut trial_change) = (bucket.clone(), change);
                let room = make_room(
                    &mut trial,
                    bucket_id,
                    index,
                    entry.caller,
                    bytes,
                    budget,
                    now_ms,
                    self.window_ms,
                    &mut trial_change,
                )?;
                if room.made {
                    (bucket, change, freed) = (trial, trial_change, room.freed);
                } else {
                    // Only answers inside their replay window are left to take room from: the
                    // key completes without its response rather than evict one (docs/behaviour.md §3.4).
                    (bytes, change.bytes, dropped) = (0, 0, true);
                }
            }
            entry.state = if bytes > 0 { State::Completed } else { State::CompletedNoBody };
            entry.deadline_ms = now_ms.saturating_add(retention_ms);
            entry.since_ms = now_ms;
            entry.bytes = bytes as u32;
            bucket.set_entry(index, &entry);
            if self.write_bucket(bucket_id, &bucket, cas)? {
                for (slot, gen) in freed {
                    cache.forget(slot);
                    self.free_data(slot, gen);
                }
                if dropped {
                    self.free_data(t.slot, t.gen); // the response written first is not kept
                }
                return Ok(if bytes > 0 { Completion::Stored(change) } else { Completion::WithoutBody(change) });
            }
        }
        Err(StoreError::Contention)
    }

    /// Writes the response to the entry's data key, fenced: never over a newer owner's stamp.
    /// Returns the bucket (and its cas) that proved ownership, or `None` if the ticket lost it.
    fn write_response(&self, t: &Ticket, response: &StoredResponse) -> Result<Option<(Bucket, u32)>, StoreError> {
        let (bucket_id, index) = split_slot(t.slot);
        let key = self.layout.data_key(t.slot);
        for _ in 0..MAX_ATTEMPTS {
            // Check ownership first: a taken-over owner must not write at all.
            let (bucket, bucket_cas) = self.read_bucket(bucket_id)?;
            if !owns(&bucket.entry(index)?, t) {
                return Ok(None);
            }
            let (value, cas) = self.store.get(&key)?;
            if stamp_gen(value.as_deref()) > t.gen {
                return Ok(None);
            }
            match self.store.set(&key, response.as_bytes(), cas) {
                Ok(()) => return Ok(Some((bucket, bucket_cas))),
                Err(KvError::CasMismatch) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(StoreError::Contention)
    }

    /// Frees a data key after the bucket's write decided: that write stands whatever this
    /// does (a claim made, a completion stored), so a failure is logged, not returned. What
    /// stays is fenced by its stamp (read only for its own claim) and overwritten by the
    /// slot's next completion: bounded as before.
    fn free_data(&self, slot: u32, gen: u64) {
        if let Err(e) = self.blank_data(slot, gen) {
            log::warn!(
                "shared data: could not free slot {slot}'s old response ({e:?}); it is freed on the slot's next use"
            );
        }
    }

    /// Empties a data key whose response belongs to `gen` or an older claim.
    fn blank_data(&self, slot: u32, gen: u64) -> Result<(), StoreError> {
        let key = self.layout.data_key(slot);
        for _ in 0..MAX_ATTEMPTS {
            let (value, cas) = self.store.get(&key)?;
            if value.is_none() || stamp_gen(value.as_deref()) > gen {
                return Ok(());
            }
            match self.store.set(&key, b"", cas) {
                Ok(()) => return Ok(()),
                Err(KvError::CasMismatch) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(StoreError::Contention)
    }

    /// A read-only look for the local cache of a fleet store: what a live completed entry of
    /// the key says (`None`: no such entry here; anything else, in progress included, is
    /// for the fleet store to decide).
    pub fn lookup(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        now_ms: u64,
    ) -> Result<Option<Verdict>, StoreError> {
        self.lookup_with(key, fingerprint, now_ms, &mut ReplayCache::new(0))
    }

    /// [`Table::lookup`], replaying from `cache` what this VM replayed before.
    pub fn lookup_with(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        now_ms: u64,
        cache: &mut ReplayCache,
    ) -> Result<Option<Verdict>, StoreError> {
        let (bucket_id, tag) = self.layout.locate(key);
        if let Some(response) = cache.trusted(&tag, fingerprint, now_ms) {
            return Ok(Some(Verdict::Replay(response)));
        }
        let (bucket, _) = self.read_bucket(bucket_id)?;
        for i in 0..ENTRIES {
            let entry = bucket.entry(i)?;
            if entry.key != tag || !entry.state.is_completed() || !entry.is_live(now_ms) {
                continue;
            }
            return Ok(if entry.fingerprint != *fingerprint {
                Some(Verdict::Mismatch)
            } else if entry.state == State::CompletedNoBody {
                Some(Verdict::CompletedWithoutBody)
            } else {
                // `None` if the entry changed hands between the two reads: ask the fleet.
                self.kept_or_read(slot_of(bucket_id, i), &entry, cache, now_ms)?.map(Verdict::Replay)
            });
        }
        Ok(None)
    }

    /// Keeps a completed entry learnt from the fleet store until its `deadline_ms`: claimed
    /// and completed at once, making room as any completion does. A key already here, or a
    /// bucket of nothing but marks, is left as it is.
    pub fn keep(
        &self,
        key: &StoreKey,
        fingerprint: &Fingerprint,
        caller: Caller,
        response: Option<&StoredResponse>,
        deadline_ms: u64,
        now_ms: u64,
    ) -> Result<Change, StoreError> {
        if deadline_ms <= now_ms {
            return Ok(Change::default());
        }
        // Between the two writes the entry is a mark for a moment: lookups skip it, and it
        // expires after a second if the completion never comes.
        let mut no_cache = ReplayCache::new(0);
        let Verdict::Claimed { ticket, change: claimed, .. } =
            self.begin_with(key, fingerprint, caller, now_ms, 1_000, &mut no_cache)?
        else {
            return Ok(Change::default());
        };
        let mut copy = response.cloned();
        let change = match self.complete(&ticket, copy.as_mut(), now_ms, deadline_ms - now_ms)? {
            Completion::Stored(c) | Completion::WithoutBody(c) => c,
            Completion::Lost => Change::default(),
        };
        Ok(Change {
            in_progress: claimed.in_progress + change.in_progress,
            completed: claimed.completed + change.completed,
            bytes: claimed.bytes + change.bytes,
            evicted: claimed.evicted + change.evicted,
            youngest_evicted_ms: claimed.youngest_evicted_ms.or(change.youngest_evicted_ms),
            expired_marks: claimed.expired_marks + change.expired_marks,
            evicted_below_share: claimed.evicted_below_share + change.evicted_below_share,
        })
    }

    /// Frees the expired entries of one bucket and the responses they held. Called a few
    /// buckets at a time from `on_tick`, so memory of expired entries is returned even when no
    /// new key lands in their bucket.
    /// `census`: counts the live entries by caller.
    pub fn sweep(&self, bucket_id: u32, now_ms: u64, mut census: Option<&mut Census>) -> Result<Change, StoreError> {
        for attempt in 0..MAX_ATTEMPTS {
            let (mut bucket, cas) = self.read_bucket(bucket_id)?;
            let mut change = Change::default();
            let mut blank = Vec::new();
            for i in 0..ENTRIES {
                let entry = bucket.entry(i)?;
                if entry.state == State::Free {
                    continue;
                }
                if entry.is_live(now_ms) {
                    // Counted once: the first read is as good as any for a figure.
                    if let (0, Some(census)) = (attempt, census.as_deref_mut()) {
                        census.add(entry.caller, u64::from(entry.bytes));
                    }
                    continue;
                }
                change.remove(&entry, now_ms, false);
                if entry.bytes > 0 {
                    blank.push((slot_of(bucket_id, i), entry.gen));
                }
                bucket.set_entry(i, &Entry { gen: entry.gen, ..Entry::FREE });
            }
            if change == Change::default() {
                return Ok(change);
            }
            if self.write_bucket(bucket_id, &bucket, cas)? {
                for (slot, gen) in blank {
                    self.free_data(slot, gen);
                }
                return Ok(change);
            }
        }
        Err(StoreError::Contention)
    }

    /// Whether this VM's turn has come to say something once per `every_ms` for the whole
    /// Envoy (every VM shares the table): the first to ask after the period takes it.
    pub fn take_turn(&self, what: &str, now_ms: u64, every_ms: u64) -> bool {
        let key = format!("{}turn:{what}", self.layout.prefix);
        let Ok((value, cas)) = self.store.get(&key) else { return false };
        let next = value.as_deref().map_or(0, |v| crate::bytes::u64_at(v, 0));
        if now_ms < next {
            return false;
        }
        // A missing key ignores `cas` (two VMs may both speak once): harmless for a log line.
        self.store.set(&key, &now_ms.saturating_add(every_ms).to_le_bytes(), cas).is_ok()
    }

    /// Adds evictions seen by this worker to the process-wide window, and returns the
    /// effective retention to show (docs/behaviour.md §3.7). `youngest_ms`: the youngest evicted entry's
    /// age, if this worker evicted any since it last looked.
    pub fn note_evictions(&self, now_ms: u64, youngest_ms: Option<u64>) -> Result<u64, StoreError> {
        let key = self.layout.evictions_key();
        for _ in 0..MAX_ATTEMPTS {
            let (value, cas) = self.store.get(&key)?;
            let Some(cas) = cas else { return Err(StoreError::Missing) };
            let window = EvictionWindow::decode(value.as_deref().unwrap_or_default())?;
            let next = window.with(now_ms, youngest_ms);
            if next == window {
                return Ok(next.effective_retention_ms());
            }
            match self.store.set(&key, &next.encode(), Some(cas)) {
                Ok(()) => return Ok(next.effective_retention_ms()),
                Err(KvError::CasMismatch) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(StoreError::Contention)
    }
}

/// Whether `entry` is still the ticket's in-progress mark.
fn owns(entry: &Entry, t: &Ticket) -> bool {
    entry.state == State::InProgress && entry.gen == t.gen && entry.key == t.key
}

/// The claim stamp of a data key's value: 0 when empty or not a response of ours.
fn stamp_gen(value: Option<&[u8]>) -> u64 {
    value.and_then(|v| crate::encoding::response_stamp(v).ok()).map_or(0, |(gen, _)| gen)
}

#[cfg(test)]
mod tests;
