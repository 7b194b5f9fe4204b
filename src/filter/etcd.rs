//! The fleet store: etcd, reached through its JSON gateway with `dispatch_http_call` from the
//! root context, so that answers reach us even when the client's stream has ended (SPEC §4).
//!
//! One etcd key per idempotency key. A claim is one transaction (create if absent, else read);
//! a takeover, renewal, completion or release compares the key's `mod_revision` with the one
//! this owner last wrote. Marks ride one lease per VM, kept alive from `on_tick`, and carry
//! their own deadline; completed entries ride a retention lease shared by the completions of
//! a time window. Writes that etcd did not acknowledge are retried from `on_tick`; a claim
//! whose answer was lost (timeout) is cleaned up by a delete-if-value, retried likewise.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

use super::answer_client;
use super::detached::{pass_through, promote};
use super::{host, send_stored, Outbound, Owner, Vm};
use crate::config::{EtcdConfig, OnConflict, OnUnavailable};
use crate::engine::{decide_entry, Decision};
use crate::entry::{decode_entry, encode_entry, State, StoredResponse, Way};
use crate::fingerprint::Fingerprint;
use crate::metrics::Counter;
use crate::problem::Problem;
use crate::store::etcd::{self as proto, Backoff, ErrorKind, EtcdError, Kv, TxnResult};

/// How often a held request (wait mode) asks etcd again.
const WAIT_POLL_MS: u64 = 100;
/// Rounds of claim/takeover for one request before it is answered 503.
const MAX_ATTEMPTS: u8 = 6;
/// How often "etcd is out of space" is logged at most.
const NO_SPACE_LOG_MS: u64 = 60_000;

/// A covered request waiting for the store's word.
pub struct ClaimReq {
    pub context_id: u32,
    pub policy: usize,
    pub key: Vec<u8>,
    pub tag: [u8; 16],
    pub fingerprint: Fingerprint,
    pub outbound: Option<Outbound>,
    /// Wait mode: when the request stops waiting, once it started.
    pub wait_deadline: Option<u64>,
    pub next_poll_ms: u64,
    pub attempts: u8,
    /// The `mod_revision` of the expired entry to take over.
    pub takeover: Option<i64>,
}

/// How an owner's call ended.
pub enum Ending {
    Complete(Option<StoredResponse>),
    Release,
}

struct EtcdOwner {
    key: Vec<u8>,
    policy: usize,
    way: Way,
    mod_revision: i64,
    busy: bool,
    ending: Option<Ending>,
    /// After a refused completion or release: when to try again.
    retry: Backoff,
}

enum Op {
    Claim {
        req: ClaimReq,
        value: Vec<u8>,
        way: Way,
    },
    /// A read-only look at a key whose claim etcd refused for lack of space.
    Read {
        req: ClaimReq,
    },
    Renew {
        id: u64,
        way: Way,
    },
    End {
        id: u64,
    },
    Cleanup {
        key: Vec<u8>,
        value: Vec<u8>,
    },
    GrantReplica,
    GrantRetention(u64),
    KeepAlive,
}

pub struct Etcd {
    cfg: EtcdConfig,
    lease_ttl_s: u64,
    lease: Option<i64>,
    lease_pending: bool,
    keepalive_ms: u64,
    /// Retention leases by `retention_s`: (lease, usable until).
    retention: HashMap<u64, (i64, u64)>,
    retention_pending: HashSet<u64>,
    owners: HashMap<u64, EtcdOwner>,
    next_owner: u64,
    claims: VecDeque<ClaimReq>,
    held: Vec<ClaimReq>,
    inflight: HashMap<u32, Op>,
    cleanups: Vec<(Vec<u8>, Vec<u8>)>,
    token_seed: u64,
    /// Whether etcd answers at all: after a failure every request waits for the backoff, and
    /// then one request at a time probes (SPEC §3.8: a store that fails is never hammered).
    health: Backoff,
    probe: Option<u32>,
    /// Lease grants, keepalives and cleanups that etcd refused: retried after this.
    background: Backoff,
    no_space_logged_ms: u64,
}

