//! What the etcd store asks of etcd and what it learns back, whatever the wire: the requests
//! (one key's transaction, a read, a lease grant), the results, the errors the store acts on,
//! and the backoff. [`super::json`] (the JSON gateway) and [`super::grpc`] (etcd's gRPC API)
//! put them on the wire, [`super::api`] picks one; the host adapter sends them from the root
//! context.
/// The etcd key of a store key: `/<namespace>/<hex of the SHA-256 store key>`.
pub fn key_name(namespace: &str, store_key: &[u8; 32]) -> Vec<u8> {
    let hex = |n: u8| if n < 10 { b'0' + n } else { b'a' + n - 10 };
    let mut k = Vec::with_capacity(namespace.len() + 2 + 64);
    k.push(b'/');
    k.extend_from_slice(namespace.as_bytes());
    k.push(b'/');
    for b in store_key {
        k.extend([hex(b >> 4), hex(b & 15)]);
    }
    k
}

/// What the store asks of etcd. Every transaction is on one key: if `compare` holds, `write`;
/// otherwise, with `read_back`, read the key in the same round trip.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Txn {
        key: Vec<u8>,
        compare: Compare,
        write: Write,
        read_back: bool,
    },
    /// Read one key (no write: it works while etcd refuses writes for lack of space).
    Range {
        key: Vec<u8>,
    },
    Grant {
        ttl_s: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Compare {
    /// The key does not exist (its `create_revision` is 0): a claim.
    Absent,
    /// Nobody wrote the key since this revision: a takeover, renewal, completion or release.
    ModRevision(i64),
    /// The key holds exactly this value: the cleanup of a claim whose answer was lost.
    Value(Vec<u8>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Write {
    /// `lease` 0: none.
    Put {
        value: Vec<u8>,
        lease: i64,
    },
    Delete,
}

impl Request {
    /// Claim: create the key if it does not exist; otherwise read it.
    pub fn claim(key: &[u8], value: Vec<u8>, lease: i64) -> Request {
        let write = Write::Put { value, lease };
        Request::Txn { key: key.to_vec(), compare: Compare::Absent, write, read_back: true }
    }

    /// Replace the value if nobody wrote the key since `mod_revision`; otherwise read it.
    pub fn replace(key: &[u8], mod_revision: i64, value: Vec<u8>, lease: i64) -> Request {
        let write = Write::Put { value, lease };
        Request::Txn { key: key.to_vec(), compare: Compare::ModRevision(mod_revision), write, read_back: true }
    }

    /// Delete the key if nobody wrote it since `mod_revision` (release); otherwise read it (a
    /// renewal that etcd applied but did not acknowledge moved the revision on).
    pub fn delete(key: &[u8], mod_revision: i64) -> Request {
        let compare = Compare::ModRevision(mod_revision);
        Request::Txn { key: key.to_vec(), compare, write: Write::Delete, read_back: true }
    }

    /// Delete the key if it still holds exactly `value`.
    pub fn delete_if_value(key: &[u8], value: Vec<u8>) -> Request {
        Request::Txn { key: key.to_vec(), compare: Compare::Value(value), write: Write::Delete, read_back: false }
    }
}

/// Headers that make Envoy send a call again, to another member of the cluster, when it
/// could not connect to the one it chose or that member refused the stream: nothing reached
/// etcd, so a write cannot apply twice. A member that stopped is still chosen until its
/// health check fails (seconds); these calls would otherwise fail after the connect timeout.
/// A reset or a timeout is never retried: the write may have applied.
pub const RETRY_UNSENT: &[(&str, &str)] =
    &[("x-envoy-retry-on", "connect-failure,refused-stream"), ("x-envoy-max-retries", "2")];

/// Where a request goes: the Envoy cluster, the `:authority`, the timeout.
pub struct Target<'a> {
    pub cluster: &'a str,
    pub authority: &'a str,
    pub timeout_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EtcdError {
    /// An error answer (Envoy's own when etcd is down or slow, or etcd's), with the HTTP
    /// status (200 for gRPC), etcd's gRPC code and what its message says, when known.
    Status { status: u16, code: Option<i64>, kind: ErrorKind },
    /// The answer is not what etcd sends.
    Malformed(&'static str),
}

impl EtcdError {
    /// Refused at once, not timed out: Envoy could not connect (gRPC UNAVAILABLE, the JSON
    /// gateway's 503) or etcd said it has no leader. A call that timed out may have reached
    /// etcd and took its whole timeout already.
    pub fn refused_at_once(&self) -> bool {
        matches!(self, EtcdError::Status { code: Some(14), .. } | EtcdError::Status { status: 503, .. })
    }
}

/// The etcd errors the plugin acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// No answer from etcd itself: Envoy's 502/503/504 (down, unreachable, timed out), or
    /// etcd unavailable (no leader). The store backs off.
    Unreachable,
    /// `etcdserver: mvcc: database space exceeded`: the quota alarm is on and every write is
    /// refused until an operator frees space; reads and deletes still work.
    NoSpace,
    /// `etcdserver: request is too large`: the value is over `--max-request-bytes`.
    TooLarge,
    /// Any other error etcd answered (a lease that is gone: code 5).
    Other,
}

impl EtcdError {
    /// etcd's gRPC code 5 (NotFound) on a put: the lease is gone.
    pub fn is_lease_not_found(&self) -> bool {
        matches!(self, EtcdError::Status { code: Some(5), .. })
    }

    pub fn kind(&self) -> ErrorKind {
        match self {
            EtcdError::Status { kind, .. } => *kind,
            EtcdError::Malformed(_) => ErrorKind::Other,
        }
    }
}

/// Bounded, jittered, doubling delays after failures (docs/behaviour.md §3.8: a store that fails is never
/// hammered): `BACKOFF_MIN_MS`, twice that, … up to `BACKOFF_MAX_MS`, each drawn between half
/// and all of it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Backoff {
    failures: u32,
    next_ms: u64,
    failed_ms: u64,
}

pub const BACKOFF_MIN_MS: u64 = 100;
pub const BACKOFF_MAX_MS: u64 = 2_000;

impl Backoff {
    /// Whether a request may go now.
    pub fn ready(&self, now_ms: u64) -> bool {
        now_ms >= self.next_ms
    }

    /// Whether a write that must land by `need_by_ms` may go now: once the backoff is over, or
    /// when waiting for it and then `slack_ms` (one call's timeout) would miss `need_by_ms`,
    /// `BACKOFF_MIN_MS` after the last failure. A mark about to expire is worth a probe: sat
    /// out, another replica takes the key over and runs the call again. It stays worth one for
    /// `late_ms` past `need_by_ms`: this Envoy's clock judges the deadline, and a replica whose
    /// clock runs behind still sees the mark alive (a write that lands then still keeps it).
    /// `need_by_ms` 0: nothing needs it by any time.
    pub fn ready_by(&self, now_ms: u64, need_by_ms: u64, slack_ms: u64, late_ms: u64) -> bool {
        let urgent = need_by_ms > 0
            && now_ms < need_by_ms.saturating_add(late_ms)
            && need_by_ms < self.next_ms.saturating_add(slack_ms);
        self.ready(now_ms) || (urgent && now_ms >= self.failed_ms.saturating_add(BACKOFF_MIN_MS))
    }

    pub fn failing(&self) -> bool {
        self.failures > 0
    }

    /// A failure at `now`; `random` is any random number (the jitter).
    pub fn fail(&mut self, now_ms: u64, random: u64) {
        let ceiling = BACKOFF_MIN_MS.saturating_mul(1 << self.failures.min(16)).min(BACKOFF_MAX_MS);
        let half = ceiling / 2;
        self.next_ms = now_ms + half + random % (half + 1);
        self.failed_ms = now_ms;
        self.failures = self.failures.saturating_add(1);
    }

    pub fn succeed(&mut self) {
        *self = Backoff::default();
    }
}

/// A key as read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kv {
    pub value: Vec<u8>,
    pub mod_revision: i64,
}

/// What a transaction did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxnResult {
    pub succeeded: bool,
    /// The store's revision after the txn: a successful put's new `mod_revision`.
    pub revision: i64,
    /// On failure, the key as the failure branch read it (`None`: absent).
    pub current: Option<Kv>,
}

