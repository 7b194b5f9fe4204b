//! Encodings of what the table stores: buckets of entry headers and stored responses.
//!
//! Compact and binary: a bucket is read and CAS-written on every claim, so it is kept small
//! and decoded lazily, one entry at a time. Anything read back is checked: a corrupt or foreign
//! value is an error (answered 503), never a panic.

use crate::caller::{Caller, CALLER_BITS};
use crate::fingerprint::Fingerprint;

/// Entries per bucket. A claim decides on one bucket (one CAS on one shared-data key), so a
/// key can only live in its own bucket, and room is made there (eviction, byte budget).
pub const ENTRIES: usize = 64;
const ENTRY_BYTES: usize = 1 + 8 + 16 + 16 + 8 + 8 + 4;
/// Where an entry's key tag, deadline and age start (`entry_bytes` lays them out).
const KEY_AT: usize = 1 + 8;
const DEADLINE_AT: usize = KEY_AT + 16 + 16;
const SINCE_AT: usize = DEADLINE_AT + 8;
const BYTES_AT: usize = SINCE_AT + 8;
/// Format 2: entries carry their age and size, buckets the last token they handed out.
const BUCKET_MAGIC: [u8; 2] = [b'B', 2];
const BUCKET_HEAD: usize = BUCKET_MAGIC.len() + 8;
pub const BUCKET_BYTES: usize = BUCKET_HEAD + ENTRIES * ENTRY_BYTES;

/// The part of the store key kept in a entry; the rest of the hash chose the bucket.
pub type KeyTag = [u8; 16];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Free = 0,
    InProgress = 1,
    Completed = 2,
    /// Completed, but the response was not stored (over `max_response_bytes`).
    CompletedNoBody = 3,
}

impl State {
    fn from_byte(b: u8) -> Option<State> {
        Some(match b {
            0 => State::Free,
            1 => State::InProgress,
            2 => State::Completed,
            3 => State::CompletedNoBody,
            _ => return None,
        })
    }

    pub fn is_completed(self) -> bool {
        matches!(self, State::Completed | State::CompletedNoBody)
    }
}

/// One entry's header. `gen` is the claim's token: only its holder may complete, release or
/// renew, and it fences late writers. Tokens grow with every claim of a bucket (and with the
/// clock, across restarts), so later claims of one key always carry larger ones (docs/behaviour.md §3.9).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub state: State,
    pub gen: u64,
    pub key: KeyTag,
    pub fingerprint: Fingerprint,
    /// In progress: the lease's end. Completed: the end of retention. Free: unused.
    pub deadline_ms: u64,
    /// When the entry took its state: the claim, or the completion (its age, for eviction).
    pub since_ms: u64,
    /// Bytes of its stored response (completed entries only), for the byte budget.
    pub bytes: u32,
    /// Whose key it is, for fair share. Kept in the top 20 bits of the age field, which a
    /// time in ms leaves unused until the year 2527: release 0.2.0 reads the same format, and
    /// sees a tagged entry as the youngest (see `since_word`).
    pub caller: Caller,
}

impl Entry {
    pub const FREE: Entry = Entry {
        state: State::Free,
        gen: 0,
        key: [0; 16],
        fingerprint: Fingerprint([0; 16]),
        deadline_ms: 0,
        since_ms: 0,
        bytes: 0,
        caller: Caller::ANONYMOUS,
    };

    /// Whether the entry holds a live entry at `now` (an expired entry binds nothing).
    pub fn is_live(&self, now_ms: u64) -> bool {
        self.state != State::Free && now_ms < self.deadline_ms
    }

    /// A live completed entry: what eviction may take.
    pub fn is_evictable(&self, now_ms: u64) -> bool {
        self.state.is_completed() && self.is_live(now_ms)
    }
}

/// What a claim's scan of a bucket needs of an entry, read without decoding the rest: a new
/// key's claim looks at all `ENTRIES`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Glance {
    pub state: State,
    pub deadline_ms: u64,
    pub since_ms: u64,
    pub caller: Caller,
}

