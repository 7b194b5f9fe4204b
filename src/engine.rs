//! The idempotency state machine (SPEC §3), sans I/O: it sees the store through [`SharedKv`]
//! and the time as a number the caller passes in.
//!
//! # Layout
//! The table has `buckets` buckets of [`WAYS`] entries. A store key hashes to one bucket; the
//! bucket is one shared-data key holding the headers of its entries (state, owner token,
//! fingerprint, deadline). Every decision about a key is taken from that one value and
//! committed with one CAS on it, the only atomic step shared data offers (SPEC §4). Responses
//! live beside it, one data key per way, written by the owner before it flips the way to
//! *completed*. All keys are created once, up front, so a CAS never meets the "set on a
//! missing key ignores cas" flaw, and memory is bounded by the table size, however many
//! distinct keys pass through.
//!
//! # Owners
//! Each claim bumps the way's `gen`; the claimer's [`Ticket`] carries it. Only the holder of
//! the current `gen` completes, releases or renews. A response written to a data key is
//! stamped with its `gen`; a writer never replaces a newer stamp, so an owner whose mark was
//! taken over cannot clobber the new owner's response (SPEC §3.8).

use crate::entry::{self, Bucket, Corrupt, KeyTag, State, StoredResponse, Way, WAYS};
use crate::fingerprint::Fingerprint;
use crate::key::StoreKey;
use crate::store::{KvError, SharedKv};

/// CAS attempts before an operation gives up (contention on one bucket from other workers).
const MAX_ATTEMPTS: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreError {
    Kv(KvError),
    /// A value in the store is not ours or is damaged.
    Corrupt(&'static str),
    /// The table has not been created (the base VM's `on_configure` did not run).
    Missing,
    /// Too many CAS conflicts in a row.
    Contention,
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

/// The claim of one way: proof of ownership for completion, release and renewal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    pub slot: u32,
    pub gen: u64,
    pub key: KeyTag,
}

/// What a covered request meets (SPEC §3.2–3.4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Begin {
    /// The key is ours: go upstream. `takeover` when it held this key's expired mark.
    Claimed { ticket: Ticket, takeover: bool, evicted: State },
    /// Another call with the same fingerprint is in progress: 409 (or wait).
    InProgress,
    /// Completed: replay this.
    Replay(StoredResponse),
    /// Completed, but its response was too large to keep: 409, not retryable.
    CompletedWithoutBody,
    /// The key was used with a different fingerprint: 422.
    Mismatch,
    /// No free way in the key's bucket: 503.
    Full,
}

/// What the owner's write achieved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    Done,
    /// The mark was taken over (it had expired): nothing was changed.
    Lost,
}

/// The pure decision for one request against its bucket (SPEC §3.3–3.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Claim { way: usize, takeover: bool },
    InProgress,
    Completed { way: usize, no_body: bool },
    Mismatch,
    Full,
}

pub fn decide(bucket: &Bucket, key: &KeyTag, fingerprint: &Fingerprint, now_ms: u64) -> Result<Decision, Corrupt> {
    let mut expired_same_key = None;
    let mut free = None;
    let mut reusable = None;
    for i in 0..WAYS {
        let way = bucket.way(i)?;
        if way.state == State::Free {
            free = free.or(Some(i));
            continue;
        }
        if !way.is_live(now_ms) {
            if way.key == *key {
                // Reuse the key's own way: a takeover when it was an in-progress mark.
                expired_same_key = Some((i, way.state == State::InProgress));
            }
            reusable = reusable.or(Some(i));
            continue;
        }
        if way.key != *key {
            continue;
        }
        // A live entry for this key: at most one exists, because claims are decided here.
        return Ok(judge_live(&way, i, fingerprint));
    }
    Ok(match (expired_same_key, free, reusable) {
        (Some((way, takeover)), _, _) => Decision::Claim { way, takeover },
        (None, Some(way), _) | (None, None, Some(way)) => Decision::Claim { way, takeover: false },
        (None, None, None) => Decision::Full,
    })
}

