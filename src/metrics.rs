//! The plugin's Envoy stats (docs/behaviour.md §3.7). Envoy shows them as `wasmcustom.<name>` in `/stats`
//! and `idempotency_<name>` in `/stats/prometheus` (Envoy 1.40); names are part of the interface.

/// One counter per outcome of a covered request or of an owner's write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    Claimed,
    Replayed,
    Conflict,
    Waited,
    Released,
    Completed,
    ExpiredTakeover,
    Expired,
    FingerprintMismatch,
    MissingKey,
    InvalidKey,
    TooLarge,
    ResponseNotStored,
    StoreError,
    StoreFull,
    OwnerLost,
    UpstreamFailed,
    Evicted,
    ScopeMissing,
    StoreNoSpace,
    CompletionUnacknowledged,
    LocalReplay,
    EvictedBelowShare,
    ShareFull,
}

impl Counter {
    pub const ALL: [Counter; 24] = [
        Counter::Claimed,
        Counter::Replayed,
        Counter::Conflict,
        Counter::Waited,
        Counter::Released,
        Counter::Completed,
        Counter::ExpiredTakeover,
        Counter::Expired,
        Counter::FingerprintMismatch,
        Counter::MissingKey,
        Counter::InvalidKey,
        Counter::TooLarge,
        Counter::ResponseNotStored,
        Counter::StoreError,
        Counter::StoreFull,
        Counter::OwnerLost,
        Counter::UpstreamFailed,
        Counter::Evicted,
        Counter::ScopeMissing,
        Counter::StoreNoSpace,
        Counter::CompletionUnacknowledged,
        Counter::LocalReplay,
        Counter::EvictedBelowShare,
        Counter::ShareFull,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Counter::Claimed => "idempotency.claimed",
            Counter::Replayed => "idempotency.replayed",
            Counter::Conflict => "idempotency.conflict",
            Counter::Waited => "idempotency.waited",
            Counter::Released => "idempotency.released",
            Counter::Completed => "idempotency.completed",
            Counter::ExpiredTakeover => "idempotency.expired_takeover",
            Counter::Expired => "idempotency.expired",
            Counter::FingerprintMismatch => "idempotency.fingerprint_mismatch",
            Counter::MissingKey => "idempotency.missing_key",
            Counter::InvalidKey => "idempotency.invalid_key",
            Counter::TooLarge => "idempotency.too_large",
            Counter::ResponseNotStored => "idempotency.response_not_stored",
            Counter::StoreError => "idempotency.store_error",
            Counter::StoreFull => "idempotency.store_full",
            Counter::OwnerLost => "idempotency.owner_lost",
            Counter::UpstreamFailed => "idempotency.upstream_failed",
            Counter::Evicted => "idempotency.evicted",
            Counter::EvictedBelowShare => "idempotency.evicted_below_share",
            Counter::ShareFull => "idempotency.share_full",
            Counter::ScopeMissing => "idempotency.scope_missing",
            Counter::StoreNoSpace => "idempotency.store_no_space",
            Counter::CompletionUnacknowledged => "idempotency.completion_unacknowledged",
            Counter::LocalReplay => "idempotency.local_replays",
        }
    }
}

/// Gauges of what the store holds, shared by every worker of the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gauge {
    InProgress,
    Completed,
    /// Bytes of stored responses (the byte budget's use).
    StoredBytes,
    /// How old the youngest entry evicted in the last minute was, in ms; 0 when none was.
    EffectiveRetention,
    /// What the configuration gives or derives, set at configure: the shared-data table's byte
    /// budget, its buckets, one bucket's share of the budget, and the base policy's
    /// `max_response_bytes`.
    ConfigStoreBytes,
    ConfigBuckets,
    ConfigBucketShareBytes,
    ConfigMaxResponseBytes,
    /// Policies whose detached calls skip the route's behaviour (no `detached_via`).
    ConfigDetachedUnrouted,
    /// The share of the table's live entries, and of its stored bytes, held by the caller
    /// holding the most entries, in thousandths; counted by the sweep, one pass at a time.
    HeaviestCallerEntries,
    HeaviestCallerBytes,
    /// etcd: the bytes this Envoy wrote lately by its write ledger (`write_budget_bytes`).
    WriteBudgetUsed,
}

impl Gauge {
    pub const ALL: [Gauge; 12] = [
        Gauge::InProgress,
        Gauge::Completed,
        Gauge::StoredBytes,
        Gauge::EffectiveRetention,
        Gauge::ConfigStoreBytes,
        Gauge::ConfigBuckets,
        Gauge::ConfigBucketShareBytes,
        Gauge::ConfigMaxResponseBytes,
        Gauge::ConfigDetachedUnrouted,
        Gauge::HeaviestCallerEntries,
        Gauge::HeaviestCallerBytes,
        Gauge::WriteBudgetUsed,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Gauge::InProgress => "idempotency.entries_in_progress",
            Gauge::Completed => "idempotency.entries_completed",
            Gauge::StoredBytes => "idempotency.stored_bytes",
            Gauge::EffectiveRetention => "idempotency.effective_retention_ms",
            Gauge::ConfigStoreBytes => "idempotency.config_max_store_bytes",
            Gauge::ConfigBuckets => "idempotency.config_buckets",
            Gauge::ConfigBucketShareBytes => "idempotency.config_bucket_share_bytes",
            Gauge::ConfigMaxResponseBytes => "idempotency.config_max_response_bytes",
            Gauge::ConfigDetachedUnrouted => "idempotency.config_detached_unrouted",
            Gauge::HeaviestCallerEntries => "idempotency.heaviest_caller_entries_permille",
            Gauge::HeaviestCallerBytes => "idempotency.heaviest_caller_bytes_permille",
            Gauge::WriteBudgetUsed => "idempotency.write_budget_used_bytes",
        }
    }
}

/// A metric's name as this instance defines it: `idempotency.<prefix>.<name>` with a
/// `stat_prefix`, else as `name` gives it.
pub fn qualified(name: &str, prefix: Option<&str>) -> String {
    match (prefix, name.strip_prefix("idempotency.")) {
        (Some(prefix), Some(rest)) => format!("idempotency.{prefix}.{rest}"),
        _ => name.to_string(),
    }
}

#[cfg(test)]
mod name_tests {
    use super::*;

    #[test]
    fn a_stat_prefix_goes_after_the_plugins_name() {
        assert_eq!(qualified(Counter::Claimed.name(), None), "idempotency.claimed");
        assert_eq!(qualified(Counter::Claimed.name(), Some("payments")), "idempotency.payments.claimed");
        assert!(Counter::ALL.iter().all(|c| c.name().starts_with("idempotency.")));
        assert!(Gauge::ALL.iter().all(|g| g.name().starts_with("idempotency.")));
    }
}
