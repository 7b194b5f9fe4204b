//! The plugin configuration: JSON in, a validated [`Config`] out, parsed once at `on_configure`.
//!
//! Parsing is done by hand over `serde_json::Value` so that every error names the field and
//! says what was expected. serde's derive with `serde_path_to_error` was built and measured:
//! the same configure cost, 137 KB more `.wasm` in every worker, and vaguer errors
//! (CHANGELOG.md, "Performance notes"). The forms of earlier releases are read in `finish`.

use serde_json::Value;
use std::fmt;

/// The gRPC status codes by name (`release_grpc_statuses` takes names or numbers).
pub const GRPC_STATUS_NAMES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

/// What to do with a duplicate that meets an in-progress first call (docs/behaviour.md §3.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnConflict {
    /// Answer 409 at once.
    Reject,
    /// Hold the duplicate until the first call finishes (or `wait_max_ms`).
    Wait,
}

/// Who sends a covered request upstream (docs/behaviour.md §3.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Forward {
    /// The plugin sends it itself (`dispatch_http_call`), so the client's departure does not
    /// cancel it.
    Detached,
    /// Envoy's router sends it: route timeouts, retries and header rules apply.
    Router,
}

/// What a covered request gets when its configured scope is absent (docs/behaviour.md §3.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MissingScope {
    /// Forwarded unprotected, as if the plugin were not there: nothing claimed or replayed.
    Pass,
    /// 401 problem+json; no work is done.
    Reject,
    /// Such callers share one anonymous scope (for public APIs that want it).
    Share,
}

/// Upstream statuses that release the key instead of completing it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatusSet {
    ranges: Vec<(u16, u16)>,
}

impl StatusSet {
    pub fn contains(&self, status: u16) -> bool {
        self.ranges.iter().any(|&(lo, hi)| lo <= status && status <= hi)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreConfig {
    SharedData,
    Etcd(EtcdConfig),
}

/// What to do with a covered request when etcd does not answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnUnavailable {
    /// 503 problem+json, retryable: no work is done.
    Reject,
    /// Forward it without idempotency (counted and logged).
    Pass,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdConfig {
    /// The Envoy clusters that reach etcd, one per etcd cluster: each key lives on exactly
    /// one of them, chosen by its hash (rendezvous hashing over the names).
    pub clusters: Vec<String>,
    /// The `:authority` of the JSON gateway's requests (`api: "json"`); the cluster's name
    /// when `None`.
    pub authority: Option<String>,
    /// gRPC (the default: the cluster speaks HTTP/2) or the JSON gateway (HTTP/1.1).
    pub api: Api,
    /// `api` not given: gRPC, and the JSON gateway if the cluster turns out to be HTTP/1.1
    /// (etcd then answers gRPC calls UNIMPLEMENTED), as configurations of the releases before
    /// the gRPC API ran.
    pub api_fallback: bool,
    pub timeout_ms: u64,
    pub on_unavailable: OnUnavailable,
    /// Each Envoy keeps copies of the completed entries it has seen, in its shared data
    /// (bounded by `capacity` and `max_store_bytes`), and replays them without a round trip.
    pub local_replays: bool,
    /// The bytes this Envoy may add to etcd lately (its write ledger: the last `retention_s`
    /// and a third more); past it, the callers that wrote the most get 429 for new keys.
    /// 0: no budget.
    pub write_budget_bytes: u64,
}

/// The default write budget: a default etcd (2 GiB quota) stays out of `NOSPACE` with up to
/// four Envoys writing theirs in full (docs/fleet.md, "The fleet's share of etcd").
pub const DEFAULT_WRITE_BUDGET_BYTES: u64 = 256 << 20;

/// Which of etcd's two client APIs the store speaks (`store.api`).
pub use crate::store::etcd::api::Api as EtcdApi;
use EtcdApi as Api;

/// The most etcd clusters one configuration spreads its keys over.
pub const MAX_ETCD_CLUSTERS: usize = 16;

/// A JWT claim verified by Envoy's `jwt_authn` filter, read from its dynamic metadata
/// (`payload_in_metadata`), to scope keys by the caller's verified identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JwtClaim {
    /// The `payload_in_metadata` name set in `jwt_authn`.
    pub payload: String,
    /// The claim, e.g. `sub`.
    pub claim: String,
}

/// How a request is treated: the fields that per-route rules may override.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    /// `false` turns the filter off (for a route).
    pub enabled: bool,
    pub key_header: String,
    pub methods: Vec<String>,
    pub require_key: bool,
    pub max_key_length: usize,
    pub scope_headers: Vec<String>,
    /// Scope by the mTLS peer's identity: its certificate's first URI SAN.
    pub scope_peer: bool,
    pub scope_jwt_claim: Option<JwtClaim>,
    /// Where this policy's scope values come from, bound into the store key when the policies
    /// of one configuration scope by different sources (set by `Config::finish`; `None`: one
    /// source for every policy, whose positions tell them apart, as before 0.3.0).
    pub scope_source: Option<Vec<u8>>,
    pub missing_scope: MissingScope,
    pub fingerprint_headers: Vec<String>,
    pub fingerprint_body: bool,
    pub lease_ms: u64,
    pub retention_s: u64,
    pub retry_after_s: u64,
    pub on_conflict: OnConflict,
    pub wait_max_ms: u64,
    pub release_statuses: StatusSet,
    /// gRPC calls: the `grpc-status` codes that release the key (bit n: code n).
    pub release_grpc_statuses: u32,
    pub max_request_body_bytes: usize,
    /// The largest stored size (body, headers, 38 bytes) of a response that is stored.
    pub max_response_bytes: usize,
    pub forward: Forward,
    pub upstream_timeout_ms: u64,
    /// Detached calls go to this cluster, whose endpoint is an internal listener with the
    /// same routes (no idempotency filter), so the route's rewrites, header rules, timeout
    /// and retries apply as for the router; `None`: straight to the route's cluster, as the
    /// client sent the request (docs/deployment.md, "Detached calls through the route").
    pub detached_via: Option<String>,
}

/// Which requests a rule applies to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RouteMatch {
    Prefix(String),
    Path(String),
    RouteName(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    pub matcher: RouteMatch,
    /// When set, the rule applies to these methods only.
    pub methods: Option<Vec<String>>,
    pub policy: Policy,
}

