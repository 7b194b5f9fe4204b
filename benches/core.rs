//! Micro-benchmarks of the core's hot paths, native, against the in-memory store (the same
//! CAS semantics as Envoy's shared data): what one covered request costs the table, without
//! Envoy, V8 or the network (`cargo bench --bench core`).
//!
//! - `claim`: `Table::begin` on a new key (read the key's bucket, decide, CAS it back);
//! - `complete`: `Table::complete` of a claimed key with a 1 KiB response (write the data
//!   key, then flip the way to completed with a second bucket CAS);
//! - `replay`: `Table::begin` on a completed key (read the bucket, then the stored response);
//! - `conflict`: `Table::begin` on a key in progress (the 409 path);
//! - `store_key` and `fingerprint`: the two SHA-256s the plugin computes per covered request
//!   before it reaches the table (a 13-byte body).
//!
//! Claims and completions change the table, so they are timed with `iter_custom` over keys
//! and tickets prepared outside the timing; a new table is made (untimed) whenever half of
//! the current one is used (a claim scans its whole bucket either way).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)] // bench code

use criterion::{criterion_group, criterion_main, Criterion};
use idempotency::fingerprint::{Fingerprint, FingerprintBuilder};
use idempotency::host::memory::MemoryKv;
use idempotency::key::StoreKey;
use idempotency::store::table::{Layout, Table, Ticket, Verdict};
use std::hint::black_box;
use std::time::{Duration, Instant};

mod fixtures;
use fixtures::response_1kib;

/// The plugin's default capacity: 1,024 buckets of 64 ways.
const CAPACITY: usize = 65_536;
/// Keys claimed per fresh table: half of it, the sizing the README recommends.
const PER_TABLE: u64 = (CAPACITY / 2) as u64;
const NOW: u64 = 1_700_000_000_000;
const LEASE_MS: u64 = 10_000;
const RETENTION_MS: u64 = 86_400_000;
const BODY: &[u8] = br#"{"amount":10}"#;
/// Room for every response the benches store: no eviction is measured.
const STORE_BYTES: u64 = 4 << 30;

fn table() -> Table<MemoryKv> {
    let t = Table::new(MemoryKv::new(), Layout::new("ns", CAPACITY, STORE_BYTES));
    assert!(t.create().unwrap());
    t
}

fn key(n: u64) -> StoreKey {
    StoreKey::derive("ns", b"api.example.com", &[None], format!("order-{n}").as_bytes())
}

fn fingerprint(body: &[u8]) -> Fingerprint {
    let mut b = FingerprintBuilder::new(b"POST", b"/payments");
    b.header("content-type", [&b"application/json"[..]].into_iter());
    b.body(body);
    b.finish()
}

fn claim(t: &Table<MemoryKv>, k: &StoreKey, fp: &Fingerprint) -> Ticket {
    match t.begin(k, fp, NOW, LEASE_MS).unwrap() {
        Verdict::Claimed { ticket, .. } => ticket,
        other => panic!("expected a claim, got {other:?}"),
    }
}

/// A table and the next key never used in it; a new table (untimed) once half of it is used.
struct Fresh {
    table: Table<MemoryKv>,
    used: u64,
    next: u64,
}

impl Fresh {
    fn new() -> Fresh {
        Fresh { table: table(), used: 0, next: 0 }
    }

    /// Runs `timed` on `iters` new keys, in chunks that fit the current table; `prepare`
    /// (untimed) turns the table and a chunk of keys into the timed routine's input.
    fn run<P>(
        &mut self,
        iters: u64,
        mut prepare: impl FnMut(&Table<MemoryKv>, Vec<StoreKey>) -> P,
        mut timed: impl FnMut(&Table<MemoryKv>, P),
    ) -> Duration {
        let mut total = Duration::ZERO;
        let mut done = 0;
        while done < iters {
            if self.used == PER_TABLE {
                self.table = table();
                self.used = 0;
            }
            let n = (iters - done).min(PER_TABLE - self.used);
            let keys = (self.next..self.next + n).map(key).collect();
            self.next += n;
            self.used += n;
            let input = prepare(&self.table, keys);
            let start = Instant::now();
            timed(&self.table, input);
            total += start.elapsed();
            done += n;
        }
        total
    }
}

fn benches(c: &mut Criterion) {
    let fp = fingerprint(BODY);
    let response = response_1kib();
    let mut g = c.benchmark_group("table");

    let mut fresh = Fresh::new();
    g.bench_function("claim", |b| {
        b.iter_custom(|iters| {
            fresh.run(
                iters,
                |_, keys| keys,
                |t, keys| {
                    for k in &keys {
                        black_box(t.begin(black_box(k), &fp, NOW, LEASE_MS).unwrap());
                    }
                },
            )
        })
    });

    let mut fresh = Fresh::new();
    g.bench_function("complete_1KiB", |b| {
        b.iter_custom(|iters| {
            fresh.run(
                iters,
                |t, keys| keys.iter().map(|k| (claim(t, k, &fp), response.clone())).collect::<Vec<_>>(),
                |t, mut tickets| {
                    for (ticket, response) in &mut tickets {
                        black_box(t.complete(black_box(ticket), Some(response), NOW + 5, RETENTION_MS).unwrap());
                    }
                },
            )
        })
    });

    {
        let t = table();
        for n in 0..PER_TABLE {
            let k = key(n);
            let ticket = claim(&t, &k, &fp);
            t.complete(&ticket, Some(&mut response.clone()), NOW, RETENTION_MS).unwrap();
        }
        let k = key(7);
        assert!(matches!(t.begin(&k, &fp, NOW + 10, LEASE_MS).unwrap(), Verdict::Replay(_)));
        g.bench_function("replay_1KiB", |b| {
            b.iter(|| black_box(t.begin(black_box(&k), &fp, NOW + 10, LEASE_MS).unwrap()))
        });

        let busy = key(PER_TABLE + 1);
        claim(&t, &busy, &fp);
        assert_eq!(t.begin(&busy, &fp, NOW + 10, LEASE_MS).unwrap(), Verdict::InProgress);
        g.bench_function("conflict", |b| {
            b.iter(|| black_box(t.begin(black_box(&busy), &fp, NOW + 10, LEASE_MS).unwrap()))
        });
    }
    g.finish();

    let mut g = c.benchmark_group("hash");
    g.bench_function("store_key", |b| {
        b.iter(|| StoreKey::derive("idem", black_box(b"api.example.com"), &[None], black_box(b"order-1234567")))
    });
    g.bench_function("fingerprint", |b| b.iter(|| fingerprint(black_box(BODY))));
    g.finish();
}

criterion_group! {
    name = core;
    config = Criterion::default().warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3));
    targets = benches
}
criterion_main!(core);
