//! A native driver for callgrind over the whole request lifecycle (what the plugin runs per
//! request, without the host calls themselves): the paths of `bench/abi_count.py`, each
//! request in an #[inline(never)] `op_*` function, so `--toggle-collect='*op_*'` counts only
//! them. Instruction counts are deterministic; the host's share is counted by abi_count.py.
//!
//! Not built by default; to run it, as bench/callgrind_driver.rs:
//!
//!   cp bench/lifecycle_driver.rs examples/
//!   CARGO_PROFILE_RELEASE_DEBUG=true CARGO_PROFILE_RELEASE_STRIP=none \
//!     cargo build --release --example lifecycle_driver --features sha2/force-soft,test-host
//!   valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*op_*' \
//!     --callgrind-out-file=/tmp/first.out target/release/examples/lifecycle_driver first 5000
//!   callgrind_annotate --inclusive=yes /tmp/first.out | head -60
//!
//! Usage: lifecycle_driver <first|router|replay|conflict> [N] ("router": forward "router", the
//! answer through Envoy's router; the others detached)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::hint::black_box;

use idempotency::config::Config;
use idempotency::host::Headers;
use idempotency::lifecycle::{Effect, Lifecycle};
use idempotency::store::shared::SharedStore;
use idempotency::host::memory::MemoryKv;
use idempotency::store::table::{Layout, Table};
use idempotency::test_host::TestHost;

type Core = Lifecycle<SharedStore<&'static MemoryKv>>;

const BODY: &[u8] = br#"{"amount":10}"#;
const ANSWER: &[u8] = br#"{"charged":10}"#;

fn pairs(pairs: &[(&str, &str)]) -> Headers {
    pairs.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect()
}

/// The request `make bench` sends, the router's answer (mode "router") and the upstream's
/// answer to the root's call (detached): the lifecycle tests' host (`src/test_host.rs`).
fn request(key: &str, now: u64) -> TestHost {
    TestHost {
        now,
        request: pairs(&[
            (":method", "POST"),
            (":path", "/payments"),
            (":authority", "bench"),
            (":scheme", "http"),
            ("authorization", "Bearer bench"),
            ("user-agent", "wrk"),
            ("x-request-id", "5f0c6a4e-0d7b-4c9e-9a53-2f8d1e6b7c10"),
            ("content-type", "application/json"),
            ("content-length", "13"),
            ("idempotency-key", key),
        ]),
        body: BODY.to_vec(),
        response: pairs(&[
            (":status", "201"),
            ("content-type", "application/json"),
            ("content-length", "14"),
            ("date", "Tue, 01 Dec 2026 22:00:00 GMT"),
            ("server", "envoy"),
            ("x-envoy-upstream-service-time", "0"),
        ]),
        response_body: ANSWER.to_vec(),
        call_headers: pairs(&[(":status", "201"), ("content-type", "application/json")]),
        call_body: ANSWER.to_vec(),
        ..TestHost::default()
    }
}

fn core(router: bool) -> Core {
    let config = if router { &br#"{"namespace":"abi","forward":"router"}"#[..] } else { br#"{"namespace":"abi"}"# };
    let config = Config::parse(config).unwrap();
    let kv: &'static MemoryKv = Box::leak(Box::new(MemoryKv::new()));
    let table = Table::new(kv, Layout::new(&config.namespace, config.capacity, config.max_store_bytes));
    table.create().unwrap();
    let tick = Core::tick_ms_for(&config);
    let kept = config.replay_cache_bytes;
    Lifecycle::new(config, SharedStore::new(table, tick, 0).with_replay_cache(kept))
}

/// One request, to its end; the root's call (detached forwarding) answered at once, or the
/// router's answer passed through.
#[inline(never)]
fn op_request(core: &mut Core, id: u32, host: &TestHost) -> usize {
    core.on_request_headers(host, id, false);
    core.on_request_body(host, id, BODY.len(), true);
    let mut effects = core.take_effects();
    if effects.iter().any(|e| matches!(e, Effect::WakeRoot)) {
        core.on_wake(host.now);
        effects.extend(core.take_effects());
    }
    for effect in &effects {
        if let Effect::Dispatch { call, .. } = effect {
            core.on_call_answer(host, *call, true, 14, host.now);
        }
    }
    effects.extend(core.take_effects());
    if core.watches_response(id) {
        core.on_response_headers(host, id, false);
        core.on_response_body(host, id, ANSWER.len(), true);
    }
    core.on_stream_done(id);
    effects.extend(core.take_effects());
    effects.len()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = args.get(1).map(String::as_str).unwrap_or("first");
    let n: u32 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(5_000);
    let mut core = core(mode == "router");
    let now = 1_700_000_000_000;
    let fixed = request("fixed", now);
    match mode {
        "first" | "router" => {}
        "replay" => {
            op_request(&mut core, 1, &fixed);
        }
        "conflict" => {
            // Claimed, its call never answered: in progress for the whole run.
            core.on_request_headers(&fixed, 1, false);
            core.on_request_body(&fixed, 1, BODY.len(), true);
            core.take_effects();
        }
        other => panic!("unknown mode {other}"),
    }
    for i in 0..n {
        let host = if matches!(mode, "first" | "router") { request(&format!("k-{i}"), now + u64::from(i)) } else { request("fixed", now) };
        black_box(op_request(&mut core, 2 + i, &host));
    }
}
