//! The fleet store: etcd through its gRPC API (or its JSON gateway), sans I/O. It emits the requests to send
//! ([`Store::poll_call`]) and consumes their answers; its leases, revisions, retries and
//! backoff are kept here. The host adapter sends the calls from the root context, so answers
//! reach us even when a client's stream has ended (docs/behaviour.md §4).
//!
//! One etcd key per idempotency key. A request reads the key first (a Range, which etcd serves
//! without a raft proposal): a key in progress or completed is answered from that read alone,
//! so a duplicate, a replay or a wait-mode poll writes nothing. Only an absent key is claimed,
//! by one transaction (create if absent, else read back), and only an expired one taken over;
//! a takeover, renewal, completion or release compares the key's `mod_revision` with the one
//! this owner last wrote, and when the compare fails, the key's value says whether the write
//! that moved it on was ours (applied, not acknowledged) or another owner's. Marks ride one
//! lease per VM, kept alive from the timer, and carry their own deadline; completed entries
//! ride a retention lease shared by the completions of a time window. Writes that etcd did not
//! acknowledge are retried with backoff; a claim whose answer was lost (timeout) is cleaned up
//! by a delete-if-value, retried likewise.

pub mod api;
mod claims;
pub mod grpc;
pub mod json;
pub mod ledger;
pub mod local_copies;
mod owners;
pub mod protocol;
pub mod shards;

#[cfg(test)]
pub(crate) mod model;
#[cfg(test)]
mod tests;

use crate::caller::Caller;
use crate::defects::{planted, Defect};
use crate::store::etcd::ledger::{Share, Verdict};
use std::collections::{HashSet, VecDeque};

use crate::ids::IdMap;
use std::cell::RefCell;
use std::rc::Rc;

use super::{Answer, Began, CallAnswer, CallRequest, Claim, Completed, For, Owner, Store, TickReport};
use crate::encoding::{Entry, KeyTag, StoredResponse};
use crate::fingerprint::Fingerprint;
use crate::key::StoreKey;
use crate::metrics::Counter;
use api::Api;
use local_copies::Replays;
use protocol::{Backoff, ErrorKind, EtcdError, Request, Target, Write};

/// Rounds of claim/takeover for one request before it is answered 503.
const MAX_ROUNDS: u8 = 6;
/// How often "etcd is out of space" is logged at most.
const NO_SPACE_LOG_MS: u64 = 60_000;
/// What a put costs etcd besides its key and value, counted by the write ledger: the
/// revision's own key and metadata (docs/fleet.md, "The fleet's share of etcd").
const PUT_OVERHEAD_BYTES: u64 = 64;
/// How often a held request (wait mode) asks etcd again.
const WAIT_POLL_MS: u64 = 100;
/// An owner's write whose mark would expire before a try of it that hangs could time out is
/// tried again beside it after this long (docs/fleet.md, "A leader lost").
pub const HEDGE_MS: u64 = 200;
/// Such tries in flight at most, per VM and cluster: a leaderless etcd is not flooded.
const MAX_HEDGES: usize = 16;

/// One round of a request's claim: its first read, then a claim of the key found absent or
/// a takeover of the entry found expired.
#[derive(Clone)]
struct Round {
    who: For,
    store_key: StoreKey,
    key: Vec<u8>,
    tag: KeyTag,
    fingerprint: Fingerprint,
    caller: Caller,
    established: bool,
    lease_ms: u64,
    attempts: u8,
    /// When its last read was sent: only a read refused at once is read again.
    looked_ms: u64,
    /// The `mod_revision` of the expired entry to take over.
    takeover: Option<i64>,
}

/// How an owner's call ended.
enum Ending {
    Complete { response: Option<Rc<StoredResponse>>, retention_ms: u64 },
    Release,
}

struct EtcdOwner {
    owner: Owner,
    store_key: StoreKey,
    key: Vec<u8>,
    entry: Entry,
    /// The completed entry as last sent (its deadline, for the local copy).
    completed: Option<Entry>,
    mod_revision: i64,
    /// A write of it is in flight.
    busy: bool,
    /// When its last write was sent.
    tried_ms: u64,
    ending: Option<Ending>,
    /// After a refused write (ending or renewal): when to try again.
    retry: Backoff,
    /// The last refusal was etcd not answering (unreachable, timed out, no leader).
    unanswered: bool,
    /// A renewal due that has not gone yet (etcd failing, no usable lease): its `lease_ms`.
    renew_wanted: Option<u64>,
    /// The claim's `lease_ms`: a refused renewal is tried again with it.
    lease_ms: u64,
}

