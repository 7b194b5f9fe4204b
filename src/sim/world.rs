//! The simulated world: Envoys and their VMs, the etcd clusters behind their network, the
//! upstream, the clients; one event at a time, in virtual time, with the effects carried out
//! as the plugin's adapter does (`src/plugin/vm.rs`). It records what its models saw (the
//! upstream's calls, each client's answers, the stores' history, the faults); `oracle.rs`
//! judges from that record alone.

use std::collections::BTreeMap;
use std::rc::Rc;

use super::check::Checker;
use super::history::{bucket_entry, Claim, History, KeyId, Locator, Mark};
use super::net::{Faults, Queue, Rng, Trouble, Window};
use super::{Combo, Protocol, Report, StoreKind, FENCE_HEADER, LEASE_MS, MAX_RESPONSE_BYTES};
use crate::assemble::AnyLifecycle;
use crate::config::Config;
use crate::encoding::decode_entry;
use crate::host::memory::MemoryKv;
use crate::host::{Flow, Headers};
use crate::lifecycle::{CallId, Effect, Reply};
use crate::store::etcd::model::Model;
use crate::store::{CallAnswer, CallKind, CallRequest};
use crate::test_host::TestHost as SimHost;

const ENVOYS_ETCD: usize = 2;
const WORKERS: usize = 2;
pub(super) const SCOPES: u64 = 2;
pub(super) const KEYS: u64 = 3;
const CLIENTS: u64 = 10;
/// At most this many more clients, each under an identity of its own made up for one request
/// (scopes from `SCOPES` on): what a hostile client does to fair share and the budgets.
const INVENTED: u64 = 6;
/// Traffic starts within this; faults fall within it too.
const HORIZON_MS: u64 = 8_000;
/// After the last client is done: leases expire, retries land, roots settle.
const DRAIN_MS: u64 = 3 * LEASE_MS + 6_000;
const HARD_END_MS: u64 = 180_000;
/// Where the Envoys' clocks start (true time starts at 0).
pub(super) const CLOCK_BASE_MS: u64 = 1_000_000;
/// After the drain, how long the VMs may take to be idle at one moment.
const SETTLE_MS: u64 = 10_000;
/// A client that stays has its answer within this (plus the time its VM did not run).
const ANSWER_BOUND_MS: u64 = 20_000;
const FORGED_FENCE: &str = "99999999";

pub(super) enum Ev {
    Send {
        client: usize,
    },
    /// A request reaches its VM (late, when its Envoy was paused or its worker stalled).
    Deliver {
        req: usize,
    },
    Leave {
        req: usize,
    },
    StreamDone {
        req: usize,
    },
    Tick {
        vm: usize,
    },
    Wake {
        vm: usize,
    },
    EtcdArrive {
        cluster: usize,
        vm: usize,
        call: u64,
        request: CallRequest,
    },
    EtcdAnswer {
        vm: usize,
        call: u64,
        answer: CallAnswer,
    },
    UpstreamArrive {
        flight: usize,
    },
    UpstreamAnswer {
        flight: usize,
    },
    /// The plugin's configuration is updated: each VM of this Envoy gets a new root for new
    /// streams; the old root finishes what it has in flight, then ends.
    ConfigUpdate {
        envoy: usize,
    },
}

impl Ev {
    /// Where an event runs: its Envoy, and its VM (a paused Envoy or a stalled VM runs none).
    fn runs_in(&self, w: &World) -> Option<(usize, Option<usize>)> {
        let vm = match self {
            Ev::Send { .. } | Ev::EtcdArrive { .. } | Ev::UpstreamArrive { .. } => return None,
            Ev::ConfigUpdate { envoy } => return Some((*envoy, None)),
            Ev::Deliver { req } | Ev::Leave { req } | Ev::StreamDone { req } => w.reqs.get(*req)?.vm,
            Ev::Tick { vm } | Ev::Wake { vm } | Ev::EtcdAnswer { vm, .. } => *vm,
            Ev::UpstreamAnswer { flight } => w.flights.get(*flight)?.vm,
        };
        w.vms.get(vm).map(|v| (v.envoy, Some(vm)))
    }
}

pub(super) struct Vm {
    pub envoy: usize,
    lifecycle: AnyLifecycle,
    /// What its store told each stream (the tap).
    told: super::tap::Told,
    next_id: u32,
    tick_ms: u64,
    /// Replaced by a configuration update: takes no new streams, ends once idle.
    draining: bool,
    /// Ended (`proxy_done`): its timer and queue are gone.
    finished: bool,
}

impl Vm {
    pub fn lifecycle_tick_ms(&self) -> u64 {
        self.tick_ms
    }
}

struct Client {
    key: KeyId,
    variant: u64,
    attempts_left: u64,
}

/// What a client got.
#[derive(Debug, Clone)]
pub(super) struct Got {
    pub status: u16,
    pub grpc: Option<u32>,
    pub body: Vec<u8>,
    pub replayed: bool,
    /// The plugin's own problem, by its slug.
    pub problem: Option<&'static str>,
}

#[derive(PartialEq, Eq)]
pub(super) enum ReqState {
    Waiting,
    Answered,
    Left,
}

pub(super) struct Req {
    client: usize,
    pub key: KeyId,
    /// Which body the client sends (its fingerprint).
    pub variant: u64,
    pub vm: usize,
    id: u32,
    pub sent: u64,
    /// When its VM had the whole request (`None`: not yet), and in which event.
    pub body_at: Option<u64>,
    pub body_seq: usize,
    pub state: ReqState,
    /// When the client had its whole answer (`got`).
    pub answered_at: Option<u64>,
    open: bool,
    request_paused: bool,
    response_paused: Option<Response>,
    /// The request as it goes on through the router (the plugin's header edits applied).
    headers: Headers,
    /// gRPC loopback edits of the response.
    set_headers: Option<Headers>,
    set_body: Option<(Vec<u8>, Headers)>,
    flight: Option<usize>,
    /// The decision its filter state records (`Effect::Record`).
    record: Option<String>,
    /// Its store told it its key was in progress or done (the tap).
    pub knew: bool,
}

#[derive(Debug, Clone, Default)]
pub(super) struct Response {
    pub status: u16,
    pub headers: Headers,
    pub body: Vec<u8>,
    pub trailers: Headers,
    /// Envoy's own answer (connect failure, reset, timeout), not the upstream's.
    from_envoy: Option<&'static str>,
    /// The connection broke after the headers: no end.
    broken: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FlightState {
    Running,
    /// Router: the client left; Envoy reset the call; its outcome is unknown.
    Orphaned,
    Done {
        storable: bool,
    },
    /// The upstream refused a stale fencing token: no effect.
    Fenced,
}

pub(super) struct Flight {
    pub req: usize,
    pub key: KeyId,
    pub variant: u64,
    pub vm: usize,
    /// `Some(n)`: a detached call (`CallId::Upstream(n)`); `None`: the router's, on the
    /// request's stream.
    pub call: Option<crate::lifecycle::WorkId>,
    pub loopback: bool,
    /// The claim its VM made for it and learnt it made, by the store's history (it may have
    /// been taken over since: a late owner's call).
    pub claim: Option<Claim>,
    pub fence: Option<u64>,
    /// When it left Envoy.
    pub sent: u64,
    /// It reached the upstream, which did its work.
    pub effect: bool,
    /// Judged as an effect the plugin knew nothing of (`on_unavailable: "pass"`).
    pub unprotected: bool,
    pub state: FlightState,
    pub answer: Response,
    /// Whether the upstream's answer completes the key (not released, not Envoy's own).
    pub storable: bool,
    latency: u64,
    /// When its answer reached the VM that sent it.
    pub answered_at: Option<u64>,
}

/// An etcd call in flight, as the network saw it.
pub(super) struct StoreCall {
    delivered: bool,
    pub cluster: usize,
    pub sent: u64,
    timeout_at: u64,
    /// A grant of the VM's lease.
    grant: bool,
}

/// How a store call of a VM ended.
pub(super) struct StoreOutcome {
    pub vm: usize,
    pub cluster: usize,
    pub sent: u64,
    pub ended: u64,
    /// The event it ended in (the order within one millisecond).
    pub seq: usize,
    /// A lease grant.
    pub grant: bool,
    pub ok: bool,
}

pub struct World {
    pub(super) combo: Combo,
    config: String,
    rng: Rng,
    /// The internal listener's hop of detached calls, drawn apart (so that a seed's other
    /// draws do not depend on it): per mille of calls it fails before the upstream got them
    /// (the inner router's own 503), and after (the route's timeout: a 504 from the hop
    /// while the upstream works on).
    hop: Rng,
    hop_fail: (u64, u64),
    queue: Queue<Ev>,
    pub(super) now: u64,
    skews: Vec<u64>,
    kvs: Vec<Rc<MemoryKv>>,
    pub(super) vms: Vec<Vm>,
    /// Per Envoy, the VMs (roots) that take new streams.
    active: Vec<Vec<usize>>,
    etcd: Vec<Model>,
    pub(super) faults: Faults,
    clients: Vec<Client>,
    pub(super) reqs: Vec<Req>,
    streams: BTreeMap<(usize, u32), usize>,
    pub(super) flights: Vec<Flight>,
    pub(super) store_calls: BTreeMap<(usize, u64), StoreCall>,
    /// Every store call that ended (answered, timed out, refused at dispatch).
    pub(super) store_log: Vec<StoreOutcome>,
    /// Detached calls Envoy refused to dispatch: VM, key, when.
    pub(super) refused_upstream: Vec<(usize, KeyId, u64)>,
    /// etcd calls sent while a cluster failed (down, stopped, leaderless, hung), by cluster.
    calls_in_trouble: Vec<u64>,
    pub(super) history: History,
    /// etcd: the cluster each key lives on, once seen.
    pub(super) key_cluster: BTreeMap<KeyId, usize>,
    fence_max: BTreeMap<KeyId, u64>,
    pub(super) grace_ms: u64,
    end_ms: Option<u64>,
    pub(super) check: Checker,
    trace: Option<Vec<String>>,
    events: usize,
    /// The VM whose event runs now (the shared-data writes are its).
    running_vm: Option<usize>,

