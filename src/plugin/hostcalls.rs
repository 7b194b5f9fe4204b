//! The one file that calls the host. The SDK's wrappers panic on statuses they don't expect
//! (docs/behaviour.md §4) and take `&str` header values only; these call the ABI directly where it matters,
//! and turn every other failure into a `Result`.

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType, Status};
use std::ptr::{null, null_mut};
use std::time::{Duration, UNIX_EPOCH};

use crate::host::{HeaderMap, Headers, Host};
use crate::host::{KvError, SharedKv};

// Raw ABI imports. Statuses are read as `u32`: an unknown value must not be undefined
// behaviour (the SDK's `Status` enum has no catch-all).
#[link(wasm_import_module = "env")]
extern "C" {
    #[link_name = "proxy_get_shared_data"]
    fn raw_get_shared_data(
        key: *const u8,
        key_size: usize,
        value: *mut *mut u8,
        value_size: *mut usize,
        cas: *mut u32,
    ) -> u32;
    #[link_name = "proxy_set_shared_data"]
    fn raw_set_shared_data(key: *const u8, key_size: usize, value: *const u8, value_size: usize, cas: u32) -> u32;
    #[link_name = "proxy_send_local_response"]
    fn raw_send_local_response(
        status: u32,
        details: *const u8,
        details_size: usize,
        body: *const u8,
        body_size: usize,
        headers: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
    #[link_name = "proxy_get_header_map_pairs"]
    fn raw_get_header_map_pairs(map_type: u32, map: *mut *mut u8, map_size: *mut usize) -> u32;
    #[link_name = "proxy_set_property"]
    fn raw_set_property(path: *const u8, path_size: usize, value: *const u8, value_size: usize) -> u32;
    #[link_name = "proxy_get_status"]
    fn raw_get_status(code: *mut u32, message: *mut *mut u8, message_size: *mut usize) -> u32;
}

const OK: u32 = 0;
const NOT_FOUND: u32 = 1;
const CAS_MISMATCH: u32 = 8;

/// Envoy shared data, without the SDK's panics.
#[derive(Clone, Copy, Default)]
pub struct SharedData;

impl SharedKv for SharedData {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), KvError> {
        let mut data: *mut u8 = null_mut();
        let mut size: usize = 0;
        let mut cas: u32 = 0;
        // SAFETY: the host writes a buffer it allocated with our allocator (proxy_on_memory_allocate)
        // and its size; we take ownership of it once.
        let status = unsafe { raw_get_shared_data(key.as_ptr(), key.len(), &mut data, &mut size, &mut cas) };
        match status {
            OK => {
                let cas = (cas != 0).then_some(cas);
                if data.is_null() || size == 0 {
                    Ok((None, cas))
                } else {
                    // SAFETY: see above.
                    Ok((Some(unsafe { Vec::from_raw_parts(data, size, size) }), cas))
                }
            }
            NOT_FOUND => Ok((None, None)),
            other => Err(KvError::Host(other)),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), KvError> {
        // SAFETY: pointers and sizes describe live slices.
        let status =
            unsafe { raw_set_shared_data(key.as_ptr(), key.len(), value.as_ptr(), value.len(), cas.unwrap_or(0)) };
        match status {
            OK => Ok(()),
            CAS_MISMATCH => Err(KvError::CasMismatch),
            other => Err(KvError::Host(other)),
        }
    }
}

/// Logs at the level Envoy's `wasm` component logs at, so that debug lines are not even
/// formatted when Envoy would drop them (one decision line per covered request).
pub fn sync_log_level() {
    if let Ok(level) = hostcalls::get_log_level() {
        proxy_wasm::set_log_level(level);
    }
}

/// Milliseconds since the Unix epoch, from the host's clock (the same for every worker).
pub fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as u64)
}

/// The request's header map as the host serialized it, in one buffer (`HeaderMap`); empty
/// when the host has none or fails.
fn request_header_map() -> HeaderMap {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    // SAFETY: the host writes a buffer it allocated with our allocator (proxy_on_memory_allocate)
    // and its size; we take ownership of it once.
    let status = unsafe { raw_get_header_map_pairs(MapType::HttpRequestHeaders as u32, &mut data, &mut size) };
    if status != OK || data.is_null() || size == 0 {
        return HeaderMap::default();
    }
    // SAFETY: see above.
    HeaderMap::parse(unsafe { Vec::from_raw_parts(data, size, size) })
}