impl EtcdOwner {
    /// A write of its waits: its ending, or a renewal.
    fn wants_write(&self) -> bool {
        self.ending.is_some() || self.renew_wanted.is_some()
    }

    /// Its write in flight may hang past its mark's deadline (etcd without a leader answers
    /// only at the call's timeout): time to try again beside it, until the mark is surely lost.
    fn hedge_due(&self, now: u64, timeout_ms: u64, late_ms: u64) -> bool {
        let deadline = self.entry.deadline_ms;
        !planted(Defect::WriteNotHedged)
            && self.busy
            && self.wants_write()
            && now >= self.tried_ms.saturating_add(HEDGE_MS)
            && deadline < self.tried_ms.saturating_add(timeout_ms)
            && now < deadline.saturating_add(late_ms)
    }
}

enum Op {
    /// A request's first look at its key: every request starts with it.
    Look {
        round: Round,
    },
    Claim {
        round: Round,
        value: Vec<u8>,
        entry: Entry,
    },
    /// A read-only look at a key whose claim etcd refused for lack of space.
    Read {
        round: Round,
    },
    /// A claim whose answer came late renews its mark before it is answered: another
    /// replica may have taken the key over meanwhile.
    Verify {
        round: Round,
        id: u64,
        value: Vec<u8>,
        entry: Entry,
    },
    Renew {
        id: u64,
        entry: Entry,
    },
    End {
        id: u64,
    },
    Cleanup {
        key: Vec<u8>,
        value: Vec<u8>,
    },
    /// A lease for this VM's marks, asked for at `sent_ms`.
    GrantReplica {
        sent_ms: u64,
    },
    GrantRetention(u64),
}

/// How the store reaches one etcd cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub cluster: String,
    pub authority: String,
    pub api: Api,
    pub timeout_ms: u64,
    /// The JSON gateway once etcd answers a gRPC call UNIMPLEMENTED (an HTTP/1.1 cluster):
    /// see `EtcdConfig::api_fallback`.
    pub api_fallback: bool,
}

#[cfg(test)]
impl Link {
    /// The gRPC API on cluster `name` (its authority too), without the JSON fallback.
    pub fn grpc(name: &str, timeout_ms: u64) -> Link {
        Link { cluster: name.into(), authority: name.into(), api: Api::Grpc, timeout_ms, api_fallback: false }
    }
}

/// The lease this VM's marks ride. It is never kept alive: a new one is granted every
/// `lease_ttl/4`, and one is used only while it outlives any mark written with it by
/// `max_lease_ms` (docs/behaviour.md §3.8: a mark's own deadline decides; the lease only collects it).
#[derive(Debug, Clone, Copy)]
struct VmLease {
    id: i64,
    rotate_at_ms: u64,
    usable_until_ms: u64,
}