impl Glance {
    /// As `Entry::is_live`.
    pub fn is_live(&self, now_ms: u64) -> bool {
        self.state != State::Free && now_ms < self.deadline_ms
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Corrupt(pub &'static str);

/// A bucket as stored: magic, the last claim token handed out, then `ENTRIES` fixed-size entries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    bytes: Vec<u8>,
}

impl Bucket {
    pub fn empty() -> Bucket {
        let mut bytes = Vec::with_capacity(BUCKET_BYTES);
        bytes.extend_from_slice(&BUCKET_MAGIC);
        bytes.resize(BUCKET_BYTES, 0);
        Bucket { bytes }
    }

    /// Checks the size and magic; each entry is checked when it is read (`entry`).
    pub fn decode(bytes: Vec<u8>) -> Result<Bucket, Corrupt> {
        if bytes.len() != BUCKET_BYTES || bytes.get(..2) != Some(&BUCKET_MAGIC[..]) {
            return Err(Corrupt("bucket: wrong size or magic"));
        }
        Ok(Bucket { bytes })
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    pub fn entry(&self, i: usize) -> Result<Entry, Corrupt> {
        parse_entry(self.raw_entry(i)?)
    }

    /// Entry `i`'s state, deadline and age; an unknown state is corrupt, as in `entry`.
    pub fn glance(&self, i: usize) -> Result<Glance, Corrupt> {
        let raw = self.raw_entry(i)?;
        let state = raw.first().copied().and_then(State::from_byte).ok_or(Corrupt("entry: unknown state"))?;
        let u64_at = |at| crate::bytes::u64_at(raw, at);
        let (since_ms, caller) = split_since_word(u64_at(SINCE_AT));
        Ok(Glance { state, deadline_ms: u64_at(DEADLINE_AT), since_ms, caller })
    }

    /// The bytes entry `i` holds in the bucket's budget: its stored response's size when it is
    /// completed with a body, else 0 (a corrupt state counts 0: `entry` refuses it when read).
    pub fn stored_bytes(&self, i: usize) -> u64 {
        let Ok(raw) = self.raw_entry(i) else { return 0 };
        match raw.first().copied().and_then(State::from_byte) {
            Some(state) if state.is_completed() => u64::from(crate::bytes::u32_at(raw, BYTES_AT)),
            _ => 0,
        }
    }

    /// Whether entry `i`'s key tag is `key` (`bytes::equal`: LLVM expands a 16-byte `==` into
    /// byte-swapped loads, two dozen Wasm instructions a word, and `find_key` runs it 64 times).
    pub fn key_is(&self, i: usize, key: &KeyTag) -> bool {
        let at = BUCKET_HEAD + i * ENTRY_BYTES + KEY_AT;
        self.bytes.get(at..at + key.len()).is_some_and(|tag| crate::bytes::equal(tag, key))
    }

    fn raw_entry(&self, i: usize) -> Result<&[u8], Corrupt> {
        let start = BUCKET_HEAD + i * ENTRY_BYTES;
        self.bytes.get(start..start + ENTRY_BYTES).ok_or(Corrupt("bucket: entry out of range"))
    }

    /// The first entry whose key tag is `key`, whatever its state, found without decoding
    /// the others (a replay or a 409 in a full bucket would decode up to 64 entries).
    pub fn find_key(&self, key: &KeyTag) -> Option<usize> {
        (0..ENTRIES).find(|&i| self.key_is(i, key))
    }

    pub fn set_entry(&mut self, i: usize, entry: &Entry) {
        let start = BUCKET_HEAD + i * ENTRY_BYTES;
        if let Some(raw) = self.bytes.get_mut(start..start + ENTRY_BYTES) {
            raw.copy_from_slice(&entry_bytes(entry));
        }
    }

    /// A new claim token: above every token this bucket handed out, and above the clock's
    /// `now_ms << 10`, so that tokens keep growing across a restart that emptied the store.
    pub fn next_token(&mut self, now_ms: u64) -> u64 {
        let last = Reader(self.bytes.get(2..BUCKET_HEAD).unwrap_or_default()).u64().unwrap_or(0);
        let token = last.saturating_add(1).max(now_ms.saturating_mul(1024));
        if let Some(raw) = self.bytes.get_mut(2..BUCKET_HEAD) {
            raw.copy_from_slice(&token.to_le_bytes());
        }
        token
    }
}

fn entry_bytes(entry: &Entry) -> [u8; ENTRY_BYTES] {
    let mut w = [0u8; ENTRY_BYTES];
    let parts: [&[u8]; 7] = [
        &[entry.state as u8],
        &entry.gen.to_le_bytes(),
        &entry.key,
        &entry.fingerprint.0,
        &entry.deadline_ms.to_le_bytes(),
        &since_word(entry.since_ms, entry.caller).to_le_bytes(),
        &entry.bytes.to_le_bytes(),
    ];
    let mut at = 0;
    for part in parts {
        if let Some(dst) = w.get_mut(at..at + part.len()) {
            dst.copy_from_slice(part);
        }
        at += part.len();
    }
    w
}

fn parse_entry(raw: &[u8]) -> Result<Entry, Corrupt> {
    let mut r = Reader(raw);
    let state = State::from_byte(r.u8()?).ok_or(Corrupt("entry: unknown state"))?;
    let (gen, key, fingerprint, deadline_ms) = (r.u64()?, r.array()?, Fingerprint(r.array()?), r.u64()?);
    let (since, caller) = split_since_word(r.u64()?);
    Ok(Entry { state, gen, key, fingerprint, deadline_ms, since_ms: since, bytes: r.u32()?, caller })
}

/// Bits of the age field that hold the time (ms since 1970: enough until the year 2527).
const SINCE_BITS: u32 = 64 - CALLER_BITS;

/// The age field as stored: the time in its low 44 bits, the caller's tag above. An untagged
/// entry (the anonymous caller) is written exactly as release 0.2.0 writes it.
fn since_word(since_ms: u64, caller: Caller) -> u64 {
    (since_ms & ((1 << SINCE_BITS) - 1)) | (caller.bits() << SINCE_BITS)
}

fn split_since_word(word: u64) -> (u64, Caller) {
    (word & ((1 << SINCE_BITS) - 1), Caller::from_bits(word >> SINCE_BITS))
}

const ENTRY_MAGIC: [u8; 2] = [b'E', 2];

/// One entry as a value of its own (the etcd store): its header, then the stored response when
/// it is completed with one, stamped here with the entry's `gen` and key.
pub fn encode_entry(entry: &Entry, response: Option<&StoredResponse>) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + ENTRY_BYTES + response.map_or(0, StoredResponse::stored_len));
    out.extend_from_slice(&ENTRY_MAGIC);
    out.extend_from_slice(&entry_bytes(entry)[..]);
    if let Some(r) = response {
        out.extend_from_slice(r.as_bytes());
        let at = out.len() - STAMP_BYTES;
        if let Some(stamp) = out.get_mut(at..at + 8 + 16) {
            let (gen, key) = stamp.split_at_mut(8);
            gen.copy_from_slice(&entry.gen.to_le_bytes());
            key.copy_from_slice(&entry.key);
        }
    }
    out
}

pub fn decode_entry(bytes: &[u8]) -> Result<(Entry, Option<StoredResponse>), Corrupt> {
    if bytes.get(..2) != Some(&ENTRY_MAGIC[..]) {
        return Err(Corrupt("entry: wrong magic"));
    }
    let raw = bytes.get(2..2 + ENTRY_BYTES).ok_or(Corrupt("entry: truncated"))?;
    let entry = parse_entry(raw)?;
    let rest = bytes.get(2 + ENTRY_BYTES..).unwrap_or_default();
    let response = match (entry.state, rest.is_empty()) {
        (State::Completed, false) => {
            let (gen, key, r) = StoredResponse::decode(rest.to_vec())?;
            if gen != entry.gen || key != entry.key {
                return Err(Corrupt("entry: response stamp differs"));
            }
            Some(r)
        }
        (_, true) if entry.state != State::Completed => None,
        _ => return Err(Corrupt("entry: response does not match state")),
    };
    Ok((entry, response))
}

const RESPONSE_MAGIC: [u8; 2] = [b'R', 2];
/// `status u16, header count u16, headers length u32, body length u32, gen u64, key, magic`.
const FOOTER_BYTES: usize = 2 + 2 + 4 + 4 + 8 + 16 + 2;
/// What a stored response costs besides its body and headers (6 bytes each besides name and
/// value): the footer.
pub const STORED_OVERHEAD: usize = FOOTER_BYTES;
/// The stamp at the very end: `gen`, key, magic.
const STAMP_BYTES: usize = 8 + 16 + 2;

/// A response as stored and replayed: status, headers in order (repeats kept), body. It is
/// held in its stored form, `body ‖ headers ‖ footer`, so that storing it, reading it back and
/// replaying it never copy the body: an answer read from the host becomes the stored value by
/// appending its headers, and a value read from the store is replayed from the same bytes.
/// The footer's stamp (`gen`, key) tells a reader it belongs to the entry it looked up, and a
/// late writer that a newer response is there.
#[derive(Clone)]
pub struct StoredResponse {
    bytes: Vec<u8>,
    status: u16,
    count: u16,
    body_len: usize,
    headers_len: usize,
}

impl StoredResponse {
    /// Builds the stored form around `body`, unstamped. Headers whose name or value does not
    /// fit the encoding (names over 64 KiB, more than 65,535 headers) are left out: Envoy's own
    /// limits are far lower.
    pub fn new<'a>(status: u16, headers: impl IntoIterator<Item = (&'a str, &'a [u8])>, body: Vec<u8>) -> Self {
        let body_len = body.len();
        let mut bytes = body;
        let mut count: u16 = 0;
        for (name, value) in headers {
            let (Ok(name_len), Ok(value_len)) = (u16::try_from(name.len()), u32::try_from(value.len())) else {
                continue;
            };
            if count == u16::MAX {
                break;
            }
            bytes.reserve(6 + name.len() + value.len() + FOOTER_BYTES);
            bytes.extend_from_slice(&name_len.to_le_bytes());
            bytes.extend_from_slice(name.as_bytes());
            bytes.extend_from_slice(&value_len.to_le_bytes());
            bytes.extend_from_slice(value);
            count += 1;
        }
        let headers_len = bytes.len() - body_len;
        bytes.reserve_exact(FOOTER_BYTES);
        bytes.extend_from_slice(&status.to_le_bytes());
        bytes.extend_from_slice(&count.to_le_bytes());
        bytes.extend_from_slice(&(headers_len as u32).to_le_bytes());
        bytes.extend_from_slice(&(body_len as u32).to_le_bytes());
        bytes.extend_from_slice(&[0u8; 8 + 16]);
        bytes.extend_from_slice(&RESPONSE_MAGIC);
        StoredResponse { bytes, status, count, body_len, headers_len }
    }

