//! A deterministic simulator of the whole lifecycle (tests only). One seed drives everything:
//! several Envoys, each with worker VMs running the real [`Lifecycle`](crate::lifecycle) over
//! the real stores, a model of Envoy's shared data per Envoy (docs/behaviour.md §4 semantics), an etcd model
//! per cluster behind a network that delays, drops and stalls, an upstream that answers,
//! fails, resets and hangs, and clients that retry and leave at any moment. Invariants are
//! checked at every step ([`check`]); a violation names its invariant, the seed and the trace.
//!
//! `make sim SEED=… COMBO=…` replays one seed with its trace; `make sim-long` runs seeds for a
//! while; `cargo test --lib sim::` runs the whole matrix with a fixed number of seeds each.

mod check;
mod history;
mod net;
mod oracle;
mod tap;
mod world;

#[cfg(test)]
mod tests;

use crate::config::Forward;

/// Where the entries live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    SharedData,
    /// etcd: `clusters` clusters (keys spread over them), with or without local copies.
    Etcd {
        clusters: usize,
        local_replays: bool,
    },
}

/// What the clients speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Http1,
    /// HTTP/2 with answers that end with trailers.
    Http2,
    /// gRPC: results with messages cannot be replayed by a local reply.
    Grpc,
    /// gRPC with the replay loopback (`grpc_replays: "loopback"`).
    GrpcLoopback,
}

/// One point of the configuration space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Combo {
    pub store: StoreKind,
    pub forward: Forward,
    pub wait: bool,
    pub protocol: Protocol,
    /// `on_unavailable: "pass"` (etcd only).
    pub pass: bool,
    pub fencing: bool,
}

impl Combo {
    /// Every combination the matrix runs.
    pub fn all() -> Vec<Combo> {
        let stores = [
            StoreKind::SharedData,
            StoreKind::Etcd { clusters: 1, local_replays: false },
            StoreKind::Etcd { clusters: 1, local_replays: true },
            StoreKind::Etcd { clusters: 2, local_replays: true },
        ];
        let mut all = Vec::new();
        for store in stores {
            let passes: &[bool] = if store == StoreKind::SharedData { &[false] } else { &[false, true] };
            for &pass in passes {
                for forward in [Forward::Detached, Forward::Router] {
                    for wait in [false, true] {
                        for protocol in [Protocol::Http1, Protocol::Http2, Protocol::Grpc, Protocol::GrpcLoopback] {
                            for fencing in [false, true] {
                                all.push(Combo { store, forward, wait, protocol, pass, fencing });
                            }
                        }
                    }
                }
            }
        }
        all
    }

    /// A short name: `etcd2+local/router/wait/grpc-loopback/pass/fence`.
    pub fn name(&self) -> String {
        let store = match self.store {
            StoreKind::SharedData => "shared".to_string(),
            StoreKind::Etcd { clusters, local_replays } => {
                format!("etcd{clusters}{}", if local_replays { "+local" } else { "" })
            }
        };
        let forward = if self.forward == Forward::Router { "router" } else { "detached" };
        let conflict = if self.wait { "wait" } else { "reject" };
        let protocol = match self.protocol {
            Protocol::Http1 => "http1",
            Protocol::Http2 => "http2",
            Protocol::Grpc => "grpc",
            Protocol::GrpcLoopback => "grpc-loopback",
        };
        let pass = if self.pass { "pass" } else { "reject503" };
        let fence = if self.fencing { "fence" } else { "nofence" };
        format!("{store}/{forward}/{conflict}/{protocol}/{pass}/{fence}")
    }

    /// The combination a name stands for.
    pub fn parse(name: &str) -> Option<Combo> {
        Combo::all().into_iter().find(|c| c.name() == name)
    }

    pub fn is_etcd(&self) -> bool {
        matches!(self.store, StoreKind::Etcd { .. })
    }

    pub fn is_grpc(&self) -> bool {
        matches!(self.protocol, Protocol::Grpc | Protocol::GrpcLoopback)
    }