pub struct EtcdStore {
    link: Link,
    namespace: String,
    /// Every policy's `retention_s`: a retention lease is kept ready for each.
    retentions: Vec<u64>,
    max_lease_ms: u64,
    lease_ttl_s: u64,
    lease: Option<VmLease>,
    lease_pending: bool,
    /// Retention leases by `retention_s`: (lease, usable until).
    retention: IdMap<u64, (i64, u64)>,
    retention_pending: HashSet<u64>,
    owners: IdMap<u64, EtcdOwner>,
    next_owner: u64,
    /// Rounds that read their key and now write it (a claim or a takeover): each waits for a
    /// usable VM lease.
    rounds: VecDeque<Round>,
    /// Reads that did not reach etcd (a member down that Envoy still sends to), to be read
    /// again when the backoff lets a call through, each until its deadline: one dead member
    /// of three must not turn a request into a 503 at once.
    relooks: VecDeque<(Round, u64)>,
    inflight: IdMap<u64, Op>,
    outbox: VecDeque<(u64, CallRequest)>,
    answers: VecDeque<(For, Answer)>,
    counts: VecDeque<Counter>,
    cleanups: Vec<(Vec<u8>, Vec<u8>)>,
    /// Whether etcd answers at all: after a failure every request waits for the backoff, and
    /// then one request at a time probes (docs/behaviour.md §3.8: a store that fails is never hammered).
    health: Backoff,
    /// The probe in flight while etcd fails: its call, when it was sent.
    probe: Option<(u64, u64)>,
    /// Owners' tries sent beside one that hangs, in flight (`MAX_HEDGES`).
    hedges: HashSet<u64>,
    /// The owner whose ending etcd refused (out of space) and whose mark would expire within
    /// its backoff, trying early: one at a time, as the health probe; when it lands, the
    /// others go at once.
    refusal_probe: Option<u64>,
    /// Lease grants and cleanups that etcd refused: retried after this; reset by one that
    /// succeeds, so that one outage does not slow every later retry.
    background: Backoff,
    no_space_logged_ms: u64,
    next_call: u64,
    /// Randomness for owner tokens and jitter (splitmix64 over a seed from the host).
    random: u64,
    /// This Envoy's copies of completed entries (`store.local_replays`).
    replays: Option<Rc<RefCell<dyn Replays>>>,
    /// This Envoy's write budget (`store.write_budget_bytes`), shared by its VMs and clusters.
    share: Option<Rc<dyn Share>>,
    share_logged_ms: u64,
    /// The Envoy's writes lately, as last charged (for the gauge).
    share_used: Option<u64>,
}

impl EtcdStore {
    /// `max_lease_ms`: the longest `lease_ms` of the policies; `retentions`: every policy's
    /// `retention_s`; `seed`: any random number.
    pub fn new(link: Link, namespace: &str, max_lease_ms: u64, retentions: Vec<u64>, seed: u64) -> EtcdStore {
        EtcdStore {
            link,
            namespace: namespace.to_string(),
            retentions,
            max_lease_ms,
            lease_ttl_s: (2 * max_lease_ms).div_ceil(1000).max(6),
            lease: None,
            lease_pending: false,
            retention: IdMap::default(),
            retention_pending: HashSet::new(),
            owners: IdMap::default(),
            next_owner: 1,
            rounds: VecDeque::new(),
            relooks: VecDeque::new(),
            inflight: IdMap::default(),
            outbox: VecDeque::new(),
            answers: VecDeque::new(),
            counts: VecDeque::new(),
            cleanups: Vec::new(),
            health: Backoff::default(),
            probe: None,
            hedges: HashSet::new(),
            refusal_probe: None,
            background: Backoff::default(),
            no_space_logged_ms: 0,
            next_call: 1,
            random: seed,
            replays: None,
            share: None,
            share_logged_ms: 0,
            share_used: None,
        }
    }

    /// Bounds what this Envoy adds to etcd by `share` (`store.write_budget_bytes`).
    pub fn with_share(mut self, share: Rc<dyn Share>) -> EtcdStore {
        self.share = Some(share);
        self
    }

    /// A new key's claim is about to be written: `None` when its caller may, else the 429's
    /// answer (this Envoy's share is full and the caller wrote the most of it lately).
    fn over_share(&mut self, caller: Caller, established: bool, now: u64) -> Option<Began> {
        let share = self.share.as_ref()?;
        let Verdict::Refuse { retry_after_ms } = share.verdict(caller, established, now) else { return None };
        if now >= self.share_logged_ms {
            self.share_logged_ms = now + 60_000;
            log::warn!(
                "fleet share: this Envoy's writes to etcd reached store.write_budget_bytes ({} bytes lately); new keys of caller {} (the heaviest writer) get 429 for {} s; retries of stored keys and other callers go on. Logged once a minute per worker",
                share.budget(),
                caller.short(),
                retry_after_ms.div_ceil(1000)
            );
        }
        Some(Began::OverShare { retry_after_s: retry_after_ms.div_ceil(1000).max(1) })
    }

    /// Counts a write in the Envoy's ledger, against the caller it is for.
    fn charge(&mut self, request: &Request, op: &Op, now: u64) {
        let Some(share) = &self.share else { return };
        let Request::Txn { key, write: Write::Put { value, .. }, .. } = request else { return };
        let caller = match op {
            Op::Claim { round, .. } | Op::Verify { round, .. } => round.caller,
            Op::Renew { entry, .. } => entry.caller,
            Op::End { id } => match self.owners.get(id) {
                Some(o) => o.entry.caller,
                None => return,
            },
            _ => return,
        };
        let bytes = (key.len() + value.len()) as u64 + PUT_OVERHEAD_BYTES;
        if let Some(total) = share.charge(caller, bytes, now) {
            self.share_used = Some(total);
        }
    }

