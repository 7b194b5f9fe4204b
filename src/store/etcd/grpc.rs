//! etcd's gRPC API on the wire: `etcdserverpb.KV/Txn`, `KV/Range` and `Lease/LeaseGrant`,
//! protobuf messages (the fields of etcd's rpc.proto and kv.proto the store uses, same
//! numbers) sent with `dispatch_grpc_call`. An answer comes back as the message and its
//! `grpc-status` and `grpc-message`, as HTTP/2 carries them.

use crate::defects::{planted, Defect};
use prost::Message;

use super::protocol::{kind_of, Compare, EtcdError, Kv, Request, Target, TxnResult, Write};
use crate::store::{CallAnswer, CallKind, CallRequest};

pub const KV: &str = "etcdserverpb.KV";
pub const LEASE: &str = "etcdserverpb.Lease";

pub mod pb {
    //! The messages, as etcd 3.4's `etcdserverpb` and `mvccpb` define them (subset).

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ResponseHeader {
        #[prost(int64, tag = "3")]
        pub revision: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct KeyValue {
        #[prost(bytes = "vec", tag = "1")]
        pub key: Vec<u8>,
        #[prost(int64, tag = "2")]
        pub create_revision: i64,
        #[prost(int64, tag = "3")]
        pub mod_revision: i64,
        #[prost(bytes = "vec", tag = "5")]
        pub value: Vec<u8>,
        #[prost(int64, tag = "6")]
        pub lease: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct RangeRequest {
        #[prost(bytes = "vec", tag = "1")]
        pub key: Vec<u8>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct RangeResponse {
        #[prost(message, optional, tag = "1")]
        pub header: Option<ResponseHeader>,
        #[prost(message, repeated, tag = "2")]
        pub kvs: Vec<KeyValue>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PutRequest {
        #[prost(bytes = "vec", tag = "1")]
        pub key: Vec<u8>,
        #[prost(bytes = "vec", tag = "2")]
        pub value: Vec<u8>,
        #[prost(int64, tag = "3")]
        pub lease: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct DeleteRangeRequest {
        #[prost(bytes = "vec", tag = "1")]
        pub key: Vec<u8>,
    }

    /// `RequestOp`'s oneof.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Op {
        #[prost(message, tag = "1")]
        Range(RangeRequest),
        #[prost(message, tag = "2")]
        Put(PutRequest),
        #[prost(message, tag = "3")]
        DeleteRange(DeleteRangeRequest),
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct RequestOp {
        #[prost(oneof = "Op", tags = "1, 2, 3")]
        pub request: Option<Op>,
    }

    /// `Compare.target` (the result is always EQUAL, 0).
    /// `Compare.result`.
    pub const EQUAL: i32 = 0;
    pub const NOT_EQUAL: i32 = 3;
    pub const TARGET_CREATE: i32 = 1;
    pub const TARGET_MOD: i32 = 2;
    pub const TARGET_VALUE: i32 = 3;

    /// `Compare`'s oneof: what the target is compared with.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Against {
        #[prost(int64, tag = "5")]
        CreateRevision(i64),
        #[prost(int64, tag = "6")]
        ModRevision(i64),
        #[prost(bytes = "vec", tag = "7")]
        Value(Vec<u8>),
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Compare {
        #[prost(int32, tag = "1")]
        pub result: i32,
        #[prost(int32, tag = "2")]
        pub target: i32,
        #[prost(bytes = "vec", tag = "3")]
        pub key: Vec<u8>,
        #[prost(oneof = "Against", tags = "5, 6, 7")]
        pub against: Option<Against>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TxnRequest {
        #[prost(message, repeated, tag = "1")]
        pub compare: Vec<Compare>,
        #[prost(message, repeated, tag = "2")]
        pub success: Vec<RequestOp>,
        #[prost(message, repeated, tag = "3")]
        pub failure: Vec<RequestOp>,
    }

    /// `ResponseOp`'s oneof (the put's and delete's answers carry nothing the store reads).
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Reply {
        #[prost(message, tag = "1")]
        Range(RangeResponse),
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ResponseOp {
        #[prost(oneof = "Reply", tags = "1")]
        pub response: Option<Reply>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TxnResponse {
        #[prost(message, optional, tag = "1")]
        pub header: Option<ResponseHeader>,
        #[prost(bool, tag = "2")]
        pub succeeded: bool,
        #[prost(message, repeated, tag = "3")]
        pub responses: Vec<ResponseOp>,
    }

    /// Envoy's `envoy.config.core.v3.GrpcService`, naming a cluster only (not etcd's).
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct GrpcService {
        #[prost(message, optional, tag = "1")]
        pub envoy_grpc: Option<EnvoyGrpc>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct EnvoyGrpc {
        #[prost(string, tag = "1")]
        pub cluster_name: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct LeaseGrantRequest {
        #[prost(int64, tag = "1")]
        pub ttl: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct LeaseGrantResponse {
        #[prost(message, optional, tag = "1")]
        pub header: Option<ResponseHeader>,
        #[prost(int64, tag = "2")]
        pub id: i64,
        #[prost(int64, tag = "3")]
        pub ttl: i64,
        #[prost(string, tag = "4")]
        pub error: String,
    }
}

pub fn txn_message(request: &Request) -> Option<pb::TxnRequest> {
    let Request::Txn { key, compare, write, read_back } = request else { return None };
    let (target, against) = match compare {
        Compare::Absent => (pb::TARGET_CREATE, pb::Against::CreateRevision(0)),
        Compare::ModRevision(r) => (pb::TARGET_MOD, pb::Against::ModRevision(*r)),
        Compare::Value(v) => (pb::TARGET_VALUE, pb::Against::Value(v.clone())),
    };
    let op = match write {
        Write::Put { value, lease } => {
            pb::Op::Put(pb::PutRequest { key: key.clone(), value: value.clone(), lease: *lease })
        }
        Write::Delete => pb::Op::DeleteRange(pb::DeleteRangeRequest { key: key.clone() }),
    };
    let read = pb::RequestOp { request: Some(pb::Op::Range(pb::RangeRequest { key: key.clone() })) };
    // Planted defects: a claim or a release whose compare always holds.
    let blind = match (compare, write) {
        (Compare::Absent, _) => planted(Defect::ClaimWithoutCompare),
        (Compare::ModRevision(_), Write::Delete) => planted(Defect::ReleaseWithoutCompare),
        _ => false,
    };
    let (result, target, against) = match blind {
        true => (pb::NOT_EQUAL, pb::TARGET_MOD, pb::Against::ModRevision(-1)),
        false => (pb::EQUAL, target, against),
    };
    Some(pb::TxnRequest {
        compare: vec![pb::Compare { result, target, key: key.clone(), against: Some(against) }],
        success: vec![pb::RequestOp { request: Some(op) }],
        failure: if *read_back { vec![read] } else { Vec::new() },
    })
}

/// The service, method and message of a request.
pub fn encode(request: &Request) -> (&'static str, &'static str, Vec<u8>) {
    match request {
        Request::Txn { .. } => (KV, "Txn", txn_message(request).map(|m| m.encode_to_vec()).unwrap_or_default()),
        Request::Range { key } => (KV, "Range", pb::RangeRequest { key: key.clone() }.encode_to_vec()),
        Request::Grant { ttl_s } => {
            let ttl = i64::try_from(*ttl_s).unwrap_or(i64::MAX);
            (LEASE, "LeaseGrant", pb::LeaseGrantRequest { ttl }.encode_to_vec())
        }
    }
}

pub fn call(request: &Request, to: &Target) -> CallRequest {
    let (service, method, body) = encode(request);
    CallRequest {
        cluster: to.cluster.to_string(),
        kind: CallKind::Grpc { service, method, metadata: super::protocol::RETRY_UNSENT },
        body,
        timeout_ms: to.timeout_ms,
    }
}

/// How a gRPC call names `cluster` to Envoy: a serialized `GrpcService` whose `envoy_grpc`
/// is that cluster. Envoy reads the name it is given as a serialized `GrpcService` whenever the
/// bytes parse as one, and as a cluster name only otherwise: a name that happens to parse
/// (`"xa"` does) names no cluster, and Envoy 1.40 then aborts the whole process ("unset
/// oneof"). `None` for a name over 125 bytes, whose length takes a byte that is not UTF-8,
/// which the SDK's `&str` cannot carry: such a name is sent as it is
/// (the configuration refuses one Envoy may read as a message: `envoy_may_misread`).
pub fn envoy_grpc_service(cluster: &str) -> Option<String> {
    let service = pb::GrpcService { envoy_grpc: Some(pb::EnvoyGrpc { cluster_name: cluster.to_string() }) };
    String::from_utf8(service.encode_to_vec()).ok()
}

/// Whether Envoy may read `cluster`, sent as it is (over 125 bytes, see `envoy_grpc_service`),
/// as a serialized `GrpcService`: the bytes are a well-formed protobuf message. Envoy's own parse
/// may still refuse it (a known field of the wrong type); this errs towards "may".
pub fn envoy_may_misread(cluster: &str) -> bool {
    envoy_grpc_service(cluster).is_none() && well_formed_message(cluster.as_bytes())
}

/// Whether `bytes` are a well-formed protobuf message: prost's decoder, with every field
/// unknown, so that any wire type is read and skipped (groups matched, depth bounded).
fn well_formed_message(bytes: &[u8]) -> bool {
    #[derive(Clone, PartialEq, prost::Message)]
    struct AnyMessage {}
    AnyMessage::decode(bytes).is_ok()
}

/// A gRPC call's answer as the store sees it: `status` (a gRPC status code) and `message`
/// in the headers, the response message (if any) as the body.
pub fn status_answer(status: u32, message: &str) -> CallAnswer {
    CallAnswer::grpc(status, message.as_bytes(), Vec::new())
}

pub fn grpc_status(answer: &CallAnswer) -> Option<i64> {
    let value = answer.headers.iter().find(|(n, _)| n == "grpc-status").map(|(_, v)| v.as_slice())?;
    std::str::from_utf8(value).ok()?.parse().ok()
}

/// The error an answer is, if it is one.
pub fn error_of(answer: &CallAnswer) -> Option<EtcdError> {
    let code = grpc_status(answer);
    if code == Some(0) {
        return None;
    }
    let message = answer.headers.iter().find(|(n, _)| n == "grpc-message").map(|(_, v)| v.as_slice());
    let message = String::from_utf8_lossy(message.unwrap_or_default());
    // Envoy's own: UNAVAILABLE when etcd cannot be reached, DEADLINE_EXCEEDED on the timeout.
    let unreachable = matches!(code, None | Some(4) | Some(14));
    let too_large = message.contains("received message larger than max");
    let kind = if too_large { super::protocol::ErrorKind::TooLarge } else { kind_of(&message, code, unreachable) };
    Some(EtcdError::Status { status: answer.status, code, kind })
}

fn decode<M: Message + Default>(answer: &CallAnswer) -> Result<M, EtcdError> {
    if let Some(e) = error_of(answer) {
        return Err(e);
    }
    M::decode(answer.body.as_slice()).map_err(|_| EtcdError::Malformed("not the expected protobuf message"))
}

fn kv(kv: &pb::KeyValue) -> Kv {
    Kv { value: kv.value.clone(), mod_revision: kv.mod_revision }
}

pub fn parse_txn(answer: &CallAnswer) -> Result<TxnResult, EtcdError> {
    let m: pb::TxnResponse = decode(answer)?;
    let revision = m.header.map(|h| h.revision).filter(|r| *r > 0).ok_or(EtcdError::Malformed("no header.revision"))?;
    let current = match (m.succeeded, m.responses.first()) {
        (false, Some(pb::ResponseOp { response: Some(pb::Reply::Range(range)) })) => range.kvs.first().map(kv),
        _ => None,
    };
    Ok(TxnResult { succeeded: m.succeeded, revision, current })
}

pub fn parse_range(answer: &CallAnswer) -> Result<Option<Kv>, EtcdError> {
    let m: pb::RangeResponse = decode(answer)?;
    Ok(m.kvs.first().map(kv))
}

pub fn parse_grant(answer: &CallAnswer) -> Result<i64, EtcdError> {
    let m: pb::LeaseGrantResponse = decode(answer)?;
    if m.id == 0 || !m.error.is_empty() {
        return Err(EtcdError::Malformed("no lease ID"));
    }
    Ok(m.id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::etcd::protocol::ErrorKind;

    fn ok(message: impl Message) -> CallAnswer {
        CallAnswer { body: message.encode_to_vec(), ..status_answer(0, "") }
    }

    #[test]
    fn a_cluster_is_named_by_a_grpc_service_that_envoy_reads_one_way_only() {
        let service = envoy_grpc_service("xa").unwrap();
        assert_eq!(service.as_bytes(), &[0x0a, 0x04, 0x0a, 0x02, b'x', b'a']);
        let longest = "e".repeat(125);
        let decoded = pb::GrpcService::decode(envoy_grpc_service(&longest).unwrap().as_bytes()).unwrap();
        assert_eq!(decoded.envoy_grpc.unwrap().cluster_name, longest);
        assert_eq!(envoy_grpc_service(&"e".repeat(126)), None);
    }

    #[test]
    fn a_long_name_envoy_may_read_as_a_message_is_told_apart() {
        // "x" is field 15, a varint: "xa" repeated is a well-formed message of any length.
        assert!(well_formed_message(b"xa"));
        assert!(envoy_may_misread(&"xa".repeat(64)));
        // A short one is sent as a GrpcService, whatever its bytes.
        assert!(!envoy_may_misread("xa"));
        // Istio's names start with "o" (wire type 7).
        let istio = format!("outbound|2379||{}.svc.cluster.local", "etcd-".repeat(24));
        assert!(!envoy_may_misread(&istio));
        // "e" is field 12, a fixed32: "etcd-east1" is two fields (and aborted Envoy 1.40).
        assert!(well_formed_message(b"etcd-east1"));
        assert!(envoy_may_misread(&"etcd-".repeat(26)));
        assert!(!envoy_may_misread(&format!("{}x", "etcd-".repeat(26))));
        // Groups: start (field 1, type 3 = 0x0b) and end (type 4 = 0x0c) of the same field.
        assert!(well_formed_message(&[0x0b, 0x08, 0x01, 0x0c]));
        assert!(!well_formed_message(&[0x0b, 0x08, 0x01]));
        assert!(!well_formed_message(&[0x0b, 0x14]));
        assert!(!well_formed_message(&[0x0c]));
        // Truncated fields, field 0, a varint that never ends.
        assert!(!well_formed_message(&[0x0a, 0x05, b'a']));
        assert!(!well_formed_message(&[0x00, 0x01]));
        assert!(!well_formed_message(&[0x08, 0xff, 0xff]));
        assert!(!well_formed_message(&[0x0d, 1, 2, 3]));
        assert!(well_formed_message(&[0x09, 1, 2, 3, 4, 5, 6, 7, 8]));
    }

    /// The bytes etcd's own Go client sends for a claim, written out by hand from rpc.proto:
    /// compare{target CREATE, key "k", create_revision 0}, success{put{key, value "v",
    /// lease 42}}, failure{range{key}}.
    #[test]
    fn a_claim_is_the_message_etcd_expects() {
        let (service, method, bytes) = encode(&Request::claim(b"k", b"v".to_vec(), 42));
        assert_eq!((service, method), ("etcdserverpb.KV", "Txn"));
        let expected: &[u8] = &[
            0x0a, 0x07, 0x10, 0x01, 0x1a, 0x01, b'k', 0x28, 0x00, // compare
            0x12, 0x0a, 0x12, 0x08, 0x0a, 0x01, b'k', 0x12, 0x01, b'v', 0x18, 42, // success: put
            0x1a, 0x05, 0x0a, 0x03, 0x0a, 0x01, b'k', // failure: range
        ];
        assert_eq!(bytes, expected);
        let cleanup =
            pb::TxnRequest::decode(encode(&Request::delete_if_value(b"k", b"v".to_vec())).2.as_slice()).unwrap();
        assert!(cleanup.failure.is_empty());
        assert_eq!(cleanup.compare[0].against, Some(pb::Against::Value(b"v".to_vec())));
    }

    #[test]
    fn parses_txns_reads_and_grants() {
        let header = Some(pb::ResponseHeader { revision: 12 });
        let done = ok(pb::TxnResponse { header: header.clone(), succeeded: true, responses: vec![] });
        assert_eq!(parse_txn(&done).unwrap(), TxnResult { succeeded: true, revision: 12, current: None });
        let found =
            pb::KeyValue { key: b"k".to_vec(), mod_revision: 7, value: b"hello".to_vec(), ..Default::default() };
        let read = pb::RangeResponse { header: header.clone(), kvs: vec![found] };
        let failed = pb::TxnResponse {
            header: header.clone(),
            succeeded: false,
            responses: vec![pb::ResponseOp { response: Some(pb::Reply::Range(read.clone())) }],
        };
        let r = parse_txn(&ok(failed)).unwrap();
        assert_eq!(r.current, Some(Kv { value: b"hello".to_vec(), mod_revision: 7 }));
        assert_eq!(parse_range(&ok(read)).unwrap().map(|k| k.mod_revision), Some(7));
        assert_eq!(parse_range(&ok(pb::RangeResponse { header, kvs: vec![] })).unwrap(), None);
        let grant = pb::LeaseGrantResponse { id: 7587862072013137409, ttl: 10, ..Default::default() };
        assert_eq!(parse_grant(&ok(grant)).unwrap(), 7587862072013137409);
        assert!(parse_grant(&ok(pb::LeaseGrantResponse::default())).is_err());
        assert!(parse_txn(&CallAnswer { body: vec![0xff, 0xff], ..status_answer(0, "") }).is_err());
    }

    #[test]
    fn errors_by_status_and_message() {
        let kind = |code, m| parse_txn(&status_answer(code, m)).unwrap_err().kind();
        assert_eq!(kind(14, "upstream connect error or disconnect/reset before headers"), ErrorKind::Unreachable);
        assert_eq!(kind(4, "upstream request timeout"), ErrorKind::Unreachable);
        assert_eq!(kind(14, "etcdserver: no leader"), ErrorKind::Unreachable);
        assert_eq!(kind(8, "etcdserver: mvcc: database space exceeded"), ErrorKind::NoSpace);
        assert_eq!(kind(3, "etcdserver: request is too large"), ErrorKind::TooLarge);
        assert_eq!(kind(8, "grpc: received message larger than max (2000000 vs. 1572864)"), ErrorKind::TooLarge);
        assert!(parse_txn(&status_answer(5, "etcdserver: requested lease not found"))
            .unwrap_err()
            .is_lease_not_found());
        assert_eq!(kind(9, "something else"), ErrorKind::Other);
        // No grpc-status at all: the call broke.
        assert_eq!(error_of(&CallAnswer::default()).map(|e| e.kind()), Some(ErrorKind::Unreachable));
    }
}