impl Etcd {
    pub fn new(cfg: EtcdConfig, max_lease_ms: u64) -> Etcd {
        Etcd {
            cfg,
            lease_ttl_s: max_lease_ms.div_ceil(1000).max(3),
            lease: None,
            lease_pending: false,
            keepalive_ms: 0,
            retention: HashMap::new(),
            retention_pending: HashSet::new(),
            owners: HashMap::new(),
            next_owner: 1,
            claims: VecDeque::new(),
            held: Vec::new(),
            inflight: HashMap::new(),
            cleanups: Vec::new(),
            token_seed: RandomState::new().build_hasher().finish(),
            health: Backoff::default(),
            probe: None,
            background: Backoff::default(),
            no_space_logged_ms: 0,
        }
    }

    /// A fresh owner token: the mark's value must differ from every other claim's, so that a
    /// delete-if-value only ever removes our own mark.
    fn token(&mut self) -> u64 {
        let mut h = RandomState::new().build_hasher();
        h.write_u64(self.token_seed);
        h.write_u64(self.next_owner);
        self.next_owner += 1;
        h.finish()
    }
}

/// A random number, for the backoff's jitter.
fn random() -> u64 {
    RandomState::new().build_hasher().finish()
}

fn with<T>(vm: &Vm, f: impl FnOnce(&mut Etcd) -> T) -> Option<T> {
    vm.etcd.as_ref().map(|e| f(&mut e.borrow_mut()))
}

/// A stream's claim: queued for the root, which sends it.
pub fn submit_claim(vm: &Vm, req: ClaimReq) {
    with(vm, |e| e.claims.push_back(req));
    vm.kick();
}

/// The owner's call ended: queue its completion or release.
pub fn end(vm: &Vm, id: u64, ending: Ending) {
    with(vm, |e| {
        if let Some(o) = e.owners.get_mut(&id) {
            o.ending = Some(ending);
        }
    });
    vm.kick();
}

/// Extends an owner's mark (from `on_tick`), unless a write of it is in flight.
pub fn renew(vm: &Vm, id: u64, now: u64, lease_ms: u64) {
    let job = with(vm, |e| {
        let lease = e.lease?;
        let o = e.owners.get_mut(&id)?;
        if o.busy || o.ending.is_some() {
            return None;
        }
        let way = Way { deadline_ms: now.saturating_add(lease_ms), ..o.way };
        o.busy = true;
        Some((proto::replace_txn(&o.key, o.mod_revision, &encode_entry(&way, None), lease), way))
    })
    .flatten();
    if let Some((body, way)) = job {
        if !send(vm, proto::TXN_PATH, &body, Op::Renew { id, way }) {
            with(vm, |e| e.owners.get_mut(&id).map(|o| o.busy = false));
        }
    }
}

/// Timer work: keepalive, held requests due for another look, retries; then send.
pub fn tick(vm: &Vm, now: u64) {
    let keepalive = with(vm, |e| {
        // A keepalive is also the probe that finds etcd back once the backoff has passed,
        // without waiting for client traffic.
        let probe_due = e.health.failing() && e.health.ready(now) && e.probe.is_none();
        let due = e.lease.is_some()
            && e.background.ready(now)
            && (probe_due || now.saturating_sub(e.keepalive_ms) >= e.lease_ttl_s * 1000 / 3);
        if due {
            e.keepalive_ms = now;
        }
        let (ready, waiting): (Vec<_>, Vec<_>) =
            std::mem::take(&mut e.held).into_iter().partition(|r| r.next_poll_ms <= now);
        e.held = waiting;
        e.claims.extend(ready);
        due.then_some(e.lease).flatten()
    })
    .flatten();
    if let Some(lease) = keepalive {
        send(vm, proto::KEEPALIVE_PATH, &proto::keepalive_body(lease), Op::KeepAlive);
    }
    pump(vm, now);
}