    /// Replays completed entries seen before from `replays`, without a round trip.
    pub fn with_replays(mut self, replays: Rc<RefCell<dyn Replays>>) -> EtcdStore {
        self.replays = Some(replays);
        self
    }

    /// Keeps a copy of a completed entry, if this store keeps copies.
    fn keep_copy(&mut self, store_key: &StoreKey, entry: &Entry, response: Option<&StoredResponse>, now: u64) {
        if let Some(replays) = &self.replays {
            replays.borrow_mut().keep(store_key, &entry.fingerprint, entry.caller, response, entry.deadline_ms, now);
        }
    }

    /// A random number (splitmix64).
    fn draw(&mut self) -> u64 {
        self.random = self.random.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.random;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// How long past its deadline (by this Envoy's clock) an owner's write stays urgent: a
    /// replica whose clock runs behind may still see the mark alive ([`Backoff::ready_by`]).
    fn late_ms(&self) -> u64 {
        if planted(Defect::WriteNotHedged) {
            0
        } else {
            self.max_lease_ms
        }
    }

    /// The VM lease, while a mark written with it now would outlive its deadline.
    fn usable_lease(&self, now: u64) -> Option<i64> {
        self.lease.filter(|l| now < l.usable_until_ms).map(|l| l.id)
    }

    /// Queues one request to etcd; `false` while etcd is unreachable and this may not probe.
    fn send(&mut self, request: Request, op: Op, now: u64) -> bool {
        self.send_by(request, op, 0, now)
    }

    /// [`Self::send`] for an owner's write, which must land by its mark's deadline
    /// `need_by_ms`: it may probe before the backoff is over ([`Backoff::ready_by`]), and it
    /// goes beside a probe that hangs (etcd without a leader answers it only at its timeout,
    /// which may come after the mark's deadline).
    fn send_by(&mut self, request: Request, op: Op, need_by_ms: u64, now: u64) -> bool {
        if self.health.failing() {
            let may_probe = self.health.ready_by(now, need_by_ms, self.link.timeout_ms, self.late_ms());
            let stuck = self.probe.is_some_and(|(_, sent)| now >= sent.saturating_add(HEDGE_MS))
                && !planted(Defect::WriteNotHedged);
            if !may_probe || (self.probe.is_some() && !(need_by_ms > 0 && stuck)) {
                return false;
            }
        }
        let call = self.next_call;
        self.next_call += 1;
        if self.health.failing() && self.probe.is_none() {
            self.probe = Some((call, now));
        }
        self.charge(&request, &op, now);
        let to =
            Target { cluster: &self.link.cluster, authority: &self.link.authority, timeout_ms: self.link.timeout_ms };
        let request = self.link.api.call(&request, &to);
        self.outbox.push_back((call, request));
        self.inflight.insert(call, op);
        true
    }

    /// Sends an owner's waiting write: its ending, or its renewal. One already in flight is
    /// tried again beside it when it may hang past the mark's deadline (a hedge).
    fn send_write(&mut self, id: u64, now: u64) {
        let Some(o) = self.owners.get(&id) else { return };
        let hedge = o.busy;
        if hedge && self.hedges.len() >= MAX_HEDGES {
            return;
        }
        let sent_before = self.next_call;
        match (&o.ending, o.renew_wanted) {
            (Some(_), _) => self.send_end(id, now),
            (None, Some(lease_ms)) => self.send_renew(id, lease_ms, now),
            (None, None) => return,
        }
        if self.next_call > sent_before {
            if hedge {
                self.hedges.insert(sent_before);
            }
            if let Some(o) = self.owners.get_mut(&id) {
                o.tried_ms = now;
            }
        }
    }

    /// Keeps the VM lease and the retention leases ready, then sends claims, endings and
    /// cleanups.
    fn pump(&mut self, now: u64) {
        // Owners first: while etcd fails, the one probe goes to a mark that would expire. After
        // a refusal (out of space, answered at once) one owner at a time whose mark would
        // expire within its backoff tries early, as that probe does: sat out, the alarm may
        // clear and the mark expire before the retry, and another replica runs the call again.
        // A write that may hang past its mark's deadline is tried again beside it.
        let (timeout_ms, late_ms) = (self.link.timeout_ms, self.late_ms());
        let mut refusal_probe = self.refusal_probe.filter(|id| self.owners.get(id).is_some_and(|o| o.busy));
        let mut ready = Vec::new();
        for (id, o) in self.owners.iter().filter(|(_, o)| o.wants_write()) {
            if o.busy {
                if o.hedge_due(now, timeout_ms, late_ms) {
                    ready.push(*id);
                }
                continue;
            }
            let urgent = o.retry.ready_by(now, o.entry.deadline_ms, timeout_ms, late_ms);
            if o.retry.ready(now) || (o.unanswered && urgent) {
                ready.push(*id);
            } else if urgent && refusal_probe.is_none() {
                refusal_probe = Some(*id);
                ready.push(*id);
            }
        }
        self.refusal_probe = refusal_probe;
        for id in ready {
            self.send_write(id, now);
        }
        let background = self.background.ready(now);
        let lease_due = self.lease_due(now);
        if background {
            self.keep_leases(lease_due, now);
        } else if lease_due > 0 && self.background.ready_by(now, lease_due, timeout_ms, late_ms) {
            // A mark about to expire waits for a lease to renew it with: as for its own
            // write, the backoff is cut short rather than let another replica take it over.
            self.grant_vm_lease(lease_due, now);
        }
        if self.usable_lease(now).is_none() && !self.lease_pending {
            // No lease and none coming: the queued claims cannot be sent.
            self.fail_rounds();
        }
        while let Some(lease) = self.usable_lease(now) {
            let Some(round) = self.rounds.pop_front() else { break };
            self.send_claim(round, lease, now);
        }
        if background {
            for (key, value) in std::mem::take(&mut self.cleanups) {
                let request = Request::delete_if_value(&key, value.clone());
                let op = Op::Cleanup { key: key.clone(), value: value.clone() };
                if !self.send(request, op, now) {
                    self.cleanups.push((key, value));
                }
            }
        }
        self.pump_relooks(now);
    }

    /// The VM's lease, and a retention lease for every policy's retention, so that
    /// completions do not wait for a grant.
    /// When the first mark waiting for a lease to be renewed with expires (0: none waits).
    fn lease_due(&self, now: u64) -> u64 {
        if self.usable_lease(now).is_some() {
            return 0;
        }
        self.owners.values().filter(|o| o.renew_wanted.is_some()).map(|o| o.entry.deadline_ms).min().unwrap_or(0)
    }

    /// Grants the leases that are missing or due; `lease_due` as [`Self::lease_due`].
    fn keep_leases(&mut self, lease_due: u64, now: u64) {
        for i in 0..self.retentions.len() {
            let Some(&retention_s) = self.retentions.get(i) else { break };
            let fresh =
                self.retention.get(&retention_s).is_some_and(|(_, until)| now + slack_s(retention_s) * 500 < *until);
            if !fresh {
                self.grant_retention(retention_s, 0, now);
            }
        }
        if self.lease.is_none_or(|l| now >= l.rotate_at_ms) {
            self.grant_vm_lease(lease_due, now);
        }
    }

    /// Asks for the VM lease; `need_by_ms` (0: nothing waits) as for [`Self::send_by`].
    fn grant_vm_lease(&mut self, need_by_ms: u64, now: u64) {
        if self.lease_pending {
            return;
        }
        self.lease_pending = true;
        let request = Request::Grant { ttl_s: self.lease_ttl_s };
        if !self.send_by(request, Op::GrantReplica { sent_ms: now }, need_by_ms, now) {
            self.lease_pending = false;
        }
    }

    /// Asks for a retention lease, unless one is on its way or the background backoff holds (a
    /// refused grant is not re-sent at once, whoever wants the lease). `need_by_ms` (0: nothing
    /// waits) as for [`Self::send_by`]: a completion whose mark would expire first cuts the
    /// backoff short, as a renewal waiting for the VM's lease does.
    fn grant_retention(&mut self, retention_s: u64, need_by_ms: u64, now: u64) {
        let ready = self.background.ready(now)
            || self.background.ready_by(now, need_by_ms, self.link.timeout_ms, self.late_ms());
        if !ready || !self.retention_pending.insert(retention_s) {
            return;
        }
        let request = Request::Grant { ttl_s: retention_s + slack_s(retention_s) };
        if !self.send_by(request, Op::GrantRetention(retention_s), need_by_ms, now) {
            self.retention_pending.remove(&retention_s);
        }
    }

    /// Reads again what did not reach etcd, as the backoff lets calls through (one probe at a
    /// time while it fails); past its deadline a request follows `on_unavailable`.
    fn pump_relooks(&mut self, now: u64) {
        while let Some((round, deadline)) = self.relooks.pop_front() {
            if now >= deadline {
                self.answers.push_back((round.who, Answer::Began(Began::Unavailable)));
                continue;
            }
            if !self.try_look(round.clone(), now) {
                self.relooks.push_front((round, deadline));
                break;
            }
        }
    }

    fn fail_rounds(&mut self) {
        for round in std::mem::take(&mut self.rounds) {
            self.answers.push_back((round.who, Answer::Began(Began::Unavailable)));
        }
    }

    /// etcd refused a write for lack of space (its quota alarm): counted, logged once a
    /// minute.
    fn note_no_space(&mut self, error: &EtcdError, now: u64) {
        if error.kind() != ErrorKind::NoSpace {
            return;
        }
        self.counts.push_back(Counter::StoreNoSpace);
        if now >= self.no_space_logged_ms {
            self.no_space_logged_ms = now + NO_SPACE_LOG_MS;
            log::warn!(
                "etcd refuses writes: its database is over its space quota (alarm NOSPACE). New keys follow on_unavailable; stored answers still replay. Free space (compact, defragment), then disarm the alarm (etcdctl alarm disarm)"
            );
        }
    }

    fn forget_dead_lease(&mut self, error: &EtcdError) {
        if error.is_lease_not_found() {
            self.lease = None;
        }
    }

    /// The health of etcd, from one answer: unreachable answers grow the backoff (not those
    /// of requests sent before the first failure), anything else resets it.
    fn note_health(&mut self, call: u64, unreachable: bool, now: u64) {
        let probe = self.probe.is_some_and(|(c, _)| c == call);
        if probe {
            self.probe = None;
        }
        self.hedges.remove(&call);
        if !unreachable {
            self.health.succeed();
        } else if probe || !self.health.failing() {
            let jitter = self.draw();
            self.health.fail(now, jitter);
            log::warn!("etcd: no answer; backing off");
        }
    }
}

/// Completed entries may outlive their retention by this much before etcd drops them: one
/// retention lease serves all completions of such a window.
fn slack_s(retention_s: u64) -> u64 {
    (retention_s / 10).clamp(1, 600)
}

impl Store for EtcdStore {
    fn begin(&mut self, who: For, claim: &Claim, now_ms: u64) -> Option<Answer> {
        if let Some(began) =
            self.replays.as_ref().and_then(|r| r.borrow_mut().lookup(&claim.key, &claim.fingerprint, now_ms))
        {
            self.counts.push_back(Counter::LocalReplay);
            return Some(Answer::Began(began));
        }
        let mut tag = [0u8; 16];
        tag.copy_from_slice(claim.key.0.get(8..24).unwrap_or(&[0u8; 16]));
        let key = protocol::key_name(&self.namespace, &claim.key.0);
        let round = Round {
            who,
            store_key: claim.key,
            key,
            tag,
            fingerprint: claim.fingerprint,
            caller: claim.caller,
            established: claim.established,
            lease_ms: claim.lease_ms,
            attempts: 0,
            looked_ms: 0,
            takeover: None,
        };
        // Read first, always: this VM cannot know whether another replica holds the key (a
        // retry landing on another replica is the common duplicate), so skipping the read
        // for keys it has not seen would make those duplicates transactions again. A first
        // call pays one round trip more (the read, then the claim).
        self.send_look(round, now_ms);
        self.pump(now_ms);
        None
    }

