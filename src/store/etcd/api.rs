//! The configured wire (`store.api`): each of the store's requests and answers through the
//! JSON gateway ([`super::json`]) or etcd's gRPC API ([`super::grpc`]).

use super::protocol::{ErrorKind, EtcdError, Kv, Request, Target, TxnResult};
use super::{grpc, json};
use crate::store::{CallAnswer, CallRequest};

/// Which of etcd's two client APIs the store speaks (configured: `store.api`); both are served
/// on etcd's client port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Api {
    /// gRPC (`dispatch_grpc_call`, protobuf): the cluster needs HTTP/2.
    #[default]
    Grpc,
    /// The JSON gateway (`dispatch_http_call`, base64 in JSON) over HTTP/1.1.
    Json,
}

impl Api {
    pub fn call(self, request: &Request, to: &Target) -> CallRequest {
        match self {
            Api::Grpc => grpc::call(request, to),
            Api::Json => json::call(request, to),
        }
    }

    pub fn parse_txn(self, answer: &CallAnswer) -> Result<TxnResult, EtcdError> {
        match self {
            Api::Grpc => grpc::parse_txn(answer),
            Api::Json => json::parse_txn(answer.status, &answer.body),
        }
    }

    pub fn parse_range(self, answer: &CallAnswer) -> Result<Option<Kv>, EtcdError> {
        match self {
            Api::Grpc => grpc::parse_range(answer),
            Api::Json => json::parse_range(answer.status, &answer.body),
        }
    }

    pub fn parse_grant(self, answer: &CallAnswer) -> Result<i64, EtcdError> {
        match self {
            Api::Grpc => grpc::parse_grant(answer),
            Api::Json => json::parse_grant(answer.status, &answer.body),
        }
    }

    /// Whether an answer says etcd was not reached (down, unreachable, timed out, no
    /// leader): the store backs off.
    pub fn is_unreachable(self, answer: &CallAnswer) -> bool {
        let error = match self {
            Api::Grpc => grpc::error_of(answer),
            Api::Json => json::error_of(answer.status, &answer.body),
        };
        error.is_some_and(|e| e.kind() == ErrorKind::Unreachable)
    }

    /// What a call that could not be sent at all stands for: etcd not reached.
    pub fn not_sent(self) -> CallAnswer {
        match self {
            Api::Grpc => grpc::status_answer(14, "dispatch failed"),
            Api::Json => CallAnswer { status: 503, headers: Vec::new(), body: b"dispatch failed".to_vec() },
        }
    }
}