/// What an error message of etcd's says, for the errors the plugin acts on.
pub fn kind_of(message: &str, code: Option<i64>, envoy_unreachable: bool) -> ErrorKind {
    if message.contains("database space exceeded") {
        ErrorKind::NoSpace
    } else if message.contains("request is too large") {
        ErrorKind::TooLarge
    } else if envoy_unreachable || code == Some(14) {
        ErrorKind::Unreachable
    } else {
        ErrorKind::Other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_with_jitter_up_to_its_bound_and_resets() {
        let mut b = Backoff::default();
        assert!(b.ready(0) && !b.failing());
        let mut now = 1_000;
        let mut waits = Vec::new();
        for i in 0..8 {
            b.fail(now, i * 7919);
            let wait = (0..).map(|d| now + d).find(|t| b.ready(*t)).unwrap() - now;
            waits.push(wait);
            now += wait;
        }
        assert!((50..=100).contains(&waits[0]), "{waits:?}");
        assert!((100..=200).contains(&waits[1]), "{waits:?}");
        assert!(waits.iter().all(|w| *w <= BACKOFF_MAX_MS), "{waits:?}");
        assert!(waits[7] >= BACKOFF_MAX_MS / 2, "{waits:?}");
        b.succeed();
        assert!(b.ready(now) && !b.failing());
    }

    #[test]
    fn a_write_due_before_the_backoff_ends_goes_after_the_shortest_backoff() {
        let mut b = Backoff::default();
        for i in 0..6 {
            b.fail(10_000, i);
        }
        let next = (10_000..).find(|t| b.ready(*t)).unwrap();
        assert!(next >= 10_000 + BACKOFF_MAX_MS / 2);
        // Due well after the backoff (with a call's timeout to spare): it waits.
        assert!(!b.ready_by(10_500, next + 1_000, 1_000, 3_000));
        // Due before the backoff ends: it goes, but not sooner than the shortest backoff.
        assert!(!b.ready_by(10_050, next, 1_000, 3_000));
        assert!(b.ready_by(10_000 + BACKOFF_MIN_MS, next, 1_000, 3_000));
        // Its deadline passed by this Envoy's clock: another Envoy's may still see it alive.
        assert!(b.ready_by(next - 1, next - 2, 1_000, 3_000));
        // Past it by more than the allowance: nothing is left to save, the backoff holds.
        assert!(!b.ready_by(next - 1, next - 3_002, 1_000, 3_000));
    }

    #[test]
    fn key_names_are_prefixed_hex() {
        assert_eq!(key_name("idem", &[0xab; 32]), format!("/idem/{}", "ab".repeat(32)).into_bytes());
        let mixed: Vec<u8> = (0u8..32).collect();
        let hex: String = mixed.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(key_name("n", &mixed.try_into().unwrap()), format!("/n/{hex}").into_bytes());
    }
}