    fn renew(&mut self, owner: Owner, lease_ms: u64, now_ms: u64) -> Option<Answer> {
        if let Some(o) = self.owners.get_mut(&owner.id).filter(|o| o.ending.is_none()) {
            o.renew_wanted = Some(lease_ms);
        }
        self.pump(now_ms);
        None
    }

    fn complete(
        &mut self,
        owner: Owner,
        response: Option<Rc<StoredResponse>>,
        retention_ms: u64,
        now_ms: u64,
    ) -> Option<Answer> {
        let Some(o) = self.owners.get_mut(&owner.id) else {
            return Some(Answer::Completed(Completed::Lost { response }));
        };
        o.ending = Some(Ending::Complete { response, retention_ms });
        self.pump(now_ms);
        None
    }

    fn release(&mut self, owner: Owner, now_ms: u64) -> Option<Answer> {
        let Some(o) = self.owners.get_mut(&owner.id) else {
            return Some(Answer::Released { done: false, change: Default::default() });
        };
        o.ending = Some(Ending::Release);
        self.pump(now_ms);
        None
    }

    fn forget(&mut self, owner: Owner) {
        self.owners.remove(&owner.id);
    }

    fn tick(&mut self, now_ms: u64) -> TickReport {
        // A lease grant is also the probe that finds etcd back once the backoff has passed,
        // without waiting for client traffic.
        if self.health.failing() && self.health.ready(now_ms) && self.probe.is_none() {
            self.grant_vm_lease(0, now_ms);
        }
        self.pump(now_ms);
        let change = self.replays.as_ref().map(|r| r.borrow_mut().tick(now_ms)).unwrap_or_default();
        TickReport { change, share_used_bytes: self.share_used.take(), ..TickReport::default() }
    }

