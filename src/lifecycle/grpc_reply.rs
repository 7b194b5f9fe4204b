//! gRPC callers (docs/behaviour.md §3.10): the plugin's own answers as trailers-only gRPC errors, and the
//! stored result of a failed call replayed as the same status and trailers.
//!
//! The codes follow gRPC's status code guide and Google's AIP-193: a duplicate in progress is
//! `ABORTED` (retry the whole call later) with `grpc-retry-pushback-ms` and a
//! `google.rpc.RetryInfo`; what the client must change is `INVALID_ARGUMENT`; a body over the
//! limit is `RESOURCE_EXHAUSTED`; no work done and safe to retry is `UNAVAILABLE`.

use prost::Message;

use super::problem::Problem;
use crate::encoding::StoredResponse;
use crate::host::Headers;

pub const OK: u32 = 0;
pub const INVALID_ARGUMENT: u32 = 3;
pub const FAILED_PRECONDITION: u32 = 9;
pub const ABORTED: u32 = 10;
pub const RESOURCE_EXHAUSTED: u32 = 8;
pub const INTERNAL: u32 = 13;
pub const UNAVAILABLE: u32 = 14;
pub const UNAUTHENTICATED: u32 = 16;

/// Stored responses keep a gRPC call's trailers among their headers, under this prefix (no
/// response header starts with `:` but `:status`).
pub const TRAILER: &str = ":t:";

/// The path a gRPC replay with messages takes: the route for it must lead to the replay
/// loopback (`grpc_replays: "loopback"`, docs/configuration.md). Should it reach a gRPC
/// server instead, no method of that name runs: it answers UNIMPLEMENTED.
pub const REPLAY_PATH: &str = "/__idempotency/replay";

/// A trailers-only gRPC answer: the status, its message and the metadata that goes with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcAnswer {
    pub code: u32,
    pub message: String,
    pub metadata: Vec<(String, Vec<u8>)>,
}

/// Whether a request is a gRPC call, from its `content-type`.
pub fn is_grpc(content_type: Option<&[u8]>) -> bool {
    content_type.is_some_and(|t| t.starts_with(b"application/grpc"))
}

/// The `grpc-status` of a response's headers or trailers, if it has one.
pub fn status_of<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Option<u32> {
    let (_, v) = pairs.into_iter().find(|(n, _)| *n == "grpc-status")?;
    std::str::from_utf8(v).ok()?.trim().parse().ok()
}

impl GrpcAnswer {
    /// The plugin's own answer in gRPC's terms (docs/behaviour.md §3.10).
    pub fn for_problem(p: &Problem) -> GrpcAnswer {
        let code = match (p.status, p.slug()) {
            (409, "in-progress") => ABORTED,
            (409, _) => FAILED_PRECONDITION, // completed, its response not stored
            (400 | 422, _) => INVALID_ARGUMENT,
            (401, _) => UNAUTHENTICATED,
            // A message too large is RESOURCE_EXHAUSTED in gRPC's own codes, as is a full store.
            (413 | 429, _) | (503, "store-full") | (502, "answer-too-large") => RESOURCE_EXHAUSTED,
            (500, _) => INTERNAL,
            _ => UNAVAILABLE, // store full or unavailable, upstream gone: no work done
        };
        let mut metadata = Vec::new();
        if let (ABORTED | RESOURCE_EXHAUSTED, Some(seconds)) = (code, p.retry_after) {
            metadata.push(("grpc-retry-pushback-ms".to_string(), (seconds * 1000).to_string().into_bytes()));
            metadata.push(("grpc-status-details-bin".to_string(), retry_details(code, p.title(), seconds)));
        }
        GrpcAnswer { code, message: p.title().to_string(), metadata }
    }

    /// The replay of a stored gRPC result that failed (a non-OK `grpc-status`, no message):
    /// the same status, message and trailing metadata, as trailers-only. `None` for a result
    /// with messages, which a local reply cannot carry (docs/limits.md).
    pub fn replay_of(response: &StoredResponse, replayed: bool) -> Option<GrpcAnswer> {
        let code = trailers_only_status(response)?;
        let mut message = String::new();
        let mut metadata = Vec::new();
        for (name, value) in response.headers() {
            let name = name.strip_prefix(TRAILER).unwrap_or(name);
            match name {
                "grpc-status" | "content-type" | "content-length" | "date" | "server" => {}
                _ if name.starts_with(':') || name.starts_with("x-envoy-") => {}
                "grpc-message" => message = percent_decoded(value),
                _ => metadata.push((name.to_string(), value.to_vec())),
            }
        }
        if replayed {
            metadata.push(("idempotent-replayed".to_string(), b"true".to_vec()));
        }
        Some(GrpcAnswer { code, message, metadata })
    }

