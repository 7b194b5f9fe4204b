//! An idempotency layer for Envoy and Istio: a proxy-wasm HTTP filter.
//!
//! The core (`config`, `key`, `fingerprint`, `entry`, `engine`, `problem`, `store`) is plain
//! Rust with no `proxy-wasm` import and is tested natively; `filter` is the thin host adapter.

pub mod config;
pub mod engine;
pub mod entry;
pub mod fingerprint;
pub mod key;
pub mod store;
