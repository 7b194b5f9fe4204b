//! Keys spread over several etcd clusters (`store.clusters`): each key lives on exactly one,
//! chosen by rendezvous hashing of the key over the clusters' names, so adding a cluster
//! moves only the keys it wins (about 1 in N+1) and removing one only the keys it held. Each
//! cluster has its own [`EtcdStore`]: its own leases, backoff and health, so one cluster
//! down leaves the others' keys served.
//!
//! Owner and call ids are the inner store's times the number of shards, plus the shard.

use std::rc::Rc;

use super::EtcdStore;
use crate::encoding::StoredResponse;
use crate::key::StoreKey;
use crate::metrics::Counter;
use crate::store::Change;
use crate::store::{Answer, CallAnswer, CallRequest, Claim, For, Owner, Store, TickReport};

pub struct Shards {
    shards: Vec<(u64, EtcdStore)>,
    /// The shard whose answers, calls and counts are polled next (round robin).
    next_poll: usize,
}

/// A 64-bit mix (splitmix64's finaliser): the key's bytes are a SHA-256 already, this only
/// combines them with a cluster's seed.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A cluster name's seed (FNV-1a): the same on every Envoy of the fleet.
pub fn seed_of(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// The shard a key lives on: the cluster with the highest score for it.
pub fn shard_of(seeds: impl Iterator<Item = u64>, key: &StoreKey) -> usize {
    let k = crate::bytes::u64_at(&key.0, 24);
    let mut best = (0, 0u64);
    for (i, seed) in seeds.enumerate() {
        let score = mix(k ^ seed);
        if i == 0 || score > best.1 {
            best = (i, score);
        }
    }
    best.0
}

impl Shards {
    /// One store per cluster, with the cluster's name.
    pub fn new(stores: Vec<(String, EtcdStore)>) -> Shards {
        Shards { shards: stores.into_iter().map(|(name, s)| (seed_of(&name), s)).collect(), next_poll: 0 }
    }

    fn n(&self) -> u64 {
        self.shards.len().max(1) as u64
    }

    fn outer(&self, shard: usize, inner: u64) -> u64 {
        inner * self.n() + shard as u64
    }

    /// The shard and the inner id of an outer id.
    fn split(&self, outer: u64) -> (usize, u64) {
        ((outer % self.n()) as usize, outer / self.n())
    }

    fn owner_out(&self, shard: usize, o: Owner) -> Owner {
        Owner { id: self.outer(shard, o.id), fence: o.fence }
    }

    fn answer_out(&self, shard: usize, answer: Answer) -> Answer {
        match answer {
            Answer::Began(crate::store::Began::Claimed { owner, takeover, change, leased_ms }) => {
                let owner = self.owner_out(shard, owner);
                Answer::Began(crate::store::Began::Claimed { owner, takeover, change, leased_ms })
            }
            other => other,
        }
    }

    /// The shard of an owner, and the owner as that shard knows it.
    fn owner_in(&mut self, owner: Owner) -> Option<(usize, &mut EtcdStore, Owner)> {
        let (shard, id) = self.split(owner.id);
        let store = self.shards.get_mut(shard).map(|(_, s)| s)?;
        Some((shard, store, Owner { id, fence: owner.fence }))
    }

    /// Polls the shards in turn, starting after the last one that gave something.
    fn poll<T>(&mut self, mut f: impl FnMut(&mut EtcdStore) -> Option<T>) -> Option<(usize, T)> {
        let n = self.shards.len();
        for step in 0..n {
            let shard = (self.next_poll + step) % n;
            if let Some(out) = self.shards.get_mut(shard).and_then(|(_, s)| f(s)) {
                self.next_poll = (shard + 1) % n;
                return Some((shard, out));
            }
        }
        None
    }
}

impl Store for Shards {
    fn begin(&mut self, who: For, claim: &Claim, now_ms: u64) -> Option<Answer> {
        let shard = shard_of(self.shards.iter().map(|(seed, _)| *seed), &claim.key);
        let answer = self.shards.get_mut(shard)?.1.begin(who, claim, now_ms)?;
        Some(self.answer_out(shard, answer))
    }

    fn renew(&mut self, owner: Owner, lease_ms: u64, now_ms: u64) -> Option<Answer> {
        let (shard, store, inner) = self.owner_in(owner)?;
        let answer = store.renew(inner, lease_ms, now_ms)?;
        Some(self.answer_out(shard, answer))
    }

    fn complete(
        &mut self,
        owner: Owner,
        response: Option<Rc<StoredResponse>>,
        retention_ms: u64,
        now_ms: u64,
    ) -> Option<Answer> {
        let (_, store, inner) = self.owner_in(owner)?;
        store.complete(inner, response, retention_ms, now_ms)
    }

    fn release(&mut self, owner: Owner, now_ms: u64) -> Option<Answer> {
        let (_, store, inner) = self.owner_in(owner)?;
        store.release(inner, now_ms)
    }

    fn forget(&mut self, owner: Owner) {
        if let Some((_, store, inner)) = self.owner_in(owner) {
            store.forget(inner);
        }
    }

    fn tick(&mut self, now_ms: u64) -> TickReport {
        let mut change = Change::default();
        let mut share_used_bytes = None;
        for (_, store) in &mut self.shards {
            let report = store.tick(now_ms);
            // One ledger for the Envoy: each shard saw its total at its last write.
            share_used_bytes = share_used_bytes.max(report.share_used_bytes);
            let c = report.change;
            change.completed += c.completed;
            change.bytes += c.bytes;
            change.evicted += c.evicted;
            change.evicted_below_share += c.evicted_below_share;
        }
        TickReport { change, share_used_bytes, ..TickReport::default() }
    }

    fn poll_answer(&mut self) -> Option<(For, Answer)> {
        let (shard, (who, answer)) = self.poll(|s| s.poll_answer())?;
        let who = match who {
            For::Owner(o) => For::Owner(self.owner_out(shard, o)),
            stream => stream,
        };
        Some((who, self.answer_out(shard, answer)))
    }

    fn poll_call(&mut self) -> Option<(u64, CallRequest)> {
        let (shard, (n, request)) = self.poll(|s| s.poll_call())?;
        Some((self.outer(shard, n), request))
    }

    fn poll_count(&mut self) -> Option<Counter> {
        self.poll(|s| s.poll_count()).map(|(_, c)| c)
    }

    fn on_call_answer(&mut self, call: u64, answer: &CallAnswer, now_ms: u64) {
        let (shard, n) = self.split(call);
        if let Some((_, store)) = self.shards.get_mut(shard) {
            store.on_call_answer(n, answer, now_ms);
        }
    }

    fn on_call_failed(&mut self, call: u64, now_ms: u64) {
        let (shard, n) = self.split(call);
        if let Some((_, store)) = self.shards.get_mut(shard) {
            store.on_call_failed(n, now_ms);
        }
    }

    fn wait_poll_ms(&self) -> u64 {
        self.shards.first().map_or(100, |(_, s)| s.wait_poll_ms())
    }

    fn answers_at_once(&self) -> bool {
        false
    }

    fn write_wait_ms(&self) -> u64 {
        self.shards.iter().map(|(_, s)| s.write_wait_ms()).max().unwrap_or(0)
    }

    fn is_idle(&self) -> bool {
        self.shards.iter().all(|(_, s)| s.is_idle())
    }

    #[cfg(test)]
    fn busy(&self) -> Vec<(&'static str, usize)> {
        self.shards.iter().flat_map(|(_, s)| s.busy()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u32) -> StoreKey {
        StoreKey::derive("t", b"h", &[], format!("k{i}").as_bytes())
    }

    #[test]
    fn keys_spread_evenly_and_a_new_cluster_moves_only_its_share() {
        let names = ["etcd_a", "etcd_b", "etcd_c"];
        let seeds = |n: usize| names.iter().take(n).map(|c| seed_of(c)).collect::<Vec<_>>();
        let (two, three) = (seeds(2), seeds(3));
        let mut counts = [0usize; 3];
        let mut moved = 0;
        for i in 0..30_000 {
            let before = shard_of(two.iter().copied(), &key(i));
            let after = shard_of(three.iter().copied(), &key(i));
            counts[after] += 1;
            if before != after {
                assert_eq!(after, 2, "a key moves only to the new cluster");
                moved += 1;
            }
        }
        assert!(counts.iter().all(|c| (9_000..11_000).contains(c)), "{counts:?}");
        assert!((9_000..11_000).contains(&moved), "{moved} of 30,000 moved");
    }
}
