//! Wait mode (SPEC §3.3, `on_conflict: "wait"`): duplicates held at the gateway until the
//! first call's outcome is known, polled from the root's timer.

use super::detached::promote;
use super::{answer_client, describe, judge, send_stored, Verdict, Vm};
use crate::metrics::Counter;
use crate::problem::Problem;

/// Wait mode: looks at the entry of every held request. One table read per distinct request
/// per tick; the first waiter of a key that finds it free becomes the owner (SPEC §3.3).
pub(super) fn poll_waiters(vm: &Vm, now: u64) {
    let waiters = std::mem::take(&mut *vm.waiters.borrow_mut());
    if waiters.is_empty() {
        return;
    }
    let mut keep = Vec::with_capacity(waiters.len());
    // Requests already looked at in this tick, with what they found (claims excepted) and the
    // counter each answer adds to: every waiter answered counts once.
    type Memo = Option<(Verdict, Option<Counter>)>;
    let mut seen: Vec<(crate::key::StoreKey, crate::fingerprint::Fingerprint, Memo)> = Vec::new();
    for w in waiters {
        if !vm.live.borrow().contains(&w.context_id) {
            continue; // the client left: drop it, nothing to release
        }
        let policy = vm.policy(w.policy);
        let known = seen.iter().position(|(k, f, _)| *k == w.key && *f == w.fingerprint);
        let verdict = match known.and_then(|i| seen.get(i)) {
            // Another waiter of this request claimed it in this tick: keep waiting for it.
            Some((_, _, None)) => Verdict::InProgress,
            Some((_, _, Some((v, counter)))) => {
                if let Some(c) = counter {
                    vm.count(*c);
                }
                clone_verdict(v)
            }
            None => {
                let begin = vm.table.begin(&w.key, &w.fingerprint, now, policy.lease_ms);
                if !matches!(begin, Ok(crate::engine::Begin::InProgress)) {
                    log::debug!("waiter {} key {} -> {}", w.context_id, w.key.short(), describe(&begin));
                }
                let counter = super::counter_of(&begin);
                let v = judge(vm, policy, begin);
                let memo = if matches!(v, Verdict::Claimed(_)) { None } else { Some((clone_verdict(&v), counter)) };
                seen.push((w.key, w.fingerprint, memo));
                v
            }
        };
        match verdict {
            Verdict::InProgress if now < w.deadline_ms => keep.push(w),
            Verdict::InProgress => {
                vm.count(Counter::Conflict);
                let p = Problem::in_progress(policy.retry_after_s);
                answer_client(vm, w.context_id, |vm| vm.reply_problem(&p));
            }
            Verdict::Claimed(owner) => promote(vm, w.context_id, w.policy, w.outbound, owner, now),
            Verdict::Replay(response) => answer_client(vm, w.context_id, |_| send_stored(&response, true)),
            Verdict::Problem(p) => answer_client(vm, w.context_id, |vm| vm.reply_problem(&p)),
        }
    }
    // Requests that started waiting during this tick queue behind the older ones.
    let mut waiting = vm.waiters.borrow_mut();
    let newer = std::mem::replace(&mut *waiting, keep);
    waiting.extend(newer);
}

fn clone_verdict(v: &Verdict) -> Verdict {
    match v {
        Verdict::Claimed(t) => Verdict::Claimed(*t),
        Verdict::InProgress => Verdict::InProgress,
        Verdict::Replay(r) => Verdict::Replay(r.clone()),
        Verdict::Problem(p) => Verdict::Problem(p.clone()),
    }
}
