//! A native driver for callgrind: N operations of one kind on the core, each in an
//! #[inline(never)] `op_*` function, so `--toggle-collect='*op_*'` counts only them
//! (instruction counts: deterministic, unlike timings on a shared machine).
//!
//! Not built by default. To run it, copy it to examples/ (examples need no Cargo.toml entry),
//! with debug info and the portable SHA-256 (the plugin runs it in Wasm, without SHA-NI):
//!
//!   cp bench/callgrind_driver.rs examples/
//!   CARGO_PROFILE_RELEASE_DEBUG=true CARGO_PROFILE_RELEASE_STRIP=none \
//!     cargo build --release --example callgrind_driver --features sha2/force-soft
//!   valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*op_*' \
//!     --callgrind-out-file=/tmp/claim.out target/release/examples/callgrind_driver claim 20000
//!   callgrind_annotate --inclusive=yes /tmp/claim.out | head -40
//!
//! Usage: callgrind_driver <claim|complete|replay|conflict|request> [N]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use idempotency::store::table::{Verdict, Layout, Table, Ticket};
use idempotency::encoding::StoredResponse;
use idempotency::fingerprint::{Fingerprint, FingerprintBuilder};
use idempotency::key::{parse_key, StoreKey};
use idempotency::host::memory::MemoryKv;
use std::hint::black_box;

// The benchmarks' shared answer; this path holds from bench/ and from examples/ alike.
#[path = "../benches/fixtures/mod.rs"]
mod fixtures;
use fixtures::response_1kib;

const NOW: u64 = 1_700_000_000_000;


fn key(n: u64) -> StoreKey {
    StoreKey::derive("ns", b"api.example.com", &[None], format!("order-{n}").as_bytes())
}

fn fp() -> Fingerprint {
    let mut b = FingerprintBuilder::new(b"POST", b"/payments");
    b.header("content-type", [&b"application/json"[..]].into_iter());
    b.body(br#"{"amount":10}"#);
    b.finish()
}

#[inline(never)]
fn op_claim(t: &Table<MemoryKv>, k: &StoreKey, f: &Fingerprint) -> Verdict {
    t.begin(k, f, NOW, 10_000).unwrap()
}

#[inline(never)]
fn op_complete(t: &Table<MemoryKv>, ticket: &Ticket, r: &mut StoredResponse) {
    black_box(t.complete(ticket, Some(r), NOW + 5, 86_400_000).unwrap());
}

#[inline(never)]
fn op_replay(t: &Table<MemoryKv>, k: &StoreKey, f: &Fingerprint) -> Verdict {
    t.begin(k, f, NOW + 10, 10_000).unwrap()
}

#[inline(never)]
fn op_conflict(t: &Table<MemoryKv>, k: &StoreKey, f: &Fingerprint) -> Verdict {
    t.begin(k, f, NOW + 10, 10_000).unwrap()
}

/// The core work of one covered first call as the plugin does it (filter/http.rs): parse the
/// key, derive the store key, build the fingerprint, claim, format the debug log line.
#[inline(never)]
fn op_request(t: &Table<MemoryKv>, raw_key: &[u8]) -> String {
    let client_key = parse_key(raw_key, 255).unwrap();
    let k = StoreKey::derive("idem", b"api.example.com", &[None], &client_key);
    let mut fpb = FingerprintBuilder::new(b"POST", b"/payments");
    fpb.header("content-type", [&b"application/json"[..]].into_iter());
    fpb.body(br#"{"amount":10}"#);
    let f = fpb.finish();
    let begin = t.begin(&k, &f, NOW, 10_000).unwrap();
    // log::debug!("key {} -> {}", key.short(), describe(&begin)), formatted whatever the level.
    let what = match &begin {
        Verdict::Claimed { ticket, takeover, .. } => format!("claimed slot {} gen {} (takeover: {takeover})", ticket.slot, ticket.gen),
        _ => String::from("other"),
    };
    format!("key {} -> {}", k.short(), what)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = args.get(1).map(String::as_str).unwrap_or("claim");
    let n: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(20_000);
    let t = Table::new(MemoryKv::new(), Layout::new("ns", 65_536, 4 << 30));
    t.create().unwrap();
    let f = fp();
    let r = response_1kib();
    let keys: Vec<StoreKey> = (0..n).map(key).collect();
    match mode {
        "claim" => {
            for k in &keys {
                black_box(op_claim(&t, k, &f));
            }
        }
        "complete" => {
            let tickets: Vec<Ticket> = keys
                .iter()
                .map(|k| match t.begin(k, &f, NOW, 10_000).unwrap() {
                    Verdict::Claimed { ticket, .. } => ticket,
                    other => panic!("{other:?}"),
                })
                .collect();
            // Each completion stores an answer of its own, as the plugin does.
            let mut answers: Vec<StoredResponse> = tickets.iter().map(|_| r.clone()).collect();
            for (ticket, answer) in tickets.iter().zip(&mut answers) {
                op_complete(&t, ticket, answer);
            }
        }
        "replay" | "conflict" => {
            for k in keys.iter().take(1000) {
                if let Verdict::Claimed { ticket, .. } = t.begin(k, &f, NOW, 10_000).unwrap() {
                    if mode == "replay" {
                        t.complete(&ticket, Some(&mut r.clone()), NOW, 86_400_000).unwrap();
                    }
                }
            }
            for i in 0..n {
                let k = &keys[(i % 1000) as usize];
                let out = if mode == "replay" { op_replay(&t, k, &f) } else { op_conflict(&t, k, &f) };
                assert!(matches!(out, Verdict::Replay(_) | Verdict::InProgress));
                black_box(out);
            }
        }
        "request" => {
            for i in 0..n {
                black_box(op_request(&t, format!("order-{i}").as_bytes()));
            }
        }
        other => panic!("unknown mode {other}"),
    }
}
