//! The simulated world: Envoys and their VMs, the etcd clusters behind their network, the
//! upstream, the clients; one event at a time, in virtual time, with the effects carried out
//! as the plugin's adapter does (`src/plugin/vm.rs`) and the invariants checked as they go.

use std::collections::BTreeMap;
use std::rc::Rc;

use super::check::Checker;
use super::net::{Faults, Queue, Rng, Trouble};
use super::{Combo, Protocol, Report, StoreKind, ETCD_TIMEOUT_MS, FENCE_HEADER, LEASE_MS, MAX_RESPONSE_BYTES};
use crate::build::AnyLifecycle;
use crate::config::Config;
use crate::host::{Flow, Headers};
use crate::lifecycle::inspect::PhaseName;
use crate::lifecycle::{CallId, Effect, Reply};
use crate::store::etcd::model::Model;
use crate::store::{CallAnswer, CallKind, CallRequest};
use crate::table::memory::MemoryKv;
use crate::test_host::TestHost as SimHost;

const ENVOYS_ETCD: usize = 2;
const WORKERS: usize = 2;
const SCOPES: u64 = 2;
const KEYS: u64 = 3;
const CLIENTS: u64 = 10;
/// Traffic starts within this; faults fall within it too.
const HORIZON_MS: u64 = 8_000;
/// After the last client is done: leases expire, retries land, roots settle.
const DRAIN_MS: u64 = 3 * LEASE_MS + 6_000;
const HARD_END_MS: u64 = 180_000;
/// Where the Envoys' clocks start (true time starts at 0).
const CLOCK_BASE_MS: u64 = 1_000_000;
/// After the drain, how long the VMs may take to be idle at one moment.
const SETTLE_MS: u64 = 10_000;
/// A client that stays has its answer within this (plus the time its Envoy was paused).
const ANSWER_BOUND_MS: u64 = 20_000;
const FORGED_FENCE: &str = "99999999";

type KeyId = (u64, u64);