/// Sends what can be sent: the lease first, then claims, owners' endings and cleanups.
pub fn pump(vm: &Vm, now: u64) {
    let Some(cell) = vm.etcd.as_ref() else { return };
    // Keep a retention lease ready for every policy's retention, so that completions do not
    // wait for a grant. Grants and cleanups that etcd refused wait for their backoff.
    let background = cell.borrow().background.ready(now);
    let retentions: Vec<u64> =
        if background { vm.config.policies().map(|p| p.retention_s).collect() } else { Vec::new() };
    for retention_s in retentions {
        let grant = {
            let mut e = cell.borrow_mut();
            let fresh = e
                .retention
                .get(&retention_s)
                .is_some_and(|(_, until)| now + retention_slack_s(retention_s) * 500 < *until);
            !fresh && e.retention_pending.insert(retention_s)
        };
        if grant {
            let ttl = retention_s + retention_slack_s(retention_s);
            if !send(vm, proto::GRANT_PATH, &proto::grant_body(ttl), Op::GrantRetention(retention_s)) {
                cell.borrow_mut().retention_pending.remove(&retention_s);
            }
        }
    }
    let need_lease = {
        let mut e = cell.borrow_mut();
        let need = e.lease.is_none() && !e.lease_pending && e.background.ready(now);
        if need {
            e.lease_pending = true;
        }
        need
    };
    if need_lease {
        let ttl = cell.borrow().lease_ttl_s;
        if !send(vm, proto::GRANT_PATH, &proto::grant_body(ttl), Op::GrantReplica) {
            cell.borrow_mut().lease_pending = false;
        }
    }
    {
        // No lease and none coming: the queued claims cannot be sent.
        let e = cell.borrow();
        let stuck = e.lease.is_none() && !e.lease_pending && !e.claims.is_empty();
        drop(e);
        if stuck {
            fail_claims(vm);
        }
    }
    // Claims, once the VM's lease exists.
    loop {
        let next = {
            let mut e = cell.borrow_mut();
            match e.lease {
                Some(lease) => e.claims.pop_front().map(|req| (req, lease, e.token())),
                None => None,
            }
        };
        let Some((req, lease, token)) = next else { break };
        send_claim(vm, req, lease, token, now);
    }
    // Owners whose call ended and whose last write is acknowledged.
    let ready: Vec<u64> = cell
        .borrow()
        .owners
        .iter()
        .filter(|(_, o)| o.ending.is_some() && !o.busy && o.retry.ready(now))
        .map(|(id, _)| *id)
        .collect();
    for id in ready {
        send_end(vm, id, now);
    }
    let cleanups = if background { std::mem::take(&mut cell.borrow_mut().cleanups) } else { Vec::new() };
    for (key, value) in cleanups {
        let body = proto::delete_if_value_txn(&key, &value);
        if !send(vm, proto::TXN_PATH, &body, Op::Cleanup { key: key.clone(), value: value.clone() }) {
            cell.borrow_mut().cleanups.push((key, value));
        }
    }
}

fn send_claim(vm: &Vm, req: ClaimReq, lease: i64, token: u64, now: u64) {
    let lease_ms = vm.policy(req.policy).lease_ms;
    let way = Way {
        state: State::InProgress,
        gen: token,
        key: req.tag,
        fingerprint: req.fingerprint,
        deadline_ms: now.saturating_add(lease_ms),
        since_ms: now,
        bytes: 0,
    };
    let value = encode_entry(&way, None);
    let body = match req.takeover {
        Some(mod_revision) => proto::replace_txn(&req.key, mod_revision, &value, lease),
        None => proto::claim_txn(&req.key, &value, lease),
    };
    let (context_id, policy, outbound) = (req.context_id, req.policy, req.outbound.clone());
    if !send(vm, proto::TXN_PATH, &body, Op::Claim { req, value, way }) {
        unavailable(vm, context_id, policy, outbound);
    }
}