    /// Reads a stored value back, checking every length: `(gen, key, response)`.
    pub fn decode(bytes: Vec<u8>) -> Result<(u64, KeyTag, StoredResponse), Corrupt> {
        let (gen, key) = response_stamp(&bytes)?;
        let footer = bytes.len() - FOOTER_BYTES;
        let mut r = Reader(bytes.get(footer..).ok_or(Corrupt("response: truncated"))?);
        let status = r.u16()?;
        let count = r.u16()?;
        let headers_len = r.u32()? as usize;
        let body_len = r.u32()? as usize;
        if body_len.checked_add(headers_len) != Some(footer) {
            return Err(Corrupt("response: lengths do not add up"));
        }
        let block = bytes.get(body_len..footer).ok_or(Corrupt("response: truncated"))?;
        let mut seen = 0u16;
        let mut headers = Headers { rest: block, left: count };
        while headers.left > 0 {
            headers.parse_next()?;
            seen += 1;
        }
        if seen != count || !headers.rest.is_empty() {
            return Err(Corrupt("response: header block"));
        }
        Ok((gen, key, StoredResponse { bytes, status, count, body_len, headers_len }))
    }

    /// Stamps the response with the claim that stores it.
    pub fn stamp(&mut self, gen: u64, key: &KeyTag) {
        let at = self.bytes.len() - STAMP_BYTES;
        if let Some(raw) = self.bytes.get_mut(at..at + 8) {
            raw.copy_from_slice(&gen.to_le_bytes());
        }
        if let Some(raw) = self.bytes.get_mut(at + 8..at + 24) {
            raw.copy_from_slice(key);
        }
    }

