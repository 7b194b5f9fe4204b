//! The key-value map the table lives in: Envoy's shared data in the plugin
//! (`plugin::hostcalls::SharedData`), [`super::memory::MemoryKv`] in tests.

/// Why a key-value operation failed (the shared-data interface, [`SharedKv`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvError {
    /// The value changed since it was read.
    CasMismatch,
    /// The host answered with an unexpected status.
    Host(u32),
}

/// A key-value map with compare-and-swap, as Envoy's shared data offers it (docs/behaviour.md §4):
/// - `get` of a missing key answers `(None, None)`; of a key holding an empty value,
///   `(None, Some(cas))`;
/// - `set` with `cas` fails with `CasMismatch` if the key exists and its cas differs, but a
///   `set` on a key that does not exist yet ignores `cas` and always succeeds;
/// - keys cannot be deleted, only emptied.
pub trait SharedKv {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), KvError>;
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), KvError>;
}

impl<T: SharedKv + ?Sized> SharedKv for &T {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), KvError> {
        (**self).get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), KvError> {
        (**self).set(key, value, cas)
    }
}

/// One map shared by owners of it (the simulator's Envoys hand theirs to every VM).
impl<T: SharedKv + ?Sized> SharedKv for std::rc::Rc<T> {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), KvError> {
        (**self).get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), KvError> {
        (**self).set(key, value, cas)
    }
}
