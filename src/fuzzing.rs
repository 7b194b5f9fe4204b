//! Entry points shared by the fuzz targets (`fuzz/`) and the corpus replay test, so both feed
//! untrusted bytes to exactly the same parsers. Each must return normally on any input.

use crate::config::Config;
use crate::encoding::{response_stamp, Bucket, StoredResponse};
use crate::fingerprint::Fingerprint;
use crate::host::memory::MemoryKv;
use crate::host::SharedKv;
use crate::key::{parse_key, StoreKey};
use crate::store::table::{decide, Layout, Table, Verdict};
use crate::store::StoreError;

/// The plugin configuration: parse, and if accepted, look up a policy.
pub fn config(data: &[u8]) {
    if let Ok(c) = Config::parse(data) {
        let i = c.policy_for(b"/payments/1?x", b"POST", Some(b"route"));
        let _ = c.policy(i);
    }
}

/// A key header value: parse it with a few limits and derive its store key.
pub fn key(data: &[u8]) {
    for max in [1, 16, 255] {
        if let Ok(k) = parse_key(data, max) {
            assert!(!k.is_empty() && k.len() <= max);
            let _ = StoreKey::derive("ns", b"host", &[Some(data), None], &k);
        }
    }
}

/// A store value: decode it as a bucket and as a response; plant it in a table and use it.
pub fn entry(data: &[u8]) {
    if let Ok(bucket) = Bucket::decode(data.to_vec()) {
        let _ = decide(&bucket, &[0; 16], &Fingerprint::default(), crate::caller::Caller::ANONYMOUS, 1, 60_000);
    }
    if let Ok((gen, key, response)) = StoredResponse::decode(data.to_vec()) {
        assert_eq!(response_stamp(data).ok(), Some((gen, key)));
        assert_eq!(response.as_bytes(), data);
        let mut again = StoredResponse::new(response.status(), response.headers(), response.body().to_vec());
        again.stamp(gen, &key);
        assert_eq!(again.as_bytes(), data, "the encoding is canonical");
    }
    // A foreign value in the bucket key of a one-bucket table: an error, or (if it is a valid
    // bucket) a decision, but never a replay (every data key is empty).
    let table = Table::new(MemoryKv::new(), Layout::new("f", 1, 1 << 20));
    if table.create().is_err() {
        return;
    }
    let kv = table.store();
    let _ = kv.set("f:t2:1:b0", data, None);
    let k = StoreKey::derive("f", b"h", &[], b"k");
    let is_bucket = Bucket::decode(data.to_vec()).is_ok();
    let begin = table.begin(&k, &Fingerprint::default(), 1, 10);
    let refused = matches!(begin, Err(StoreError::Corrupt(_)));
    let decided = is_bucket && matches!(begin, Ok(ref b) if !matches!(b, Verdict::Replay(_)));
    assert!(refused || decided, "planted bucket: {begin:?}");
    assert_eq!(table.sweep(0, u64::MAX, None).is_err(), !is_bucket);

    // A completed entry whose response was replaced by a foreign value: an error, unless the
    // value is a response stamped for exactly this entry.
    let table = Table::new(MemoryKv::new(), Layout::new("g", 1, 1 << 20));
    if table.create().is_err() {
        return;
    }
    if let Ok(Verdict::Claimed { ticket, .. }) = table.begin(&k, &Fingerprint::default(), 1, 10) {
        let mut response = StoredResponse::new(200, [], b"ok".to_vec());
        let _ = table.complete(&ticket, Some(&mut response), 1, 100);
        let _ = table.store().set(&format!("g:t2:1:d{}", ticket.slot), data, None);
        let ours = StoredResponse::decode(data.to_vec()).ok().filter(|(g, k, _)| *g == ticket.gen && *k == ticket.key);
        let begin = table.begin(&k, &Fingerprint::default(), 2, 10);
        let ok = match (&begin, ours) {
            (Ok(Verdict::Replay(r)), Some((_, _, planted))) => **r == planted,
            (Err(StoreError::Corrupt(_)), None) => true,
            _ => false,
        };
        assert!(ok, "planted response: {begin:?}");
        let _ = table.release(&ticket);
    }
    let _ = crate::store::table::retention::EvictionWindow::decode(data);
}

/// An answer from etcd (the JSON gateway's or a gRPC message), and an etcd value (an entry
/// of ours or a foreign one).
pub fn etcd(data: &[u8]) {
    use crate::store::etcd::api::Api;
    use crate::store::etcd::{grpc, json};
    for status in [200, 404, 503] {
        let _ = json::parse_txn(status, data);
        let _ = json::parse_grant(status, data);
        let _ = json::parse_range(status, data);
    }
    for code in [0, 5, 14] {
        let answer = crate::store::CallAnswer { body: data.to_vec(), ..grpc::status_answer(code, "") };
        let _ = Api::Grpc.parse_txn(&answer);
        let _ = Api::Grpc.parse_grant(&answer);
        let _ = Api::Grpc.parse_range(&answer);
    }
    if let Ok((entry, response)) = crate::encoding::decode_entry(data) {
        assert_eq!(crate::encoding::encode_entry(&entry, response.as_ref()), data);
        let _ = crate::store::decision::decide_entry(Some(&entry), &Fingerprint::default(), 1);
    }
}