    pub fn status(&self) -> u16 {
        self.status
    }

    pub fn body(&self) -> &[u8] {
        self.bytes.get(..self.body_len).unwrap_or_default()
    }

    /// Headers in order, repeats kept.
    pub fn headers(&self) -> Headers<'_> {
        let block = self.bytes.get(self.body_len..self.body_len + self.headers_len).unwrap_or_default();
        Headers { rest: block, left: self.count }
    }

    /// The stored form, as written to the store.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// What the response costs the store's byte budget.
    pub fn stored_len(&self) -> usize {
        self.bytes.len()
    }
}

/// Equal content: status, headers and body (the stamp says where it is stored, not what).
impl PartialEq for StoredResponse {
    fn eq(&self, other: &Self) -> bool {
        let content = |r: &StoredResponse| r.bytes.get(..r.bytes.len() - STAMP_BYTES).unwrap_or_default().to_vec();
        content(self) == content(other)
    }
}

impl Eq for StoredResponse {}

impl std::fmt::Debug for StoredResponse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let body = String::from_utf8_lossy(self.body().get(..64.min(self.body_len)).unwrap_or_default()).into_owned();
        f.debug_struct("StoredResponse")
            .field("status", &self.status)
            .field("headers", &self.headers().collect::<Vec<_>>())
            .field("body_len", &self.body_len)
            .field("body", &body)
            .finish()
    }
}

