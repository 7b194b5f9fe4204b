//! An in-memory etcd for the store's tests, over the gRPC API (`KV/Txn`, `KV/Range`,
//! `Lease/LeaseGrant`, protobuf as etcd speaks it): revisions, leases that expire with the
//! fake clock, and a switch that refuses every write as etcd does when it is out of space
//! (its NOSPACE alarm).

use prost::Message;
use std::collections::{BTreeMap, HashMap};

use super::grpc::pb;
use crate::store::{CallAnswer, CallKind, CallRequest};

#[derive(Clone)]
struct Entry {
    value: Vec<u8>,
    mod_revision: i64,
    create_revision: i64,
    lease: i64,
}

#[derive(Default)]
pub struct Model {
    kvs: BTreeMap<Vec<u8>, Entry>,
    revision: i64,
    /// Lease id → expires at ms.
    leases: HashMap<i64, u64>,
    next_lease: i64,
    pub no_space: bool,
    /// Requests handled, by method.
    pub requests: HashMap<String, usize>,
    /// Every request handled, in order: its method.
    pub log: Vec<&'static str>,
    /// The requests etcd would put through raft (a proposal, an fsync): lease grants, and
    /// transactions with a write in either branch, whichever branch runs (etcd serves a
    /// transaction as a read only when neither branch writes). Ranges are read through
    /// ReadIndex, without a proposal. Requests refused for lack of space are not proposed.
    pub proposals: usize,
    /// The TTL of every lease granted, in order.
    pub granted_ttls: Vec<i64>,
}

fn ok(message: impl Message) -> CallAnswer {
    CallAnswer::grpc(0, b"", message.encode_to_vec())
}

fn error(code: u32, text: &str) -> CallAnswer {
    CallAnswer::grpc(code, text.as_bytes(), Vec::new())
}

fn no_space() -> CallAnswer {
    error(8, "etcdserver: mvcc: database space exceeded")
}

impl Model {
    pub fn new() -> Model {
        Model { revision: 1, next_lease: 7_000, ..Model::default() }
    }

    /// What etcd answers to `request` at `now`.
    pub fn handle(&mut self, request: &CallRequest, now: u64) -> CallAnswer {
        self.expire(now);
        let CallKind::Grpc { method, .. } = &request.kind else { return error(12, "not a gRPC call") };
        *self.requests.entry(method.to_string()).or_default() += 1;
        self.log.push(*method);
        let body = request.body.as_slice();
        match *method {
            "Txn" => match pb::TxnRequest::decode(body) {
                Ok(txn) => self.txn(&txn),
                Err(_) => error(13, "bad message"),
            },
            "Range" => {
                let key = pb::RangeRequest::decode(body).map(|r| r.key).unwrap_or_default();
                ok(pb::RangeResponse { header: self.header(), kvs: self.kv(&key) })
            }
            "LeaseGrant" if self.no_space => no_space(),
            "LeaseGrant" => {
                let ttl = pb::LeaseGrantRequest::decode(body).map(|r| r.ttl).unwrap_or(0).max(1);
                self.next_lease += 1;
                self.granted_ttls.push(ttl);
                self.leases.insert(self.next_lease, now + ttl as u64 * 1000);
                self.proposals += 1;
                ok(pb::LeaseGrantResponse { header: self.header(), id: self.next_lease, ttl, error: String::new() })
            }
            _ => error(12, "unknown method"),
        }
    }

    /// The key a transaction is on (a claim, renewal, completion or release), if it is one.
    pub fn txn_key(request: &CallRequest) -> Option<Vec<u8>> {
        let CallKind::Grpc { method: "Txn", .. } = &request.kind else { return None };
        pb::TxnRequest::decode(request.body.as_slice()).ok()?.compare.into_iter().next().map(|c| c.key)
    }

    pub fn keys(&self) -> Vec<Vec<u8>> {
        self.kvs.keys().cloned().collect()
    }

    pub fn value(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.kvs.get(key).map(|e| e.value.clone())
    }

    /// A key's value and `mod_revision`.
    pub fn get(&self, key: &[u8]) -> Option<(&[u8], i64)> {
        self.kvs.get(key).map(|e| (e.value.as_slice(), e.mod_revision))
    }

