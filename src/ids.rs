//! Maps keyed by the ids the plugin hands out or Envoy gives (stream contexts, calls, owners):
//! small integers no caller chooses, so a multiplicative hash serves where SipHash, built to
//! resist chosen keys, would cost a few hundred instructions a lookup on every event.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

#[derive(Default)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        // Fibonacci hashing: spreads consecutive ids over the high bits the table probes by.
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_ids_spread_over_the_top_bits() {
        let tops: std::collections::HashSet<u64> = (0u32..128)
            .map(|id| {
                let mut h = IdHasher::default();
                h.write_u32(id);
                h.finish() >> 57
            })
            .collect();
        assert!(tops.len() > 64, "{} distinct top-7-bit tags of 128", tops.len());
    }
}
