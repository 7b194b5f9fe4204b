//! The etcd v3 JSON gateway, sans I/O: the bodies the plugin sends and the parsers of what
//! etcd answers (SPEC §4: `POST /v3/kv/txn`, keys and values base64, 64-bit numbers as
//! strings, false and empty fields omitted). The store ([`super::EtcdStore`]) builds and
//! reads them; the host adapter sends them with `dispatch_http_call`.

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use serde_json::{json, Value};

pub const TXN_PATH: &str = "/v3/kv/txn";
pub const RANGE_PATH: &str = "/v3/kv/range";
pub const GRANT_PATH: &str = "/v3/lease/grant";
pub const KEEPALIVE_PATH: &str = "/v3/lease/keepalive";

/// The etcd key of a store key: `/<namespace>/<hex of the SHA-256 store key>`.
pub fn key_name(namespace: &str, store_key: &[u8; 32]) -> Vec<u8> {
    let mut k = format!("/{namespace}/").into_bytes();
    for b in store_key {
        k.extend_from_slice(format!("{b:02x}").as_bytes());
    }
    k
}

fn b64(bytes: &[u8]) -> String {
    B64.encode(bytes)
}

fn put(key: &[u8], value: &[u8], lease: i64) -> Value {
    let mut p = json!({"key": b64(key), "value": b64(value)});
    if let (true, Some(obj)) = (lease != 0, p.as_object_mut()) {
        obj.insert("lease".into(), json!(lease.to_string()));
    }
    json!({"request_put": p})
}

fn range(key: &[u8]) -> Value {
    json!({"request_range": {"key": b64(key)}})
}

/// Claim: create the key if it does not exist; otherwise read it, in the same round trip.
pub fn claim_txn(key: &[u8], value: &[u8], lease: i64) -> Vec<u8> {
    json!({
        "compare": [{"key": b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}],
        "success": [put(key, value, lease)],
        "failure": [range(key)],
    })
    .to_string()
    .into_bytes()
}

