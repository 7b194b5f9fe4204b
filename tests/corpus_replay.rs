//! Replays the fuzzers' corpora (`fuzz/corpus/<target>/`) through the same entry points, so
//! every input a fuzzer ever kept is a regression test on stable Rust.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)] // test code

use std::fs;
use std::path::Path;

fn replay(target: &str, run: fn(&[u8])) -> usize {
    // Under the WASI runner only the current directory (the package's) is open.
    let root = if cfg!(target_family = "wasm") { Path::new(".") } else { Path::new(env!("CARGO_MANIFEST_DIR")) };
    let dir = root.join("fuzz/corpus").join(target);
    let mut n = 0;
    for entry in fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        run(&fs::read(&path).unwrap());
        n += 1;
    }
    assert!(n > 0, "empty corpus {}", dir.display());
    n
}

#[test]
fn config_corpus() {
    replay("config", idempotency::fuzzing::config);
}

#[test]
fn key_corpus() {
    replay("key", idempotency::fuzzing::key);
}

#[test]
fn entry_corpus() {
    replay("entry", idempotency::fuzzing::entry);
}

#[test]
fn etcd_corpus() {
    replay("etcd", idempotency::fuzzing::etcd);
}