fn send_end(vm: &Vm, id: u64, now: u64) {
    let Some(cell) = vm.etcd.as_ref() else { return };
    let body = {
        let mut e = cell.borrow_mut();
        let retention_s = match e.owners.get(&id) {
            Some(o) => vm.policy(o.policy).retention_s,
            None => return,
        };
        let usable = e.retention.get(&retention_s).filter(|(_, until)| now < *until).map(|(l, _)| *l);
        let Some(o) = e.owners.get_mut(&id) else { return };
        match &mut o.ending {
            Some(Ending::Release) => {
                o.busy = true;
                proto::delete_txn(&o.key, o.mod_revision)
            }
            Some(Ending::Complete(response)) => {
                let Some(lease) = usable else {
                    // Completed entries ride a retention lease: get one first.
                    if e.retention_pending.insert(retention_s) {
                        drop(e);
                        let ttl = retention_s + retention_slack_s(retention_s);
                        if !send(vm, proto::GRANT_PATH, &proto::grant_body(ttl), Op::GrantRetention(retention_s)) {
                            cell.borrow_mut().retention_pending.remove(&retention_s);
                        }
                    }
                    return;
                };
                let state = if response.is_some() { State::Completed } else { State::CompletedNoBody };
                let bytes = response.as_ref().map_or(0, |r| r.stored_len() as u32);
                let deadline_ms = now.saturating_add(retention_s * 1000);
                let way = Way { state, deadline_ms, since_ms: now, bytes, ..o.way };
                if let Some(r) = response.as_mut() {
                    r.stamp(way.gen, &way.key);
                }
                o.busy = true;
                proto::replace_txn(&o.key, o.mod_revision, &encode_entry(&way, response.as_ref()), lease)
            }
            None => return,
        }
    };
    if !send(vm, proto::TXN_PATH, &body, Op::End { id }) {
        with(vm, |e| e.owners.get_mut(&id).map(|o| o.busy = false));
    }
}

/// Completed entries may outlive their retention by this much before etcd drops them: one
/// retention lease serves all completions of such a window.
fn retention_slack_s(retention_s: u64) -> u64 {
    (retention_s / 10).clamp(1, 600)
}

/// Sends one request to etcd from the root context; `false` if it could not be sent.
fn send(vm: &Vm, path: &str, body: &[u8], op: Op) -> bool {
    let Some(cell) = vm.etcd.as_ref() else { return false };
    let now = vm.now_ms();
    let (cluster, authority, timeout, probing) = {
        let e = cell.borrow();
        // Unreachable: wait for the backoff, then let one request at a time find out.
        if e.health.failing() && (e.probe.is_some() || !e.health.ready(now)) {
            return false;
        }
        (e.cfg.cluster.clone(), e.cfg.authority.clone(), Duration::from_millis(e.cfg.timeout_ms), e.health.failing())
    };
    let headers = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", authority.as_str()),
        ("content-type", "application/json"),
    ];
    match host::dispatch(&cluster, headers, body, timeout) {
        Ok(token) => {
            let mut e = cell.borrow_mut();
            e.inflight.insert(token, op);
            if probing {
                e.probe = Some(token);
            }
            true
        }
        Err(status) => {
            log::warn!("etcd: cannot send to cluster {cluster:?}: {status:?}");
            cell.borrow_mut().health.fail(now, random());
            false
        }
    }
}