    fn poll_answer(&mut self) -> Option<(For, Answer)> {
        self.answers.pop_front()
    }

    fn poll_call(&mut self) -> Option<(u64, CallRequest)> {
        self.outbox.pop_front()
    }

    fn poll_count(&mut self) -> Option<Counter> {
        self.counts.pop_front()
    }

    fn on_call_answer(&mut self, call: u64, answer: &CallAnswer, now_ms: u64) {
        let Some(op) = self.inflight.remove(&call) else { return };
        let switch = self.link.api_fallback && self.link.api == Api::Grpc && grpc::grpc_status(answer) == Some(12);
        if switch {
            // An HTTP/1.1 cluster, as the releases before the gRPC API used: their API then.
            log::warn!(
                "etcd: cluster {:?} answers gRPC calls UNIMPLEMENTED (an HTTP/1.1 cluster): using the JSON \
                 gateway, as releases before 0.1.0 did; set store.api to \"json\", or make the cluster HTTP/2",
                self.link.cluster
            );
            self.link.api = Api::Json;
            self.link.api_fallback = false;
        }
        self.note_health(call, self.link.api.is_unreachable(answer), now_ms);
        self.on_answer(op, answer, now_ms);
        if switch {
            // The refusal was the API's, not etcd's: the next calls go at once.
            self.background.succeed();
            self.health.succeed();
        }
        self.pump(now_ms);
    }