/// The validated configuration. Header names are lower-case, methods upper-case.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub namespace: String,
    /// `mode: "observe"`: decide, count, log and record as enforcing would, and change
    /// nothing on the wire (every request goes on through the router, untouched).
    pub observe: bool,
    /// Puts this instance's metrics apart from another's in the same Envoy:
    /// `idempotency.<stat_prefix>.<name>` (`None`: `idempotency.<name>`, as before it existed).
    pub stat_prefix: Option<String>,
    pub capacity: usize,
    /// Bytes of stored responses the shared-data table holds at most.
    pub max_store_bytes: u64,
    /// The replay window every stored answer gets whatever other callers do (docs/behaviour.md
    /// §3.4): no completed entry younger than this is evicted; a new key is refused instead.
    pub min_retention_s: u64,
    pub max_waiters: usize,
    /// Bytes each worker buffers for requests in flight: router-mode captures of answers and
    /// the bodies of held duplicates.
    pub max_buffered_bytes: usize,
    /// Bytes of replayed responses each worker keeps, so that the next replay of the same
    /// entry reads the store once (its bucket), not twice.
    pub replay_cache_bytes: usize,
    pub store: StoreConfig,
    /// The request header that carries a first call's fencing token upstream (docs/behaviour.md §3.9);
    /// the client's own value is removed from every request.
    pub fencing_header: Option<String>,
    /// gRPC results with messages replay through the replay loopback (`"loopback"`): a route
    /// for `grpc::REPLAY_PATH` to a listener that answers by itself (docs/behaviour.md §3.10).
    pub grpc_replay_loopback: bool,
    /// The policy of requests no rule matches.
    pub policy: Policy,
    pub rules: Vec<Rule>,
    /// What an earlier release's form of this configuration now means, and the values derived
    /// for it: logged once at configure (docs/upgrading.md).
    pub notices: Vec<String>,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            enabled: true,
            key_header: "idempotency-key".into(),
            methods: vec!["POST".into(), "PATCH".into()],
            require_key: false,
            max_key_length: 255,
            scope_headers: vec!["authorization".into()],
            scope_peer: false,
            scope_jwt_claim: None,
            scope_source: None,
            missing_scope: MissingScope::Pass,
            fingerprint_headers: vec!["content-type".into()],
            fingerprint_body: true,
            lease_ms: 10_000,
            retention_s: 86_400,
            retry_after_s: 1,
            on_conflict: OnConflict::Reject,
            wait_max_ms: 5_000,
            // 401, 403 and 407 say the caller was not let in: nothing ran, and storing them would
            // let invented identities fill the store (docs/behaviour.md §2).
            release_statuses: StatusSet {
                ranges: vec![(500, 599), (401, 401), (403, 403), (407, 408), (425, 425), (429, 429)],
            },
            // The server-side failures (docs/behaviour.md §3.10): UNKNOWN, DEADLINE_EXCEEDED,
            // RESOURCE_EXHAUSTED, INTERNAL, UNAVAILABLE, DATA_LOSS.
            release_grpc_statuses: [2, 4, 8, 13, 14, 15].iter().fold(0, |set, code| set | 1 << code),
            max_request_body_bytes: 1 << 20,
            // What `Config::finish` fits to the default store: one bucket's share.
            max_response_bytes: 128 << 10,
            forward: Forward::Detached,
            upstream_timeout_ms: 30_000,
            detached_via: None,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            namespace: "idem".into(),
            stat_prefix: None,
            observe: false,
            capacity: 65_536,
            max_store_bytes: 128 << 20,
            min_retention_s: DEFAULT_MIN_RETENTION_S,
            max_waiters: 1_024,
            max_buffered_bytes: 16 << 20,
            replay_cache_bytes: 256 << 10,
            store: StoreConfig::SharedData,
            fencing_header: None,
            grpc_replay_loopback: false,
            policy: Policy::default(),
            rules: Vec::new(),
            notices: Vec::new(),
        }
    }
}

/// A configuration error: the field (a JSON path such as `store.kind`) and why it was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "invalid configuration: {}", self.reason)
        } else {
            write!(f, "invalid configuration: field `{}`: {}", self.field, self.reason)
        }
    }
}

fn err(field: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError { field: field.into(), reason: reason.into() }
}

/// Largest values we accept: they keep arithmetic on milliseconds and sizes far from overflow
/// and catch unit mistakes (seconds given as milliseconds).
const MAX_MS: u64 = 24 * 3600 * 1000;
const MIN_LEASE_MS: u64 = 1_000;
/// The smallest `lease_ms` the first release took: a shorter one given is raised (see `finish`).
const FIRST_MIN_LEASE_MS: u64 = 100;
const MIN_ETCD_LEASE_MS: u64 = 3_000;
const MAX_RETENTION_S: u64 = 30 * 24 * 3600;
/// The replay window by default: the retry schedules of common clients end within it (AWS
/// SDKs' standard mode: 3 attempts, backoff up to 20 s; Stripe's: up to 8 s; gRPC's usual
/// retry policies: backoff up to 10–30 s; docs/configuration.md).
pub const DEFAULT_MIN_RETENTION_S: u64 = 60;
const MAX_BODY: u64 = 64 << 20;
const MAX_CAPACITY: u64 = 1 << 22;
const MAX_STORE_BYTES: u64 = 64 << 30;
/// An etcd request is at most 1.5 MiB by default (`--max-request-bytes`); a stored response of
/// 1 MiB is 1.33 MiB in base64.
const MAX_ETCD_RESPONSE_BYTES: u64 = 1 << 20;
/// `max_response_bytes` not given: fitted to the store by `finish`.
const UNSET: usize = usize::MAX;
/// The largest default `max_response_bytes`, before it is fitted to the store (see `finish`).
const DEFAULT_MAX_RESPONSE_BYTES: usize = 1 << 20;