    /// The method of a call and the key it is on (the compare's key for a transaction).
    pub fn request_key(request: &CallRequest) -> Option<(&'static str, Vec<u8>)> {
        let CallKind::Grpc { method, .. } = &request.kind else { return None };
        let key = match *method {
            "Range" => pb::RangeRequest::decode(request.body.as_slice()).ok()?.key,
            "Txn" => Self::txn_key(request)?,
            _ => return None,
        };
        Some((method, key))
    }

    /// When the lease a key rides ends (`None`: no lease, or no such key).
    pub fn lease_end(&self, key: &[u8]) -> Option<u64> {
        self.kvs.get(key).and_then(|e| self.leases.get(&e.lease)).copied()
    }

    /// Whether a transaction's answer says its compare held (its success branch ran).
    pub fn succeeded(answer: &CallAnswer) -> bool {
        pb::TxnResponse::decode(answer.body.as_slice()).is_ok_and(|r| r.succeeded)
    }

    /// Drops the keys of the leases that ended by `now` (etcd does so as time passes).
    pub fn expire(&mut self, now: u64) {
        let dead: Vec<i64> = self.leases.iter().filter(|(_, at)| **at <= now).map(|(id, _)| *id).collect();
        for id in dead {
            self.leases.remove(&id);
            self.kvs.retain(|_, e| e.lease != id);
        }
    }

    fn header(&self) -> Option<pb::ResponseHeader> {
        Some(pb::ResponseHeader { revision: self.revision })
    }

    fn kv(&self, key: &[u8]) -> Vec<pb::KeyValue> {
        self.kvs
            .get(key)
            .map(|e| pb::KeyValue {
                key: key.to_vec(),
                create_revision: e.create_revision,
                mod_revision: e.mod_revision,
                value: e.value.clone(),
                lease: e.lease,
            })
            .into_iter()
            .collect()
    }

    fn compare(&self, c: &pb::Compare) -> bool {
        let e = self.kvs.get(&c.key);
        let equal = match (c.target, &c.against) {
            (pb::TARGET_CREATE, Some(pb::Against::CreateRevision(r))) => e.map_or(0, |e| e.create_revision) == *r,
            (pb::TARGET_MOD, Some(pb::Against::ModRevision(r))) => e.map_or(0, |e| e.mod_revision) == *r,
            (pb::TARGET_VALUE, Some(pb::Against::Value(v))) => e.is_some_and(|e| &e.value == v),
            _ => return false,
        };
        match c.result {
            pb::EQUAL => equal,
            pb::NOT_EQUAL => !equal,
            _ => false, // GREATER and LESS: the plugin sends neither
        }
    }

    fn txn(&mut self, txn: &pb::TxnRequest) -> CallAnswer {
        let succeeded = txn.compare.iter().all(|c| self.compare(c));
        // As etcd's quota: a txn costs what its larger branch writes, whichever runs.
        let puts = |ops: &[pb::RequestOp]| ops.iter().any(|op| matches!(op.request, Some(pb::Op::Put(_))));
        if self.no_space && (puts(&txn.success) || puts(&txn.failure)) {
            return no_space();
        }
        let writes = |ops: &[pb::RequestOp]| ops.iter().any(|op| !matches!(op.request, Some(pb::Op::Range(_)) | None));
        if writes(&txn.success) || writes(&txn.failure) {
            self.proposals += 1;
        }
        let mut responses = Vec::new();
        for op in if succeeded { &txn.success } else { &txn.failure } {
            match &op.request {
                Some(pb::Op::Put(put)) => {
                    if put.lease != 0 && !self.leases.contains_key(&put.lease) {
                        return error(5, "etcdserver: requested lease not found");
                    }
                    self.revision += 1;
                    let create_revision = self.kvs.get(&put.key).map_or(self.revision, |e| e.create_revision);
                    let entry = Entry {
                        value: put.value.clone(),
                        mod_revision: self.revision,
                        create_revision,
                        lease: put.lease,
                    };
                    self.kvs.insert(put.key.clone(), entry);
                    responses.push(pb::ResponseOp { response: None });
                }
                Some(pb::Op::Range(range)) => {
                    let read = pb::RangeResponse { header: self.header(), kvs: self.kv(&range.key) };
                    responses.push(pb::ResponseOp { response: Some(pb::Reply::Range(read)) });
                }
                Some(pb::Op::DeleteRange(del)) => {
                    if self.kvs.remove(&del.key).is_some() {
                        self.revision += 1;
                    }
                    responses.push(pb::ResponseOp { response: None });
                }
                None => {}
            }
        }
        ok(pb::TxnResponse { header: self.header(), succeeded, responses })
    }
}