    fn on_call_failed(&mut self, call: u64, now_ms: u64) {
        // Nothing was sent: as if Envoy had answered that etcd cannot be reached.
        let answer = self.link.api.not_sent();
        self.on_call_answer(call, &answer, now_ms);
    }

    fn wait_poll_ms(&self) -> u64 {
        WAIT_POLL_MS
    }

    fn answers_at_once(&self) -> bool {
        false
    }

    /// A completion is answered within the call's timeout, or waits for a retention lease
    /// (one more call): twice the timeout bounds both.
    fn write_wait_ms(&self) -> u64 {
        2 * self.link.timeout_ms
    }

    #[cfg(test)]
    fn busy(&self) -> Vec<(&'static str, usize)> {
        let all = [
            ("etcd_inflight", self.inflight.len()),
            ("etcd_rounds", self.rounds.len()),
            ("etcd_relooks", self.relooks.len()),
            ("etcd_owners", self.owners.len()),
            ("etcd_cleanups", self.cleanups.len()),
            ("etcd_outbox", self.outbox.len()),
            ("etcd_answers", self.answers.len()),
        ];
        all.into_iter().filter(|(_, n)| *n > 0).collect()
    }

    fn is_idle(&self) -> bool {
        self.inflight.is_empty()
            && self.rounds.is_empty()
            && self.relooks.is_empty()
            && self.owners.is_empty()
            && self.cleanups.is_empty()
            && self.outbox.is_empty()
            && self.answers.is_empty()
    }
}
