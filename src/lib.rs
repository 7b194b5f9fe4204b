//! An idempotency layer for Envoy and Istio: a proxy-wasm HTTP filter.
//!
//! The core is plain Rust with no `proxy-wasm` import, tested natively: `lifecycle` (a
//! request's life, events in, effects out) over `store` (shared data, etcd) and the two ports
//! to Envoy in `host`. `plugin` is the thin proxy-wasm adapter, built for `wasm32-wasip1` only.
//! The module map is ARCHITECTURE.md's.

pub mod assemble;
pub mod bytes;
pub mod caller;
pub mod config;
pub mod defects;
pub mod digest;
pub mod encoding;
pub mod fingerprint;
pub mod fuzzing;
pub mod header_map;
pub mod host;
pub mod ids;
pub mod key;
pub mod lifecycle;
pub mod metrics;
pub mod store;

#[cfg(test)]
#[cfg(not(target_family = "wasm"))]
mod sim;
#[cfg(test)]
pub mod test_driver;
#[cfg(any(test, feature = "test-host"))]
pub mod test_host;

#[cfg(all(target_arch = "wasm32", not(test), feature = "plugin"))]
mod plugin;

#[cfg(all(target_arch = "wasm32", not(test), feature = "plugin"))]
proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Debug);
    proxy_wasm::set_root_context(|id| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(plugin::Root::new(id))
    });
}}