    pub(super) excuses: BTreeMap<&'static str, usize>,
}

impl World {
    pub fn new(seed: u64, combo: Combo, trace: bool) -> World {
        let mut rng = Rng::new(seed);
        let clusters = match combo.store {
            StoreKind::SharedData => 0,
            StoreKind::Etcd { clusters, .. } => clusters,
        };
        let envoys = if combo.is_etcd() { ENVOYS_ETCD } else { 1 };
        let faults = Faults::draw(&mut rng, clusters, envoys, envoys * WORKERS, HORIZON_MS, LEASE_MS);
        let config = combo.config_json(faults.etcd_timeout_ms);
        let kvs: Vec<Rc<MemoryKv>> = (0..envoys).map(|_| Rc::new(MemoryKv::journaled())).collect();
        let skews = (0..envoys).map(|_| rng.range(0, 40)).collect();
        let grace_ms =
            if combo.is_etcd() { 2 * faults.etcd_timeout_ms + 2 * faults.etcd_latency_max + 300 } else { 200 };
        let history = History::new(Self::locators(&combo));
        // Where each key lives: the cluster the plugin's placement picks (store/etcd/shards.rs).
        let key_cluster = history
            .locators()
            .iter()
            .map(|(key, _)| {
                let seeds = (0..clusters).map(|i| crate::store::etcd::shards::seed_of(&format!("etcd{i}")));
                (*key, crate::store::etcd::shards::shard_of(seeds, &Self::store_key(*key)))
            })
            .collect();
        let mut w = World {
            combo,
            config,
            rng,
            hop: Rng::new(0),
            hop_fail: (0, 0),
            queue: Queue::new(),
            now: 0,
            skews,
            kvs,
            vms: Vec::new(),
            active: vec![Vec::new(); envoys],
            etcd: (0..clusters).map(|_| Model::new()).collect(),
            faults,
            clients: Vec::new(),
            reqs: Vec::new(),
            streams: BTreeMap::new(),
            flights: Vec::new(),
            store_calls: BTreeMap::new(),
            store_log: Vec::new(),
            refused_upstream: Vec::new(),
            calls_in_trouble: vec![0; clusters],
            history,
            key_cluster,
            fence_max: BTreeMap::new(),
            grace_ms,
            end_ms: None,
            check: Checker::default(),
            trace: trace.then(Vec::new),
            events: 0,
            running_vm: None,
            excuses: BTreeMap::new(),
        };
        for envoy in 0..envoys {
            for _ in 0..WORKERS {
                w.add_vm(envoy);
            }
        }
        for c in 0..CLIENTS {
            let key = (w.rng.range(0, SCOPES - 1), w.rng.range(0, KEYS - 1));
            let variant = u64::from(w.rng.chance(80));
            let attempts_left = w.rng.range(1, 4);
            w.clients.push(Client { key, variant, attempts_left });
            let at = w.rng.range(0, HORIZON_MS / 2);
            w.queue.push(at, Ev::Send { client: c as usize });
        }
        // Invented identities, drawn apart like the hop: in a third of the runs, 2 to INVENTED
        // clients, each a new caller sending one request of a key of its own.
        let mut invent = Rng::new(seed ^ 0x1DE7_1717);
        if invent.chance(333) {
            for n in 0..invent.range(2, INVENTED) {
                let c = w.clients.len();
                let key = (SCOPES + n, invent.range(0, KEYS - 1));
                w.clients.push(Client { key, variant: 0, attempts_left: 1 });
                w.queue.push(invent.range(0, HORIZON_MS / 2), Ev::Send { client: c });
            }
        }
        let mut hop = Rng::new(seed ^ 0x0B0F_4A11);
        if hop.chance(300) {
            w.hop_fail = (hop.range(5, 60), hop.range(5, 60));
        }
        w.hop = hop;
        // Drawn apart, so that the rest of a seed's run does not depend on it.
        let mut update = Rng::new(seed ^ 0xC0F1_6A7E);
        if update.chance(300) {
            let envoy = update.range(0, envoys as u64 - 1) as usize;
            w.queue.push(update.range(500, HORIZON_MS), Ev::ConfigUpdate { envoy });
        }
        w
    }

    /// Where each simulated key lives in the stores, as the plugin names it (its store key
    /// from the request's `:authority`, scope and key).
    fn locators(combo: &Combo) -> Vec<(KeyId, Locator)> {
        let config = Config::parse(combo.config_json(500).as_bytes()).ok();
        let layout = config.map(|c| crate::store::table::Layout::new(&c.namespace, c.capacity, c.max_store_bytes));
        let mut out = Vec::new();
        for scope in 0..SCOPES + INVENTED {
            for key in 0..KEYS {
                let store_key = Self::store_key((scope, key));
                let locator = match (combo.is_etcd(), &layout) {
                    (true, _) => Locator::Etcd { name: crate::store::etcd::protocol::key_name("idem", &store_key.0) },
                    (false, Some(layout)) => {
                        let (bucket, tag) = layout.locate(&store_key);
                        Locator::Bucket { name: layout.bucket_key(bucket), tag }
                    }
                    (false, None) => continue,
                };
                out.push(((scope, key), locator));
            }
        }
        out
    }

    /// A simulated key's store key, as the plugin derives it from the request's `:authority`,
    /// scope and key.
    fn store_key((scope, key): KeyId) -> crate::key::StoreKey {
        let authorization = format!("Bearer s{scope}");
        crate::key::StoreKey::derive("idem", b"api", &[Some(authorization.as_bytes())], format!("k{key}").as_bytes())
    }

    fn add_vm(&mut self, envoy: usize) {
        let config = match Config::parse(self.config.as_bytes()) {
            Ok(c) => c,
            Err(e) => panic!("the simulator's configuration {} does not load: {e}", self.config),
        };
        let kv = self.kvs[envoy].clone();
        let rng = &mut self.rng;
        let told = super::tap::Told::default();
        let tap = |inner| Box::new(super::tap::Tap { inner, told: told.clone() }) as Box<dyn crate::store::Store>;
        let lifecycle = match crate::assemble::lifecycle_wrapped(config, kv, &mut || rng.next(), tap) {
            Ok(l) => l,
            Err(e) => panic!("lifecycle: {e}"),
        };
        let tick_ms = lifecycle.tick_ms();
        let vm = self.vms.len();
        let first_tick = self.rng.range(1, tick_ms);
        self.vms.push(Vm { envoy, lifecycle, told, next_id: 2, tick_ms, draining: false, finished: false });
        self.active[envoy].push(vm);
        if self.faults.stalls.len() <= vm {
            self.faults.stalls.resize(vm + 1, Vec::new());
        }

        self.queue.push(first_tick, Ev::Tick { vm });
    }