enum Ev {
    Send {
        client: usize,
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
    /// The Envoy an event runs in (paused Envoys run nothing).
    fn envoy(&self, w: &World) -> Option<usize> {
        let vm = match self {
            Ev::Send { .. } | Ev::EtcdArrive { .. } | Ev::UpstreamArrive { .. } => return None,
            Ev::ConfigUpdate { envoy } => return Some(*envoy),
            Ev::Leave { req } | Ev::StreamDone { req } => w.reqs.get(*req)?.vm,
            Ev::Tick { vm } | Ev::Wake { vm } | Ev::EtcdAnswer { vm, .. } => *vm,
            Ev::UpstreamAnswer { flight } => w.flights.get(*flight)?.vm,
        };
        w.vms.get(vm).map(|v| v.envoy)
    }
}

struct Vm {
    envoy: usize,
    lifecycle: AnyLifecycle,
    next_id: u32,
    tick_ms: u64,
    /// Replaced by a configuration update: takes no new streams, ends once idle.
    draining: bool,
    /// Ended (`proxy_done`): its timer and queue are gone.
    finished: bool,
}

struct Client {
    key: KeyId,
    variant: u64,
    attempts_left: u64,
}

/// What a client got.
#[derive(Debug, Clone)]
struct Got {
    status: u16,
    grpc: Option<u32>,
    body: Vec<u8>,
    replayed: bool,
    /// The plugin's own problem, by its slug.
    problem: Option<&'static str>,
}

#[derive(PartialEq, Eq)]
enum ReqState {
    Waiting,
    Answered,
    Left,
}

struct Req {
    client: usize,
    key: KeyId,
    vm: usize,
    id: u32,
    sent: u64,
    state: ReqState,
    /// When the client had its whole answer (`got`).
    answered_at: Option<u64>,
    open: bool,
    request_paused: bool,
    response_paused: Option<Response>,
    held_ever: bool,
    /// The request as it goes on through the router (the plugin's header edits applied).
    headers: Headers,
    /// gRPC loopback edits of the response.
    set_headers: Option<Headers>,
    set_body: Option<(Vec<u8>, Headers)>,
    flight: Option<usize>,
    /// The decision its filter state records (`Effect::Record`).
    record: Option<String>,
}

#[derive(Debug, Clone, Default)]
struct Response {
    status: u16,
    headers: Headers,
    body: Vec<u8>,
    trailers: Headers,
    /// Envoy's own answer (connect failure, reset, timeout), not the upstream's.
    from_envoy: Option<&'static str>,
    /// The connection broke after the headers: no end.
    broken: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FlightState {
    Running,
    /// Router: the client left; Envoy reset the call; its outcome is unknown.
    Orphaned,
    Done {
        storable: bool,
    },
    /// The upstream refused a stale fencing token: no effect.
    Fenced,
}

struct Flight {
    req: usize,
    key: KeyId,
    vm: usize,
    /// `Some(n)`: a detached call (`CallId::Upstream(n)`); `None`: the router's, on the
    /// request's stream.
    call: Option<u64>,
    loopback: bool,
    claimed: bool,
    fence: Option<u64>,
    start: u64,
    state: FlightState,
    answer: Response,
    /// Whether the upstream's answer completes the key (not released, not Envoy's own).
    storable: bool,
    latency: u64,
}

pub struct World {
    combo: Combo,
    config: String,
    rng: Rng,
    queue: Queue<Ev>,
    now: u64,
    skews: Vec<u64>,
    kvs: Vec<Rc<MemoryKv>>,
    vms: Vec<Vm>,
    /// Per Envoy, the VMs (roots) that take new streams.
    active: Vec<Vec<usize>>,
    etcd: Vec<Model>,
    faults: Faults,
    clients: Vec<Client>,
    reqs: Vec<Req>,
    streams: BTreeMap<(usize, u32), usize>,
    flights: Vec<Flight>,
    /// etcd calls in flight by (VM, call): whether delivered.
    store_calls: BTreeMap<(usize, u64), bool>,
    /// etcd calls sent while a cluster was in trouble, by cluster.
    calls_in_trouble: Vec<u64>,
    /// Each VM's transactions the network lost (either way): when, and on which etcd key.
    /// Each cost that key's owner a timeout of waiting.
    lost_calls: Vec<Vec<(u64, Vec<u8>)>>,
    fence_max: BTreeMap<KeyId, u64>,
    owned_until: BTreeMap<KeyId, u64>,
    grace_ms: u64,
    end_ms: Option<u64>,
    check: Checker,
    trace: Option<Vec<String>>,
    events: usize,
}

impl World {
    pub fn new(seed: u64, combo: Combo, trace: bool) -> World {
        let mut rng = Rng::new(seed);
        let clusters = match combo.store {
            StoreKind::SharedData => 0,
            StoreKind::Etcd { clusters, .. } => clusters,
        };
        let envoys = if combo.is_etcd() { ENVOYS_ETCD } else { 1 };
        let faults = Faults::draw(&mut rng, clusters, envoys, HORIZON_MS);
        let config = combo.config_json();
        let kvs: Vec<Rc<MemoryKv>> = (0..envoys).map(|_| Rc::new(MemoryKv::new())).collect();
        let skews = (0..envoys).map(|_| rng.range(0, 40)).collect();
        let grace_ms = if combo.is_etcd() { 2 * ETCD_TIMEOUT_MS + 2 * faults.etcd_latency_max + 300 } else { 200 };
        let mut w = World {
            combo,
            config,
            rng,
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
            calls_in_trouble: vec![0; clusters],
            lost_calls: Vec::new(),
            fence_max: BTreeMap::new(),
            owned_until: BTreeMap::new(),
            grace_ms,
            end_ms: None,
            check: Checker::default(),
            trace: trace.then(Vec::new),
            events: 0,
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
        // Drawn apart, so that the rest of a seed's run does not depend on it.
        let mut update = Rng::new(seed ^ 0xC0F1_6A7E);
        if update.chance(300) {
            let envoy = update.range(0, envoys as u64 - 1) as usize;
            w.queue.push(update.range(500, HORIZON_MS), Ev::ConfigUpdate { envoy });
        }
        w
    }

    fn add_vm(&mut self, envoy: usize) {
        let config = match Config::parse(self.config.as_bytes()) {
            Ok(c) => c,
            Err(e) => panic!("the simulator's configuration {} does not load: {e}", self.config),
        };
        let kv = self.kvs[envoy].clone();
        let rng = &mut self.rng;
        let lifecycle = match crate::build::lifecycle(config, kv, &mut || rng.next()) {
            Ok(l) => l,
            Err(e) => panic!("lifecycle: {e}"),
        };
        let tick_ms = lifecycle.tick_ms();
        let vm = self.vms.len();
        let first_tick = self.rng.range(1, tick_ms);
        self.vms.push(Vm { envoy, lifecycle, next_id: 2, tick_ms, draining: false, finished: false });
        self.active[envoy].push(vm);
        self.queue.push(first_tick, Ev::Tick { vm });
    }

    fn log(&mut self, line: impl FnOnce() -> String) {
        if let Some(trace) = &mut self.trace {
            trace.push(format!("{:>7} {}", self.now, line()));
        }
    }

    /// The clock of the Envoy that runs `vm`: skewed, and stepped as the seed drew. It starts
    /// at `CLOCK_BASE_MS` so that a step back never goes below zero.
    fn clock(&self, vm: usize) -> u64 {
        let envoy = self.vms[vm].envoy;
        let stepped = (self.now + CLOCK_BASE_MS) as i64 + self.faults.stepped(envoy, self.now);
        stepped as u64 + self.skews[envoy]
    }

    pub fn run(mut self) -> Report {
        let (etcd, pauses) = (format!("{:?}", self.faults.etcd), format!("{:?}", self.faults.pauses));
        let steps = format!("{:?}", self.faults.steps);
        let (latency, lost) = (self.faults.etcd_latency_max, (self.faults.lose_before, self.faults.lose_after));
        self.log(|| {
            format!("faults: etcd {etcd}, latency up to {latency} ms, lost per mille {lost:?}, paused {pauses}, clock steps {steps}")
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
            if let Some(envoy) = ev.envoy(&self) {
                if let Some(until) = self.faults.paused_until(envoy, at) {
                    self.queue.push(until, ev);
                    continue;
                }
            }
            self.events += 1;
            self.step(ev);
            self.note_owned();
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
        let body = format!("{{\"amount\":{}}}", 10 + variant).into_bytes();
        self.reqs.push(Req {
            client,
            key,
            vm,
            id,
            sent: self.now,
            state: ReqState::Waiting,
            answered_at: None,
            open: true,
            request_paused: false,
            response_paused: None,
            held_ever: false,
            headers: headers.clone(),
            set_headers: None,
            set_body: None,
            flight: None,
            record: None,
        });
        self.streams.insert((vm, id), r);
        if self.rng.chance(250) {
            let at = self.now + self.rng.range(0, 2_500);
            self.queue.push(at, Ev::Leave { req: r });
        }
        self.log(|| format!("client {client} sends req {r} key {key:?} v{variant} to vm {vm} stream {id}"));
        let host = SimHost { now: self.clock(vm), request: headers, body, ..SimHost::default() };
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
        let envoy = self.vms[self.reqs[r].vm].envoy;
        let paused: u64 = self.faults.pauses[envoy].iter().map(|(a, b)| b - a).sum();
        if late > ANSWER_BOUND_MS + paused {
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
        self.end_stream(r);
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
        let effects = self.vms[vm].lifecycle.take_effects();
        for effect in effects {
            self.effect(vm, effect);
        }
        self.note_held(vm);
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
            Effect::Dispatch { call: CallId::Store(n), request } => self.etcd_send(vm, n, request),
            Effect::Dispatch { call: CallId::Upstream(n), request } => self.detached_send(vm, n, request),
            Effect::WakeRoot => self.queue.push(self.now, Ev::Wake { vm }),
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
                let trailers = crate::grpc::trailers_and_headers(response);
                Got {
                    status: response.status(),
                    grpc: crate::grpc::status_of(trailers),
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

    /// Which streams are held as duplicates now (wait mode).
    fn note_held(&mut self, vm: usize) {
        let open: Vec<usize> = self
            .streams
            .range((vm, 0)..=(vm, u32::MAX))
            .map(|(_, r)| *r)
            .filter(|r| self.reqs[*r].open && !self.reqs[*r].held_ever)
            .collect();
        for r in open {
            if self.vms[vm].lifecycle.phase_name(self.reqs[r].id) == Some(PhaseName::Waiting) {
                self.reqs[r].held_ever = true;
            }
        }
    }

    /// Per key, until when something owns it (plus a grace for answers on their way).
    fn note_owned(&mut self) {
        let mut owned: Vec<(KeyId, u64)> = Vec::new();
        for (vm, v) in self.vms.iter().enumerate() {
            for id in v.lifecycle.work_streams() {
                if let Some(r) = self.streams.get(&(vm, id)) {
                    owned.push((self.reqs[*r].key, self.now + self.grace_ms));
                }
            }
        }
        for f in &self.flights {
            if !f.claimed {
                continue;
            }
            match f.state {
                FlightState::Running => owned.push((f.key, self.now + self.grace_ms)),
                FlightState::Orphaned => owned.push((
                    f.key,
                    f.start.max(self.now.min(f.start + f.latency)) + LEASE_MS + self.grace_ms + 2 * LEASE_MS,
                )),
                _ => {}
            }
        }
        for (key, until) in owned {
            let e = self.owned_until.entry(key).or_insert(0);
            *e = (*e).max(until);
        }
    }

    // --- etcd ------------------------------------------------------------------------------

    fn etcd_send(&mut self, vm: usize, call: u64, request: CallRequest) {
        let cluster = request.cluster.strip_prefix("etcd").and_then(|n| n.parse::<usize>().ok()).unwrap_or(0);
        self.store_calls.insert((vm, call), false);
        if let crate::store::CallKind::Grpc { method, .. } = &request.kind {
            self.log(|| format!("vm {vm} etcd call {call}: {method}"));
        }
        let timeout = request.timeout_ms.max(1);
        let timeout_answer = crate::store::etcd::grpc::status_answer(4, "upstream request timeout");
        self.queue.push(self.now + timeout, Ev::EtcdAnswer { vm, call, answer: timeout_answer });
        let trouble = self.faults.trouble(cluster, self.now);
        if trouble.is_some() {
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
            self.note_lost(vm, &request);
            return;
        }
        let mut at = self.now + self.rng.range(1, self.faults.etcd_latency_max);
        if let Some(w) = self.faults.trouble(cluster, at).filter(|w| w.trouble == Trouble::Stalled) {
            at = w.to; // waits in the stopped process's socket
        }
        self.queue.push(at, Ev::EtcdArrive { cluster, vm, call, request });
    }

    fn note_lost(&mut self, vm: usize, request: &CallRequest) {
        let Some(key) = crate::store::etcd::model::Model::txn_key(request) else { return };
        if self.lost_calls.len() <= vm {
            self.lost_calls.resize(vm + 1, Vec::new());
        }
        self.lost_calls[vm].push((self.now, key));
    }

    /// The etcd key of a simulated key, as the plugin names it (its store key from the
    /// request's `:authority`, scope and key).
    fn etcd_key(key: KeyId) -> Vec<u8> {
        let scope = format!("Bearer s{}", key.0);
        let store_key =
            crate::key::StoreKey::derive("idem", b"api", &[Some(scope.as_bytes())], format!("k{}", key.1).as_bytes());
        crate::store::etcd::protocol::key_name("idem", &store_key.0)
    }

    fn etcd_arrive(&mut self, cluster: usize, vm: usize, call: u64, request: CallRequest) {
        let trouble = self.faults.trouble(cluster, self.now).map(|w| w.trouble);
        if trouble == Some(Trouble::Down) {
            let refused = crate::store::etcd::grpc::status_answer(14, "upstream connect error");
            self.queue.push(self.now + 1, Ev::EtcdAnswer { vm, call, answer: refused });
            return;
        }
        if let Some(w) = self.faults.trouble(cluster, self.now).filter(|w| w.trouble == Trouble::NoLeader) {
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
        let model = &mut self.etcd[cluster];
        model.no_space = trouble == Some(Trouble::NoSpace);
        let answer = model.handle(&request, self.now);
        model.no_space = false;
        if self.rng.chance(self.faults.lose_after) {
            self.log(|| format!("etcd call {call} of vm {vm} applied, its answer lost"));
            self.note_lost(vm, &request);
            return;
        }
        let at = self.now + self.rng.range(1, self.faults.etcd_latency_max);
        self.queue.push(at, Ev::EtcdAnswer { vm, call, answer });
    }

    fn etcd_deliver(&mut self, vm: usize, call: u64, answer: CallAnswer) {
        match self.store_calls.get_mut(&(vm, call)) {
            Some(delivered) if !*delivered => *delivered = true,
            _ => return,
        }
        if self.root_gone(vm, "an etcd answer") {
            return;
        }
        let status = crate::store::etcd::grpc::grpc_status(&answer);
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
        let (vm, id) = (self.reqs[r].vm, self.reqs[r].id);
        let phase = self.vms[vm].lifecycle.phase_name(id);
        let loopback = phase == Some(PhaseName::GrpcReplay);
        let claimed = phase == Some(PhaseName::Owner);
        let headers = self.reqs[r].headers.clone();
        self.new_flight(r, vm, None, loopback, claimed, &headers);
    }

    fn detached_send(&mut self, vm: usize, n: u64, request: CallRequest) {
        let CallKind::Http { headers } = &request.kind else { return };
        let pairs: Headers =
            headers.iter().map(|(n, v)| (String::from_utf8_lossy(n).into_owned(), v.to_vec())).collect();
        let r = pairs
            .iter()
            .find(|(n, _)| n == "x-sim-req")
            .and_then(|(_, v)| std::str::from_utf8(v).ok()?.parse::<usize>().ok());
        let Some(r) = r else {
            self.check.fail("answer_crossed", self.now, "a detached call without its request".into());
            return;
        };
        let claimed = self.vms[vm].lifecycle.call_owner(n).flatten().is_some();
        self.new_flight(r, vm, Some(n), false, claimed, &pairs);
    }

    fn new_flight(&mut self, r: usize, vm: usize, call: Option<u64>, loopback: bool, claimed: bool, headers: &Headers) {
        let fence = headers.iter().find(|(n, _)| n == FENCE_HEADER).map(|(_, v)| v.clone());
        if self.combo.fencing && fence.as_deref() == Some(FORGED_FENCE.as_bytes()) {
            self.check.fail("forged_fence_passed", self.now, format!("req {r}"));
        }
        let fence = fence.and_then(|v| String::from_utf8(v).ok()?.parse::<u64>().ok());
        let f = self.flights.len();
        let key = self.reqs[r].key;
        self.flights.push(Flight {
            req: r,
            key,
            vm,
            call,
            loopback,
            claimed,
            fence,
            start: self.now,
            state: FlightState::Running,
            answer: Response::default(),
            storable: false,
            latency: 0,
        });
        if call.is_none() {
            self.reqs[r].flight = Some(f);
        }
        self.log(|| {
            format!(
                "flight {f}: req {r} upstream ({}, claimed {claimed}, fence {fence:?}, loopback {loopback})",
                if call.is_some() { "detached" } else { "router" }
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
        let key = self.flights[f].key;
        if self.combo.fencing {
            let (claimed, fence) = (self.flights[f].claimed, self.flights[f].fence);
            match (claimed, fence) {
                (true, None) => self.check.fail("fence_missing", self.now, format!("flight {f}")),
                (false, Some(_)) => {
                    self.check.fail("fence_missing", self.now, format!("flight {f}: a token on an unclaimed request"))
                }
                _ => {}
            }
            if let Some(token) = fence {
                let reused =
                    self.flights.iter().enumerate().any(|(g, o)| g != f && o.key == key && o.fence == Some(token));
                if reused {
                    self.check.fail("fence_reused", self.now, format!("flight {f} token {token}"));
                }
                let max = self.fence_max.entry(key).or_insert(0);
                if token <= *max {
                    self.flights[f].state = FlightState::Fenced;
                    self.flights[f].answer = plain(409, b"fenced: a newer claim ran".to_vec());
                    self.queue.push(self.now + 1, Ev::UpstreamAnswer { flight: f });
                    return;
                }
                *max = token;
            }
        }
        self.check_effect(f);
        let (answer, storable, latency) = self.plan(f);
        self.flights[f].answer = answer;
        self.flights[f].latency = latency;
        let storable_now = storable;
        self.log(|| format!("flight {f} effect on key {key:?}; answers in {latency} ms (storable {storable_now})"));
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
        let grpc = crate::grpc::status_of(
            answer.headers.iter().chain(answer.trailers.iter()).map(|(n, v)| (n.as_str(), v.as_slice())),
        );
        let replayed = answer.headers.iter().any(|(n, _)| n == "idempotent-replayed");
        let got = Got { status: answer.status, grpc, body: answer.body, replayed, problem: None };
        self.got(r, got);
        self.queue.push(self.now, Ev::StreamDone { req: r });
    }

    // --- checks --------------------------------------------------------------------------

    /// The upstream is about to do flight `f`'s work: may it?
    fn check_effect(&mut self, f: usize) {
        let (key, claimed, r) = (self.flights[f].key, self.flights[f].claimed, self.flights[f].req);
        let held = self.reqs[r].held_ever;
        for (g, other) in self.flights.iter().enumerate() {
            if g == f || other.key != key || other.loopback || !other.claimed {
                continue;
            }
            let blocking = match other.state {
                FlightState::Running => true,
                FlightState::Done { storable } => storable,
                FlightState::Orphaned | FlightState::Fenced => false,
            };
            if !blocking {
                continue;
            }
            // From the other's request: its claim may have waited for a paused worker.
            let envoy = self.vms[other.vm].envoy;
            let since = self.reqs[other.req].sent;
            // Each of the owner VM's calls lost meanwhile cost it a timeout of waiting.
            let etcd_key = Self::etcd_key(key);
            let lost = self.lost_calls.get(other.vm).map_or(0, |calls| {
                calls.iter().filter(|(t, k)| (since..=self.now).contains(t) && *k == etcd_key).count()
            });
            if self.faults.may_lose_lease(envoy, since, self.now, LEASE_MS, lost as u64 * ETCD_TIMEOUT_MS) {
                continue;
            }
            if !claimed && !held {
                continue; // on_unavailable "pass": a request the plugin knew nothing of
            }
            let invariant = if !claimed && held { "held_duplicate_forwarded" } else { "duplicate_effect" };
            let detail = format!(
                "flight {f} (req {r}, claimed {claimed}, held {held}) runs key {key:?} while flight {g} (req {}) is {:?}",
                other.req, other.state
            );
            self.check.fail(invariant, self.now, detail);
            return;
        }
    }

    /// Whether one of these flights' clients had its whole answer before `sent`.
    fn answered_before(&self, flights: &[usize], sent: u64) -> bool {
        flights.iter().any(|g| {
            let req = self.flights.get(*g).and_then(|o| self.reqs.get(o.req));
            req.and_then(|q| q.answered_at).is_some_and(|at| at < sent)
        })
    }

    fn check_answer(&mut self, r: usize, key: KeyId, got: &Got) {
        let done: Vec<usize> = (0..self.flights.len())
            .filter(|g| {
                let o = &self.flights[*g];
                o.key == key && !o.loopback && matches!(o.state, FlightState::Done { storable: true })
            })
            .collect();
        let tag = parse_tag(&got.body);
        if got.replayed && got.problem.is_none() {
            let matches = |w: &World, g: usize| {
                let o = &w.flights[g];
                let same_grpc = crate::grpc::status_of(
                    o.answer.headers.iter().chain(o.answer.trailers.iter()).map(|(n, v)| (n.as_str(), v.as_slice())),
                ) == got.grpc;
                same_grpc && (o.answer.status == got.status || w.combo.is_grpc())
            };
            if got.grpc == Some(crate::grpc::FAILED_PRECONDITION) && self.combo.is_grpc() {
                // Not replayable over gRPC without the loopback: a completed call must exist.
                if done.is_empty() {
                    self.check.fail("completed_without_completion", self.now, format!("req {r}: {got:?}"));
                }
                return;
            }
            match tag {
                Some((g, scope, k)) if (scope, k) != key => {
                    self.check.fail("cross_scope", self.now, format!("req {r} of {key:?} got flight {g}'s answer"));
                }
                Some((g, _, _)) if done.contains(&g) && matches(self, g) => {}
                _ if got.body.is_empty()
                    && got.grpc.is_some_and(|c| c != 0)
                    && done.iter().any(|g| matches(self, *g)) => {}
                _ => {
                    let detail = format!("req {r} of {key:?} replayed {got:?}; completed flights {done:?}");
                    self.check.fail("replay_differs", self.now, detail);
                }
            }
            return;
        }
        if let Some((g, _, _)) = tag.filter(|_| got.problem.is_none()) {
            if self.flights.get(g).is_none_or(|o| o.req != r) {
                self.check.fail("answer_crossed", self.now, format!("req {r} got flight {g}'s answer"));
            }
        }
        match got.problem {
            Some("response-not-stored") if done.is_empty() => {
                self.check.fail("completed_without_completion", self.now, format!("req {r} of {key:?}"));
            }
            // A full write budget refuses new keys only: a key whose first call had its answer
            // before this one was sent replays (unless a fault may have kept its completion out
            // of etcd). A call still completing may not have its claim in etcd when this one reads.
            Some("share-full")
                if self.answered_before(&done, self.reqs[r].sent) && !self.faults.any_between(0, self.now) =>
            {
                self.check.fail("share_full_for_a_stored_key", self.now, format!("req {r} of {key:?}"));
            }
            Some("in-progress") => {
                let owned = self.owned_until.get(&key).copied().unwrap_or(0);
                let from = self.now.saturating_sub(LEASE_MS + 2 * self.grace_ms);
                if owned < self.now && !self.faults.any_between(from, self.now) {
                    let detail = format!("req {r}: 409 for {key:?}, owned until {owned}");
                    self.check.fail("locked_without_owner", self.now, detail);
                }
            }
            _ => {}
        }
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
            effects: self.flights.iter().filter(|f| !f.loopback && f.state != FlightState::Fenced).count(),
            events: self.events,
            violations: self.check.violations,
            trace: self.trace.unwrap_or_default(),
        }
    }
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
fn parse_tag(body: &[u8]) -> Option<(usize, u64, u64)> {
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
        crate::grpc::ABORTED => Some("in-progress"),
        crate::grpc::FAILED_PRECONDITION if message.contains("not stored") => Some("response-not-stored"),
        crate::grpc::FAILED_PRECONDITION => None,
        crate::grpc::OK => None,
        _ if message.contains("eff:") => None,
        _ => Some("grpc-error"),
    }
}

/// The `:status` of a header map, 0 when absent.
fn status_in(headers: &Headers) -> u16 {
    let value = headers.iter().find(|(n, _)| n == ":status").map(|(_, v)| v.as_slice());
    value.and_then(|v| std::str::from_utf8(v).ok()?.parse().ok()).unwrap_or(0)
}