/// An answer from etcd, if `token` is one of ours.
pub fn on_answer(vm: &Vm, token: u32, status: u16, body: &[u8], now: u64) -> bool {
    let Some(op) = with(vm, |e| e.inflight.remove(&token)).flatten() else { return false };
    let unreachable = proto::is_unreachable(status, body);
    with(vm, |e| {
        let probe = e.probe == Some(token);
        if probe {
            e.probe = None;
        }
        if !unreachable {
            e.health.succeed();
        } else if probe || !e.health.failing() {
            // Answers to requests sent before the first failure do not grow the backoff.
            e.health.fail(now, random());
            log::warn!("etcd: no answer (status {status}); backing off");
        }
    });
    match op {
        Op::Claim { req, value, way } => on_claim(vm, req, value, way, proto::parse_txn(status, body), now),
        Op::Read { req } => match proto::parse_range(status, body) {
            Ok(Some(kv)) => judge_existing(vm, req, kv, now, false),
            Ok(None) | Err(_) => unavailable(vm, req.context_id, req.policy, req.outbound),
        },
        Op::Renew { id, way } => {
            let result = proto::parse_txn(status, body);
            note_no_space(vm, &result, now);
            let lost = with(vm, |e| {
                let lost = matches!(result, Ok(TxnResult { succeeded: false, .. }));
                if let Err(err) = &result {
                    forget_dead_lease(e, err);
                }
                if let Some(o) = e.owners.get_mut(&id) {
                    o.busy = false;
                    if let Ok(TxnResult { succeeded: true, revision, .. }) = result {
                        o.mod_revision = revision;
                        o.way = way;
                    }
                }
                if lost {
                    e.owners.remove(&id);
                }
                lost
            });
            if lost == Some(true) {
                vm.count(Counter::OwnerLost);
            }
        }
        Op::End { id } => {
            let result = proto::parse_txn(status, body);
            note_no_space(vm, &result, now);
            let outcome = with(vm, |e| match &result {
                Ok(r) => e.owners.remove(&id).map(|o| (r.succeeded, o.ending)),
                Err(err) => {
                    if err.is_lease_not_found() {
                        e.retention.clear();
                    }
                    if let Some(o) = e.owners.get_mut(&id) {
                        // Retried after a backoff until etcd acknowledges it. A response over
                        // etcd's request limit is completed without its body instead.
                        o.busy = false;
                        if err.kind() == ErrorKind::TooLarge {
                            if let Some(Ending::Complete(response)) = &mut o.ending {
                                log::warn!("etcd: the response is over etcd's request limit; completing without it");
                                *response = None;
                            }
                        } else {
                            o.retry.fail(now, random());
                        }
                    }
                    None
                }
            })
            .flatten();
            match outcome {
                Some((true, Some(Ending::Release))) => vm.count(Counter::Released),
                Some((true, Some(Ending::Complete(response)))) => {
                    vm.count(Counter::Completed);
                    if response.is_none() {
                        vm.count(Counter::ResponseNotStored);
                    }
                }
                Some((false, _)) => vm.count(Counter::OwnerLost),
                _ => {
                    if let Err(err) = result {
                        log::warn!("etcd: completion or release not acknowledged ({err:?}); retrying");
                        vm.count(Counter::StoreError);
                    }
                }
            }
        }
        Op::Cleanup { key, value } => {
            if proto::parse_txn(status, body).is_err() {
                with(vm, |e| {
                    e.cleanups.push((key, value));
                    e.background.fail(now, random());
                });
            }
        }
        Op::GrantReplica => match proto::parse_grant(status, body) {
            Ok(lease) => {
                with(vm, |e| {
                    e.lease = Some(lease);
                    e.lease_pending = false;
                    e.keepalive_ms = now;
                });
            }
            Err(err) => {
                log::warn!("etcd: lease grant failed: {err:?}");
                with(vm, |e| {
                    e.lease_pending = false;
                    e.background.fail(now, random());
                });
                fail_claims(vm);
            }
        },
        Op::GrantRetention(retention_s) => {
            let granted = proto::parse_grant(status, body);
            with(vm, |e| {
                e.retention_pending.remove(&retention_s);
                match granted {
                    Ok(lease) => {
                        e.retention.insert(retention_s, (lease, now + retention_slack_s(retention_s) * 1000));
                    }
                    Err(_) => e.background.fail(now, random()),
                }
            });
        }
        Op::KeepAlive => {
            if let Ok(false) = proto::parse_keepalive(status, body) {
                log::warn!("etcd: the VM's lease expired; granting a new one");
                with(vm, |e| e.lease = None);
            }
        }
    }
    pump(vm, now);
    true
}

fn forget_dead_lease(e: &mut Etcd, err: &EtcdError) {
    if err.is_lease_not_found() {
        e.lease = None;
    }
}

/// The lease could not be had: the queued claims are answered per `on_unavailable`.
fn fail_claims(vm: &Vm) {
    let claims: Vec<ClaimReq> = with(vm, |e| e.claims.drain(..).collect()).unwrap_or_default();
    for req in claims {
        unavailable(vm, req.context_id, req.policy, req.outbound);
    }
}