    /// A completed call whose result cannot be replayed to a gRPC client.
    pub fn not_replayable() -> GrpcAnswer {
        GrpcAnswer {
            code: FAILED_PRECONDITION,
            message: "The call for this Idempotency-Key completed; its result cannot be replayed over gRPC".into(),
            metadata: vec![("idempotent-replayed".to_string(), b"true".to_vec())],
        }
    }
}

/// The status of a stored failure without messages: what a trailers-only replay can carry
/// (`None`: a result that needs the loopback).
pub fn trailers_only_status(response: &StoredResponse) -> Option<u32> {
    let code = status_of(trailers_and_headers(response))?;
    (code != OK && response.body().is_empty()).then_some(code)
}

/// A stored result with messages, replayed through the loopback: the headers that replace
/// the loopback's, and the trailers that follow the messages.
pub fn replay_parts(response: &StoredResponse, replayed: bool) -> (Headers, Headers) {
    let mut headers = vec![(":status".to_string(), b"200".to_vec())];
    let mut trailers = Vec::new();
    for (name, value) in response.headers() {
        match name.strip_prefix(TRAILER) {
            Some(trailer) => trailers.push((trailer.to_string(), value.to_vec())),
            None if name.starts_with(':') || name == "content-length" || name.starts_with("x-envoy-") => {}
            None => headers.push((name.to_string(), value.to_vec())),
        }
    }
    if replayed {
        headers.push(("idempotent-replayed".to_string(), b"true".to_vec()));
    }
    (headers, trailers)
}

/// A stored response's trailers (their prefix cut) and headers: where `grpc-status` may be.
pub fn trailers_and_headers(response: &StoredResponse) -> impl Iterator<Item = (&str, &[u8])> {
    response.headers().map(|(n, v)| (n.strip_prefix(TRAILER).unwrap_or(n), v))
}

