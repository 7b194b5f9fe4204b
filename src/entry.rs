//! Encodings of what the table stores: buckets of entry headers ("ways") and stored responses.
//!
//! Compact and binary: a bucket is read and CAS-written on every claim, so it is kept small
//! and decoded lazily, one way at a time. Anything read back is checked: a corrupt or foreign
//! value is an error (answered 503), never a panic.

use crate::fingerprint::Fingerprint;

/// Entries per bucket. A claim decides on one bucket (one CAS on one shared-data key), so a
/// key can only live in its own bucket; 64 ways make a full bucket rare (see README, Limits).
pub const WAYS: usize = 64;
const WAY_BYTES: usize = 1 + 8 + 16 + 16 + 8;
const BUCKET_MAGIC: [u8; 2] = [b'B', 1];
pub const BUCKET_BYTES: usize = BUCKET_MAGIC.len() + WAYS * WAY_BYTES;
const RESPONSE_MAGIC: [u8; 2] = [b'R', 1];

/// The part of the store key kept in a way; the rest of the hash chose the bucket.
pub type KeyTag = [u8; 16];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Free = 0,
    InProgress = 1,
    Completed = 2,
    /// Completed, but the response was over `max_response_bytes` and was not stored.
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
}

/// One entry's header. `gen` counts the claims of this way: it is the owner's token (only the
/// holder of the current `gen` may complete or release) and fences late writers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Way {
    pub state: State,
    pub gen: u64,
    pub key: KeyTag,
    pub fingerprint: Fingerprint,
    /// In progress: the lease's end. Completed: the end of retention. Free: unused.
    pub deadline_ms: u64,
}

impl Way {
    pub const FREE: Way =
        Way { state: State::Free, gen: 0, key: [0; 16], fingerprint: Fingerprint([0; 16]), deadline_ms: 0 };

