//! Wait mode (SPEC §3.3, `on_conflict: "wait"`): duplicates held at the gateway until the
//! first call's outcome is known, polled from the root's timer.

use super::detached::promote;
use super::{answer_client, describe, judge, send_stored, Verdict, Vm, Waiter};
use crate::fingerprint::Fingerprint;
use crate::key::StoreKey;
use crate::metrics::Counter;
use crate::problem::Problem;

/// What a request's entry held when a waiter of it looked in this tick.
enum Seen {
    /// That waiter claimed it and became the first call: the others keep waiting for it.
    Claimed,
    /// An answer for every waiter of the request, with the counter each answer adds to.
    Answer(Verdict, Option<Counter>),
}

/// Wait mode: looks at the entry of every held request. One table read per distinct request
/// per tick; the first waiter of a key that finds it free becomes the owner (SPEC §3.3). Every
/// waiter of one request is answered from the same verdict: a replay is not copied per waiter.
pub(super) fn poll_waiters(vm: &Vm, now: u64) {
    let waiters = std::mem::take(&mut *vm.waiters.borrow_mut());
    if waiters.is_empty() {
        return;
    }
    let mut keep = Vec::with_capacity(waiters.len());
    let mut seen: Vec<(StoreKey, Fingerprint, Seen)> = Vec::new();
    for w in waiters {
        if !vm.live.borrow().contains(&w.context_id) {
            continue; // the client left: drop it, nothing to release
        }
        let known = seen.iter().position(|(k, f, _)| *k == w.key && *f == w.fingerprint);
        let index = match known {
            Some(i) => {
                if let Some((_, _, Seen::Answer(_, Some(counter)))) = seen.get(i) {
                    vm.count(*counter);
                }
                i
            }
            None => {
                let policy = vm.policy(w.policy);
                let begin = vm.table.begin(&w.key, &w.fingerprint, now, policy.lease_ms);
                if !matches!(begin, Ok(crate::engine::Begin::InProgress)) {
                    log::debug!("waiter {} key {} -> {}", w.context_id, w.key.short(), describe(&begin));
                }
                let counter = super::counter_of(&begin);
                match judge(vm, policy, begin) {
                    Verdict::Claimed(owner) => {
                        seen.push((w.key, w.fingerprint, Seen::Claimed));
                        promote(vm, w.context_id, w.policy, w.outbound, owner, now);
                        continue;
                    }
                    verdict => seen.push((w.key, w.fingerprint, Seen::Answer(verdict, counter))),
                }
                seen.len() - 1
            }
        };
        match seen.get(index).map(|(_, _, s)| s) {
            Some(Seen::Claimed | Seen::Answer(Verdict::InProgress, _)) => still_in_progress(vm, w, now, &mut keep),
            Some(Seen::Answer(Verdict::Replay(response), _)) => {
                answer_client(vm, w.context_id, |_| send_stored(response, true))
            }
            Some(Seen::Answer(Verdict::Problem(p), _)) => answer_client(vm, w.context_id, |vm| vm.reply_problem(p)),
            Some(Seen::Answer(Verdict::Claimed(_), _)) | None => {}
        }
    }
    // Requests that started waiting during this tick queue behind the older ones.
    let mut waiting = vm.waiters.borrow_mut();
    let newer = std::mem::replace(&mut *waiting, keep);
    waiting.extend(newer);
}

/// The first call still runs: keep waiting, or 409 once `wait_max_ms` has passed.
fn still_in_progress(vm: &Vm, w: Waiter, now: u64, keep: &mut Vec<Waiter>) {
    if now < w.deadline_ms {
        keep.push(w);
        return;
    }
    vm.count(Counter::Conflict);
    let p = Problem::in_progress(vm.policy(w.policy).retry_after_s);
    answer_client(vm, w.context_id, |vm| vm.reply_problem(&p));
}
