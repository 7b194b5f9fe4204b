//! An in-memory etcd for the store's tests: the JSON gateway's txn, range, lease grant and
//! keepalive, with revisions, leases that expire with the fake clock, and a switch that
//! refuses every write as etcd does when it is out of space (its NOSPACE alarm).

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};

use super::protocol::{GRANT_PATH, KEEPALIVE_PATH, RANGE_PATH, TXN_PATH};
use crate::store::{CallAnswer, CallRequest};

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
    /// Lease id → (TTL s, expires at ms).
    leases: HashMap<i64, (u64, u64)>,
    next_lease: i64,
    pub no_space: bool,
    /// Requests handled, by path.
    pub requests: HashMap<String, usize>,
}

fn b64(bytes: &[u8]) -> String {
    B64.encode(bytes)
}

fn unb64(v: &Value) -> Vec<u8> {
    v.as_str().and_then(|s| B64.decode(s).ok()).unwrap_or_default()
}

fn int(v: &Value) -> i64 {
    v.as_str().and_then(|s| s.parse().ok()).or_else(|| v.as_i64()).unwrap_or(0)
}

fn answer(status: u16, body: Value) -> CallAnswer {
    CallAnswer {
        status,
        headers: vec![(":status".into(), status.to_string().into_bytes())],
        body: body.to_string().into_bytes(),
    }
}

fn no_space() -> CallAnswer {
    let m = "etcdserver: mvcc: database space exceeded";
    answer(429, json!({"error": m, "message": m, "code": 8}))
}

impl Model {
    pub fn new() -> Model {
        Model { revision: 1, next_lease: 7_000, ..Model::default() }
    }

    /// What etcd answers to `request` at `now`.
    pub fn handle(&mut self, request: &CallRequest, now: u64) -> CallAnswer {
        self.expire(now);
        let path = request.headers.iter().find(|(n, _)| n == ":path").map(|(_, v)| v.clone()).unwrap_or_default();
        *self.requests.entry(path.clone()).or_default() += 1;
        let body: Value = serde_json::from_slice(&request.body).unwrap_or(Value::Null);
        match path.as_str() {
            TXN_PATH => self.txn(&body),
            RANGE_PATH => {
                let key = unb64(&body["key"]);
                answer(200, json!({"header": self.header(), "kvs": self.kv_json(&key)}))
            }
            GRANT_PATH if self.no_space => no_space(),
            GRANT_PATH => {
                let ttl = int(&body["TTL"]).max(1) as u64;
                self.next_lease += 1;
                self.leases.insert(self.next_lease, (ttl, now + ttl * 1000));
                answer(200, json!({"header": self.header(), "ID": self.next_lease.to_string(), "TTL": ttl.to_string()}))
            }
            KEEPALIVE_PATH => {
                let id = int(&body["ID"]);
                match self.leases.get_mut(&id) {
                    Some((ttl, expires)) => {
                        *expires = now + *ttl * 1000;
                        answer(200, json!({"result": {"ID": id.to_string(), "TTL": ttl.to_string()}}))
                    }
                    None => answer(200, json!({"result": {"ID": id.to_string()}})),
                }
            }
            _ => answer(404, json!({"error": "not found", "code": 12})),
        }
    }

    pub fn keys(&self) -> Vec<Vec<u8>> {
        self.kvs.keys().cloned().collect()
    }

    fn expire(&mut self, now: u64) {
        let dead: Vec<i64> = self.leases.iter().filter(|(_, (_, at))| *at <= now).map(|(id, _)| *id).collect();
        for id in dead {
            self.leases.remove(&id);
            self.kvs.retain(|_, e| e.lease != id);
        }
    }

    fn header(&self) -> Value {
        json!({"revision": self.revision.to_string()})
    }

    fn kv_json(&self, key: &[u8]) -> Value {
        match self.kvs.get(key) {
            Some(e) => json!([{"key": b64(key), "value": b64(&e.value),
                "mod_revision": e.mod_revision.to_string(), "create_revision": e.create_revision.to_string()}]),
            None => json!([]),
        }
    }

    fn compare(&self, c: &Value) -> bool {
        let key = unb64(&c["key"]);
        let e = self.kvs.get(&key);
        match c["target"].as_str() {
            Some("CREATE") => e.map_or(0, |e| e.create_revision) == int(&c["create_revision"]),
            Some("MOD") => e.map_or(0, |e| e.mod_revision) == int(&c["mod_revision"]),
            Some("VALUE") => e.map(|e| e.value.clone()) == Some(unb64(&c["value"])),
            _ => false,
        }
    }

    fn txn(&mut self, body: &Value) -> CallAnswer {
        let ok = body["compare"].as_array().is_some_and(|cs| cs.iter().all(|c| self.compare(c)));
        let ops = body[if ok { "success" } else { "failure" }].as_array().cloned().unwrap_or_default();
        // As etcd's quota: a txn costs what its larger branch writes, whichever runs.
        let puts =
            |branch: &str| body[branch].as_array().is_some_and(|b| b.iter().any(|op| op.get("request_put").is_some()));
        if self.no_space && (puts("success") || puts("failure")) {
            return no_space();
        }
        let mut responses = Vec::new();
        for op in &ops {
            if let Some(put) = op.get("request_put") {
                let lease = int(&put["lease"]);
                if lease != 0 && !self.leases.contains_key(&lease) {
                    return answer(404, json!({"error": "etcdserver: requested lease not found", "code": 5}));
                }
                let key = unb64(&put["key"]);
                self.revision += 1;
                let create_revision = self.kvs.get(&key).map_or(self.revision, |e| e.create_revision);
                let entry = Entry { value: unb64(&put["value"]), mod_revision: self.revision, create_revision, lease };
                self.kvs.insert(key, entry);
                responses.push(json!({"response_put": {"header": self.header()}}));
            } else if let Some(range) = op.get("request_range") {
                let key = unb64(&range["key"]);
                responses.push(json!({"response_range": {"header": self.header(), "kvs": self.kv_json(&key)}}));
            } else if let Some(del) = op.get("request_delete_range") {
                if self.kvs.remove(&unb64(&del["key"])).is_some() {
                    self.revision += 1;
                }
                responses.push(json!({"response_delete_range": {"header": self.header()}}));
            }
        }
        let mut out = json!({"header": self.header(), "responses": responses});
        if ok {
            out["succeeded"] = json!(true);
        }
        answer(200, out)
    }
}