    /// Whether the way holds a live entry at `now` (an expired entry binds nothing).
    pub fn is_live(&self, now_ms: u64) -> bool {
        self.state != State::Free && now_ms < self.deadline_ms
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Corrupt(pub &'static str);

/// A bucket as stored: magic, then `WAYS` fixed-size ways.
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

    /// Checks the size and magic; each way is checked when it is read (`way`).
    pub fn decode(bytes: Vec<u8>) -> Result<Bucket, Corrupt> {
        if bytes.len() != BUCKET_BYTES || bytes.get(..2) != Some(&BUCKET_MAGIC[..]) {
            return Err(Corrupt("bucket: wrong size or magic"));
        }
        Ok(Bucket { bytes })
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    pub fn way(&self, i: usize) -> Result<Way, Corrupt> {
        let start = BUCKET_MAGIC.len() + i * WAY_BYTES;
        parse_way(self.bytes.get(start..start + WAY_BYTES).ok_or(Corrupt("bucket: way out of range"))?)
    }

    pub fn set_way(&mut self, i: usize, way: &Way) {
        let start = BUCKET_MAGIC.len() + i * WAY_BYTES;
        if let Some(raw) = self.bytes.get_mut(start..start + WAY_BYTES) {
            raw.copy_from_slice(&way_bytes(way));
        }
    }
}

fn way_bytes(way: &Way) -> [u8; WAY_BYTES] {
    let mut w = [0u8; WAY_BYTES];
    let parts: [&[u8]; 5] =
        [&[way.state as u8], &way.gen.to_le_bytes(), &way.key, &way.fingerprint.0, &way.deadline_ms.to_le_bytes()];
    let mut at = 0;
    for part in parts {
        if let Some(dst) = w.get_mut(at..at + part.len()) {
            dst.copy_from_slice(part);
        }
        at += part.len();
    }
    w
}

fn parse_way(raw: &[u8]) -> Result<Way, Corrupt> {
    let mut r = Reader(raw);
    Ok(Way {
        state: State::from_byte(r.u8()?).ok_or(Corrupt("entry: unknown state"))?,
        gen: r.u64()?,
        key: r.array()?,
        fingerprint: Fingerprint(r.array()?),
        deadline_ms: r.u64()?,
    })
}

const ENTRY_MAGIC: [u8; 2] = [b'E', 1];

/// One entry as a value of its own (the etcd store): its header, then the stored response when
/// it is completed with one.
pub fn encode_entry(way: &Way, response: Option<&StoredResponse>) -> Vec<u8> {
    let mut out = ENTRY_MAGIC.to_vec();
    out.extend_from_slice(&way_bytes(way)[..]);
    if let Some(r) = response {
        out.extend_from_slice(&encode_response(way.gen, &way.key, r));
    }
    out
}

pub fn decode_entry(bytes: &[u8]) -> Result<(Way, Option<StoredResponse>), Corrupt> {
    if bytes.get(..2) != Some(&ENTRY_MAGIC[..]) {
        return Err(Corrupt("entry: wrong magic"));
    }
    let raw = bytes.get(2..2 + WAY_BYTES).ok_or(Corrupt("entry: truncated"))?;
    let way = parse_way(raw)?;
    let rest = bytes.get(2 + WAY_BYTES..).unwrap_or_default();
    let response = match (way.state, rest.is_empty()) {
        (State::Completed, false) => {
            let (gen, key, r) = decode_response(rest)?;
            if gen != way.gen || key != way.key {
                return Err(Corrupt("entry: response stamp differs"));
            }
            Some(r)
        }
        (_, true) if way.state != State::Completed => None,
        _ => return Err(Corrupt("entry: response does not match state")),
    };
    Ok((way, response))
}

/// A response as replayed: status, headers in order (repeats kept), body.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct StoredResponse {
    pub status: u16,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
}

/// Encodes a stored response, stamped with the way's claim (`gen`, `key`) so that a reader can
/// tell it belongs to the entry it looked up, and a late writer can tell it is newer.
pub fn encode_response(gen: u64, key: &KeyTag, response: &StoredResponse) -> Vec<u8> {
    let headers_len: usize = response.headers.iter().map(|(n, v)| 6 + n.len() + v.len()).sum();
    let mut out = Vec::with_capacity(2 + 8 + 16 + 4 + headers_len + 4 + response.body.len());
    out.extend_from_slice(&RESPONSE_MAGIC);
    out.extend_from_slice(&gen.to_le_bytes());
    out.extend_from_slice(key);
    out.extend_from_slice(&response.status.to_le_bytes());
    // Header names are at most u16 long and values u32: Envoy's own limits are far lower.
    out.extend_from_slice(&(response.headers.len() as u16).to_le_bytes());
    for (name, value) in &response.headers {
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&(value.len() as u32).to_le_bytes());
        out.extend_from_slice(value);
    }
    out.extend_from_slice(&(response.body.len() as u32).to_le_bytes());
    out.extend_from_slice(&response.body);
    out
}

/// The stamp of a stored response, read without decoding the rest.
pub fn response_stamp(bytes: &[u8]) -> Result<(u64, KeyTag), Corrupt> {
    let mut r = Reader(bytes);
    if r.take(2)? != RESPONSE_MAGIC {
        return Err(Corrupt("response: wrong magic"));
    }
    Ok((r.u64()?, r.array()?))
}

pub fn decode_response(bytes: &[u8]) -> Result<(u64, KeyTag, StoredResponse), Corrupt> {
    let (gen, key) = response_stamp(bytes)?;
    let mut r = Reader(bytes.get(2 + 8 + 16..).ok_or(Corrupt("response: truncated"))?);
    let status = r.u16()?;
    let count = r.u16()?;
    let mut headers = Vec::with_capacity(usize::from(count));
    for _ in 0..count {
        let name_len = usize::from(r.u16()?);
        let name = String::from_utf8(r.take(name_len)?.to_vec()).map_err(|_| Corrupt("response: header name"))?;
        let value_len = r.u32()? as usize;
        headers.push((name, r.take(value_len)?.to_vec()));
    }
    let body_len = r.u32()? as usize;
    let body = r.take(body_len)?.to_vec();
    if !r.0.is_empty() {
        return Err(Corrupt("response: trailing bytes"));
    }
    Ok((gen, key, StoredResponse { status, headers, body }))
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

    #[test]
    fn bucket_round_trip() {
        let mut b = Bucket::empty();
        assert_eq!(b.as_bytes().len(), BUCKET_BYTES);
        let way =
            Way { state: State::Completed, gen: 7, key: [3; 16], fingerprint: Fingerprint([9; 16]), deadline_ms: 1234 };
        b.set_way(WAYS - 1, &way);
        let b2 = Bucket::decode(b.as_bytes().to_vec()).unwrap();
        assert_eq!(b2.way(WAYS - 1).unwrap(), way);
        assert_eq!(b2.way(0).unwrap(), Way::FREE);
    }

    #[test]
    fn corrupt_buckets_are_errors() {
        assert!(Bucket::decode(vec![]).is_err());
        assert!(Bucket::decode(b"foreign value".to_vec()).is_err());
        let mut bytes = Bucket::empty().as_bytes().to_vec();
        bytes[2] = 9; // unknown state in way 0
        let bucket = Bucket::decode(bytes).unwrap();
        assert!(bucket.way(0).is_err());
        assert!(bucket.way(1).is_ok());
    }

    #[test]
    fn response_round_trip_keeps_repeated_headers_and_binary_body() {
        let resp = StoredResponse {
            status: 201,
            headers: vec![
                ("content-type".into(), b"application/json".to_vec()),
                ("set-cookie".into(), b"a=1".to_vec()),
                ("set-cookie".into(), b"b=\xff".to_vec()),
            ],
            body: (0..=255u8).collect(),
        };
        let bytes = encode_response(42, &[5; 16], &resp);
        assert_eq!(response_stamp(&bytes).unwrap(), (42, [5; 16]));
        assert_eq!(decode_response(&bytes).unwrap(), (42, [5; 16], resp));
    }

    #[test]
    fn entry_round_trip_and_consistency() {
        let way =
            Way { state: State::Completed, gen: 9, key: [1; 16], fingerprint: Fingerprint([2; 16]), deadline_ms: 5 };
        let resp = StoredResponse { status: 201, headers: vec![("a".into(), b"b".to_vec())], body: b"x".to_vec() };
        let bytes = encode_entry(&way, Some(&resp));
        assert_eq!(decode_entry(&bytes).unwrap(), (way, Some(resp.clone())));
        let mark = Way { state: State::InProgress, ..way };
        assert_eq!(decode_entry(&encode_entry(&mark, None)).unwrap(), (mark, None));
        // A completed entry must carry its response; a mark must not.
        assert!(decode_entry(&encode_entry(&way, None)).is_err());
        assert!(decode_entry(&encode_entry(&mark, Some(&resp))).is_err());
        for n in 0..bytes.len() {
            assert!(decode_entry(&bytes[..n]).is_err(), "prefix {n}");
        }
    }

    #[test]
    fn every_truncation_of_a_response_is_an_error() {
        let resp = StoredResponse { status: 200, headers: vec![("a".into(), b"b".to_vec())], body: b"xyz".to_vec() };
        let bytes = encode_response(1, &[1; 16], &resp);
        for n in 0..bytes.len() {
            assert!(decode_response(&bytes[..n]).is_err(), "prefix {n}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode_response(&longer).is_err());
    }
}
