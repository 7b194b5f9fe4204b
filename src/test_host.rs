//! What Envoy would hand the lifecycle during one event (tests only): the current stream's
//! request or response, or the answer of the call being delivered. The lifecycle's tests and
//! the simulator (`src/sim/`) share it.

use crate::host::{HeaderMap, Headers, Host};

#[derive(Default, Clone)]
pub struct TestHost {
    pub now: u64,
    pub request: Headers,
    pub body: Vec<u8>,
    pub response: Headers,
    pub response_body: Vec<u8>,
    pub response_trailers: Headers,
    pub code_details: Option<&'static str>,
    pub call_headers: Headers,
    pub call_body: Vec<u8>,
    pub call_trailers: Headers,
    pub grpc_text: Vec<u8>,
}

impl Host for TestHost {
    fn now_ms(&self) -> u64 {
        self.now
    }
    fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        self.request.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone())
    }
    fn request_headers(&self) -> HeaderMap {
        HeaderMap::from_pairs(&self.request)
    }
    fn request_body(&self, size: usize) -> Vec<u8> {
        self.body.iter().take(size).copied().collect()
    }
    fn response_headers(&self) -> Headers {
        self.response.clone()
    }
    fn response_trailers(&self) -> Headers {
        self.response_trailers.clone()
    }
    fn response_body(&self, size: usize) -> Vec<u8> {
        self.response_body.iter().take(size).copied().collect()
    }
    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        match path {
            ["xds", "cluster_name"] => Some(b"upstream".to_vec()),
            ["response", "code_details"] => self.code_details.map(|d| d.as_bytes().to_vec()),
            _ => None,
        }
    }
    fn call_headers(&self) -> Headers {
        self.call_headers.clone()
    }
    fn call_body(&self, size: usize) -> Vec<u8> {
        self.call_body.iter().take(size).copied().collect()
    }
    fn call_trailers(&self) -> Headers {
        self.call_trailers.clone()
    }
    fn grpc_message(&self, size: usize) -> Vec<u8> {
        self.call_body.iter().take(size).copied().collect()
    }
    fn grpc_status_text(&self) -> Vec<u8> {
        self.grpc_text.clone()
    }
}