/// `grpc-message` is percent-encoded on the wire; the local reply API encodes it again.
fn percent_decoded(value: &[u8]) -> String {
    let mut out = Vec::with_capacity(value.len());
    let mut i = 0;
    while let Some(&b) = value.get(i) {
        let hex = value.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
        match (b, hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(decoded)) => {
                out.push(decoded);
                i += 3;
            }
            _ => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[derive(Clone, PartialEq, prost::Message)]
struct RpcStatus {
    #[prost(int32, tag = "1")]
    code: i32,
    #[prost(string, tag = "2")]
    message: String,
    #[prost(message, repeated, tag = "3")]
    details: Vec<Any>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Any {
    #[prost(string, tag = "1")]
    type_url: String,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RetryInfo {
    #[prost(message, optional, tag = "1")]
    retry_delay: Option<Duration>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Duration {
    #[prost(int64, tag = "1")]
    seconds: i64,
    #[prost(int32, tag = "2")]
    nanos: i32,
}

/// `grpc-status-details-bin`: a `google.rpc.Status` with a `google.rpc.RetryInfo`, base64
/// without padding as gRPC's `-bin` metadata travels in HTTP/2 headers.
fn retry_details(code: u32, message: &str, seconds: u64) -> Vec<u8> {
    use base64::Engine;
    let info = RetryInfo { retry_delay: Some(Duration { seconds: seconds as i64, nanos: 0 }) };
    let status = RpcStatus {
        code: code as i32,
        message: message.to_string(),
        details: vec![Any { type_url: "type.googleapis.com/google.rpc.RetryInfo".into(), value: info.encode_to_vec() }],
    };
    base64::engine::general_purpose::STANDARD_NO_PAD.encode(status.encode_to_vec()).into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;

    #[test]
    fn a_duplicate_in_progress_is_aborted_with_its_pushback_and_retry_info() {
        let a = GrpcAnswer::for_problem(&Problem::in_progress(2));
        assert_eq!(a.code, ABORTED);
        assert_eq!(a.metadata[0], ("grpc-retry-pushback-ms".to_string(), b"2000".to_vec()));
        let (name, bin) = &a.metadata[1];
        assert_eq!(name, "grpc-status-details-bin");
        let raw = base64::engine::general_purpose::STANDARD_NO_PAD.decode(bin).unwrap();
        let status = RpcStatus::decode(raw.as_slice()).unwrap();
        assert_eq!((status.code, status.details.len()), (10, 1));
        assert_eq!(status.details[0].type_url, "type.googleapis.com/google.rpc.RetryInfo");
        let info = RetryInfo::decode(status.details[0].value.as_slice()).unwrap();
        assert_eq!(info.retry_delay, Some(Duration { seconds: 2, nanos: 0 }));
    }

    #[test]
    fn a_callers_full_share_is_resource_exhausted_with_its_pushback() {
        let a = GrpcAnswer::for_problem(&Problem::share_full(90));
        assert_eq!(a.code, RESOURCE_EXHAUSTED);
        assert_eq!(a.metadata[0], ("grpc-retry-pushback-ms".to_string(), b"90000".to_vec()));
        let raw = base64::engine::general_purpose::STANDARD_NO_PAD.decode(&a.metadata[1].1).unwrap();
        let status = RpcStatus::decode(raw.as_slice()).unwrap();
        assert_eq!(status.code, 8);
        let info = RetryInfo::decode(status.details[0].value.as_slice()).unwrap();
        assert_eq!(info.retry_delay, Some(Duration { seconds: 90, nanos: 0 }));
        // A body over the limit is resource-exhausted too, and not retried.
        assert!(GrpcAnswer::for_problem(&Problem::body_too_large(10)).metadata.is_empty());
        // An answer too large to relay whose key was released says when to retry.
        let released = GrpcAnswer::for_problem(&Problem::answer_too_large(Some(3)));
        assert_eq!(released.code, RESOURCE_EXHAUSTED);
        assert!(released.metadata.iter().any(|(n, v)| n == "grpc-retry-pushback-ms" && v == b"3000"));
    }

    #[test]
    fn every_problem_maps_to_the_code_of_spec_3_10() {
        let cases = [
            (Problem::fingerprint_mismatch(), INVALID_ARGUMENT),
            (Problem::missing_key("idempotency-key"), INVALID_ARGUMENT),
            (Problem::invalid_key("bad".into()), INVALID_ARGUMENT),
            (Problem::body_too_large(10), RESOURCE_EXHAUSTED),
            (Problem::store_full(1), RESOURCE_EXHAUSTED),
            (Problem::store_unavailable(1), UNAVAILABLE),
            (Problem::upstream_failed(502, "reset", 1), UNAVAILABLE),
            (Problem::completed_without_response(), FAILED_PRECONDITION),
            (Problem::scope_missing(), UNAUTHENTICATED),
            (Problem::body_unavailable(), INTERNAL),
            (Problem::answer_too_large(None), RESOURCE_EXHAUSTED),
        ];
        for (p, code) in cases {
            let a = GrpcAnswer::for_problem(&p);
            assert_eq!(a.code, code, "{p:?}");
            // A retryable refusal carries its pushback: a full store says when room frees up.
            let pushback = a.metadata.iter().any(|(n, _)| n == "grpc-retry-pushback-ms");
            assert_eq!(pushback, p.slug() == "store-full", "only ABORTED and a full store carry a pushback: {p:?}");
        }
    }

    #[test]
    fn a_stored_failure_replays_as_its_own_status_and_trailers() {
        let headers: Vec<(&str, &[u8])> = vec![
            (":status", b"200"),
            ("content-type", b"application/grpc"),
            (":t:grpc-status", b"5"),
            (":t:grpc-message", b"no%20such%20account"),
            (":t:grpc-status-details-bin", b"CAU"),
            (":t:x-trailer", b"t"),
        ];
        let stored = StoredResponse::new(200, headers.clone(), Vec::new());
        let a = GrpcAnswer::replay_of(&stored, true).unwrap();
        assert_eq!((a.code, a.message.as_str()), (5, "no such account"));
        let names: Vec<&str> = a.metadata.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["grpc-status-details-bin", "x-trailer", "idempotent-replayed"]);
        let ok: Vec<(&str, &[u8])> = vec![("content-type", b"application/grpc"), (":t:grpc-status", b"0")];
        let ok = StoredResponse::new(200, ok, b"msg".to_vec());
        assert_eq!(GrpcAnswer::replay_of(&ok, true), None);
        let (headers, trailers) = replay_parts(&ok, true);
        assert_eq!(
            headers.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
            [":status", "content-type", "idempotent-replayed"]
        );
        assert_eq!(trailers, vec![("grpc-status".to_string(), b"0".to_vec())]);
    }
}