impl Config {
    /// Parses and validates the plugin configuration. Empty input means all defaults.
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        if bytes.iter().all(|b| b.is_ascii_whitespace()) {
            return Ok(Config::default());
        }
        let value: Value = serde_json::from_slice(bytes).map_err(|e| err("", format!("not valid JSON: {e}")))?;
        let Value::Object(map) = value else {
            return Err(err("", "expected a JSON object"));
        };
        let mut c = Config::default();
        c.policy.max_response_bytes = UNSET;
        let mut rules = None;
        let store_bytes_given = map.contains_key("max_store_bytes");
        for (name, v) in &map {
            let f = name.as_str();
            match f {
                "namespace" => c.namespace = namespace(f, v)?,
                "stat_prefix" => c.stat_prefix = Some(stat_prefix(f, v)?),
                "mode" => {
                    c.observe = match string(f, v)? {
                        "enforce" => false,
                        "observe" => true,
                        other => return Err(err(f, format!("expected \"enforce\" or \"observe\", got {other:?}"))),
                    }
                }
                "capacity" => c.capacity = int(f, v, 1, MAX_CAPACITY)? as usize,
                "max_store_bytes" => c.max_store_bytes = int(f, v, 0, MAX_STORE_BYTES)?,
                "min_retention_s" => c.min_retention_s = int(f, v, 0, MAX_RETENTION_S)?,
                "max_waiters" => c.max_waiters = int(f, v, 0, 1 << 20)? as usize,
                "max_buffered_bytes" => c.max_buffered_bytes = int(f, v, 0, 1 << 30)? as usize,
                "replay_cache_bytes" => c.replay_cache_bytes = int(f, v, 0, 64 << 20)? as usize,
                "store" => c.store = store(f, v, &mut c.notices)?,
                "fencing_header" => c.fencing_header = Some(header_name(f, v)?),
                "grpc_replays" => {
                    c.grpc_replay_loopback = match string(f, v)? {
                        "loopback" => true,
                        "off" => false,
                        other => return Err(err(f, format!("expected \"loopback\" or \"off\", got {other:?}"))),
                    }
                }
                "routes" => rules = Some(v),
                _ => {
                    if !c.policy.set(f, f, v)? {
                        return Err(err(f, "unknown field"));
                    }
                }
            }
        }
        // Rules start from the base policy, whatever the order of fields in the JSON.
        if let Some(v) = rules {
            for (i, item) in array("routes", v)?.iter().enumerate() {
                c.rules.push(rule(&format!("routes[{i}]"), item, &c.policy)?);
            }
        }
        c.finish(store_bytes_given)?;
        if c.observe {
            c.observe_only();
        }
        Ok(c)
    }

    /// Observe mode changes nothing on the wire: the router forwards every request as it came
    /// (no detached call, no fencing header set or removed, no replay loopback), and no request
    /// is held (wait mode decides as reject mode would).
    fn observe_only(&mut self) {
        self.fencing_header = None;
        self.grpc_replay_loopback = false;
        for p in std::iter::once(&mut self.policy).chain(self.rules.iter_mut().map(|r| &mut r.policy)) {
            p.forward = Forward::Router;
            p.on_conflict = OnConflict::Reject;
        }
    }

    /// Checks the values that only make sense together (docs/behaviour.md §3.8), and fits the default
    /// `max_response_bytes` to the store, or the default store to a `max_response_bytes`
    /// given (`store_bytes_given`: whether `max_store_bytes` was).
    fn finish(&mut self, store_bytes_given: bool) -> Result<(), ConfigError> {
        if let Some(name) = &self.fencing_header {
            // The token replaces what the client sent: it must not be a header the plugin
            // reads for itself, nor one Envoy owns.
            let reads = |p: &Policy| {
                *name == p.key_header || p.scope_headers.contains(name) || p.fingerprint_headers.contains(name)
            };
            if self.policies().any(reads)
                || crate::header_map::is_hop_by_hop(name)
                || ["host", "content-length"].contains(&name.as_str())
            {
                return Err(err("fencing_header", format!("{name:?} is a header the plugin or Envoy reads")));
            }
        }
        if !store_bytes_given {
            self.fit_store_bytes();
        }
        self.bind_scope_sources();
        let (limit, limit_why) = match &self.store {
            StoreConfig::SharedData => {
                let buckets = crate::store::table::Layout::buckets_for(self.capacity);
                let share = self.max_store_bytes / u64::from(buckets);
                (share, format!("the share of one of the table's {buckets} buckets (max_store_bytes / ceil(capacity / 64) = {share}): raise max_store_bytes, or lower capacity"))
            }
            StoreConfig::Etcd(_) => {
                (MAX_ETCD_RESPONSE_BYTES, format!("{MAX_ETCD_RESPONSE_BYTES}, what one etcd request carries"))
            }
        };
        let default = (limit as usize).min(DEFAULT_MAX_RESPONSE_BYTES);
        let etcd_timeout = match &self.store {
            StoreConfig::Etcd(e) => Some(e.timeout_ms),
            StoreConfig::SharedData => None,
        };
        let policies = std::iter::once((String::new(), &mut self.policy))
            .chain(self.rules.iter_mut().enumerate().map(|(i, r)| (format!("routes[{i}]."), &mut r.policy)));
        let notices = &mut self.notices;
        for (at, p) in policies {
            // Leases an earlier release took, now too short to hold under load (measured):
            // raised, rather than a configuration that loaded before refused.
            let mut min_lease = MIN_LEASE_MS;
            let mut why = "the shortest lease a live call keeps under load".to_string();
            if let Some(timeout_ms) = etcd_timeout {
                min_lease = MIN_ETCD_LEASE_MS.max(timeout_ms.saturating_mul(3));
                why = format!("with the etcd store, at least {MIN_ETCD_LEASE_MS} and three store.timeout_ms ({timeout_ms}): a renewal round trip reaches hundreds of ms, and one that times out must leave time for the next");
            }
            if p.lease_ms < min_lease {
                notices.push(format!("{at}lease_ms {} raised to {min_lease}: {why}", p.lease_ms));
                p.lease_ms = min_lease;
            }
            // 0 meant no timeout before 0.1.0; a stalled upstream would hold its key for ever.
            if p.upstream_timeout_ms == 0 {
                notices.push(format!("{at}upstream_timeout_ms 0 (no timeout) is now {MAX_MS}, the longest one"));
                p.upstream_timeout_ms = MAX_MS;
            }
            // Before 0.1.0 a larger answer failed its write to etcd; now it is not stored.
            if etcd_timeout.is_some() && p.max_response_bytes != UNSET && p.max_response_bytes as u64 > limit {
                notices.push(format!(
                    "{at}max_response_bytes {} lowered to {limit}, what one etcd request carries",
                    p.max_response_bytes
                ));
                p.max_response_bytes = limit as usize;
            }
            if p.max_response_bytes == UNSET {
                p.max_response_bytes = default;
            } else if p.max_response_bytes as u64 > limit {
                return Err(err(
                    &format!("{at}max_response_bytes"),
                    format!("{} is above {limit_why}", p.max_response_bytes),
                ));
            }
        }
        Ok(())
    }

    /// A scope value's position tells its source (the headers in order, then the peer, then the
    /// claim) only while every policy reads the same sources: when they differ, each policy's
    /// store keys also bind where its values came from (docs/behaviour.md §3.1), so that a
    /// header on one route can never name the key a JWT claim names on another.
    fn bind_scope_sources(&mut self) {
        let source = |p: &Policy| {
            let mut s = String::new();
            for h in &p.scope_headers {
                s += &format!("header:{h}\n");
            }
            if p.scope_peer {
                s += "peer\n";
            }
            if let Some(jwt) = &p.scope_jwt_claim {
                s += &format!("jwt:{}:{}\n", jwt.payload, jwt.claim);
            }
            s.into_bytes()
        };
        let sources: Vec<Vec<u8>> = self.policies().map(source).collect();
        if sources.windows(2).all(|w| w.first() == w.last()) {
            return;
        }
        let policies = std::iter::once(&mut self.policy).chain(self.rules.iter_mut().map(|r| &mut r.policy));
        for (p, s) in policies.zip(sources) {
            p.scope_source = Some(s);
        }
    }

    /// Releases before 0.2.0 had no byte budget and stored answers up to the
    /// `max_response_bytes` given (1 MiB was the documented default). With the default budget
    /// one bucket's share is smaller than that for a large `capacity`: the budget grows to
    /// give each bucket room for one such answer, instead of refusing a configuration that
    /// loaded before.
    fn fit_store_bytes(&mut self) {
        if !matches!(self.store, StoreConfig::SharedData) {
            return;
        }
        let largest = self.policies().map(|p| p.max_response_bytes).filter(|b| *b != UNSET).max().unwrap_or(0);
        let buckets = u64::from(crate::store::table::Layout::buckets_for(self.capacity));
        let needed = (largest as u64).saturating_mul(buckets).min(MAX_STORE_BYTES);
        if needed > self.max_store_bytes {
            self.notices.push(format!(
                "max_store_bytes not given: derived {needed} (max_response_bytes {largest} for each of the \
                 {buckets} buckets of capacity {}) instead of the default {}; set max_store_bytes to choose",
                self.capacity, self.max_store_bytes
            ));
            self.max_store_bytes = needed;
        }
    }

    /// The figures an operator needs to know what memory the table may use (the gauges
    /// `idempotency.config_*`, and the line logged at configure).
    pub fn derived(&self) -> Vec<(crate::metrics::Gauge, u64)> {
        use crate::metrics::Gauge;
        let buckets = u64::from(crate::store::table::Layout::buckets_for(self.capacity));
        vec![
            (Gauge::ConfigStoreBytes, self.max_store_bytes),
            (Gauge::ConfigBuckets, buckets),
            (Gauge::ConfigBucketShareBytes, self.max_store_bytes / buckets.max(1)),
            (Gauge::ConfigMaxResponseBytes, self.policy.max_response_bytes as u64),
            (Gauge::ConfigDetachedUnrouted, self.detached_unrouted() as u64),
        ]
    }

    /// How many policies (the base one and the rules') send detached calls straight to the
    /// route's cluster, without the route's rewrites, header rules, timeout and retries:
    /// told at configure (a warning and the `config_detached_unrouted` gauge).
    pub fn detached_unrouted(&self) -> usize {
        if self.observe {
            return 0;
        }
        self.policies().filter(|p| p.enabled && p.forward == Forward::Detached && p.detached_via.is_none()).count()
    }

    /// The policy for a request: the first rule that matches, else the base policy.
    pub fn policy_for(&self, path: &[u8], method: &[u8], route_name: Option<&[u8]>) -> usize {
        let path = path.split(|b| *b == b'?').next().unwrap_or_default();
        let path = normalized(path);
        self.rules.iter().position(|r| r.matches(&path, method, route_name)).map_or(0, |i| i + 1)
    }

    /// Every policy: the base one, then each rule's.
    pub fn policies(&self) -> impl Iterator<Item = &Policy> {
        std::iter::once(&self.policy).chain(self.rules.iter().map(|r| &r.policy))
    }

    /// Policy 0 is the base policy; policy `i + 1` is rule `i`'s.
    pub fn policy(&self, index: usize) -> &Policy {
        match index.checked_sub(1).and_then(|i| self.rules.get(i)) {
            Some(rule) => &rule.policy,
            None => &self.policy,
        }
    }
}

