//! What the request lifecycle reads from Envoy during an event, behind one trait: the plugin
//! implements it with host calls (`plugin::hostcalls`), the tests with a fake. Reads are
//! lazy, so that a request the plugin does not cover costs one header lookup.

pub use crate::header_map::HeaderMap;
pub use shared_kv::{KvError, SharedKv};

pub mod memory;
mod shared_kv;

/// A header map as Envoy hands it over: names lower-case, values any bytes, repeats kept.
pub type Headers = Vec<(String, Vec<u8>)>;

pub trait Host {
    /// The clock, in ms since the Unix epoch; read only when an event needs it (a host call).
    fn now_ms(&self) -> u64;
    /// One request header of the current stream.
    fn request_header(&self, name: &str) -> Option<Vec<u8>>;
    /// Every request header of the current stream, in order, read in place.
    fn request_headers(&self) -> HeaderMap;
    /// The current stream's buffered request body, up to `size` bytes.
    fn request_body(&self, size: usize) -> Vec<u8>;
    fn response_headers(&self) -> Headers;
    /// The current stream's response trailers (a gRPC call's status).
    fn response_trailers(&self) -> Headers;
    /// The current chunk of the current stream's response body.
    fn response_body(&self, size: usize) -> Vec<u8>;
    /// A property (`xds.cluster_name`, `response.code_details`, a JWT claim …).
    fn property(&self, path: &[&str]) -> Option<Vec<u8>>;
    /// The headers of the HTTP call whose answer is being delivered.
    fn call_headers(&self) -> Headers;
    fn call_body(&self, size: usize) -> Vec<u8>;
    /// Its trailers (a gRPC call's status).
    fn call_trailers(&self) -> Headers;
    /// The response message of the gRPC call whose answer is being delivered.
    fn grpc_message(&self, size: usize) -> Vec<u8>;
    /// Its `grpc-message` (the status's text), when it failed.
    fn grpc_status_text(&self) -> Vec<u8>;
}

/// What a stream callback tells Envoy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Pause,
}