/// A live entry of the request's key: conflict, replay or mismatch.
fn judge_live(way: &Way, index: usize, fingerprint: &Fingerprint) -> Decision {
    if way.fingerprint != *fingerprint {
        return Decision::Mismatch;
    }
    match way.state {
        State::InProgress => Decision::InProgress,
        State::Completed => Decision::Completed { way: index, no_body: false },
        State::CompletedNoBody => Decision::Completed { way: index, no_body: true },
        State::Free => Decision::Claim { way: index, takeover: false },
    }
}

/// The decision for a store that keeps one value per key (etcd): `entry` is the key's value,
/// if any. A claim's `way` is meaningless there (0).
pub fn decide_entry(entry: Option<&Way>, fingerprint: &Fingerprint, now_ms: u64) -> Decision {
    match entry {
        Some(way) if way.is_live(now_ms) => judge_live(way, 0, fingerprint),
        Some(way) => Decision::Claim { way: 0, takeover: way.state == State::InProgress },
        None => Decision::Claim { way: 0, takeover: false },
    }
}

/// Where the table's keys are and how a store key maps onto them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    buckets: u32,
    /// `<namespace>:<buckets>:`, the prefix of every key name (built once: names are made on
    /// every store access).
    prefix: String,
}

impl Layout {
    /// A table that holds at least `capacity` entries: `ceil(capacity / WAYS)` buckets.
    pub fn new(namespace: &str, capacity: usize) -> Layout {
        let buckets = capacity.div_ceil(WAYS).clamp(1, u32::MAX as usize) as u32;
        Layout { buckets, prefix: format!("{namespace}:{buckets}:") }
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
        self.buckets as usize * WAYS
    }

    // The bucket count is part of every name, so a table of another size never reads this one.
    fn bucket_key(&self, bucket: u32) -> String {
        self.name('b', bucket)
    }

    fn data_key(&self, slot: u32) -> String {
        self.name('d', slot)
    }

    fn ready_key(&self) -> String {
        format!("{}ready", self.prefix)
    }

    fn locate(&self, key: &StoreKey) -> (u32, KeyTag) {
        let mut head = [0u8; 8];
        let mut tag = [0u8; 16];
        let (h, rest) = key.0.split_at(8);
        head.copy_from_slice(h);
        tag.copy_from_slice(rest.get(..16).unwrap_or(&[0u8; 16]));
        ((u64::from_le_bytes(head) % u64::from(self.buckets)) as u32, tag)
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
    (slot / WAYS as u32, slot as usize % WAYS)
}

/// Changes of the entries held, for the gauges: +1/-1 per state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    pub in_progress: i64,
    pub completed: i64,
}

impl Held {
    pub fn of(state: State, sign: i64) -> Held {
        match state {
            State::Free => Held::default(),
            State::InProgress => Held { in_progress: sign, completed: 0 },
            State::Completed | State::CompletedNoBody => Held { in_progress: 0, completed: sign },
        }
    }
    pub fn plus(self, other: Held) -> Held {
        Held { in_progress: self.in_progress + other.in_progress, completed: self.completed + other.completed }
    }
}

/// What a sweep of one bucket freed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Swept {
    pub freed: Held,
}

/// The idempotency table over a [`SharedKv`].
pub struct Table<S> {
    store: S,
    layout: Layout,
}

