//! What the lifecycle asks the host to do. The adapter carries effects out in order, after the
//! event that produced them returned: a local reply re-enters the plugin's own callbacks.

use std::rc::Rc;

use super::problem::Problem;
use crate::encoding::StoredResponse;
use crate::metrics::{Counter, Gauge};
use crate::store::CallRequest;

/// Who an HTTP call's answer goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CallId {
    /// A covered request the root sends upstream itself (detached forwarding).
    Upstream(super::WorkId),
    /// A request of the store's (etcd).
    Store(u64),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Problem(Problem),
    /// A stored response (`replayed`: with `idempotent-replayed: true`), or the upstream's
    /// answer to a detached call.
    Stored {
        response: Rc<StoredResponse>,
        replayed: bool,
    },
    /// A trailers-only gRPC answer to a gRPC call (docs/behaviour.md §3.10).
    Grpc(super::grpc_reply::GrpcAnswer),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// A local reply on `stream`. The lifecycle emits it only for streams still open; the
    /// adapter makes the stream current first when the event was another's.
    Reply {
        stream: u32,
        reply: Reply,
    },
    /// Set (`Some`) or remove (`None`) one of `stream`'s request headers before the request
    /// goes on: the fencing token (docs/behaviour.md §3.9).
    SetRequestHeader {
        stream: u32,
        name: String,
        value: Option<String>,
    },
    /// A gRPC replay through the loopback: its answer's headers become these.
    SetResponseHeaders {
        stream: u32,
        headers: Vec<(String, Vec<u8>)>,
    },
    /// … its buffered body (`size` bytes) becomes `body`, and these trailers follow.
    ReplaceResponseBody {
        stream: u32,
        size: usize,
        body: Vec<u8>,
        trailers: Vec<(String, Vec<u8>)>,
    },
    /// Let `stream`'s paused request go on through Envoy's router.
    Resume {
        stream: u32,
    },
    /// Let `stream`'s paused response go on to the client (its completion is stored).
    ResumeResponse {
        stream: u32,
    },
    /// Send an HTTP call from the root context (only emitted in the root's events).
    Dispatch {
        call: CallId,
        request: CallRequest,
    },
    /// The root has calls to send: wake it (the VM's shared queue) from a stream's event.
    WakeRoot,
    Count {
        counter: Counter,
        n: u32,
    },
    AddGauge {
        gauge: Gauge,
        delta: i64,
    },
    /// What was decided for `stream`, as its filter state `wasm.idempotency` (one per covered
    /// request; docs/operations.md).
    Record {
        stream: u32,
        text: String,
    },
    SetGauge {
        gauge: Gauge,
        value: u64,
    },
}
