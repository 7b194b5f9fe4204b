//! An in-memory [`SharedKv`] with Envoy's exact shared-data semantics (docs/behaviour.md §4), including the
//! flaw that a `set` on a missing key ignores `cas`. The core's tests run against it.

use super::{KvError, SharedKv};
use std::collections::HashMap;
use std::sync::Mutex;

#[derive(Default)]
pub struct MemoryKv {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    values: HashMap<String, (Vec<u8>, u32)>,
    /// One counter for the whole map, bumped by every write, as in Envoy.
    last_cas: u32,
    /// The keys written since the journal was last taken, when it is kept (the simulator
    /// reads what each write left).
    journal: Option<Vec<String>>,
}

impl MemoryKv {
    pub fn new() -> Self {
        Self::default()
    }

    /// A map that keeps a journal of the keys written ([`MemoryKv::take_journal`]).
    pub fn journaled() -> Self {
        let kv = Self::default();
        if let Ok(mut inner) = kv.inner.lock() {
            inner.journal = Some(Vec::new());
        }
        kv
    }

    /// The keys written since the last call, in order.
    pub fn take_journal(&self) -> Vec<String> {
        self.inner.lock().ok().and_then(|mut i| i.journal.as_mut().map(std::mem::take)).unwrap_or_default()
    }

    /// Number of keys ever created (they cannot be deleted).
    pub fn key_count(&self) -> usize {
        self.inner.lock().map(|i| i.values.len()).unwrap_or(0)
    }

    /// Total bytes of values held.
    pub fn value_bytes(&self) -> usize {
        self.inner.lock().map(|i| i.values.values().map(|(v, _)| v.len()).sum()).unwrap_or(0)
    }
}

impl SharedKv for MemoryKv {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), KvError> {
        let inner = self.inner.lock().map_err(|_| KvError::Host(10))?;
        Ok(match inner.values.get(key) {
            None => (None, None),
            Some((v, cas)) if v.is_empty() => (None, Some(*cas)),
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
        })
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), KvError> {
        let mut inner = self.inner.lock().map_err(|_| KvError::Host(10))?;
        if let (Some((_, current)), Some(expected)) = (inner.values.get(key), cas) {
            if expected != 0 && expected != *current {
                return Err(KvError::CasMismatch);
            }
        }
        inner.last_cas = inner.last_cas.wrapping_add(1).max(1);
        let next = inner.last_cas;
        inner.values.insert(key.to_string(), (value.to_vec(), next));
        if let Some(journal) = &mut inner.journal {
            journal.push(key.to_string());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn behaves_like_envoy_shared_data() {
        let kv = MemoryKv::new();
        assert_eq!(kv.get("k").unwrap(), (None, None));
        // A set on a missing key ignores cas: both "first writers" succeed.
        kv.set("k", b"a", Some(12345)).unwrap();
        kv.set("new", b"x", None).unwrap();
        let (v, cas) = kv.get("k").unwrap();
        assert_eq!(v.as_deref(), Some(&b"a"[..]));
        let cas = cas.unwrap();
        // On an existing key CAS is exact.
        assert_eq!(kv.set("k", b"b", Some(cas + 100)), Err(KvError::CasMismatch));
        kv.set("k", b"b", Some(cas)).unwrap();
        assert_eq!(kv.set("k", b"c", Some(cas)), Err(KvError::CasMismatch));
        // Emptying keeps the key: (None, Some(cas)).
        kv.set("k", b"", None).unwrap();
        let (v, cas) = kv.get("k").unwrap();
        assert!(v.is_none() && cas.is_some());
        assert_eq!(kv.key_count(), 2);
    }
}