fn on_claim(vm: &Vm, mut req: ClaimReq, value: Vec<u8>, way: Way, result: Result<TxnResult, EtcdError>, now: u64) {
    let policy = vm.policy(req.policy);
    let retry = retry_claim;
    match result {
        Ok(TxnResult { succeeded: true, revision, .. }) => {
            vm.count(Counter::Claimed);
            if req.takeover.is_some() {
                vm.count(Counter::ExpiredTakeover);
            }
            let id = with(vm, |e| {
                let id = e.next_owner;
                e.next_owner += 1;
                e.owners.insert(
                    id,
                    EtcdOwner {
                        key: req.key.clone(),
                        policy: req.policy,
                        way,
                        mod_revision: revision,
                        busy: false,
                        ending: None,
                        retry: Backoff::default(),
                    },
                );
                id
            })
            .unwrap_or(0);
            log::debug!("etcd: claimed {} (takeover: {})", hex_tail(&req.key), req.takeover.is_some());
            // The lease counts from when the claim left, not from its answer.
            let leased_ms = way.deadline_ms.saturating_sub(policy.lease_ms);
            promote(vm, req.context_id, req.policy, req.outbound, Owner::Etcd(id), leased_ms);
        }
        Ok(TxnResult { current: None, .. }) => {
            // The key vanished between compare and read (released, or its lease ended).
            req.takeover = None;
            retry(vm, req);
        }
        Ok(TxnResult { current: Some(kv), .. }) => judge_existing(vm, req, kv, now, true),
        Err(err) if err.kind() == ErrorKind::NoSpace => {
            // etcd refuses writes, reads still work: a stored answer replays, an in-progress
            // mark still conflicts; a new key cannot be claimed (on_unavailable).
            note_no_space(vm, &Err::<(), _>(err), now);
            let (context_id, policy, outbound) = (req.context_id, req.policy, req.outbound.clone());
            if !send(vm, proto::RANGE_PATH, &proto::range_body(&req.key), Op::Read { req }) {
                unavailable(vm, context_id, policy, outbound);
            }
        }
        Err(err) => {
            if err.is_lease_not_found() {
                with(vm, |e| forget_dead_lease(e, &err));
                retry(vm, req);
                return;
            }
            log::warn!("etcd: claim failed: {err:?}");
            if matches!(err, EtcdError::Status { status: 504, .. }) {
                // The claim may have been applied after its answer was lost: remove our mark
                // (only ours: the value carries our token), retried until etcd answers.
                with(vm, |e| e.cleanups.push((req.key.clone(), value)));
            }
            unavailable(vm, req.context_id, req.policy, req.outbound);
        }
    }
}

/// The key holds an entry: conflict, replay, mismatch, or (expired, and `writable`) another
/// round to take it over.
fn judge_existing(vm: &Vm, mut req: ClaimReq, kv: Kv, now: u64, writable: bool) {
    let policy = vm.policy(req.policy);
    // An entry must be of this key: a value copied from another key is foreign.
    let decoded = decode_entry(&kv.value).and_then(|(entry, response)| {
        if entry.key == req.tag {
            Ok((entry, response))
        } else {
            Err(crate::entry::Corrupt("entry: of another key"))
        }
    });
    let (entry, response) = match decoded {
        Ok(decoded) => decoded,
        Err(e) => {
            let p = vm.store_problem(crate::engine::StoreError::Corrupt(e.0), policy.retry_after_s);
            answer_client(vm, req.context_id, |vm| vm.reply_problem(&p));
            return;
        }
    };
    match decide_entry(Some(&entry), &req.fingerprint, now) {
        Decision::Claim { .. } if writable => {
            req.takeover = Some(kv.mod_revision);
            retry_claim(vm, req);
        }
        Decision::Claim { .. } => unavailable(vm, req.context_id, req.policy, req.outbound),
        Decision::InProgress => conflict(vm, req, now),
        Decision::Completed { no_body: false, .. } => match response {
            Some(r) => {
                vm.count(Counter::Replayed);
                answer_client(vm, req.context_id, |_| send_stored(&r, true));
            }
            None => {
                let p =
                    vm.store_problem(crate::engine::StoreError::Corrupt("entry: no response"), policy.retry_after_s);
                answer_client(vm, req.context_id, |vm| vm.reply_problem(&p));
            }
        },
        Decision::Completed { no_body: true, .. } => {
            vm.count(Counter::Conflict);
            answer_client(vm, req.context_id, |vm| vm.reply_problem(&Problem::completed_without_response()));
        }
        Decision::Mismatch | Decision::Full => {
            vm.count(Counter::FingerprintMismatch);
            answer_client(vm, req.context_id, |vm| vm.reply_problem(&Problem::fingerprint_mismatch()));
        }
    }
}

