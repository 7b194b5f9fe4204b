//! `src/bin/idempotency-key.rs` run as an operator runs it, against known vectors: the store
//! key of src/key.rs `store_key_vector`, the caller tag of src/caller.rs `caller_tag_vector` (under its secret),
//! and the bucket and etcd shard of that key worked out by hand (docs/operations.md, "Finding
//! one key").
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)] // test code

use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_idempotency-key");
/// The secret of src/caller.rs `caller_tag_vector`, the SipHash reference key.
const TAG_KEY: &str = "000102030405060708090a0b0c0d0e0f";
const VECTOR: &str = "2cf6ad973cc0d74141c28f40258ea4426f5731fa10da47ab86dc3dd54cbdd879";

fn run(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

fn json(args: &[&str]) -> serde_json::Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let out = run(&all);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn the_vector_key_as_text() {
    let out = run(&[
        "--namespace",
        "idem",
        "--host",
        "localhost",
        "--scope",
        "Bearer e2e-caller",
        "--tag-key",
        TAG_KEY,
        "vector-key",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    // The bucket: the key's first 8 bytes, little-endian, modulo 1,024 buckets (65,536 / 64):
    // 0x41d7c03c97adf62c % 1024 = 556, whose entries are slots 556 × 64 = 35,584 to 35,647.
    let want = format!(
        "store key       {VECTOR}
log digest      2cf6ad973cc0
caller tag      fa960
shared data (store kind shared_data), in Envoy's shared data:
  bucket        idem:t2:1024:b556 (bucket 556 of 1024)
  data keys     idem:t2:1024:d35584 .. idem:t2:1024:d35647 (its entry is one of the bucket's 64)
local replay copies (store kind etcd, local_replays), in Envoy's shared data:
  bucket        idem.replays:t2:1024:b556 (bucket 556 of 1024)
  data keys     idem.replays:t2:1024:d35584 .. idem.replays:t2:1024:d35647 (its entry is one of the bucket's 64)
etcd key        /idem/{VECTOR}
"
    );
    assert_eq!(text, want);
}

#[test]
fn the_vector_key_as_json_with_shards() {
    let out =
        json(&["--host", "localhost", "--scope", "Bearer e2e-caller", "--clusters", "etcd_a,etcd_b", "vector-key"]);
    assert_eq!(out["store_key"], VECTOR);
    assert_eq!(out["log_digest"], "2cf6ad973cc0");
    // Without the Envoy's secret there is no tag to show: tags are keyed (docs/memory.md).
    assert_eq!(out["caller_tag"], serde_json::Value::Null);
    assert_eq!(out["etcd_key"], format!("/idem/{VECTOR}"));
    // Rendezvous: splitmix64(last 8 bytes LE ^ FNV-1a(name)) is 0xff1c… for etcd_a, 0x54b1… for etcd_b.
    assert_eq!(out["etcd_cluster"], "etcd_a");
    assert_eq!(out["shared_data"]["bucket_key"], "idem:t2:1024:b556");
    // The other order of the same clusters picks the same cluster: the score is per name.
    let swapped =
        json(&["--host", "localhost", "--scope", "Bearer e2e-caller", "--clusters", "etcd_b,etcd_a", "vector-key"]);
    assert_eq!(swapped["etcd_cluster"], "etcd_a");
}

#[test]
fn quoted_and_bare_keys_are_one_key_and_the_capacity_sets_the_buckets() {
    let bare = json(&["--host", "localhost", "--scope", "Bearer e2e-caller", "vector-key"]);
    let quoted = json(&["--host", "localhost", "--scope", "Bearer e2e-caller", "\"vector-key\""]);
    assert_eq!(bare["store_key"], quoted["store_key"]);
    let small = json(&["--host", "localhost", "--scope", "Bearer e2e-caller", "--capacity", "1000", "vector-key"]);
    // ceil(1000 / 64) = 16 buckets; 556 % 16 = 12 (the same low bits).
    assert_eq!(small["shared_data"]["buckets"], 16);
    assert_eq!(small["shared_data"]["bucket_key"], "idem:t2:16:b12");
    assert_eq!(small["shared_data"]["first_data_key"], "idem:t2:16:d768");
    assert_eq!(small["shared_data"]["last_data_key"], "idem:t2:16:d831");
}

#[test]
fn scope_values_change_the_key_by_value_position_and_absence() {
    let key = |scopes: &[&str]| {
        let mut args = vec!["--host", "localhost"];
        args.extend_from_slice(scopes);
        args.push("k");
        json(&args)["store_key"].as_str().unwrap().to_string()
    };
    let alice = key(&["--scope", "Bearer alice"]);
    assert_ne!(alice, key(&["--scope", "Bearer bob"]));
    assert_ne!(key(&["--scope", "a", "--absent"]), key(&["--absent", "--scope", "a"]));
    assert_ne!(key(&["--scope", "a", "--also", "b"]), key(&["--scope", "a", "--scope", "b"]));
    assert_ne!(key(&["--absent"]), key(&["--unscoped"]));
    // After `--`, a key may start with dashes.
    let dashed = json(&["--host", "localhost", "--scope", "a", "--", "--k"]);
    assert_ne!(dashed["store_key"].as_str().unwrap(), key(&["--scope", "a"]));
    let anonymous = json(&["--host", "localhost", "--absent", "--tag-key", TAG_KEY, "k"]);
    assert_eq!(anonymous["caller_tag"], "00000");
    let keyed = |tag_key: &str| {
        json(&["--host", "localhost", "--scope", "Bearer alice", "--tag-key", tag_key, "k"])["caller_tag"].clone()
    };
    // Another Envoy's secret gives the same caller another tag.
    assert_ne!(keyed(TAG_KEY), keyed("ffeeddccbbaa99887766554433221100"));
}

#[test]
fn what_the_plugin_would_refuse_is_refused() {
    for args in [
        &["--host", "h", "k"][..],                                   // no scope given
        &["--scope", "a", "k"],                                      // no host
        &["--host", "h", "--scope", "a", "bad key"],                 // 400 in the plugin
        &["--host", "h", "--scope", "a", "--namespace", "a/b", "k"], // invalid namespace
        &["--host", "h", "--scope", "a", "--capacity", "0", "k"],    // invalid capacity
        &["--host", "h", "--scope", "a", "--clusters", "x,x", "k"],  // clusters not distinct
        &["--host", "h", "--unscoped", "--scope", "a", "k"],         // both
        &["--host", "h", "--absent", "--also", "b", "k"],            // --also without a --scope
        &["--host", "h", "--scope", "a", "k1", "k2"],                // two keys
        &["--host", "h", "--scope", "a", "--bogus", "k"],            // unknown option
    ] {
        let out = run(args);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(!out.stderr.is_empty(), "{args:?}: no reason given");
    }
}