/// Replace the value if nobody wrote the key since `mod_revision` (takeover, renewal,
/// completion); otherwise read it.
pub fn replace_txn(key: &[u8], mod_revision: i64, value: &[u8], lease: i64) -> Vec<u8> {
    json!({
        "compare": [{"key": b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": mod_revision.to_string()}],
        "success": [put(key, value, lease)],
        "failure": [range(key)],
    })
    .to_string()
    .into_bytes()
}

/// Delete the key if nobody wrote it since `mod_revision` (release); otherwise read it (a
/// renewal that etcd applied but did not acknowledge moved the revision on).
pub fn delete_txn(key: &[u8], mod_revision: i64) -> Vec<u8> {
    json!({
        "compare": [{"key": b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": mod_revision.to_string()}],
        "success": [{"request_delete_range": {"key": b64(key)}}],
        "failure": [range(key)],
    })
    .to_string()
    .into_bytes()
}

/// Delete the key if it still holds exactly `value`: cleans up a claim whose answer was lost
/// (it may or may not have been applied).
pub fn delete_if_value_txn(key: &[u8], value: &[u8]) -> Vec<u8> {
    json!({
        "compare": [{"key": b64(key), "result": "EQUAL", "target": "VALUE", "value": b64(value)}],
        "success": [{"request_delete_range": {"key": b64(key)}}],
    })
    .to_string()
    .into_bytes()
}

/// Read one key (no write: it works while etcd refuses writes for lack of space).
pub fn range_body(key: &[u8]) -> Vec<u8> {
    json!({"key": b64(key)}).to_string().into_bytes()
}

pub fn grant_body(ttl_s: u64) -> Vec<u8> {
    json!({"TTL": ttl_s.to_string()}).to_string().into_bytes()
}

pub fn keepalive_body(lease: i64) -> Vec<u8> {
    json!({"ID": lease.to_string()}).to_string().into_bytes()
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EtcdError {
    /// An HTTP status other than 200 (Envoy's 503/504 when etcd is down or slow, or etcd's
    /// own error), with etcd's error code and what its message says, when the body has them.
    Status { status: u16, code: Option<i64>, kind: ErrorKind },
    /// The body is not what the gateway sends.
    Malformed(&'static str),
}

/// The etcd errors the plugin acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// No answer from etcd itself: Envoy's 502/503/504 (down, unreachable, timed out), or
    /// etcd unavailable (no leader). The store backs off.
    Unreachable,
    /// `etcdserver: mvcc: database space exceeded`: the quota alarm is on and every write is
    /// refused until an operator frees space; reads and deletes still work.
    NoSpace,
    /// `etcdserver: request is too large`: the value is over `--max-request-bytes`.
    TooLarge,
    /// Any other error etcd answered (a lease that is gone: code 5).
    Other,
}

impl EtcdError {
    /// etcd's gRPC code 5 (NotFound) on a put: the lease is gone.
    pub fn is_lease_not_found(&self) -> bool {
        matches!(self, EtcdError::Status { code: Some(5), .. })
    }

    pub fn kind(&self) -> ErrorKind {
        match self {
            EtcdError::Status { kind, .. } => *kind,
            EtcdError::Malformed(_) => ErrorKind::Other,
        }
    }
}

/// Bounded, jittered, doubling delays after failures (SPEC §3.8: a store that fails is never
/// hammered): `BACKOFF_MIN_MS`, twice that, … up to `BACKOFF_MAX_MS`, each drawn between half
/// and all of it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Backoff {
    failures: u32,
    next_ms: u64,
}

pub const BACKOFF_MIN_MS: u64 = 100;
pub const BACKOFF_MAX_MS: u64 = 2_000;

impl Backoff {
    /// Whether a request may go now.
    pub fn ready(&self, now_ms: u64) -> bool {
        now_ms >= self.next_ms
    }

    pub fn failing(&self) -> bool {
        self.failures > 0
    }

    /// A failure at `now`; `random` is any random number (the jitter).
    pub fn fail(&mut self, now_ms: u64, random: u64) {
        let ceiling = BACKOFF_MIN_MS.saturating_mul(1 << self.failures.min(16)).min(BACKOFF_MAX_MS);
        let half = ceiling / 2;
        self.next_ms = now_ms + half + random % (half + 1);
        self.failures = self.failures.saturating_add(1);
    }

    pub fn succeed(&mut self) {
        *self = Backoff::default();
    }
}

/// A key as read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kv {
    pub value: Vec<u8>,
    pub mod_revision: i64,
}

/// What a transaction did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxnResult {
    pub succeeded: bool,
    /// The store's revision after the txn: a successful put's new `mod_revision`.
    pub revision: i64,
    /// On failure, the key as the failure branch read it (`None`: absent).
    pub current: Option<Kv>,
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

fn body_json(status: u16, body: &[u8]) -> Result<Value, EtcdError> {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    if status != 200 {
        let code = parsed.as_ref().and_then(|v| v.get("code")).and_then(int);
        let says = |text: &str| {
            let message = parsed.as_ref().and_then(|v| v.get("error").or_else(|| v.get("message")));
            message.and_then(Value::as_str).is_some_and(|m| m.contains(text))
        };
        let kind = if says("database space exceeded") {
            ErrorKind::NoSpace
        } else if says("request is too large") {
            ErrorKind::TooLarge
        } else if parsed.is_none() && matches!(status, 0 | 502..=504) || code == Some(14) {
            // Envoy's own answer (text), or etcd's Unavailable (14).
            ErrorKind::Unreachable
        } else {
            ErrorKind::Other
        };
        return Err(EtcdError::Status { status, code, kind });
    }
    parsed.ok_or(EtcdError::Malformed("not JSON"))
}

/// Whether an answer says etcd was not reached (Envoy's own 502/503/504, etcd unavailable):
/// the store backs off.
pub fn is_unreachable(status: u16, body: &[u8]) -> bool {
    status != 200 && matches!(body_json(status, body), Err(e) if e.kind() == ErrorKind::Unreachable)
}

/// The key a range read found, if any.
pub fn parse_range(status: u16, body: &[u8]) -> Result<Option<Kv>, EtcdError> {
    let v = body_json(status, body)?;
    v.get("kvs").and_then(|k| k.get(0)).map(parse_kv).transpose()
}

fn parse_kv(kv: &Value) -> Result<Kv, EtcdError> {
    let value = match kv.get("value").and_then(Value::as_str) {
        Some(s) => B64.decode(s).map_err(|_| EtcdError::Malformed("value is not base64"))?,
        None => Vec::new(),
    };
    let mod_revision = kv.get("mod_revision").and_then(int).ok_or(EtcdError::Malformed("no mod_revision"))?;
    Ok(Kv { value, mod_revision })
}

pub fn parse_txn(status: u16, body: &[u8]) -> Result<TxnResult, EtcdError> {
    let v = body_json(status, body)?;
    let revision = v
        .get("header")
        .and_then(|h| h.get("revision"))
        .and_then(int)
        .ok_or(EtcdError::Malformed("no header.revision"))?;
    let succeeded = v.get("succeeded").and_then(Value::as_bool).unwrap_or(false);
    let current = if succeeded {
        None
    } else {
        let kv = v
            .get("responses")
            .and_then(|r| r.get(0))
            .and_then(|r| r.get("response_range"))
            .and_then(|r| r.get("kvs"))
            .and_then(|k| k.get(0));
        kv.map(parse_kv).transpose()?
    };
    Ok(TxnResult { succeeded, revision, current })
}

/// A granted lease's id.
pub fn parse_grant(status: u16, body: &[u8]) -> Result<i64, EtcdError> {
    let v = body_json(status, body)?;
    v.get("ID").and_then(int).filter(|id| *id != 0).ok_or(EtcdError::Malformed("no lease ID"))
}

/// Whether a keepalive found the lease alive (a dead lease answers 200 without `TTL`).
pub fn parse_keepalive(status: u16, body: &[u8]) -> Result<bool, EtcdError> {
    let v = body_json(status, body)?;
    let result = v.get("result").ok_or(EtcdError::Malformed("no result"))?;
    Ok(result.get("TTL").and_then(int).unwrap_or(0) > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_body_has_the_create_compare() {
        let body: Value = serde_json::from_slice(&claim_txn(b"/ns/k", b"v", 42)).unwrap();
        assert_eq!(body["compare"][0]["target"], "CREATE");
        assert_eq!(body["compare"][0]["create_revision"], "0");
        assert_eq!(body["success"][0]["request_put"]["lease"], "42");
        assert_eq!(body["success"][0]["request_put"]["value"], "dg==");
        assert_eq!(body["failure"][0]["request_range"]["key"], "L25zL2s=");
        let no_lease: Value = serde_json::from_slice(&claim_txn(b"k", b"v", 0)).unwrap();
        assert!(no_lease["success"][0]["request_put"].get("lease").is_none());
    }

    #[test]
    fn parses_a_successful_txn() {
        let body = br#"{"header":{"cluster_id":"1","member_id":"2","revision":"12","raft_term":"2"},"succeeded":true,"responses":[{"response_put":{"header":{"revision":"12"}}}]}"#;
        assert_eq!(parse_txn(200, body).unwrap(), TxnResult { succeeded: true, revision: 12, current: None });
    }

    #[test]
    fn parses_a_failed_txn_with_its_read() {
        let body = br#"{"header":{"revision":"9"},"responses":[{"response_range":{"header":{"revision":"9"},"kvs":[{"key":"aw==","create_revision":"5","mod_revision":"7","version":"2","value":"aGVsbG8="}],"count":"1"}}]}"#;
        let r = parse_txn(200, body).unwrap();
        assert!(!r.succeeded);
        assert_eq!(r.current, Some(Kv { value: b"hello".to_vec(), mod_revision: 7 }));
        // The key vanished between compare and read: no kvs.
        let gone = br#"{"header":{"revision":"9"},"responses":[{"response_range":{"header":{"revision":"9"}}}]}"#;
        assert_eq!(parse_txn(200, gone).unwrap().current, None);
    }

    #[test]
    fn errors_carry_status_and_code() {
        let e = parse_txn(404, br#"{"error":"etcdserver: requested lease not found","code":5}"#).unwrap_err();
        assert!(e.is_lease_not_found());
        let e = parse_txn(503, b"upstream connect error").unwrap_err();
        assert_eq!(e, EtcdError::Status { status: 503, code: None, kind: ErrorKind::Unreachable });
        assert_eq!(parse_txn(504, b"upstream request timeout").unwrap_err().kind(), ErrorKind::Unreachable);
        let full = br#"{"error":"etcdserver: mvcc: database space exceeded","code":8}"#;
        assert_eq!(parse_txn(429, full).unwrap_err().kind(), ErrorKind::NoSpace);
        let big = br#"{"error":"etcdserver: request is too large","code":3}"#;
        assert_eq!(parse_txn(400, big).unwrap_err().kind(), ErrorKind::TooLarge);
        let no_leader = br#"{"error":"etcdserver: no leader","code":14}"#;
        assert_eq!(parse_txn(503, no_leader).unwrap_err().kind(), ErrorKind::Unreachable);
        assert_eq!(parse_txn(404, br#"{"error":"lease not found","code":5}"#).unwrap_err().kind(), ErrorKind::Other);
        assert!(parse_txn(200, b"{}").is_err());
        assert!(parse_txn(
            200,
            br#"{"header":{"revision":"1"},"responses":[{"response_range":{"kvs":[{"value":"!!"}]}}]}"#
        )
        .is_err());
    }

    #[test]
    fn leases() {
        assert_eq!(
            parse_grant(200, br#"{"header":{},"ID":"7587862072013137409","TTL":"10"}"#).unwrap(),
            7587862072013137409
        );
        assert!(parse_keepalive(200, br#"{"result":{"header":{},"ID":"1","TTL":"9"}}"#).unwrap());
        assert!(!parse_keepalive(200, br#"{"result":{"header":{},"ID":"1"}}"#).unwrap());
    }

    #[test]
    fn range_reads() {
        let found =
            br#"{"header":{"revision":"9"},"kvs":[{"key":"aw==","mod_revision":"7","value":"aGk="}],"count":"1"}"#;
        assert_eq!(parse_range(200, found).unwrap(), Some(Kv { value: b"hi".to_vec(), mod_revision: 7 }));
        assert_eq!(parse_range(200, br#"{"header":{"revision":"9"}}"#).unwrap(), None);
        assert!(parse_range(503, b"down").is_err());
        let body: Value = serde_json::from_slice(&range_body(b"/ns/k")).unwrap();
        assert_eq!(body["key"], "L25zL2s=");
    }

    #[test]
    fn backoff_doubles_with_jitter_up_to_its_bound_and_resets() {
        let mut b = Backoff::default();
        assert!(b.ready(0) && !b.failing());
        let mut now = 1_000;
        let mut waits = Vec::new();
        for i in 0..8 {
            b.fail(now, i * 7919);
            let wait = (0..).map(|d| now + d).find(|t| b.ready(*t)).unwrap() - now;
            waits.push(wait);
            now += wait;
        }
        assert!((50..=100).contains(&waits[0]), "{waits:?}");
        assert!((100..=200).contains(&waits[1]), "{waits:?}");
        assert!(waits.iter().all(|w| *w <= BACKOFF_MAX_MS), "{waits:?}");
        assert!(waits[7] >= BACKOFF_MAX_MS / 2, "{waits:?}");
        b.succeed();
        assert!(b.ready(now) && !b.failing());
    }

    #[test]
    fn key_names_are_prefixed_hex() {
        assert_eq!(key_name("idem", &[0xab; 32]), format!("/idem/{}", "ab".repeat(32)).into_bytes());
    }
}