    /// The plugin's configuration for this combination: short leases and waits, so that
    /// expiry, renewal and `wait_max_ms` happen within a run; `etcd_timeout_ms` is drawn per seed.
    pub fn config_json(&self, etcd_timeout_ms: u64) -> String {
        let mut fields = vec![
            format!("\"lease_ms\":{}", LEASE_MS),
            "\"retention_s\":3600".to_string(),
            // A small table: each VM's first configuration creates or reads every bucket.
            "\"capacity\":256".to_string(),
            format!("\"wait_max_ms\":{}", WAIT_MAX_MS),
            "\"retry_after_s\":1".to_string(),
            format!("\"upstream_timeout_ms\":{}", UPSTREAM_TIMEOUT_MS),
            format!("\"max_response_bytes\":{}", MAX_RESPONSE_BYTES),
            format!("\"on_conflict\":\"{}\"", if self.wait { "wait" } else { "reject" }),
            format!("\"forward\":\"{}\"", if self.forward == Forward::Router { "router" } else { "detached" }),
            // Detached calls travel through the route's internal listener (docs/deployment.md):
            // one more hop, modelled by the world (`World::hop`).
            format!("\"detached_via\":\"{HOP_CLUSTER}\""),
        ];
        if self.fencing {
            fields.push(format!("\"fencing_header\":\"{FENCE_HEADER}\""));
        }
        if self.protocol == Protocol::GrpcLoopback {
            fields.push("\"grpc_replays\":\"loopback\"".to_string());
        }
        if let StoreKind::Etcd { clusters, local_replays } = self.store {
            let names: Vec<String> = (0..clusters).map(|i| format!("\"etcd{i}\"")).collect();
            fields.push(format!(
                "\"store\":{{\"kind\":\"etcd\",\"clusters\":[{}],\"timeout_ms\":{},\"write_budget_bytes\":{},\"on_unavailable\":\"{}\",\"local_replays\":{}}}",
                names.join(","),
                etcd_timeout_ms,
                WRITE_BUDGET_BYTES,
                if self.pass { "pass" } else { "reject" },
                local_replays
            ));
        }
        format!("{{{}}}", fields.join(","))
    }
}

pub const LEASE_MS: u64 = 3_000;
pub const WAIT_MAX_MS: u64 = 1_500;
pub const UPSTREAM_TIMEOUT_MS: u64 = 6_000;
/// The cluster of the internal listener detached calls go through (`detached_via`).
pub const HOP_CLUSTER: &str = "idem_internal";
pub const MAX_RESPONSE_BYTES: usize = 2_048;
/// Small enough that a run's busiest caller meets it now and then: the 429 path runs too.
pub const WRITE_BUDGET_BYTES: u64 = 1_500;
pub const FENCE_HEADER: &str = "x-fence";

/// What one run found.
#[derive(Debug, Default)]
pub struct Report {
    pub requests: usize,
    pub effects: usize,
    pub events: usize,
    /// What the etcd clusters handled: reads (Range), transactions, and raft proposals (lease
    /// grants and transactions that write in either branch).
    pub etcd: EtcdCalls,
    pub violations: Vec<check::Violation>,
    /// How often each of the oracle's excuses for a second effect of a key was used.
    pub excuses: std::collections::BTreeMap<&'static str, usize>,
    /// The run's trace, when asked for.
    pub trace: Vec<String>,
}

/// Requests the etcd clusters of a run handled.
#[derive(Debug, Default, Clone, Copy)]
pub struct EtcdCalls {
    pub reads: usize,
    pub txns: usize,
    pub proposals: usize,
}

impl std::ops::AddAssign for EtcdCalls {
    fn add_assign(&mut self, other: EtcdCalls) {
        self.reads += other.reads;
        self.txns += other.txns;
        self.proposals += other.proposals;
    }
}

impl std::fmt::Display for EtcdCalls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "etcd {} reads, {} txns, {} proposals", self.reads, self.txns, self.proposals)
    }
}

/// Runs one seed of one combination.
pub fn run(seed: u64, combo: Combo, trace: bool) -> Report {
    world::World::new(seed, combo, trace).run()
}