    pub(super) fn log(&mut self, line: impl FnOnce() -> String) {
        if let Some(trace) = &mut self.trace {
            trace.push(format!("{:>7} {}", self.now, line()));
        }
    }

    /// The clock of Envoy `envoy` at true time `at`: skewed, and stepped as the seed drew. It
    /// starts at `CLOCK_BASE_MS` so that a step back never goes below zero.
    pub(super) fn clock_of(&self, envoy: usize, at: u64) -> u64 {
        let stepped = (at + CLOCK_BASE_MS) as i64 + self.faults.stepped(envoy, at);
        stepped as u64 + self.skews[envoy]
    }

    /// The latest Envoy `envoy`'s clock read at any true time in `from..=to` (a step back
    /// within sets it back).
    pub(super) fn latest_clock(&self, envoy: usize, from: u64, to: u64) -> u64 {
        let steps = self.faults.steps.get(envoy).into_iter().flatten().map(|(at, _)| *at);
        let before_steps = steps.filter(|at| from < *at && *at <= to).map(|at| at - 1);
        before_steps.chain([from, to]).map(|t| self.clock_of(envoy, t)).max().unwrap_or(0)
    }

    fn clock(&self, vm: usize) -> u64 {
        self.clock_of(self.vms[vm].envoy, self.now)
    }

    /// The first true time at which Envoy `envoy`'s clock reads `value` or more.
    pub(super) fn true_time(&self, envoy: usize, value: u64) -> u64 {
        let mut bounds: Vec<u64> = vec![0];
        bounds.extend(self.faults.steps.get(envoy).into_iter().flatten().map(|(at, _)| *at));
        bounds.sort_unstable();
        for (i, from) in bounds.iter().enumerate() {
            let to = bounds.get(i + 1).copied().unwrap_or(u64::MAX);
            let offset = CLOCK_BASE_MS as i64 + self.skews[envoy] as i64 + self.faults.stepped(envoy, *from);
            let at = (value as i64 - offset).max(*from as i64) as u64;
            if at < to {
                return at;
            }
        }
        u64::MAX
    }

    pub fn run(mut self) -> Report {
        let (etcd, pauses) = (format!("{:?}", self.faults.etcd), format!("{:?}", self.faults.pauses));
        let (steps, stalls) = (format!("{:?}", self.faults.steps), format!("{:?}", self.faults.stalls));
        let (latency, lost) = (self.faults.etcd_latency_max, (self.faults.lose_before, self.faults.lose_after));
        let (timeout, refused, aim) = (self.faults.etcd_timeout_ms, self.faults.dispatch_fail, self.faults.aim);
        self.log(|| {
            format!(
                "faults: etcd {etcd}, timeout {timeout} ms, latency up to {latency} ms, lost per mille {lost:?}, dispatch refused per mille {refused}, aimed per mille {aim}, paused {pauses}, stalled {stalls}, clock steps {steps}"
            )
        });
        let mut same_instant = 0;
        while let Some((at, ev)) = self.queue.pop() {
            // After the drain, run on until every VM is back at its baseline at one moment
            // (an etcd store grants leases now and then), or give up after a while.
            let drained = self.end_ms.is_some_and(|end| at > end);
            if drained
                && (self.vms.iter().all(|v| v.lifecycle.residue().is_empty())
                    || self.end_ms.is_some_and(|end| at > end + SETTLE_MS))
            {
                break;
            }
            if at > HARD_END_MS {
                break;
            }
            same_instant = if at == self.now { same_instant + 1 } else { 0 };
            if same_instant > 100_000 {
                self.check.fail("livelock", at, "100,000 events at one instant".into());
                break;
            }
            self.now = at;
            if let Some((envoy, vm)) = ev.runs_in(&self) {
                let until = match vm {
                    Some(vm) => self.faults.halted_until(envoy, vm, at),
                    None => self.faults.paused_until(envoy, at),
                };
                if let Some(until) = until {
                    self.queue.push(until, ev);
                    continue;
                }
                self.running_vm = vm;
            }
            self.events += 1;
            self.step(ev);
            self.sync_shared_history();
            self.running_vm = None;
            if self.end_ms.is_none() && self.traffic_over() {
                self.end_ms = Some(self.now + DRAIN_MS);
            }
        }
        self.finish()
    }

    /// A replaced root ends once idle, as `plugin/root.rs` does (its timer and queue go).
    fn end_if_drained(&mut self, vm: usize) {
        if self.vms[vm].draining && !self.vms[vm].finished && self.vms[vm].lifecycle.is_idle() {
            self.vms[vm].finished = true;
            self.log(|| format!("vm {vm}'s old root ends"));
        }
    }

    fn traffic_over(&self) -> bool {
        self.clients.iter().all(|c| c.attempts_left == 0) && self.reqs.iter().all(|r| r.state != ReqState::Waiting)
    }

    fn step(&mut self, ev: Ev) {
        match ev {
            Ev::Send { client } => self.send(client),
            Ev::Deliver { req } => self.deliver(req),
            Ev::Leave { req } => self.leave(req),
            Ev::StreamDone { req } => self.stream_done(req),
            Ev::Tick { vm } => {
                if self.vms[vm].finished {
                    return;
                }
                let now = self.clock(vm);
                self.vms[vm].lifecycle.on_tick(now);
                self.carry_out(vm);
                self.end_if_drained(vm);
                let next = self.now + self.vms[vm].tick_ms + self.rng.range(0, 3);
                self.queue.push(next, Ev::Tick { vm });
            }
            Ev::Wake { vm } => {
                if self.vms[vm].finished {
                    return;
                }
                let now = self.clock(vm);
                self.vms[vm].lifecycle.on_wake(now);
                self.carry_out(vm);
                self.end_if_drained(vm);
            }
            Ev::ConfigUpdate { envoy } => {
                for vm in std::mem::take(&mut self.active[envoy]) {
                    self.log(|| format!("configuration update: vm {vm} drains"));
                    self.vms[vm].draining = true;
                    self.add_vm(envoy);
                    self.end_if_drained(vm);
                }
            }
            Ev::EtcdArrive { cluster, vm, call, request } => self.etcd_arrive(cluster, vm, call, request),
            Ev::EtcdAnswer { vm, call, answer } => self.etcd_deliver(vm, call, answer),
            Ev::UpstreamArrive { flight } => self.upstream_arrive(flight),
            Ev::UpstreamAnswer { flight } => self.upstream_answer(flight),
        }
    }

    // --- clients -------------------------------------------------------------------------

    /// A client sends a request: to a worker of an Envoy, which reads it when it runs.
    fn send(&mut self, client: usize) {
        let c = &mut self.clients[client];
        if c.attempts_left == 0 {
            return;
        }
        c.attempts_left -= 1;
        let (key, variant) = (c.key, c.variant);
        let envoys = self.kvs.len() as u64;
        let envoy = self.rng.range(0, envoys - 1) as usize;
        let roots = &self.active[envoy];
        let vm = roots[self.rng.range(0, roots.len() as u64 - 1) as usize];
        let id = self.vms[vm].next_id;
        self.vms[vm].next_id += 1;
        let r = self.reqs.len();
        let grpc = self.combo.is_grpc();
        let mut headers: Headers = vec![
            (":method".into(), b"POST".to_vec()),
            (":path".into(), if grpc { b"/pay.Payments/Pay".to_vec() } else { b"/pay".to_vec() }),
            (":authority".into(), b"api".to_vec()),
            ("authorization".into(), format!("Bearer s{}", key.0).into_bytes()),
            ("content-type".into(), if grpc { b"application/grpc".to_vec() } else { b"application/json".to_vec() }),
            ("idempotency-key".into(), format!("k{}", key.1).into_bytes()),
            ("x-sim-req".into(), r.to_string().into_bytes()),
        ];
        if self.rng.chance(200) {
            headers.push((FENCE_HEADER.into(), FORGED_FENCE.as_bytes().to_vec()));
        }
        self.reqs.push(Req {
            client,
            key,
            variant,
            vm,
            id,
            sent: self.now,
            body_at: None,
            body_seq: 0,
            state: ReqState::Waiting,
            answered_at: None,
            open: true,
            request_paused: false,
            response_paused: None,
            headers,
            set_headers: None,
            set_body: None,
            flight: None,
            record: None,
            knew: false,
        });
        self.streams.insert((vm, id), r);
        if self.rng.chance(250) {
            let at = self.now + self.rng.range(0, 2_500);
            self.queue.push(at, Ev::Leave { req: r });
        }
        self.log(|| format!("client {client} sends req {r} key {key:?} v{variant} to vm {vm} stream {id}"));
        match self.faults.halted_until(envoy, vm, self.now) {
            Some(until) => self.queue.push(until, Ev::Deliver { req: r }),
            None => {
                self.running_vm = Some(vm);
                self.deliver(r);
            }
        }
    }

