//! etcd's JSON gateway on the wire (docs/behaviour.md §4): `POST /v3/kv/txn` and the rest over HTTP/1.1,
//! keys and values base64, 64-bit numbers as strings, false and empty fields omitted.

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use serde_json::{json, Value};

use super::protocol::{kind_of, Compare, EtcdError, Kv, Request, Target, TxnResult, Write};
use crate::header_map::HeaderMap;
use crate::store::{CallKind, CallRequest};

pub const TXN_PATH: &str = "/v3/kv/txn";
pub const RANGE_PATH: &str = "/v3/kv/range";
pub const GRANT_PATH: &str = "/v3/lease/grant";

fn b64(bytes: &[u8]) -> String {
    B64.encode(bytes)
}

pub fn call(request: &Request, to: &Target) -> CallRequest {
    let (path, body) = encode(request);
    let fixed =
        [(":method", "POST"), (":path", path), (":authority", to.authority), ("content-type", "application/json")];
    let pairs: Vec<(&str, &str)> = fixed.iter().chain(super::protocol::RETRY_UNSENT).copied().collect();
    let headers = HeaderMap::from_pairs(&pairs);
    CallRequest {
        cluster: to.cluster.to_string(),
        kind: CallKind::Http { headers },
        body: body.to_string().into_bytes(),
        timeout_ms: to.timeout_ms,
    }
}

pub fn encode(request: &Request) -> (&'static str, Value) {
    match request {
        Request::Txn { key, compare, write, read_back } => {
            let compare = match compare {
                Compare::Absent => {
                    json!({"key": b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"})
                }
                Compare::ModRevision(r) => {
                    json!({"key": b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": r.to_string()})
                }
                Compare::Value(v) => json!({"key": b64(key), "result": "EQUAL", "target": "VALUE", "value": b64(v)}),
            };
            let success = match write {
                Write::Put { value, lease } => {
                    let mut put = json!({"key": b64(key), "value": b64(value)});
                    if let (true, Some(obj)) = (*lease != 0, put.as_object_mut()) {
                        obj.insert("lease".into(), json!(lease.to_string()));
                    }
                    json!({"request_put": put})
                }
                Write::Delete => json!({"request_delete_range": {"key": b64(key)}}),
            };
            let mut txn = json!({"compare": [compare], "success": [success]});
            if let (true, Some(obj)) = (*read_back, txn.as_object_mut()) {
                obj.insert("failure".into(), json!([{"request_range": {"key": b64(key)}}]));
            }
            (TXN_PATH, txn)
        }
        Request::Range { key } => (RANGE_PATH, json!({"key": b64(key)})),
        Request::Grant { ttl_s } => (GRANT_PATH, json!({"TTL": ttl_s.to_string()})),
    }
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

/// The error an answer is, if it is one.
pub fn error_of(status: u16, body: &[u8]) -> Option<EtcdError> {
    body_json(status, body).err()
}

fn body_json(status: u16, body: &[u8]) -> Result<Value, EtcdError> {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    if status != 200 {
        let code = parsed.as_ref().and_then(|v| v.get("code")).and_then(int);
        let message = parsed.as_ref().and_then(|v| v.get("error").or_else(|| v.get("message")));
        // Envoy's own answer is text: etcd down, unreachable or too slow.
        let envoy_unreachable = parsed.is_none() && matches!(status, 0 | 502..=504);
        let kind = kind_of(message.and_then(Value::as_str).unwrap_or(""), code, envoy_unreachable);
        return Err(EtcdError::Status { status, code, kind });
    }
    parsed.ok_or(EtcdError::Malformed("not JSON"))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::etcd::protocol::ErrorKind;

    fn body(request: &Request) -> Value {
        encode(request).1
    }

    #[test]
    fn claim_body_has_the_create_compare() {
        let b = body(&Request::claim(b"/ns/k", b"v".to_vec(), 42));
        assert_eq!(b["compare"][0]["target"], "CREATE");
        assert_eq!(b["compare"][0]["create_revision"], "0");
        assert_eq!(b["success"][0]["request_put"]["lease"], "42");
        assert_eq!(b["success"][0]["request_put"]["value"], "dg==");
        assert_eq!(b["failure"][0]["request_range"]["key"], "L25zL2s=");
        let no_lease = body(&Request::claim(b"k", b"v".to_vec(), 0));
        assert!(no_lease["success"][0]["request_put"].get("lease").is_none());
        let cleanup = body(&Request::delete_if_value(b"k", b"v".to_vec()));
        assert_eq!(cleanup["compare"][0]["target"], "VALUE");
        assert!(cleanup.get("failure").is_none());
        let release = body(&Request::delete(b"k", 7));
        assert_eq!(release["compare"][0]["mod_revision"], "7");
        assert_eq!(release["success"][0]["request_delete_range"]["key"], "aw==");
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
        assert!(parse_grant(200, br#"{"header":{},"ID":"0"}"#).is_err());
        assert_eq!(body(&Request::Grant { ttl_s: 20 })["TTL"], "20");
    }

    #[test]
    fn range_reads() {
        let found =
            br#"{"header":{"revision":"9"},"kvs":[{"key":"aw==","mod_revision":"7","value":"aGk="}],"count":"1"}"#;
        assert_eq!(parse_range(200, found).unwrap(), Some(Kv { value: b"hi".to_vec(), mod_revision: 7 }));
        assert_eq!(parse_range(200, br#"{"header":{"revision":"9"}}"#).unwrap(), None);
        assert!(parse_range(503, b"down").is_err());
        assert_eq!(body(&Request::Range { key: b"/ns/k".to_vec() })["key"], "L25zL2s=");
    }
}
