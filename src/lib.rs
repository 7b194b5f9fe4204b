//! An idempotency layer for Envoy and Istio: a proxy-wasm HTTP filter.
//!
//! The core (`config`, `key`, `fingerprint`, `entry`, `engine`, `problem`, `metrics`,
//! `store`) is plain Rust with no `proxy-wasm` import and is tested natively; `filter` is the
//! thin host adapter, built for `wasm32-wasip1` only.

pub mod budget;
pub mod config;
pub mod engine;
pub mod entry;
pub mod fingerprint;
pub mod fuzzing;
pub mod host;
pub mod key;
pub mod lifecycle;
pub mod metrics;
pub mod problem;
pub mod retention;
pub mod store;

#[cfg(all(target_arch = "wasm32", not(test), feature = "plugin"))]
mod plugin;

#[cfg(all(target_arch = "wasm32", not(test), feature = "plugin"))]
proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Debug);
    proxy_wasm::set_root_context(|id| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(plugin::Root::new(id))
    });
}}