/// The headers of a stored response, checked when it was built or decoded.
pub struct Headers<'a> {
    rest: &'a [u8],
    left: u16,
}

impl<'a> Headers<'a> {
    fn parse_next(&mut self) -> Result<(&'a str, &'a [u8]), Corrupt> {
        let mut r = Reader(self.rest);
        let name_len = usize::from(r.u16()?);
        let name = std::str::from_utf8(r.take(name_len)?).map_err(|_| Corrupt("response: header name"))?;
        let value_len = r.u32()? as usize;
        let value = r.take(value_len)?;
        self.rest = r.0;
        self.left -= 1;
        Ok((name, value))
    }
}

impl<'a> Iterator for Headers<'a> {
    type Item = (&'a str, &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return None;
        }
        self.parse_next().ok()
    }
}

/// The stamp of a stored response, read from its end without decoding the rest.
pub fn response_stamp(bytes: &[u8]) -> Result<(u64, KeyTag), Corrupt> {
    let at = bytes.len().checked_sub(FOOTER_BYTES).ok_or(Corrupt("response: truncated"))?;
    let mut r = Reader(bytes.get(at + FOOTER_BYTES - STAMP_BYTES..).unwrap_or_default());
    let gen = r.u64()?;
    let key = r.array()?;
    if r.take(2)? != RESPONSE_MAGIC {
        return Err(Corrupt("response: wrong magic"));
    }
    Ok((gen, key))
}