/// Sends a local reply on the current (effective) stream. Header values may be any bytes.
pub fn send_response<N: AsRef<[u8]>, V: AsRef<[u8]>>(status: u16, headers: &[(N, V)], body: &[u8]) -> Result<(), u32> {
    let map = HeaderMap::from_pairs(headers);
    let map = map.as_bytes();
    // SAFETY: pointers and sizes describe live buffers.
    let status = unsafe {
        raw_send_local_response(u32::from(status), null(), 0, body.as_ptr(), body.len(), map.as_ptr(), map.len(), -1)
    };
    if status == OK {
        Ok(())
    } else {
        Err(status)
    }
}

/// Sends a trailers-only gRPC answer on the current stream: HTTP 200, `grpc-status` `code`,
/// `grpc-message` `message` (Envoy encodes it), and `metadata` with it.
pub fn send_grpc<N: AsRef<[u8]>, V: AsRef<[u8]>>(code: u32, message: &str, metadata: &[(N, V)]) -> Result<(), u32> {
    let map = HeaderMap::from_pairs(metadata);
    let map = map.as_bytes();
    let code = i32::try_from(code).unwrap_or(2);
    // SAFETY: pointers and sizes describe live buffers.
    let status = unsafe {
        raw_send_local_response(200, null(), 0, message.as_ptr(), message.len(), map.as_ptr(), map.len(), code)
    };
    if status == OK {
        Ok(())
    } else {
        Err(status)
    }
}

/// What the lifecycle reads from Envoy, for the context the current callback is for.
pub struct HostCalls;

impl Host for HostCalls {
    fn now_ms(&self) -> u64 {
        now_ms()
    }

    fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name).ok().flatten()
    }

    fn request_headers(&self) -> HeaderMap {
        request_header_map()
    }

    fn request_body(&self, size: usize) -> Vec<u8> {
        hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size).ok().flatten().unwrap_or_default()
    }

    fn response_headers(&self) -> Headers {
        hostcalls::get_map_bytes(MapType::HttpResponseHeaders).unwrap_or_default()
    }

    fn response_trailers(&self) -> Headers {
        hostcalls::get_map_bytes(MapType::HttpResponseTrailers).unwrap_or_default()
    }

    fn response_body(&self, size: usize) -> Vec<u8> {
        hostcalls::get_buffer(BufferType::HttpResponseBody, 0, size).ok().flatten().unwrap_or_default()
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        hostcalls::get_property(path.to_vec()).ok().flatten()
    }

    fn call_headers(&self) -> Headers {
        hostcalls::get_map_bytes(MapType::HttpCallResponseHeaders).unwrap_or_default()
    }

    fn call_body(&self, size: usize) -> Vec<u8> {
        hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, size).ok().flatten().unwrap_or_default()
    }

    fn call_trailers(&self) -> Headers {
        hostcalls::get_map_bytes(MapType::HttpCallResponseTrailers).unwrap_or_default()
    }

    fn grpc_message(&self, size: usize) -> Vec<u8> {
        hostcalls::get_buffer(BufferType::GrpcReceiveBuffer, 0, size).ok().flatten().unwrap_or_default()
    }

    fn grpc_status_text(&self) -> Vec<u8> {
        // The SDK's get_grpc_status panics on a text that is not UTF-8.
        let mut code: u32 = 0;
        let mut data: *mut u8 = null_mut();
        let mut size: usize = 0;
        // SAFETY: as in `SharedData::get`: the host hands over a buffer it allocated with our
        // allocator; we take ownership of it once.
        let status = unsafe { raw_get_status(&mut code, &mut data, &mut size) };
        if status != OK || data.is_null() || size == 0 {
            return Vec::new();
        }
        // SAFETY: see above.
        unsafe { Vec::from_raw_parts(data, size, size) }
    }
}

pub fn plugin_configuration() -> Vec<u8> {
    hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX).ok().flatten().unwrap_or_default()
}

/// Tells Envoy a root context that asked to finish later (`on_done` answered false) is done.
pub fn done() {
    let _ = hostcalls::done();
}