    /// The request reaches its VM: headers, then the body.
    fn deliver(&mut self, r: usize) {
        if !self.reqs[r].open {
            return;
        }
        if self.vms[self.reqs[r].vm].draining {
            // Read after a configuration update: the new root takes it.
            let envoy = self.vms[self.reqs[r].vm].envoy;
            let roots = &self.active[envoy];
            let vm = roots[self.rng.range(0, roots.len() as u64 - 1) as usize];
            let id = self.vms[vm].next_id;
            self.vms[vm].next_id += 1;
            self.streams.remove(&(self.reqs[r].vm, self.reqs[r].id));
            self.streams.insert((vm, id), r);
            (self.reqs[r].vm, self.reqs[r].id) = (vm, id);
            self.running_vm = Some(vm);
        }
        let (vm, id) = (self.reqs[r].vm, self.reqs[r].id);
        self.reqs[r].body_at = Some(self.now);
        self.reqs[r].body_seq = self.events;

        let variant = self.reqs[r].variant;
        let body = format!("{{\"amount\":{}}}", 10 + variant).into_bytes();
        let host = SimHost { now: self.clock(vm), request: self.reqs[r].headers.clone(), body, ..SimHost::default() };
        let flow = self.vms[vm].lifecycle.on_request_headers(&host, id, false);
        self.carry_out(vm);
        if self.reqs[r].state != ReqState::Waiting || !self.reqs[r].open {
            return;
        }
        let flow = if flow == Flow::Pause || self.vms[vm].lifecycle.tracks(id) {
            let size = host.body.len();
            let flow = self.vms[vm].lifecycle.on_request_body(&host, id, size, true);
            self.carry_out(vm);
            flow
        } else {
            flow
        };
        if !self.reqs[r].open || self.reqs[r].state != ReqState::Waiting {
            return;
        }
        match flow {
            Flow::Continue => self.forward_by_router(r),
            Flow::Pause => self.reqs[r].request_paused = true,
        }
    }

    /// The client's answer is complete: check it, then maybe try again.
    fn got(&mut self, r: usize, got: Got) {
        if self.reqs[r].state != ReqState::Waiting {
            return;
        }
        self.reqs[r].state = ReqState::Answered;
        self.reqs[r].answered_at = Some(self.now);
        let key = self.reqs[r].key;
        self.log(|| {
            format!(
                "req {r} gets {} grpc {:?} {}{}: {}",
                got.status,
                got.grpc,
                if got.replayed { "replayed " } else { "" },
                got.problem.unwrap_or(""),
                String::from_utf8_lossy(got.body.get(..60.min(got.body.len())).unwrap_or_default())
            )
        });
        let late = self.now.saturating_sub(self.reqs[r].sent);
        let vm = self.reqs[r].vm;
        let halted = self.faults.halted_total(self.vms[vm].envoy, vm);
        if late > ANSWER_BOUND_MS + halted {
            self.check.fail("answered_late", self.now, format!("req {r} answered after {late} ms"));
        }
        self.check_answer(r, key, &got);
        let client = self.reqs[r].client;
        if self.clients[client].attempts_left > 0 {
            let retry = got.problem.is_some() || got.status >= 500 || self.rng.chance(500);
            if retry {
                let at = self.now + self.rng.range(50, 1_500);
                self.queue.push(at, Ev::Send { client });
            } else {
                self.clients[client].attempts_left = 0;
            }
        }
    }

    fn leave(&mut self, r: usize) {
        if !self.reqs[r].open {
            return;
        }
        self.log(|| format!("req {r} leaves"));
        if self.reqs[r].state == ReqState::Waiting {
            self.reqs[r].state = ReqState::Left;
        }
        if let Some(f) = self.reqs[r].flight {
            if self.flights[f].call.is_none() && self.flights[f].state == FlightState::Running {
                self.flights[f].state = FlightState::Orphaned; // Envoy resets the router's call
            }
        }
        if self.reqs[r].body_at.is_some() {
            self.end_stream(r);
        } else {
            self.reqs[r].open = false; // it never reached its VM
        }
        self.retry_later(self.reqs[r].client);
    }

    /// A client that got no answer tries again later, if it has tries left.
    fn retry_later(&mut self, client: usize) {
        if self.clients[client].attempts_left > 0 {
            let at = self.now + self.rng.range(100, 2_000);
            self.queue.push(at, Ev::Send { client });
        }
    }

    fn stream_done(&mut self, r: usize) {
        if self.reqs[r].open {
            self.end_stream(r);
        }
    }

    fn end_stream(&mut self, r: usize) {
        let (vm, id) = (self.reqs[r].vm, self.reqs[r].id);
        self.reqs[r].open = false;
        if self.vms[vm].lifecycle.tracks(id) {
            self.vms[vm].lifecycle.on_stream_done(id);
            self.carry_out(vm);
        }
    }

    // --- effects, as the adapter carries them out ------------------------------------------

    fn carry_out(&mut self, vm: usize) {
        self.sync_shared_history();
        let told = std::mem::take(&mut *self.vms[vm].told.borrow_mut());
        for id in told {
            if let Some(r) = self.streams.get(&(vm, id)) {
                self.reqs[*r].knew = true;
            }
        }
        let effects = self.vms[vm].lifecycle.take_effects();
        for effect in effects {
            self.effect(vm, effect);
        }
    }

    /// A stream the lifecycle acts on must be open.
    fn open_stream(&mut self, vm: usize, id: u32, what: &str) -> Option<usize> {
        let r = *self.streams.get(&(vm, id))?;
        if !self.reqs[r].open {
            self.check.fail("effect_on_closed_stream", self.now, format!("{what} on vm {vm} stream {id} (req {r})"));
            return None;
        }
        Some(r)
    }

    fn effect(&mut self, vm: usize, effect: Effect) {
        match effect {
            Effect::Reply { stream, reply } => {
                let Some(r) = self.open_stream(vm, stream, "a reply") else { return };
                if let Some(got) = self.reply_got(&reply) {
                    self.check_record(r, &got);
                    self.got(r, got);
                }
                if self.vms[vm].lifecycle.watches_response(stream) {
                    self.check.fail("own_reply_watched", self.now, format!("req {r}"));
                }
                self.queue.push(self.now, Ev::StreamDone { req: r });
            }
            Effect::SetRequestHeader { stream, name, value } => {
                let Some(r) = self.open_stream(vm, stream, "a request header") else { return };
                let headers = &mut self.reqs[r].headers;
                headers.retain(|(n, _)| *n != name);
                if let Some(v) = value {
                    headers.push((name, v.into_bytes()));
                }
            }
            Effect::SetResponseHeaders { stream, headers } => {
                let Some(r) = self.open_stream(vm, stream, "response headers") else { return };
                self.reqs[r].set_headers = Some(headers);
            }
            Effect::ReplaceResponseBody { stream, body, trailers, .. } => {
                let Some(r) = self.open_stream(vm, stream, "a response body") else { return };
                self.reqs[r].set_body = Some((body, trailers));
            }
            Effect::Resume { stream } => {
                let Some(r) = self.open_stream(vm, stream, "a resume") else { return };
                if !self.reqs[r].request_paused {
                    self.check.fail("resume_not_paused", self.now, format!("request of req {r}"));
                    return;
                }
                self.reqs[r].request_paused = false;
                self.forward_by_router(r);
            }
            Effect::ResumeResponse { stream } => {
                let Some(r) = self.open_stream(vm, stream, "a response resume") else { return };
                let Some(response) = self.reqs[r].response_paused.take() else {
                    self.check.fail("resume_not_paused", self.now, format!("response of req {r}"));
                    return;
                };
                self.response_reaches_client(r, response);
            }
            Effect::Dispatch { call, request } if self.rng.chance(self.faults.dispatch_fail) => {
                self.log(|| format!("vm {vm}: Envoy refuses to dispatch {call:?}"));
                match call {
                    CallId::Store(_) => self.faults.refused.push((vm, self.now)),
                    CallId::Upstream(_) => {
                        if let Some(r) = sim_req(&request) {
                            self.refused_upstream.push((vm, self.reqs[r].key, self.now));
                        }
                    }
                }
                if let CallId::Store(_) = call {
                    self.note_refused(vm, &request);
                }
                // Envoy refuses within the dispatch itself, and the adapter tells the lifecycle
                // there and then (plugin/vm.rs): before any other callback of the worker.
                let now = self.clock(vm);
                self.vms[vm].lifecycle.on_call_failed(call, now);
                self.carry_out(vm);
            }
            Effect::Dispatch { call: CallId::Store(n), request } => self.etcd_send(vm, n, request),
            Effect::Dispatch { call: CallId::Upstream(n), request } => self.detached_send(vm, n, request),
            // The shared queue's callback is another event of the worker's loop: a pause or a
            // stall may come between.
            Effect::WakeRoot => {
                let at = self.now + self.rng.range(0, 2);
                self.queue.push(at, Ev::Wake { vm });
            }
            Effect::Count { counter, n } => self.log(|| format!("vm {vm} counts {} +{n}", counter.name())),
            Effect::AddGauge { .. } | Effect::SetGauge { .. } => {}
            Effect::Record { stream, text } => {
                let Some(r) = self.open_stream(vm, stream, "a record") else { return };
                if self.reqs[r].record.is_some() {
                    self.check.fail("recorded_twice", self.now, format!("req {r}: {text}"));
                }
                self.reqs[r].record = Some(text);
            }
        }
    }

