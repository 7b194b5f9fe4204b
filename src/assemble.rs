//! A VM's lifecycle and store, built from a parsed configuration over any shared-data map: the
//! plugin builds it over Envoy's shared data (`plugin/configure.rs`), the simulator over its
//! model of it, so both run the same stores.

use std::cell::RefCell;
use std::rc::Rc;

use crate::caller::TagKey;
use crate::config::{Config, StoreConfig};
use crate::host::SharedKv;
use crate::lifecycle::Lifecycle;
use crate::store::etcd::ledger::{Share, WriteBudget};
use crate::store::etcd::local_copies::{LocalReplays, Replays};
use crate::store::etcd::shards::Shards;
use crate::store::etcd::{EtcdStore, Link};
use crate::store::shared::SharedStore;
use crate::store::table::{Layout, Table};
use crate::store::Store;

pub type AnyLifecycle = Lifecycle<Box<dyn Store>>;

/// The lifecycle of one VM. `kv`: the shared data of its Envoy; `random`: a random number per
/// call (the tables' sweep start, the etcd stores' seeds).
pub fn lifecycle<K: SharedKv + Clone + 'static>(
    config: Config,
    kv: K,
    random: &mut dyn FnMut() -> u64,
) -> Result<AnyLifecycle, String> {
    lifecycle_wrapped(config, kv, random, |store| store)
}

/// [`lifecycle`], its store wrapped by `wrap` (the simulator taps what the store tells each
/// stream).
pub fn lifecycle_wrapped<K: SharedKv + Clone + 'static>(
    config: Config,
    kv: K,
    random: &mut dyn FnMut() -> u64,
    wrap: impl FnOnce(Box<dyn Store>) -> Box<dyn Store>,
) -> Result<AnyLifecycle, String> {
    let tick_ms = Lifecycle::<Box<dyn Store>>::tick_ms_for(&config);
    let (kv_for_key, namespace) = (kv.clone(), config.namespace.clone());
    let store: Box<dyn Store> = match &config.store {
        StoreConfig::SharedData => {
            let layout = Layout::new(&config.namespace, config.capacity, config.max_store_bytes);
            let table = Table::new(kv, layout).with_window(config.min_retention_s.saturating_mul(1000));
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
                api_fallback: cfg.api_fallback,
            };
            let longest_retention_ms = retentions.iter().max().copied().unwrap_or(86_400).saturating_mul(1000);
            let share: Option<Rc<dyn Share>> = (cfg.write_budget_bytes > 0).then(|| {
                let budget =
                    WriteBudget::new(kv.clone(), &config.namespace, cfg.write_budget_bytes, longest_retention_ms);
                Rc::new(budget) as Rc<dyn Share>
            });
            let replays = match cfg.local_replays {
                true => Some(local_replays(&config, kv, random)?),
                false => None,
            };
            let mut store = |cluster: &String| {
                let mut store =
                    EtcdStore::new(link(cluster), &config.namespace, max_lease, retentions.clone(), random());
                if let Some(share) = &share {
                    store = store.with_share(share.clone());
                }
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
    let tag_key = tag_key(&kv_for_key, &namespace, random);
    Ok(Lifecycle::new(config, wrap(store)).with_tag_key(tag_key))
}

/// This Envoy's secret for callers' tags (`<namespace>:tag-key` in its shared data): made by
/// the first VM that configures (the base VM, before any worker serves) from the host's
/// randomness, read by the others; kept across configuration updates, new when Envoy restarts.
pub fn tag_key<K: SharedKv>(kv: &K, namespace: &str, random: &mut dyn FnMut() -> u64) -> TagKey {
    let name = format!("{namespace}:tag-key");
    let stored = || match kv.get(&name) {
        Ok((Some(bytes), _)) => bytes.as_slice().try_into().ok().map(TagKey),
        _ => None,
    };
    if let Some(key) = stored() {
        return key;
    }
    let mut fresh = [0u8; 16];
    fresh[..8].copy_from_slice(&random().to_le_bytes());
    fresh[8..].copy_from_slice(&random().to_le_bytes());
    if kv.set(&name, &fresh, None).is_ok() {
        log::info!(
            "idempotency: callers' tags are keyed with this Envoy's secret {} (tools/caller_tag.py --key)",
            TagKey(fresh).hex()
        );
    }
    // Another VM may have written its own first: every VM takes what is stored.
    stored().unwrap_or(TagKey(fresh))
}

/// This Envoy's copies of the fleet's completed entries: a table of their own in shared data
/// (`<namespace>.replays`), bounded by `capacity` and `max_store_bytes`.
fn local_replays<K: SharedKv + 'static>(
    config: &Config,
    kv: K,
    random: &mut dyn FnMut() -> u64,
) -> Result<Rc<RefCell<dyn Replays>>, String> {
    let layout = Layout::new(&format!("{}.replays", config.namespace), config.capacity, config.max_store_bytes);
    let table = Table::new(kv, layout);
    table.create().map_err(|e| format!("cannot create the local replay table in shared data: {e:?}"))?;
    let from = (random() % u64::from(table.layout().buckets())) as u32;
    Ok(Rc::new(RefCell::new(LocalReplays::new(table, from, config.replay_cache_bytes))))
}