/// Another round of claim or takeover, or 503 after `MAX_ATTEMPTS`.
fn retry_claim(vm: &Vm, mut req: ClaimReq) {
    req.attempts += 1;
    if req.attempts >= MAX_ATTEMPTS {
        let p = vm.store_problem(crate::engine::StoreError::Contention, vm.policy(req.policy).retry_after_s);
        answer_client(vm, req.context_id, |vm| vm.reply_problem(&p));
    } else {
        with(vm, |e| e.claims.push_back(req));
    }
}

/// etcd refused a write for lack of space (its quota alarm): counted, and logged once a minute.
fn note_no_space<T>(vm: &Vm, result: &Result<T, EtcdError>, now: u64) {
    if !matches!(result, Err(e) if e.kind() == ErrorKind::NoSpace) {
        return;
    }
    vm.count(Counter::StoreNoSpace);
    let log_now = with(vm, |e| {
        let due = now >= e.no_space_logged_ms;
        if due {
            e.no_space_logged_ms = now + NO_SPACE_LOG_MS;
        }
        due
    });
    if log_now == Some(true) {
        log::warn!(
            "etcd refuses writes: its database is over its space quota (alarm NOSPACE). New keys follow on_unavailable; stored answers still replay. Free space (compact, defragment), then disarm the alarm (etcdctl alarm disarm)"
        );
    }
}

/// In progress: 409, or hold the request and ask again (wait mode).
fn conflict(vm: &Vm, mut req: ClaimReq, now: u64) {
    let policy = vm.policy(req.policy);
    if policy.on_conflict == OnConflict::Wait {
        let deadline = match req.wait_deadline {
            Some(d) => Some(d),
            None => {
                let held = with(vm, |e| e.held.len()).unwrap_or(0);
                (held < vm.config.max_waiters).then(|| {
                    vm.count(Counter::Waited);
                    now.saturating_add(policy.wait_max_ms)
                })
            }
        };
        if let Some(deadline) = deadline.filter(|d| now < *d) {
            if vm.live.borrow().contains(&req.context_id) {
                req.wait_deadline = Some(deadline);
                req.next_poll_ms = now + WAIT_POLL_MS;
                req.attempts = 0;
                req.takeover = None;
                with(vm, |e| e.held.push(req));
            }
            return;
        }
    }
    vm.count(Counter::Conflict);
    let p = Problem::in_progress(policy.retry_after_s);
    answer_client(vm, req.context_id, |vm| vm.reply_problem(&p));
}

/// etcd did not answer: `on_unavailable` decides.
fn unavailable(vm: &Vm, context_id: u32, policy: usize, outbound: Option<Outbound>) {
    vm.count(Counter::StoreError);
    let on_unavailable = with(vm, |e| e.cfg.on_unavailable).unwrap_or(OnUnavailable::Reject);
    match on_unavailable {
        OnUnavailable::Reject => {
            let p = Problem::store_unavailable(vm.policy(policy).retry_after_s);
            answer_client(vm, context_id, |vm| vm.reply_problem(&p));
        }
        OnUnavailable::Pass => {
            log::warn!("etcd unavailable: forwarding without idempotency (on_unavailable: pass)");
            pass_through(vm, context_id, policy, outbound);
        }
    }
}

fn hex_tail(key: &[u8]) -> String {
    String::from_utf8_lossy(key.get(key.len().saturating_sub(12)..).unwrap_or_default()).into_owned()
}