    /// The record of a request the plugin answered itself says what it answered.
    fn check_record(&mut self, r: usize, got: &Got) {
        let decision = self.reqs[r]
            .record
            .as_deref()
            .and_then(|t| t.strip_prefix("decision="))
            .map(|t| t.split(' ').next().unwrap_or_default().to_string());
        // A request passed on without idempotency gets what the upstream path gives it.
        if decision.as_deref().is_some_and(|d| d.starts_with("pass-")) {
            return;
        }
        let expected = match (got.problem, got.replayed) {
            // A gRPC status stands for several problems: the record keeps which one.
            (Some("grpc-error"), _) => return,
            (Some(slug), _) => slug,
            (None, true) => "replayed",
            (None, false) => return,
        };
        if decision.as_deref() != Some(expected) {
            let detail = format!("req {r} got {expected}, recorded {decision:?}");
            self.check.fail("record_differs", self.now, detail);
        }
    }

    fn reply_got(&self, reply: &Reply) -> Option<Got> {
        Some(match reply {
            Reply::Problem(p) => {
                Got { status: p.status, grpc: None, body: p.body().to_vec(), replayed: false, problem: Some(p.slug()) }
            }
            Reply::Stored { response, replayed } => {
                let trailers = crate::lifecycle::grpc_reply::trailers_and_headers(response);
                Got {
                    status: response.status(),
                    grpc: crate::lifecycle::grpc_reply::status_of(trailers),
                    body: response.body().to_vec(),
                    replayed: *replayed,
                    problem: None,
                }
            }
            Reply::Grpc(a) => Got {
                status: 200,
                grpc: Some(a.code),
                body: a.message.as_bytes().to_vec(),
                replayed: a.metadata.iter().any(|(n, _)| n == "idempotent-replayed"),
                problem: grpc_problem(a.code, &a.message),
            },
        })
    }

    // --- what the stores held ------------------------------------------------------------

    /// Reads what shared-data writes left for the simulated keys (their VM: the one whose
    /// event runs).
    fn sync_shared_history(&mut self) {
        if self.combo.is_etcd() {
            for kv in &self.kvs {
                kv.take_journal(); // the local copies and the ledger: not the key's store
            }
            return;
        }
        let Some(kv) = self.kvs.first().cloned() else { return };
        let written = kv.take_journal();
        if written.is_empty() {
            return;
        }
        let locators: Vec<(KeyId, Locator)> = self.history.locators().to_vec();
        for (key, locator) in locators {
            let Locator::Bucket { name, tag } = locator else { continue };
            if !written.contains(&name) {
                continue;
            }
            let bytes = crate::host::SharedKv::get(&*kv, &name).ok().and_then(|(v, _)| v).unwrap_or_default();
            let entry = bucket_entry(&bytes, &tag);
            let mark = Mark { at: self.now, by_vm: self.running_vm, entry, revision: 0, acknowledged: true };
            self.note_mark(key, mark);
        }
    }

    /// Reads what an etcd cluster holds for the simulated keys that live on it, after it
    /// served a call of `vm` (`acknowledged`: its answer will reach `vm` in time).
    fn sync_etcd_history(&mut self, cluster: usize, vm: usize, written: Option<&[u8]>, acknowledged: bool) {
        let locators: Vec<(KeyId, Locator)> = self.history.locators().to_vec();
        for (key, locator) in locators {
            let Locator::Etcd { name } = locator else { continue };
            if self.key_cluster.get(&key) != Some(&cluster) {
                continue;
            }
            let (entry, revision) = match self.etcd[cluster].get(&name) {
                Some((value, revision)) => (decode_entry(value).ok().map(|(e, _)| e), revision),
                None => (None, 0),
            };
            let ours = written == Some(name.as_slice());
            let by_vm = ours.then_some(vm);
            let mark = Mark { at: self.now, by_vm, entry, revision, acknowledged: !ours || acknowledged };
            self.note_mark(key, mark);
        }
    }

    /// Records a key's new state; a new claim may draw a pause aimed at its deadline.
    fn note_mark(&mut self, key: KeyId, mark: Mark) {
        let before = self.history.at(key, self.now).and_then(Mark::in_progress);
        let changed = self.history.marks(key).len();
        self.history.note(key, mark);
        if self.history.marks(key).len() > changed {
            let view = mark.entry.map(|e| (e.state, e.gen, e.deadline_ms));
            self.log(|| format!("store: key {key:?} holds {view:?} (vm {:?}, revision {})", mark.by_vm, mark.revision));
        }
        self.check_overwrite(key, before, &mark);
        let (Some(gen), Some(vm)) = (mark.in_progress(), mark.by_vm) else { return };
        if before != Some(gen) {
            self.log(|| format!("store: key {key:?} claimed by vm {vm} (token {gen})"));
            self.aim_pause(vm, mark.entry.map_or(0, |e| e.deadline_ms));
        }
    }

    // --- faults aimed at deadlines -------------------------------------------------------

    /// After a claim, now and then: its VM stops from a moment within its lease until just
    /// after its mark's deadline (a pause of its Envoy in a fleet, a stall of its worker).
    fn aim_pause(&mut self, vm: usize, deadline: u64) {
        if self.faults.aim == 0 || !self.rng.chance(self.faults.aim / 3) {
            return;
        }
        let envoy = self.vms[vm].envoy;
        let judge = (envoy + 1) % self.kvs.len();
        // Now and then right after the claim, before the root sends the call it queued.
        let from = self.now + if self.rng.chance(300) { 1 } else { self.rng.range(0, LEASE_MS / 2) };
        let to = self.true_time(judge, deadline) + self.rng.range(1, 300);
        if to <= from {
            return;
        }
        if self.kvs.len() > 1 && self.rng.chance(500) {
            self.faults.pauses[envoy].push((from, to));
            self.log(|| format!("aimed: envoy {envoy} paused {from}..{to}"));
        } else {
            self.faults.stalls[vm].push((from, to));
            self.log(|| format!("aimed: vm {vm} stalled {from}..{to}"));
        }
    }

