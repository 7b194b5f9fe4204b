//! The invariants the simulator checks, by name (docs/behaviour.md §3.8 and the rest of §3). Each check
//! lives where its facts are known (`world.rs`); this file names them and keeps what failed.

use std::fmt;

/// Every invariant, with what it asserts.
pub const INVARIANTS: [(&str, &str); 27] = [
    ("duplicate_effect", "a key's work reaches the upstream again (two effects under one claim, or a later claim's while the earlier may run or after it completed) with no excuse: released, passed on an unavailable store, orphaned, or a lease its owner could not have kept"),
    ("unclaimed_effect", "a request reaches the upstream while the store holds no claim of its VM's for its key, and no store failure lets it pass"),
    ("held_duplicate_forwarded", "a request whose store read said its key was in progress or done is sent upstream without a claim"),
    ("late_owner_overwrote", "a write of an earlier claim lands over a later claim of the same key"),
    ("mark_removed_early", "an in-progress mark is removed before its deadline by a VM other than its owner's"),
    ("replay_differs", "a replay is not the stored answer of a completed call of the same key and caller (status, body, gRPC status)"),
    ("cross_scope", "a replay carries another caller's answer"),
    ("answer_crossed", "a request gets the upstream answer of another request"),
    ("detached_unrouted", "a detached call goes anywhere but the route's internal listener (detached_via)"),
    ("unanswered", "a client that stayed got no answer by the end of the run"),
    ("answered_late", "a client that stayed got its answer later than the bound"),
    ("locked_without_owner", "a 409 in progress while the store holds no mark of the key, or its owner is not at work (running, answered lately, orphaned, on its way) and no fault of its VM explains it"),
    ("completed_without_completion", "a 409 completed-without-response (or a not-replayable gRPC result) for a key no call completed"),
    ("recorded_twice", "a covered request's decision is recorded (filter state) at most once"),
    ("record_differs", "the recorded decision of a request the plugin answered itself is what it answered (the problem's slug, or replayed)"),
    ("share_full_for_a_stored_key", "a 429 share-full (a full write budget) for a key whose answer the store held all through the request"),
    ("not_back_to_baseline", "a VM holds streams, calls, owners, waiters or buffered bytes after traffic stopped"),
    ("effect_on_closed_stream", "the lifecycle answers, resumes or edits a stream that has ended"),
    ("resume_not_paused", "a request or response is resumed that is not paused (Envoy would continue it twice)"),
    ("own_reply_watched", "the plugin's own local reply is taken for the upstream's answer"),
    ("fence_missing", "with fencing on, a claimed request reaches the upstream without its claim's own token, or one without a claim with a token"),
    ("fence_reused", "two claims of one key carry the same fencing token"),
    ("forged_fence_passed", "the client's own fencing header reaches the upstream"),
    ("old_root_never_finished", "a root replaced by a configuration update never ends (it keeps granting leases for ever)"),
    ("old_root_ended_early", "a replaced root ended with calls or work in flight: their answers reach nobody"),
    ("livelock", "events keep coming at one instant: the run cannot advance"),
    ("store_hammered", "a failing etcd receives more calls than the backoff allows"),
];

#[derive(Debug, Clone)]
pub struct Violation {
    pub invariant: &'static str,
    pub at_ms: u64,
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} at {} ms: {}", self.invariant, self.at_ms, self.detail)
    }
}

/// The violations of one run, the first of each invariant only.
#[derive(Default)]
pub struct Checker {
    pub violations: Vec<Violation>,
}

impl Checker {
    pub fn fail(&mut self, invariant: &'static str, at_ms: u64, detail: String) {
        debug_assert!(INVARIANTS.iter().any(|(name, _)| *name == invariant), "unknown invariant {invariant}");
        if !self.violations.iter().any(|v| v.invariant == invariant) {
            self.violations.push(Violation { invariant, at_ms, detail });
        }
    }
}