impl<S: SharedKv> Table<S> {
    pub fn new(store: S, layout: Layout) -> Self {
        Table { store, layout }
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn store(&self) -> &S {
        &self.store
    }

    /// Creates every key of the table unless it exists. Run by the base VM before any worker
    /// serves (SPEC §4), so no claim ever meets a missing key. Returns whether it created them.
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
        for slot in 0..(self.layout.buckets as usize * WAYS) as u32 {
            let key = self.layout.data_key(slot);
            if self.store.get(&key)?.1.is_none() {
                self.store.set(&key, b"", None)?;
            }
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
    ) -> Result<Begin, StoreError> {
        let (bucket_id, tag) = self.layout.locate(key);
        for _ in 0..MAX_ATTEMPTS {
            let (mut bucket, cas) = self.read_bucket(bucket_id)?;
            match decide(&bucket, &tag, fingerprint, now_ms)? {
                Decision::Claim { way, takeover } => {
                    let old = bucket.way(way)?;
                    let claimed = Way {
                        state: State::InProgress,
                        gen: old.gen.wrapping_add(1),
                        key: tag,
                        fingerprint: *fingerprint,
                        deadline_ms: now_ms.saturating_add(lease_ms),
                    };
                    bucket.set_way(way, &claimed);
                    if self.write_bucket(bucket_id, &bucket, cas)? {
                        let slot = bucket_id * WAYS as u32 + way as u32;
                        let ticket = Ticket { slot, gen: claimed.gen, key: tag };
                        return Ok(Begin::Claimed { ticket, takeover, evicted: old.state });
                    }
                }
                Decision::InProgress => return Ok(Begin::InProgress),
                Decision::Mismatch => return Ok(Begin::Mismatch),
                Decision::Full => return Ok(Begin::Full),
                Decision::Completed { no_body: true, .. } => return Ok(Begin::CompletedWithoutBody),
                Decision::Completed { way, no_body: false } => {
                    let expected = bucket.way(way)?;
                    let slot = bucket_id * WAYS as u32 + way as u32;
                    if let Some(response) = self.read_response(slot, &expected)? {
                        return Ok(Begin::Replay(response));
                    }
                    // The way changed hands between the two reads: decide again.
                }
            }
        }
        Err(StoreError::Contention)
    }

    /// The stored response of `way`, or `None` if the data key no longer belongs to it.
    fn read_response(&self, slot: u32, way: &Way) -> Result<Option<StoredResponse>, StoreError> {
        let (value, _) = self.store.get(&self.layout.data_key(slot))?;
        let Some(bytes) = value else { return Ok(None) };
        let (gen, key, response) = entry::decode_response(&bytes)?;
        Ok((gen == way.gen && key == way.key).then_some(response))
    }

    /// Applies `change` to the ticket's way if the ticket still owns it (in progress, same gen).
    fn update_owned(&self, t: &Ticket, change: impl Fn(&mut Way)) -> Result<Finish, StoreError> {
        self.update_owned_from(t, None, change)
    }

    /// As `update_owned`, trying first with a bucket the caller has just read.
    fn update_owned_from(
        &self,
        t: &Ticket,
        mut read: Option<(Bucket, u32)>,
        change: impl Fn(&mut Way),
    ) -> Result<Finish, StoreError> {
        let (bucket_id, way_i) = split_slot(t.slot);
        for _ in 0..MAX_ATTEMPTS {
            let (mut bucket, cas) = match read.take() {
                Some(fresh) => fresh,
                None => self.read_bucket(bucket_id)?,
            };
            let mut way = bucket.way(way_i)?;
            if way.state != State::InProgress || way.gen != t.gen || way.key != t.key {
                return Ok(Finish::Lost);
            }
            change(&mut way);
            bucket.set_way(way_i, &way);
            if self.write_bucket(bucket_id, &bucket, cas)? {
                return Ok(Finish::Done);
            }
        }
        Err(StoreError::Contention)
    }

    /// Extends the owner's lease (SPEC §3.5).
    pub fn renew(&self, t: &Ticket, now_ms: u64, lease_ms: u64) -> Result<Finish, StoreError> {
        let deadline = now_ms.saturating_add(lease_ms);
        self.update_owned(t, |w| w.deadline_ms = w.deadline_ms.max(deadline))
    }

    /// Releases the key at once, so a retry can do the work (SPEC §3.4).
    pub fn release(&self, t: &Ticket) -> Result<Finish, StoreError> {
        let done = self.update_owned(t, |w| {
            w.state = State::Free;
            w.key = [0; 16];
            w.fingerprint = Fingerprint::default();
            w.deadline_ms = 0;
        })?;
        if done == Finish::Done {
            // Free what an earlier entry of this way left in its data key.
            self.blank_data(t.slot, t.gen)?;
        }
        Ok(done)
    }

    /// Completes the key with its response, or without one when it was too large to keep.
    pub fn complete(
        &self,
        t: &Ticket,
        response: Option<&StoredResponse>,
        now_ms: u64,
        retention_ms: u64,
    ) -> Result<Finish, StoreError> {
        let mut read = None;
        if let Some(response) = response {
            match self.write_response(t, response)? {
                Some(bucket) => read = Some(bucket),
                None => return Ok(Finish::Lost),
            }
        }
        let state = if response.is_some() { State::Completed } else { State::CompletedNoBody };
        let deadline = now_ms.saturating_add(retention_ms);
        // The bucket read by the ownership check is usually still current: one CAS, no re-read.
        self.update_owned_from(t, read, |w| {
            w.state = state;
            w.deadline_ms = deadline;
        })
    }

    /// Writes the response to the way's data key, fenced: never over a newer owner's stamp.
    /// Returns the bucket (and its cas) that proved ownership, or `None` if the ticket lost it.
    fn write_response(&self, t: &Ticket, response: &StoredResponse) -> Result<Option<(Bucket, u32)>, StoreError> {
        let (bucket_id, way_i) = split_slot(t.slot);
        let key = self.layout.data_key(t.slot);
        let encoded = entry::encode_response(t.gen, &t.key, response);
        for _ in 0..MAX_ATTEMPTS {
            // Check ownership first: a taken-over owner must not write at all.
            let (bucket, bucket_cas) = self.read_bucket(bucket_id)?;
            let way = bucket.way(way_i)?;
            if way.state != State::InProgress || way.gen != t.gen || way.key != t.key {
                return Ok(None);
            }
            let (value, cas) = self.store.get(&key)?;
            if stamp_gen(value.as_deref()) > t.gen {
                return Ok(None);
            }
            match self.store.set(&key, &encoded, cas) {
                Ok(()) => return Ok(Some((bucket, bucket_cas))),
                Err(KvError::CasMismatch) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(StoreError::Contention)
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

    /// Frees the expired entries of one bucket and the responses they held. Called a few
    /// buckets at a time from `on_tick`, so memory of expired entries is returned even when no
    /// new key lands in their bucket.
    pub fn sweep(&self, bucket_id: u32, now_ms: u64) -> Result<Swept, StoreError> {
        for _ in 0..MAX_ATTEMPTS {
            let (mut bucket, cas) = self.read_bucket(bucket_id)?;
            let mut freed = Held::default();
            let mut blank = Vec::new();
            for i in 0..WAYS {
                let way = bucket.way(i)?;
                if way.state == State::Free || way.is_live(now_ms) {
                    continue;
                }
                freed = freed.plus(Held::of(way.state, 1));
                if way.state == State::Completed {
                    blank.push((bucket_id * WAYS as u32 + i as u32, way.gen));
                }
                bucket.set_way(i, &Way { gen: way.gen, ..Way::FREE });
            }
            if freed == Held::default() {
                return Ok(Swept::default());
            }
            if self.write_bucket(bucket_id, &bucket, cas)? {
                for (slot, gen) in blank {
                    self.blank_data(slot, gen)?;
                }
                return Ok(Swept { freed });
            }
        }
        Err(StoreError::Contention)
    }
}

/// The claim stamp of a data key's value: 0 when empty or not a response of ours.
fn stamp_gen(value: Option<&[u8]>) -> u64 {
    value.and_then(|v| entry::response_stamp(v).ok()).map_or(0, |(gen, _)| gen)
}

#[cfg(test)]
mod tests;