/// Sets (`Some`) or removes (`None`) a request header of the current stream.
pub fn set_request_header(name: &str, value: Option<&str>) {
    let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, value);
}

/// Replaces every response header of the current stream.
pub fn set_response_headers(headers: &[(String, Vec<u8>)]) {
    let map: Vec<(&str, &[u8])> = headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())).collect();
    let _ = hostcalls::set_map_bytes(MapType::HttpResponseHeaders, map);
}

/// Replaces the current stream's buffered response body (`size` bytes) with `body`.
pub fn replace_response_body(size: usize, body: &[u8]) {
    let _ = hostcalls::set_buffer(BufferType::HttpResponseBody, 0, size, body);
}

/// Adds a response trailer; at the body's end Envoy creates the trailers (docs/behaviour.md §4).
pub fn add_response_trailer(name: &str, value: &[u8]) {
    let _ = hostcalls::add_map_value_bytes(MapType::HttpResponseTrailers, name, value);
}

pub fn resume_request() -> bool {
    hostcalls::resume_http_request().is_ok()
}

pub fn resume_response() -> bool {
    hostcalls::resume_http_response().is_ok()
}

/// Makes `context_id` the stream that later calls act on; `false` when the stream is gone.
/// The current stream's filter state `wasm.idempotency` (Envoy prefixes `wasm.`).
pub fn set_filter_state(text: &str) {
    // The path as the ABI takes it (parts joined by NUL; one part here), not built per call
    // as the SDK's `set_property` does: every covered request sets it.
    const PATH: &[u8] = b"idempotency";
    // SAFETY: both pointers are valid for their sizes during the call; the host copies them.
    let status = unsafe { raw_set_property(PATH.as_ptr(), PATH.len(), text.as_ptr(), text.len()) };
    if status != OK {
        log::debug!("filter state not set: status {status}");
    }
}

pub fn set_effective_context(context_id: u32) -> bool {
    hostcalls::set_effective_context(context_id).is_ok()
}

/// Sends a request from the current context (the root's: see `plugin::root`).
pub fn dispatch(cluster: &str, headers: Vec<(&str, &str)>, body: &[u8], timeout: Duration) -> Result<u32, Status> {
    hostcalls::dispatch_http_call(cluster, headers, Some(body), vec![], timeout)
}

/// Sends a unary gRPC call from the current context; its answer comes to
/// `on_grpc_call_response` with a token of its own (not an HTTP call's).
pub fn dispatch_grpc(
    cluster: &str,
    service: &str,
    method: &str,
    metadata: &[(&str, &str)],
    message: &[u8],
    timeout: Duration,
) -> Result<u32, Status> {
    let metadata = metadata.iter().map(|(name, value)| (*name, value.as_bytes())).collect();
    let target = crate::store::etcd::grpc::envoy_grpc_service(cluster);
    let target = target.as_deref().unwrap_or(cluster);
    hostcalls::dispatch_grpc_call(target, service, method, metadata, Some(message), timeout)
}

pub fn register_queue(name: &str) -> Option<u32> {
    hostcalls::register_shared_queue(name).ok()
}

pub fn enqueue(queue_id: u32) -> bool {
    hostcalls::enqueue_shared_queue(queue_id, Some(b"job")).is_ok()
}

/// Empties the queue of notifications.
pub fn drain_queue(queue_id: u32) {
    while let Ok(Some(_)) = hostcalls::dequeue_shared_queue(queue_id) {}
}

/// Takes one notification off the queue: Envoy calls `on_queue_ready` once per enqueue, so
/// one each keeps it empty; the jobs themselves wait in the VM's outbox.
pub fn take_from_queue(queue_id: u32) {
    let _ = hostcalls::dequeue_shared_queue(queue_id);
}

pub fn set_tick(period: Duration) {
    let _ = hostcalls::set_tick_period(period);
}

pub fn define_counter(name: &str) -> Option<u32> {
    hostcalls::define_metric(MetricType::Counter, name).ok()
}

pub fn define_gauge(name: &str) -> Option<u32> {
    hostcalls::define_metric(MetricType::Gauge, name).ok()
}

pub fn add_metric(id: u32, delta: i64) {
    let _ = hostcalls::increment_metric(id, delta);
}

pub fn set_metric(id: u32, value: u64) {
    let _ = hostcalls::record_metric(id, value);
}
