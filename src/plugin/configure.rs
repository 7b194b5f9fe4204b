//! `on_configure`: the configuration parsed once, the lifecycle and its store built over
//! Envoy's shared data (`crate::assemble`; the base VM creates the table before any worker serves:
//! docs/behaviour.md §4), the queue registered.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

use super::hostcalls::{self, SharedData};
use super::vm::{AnyLifecycle, Vm};
use crate::config::{Config, Forward, StoreConfig};
use crate::host::SharedKv;

/// A random number from the host's randomness (WASI).
fn random() -> u64 {
    RandomState::new().build_hasher().finish()
}

/// The VM of a root context, or why not (logged: Envoy then refuses the configuration).
pub fn configure(root_id: u32) -> Result<Vm, String> {
    let bytes = hostcalls::plugin_configuration();
    let config = Config::parse(&bytes).map_err(|e| e.to_string())?;
    tell(&config, &bytes);
    let lifecycle = lifecycle(config)?;
    let needs_queue = lifecycle.config().policies().any(|p| p.forward == Forward::Detached)
        || matches!(lifecycle.config().store, StoreConfig::Etcd(_));
    let namespace = lifecycle.config().namespace.clone();
    let vm = Vm::new(lifecycle);
    if needs_queue {
        // One queue per root, under a name no other uses: the last VM to register a name
        // receives all its notifications (docs/behaviour.md §4).
        let mut h = RandomState::new().build_hasher();
        h.write_u32(root_id);
        let name = format!("{namespace}:detached:{:016x}", h.finish());
        vm.set_queue(hostcalls::register_queue(&name).ok_or_else(|| format!("cannot register shared queue {name}"))?);
    }
    Ok(vm)
}

/// The release, what the configuration derived (as gauges too), and what its old forms now
/// mean: logged by the first VM of the process that loads this configuration, not by each.
fn tell(config: &Config, bytes: &[u8]) {
    let derived = config.derived();
    for (gauge, value) in &derived {
        if let Some(id) =
            hostcalls::define_gauge(&crate::metrics::qualified(gauge.name(), config.stat_prefix.as_deref()))
        {
            hostcalls::set_metric(id, *value);
        }
    }
    let digest = crate::digest::plain(bytes);
    let told: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    let told = format!("{}:told:{}:{told}", config.namespace, env!("CARGO_PKG_VERSION"));
    if SharedData.get(&told).is_ok_and(|(v, _)| v.is_some()) || SharedData.set(&told, b"1", None).is_err() {
        return;
    }
    let figures: Vec<String> = derived.iter().map(|(g, v)| format!("{}={v}", g.name())).collect();
    log::info!("idempotency {}: configured; {}", env!("CARGO_PKG_VERSION"), figures.join(" "));
    for notice in &config.notices {
        log::warn!("idempotency: {notice}");
    }
    let unrouted = config.detached_unrouted();
    if unrouted > 0 {
        log::warn!(
            "idempotency: {unrouted} of this configuration's policies send detached calls straight to the route's cluster: the route's rewrites, header rules, timeout and retries do not apply to them. Set detached_via to a cluster on an internal listener with the same routes (docs/deployment.md, \"Detached calls through the route\"), or forward: \"router\""
        );
    }
}

fn lifecycle(config: Config) -> Result<AnyLifecycle, String> {
    crate::assemble::lifecycle(config, SharedData, &mut random)
}
