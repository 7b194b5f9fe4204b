//! The proxy-wasm adapter, built into the plugin only: callbacks become lifecycle events,
//! effects become host calls. It takes no decisions; `hostcalls.rs` is the one file that
//! calls the host.

mod configure;
mod hostcalls;
mod root;
mod stream;
mod vm;

pub use root::Root;