    /// When an owner's ending becomes due, now and then: its cluster is in trouble until just
    /// before its mark's deadline (up to one timeout before it).
    fn aim_window(&mut self, f: usize) {
        let Some(claim) = self.flights[f].claim else { return };
        let key = self.flights[f].key;
        let Some(&cluster) = self.key_cluster.get(&key) else { return };
        if self.faults.aim == 0 || !self.rng.chance(self.faults.aim) || self.faults.trouble(cluster, self.now).is_some()
        {
            return;
        }
        let Some(deadline) = self.history.last_deadline(key, claim.gen, self.now + 1).and_then(|m| m.entry) else {
            return;
        };
        let judge = (self.vms[self.flights[f].vm].envoy + 1) % self.kvs.len();
        let before = self.rng.range(0, self.faults.etcd_timeout_ms);
        let to = self.true_time(judge, deadline.deadline_ms).saturating_sub(before);
        if to <= self.now + 20 {
            return;
        }
        let kinds = [Trouble::Hung, Trouble::Stalled, Trouble::Down, Trouble::NoLeader, Trouble::NoSpace];
        let trouble = self.rng.pick(&kinds).unwrap_or(Trouble::Hung);
        self.faults.etcd[cluster].push(Window { from: self.now, to, trouble });
        let from = self.now;
        self.log(|| format!("aimed: etcd cluster {cluster} {trouble:?} {from}..{to}"));
    }

    // --- etcd ------------------------------------------------------------------------------

    fn etcd_send(&mut self, vm: usize, call: u64, request: CallRequest) {
        let cluster = request.cluster.strip_prefix("etcd").and_then(|n| n.parse::<usize>().ok()).unwrap_or(0);
        let timeout = request.timeout_ms.max(1);
        if let Some((method, name)) = Model::request_key(&request) {
            if let Some(key) = self.key_named(&name) {
                self.log(|| format!("vm {vm} etcd call {call}: {method} of key {key:?}"));
            }
        }
        let record = StoreCall {
            delivered: false,
            cluster,
            sent: self.now,
            timeout_at: self.now + timeout,
            grant: is_grant(&request),
        };
        self.store_calls.insert((vm, call), record);
        let timeout_answer = crate::store::etcd::grpc::status_answer(4, "upstream request timeout");
        self.queue.push(self.now + timeout, Ev::EtcdAnswer { vm, call, answer: timeout_answer });
        let trouble = self.faults.trouble(cluster, self.now);
        // Out of space, etcd still serves reads: only the windows where it fails count.
        if trouble.is_some_and(|w| w.trouble != Trouble::NoSpace) {
            if let Some(n) = self.calls_in_trouble.get_mut(cluster) {
                *n += 1;
            }
        }
        if trouble.is_some_and(|w| w.trouble == Trouble::Down) {
            let refused = crate::store::etcd::grpc::status_answer(14, "upstream connect error");
            self.queue.push(self.now + 1, Ev::EtcdAnswer { vm, call, answer: refused });
            return;
        }
        if self.rng.chance(self.faults.lose_before) {
            self.log(|| format!("etcd call {call} of vm {vm} lost on its way"));
            self.faults.lost.push((vm, cluster, self.now));
            return;
        }
        let mut at = self.now + self.rng.range(1, self.faults.etcd_latency_max);
        if let Some(w) = self.faults.trouble(cluster, at).filter(|w| w.trouble == Trouble::Stalled) {
            at = w.to; // waits in the stopped process's socket
        }
        self.queue.push(at, Ev::EtcdArrive { cluster, vm, call, request });
    }

    /// The simulated key an etcd key name stands for.
    fn key_named(&self, name: &[u8]) -> Option<KeyId> {
        self.history
            .locators()
            .iter()
            .find(|(_, l)| matches!(l, Locator::Etcd { name: n } if n == name))
            .map(|(k, _)| *k)
    }

    /// A store call Envoy refused to dispatch.
    fn note_refused(&mut self, vm: usize, request: &CallRequest) {
        let cluster = request.cluster.strip_prefix("etcd").and_then(|n| n.parse::<usize>().ok()).unwrap_or(0);
        let grant = is_grant(request);
        self.store_log.push(StoreOutcome {
            vm,
            cluster,
            sent: self.now,
            ended: self.now,
            seq: self.events,
            grant,
            ok: false,
        });
    }

    fn etcd_arrive(&mut self, cluster: usize, vm: usize, call: u64, request: CallRequest) {
        let trouble = self.faults.trouble(cluster, self.now);
        match trouble.map(|w| w.trouble) {
            Some(Trouble::Down) => {
                let refused = crate::store::etcd::grpc::status_answer(14, "upstream connect error");
                self.queue.push(self.now + 1, Ev::EtcdAnswer { vm, call, answer: refused });
                return;
            }
            Some(Trouble::NoLeader) => {
                let w = trouble.unwrap_or(Window { from: 0, to: 0, trouble: Trouble::NoLeader });
                if self.rng.chance(500) {
                    self.queue.push(w.to, Ev::EtcdArrive { cluster, vm, call, request });
                // commits later
                } else {
                    let failed = crate::store::etcd::grpc::status_answer(14, "etcdserver: no leader");
                    let at = self.now + self.rng.range(1, (w.to - self.now).clamp(1, 1_000));
                    self.queue.push(at, Ev::EtcdAnswer { vm, call, answer: failed });
                }
                return;
            }
            Some(Trouble::Hung) => {
                let w = trouble.unwrap_or(Window { from: 0, to: 0, trouble: Trouble::Hung });
                if self.rng.chance(500) {
                    self.queue.push(w.to, Ev::EtcdArrive { cluster, vm, call, request });
                // commits later
                } else {
                    self.log(|| format!("etcd call {call} of vm {vm} hangs, never answered"));
                    self.faults.lost.push((vm, cluster, self.now));
                }
                return;
            }
            _ => {}
        }
        // Leases that ended went with time, not with this call.
        self.etcd[cluster].expire(self.now);
        self.sync_etcd_history(cluster, vm, None, true);
        let model = &mut self.etcd[cluster];
        model.no_space = trouble.is_some_and(|w| w.trouble == Trouble::NoSpace);
        let answer = model.handle(&request, self.now);
        model.no_space = false;
        let written =
            Model::request_key(&request).filter(|(m, _)| *m == "Txn" && Model::succeeded(&answer)).map(|(_, k)| k);
        let lost = self.rng.chance(self.faults.lose_after);
        let at = self.now + self.rng.range(1, self.faults.etcd_latency_max);
        let timeout_at = self.store_calls.get(&(vm, call)).map_or(0, |c| c.timeout_at);
        let ok = crate::store::etcd::grpc::grpc_status(&answer) == Some(0);
        self.sync_etcd_history(cluster, vm, written.as_deref().filter(|_| ok), !lost && at < timeout_at);
        if lost {
            self.log(|| format!("etcd call {call} of vm {vm} applied, its answer lost"));
            self.faults.lost.push((vm, cluster, self.store_calls.get(&(vm, call)).map_or(self.now, |c| c.sent)));
            return;
        }
        self.queue.push(at, Ev::EtcdAnswer { vm, call, answer });
    }

    fn etcd_deliver(&mut self, vm: usize, call: u64, answer: CallAnswer) {
        let Some(record) = self.store_calls.get_mut(&(vm, call)) else { return };
        if record.delivered {
            return;
        }
        record.delivered = true;
        let (cluster, sent) = (record.cluster, record.sent);
        let grant = record.grant;
        if self.root_gone(vm, "an etcd answer") {
            return;
        }
        let status = crate::store::etcd::grpc::grpc_status(&answer);
        let ok = status == Some(0);
        self.store_log.push(StoreOutcome { vm, cluster, sent, ended: self.now, seq: self.events, grant, ok });
        if status == Some(4) {
            // Timed out: lost, or slower than `timeout_ms` (a slow run's round trip can be): for
            // its VM, as a lost call.
            self.faults.lost.push((vm, cluster, sent));
        }
        self.log(|| format!("vm {vm} etcd call {call} answered: grpc-status {status:?}"));
        let now = self.clock(vm);
        crate::test_driver::deliver_store_answer(&mut self.vms[vm].lifecycle, CallId::Store(call), &answer, now);
        self.carry_out(vm);
        self.end_if_drained(vm);
    }

    /// A call's answer for a root that has ended: it ended with work in flight.
    fn root_gone(&mut self, vm: usize, what: &str) -> bool {
        if self.vms[vm].finished {
            self.check.fail("old_root_ended_early", self.now, format!("{what} for vm {vm}, whose old root ended"));
        }
        self.vms[vm].finished
    }

    // --- the upstream ------------------------------------------------------------------------

    /// The request goes on through Envoy's router.
    fn forward_by_router(&mut self, r: usize) {
        let vm = self.reqs[r].vm;
        let headers = self.reqs[r].headers.clone();
        let loopback = header(&headers, ":path") == Some(crate::lifecycle::grpc_reply::REPLAY_PATH.as_bytes());
        self.new_flight(r, vm, None, loopback, &headers);
    }

