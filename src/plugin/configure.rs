//! `on_configure`: the configuration parsed once, the table created (by the base VM, before
//! any worker serves: SPEC §4), the store and the lifecycle built, the queue registered.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

use super::hostcalls::{self, SharedData};
use super::vm::{AnyLifecycle, Vm};
use crate::config::{Config, Forward, StoreConfig};
use crate::lifecycle::Lifecycle;
use crate::store::etcd::replays::{LocalReplays, Replays};
use crate::store::etcd::shards::Shards;
use crate::store::etcd::{EtcdStore, Link};
use crate::store::shared::SharedStore;
use crate::store::Store;
use crate::table::{Layout, Table};
use std::cell::RefCell;
use std::rc::Rc;

/// A random number from the host's randomness (WASI).
fn random() -> u64 {
    RandomState::new().build_hasher().finish()
}

/// The VM of a root context, or why not (logged: Envoy then refuses the configuration).
pub fn configure(root_id: u32) -> Result<Vm, String> {
    let config = Config::parse(&hostcalls::plugin_configuration()).map_err(|e| e.to_string())?;
    let lifecycle = lifecycle(config)?;
    let needs_queue = lifecycle.config().policies().any(|p| p.forward == Forward::Detached)
        || matches!(lifecycle.config().store, StoreConfig::Etcd(_));
    let namespace = lifecycle.config().namespace.clone();
    let vm = Vm::new(lifecycle);
    if needs_queue {
        // One queue per root, under a name no other uses: the last VM to register a name
        // receives all its notifications (SPEC §4).
        let mut h = RandomState::new().build_hasher();
        h.write_u32(root_id);
        let name = format!("{namespace}:detached:{:016x}", h.finish());
        vm.set_queue(hostcalls::register_queue(&name).ok_or_else(|| format!("cannot register shared queue {name}"))?);
    }
    Ok(vm)
}

fn lifecycle(config: Config) -> Result<AnyLifecycle, String> {
    let tick_ms = Lifecycle::<Box<dyn Store>>::tick_ms_for(&config);
    let store: Box<dyn Store> = match &config.store {
        StoreConfig::SharedData => {
            let layout = Layout::new(&config.namespace, config.capacity, config.max_store_bytes);
            let table = Table::new(SharedData, layout);
            // The base VM runs this first: it creates the table; workers find it.
            if table.create().map_err(|e| format!("cannot create the table in shared data: {e:?}"))? {
                log::info!(
                    "idempotency: created a table of {} entries ({} buckets) in namespace {:?}",
                    table.layout().entries(),
                    table.layout().buckets(),
                    config.namespace
                );
            }
            let from = (random() % u64::from(table.layout().buckets())) as u32;
            Box::new(SharedStore::new(table, tick_ms, from).with_replay_cache(config.replay_cache_bytes))
        }
        StoreConfig::Etcd(cfg) => {
            let max_lease = config.policies().map(|p| p.lease_ms).max().unwrap_or(10_000);
            let retentions: Vec<u64> = config.policies().map(|p| p.retention_s).collect();
            let link = |cluster: &String| Link {
                cluster: cluster.clone(),
                authority: cfg.authority.clone().unwrap_or_else(|| cluster.clone()),
                api: cfg.api,
                timeout_ms: cfg.timeout_ms,
            };
            let replays = match cfg.local_replays {
                true => Some(local_replays(&config)?),
                false => None,
            };
            let store = |cluster: &String| {
                let store = EtcdStore::new(link(cluster), &config.namespace, max_lease, retentions.clone(), random());
                match &replays {
                    Some(r) => store.with_replays(r.clone()),
                    None => store,
                }
            };
            match cfg.clusters.as_slice() {
                [one] => Box::new(store(one)),
                many => Box::new(Shards::new(many.iter().map(|c| (c.clone(), store(c))).collect())),
            }
        }
    };
    Ok(Lifecycle::new(config, store))
}

/// This Envoy's copies of the fleet's completed entries: a table of their own in shared data
/// (`<namespace>.replays`), bounded by `capacity` and `max_store_bytes`.
fn local_replays(config: &Config) -> Result<Rc<RefCell<dyn Replays>>, String> {
    let layout = Layout::new(&format!("{}.replays", config.namespace), config.capacity, config.max_store_bytes);
    let table = Table::new(SharedData, layout);
    table.create().map_err(|e| format!("cannot create the local replay table in shared data: {e:?}"))?;
    let from = (random() % u64::from(table.layout().buckets())) as u32;
    Ok(Rc::new(RefCell::new(LocalReplays::new(table, from, config.replay_cache_bytes))))
}