/// A path as rules match it (docs/behaviour.md §3.1): slashes merged and `.` and `..` segments
/// resolved, as Envoy's `merge_slashes` and `normalize_path` route it, so that `//v1/payments`
/// or `/v1/./payments` cannot escape a rule for `/v1/payments` on an Envoy that does not
/// normalize. Borrowed when there is nothing to do (the common case).
pub fn normalized(path: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    let plain = !path.windows(2).any(|w| w == b"//" || w == b"/.") && !path.ends_with(b"/.");
    if plain {
        return std::borrow::Cow::Borrowed(path);
    }
    let mut segments: Vec<&[u8]> = Vec::new();
    for segment in path.split(|b| *b == b'/').skip(1) {
        match segment {
            b"" | b"." => {}
            b".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    let mut out = Vec::with_capacity(path.len());
    for s in &segments {
        out.push(b'/');
        out.extend_from_slice(s);
    }
    let trailing = path.ends_with(b"/") || path.ends_with(b"/.") || path.ends_with(b"/..");
    if out.is_empty() || trailing {
        out.push(b'/');
    }
    std::borrow::Cow::Owned(out)
}

impl Rule {
    fn matches(&self, path: &[u8], method: &[u8], route_name: Option<&[u8]>) -> bool {
        let path_ok = match &self.matcher {
            RouteMatch::Prefix(p) => path.starts_with(p.as_bytes()),
            RouteMatch::Path(p) => path == p.as_bytes(),
            RouteMatch::RouteName(n) => route_name == Some(n.as_bytes()),
        };
        path_ok && self.methods.as_ref().is_none_or(|ms| ms.iter().any(|m| m.as_bytes() == method))
    }
}

fn rule(f: &str, v: &Value, base: &Policy) -> Result<Rule, ConfigError> {
    let Value::Object(map) = v else {
        return Err(err(
            f,
            format!("expected an object like {{\"match\":{{\"prefix\":\"/payments\"}},\"require_key\":true}}, got {v}"),
        ));
    };
    let match_field = format!("{f}.match");
    let Some(Value::Object(m)) = map.get("match") else {
        return Err(err(
            &match_field,
            "missing, or not an object with one of prefix, path, route_name (and optional methods)",
        ));
    };
    let mut matcher = None;
    let mut methods_only = None;
    for (name, mv) in m {
        let mf = format!("{match_field}.{name}");
        let kind = match name.as_str() {
            "prefix" => RouteMatch::Prefix(path_string(&mf, mv)?),
            "path" => RouteMatch::Path(path_string(&mf, mv)?),
            "route_name" => RouteMatch::RouteName(string(&mf, mv)?.to_string()),
            "methods" => {
                methods_only = Some(methods(&mf, mv)?);
                continue;
            }
            _ => return Err(err(&mf, "unknown field; expected prefix, path, route_name or methods")),
        };
        if matcher.replace(kind).is_some() {
            return Err(err(&match_field, "give exactly one of prefix, path, route_name"));
        }
    }
    let Some(matcher) = matcher else {
        return Err(err(&match_field, "give exactly one of prefix, path, route_name"));
    };
    let mut policy = base.clone();
    for (name, fv) in map {
        if name == "match" {
            continue;
        }
        let field = format!("{f}.{name}");
        if !policy.set(name, &field, fv)? {
            return Err(err(&field, "unknown field, or not one a rule can override"));
        }
    }
    Ok(Rule { matcher, methods: methods_only, policy })
}

impl Policy {
    /// Whether a gRPC call that ended with `code` releases its key.
    pub fn releases_grpc(&self, code: u32) -> bool {
        self.release_grpc_statuses & (1 << code.min(31)) != 0
    }

    /// Sets one field; `Ok(false)` when `name` is not a policy field.
    fn set(&mut self, name: &str, f: &str, v: &Value) -> Result<bool, ConfigError> {
        match name {
            "enabled" => self.enabled = boolean(f, v)?,
            "key_header" => self.key_header = header_name(f, v)?,
            "methods" => self.methods = methods(f, v)?,
            "require_key" => self.require_key = boolean(f, v)?,
            "max_key_length" => self.max_key_length = int(f, v, 1, 8192)? as usize,
            "scope_headers" => self.scope_headers = header_names(f, v)?,
            "scope_peer" => self.scope_peer = boolean(f, v)?,
            "scope_jwt_claim" => self.scope_jwt_claim = jwt_claim(f, v)?,
            "missing_scope" => {
                self.missing_scope = match string(f, v)? {
                    "pass" => MissingScope::Pass,
                    "reject" => MissingScope::Reject,
                    "share" => MissingScope::Share,
                    other => return Err(err(f, format!("expected \"pass\", \"reject\" or \"share\", got {other:?}"))),
                }
            }
            "fingerprint_headers" => self.fingerprint_headers = header_names(f, v)?,
            "fingerprint_body" => self.fingerprint_body = boolean(f, v)?,
            // Renewal runs every lease/4 from the worker's event loop, which an overloaded
            // worker can stall for hundreds of ms (measured): shorter leases expire under load.
            "lease_ms" => self.lease_ms = int(f, v, FIRST_MIN_LEASE_MS, MAX_MS)?,
            "retention_s" => self.retention_s = int(f, v, 1, MAX_RETENTION_S)?,
            "retry_after_s" => self.retry_after_s = int(f, v, 1, 3600)?,
            "on_conflict" => {
                self.on_conflict = match string(f, v)? {
                    "reject" => OnConflict::Reject,
                    "wait" => OnConflict::Wait,
                    other => return Err(err(f, format!("expected \"reject\" or \"wait\", got {other:?}"))),
                }
            }
            "wait_max_ms" => self.wait_max_ms = int(f, v, 1, MAX_MS)?,
            "release_statuses" => self.release_statuses = statuses(f, v)?,
            "release_grpc_statuses" => self.release_grpc_statuses = grpc_statuses(f, v)?,
            "max_request_body_bytes" => self.max_request_body_bytes = int(f, v, 0, MAX_BODY)? as usize,
            "max_response_bytes" => self.max_response_bytes = int(f, v, 0, MAX_BODY)? as usize,
            "forward" => {
                self.forward = match string(f, v)? {
                    "detached" => Forward::Detached,
                    "router" => Forward::Router,
                    other => return Err(err(f, format!("expected \"detached\" or \"router\", got {other:?}"))),
                }
            }
            // 0 would mean no timeout: a stalled upstream would hold its key for ever.
            "upstream_timeout_ms" => self.upstream_timeout_ms = int(f, v, 0, MAX_MS)?,
            "detached_via" => self.detached_via = Some(detached_via(f, v)?),
            _ => return Ok(false),
        }
        Ok(true)
    }
}

fn path_string(f: &str, v: &Value) -> Result<String, ConfigError> {
    let s = string(f, v)?;
    if !s.starts_with('/') {
        return Err(err(f, format!("expected a path starting with '/', got {s:?}")));
    }
    Ok(s.to_string())
}

fn jwt_claim(f: &str, v: &Value) -> Result<Option<JwtClaim>, ConfigError> {
    if v.is_null() {
        return Ok(None);
    }
    let Value::Object(map) = v else {
        return Err(err(f, format!("expected {{\"payload\":\"<payload_in_metadata>\",\"claim\":\"sub\"}}, got {v}")));
    };
    let mut payload = None;
    let mut claim = None;
    for (name, item) in map {
        let field = format!("{f}.{name}");
        let value = string(&field, item)?;
        if value.is_empty() {
            return Err(err(&field, "must not be empty"));
        }
        match name.as_str() {
            "payload" => payload = Some(value.to_string()),
            "claim" => claim = Some(value.to_string()),
            _ => return Err(err(&field, "unknown field; expected payload and claim")),
        }
    }
    match (payload, claim) {
        (Some(payload), Some(claim)) => Ok(Some(JwtClaim { payload, claim })),
        (None, _) => Err(err(&format!("{f}.payload"), "missing")),
        (_, None) => Err(err(&format!("{f}.claim"), "missing")),
    }
}

fn etcd(f: &str, map: &serde_json::Map<String, Value>, notices: &mut Vec<String>) -> Result<StoreConfig, ConfigError> {
    let mut clusters: Vec<String> = Vec::new();
    let mut authority = None;
    let mut api = Api::Grpc;
    let mut local_replays = true;
    let mut timeout_ms = 1_000;
    let mut on_unavailable = OnUnavailable::Reject;
    let mut write_budget_bytes = DEFAULT_WRITE_BUDGET_BYTES;
    for (name, v) in map {
        let field = format!("{f}.{name}");
        match name.as_str() {
            "kind" => {}
            "cluster" => clusters.extend(Some(string(&field, v)?.to_string()).filter(|c| !c.is_empty())),
            "clusters" => clusters.extend(cluster_names(&field, v)?),
            "authority" => authority = Some(string(&field, v)?.to_string()),
            "local_replays" => local_replays = boolean(&field, v)?,
            "api" => {
                api = match string(&field, v)? {
                    "grpc" => Api::Grpc,
                    "json" => Api::Json,
                    other => return Err(err(&field, format!("expected \"grpc\" or \"json\", got {other:?}"))),
                }
            }
            "timeout_ms" => timeout_ms = int(&field, v, 1, 60_000)?,
            "write_budget_bytes" => write_budget_bytes = int(&field, v, 0, 1 << 40)?,
            "on_unavailable" => {
                on_unavailable = match string(&field, v)? {
                    "reject" => OnUnavailable::Reject,
                    "pass" => OnUnavailable::Pass,
                    other => return Err(err(&field, format!("expected \"reject\" or \"pass\", got {other:?}"))),
                }
            }
            _ => return Err(err(&field, "unknown field for store kind \"etcd\"")),
        }
    }
    if clusters.is_empty() {
        return Err(err(&format!("{f}.cluster"), "missing: the Envoy cluster that reaches etcd (or clusters: [...])"));
    }
    if map.contains_key("cluster") && map.contains_key("clusters") {
        return Err(err(&format!("{f}.clusters"), "give cluster or clusters, not both"));
    }
    if authority.is_some() && !map.contains_key("api") && clusters.len() == 1 {
        // Before 0.2.0 the JSON gateway was the only API, and `authority` its `:authority`:
        // such a configuration runs on an HTTP/1.1 cluster, and keeps doing so.
        api = Api::Json;
        notices.push(format!(
            "{f}.authority without {f}.api: the JSON gateway, as before 0.2.0; add \"api\": \"json\" to keep it, \
             or remove authority and give etcd an HTTP/2 cluster for its gRPC API (the default)"
        ));
    }
    if authority.is_some() && (api == Api::Grpc || clusters.len() > 1) {
        let why = "only with api \"json\" and one cluster (gRPC calls carry the cluster's name)";
        return Err(err(&format!("{f}.authority"), why));
    }
    if api == Api::Grpc {
        if let Some(name) = clusters.iter().find(|c| crate::store::etcd::grpc::envoy_may_misread(c)) {
            let why = format!(
                "{name:?}: Envoy may read a cluster name over 125 bytes as a serialized GrpcService and abort; \
                 give the cluster a shorter name"
            );
            return Err(err(&format!("{f}.clusters"), why));
        }
    }
    let api_fallback = !map.contains_key("api") && api == Api::Grpc;
    Ok(StoreConfig::Etcd(EtcdConfig {
        clusters,
        authority,
        api,
        api_fallback,
        timeout_ms,
        on_unavailable,
        local_replays,
        write_budget_bytes,
    }))
}

/// `detached_via`: an Envoy cluster's name, 1 to 255 bytes.
fn detached_via(f: &str, v: &Value) -> Result<String, ConfigError> {
    let name = string(f, v)?;
    if name.is_empty() || name.len() > 255 {
        return Err(err(f, format!("expected a cluster name of 1 to 255 bytes, got {name:?}")));
    }
    Ok(name.to_string())
}

/// `clusters`: 1 to `MAX_ETCD_CLUSTERS` distinct, non-empty names.
fn cluster_names(f: &str, v: &Value) -> Result<Vec<String>, ConfigError> {
    let names = v.as_array().ok_or_else(|| err(f, format!("expected an array of cluster names, got {v}")))?;
    if names.is_empty() || names.len() > MAX_ETCD_CLUSTERS {
        return Err(err(f, format!("expected 1 to {MAX_ETCD_CLUSTERS} cluster names, got {}", names.len())));
    }
    let mut out: Vec<String> = Vec::new();
    for name in names {
        let name = string(f, name)?;
        if name.is_empty() || out.iter().any(|n| n == name) {
            return Err(err(f, format!("cluster names must be non-empty and distinct: {name:?}")));
        }
        out.push(name.to_string());
    }
    Ok(out)
}

fn boolean(f: &str, v: &Value) -> Result<bool, ConfigError> {
    v.as_bool().ok_or_else(|| err(f, format!("expected true or false, got {v}")))
}

fn string<'a>(f: &str, v: &'a Value) -> Result<&'a str, ConfigError> {
    v.as_str().ok_or_else(|| err(f, format!("expected a string, got {v}")))
}