    fn detached_send(&mut self, vm: usize, n: crate::lifecycle::WorkId, request: CallRequest) {
        let CallKind::Http { headers } = &request.kind else { return };
        if request.cluster != super::HOP_CLUSTER {
            self.check.fail("detached_unrouted", self.now, format!("a detached call to {:?}", request.cluster));
        }
        let pairs: Headers =
            headers.iter().map(|(n, v)| (String::from_utf8_lossy(n).into_owned(), v.to_vec())).collect();
        let Some(r) = sim_req(&request) else {
            self.check.fail("answer_crossed", self.now, "a detached call without its request".into());
            return;
        };
        self.new_flight(r, vm, Some(n), false, &pairs);
    }

    fn new_flight(
        &mut self,
        r: usize,
        vm: usize,
        call: Option<crate::lifecycle::WorkId>,
        loopback: bool,
        headers: &Headers,
    ) {
        self.sync_shared_history();
        let fence = header(headers, FENCE_HEADER).map(<[u8]>::to_vec);
        if self.combo.fencing && fence.as_deref() == Some(FORGED_FENCE.as_bytes()) {
            self.check.fail("forged_fence_passed", self.now, format!("req {r}"));
        }
        let fence = fence.and_then(|v| String::from_utf8(v).ok()?.parse::<u64>().ok());
        let f = self.flights.len();
        let (key, variant) = (self.reqs[r].key, self.reqs[r].variant);
        let from = self.reqs[r].body_at.unwrap_or(self.reqs[r].sent);
        let claim = if loopback { None } else { self.history.claim_by(key, vm, from, self.now) };
        self.flights.push(Flight {
            req: r,
            key,
            variant,
            vm,
            call,
            loopback,
            claim,
            fence,
            sent: self.now,
            effect: false,
            unprotected: false,
            state: FlightState::Running,
            answer: Response::default(),
            storable: false,
            latency: 0,
            answered_at: None,
        });
        if call.is_none() {
            self.reqs[r].flight = Some(f);
        }
        self.log(|| {
            format!(
                "flight {f}: req {r} upstream ({}, claim {:?}, fence {fence:?}, loopback {loopback})",
                if call.is_some() { "detached" } else { "router" },
                claim.map(|c| c.gen)
            )
        });
        let at = self.now + self.rng.range(0, 3);
        self.queue.push(at, Ev::UpstreamArrive { flight: f });
    }

    fn upstream_arrive(&mut self, f: usize) {
        if self.flights[f].loopback {
            let answer = Response {
                status: 200,
                headers: vec![
                    (":status".into(), b"200".to_vec()),
                    ("content-type".into(), b"application/x-idempotency-replay".to_vec()),
                ],
                body: b"loopback".to_vec(),
                ..Response::default()
            };
            self.flights[f].answer = answer;
            self.flights[f].storable = true;
            self.queue.push(self.now + 1, Ev::UpstreamAnswer { flight: f });
            return;
        }
        if self.flights[f].state == FlightState::Orphaned && self.rng.chance(500) {
            self.flights[f].state = FlightState::Done { storable: false }; // reset before it got there
            return;
        }
        let hop = self.flights[f].call.is_some();
        if hop && self.hop.chance(self.hop_fail.0) {
            // The internal listener's router could not reach the upstream: its own 503,
            // which comes back through the hop as an answer.
            self.flights[f].answer = plain(503, b"no healthy upstream".to_vec());
            self.log(|| format!("flight {f}: the hop failed before the upstream"));
            self.queue.push(self.now + 1, Ev::UpstreamAnswer { flight: f });
            return;
        }
        let key = self.flights[f].key;
        let protected = self.judge_fence(f);
        if let (true, Some(token)) = (self.combo.fencing, self.flights[f].fence) {
            let max = self.fence_max.entry(key).or_insert(0);
            if token <= *max {
                self.flights[f].state = FlightState::Fenced;
                self.flights[f].answer = plain(409, b"fenced: a newer claim ran".to_vec());
                self.queue.push(self.now + 1, Ev::UpstreamAnswer { flight: f });
                return;
            }
            *max = token;
        }
        self.flights[f].effect = true;
        self.judge_effect(f, protected);
        let (answer, storable, latency) = self.plan(f);
        let (answer, storable, latency) = if hop && latency > 1 && self.hop.chance(self.hop_fail.1) {
            // The route's timeout ends the hop while the upstream works on: a 504 from the
            // internal listener, an answer to the plugin (it releases the key).
            self.log(|| format!("flight {f}: the hop timed out after the upstream got it"));
            (plain(504, b"upstream request timeout".to_vec()), false, latency / 2)
        } else {
            (answer, storable, latency)
        };
        self.flights[f].answer = answer;
        self.flights[f].latency = latency;
        self.log(|| format!("flight {f} effect on key {key:?}; answers in {latency} ms (storable {storable})"));
        self.queue.push(self.now + latency, Ev::UpstreamAnswer { flight: f });
        self.flights[f].storable = storable;
    }

    /// What the upstream answers, and after how long.
    fn plan(&mut self, f: usize) -> (Response, bool, u64) {
        let latency = match self.rng.range(0, 99) {
            0..=79 => self.rng.range(5, 400),
            80..=94 => self.rng.range(400, 2_500),
            _ => self.rng.range(3_000, 8_000),
        };
        let detached = self.flights[f].call.is_some();
        if detached && latency > super::UPSTREAM_TIMEOUT_MS {
            let mut r = plain(504, b"upstream request timeout".to_vec());
            r.from_envoy = Some("response_timeout");
            return (r, false, super::UPSTREAM_TIMEOUT_MS);
        }
        let tag = format!("eff:{f};s{};k{};", self.flights[f].key.0, self.flights[f].key.1);
        let roll = self.rng.range(0, 99);
        if roll < 5 {
            let mut r = plain(
                503,
                b"upstream connect error or disconnect/reset before headers. reset reason: connection termination"
                    .to_vec(),
            );
            r.from_envoy = Some("upstream_reset_before_response_started{connection_termination}");
            return (r, false, latency);
        }
        if self.combo.is_grpc() {
            let message = |text: &str| {
                let mut m = vec![0u8, 0, 0, 0, text.len() as u8];
                m.extend_from_slice(text.as_bytes());
                m
            };
            let mut r = Response {
                status: 200,
                headers: vec![
                    (":status".into(), b"200".to_vec()),
                    ("content-type".into(), b"application/grpc".to_vec()),
                    ("x-envoy-upstream-service-time".into(), b"3".to_vec()),
                ],
                ..Response::default()
            };
            return match roll {
                5..=12 => {
                    r.body = message(&tag);
                    r.trailers =
                        vec![("grpc-status".into(), b"14".to_vec()), ("grpc-message".into(), b"try later".to_vec())];
                    (r, false, latency)
                }
                13..=18 => {
                    // Trailers-only: a failure the client caused, stored and replayed.
                    r.headers.push(("grpc-status".into(), b"3".to_vec()));
                    r.headers.push(("grpc-message".into(), tag.into_bytes()));
                    (r, true, latency)
                }
                19..=22 => {
                    r.body = message(&tag);
                    r.broken = true; // the stream ends without trailers: no status
                    (r, false, latency)
                }
                _ => {
                    r.body = message(&tag);
                    r.trailers = vec![("grpc-status".into(), b"0".to_vec())];
                    (r, true, latency)
                }
            };
        }
        let mut body = tag.into_bytes();
        let status = match roll {
            5..=12 => 500,
            13..=17 => 400,
            18..=22 => {
                body.resize(MAX_RESPONSE_BYTES + 100, b'x');
                201
            }
            _ => 201,
        };
        let mut r = plain(status, body);
        r.headers.push(("x-envoy-upstream-service-time".into(), b"3".to_vec()));
        if self.combo.protocol == Protocol::Http2 && self.rng.chance(500) {
            r.trailers = vec![("x-checksum".into(), b"abc".to_vec())];
        }
        (r, status != 500, latency)
    }