/// A bounds-checked cursor over untrusted bytes.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Corrupt> {
        if n > self.0.len() {
            return Err(Corrupt("truncated"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], Corrupt> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
    fn u8(&mut self) -> Result<u8, Corrupt> {
        Ok(u8::from_le_bytes(self.array()?))
    }
    fn u16(&mut self) -> Result<u16, Corrupt> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, Corrupt> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, Corrupt> {
        Ok(u64::from_le_bytes(self.array()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(state: State) -> Entry {
        Entry {
            state,
            gen: 7,
            key: [3; 16],
            fingerprint: Fingerprint([9; 16]),
            deadline_ms: 1234,
            since_ms: 1000,
            bytes: 55,
            caller: Caller::ANONYMOUS,
        }
    }

    #[test]
    fn bucket_round_trip() {
        let mut b = Bucket::empty();
        assert_eq!(b.as_bytes().len(), BUCKET_BYTES);
        b.set_entry(ENTRIES - 1, &entry(State::Completed));
        let b2 = Bucket::decode(b.as_bytes().to_vec()).unwrap();
        assert_eq!(b2.entry(ENTRIES - 1).unwrap(), entry(State::Completed));
        assert_eq!(b2.entry(0).unwrap(), Entry::FREE);
        assert!(b2.entry(ENTRIES).is_err());
    }

    /// `stored_bytes` reads what `entry` decodes, without decoding: a completed entry's size,
    /// 0 for the others.
    #[test]
    fn a_glance_at_the_stored_bytes_agrees_with_the_entry() {
        let mut b = Bucket::empty();
        b.set_entry(1, &Entry { bytes: 0x0102_0304, ..entry(State::Completed) });
        b.set_entry(2, &entry(State::CompletedNoBody));
        b.set_entry(3, &entry(State::InProgress));
        assert_eq!(b.stored_bytes(1), 0x0102_0304);
        assert_eq!(b.stored_bytes(1), u64::from(b.entry(1).unwrap().bytes));
        assert_eq!(b.stored_bytes(2), 55, "as make_room counts it (the table writes 0 for no body)");
        assert_eq!((b.stored_bytes(0), b.stored_bytes(3), b.stored_bytes(ENTRIES)), (0, 0, 0));
    }

    #[test]
    fn tokens_grow_with_every_claim_and_with_the_clock() {
        let mut b = Bucket::empty();
        let first = b.next_token(5);
        assert_eq!(first, 5 * 1024);
        assert_eq!(b.next_token(5), first + 1);
        assert_eq!(b.next_token(0), first + 2, "a clock that went back never lowers a token");
        // A restart empties the store: the clock alone keeps the next token above.
        assert!(Bucket::empty().next_token(6) > first + 2);
        let again = Bucket::decode(b.as_bytes().to_vec()).unwrap().next_token(5);
        assert_eq!(again, first + 3, "the last token is stored in the bucket");
    }

    /// The vector `tests/test_encodings.py` checks the Python decoder (tests/chaos.py) against.
    #[test]
    fn etcd_entry_vector() {
        let e = Entry {
            state: State::InProgress,
            gen: 0x0102_0304_0506_0708,
            key: [7; 16],
            fingerprint: Fingerprint([9; 16]),
            deadline_ms: 1_800_000_000_123,
            since_ms: 1_799_999_990_123,
            bytes: 0,
            caller: Caller::ANONYMOUS,
        };
        let hex: String = encode_entry(&e, None).iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "450201080706050403020107070707070707070707070707070707090909090909090909090909090909097b505c18a30100006b295c18a301000000000000"
        );
    }

    #[test]
    fn corrupt_buckets_are_errors() {
        assert!(Bucket::decode(vec![]).is_err());
        assert!(Bucket::decode(b"foreign value".to_vec()).is_err());
        let mut bytes = Bucket::empty().as_bytes().to_vec();
        bytes[BUCKET_HEAD] = 9; // unknown state in entry 0
        let bucket = Bucket::decode(bytes).unwrap();
        assert!(bucket.entry(0).is_err());
        assert!(bucket.entry(1).is_ok());
        assert_eq!(bucket.glance(0), Err(Corrupt("entry: unknown state")), "as entry(0)");
        assert!(bucket.glance(ENTRIES).is_err() && bucket.entry(ENTRIES).is_err());
    }

    /// Release 0.2.0 reads the same bucket format: an untagged entry is written byte for byte
    /// as it wrote it, a tagged one differs only in the top 20 bits of its age field.
    #[test]
    fn a_callers_tag_rides_in_the_top_of_the_age_field() {
        let plain = Entry { state: State::Completed, since_ms: 1_800_000_000_123, ..Entry::FREE };
        let tagged = Entry { caller: Caller::from_bits(0xabcde), ..plain };
        let (a, b) = (entry_bytes(&plain), entry_bytes(&tagged));
        assert_eq!(crate::bytes::u64_at(&a, SINCE_AT), 1_800_000_000_123, "0.2.0's layout");
        assert_eq!(crate::bytes::u64_at(&b, SINCE_AT), 1_800_000_000_123 | 0xabcde << 44);
        assert_eq!(a.iter().zip(b.iter()).filter(|(x, y)| x != y).count(), 3, "only the top bytes differ");
        assert_eq!(parse_entry(&b).unwrap(), tagged);
    }

    #[test]
    fn a_glance_reads_what_the_whole_entry_holds() {
        let mut bucket = Bucket::empty();
        let states = [State::Free, State::InProgress, State::Completed, State::CompletedNoBody];
        for i in 0..ENTRIES {
            let n = i as u64;
            let entry = Entry {
                state: states[i % 4],
                gen: n * 7 + 1,
                key: [i as u8; 16],
                fingerprint: Fingerprint([!(i as u8); 16]),
                deadline_ms: u64::MAX - n,
                since_ms: n << 37 | 3,
                bytes: u32::MAX - i as u32,
                caller: Caller::from_bits(i as u64 * 4099),
            };
            bucket.set_entry(i, &entry);
        }
        for i in 0..ENTRIES {
            let (whole, glance) = (bucket.entry(i).unwrap(), bucket.glance(i).unwrap());
            assert_eq!(
                (glance.state, glance.deadline_ms, glance.since_ms, glance.caller),
                (whole.state, whole.deadline_ms, whole.since_ms, whole.caller)
            );
            assert_eq!((whole.since_ms, whole.caller), ((i as u64) << 37 | 3, Caller::from_bits(i as u64 * 4099)));
            assert_eq!(glance.is_live(u64::MAX - 64), whole.is_live(u64::MAX - 64));
            assert!(bucket.key_is(i, &whole.key) && !bucket.key_is(i, &[i as u8 ^ 1; 16]));
            assert_eq!(bucket.find_key(&whole.key), Some(i));
        }
    }

    fn sample() -> StoredResponse {
        let headers: [(&str, &[u8]); 3] =
            [("content-type", b"application/json"), ("set-cookie", b"a=1"), ("set-cookie", b"b=\xff")];
        StoredResponse::new(201, headers, (0..=255u8).collect())
    }

    #[test]
    fn response_round_trip_keeps_repeated_headers_and_binary_body() {
        let mut resp = sample();
        resp.stamp(42, &[5; 16]);
        assert_eq!(response_stamp(resp.as_bytes()).unwrap(), (42, [5; 16]));
        let (gen, key, back) = StoredResponse::decode(resp.as_bytes().to_vec()).unwrap();
        assert_eq!((gen, key), (42, [5; 16]));
        assert_eq!(back, sample(), "the stamp is not content");
        assert_eq!(back.status(), 201);
        assert_eq!(back.body(), &(0..=255u8).collect::<Vec<_>>()[..]);
        let headers: Vec<_> = back.headers().collect();
        assert_eq!(
            headers,
            vec![
                ("content-type", &b"application/json"[..]),
                ("set-cookie", &b"a=1"[..]),
                ("set-cookie", &b"b=\xff"[..])
            ]
        );
        assert_ne!(back, StoredResponse::new(200, [], b"x".to_vec()));
    }

    #[test]
    fn the_body_is_the_start_of_the_stored_value() {
        let resp = StoredResponse::new(200, [("a", &b"b"[..])], b"hello".to_vec());
        assert_eq!(&resp.as_bytes()[..5], b"hello");
        assert_eq!(resp.stored_len(), 5 + 6 + 2 + FOOTER_BYTES);
        let empty = StoredResponse::new(204, [], Vec::new());
        let (_, _, back) = StoredResponse::decode(empty.as_bytes().to_vec()).unwrap();
        assert!(back.body().is_empty() && back.headers().next().is_none());
    }

    #[test]
    fn entry_round_trip_and_consistency() {
        let done = entry(State::Completed);
        let mut resp = StoredResponse::new(201, [("a", &b"b"[..])], b"x".to_vec());
        resp.stamp(done.gen, &done.key);
        let bytes = encode_entry(&done, Some(&resp));
        assert_eq!(decode_entry(&bytes).unwrap(), (done, Some(resp.clone())));
        let mark = Entry { state: State::InProgress, ..done };
        assert_eq!(decode_entry(&encode_entry(&mark, None)).unwrap(), (mark, None));
        // A completed entry must carry its response; a mark must not.
        assert!(decode_entry(&encode_entry(&done, None)).is_err());
        assert!(decode_entry(&encode_entry(&mark, Some(&resp))).is_err());
        // The response is stamped for the entry as it is encoded; one stamped for another
        // entry is foreign.
        let mut other = resp.clone();
        other.stamp(done.gen + 1, &done.key);
        assert_eq!(encode_entry(&done, Some(&other)), bytes);
        let mut foreign = bytes.clone();
        let at = foreign.len() - STAMP_BYTES;
        foreign[at] ^= 1;
        assert!(decode_entry(&foreign).is_err());
        for n in 0..bytes.len() {
            assert!(decode_entry(&bytes[..n]).is_err(), "prefix {n}");
        }
    }

    #[test]
    fn every_truncation_or_extension_of_a_response_is_an_error() {
        let mut resp = sample();
        resp.stamp(1, &[1; 16]);
        let bytes = resp.as_bytes().to_vec();
        for n in 0..bytes.len() {
            assert!(StoredResponse::decode(bytes[..n].to_vec()).is_err(), "prefix {n}");
            assert!(StoredResponse::decode(bytes[n + 1..].to_vec()).is_err(), "suffix {n}");
        }
        let mut longer = vec![0];
        longer.extend_from_slice(&bytes);
        assert!(StoredResponse::decode(longer).is_err());
    }
}