fn int(f: &str, v: &Value, min: u64, max: u64) -> Result<u64, ConfigError> {
    match v.as_u64() {
        Some(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(err(f, format!("expected an integer from {min} to {max}, got {v}"))),
    }
}

fn array<'a>(f: &str, v: &'a Value) -> Result<&'a Vec<Value>, ConfigError> {
    v.as_array().ok_or_else(|| err(f, format!("expected an array, got {v}")))
}

/// RFC 9110 token characters: what a header name or a method may contain.
fn is_token(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn header_name(f: &str, v: &Value) -> Result<String, ConfigError> {
    let s = string(f, v)?;
    if !is_token(s) {
        return Err(err(f, format!("{s:?} is not a valid header name")));
    }
    Ok(s.to_ascii_lowercase())
}

fn header_names(f: &str, v: &Value) -> Result<Vec<String>, ConfigError> {
    let mut out: Vec<String> = Vec::new();
    for (i, item) in array(f, v)?.iter().enumerate() {
        let name = header_name(&format!("{f}[{i}]"), item)?;
        if !out.contains(&name) {
            out.push(name);
        }
    }
    Ok(out)
}

fn methods(f: &str, v: &Value) -> Result<Vec<String>, ConfigError> {
    let mut out: Vec<String> = Vec::new();
    for (i, item) in array(f, v)?.iter().enumerate() {
        let field = format!("{f}[{i}]");
        let s = string(&field, item)?;
        if !is_token(s) {
            return Err(err(&field, format!("{s:?} is not a valid HTTP method")));
        }
        let m = s.to_ascii_uppercase();
        if !out.contains(&m) {
            out.push(m);
        }
    }
    Ok(out)
}

fn statuses(f: &str, v: &Value) -> Result<StatusSet, ConfigError> {
    let mut ranges = Vec::new();
    for (i, item) in array(f, v)?.iter().enumerate() {
        let field = format!("{f}[{i}]");
        let range = match item {
            Value::Number(_) => {
                let n = int(&field, item, 100, 599)? as u16;
                (n, n)
            }
            Value::String(s) => match s.as_bytes() {
                [c @ b'1'..=b'5', b'x' | b'X', b'x' | b'X'] => {
                    let lo = u16::from(c - b'0') * 100;
                    (lo, lo + 99)
                }
                _ => {
                    return Err(err(&field, format!("expected a status (100-599) or a class like \"5xx\", got {s:?}")))
                }
            },
            other => {
                return Err(err(&field, format!("expected a status (100-599) or a class like \"5xx\", got {other}")))
            }
        };
        ranges.push(range);
    }
    Ok(StatusSet { ranges })
}

/// gRPC status codes, by number (0-16) or name (`"UNAVAILABLE"`), as a set of bits.
fn grpc_statuses(f: &str, v: &Value) -> Result<u32, ConfigError> {
    let mut set = 0u32;
    for (i, item) in array(f, v)?.iter().enumerate() {
        let field = format!("{f}[{i}]");
        let code = match item {
            Value::Number(_) => int(&field, item, 0, 16)? as u32,
            Value::String(s) => GRPC_STATUS_NAMES.iter().position(|n| n.eq_ignore_ascii_case(s)).ok_or_else(|| {
                err(&field, format!("expected a gRPC status code (0-16) or its name like \"UNAVAILABLE\", got {s:?}"))
            })? as u32,
            other => return Err(err(&field, format!("expected a gRPC status code (0-16) or its name, got {other}"))),
        };
        set |= 1 << code;
    }
    Ok(set)
}

fn namespace(f: &str, v: &Value) -> Result<String, ConfigError> {
    let s = string(f, v)?;
    let ok = !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if !ok {
        return Err(err(f, format!("expected 1 to 64 characters from [A-Za-z0-9._-], got {s:?}")));
    }
    Ok(s.to_string())
}

/// A metric name's part: what Prometheus keeps of a stat name, so that it stays one word there.
fn stat_prefix(f: &str, v: &Value) -> Result<String, ConfigError> {
    let s = string(f, v)?;
    let ok =
        !s.is_empty() && s.len() <= 32 && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if !ok {
        return Err(err(f, format!("expected 1 to 32 characters from [a-z0-9_], got {s:?}")));
    }
    Ok(s.to_string())
}

/// `notices`: where an old form's new meaning is told (see [`Config::notices`]).
fn store(f: &str, v: &Value, notices: &mut Vec<String>) -> Result<StoreConfig, ConfigError> {
    let Value::Object(map) = v else {
        return Err(err(f, format!("expected an object like {{\"kind\":\"shared_data\"}}, got {v}")));
    };
    let kind_field = format!("{f}.kind");
    let kind = match map.get("kind") {
        Some(k) => string(&kind_field, k)?,
        None => return Err(err(&kind_field, "missing")),
    };
    match kind {
        "shared_data" => {
            if let Some(extra) = map.keys().find(|k| k.as_str() != "kind") {
                return Err(err(&format!("{f}.{extra}"), "unknown field for store kind \"shared_data\""));
            }
            Ok(StoreConfig::SharedData)
        }
        "etcd" => etcd(f, map, notices),
        other => Err(err(&kind_field, format!("expected \"shared_data\" or \"etcd\", got {other:?}"))),
    }
}

#[cfg(test)]
mod docs_tests;

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Config, ConfigError> {
        Config::parse(s.as_bytes())
    }

    #[test]
    fn empty_and_empty_object_give_defaults() {
        assert_eq!(parse("").unwrap(), Config::default());
        assert_eq!(parse(" {} ").unwrap(), Config::default());
    }

    #[test]
    fn fields_are_parsed_and_normalised() {
        let c = parse(
            r#"{"key_header":"X-Idem","methods":["post","put","POST"],"require_key":true,
                "lease_ms":2000,"retention_s":60,"release_statuses":["4xx",503],
                "forward":"router","namespace":"shop","capacity":1024,
                "scope_headers":["X-Tenant"],"store":{"kind":"shared_data"}}"#,
        )
        .unwrap();
        let p = &c.policy;
        assert_eq!(p.key_header, "x-idem");
        assert_eq!(p.methods, vec!["POST", "PUT"]);
        assert!(p.require_key);
        assert_eq!((p.lease_ms, p.retention_s, c.capacity), (2000, 60, 1024));
        assert!(p.release_statuses.contains(404) && p.release_statuses.contains(503));
        assert!(!p.release_statuses.contains(500) && !p.release_statuses.contains(201));
        assert_eq!(p.forward, Forward::Router);
        assert_eq!(p.scope_headers, vec!["x-tenant"]);
    }

    #[test]
    fn rules_match_the_path_as_envoy_routes_it_after_normalizing() {
        for (raw, norm) in [
            ("/v1/payments", "/v1/payments"),
            ("//v1/payments", "/v1/payments"),
            ("/v1//payments/", "/v1/payments/"),
            ("/v1/./payments", "/v1/payments"),
            ("/x/../v1/payments", "/v1/payments"),
            ("/../v1/payments", "/v1/payments"),
            ("/v1/payments/.", "/v1/payments/"),
            ("/.well-known/x", "/.well-known/x"),
            ("//", "/"),
        ] {
            assert_eq!(normalized(raw.as_bytes()).as_ref(), norm.as_bytes(), "{raw}");
        }
        let c = parse(r#"{"routes":[{"match":{"prefix":"/v1/payments"},"require_key":true}]}"#).unwrap();
        for path in ["/v1/payments", "//v1/payments", "/v1/./payments?x=1", "/a/../v1/payments"] {
            assert_eq!(c.policy_for(path.as_bytes(), b"POST", None), 1, "{path}");
        }
        assert_eq!(c.policy_for(b"/v2/payments", b"POST", None), 0);
    }

    #[test]
    fn default_release_statuses_follow_the_spec() {
        let s = Config::default().policy.release_statuses;
        for code in [500, 503, 599, 401, 403, 407, 408, 425, 429] {
            assert!(s.contains(code), "{code}");
        }
        for code in [200, 201, 400, 402, 404, 405, 406, 409, 422, 600] {
            assert!(!s.contains(code), "{code}");
        }
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (r#"{"lease_ms":"10s"}"#, "lease_ms"),
            (r#"{"lease_ms":0}"#, "lease_ms"),
            (r#"{"lease":1000}"#, "lease"),
            (r#"{"replay_cache_bytes":67108865}"#, "replay_cache_bytes"),
            (r#"{"routes":[{"match":{"prefix":"/"},"replay_cache_bytes":0}]}"#, "routes[0].replay_cache_bytes"),
            (r#"{"methods":["PO ST"]}"#, "methods[0]"),
            (r#"{"release_statuses":[200,"6xx"]}"#, "release_statuses[1]"),
            (r#"{"release_statuses":[99]}"#, "release_statuses[0]"),
            (r#"{"on_conflict":"queue"}"#, "on_conflict"),
            (r#"{"forward":"proxy"}"#, "forward"),
            (r#"{"detached_via":""}"#, "detached_via"),
            (r#"{"detached_via":7}"#, "detached_via"),
            (r#"{"store":{"kind":"redis"}}"#, "store.kind"),
            (r#"{"store":{"kind":"shared_data","x":1}}"#, "store.x"),
            (r#"{"store":{}}"#, "store.kind"),
            (r#"{"store":{"kind":"etcd"}}"#, "store.cluster"),
            (r#"{"store":{"kind":"etcd","cluster":"etcd","on_unavailable":"maybe"}}"#, "store.on_unavailable"),
            (r#"{"store":{"kind":"etcd","cluster":"etcd","timeout_ms":0}}"#, "store.timeout_ms"),
            (r#"{"store":{"kind":"etcd","cluster":"etcd","api":"rest"}}"#, "store.api"),
            (r#"{"store":{"kind":"etcd","clusters":[]}}"#, "store.clusters"),
            (r#"{"store":{"kind":"etcd","clusters":["a","a"]}}"#, "store.clusters"),
            (r#"{"store":{"kind":"etcd","clusters":["a",""]}}"#, "store.clusters"),
            (r#"{"store":{"kind":"etcd","cluster":"a","clusters":["b"]}}"#, "store.clusters"),
            (r#"{"store":{"kind":"etcd","cluster":"a","api":"grpc","authority":"x"}}"#, "store.authority"),
            (r#"{"store":{"kind":"etcd","clusters":["a","b"],"authority":"x"}}"#, "store.authority"),
            (r#"{"namespace":"a/b"}"#, "namespace"),
            (r#"{"capacity":0}"#, "capacity"),
            (r#"{"key_header":""}"#, "key_header"),
            (r#"{"require_key":"yes"}"#, "require_key"),
            (r#"{"scope_headers":"authorization"}"#, "scope_headers"),
        ];
        for (json, field) in cases {
            let e = parse(json).unwrap_err();
            assert_eq!(e.field, field, "{json}: {e}");
            assert!(e.to_string().contains(field));
        }
    }

    #[test]
    fn a_long_cluster_name_envoy_may_read_as_a_grpc_service_is_refused_for_the_grpc_api_only() {
        let long = "etcd-".repeat(26);
        let grpc = format!(r#"{{"store":{{"kind":"etcd","clusters":["etcd","{long}"]}}}}"#);
        let e = parse(&grpc).unwrap_err();
        assert_eq!(e.field, "store.clusters", "{e}");
        assert!(e.to_string().contains("shorter name"), "{e}");
        let json = format!(r#"{{"store":{{"kind":"etcd","cluster":"{long}","api":"json"}}}}"#);
        assert!(parse(&json).is_ok());
        // Short names are sent as a GrpcService: any bytes will do.
        assert!(parse(r#"{"store":{"kind":"etcd","clusters":["xa","etcd-east1"]}}"#).is_ok());
        let other = format!(r#"{{"store":{{"kind":"etcd","cluster":"{long}x"}}}}"#);
        assert!(parse(&other).is_ok());
    }

    #[test]
    fn rules_override_the_base_policy_and_the_first_match_wins() {
        let c = parse(
            r#"{"lease_ms":3000,
                "routes":[
                  {"match":{"prefix":"/payments","methods":["POST"]},"require_key":true},
                  {"match":{"path":"/search"},"enabled":false},
                  {"match":{"route_name":"orders"},"on_conflict":"wait","scope_jwt_claim":{"payload":"jwt","claim":"sub"}},
                  {"match":{"prefix":"/"},"forward":"router"}
                ]}"#,
        )
        .unwrap();
        let pick = |path: &str, method: &str, route: Option<&str>| {
            c.policy_for(path.as_bytes(), method.as_bytes(), route.map(str::as_bytes))
        };
        assert_eq!(pick("/payments/1?x=1", "POST", None), 1);
        assert!(c.policy(1).require_key);
        assert_eq!(c.policy(1).lease_ms, 3000, "rules inherit the base policy");
        assert_eq!(pick("/payments/1", "PATCH", None), 4, "method list restricts the rule");
        assert_eq!(pick("/search?q=a", "POST", None), 2);
        assert!(!c.policy(2).enabled);
        assert_eq!(pick("/search/more", "POST", None), 4, "path is exact");
        assert_eq!(pick("/orders", "POST", Some("orders")), 3);
        assert_eq!(c.policy(3).on_conflict, OnConflict::Wait);
        assert_eq!(c.policy(3).scope_jwt_claim, Some(JwtClaim { payload: "jwt".into(), claim: "sub".into() }));
        assert_eq!(c.policy(4).forward, Forward::Router);
        assert!(!c.policy(0).require_key);

        let no_rules = parse("{}").unwrap();
        assert_eq!(no_rules.policy_for(b"/x", b"POST", None), 0);
    }

    #[test]
    fn rule_errors_name_the_field() {
        let cases = [
            (r#"{"routes":{}}"#, "routes"),
            (r#"{"routes":[{"require_key":true}]}"#, "routes[0].match"),
            (r#"{"routes":[{"match":{"prefix":"/a","path":"/b"}}]}"#, "routes[0].match"),
            (r#"{"routes":[{"match":{"prefix":"a"}}]}"#, "routes[0].match.prefix"),
            (r#"{"routes":[{"match":{"regex":".*"}}]}"#, "routes[0].match.regex"),
            (r#"{"routes":[{"match":{"prefix":"/"}},{"match":{"prefix":"/"},"lease_ms":-1}]}"#, "routes[1].lease_ms"),
            (r#"{"routes":[{"match":{"prefix":"/"},"capacity":5}]}"#, "routes[0].capacity"),
            (r#"{"scope_jwt_claim":{"payload":"jwt"}}"#, "scope_jwt_claim.claim"),
        ];
        for (json, field) in cases {
            let e = parse(json).unwrap_err();
            assert_eq!(e.field, field, "{json}: {e}");
        }
    }

    #[test]
    fn etcd_store() {
        let c = parse(r#"{"store":{"kind":"etcd","cluster":"etcd_cluster","on_unavailable":"pass"}}"#).unwrap();
        assert_eq!(
            c.store,
            StoreConfig::Etcd(EtcdConfig {
                clusters: vec!["etcd_cluster".into()],
                authority: None,
                api: Api::Grpc,
                api_fallback: true,
                timeout_ms: 1000,
                on_unavailable: OnUnavailable::Pass,
                local_replays: true,
                write_budget_bytes: DEFAULT_WRITE_BUDGET_BYTES,
            })
        );
        assert_eq!(parse(r#"{"stat_prefix":"pay_v2"}"#).unwrap().stat_prefix.as_deref(), Some("pay_v2"));
        assert_eq!(parse("{}").unwrap().stat_prefix, None);
        for bad in [r#"{"stat_prefix":""}"#, r#"{"stat_prefix":"Pay"}"#, r#"{"stat_prefix":"a.b"}"#] {
            assert!(parse(bad).unwrap_err().to_string().contains("stat_prefix"), "{bad}");
        }
        let off = parse(r#"{"store":{"kind":"etcd","cluster":"e","write_budget_bytes":0}}"#).unwrap();
        let StoreConfig::Etcd(e) = off.store else { panic!("etcd") };
        assert_eq!(e.write_budget_bytes, 0);
        let err = parse(r#"{"store":{"kind":"etcd","cluster":"e","write_budget_bytes":-1}}"#).unwrap_err();
        assert!(err.to_string().contains("store.write_budget_bytes"), "{err}");
        let c = parse(r#"{"store":{"kind":"etcd","clusters":["a","b"],"api":"json"}}"#).unwrap();
        let StoreConfig::Etcd(e) = c.store else { panic!("etcd") };
        assert_eq!((e.clusters, e.api), (vec!["a".to_string(), "b".to_string()], Api::Json));
        let json = parse(r#"{"store":{"kind":"etcd","cluster":"e","api":"json","authority":"etcd.local"}}"#).unwrap();
        let StoreConfig::Etcd(e) = json.store else { panic!("etcd") };
        assert_eq!(e.authority.as_deref(), Some("etcd.local"));
    }

    #[test]
    fn values_that_could_lock_a_key_or_break_a_bound_are_refused() {
        let cases = [
            // A response that could never fit its bucket's share of the byte budget given.
            (r#"{"max_store_bytes":134217728,"max_response_bytes":200000}"#, "max_response_bytes"),
            (r#"{"capacity":64,"max_store_bytes":1000,"max_response_bytes":1001}"#, "max_response_bytes"),
            (
                r#"{"max_store_bytes":134217728,"routes":[{"match":{"prefix":"/"},"max_response_bytes":1048576}]}"#,
                "routes[0].max_response_bytes",
            ),
            (r#"{"missing_scope":"allow"}"#, "missing_scope"),
        ];
        for (json, field) in cases {
            let e = parse(json).unwrap_err();
            assert_eq!(e.field, field, "{json}: {e}");
        }
        let e = parse(r#"{"max_store_bytes":134217728,"max_response_bytes":200000}"#).unwrap_err();
        assert!(e.reason.contains("max_store_bytes") && e.reason.contains("capacity"), "{e}");
    }

    /// Every configuration the project shipped or documented (`tests/config_corpus/`, see its
    /// INDEX.md) loads, except those written to be refused (`REFUSED`: each with the field its
    /// refusal names).
    #[test]
    fn every_configuration_of_the_corpus_loads() {
        // Under the WASI runner the repository is the current directory.
        let root = if cfg!(target_family = "wasm") { "." } else { env!("CARGO_MANIFEST_DIR") };
        let dir = std::path::Path::new(root).join("tests/config_corpus");
        let refused = std::fs::read_to_string(dir.join("REFUSED")).unwrap();
        let refused: Vec<(&str, &str)> = refused
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .filter_map(|l| l.split_once(' '))
            .collect();
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "json"))
            .collect();
        files.sort();
        assert!(files.len() >= 45, "{} configurations", files.len());
        let mut failures = Vec::new();
        for path in &files {
            let name = path.file_name().unwrap().to_str().unwrap();
            let parsed = Config::parse(&std::fs::read(path).unwrap());
            match (refused.iter().find(|(f, _)| *f == name), parsed) {
                (None, Ok(_)) => {}
                (None, Err(e)) => failures.push(format!("{name}: {e}")),
                (Some((_, field)), Err(e)) if e.field == *field => {}
                (Some((_, field)), other) => {
                    failures.push(format!("{name}: expected a refusal of {field}, got {other:?}"))
                }
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    /// Two configurations an earlier release documented, which 0.1.0 refused (issue: Envoy
    /// with FAIL_CLOSED then exits at startup): they load, with what they now mean told once.
    #[test]
    fn earlier_releases_configurations_load_with_a_notice() {
        let c = parse(r#"{"capacity":20000,"max_response_bytes":1048576}"#).unwrap();
        // 313 buckets, each with room for one answer of 1 MiB.
        assert_eq!(c.max_store_bytes, 313 << 20);
        assert_eq!(c.policy.max_response_bytes, 1 << 20);
        assert!(c.notices.len() == 1 && c.notices[0].contains("derived 328204288"), "{:?}", c.notices);
        let c = parse(r#"{"routes":[{"match":{"prefix":"/"},"max_response_bytes":1048576}]}"#).unwrap();
        assert_eq!(c.max_store_bytes, 1024 << 20);
        // What the default budget already holds derives nothing.
        assert!(parse(r#"{"max_response_bytes":100000}"#).unwrap().notices.is_empty());
        let first_fleet = r#"{"store":{"kind":"etcd","cluster":"etcd","authority":"127.0.0.1:2379",
            "timeout_ms":500,"on_unavailable":"reject"}}"#;
        let c = parse(first_fleet).unwrap();
        let StoreConfig::Etcd(e) = &c.store else { panic!("etcd") };
        assert_eq!((e.api, e.authority.as_deref()), (Api::Json, Some("127.0.0.1:2379")));
        assert!(c.notices.len() == 1 && c.notices[0].contains("\"api\": \"json\""), "{:?}", c.notices);
        assert!(parse(r#"{"store":{"kind":"etcd","cluster":"e"}}"#).unwrap().notices.is_empty());
        // Leases an earlier release took are raised to what holds now: 100 ms was the first
        // minimum, 3 s with etcd came later, and three store timeouts later still.
        for (json, at, lease) in [
            (r#"{"forward":"router","lease_ms":500}"#, "lease_ms", 1_000),
            (r#"{"lease_ms":2000,"store":{"kind":"etcd","cluster":"etcd"}}"#, "lease_ms", 3_000),
            (r#"{"lease_ms":3000,"store":{"kind":"etcd","cluster":"e","timeout_ms":1500}}"#, "lease_ms", 4_500),
            (
                r#"{"store":{"kind":"etcd","cluster":"e","timeout_ms":2000},"routes":[{"match":{"prefix":"/"},"lease_ms":5000}]}"#,
                "routes[0].lease_ms",
                6_000,
            ),
        ] {
            let c = parse(json).unwrap();
            assert_eq!(c.policies().map(|p| p.lease_ms).min(), Some(lease), "{json}");
            assert!(c.notices.len() == 1 && c.notices[0].starts_with(&format!("{at} ")), "{json}: {:?}", c.notices);
        }
        assert_eq!(parse(r#"{"lease_ms":99}"#).unwrap_err().field, "lease_ms", "below the first minimum");
        // No timeout, and an answer larger than etcd takes: bounded, and said.
        let c = parse(r#"{"upstream_timeout_ms":0}"#).unwrap();
        assert_eq!((c.policy.upstream_timeout_ms, c.notices.len()), (MAX_MS, 1));
        let c = parse(r#"{"store":{"kind":"etcd","cluster":"e"},"max_response_bytes":2000000}"#).unwrap();
        assert_eq!((c.policy.max_response_bytes, c.notices.len()), (1 << 20, 1));
    }

    #[test]
    fn max_response_bytes_defaults_to_what_one_bucket_holds() {
        assert_eq!(parse("{}").unwrap(), Config::default());
        assert_eq!(Config::default().policy.max_response_bytes, 128 << 10);
        // 64 buckets of 2 MiB: the default is capped at 1 MiB.
        let c = parse(r#"{"capacity":4096,"max_store_bytes":134217728}"#).unwrap();
        assert_eq!(c.policy.max_response_bytes, 1 << 20);
        let c = parse(r#"{"capacity":1024,"max_store_bytes":2097152,"routes":[{"match":{"prefix":"/"}}]}"#).unwrap();
        assert_eq!((c.policy.max_response_bytes, c.policy(1).max_response_bytes), (131072, 131072));
        let etcd = parse(r#"{"store":{"kind":"etcd","cluster":"e"}}"#).unwrap();
        assert_eq!(etcd.policy.max_response_bytes, 1 << 20);
    }

    #[test]
    fn missing_scope_choices() {
        assert_eq!(Config::default().policy.missing_scope, MissingScope::Pass);
        for (json, want) in
            [("pass", MissingScope::Pass), ("reject", MissingScope::Reject), ("share", MissingScope::Share)]
        {
            let c = parse(&format!(r#"{{"missing_scope":"{json}"}}"#)).unwrap();
            assert_eq!(c.policy.missing_scope, want);
        }
    }

    #[test]
    fn non_objects_are_refused() {
        assert!(parse("[]").is_err());
        assert!(parse("{").is_err());
        assert!(parse("\"x\"").is_err());
    }

    /// What configure tells (a warning and `config_detached_unrouted`): the policies whose
    /// detached calls skip the route's behaviour; router, observe and disabled ones do not.
    #[test]
    fn policies_detached_without_a_route_are_counted() {
        assert_eq!(parse("{}").unwrap().detached_unrouted(), 1);
        assert_eq!(parse(r#"{"detached_via":"inner"}"#).unwrap().detached_unrouted(), 0);
        assert_eq!(parse(r#"{"forward":"router"}"#).unwrap().detached_unrouted(), 0);
        assert_eq!(parse(r#"{"mode":"observe"}"#).unwrap().detached_unrouted(), 0);
        let c = parse(
            r#"{"detached_via":"inner","routes":[
                {"match":{"prefix":"/a"},"forward":"router"},
                {"match":{"prefix":"/b"},"enabled":false}]}"#,
        )
        .unwrap();
        assert_eq!((c.detached_unrouted(), c.policy(1).detached_via.as_deref()), (0, Some("inner")));
        let c = parse(r#"{"forward":"router","routes":[{"match":{"prefix":"/a"},"forward":"detached"}]}"#).unwrap();
        assert_eq!(c.detached_unrouted(), 1);
    }
}