    fn upstream_answer(&mut self, f: usize) {
        let state = self.flights[f].state;
        let storable = self.flights[f].storable && state != FlightState::Fenced;
        let answer = self.flights[f].answer.clone();
        match state {
            FlightState::Running => self.flights[f].state = FlightState::Done { storable },
            FlightState::Fenced => {}
            _ => return,
        }
        self.flights[f].answered_at = Some(self.now);
        if self.combo.is_etcd() && self.flights[f].effect {
            self.aim_window(f);
        }
        let r = self.flights[f].req;
        let vm = self.flights[f].vm;
        match self.flights[f].call {
            Some(n) => {
                if self.root_gone(vm, "a detached call's answer") {
                    return;
                }
                let (headers, trailers) = if answer.broken && !self.combo.is_grpc() {
                    (Vec::new(), Vec::new())
                } else {
                    (answer.headers.clone(), answer.trailers.clone())
                };
                let has_headers = !headers.is_empty();
                let host = SimHost {
                    now: self.clock(vm),
                    call_headers: headers,
                    call_body: answer.body.clone(),
                    call_trailers: trailers,
                    ..SimHost::default()
                };
                let now = self.clock(vm);
                self.vms[vm].lifecycle.on_call_answer(&host, CallId::Upstream(n), has_headers, answer.body.len(), now);
                self.carry_out(vm);
                self.end_if_drained(vm);
            }
            None => self.router_response(r, answer),
        }
    }

    /// The router's answer passes through the plugin's response callbacks, then to the client.
    fn router_response(&mut self, r: usize, answer: Response) {
        if !self.reqs[r].open {
            return;
        }
        let (vm, id) = (self.reqs[r].vm, self.reqs[r].id);
        let host = SimHost {
            now: self.clock(vm),
            response: answer.headers.clone(),
            response_body: answer.body.clone(),
            response_trailers: answer.trailers.clone(),
            code_details: Some(answer.from_envoy.unwrap_or("via_upstream")),
            ..SimHost::default()
        };
        let has_body = !answer.body.is_empty();
        let has_trailers = !answer.trailers.is_empty();
        let mut flow = Flow::Continue;
        if self.vms[vm].lifecycle.watches_response(id) {
            flow = self.vms[vm].lifecycle.on_response_headers(&host, id, !has_body && !has_trailers && !answer.broken);
            self.carry_out(vm);
        }
        if has_body && self.reqs[r].open && self.vms[vm].lifecycle.watches_response(id) {
            let eos = !has_trailers && !answer.broken;
            flow = self.vms[vm].lifecycle.on_response_body(&host, id, answer.body.len(), eos);
            self.carry_out(vm);
        }
        if answer.broken {
            // The connection broke after the headers: the client sees a reset stream.
            if let Some(f) = self.reqs[r].flight {
                self.flights[f].state = FlightState::Orphaned;
            }
            self.reqs[r].state = ReqState::Left;
            self.end_stream(r);
            self.retry_later(self.reqs[r].client);
            return;
        }
        if has_trailers && self.reqs[r].open && self.vms[vm].lifecycle.watches_response(id) {
            flow = self.vms[vm].lifecycle.on_response_trailers(&host, id);
            self.carry_out(vm);
        }
        if !self.reqs[r].open {
            return;
        }
        match flow {
            Flow::Continue => self.response_reaches_client(r, answer),
            Flow::Pause => self.reqs[r].response_paused = Some(answer),
        }
    }

    fn response_reaches_client(&mut self, r: usize, mut answer: Response) {
        if let Some(headers) = self.reqs[r].set_headers.take() {
            answer.status = status_in(&headers);
            answer.headers = headers;
        }
        if let Some((body, trailers)) = self.reqs[r].set_body.take() {
            answer.body = body;
            answer.trailers = trailers;
        }
        let grpc = crate::lifecycle::grpc_reply::status_of(
            answer.headers.iter().chain(answer.trailers.iter()).map(|(n, v)| (n.as_str(), v.as_slice())),
        );
        let replayed = answer.headers.iter().any(|(n, _)| n == "idempotent-replayed");
        let got = Got { status: answer.status, grpc, body: answer.body, replayed, problem: None };
        self.got(r, got);
        self.queue.push(self.now, Ev::StreamDone { req: r });
    }

    fn finish(mut self) -> Report {
        for r in 0..self.reqs.len() {
            if self.reqs[r].state == ReqState::Waiting {
                let detail = format!("req {r} sent at {} to vm {}", self.reqs[r].sent, self.reqs[r].vm);
                self.check.fail("unanswered", self.now, detail);
            }
        }
        for (vm, v) in self.vms.iter().enumerate() {
            let residue = v.lifecycle.residue();
            if !residue.is_empty() {
                self.check.fail("not_back_to_baseline", self.now, format!("vm {vm}: {residue:?}"));
            }
        }
        for (vm, v) in self.vms.iter().enumerate() {
            if v.draining && !v.finished {
                self.check.fail("old_root_never_finished", self.now, format!("vm {vm}: {:?}", v.lifecycle.residue()));
            }
        }
        for (cluster, calls) in self.calls_in_trouble.iter().enumerate() {
            let windows = self.faults.etcd.get(cluster).map(Vec::as_slice).unwrap_or_default();
            let allowed: u64 = windows
                .iter()
                .filter(|w| w.trouble != Trouble::NoSpace)
                .map(|w| (w.to - w.from) / 20 * self.vms.len() as u64 + 64)
                .sum();
            if *calls > allowed && allowed > 0 {
                let detail = format!("cluster {cluster}: {calls} calls during trouble, at most {allowed}");
                self.check.fail("store_hammered", self.now, detail);
            }
        }
        let mut etcd = super::EtcdCalls::default();
        for m in &self.etcd {
            let handled = |method: &str| m.requests.get(method).copied().unwrap_or(0);
            etcd += super::EtcdCalls { reads: handled("Range"), txns: handled("Txn"), proposals: m.proposals };
        }
        Report {
            requests: self.reqs.len(),
            etcd,
            effects: self.flights.iter().filter(|f| f.effect).count(),
            events: self.events,
            violations: self.check.violations,
            excuses: self.excuses,
            trace: self.trace.unwrap_or_default(),
        }
    }
}

/// A grant of a VM's lease (its marks ride it), not a retention lease (hours long).
fn is_grant(request: &CallRequest) -> bool {
    use prost::Message;
    matches!(request.kind, CallKind::Grpc { method: "LeaseGrant", .. })
        && crate::store::etcd::grpc::pb::LeaseGrantRequest::decode(request.body.as_slice()).is_ok_and(|g| g.ttl < 60)
}

fn header<'a>(headers: &'a Headers, name: &str) -> Option<&'a [u8]> {
    headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_slice())
}

/// The simulated request a detached call carries (its `x-sim-req` header).
fn sim_req(request: &CallRequest) -> Option<usize> {
    std::str::from_utf8(request.header("x-sim-req")?.as_bytes()).ok()?.parse().ok()
}

fn plain(status: u16, body: Vec<u8>) -> Response {
    Response {
        status,
        headers: vec![
            (":status".into(), status.to_string().into_bytes()),
            ("content-type".into(), b"text/plain".to_vec()),
        ],
        body,
        ..Response::default()
    }
}

/// `eff:<flight>;s<scope>;k<key>;` in an answer's body.
pub(super) fn parse_tag(body: &[u8]) -> Option<(usize, u64, u64)> {
    let text = String::from_utf8_lossy(body);
    let start = text.find("eff:")?;
    let mut parts = text.get(start + 4..)?.split(';');
    let flight = parts.next()?.parse().ok()?;
    let scope = parts.next()?.strip_prefix('s')?.parse().ok()?;
    let key = parts.next()?.strip_prefix('k')?.parse().ok()?;
    Some((flight, scope, key))
}

/// The plugin's problem a gRPC answer stands for, by the slug of its HTTP form.
fn grpc_problem(code: u32, message: &str) -> Option<&'static str> {
    match code {
        crate::lifecycle::grpc_reply::ABORTED => Some("in-progress"),
        crate::lifecycle::grpc_reply::FAILED_PRECONDITION if message.contains("not stored") => {
            Some("response-not-stored")
        }
        crate::lifecycle::grpc_reply::FAILED_PRECONDITION => None,
        crate::lifecycle::grpc_reply::OK => None,
        _ if message.contains("eff:") => None,
        _ => Some("grpc-error"),
    }
}

/// The `:status` of a header map, 0 when absent.
fn status_in(headers: &Headers) -> u16 {
    let value = headers.iter().find(|(n, _)| n == ":status").map(|(_, v)| v.as_slice());
    value.and_then(|v| std::str::from_utf8(v).ok()?.parse().ok()).unwrap_or(0)
}
