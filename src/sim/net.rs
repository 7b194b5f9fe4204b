//! The simulator's randomness, its event queue, and the faults a seed draws: etcd windows
//! (down, stalled, out of space), per-request losses, slow links and paused Envoys.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// splitmix64: one seed, one stream of numbers.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x5DEE_CE66_D1CE_4E5B)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    /// True `per_mille` times in a thousand.
    pub fn chance(&mut self, per_mille: u64) -> bool {
        self.next() % 1000 < per_mille
    }

    pub fn pick<T: Copy>(&mut self, items: &[T]) -> Option<T> {
        let n = items.len() as u64;
        if n == 0 {
            return None;
        }
        items.get((self.next() % n) as usize).copied()
    }
}

/// Events in time order; ties in the order they were scheduled.
pub struct Queue<E> {
    heap: BinaryHeap<Scheduled<E>>,
    seq: u64,
}

struct Scheduled<E> {
    at: u64,
    seq: u64,
    event: E,
}

impl<E> PartialEq for Scheduled<E> {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl<E> Eq for Scheduled<E> {}
impl<E> PartialOrd for Scheduled<E> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<E> Ord for Scheduled<E> {
    fn cmp(&self, other: &Self) -> Ordering {
        // Reversed: the heap pops the earliest.
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

impl<E> Queue<E> {
    pub fn new() -> Queue<E> {
        Queue { heap: BinaryHeap::new(), seq: 0 }
    }

    pub fn push(&mut self, at: u64, event: E) {
        self.seq += 1;
        self.heap.push(Scheduled { at, seq: self.seq, event });
    }

    pub fn pop(&mut self) -> Option<(u64, E)> {
        self.heap.pop().map(|s| (s.at, s.event))
    }
}

/// What an etcd cluster does for a while.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trouble {
    /// Nothing listens: Envoy answers UNAVAILABLE at once.
    Down,
    /// The process is stopped (SIGSTOP): requests wait in its socket and are applied when it
    /// resumes; Envoy's calls time out meanwhile.
    Stalled,
    /// The quota alarm: every write refused, reads served.
    NoSpace,
    /// An election: no leader. A call either fails ("etcdserver: no leader") or its proposal
    /// commits when the new leader is in, at the window's end (after Envoy's timeout).
    NoLeader,
    /// An election no member has noticed yet (the leader was killed): every call hangs until
    /// Envoy's timeout; its proposal commits when the window ends, or is dropped.
    Hung,
}

#[derive(Debug, Clone, Copy)]
pub struct Window {
    pub from: u64,
    pub to: u64,
    pub trouble: Trouble,
}

/// The faults of one run: those the seed draws at the start, those it aims at the run's own
/// boundaries as it goes (a window that ends just before a mark's deadline), and those that
/// happened (calls lost, calls that could not be dispatched). The oracle judges from this log.
pub struct Faults {
    /// Per etcd cluster.
    pub etcd: Vec<Vec<Window>>,
    /// Each direction of an etcd call takes up to this long.
    pub etcd_latency_max: u64,
    /// The plugin's `store.timeout_ms` for this run: up to a third of the lease.
    pub etcd_timeout_ms: u64,
    /// Per mille of etcd calls lost before etcd sees them, and after it applied them.
    pub lose_before: u64,
    pub lose_after: u64,
    /// Per mille of calls (etcd's and detached ones) that Envoy refuses at dispatch.
    pub dispatch_fail: u64,
    /// Per Envoy: when it is paused (SIGSTOP), none of its VMs run and it takes no requests.
    pub pauses: Vec<Vec<(u64, u64)>>,
    /// Per VM: when that worker alone is stalled (a long event), while the others run.
    pub stalls: Vec<Vec<(u64, u64)>>,
    /// Per Envoy: clock steps (when, by how many ms; negative: back), as NTP steps a clock.
    pub steps: Vec<Vec<(u64, i64)>>,
    /// Faults aimed at deadlines: per mille of the chances the run takes them.
    pub aim: u64,
    /// What happened: calls of a VM to a cluster that the network lost (when sent).
    pub lost: Vec<(usize, usize, u64)>,
    /// Store calls of a VM that Envoy refused at dispatch (when).
    pub refused: Vec<(usize, u64)>,
}

/// The largest clock step drawn, either way.
pub const STEP_MAX_MS: u64 = 3_000;

impl Faults {
    pub fn draw(rng: &mut Rng, clusters: usize, envoys: usize, vms: usize, horizon: u64, lease_ms: u64) -> Faults {
        let slow = rng.chance(300);
        let etcd_latency_max = if slow { rng.range(100, 200) } else { rng.range(1, 30) };
        let etcd_timeout_ms = rng.range(200, lease_ms / 3);
        let lossy = rng.chance(300);
        let (lose_before, lose_after) = if lossy { (rng.range(5, 40), rng.range(5, 40)) } else { (0, 0) };
        let dispatch_fail = if rng.chance(200) { rng.range(5, 50) } else { 0 };
        let mut etcd = Vec::new();
        for _ in 0..clusters {
            let mut windows = Vec::new();
            if rng.chance(400) {
                let kinds = [Trouble::Down, Trouble::Stalled, Trouble::NoSpace, Trouble::NoLeader, Trouble::Hung];
                let trouble = rng.pick(&kinds).unwrap_or(Trouble::Down);
                let from = rng.range(500, horizon);
                let to = from + rng.range(200, 5_000);
                windows.push(Window { from, to, trouble });
            }
            etcd.push(windows);
        }
        let windows = |rng: &mut Rng, n: usize, per_mille: u64, longest: u64| -> Vec<Vec<(u64, u64)>> {
            (0..n)
                .map(|_| {
                    let mut at = Vec::new();
                    if rng.chance(per_mille) {
                        let from = rng.range(500, horizon);
                        at.push((from, from + rng.range(200, longest)));
                    }
                    at
                })
                .collect()
        };
        let pauses = windows(rng, envoys, 150, 6_000);
        let stalls = windows(rng, vms, 100, 4_000);
        let mut steps = Vec::new();
        for _ in 0..envoys {
            let mut at = Vec::new();
            if rng.chance(150) {
                let by = rng.range(100, STEP_MAX_MS) as i64;
                at.push((rng.range(500, horizon), if rng.chance(500) { by } else { -by }));
            }
            steps.push(at);
        }
        let aim = if rng.chance(300) { rng.range(200, 800) } else { 0 };
        Faults {
            etcd,
            etcd_latency_max,
            etcd_timeout_ms,
            lose_before,
            lose_after,
            dispatch_fail,
            pauses,
            stalls,
            steps,
            aim,
            lost: Vec::new(),
            refused: Vec::new(),
        }
    }

    /// How far Envoy `envoy`'s clock has been stepped by `at`.
    pub fn stepped(&self, envoy: usize, at: u64) -> i64 {
        self.steps.get(envoy).map_or(0, |s| s.iter().filter(|(when, _)| *when <= at).map(|(_, by)| by).sum())
    }

    pub fn trouble(&self, cluster: usize, at: u64) -> Option<Window> {
        self.etcd.get(cluster)?.iter().find(|w| w.from <= at && at < w.to).copied()
    }

    /// When Envoy `envoy` runs again, if it is paused at `at`.
    pub fn paused_until(&self, envoy: usize, at: u64) -> Option<u64> {
        self.pauses.get(envoy)?.iter().find(|(from, to)| *from <= at && at < *to).map(|(_, to)| *to)
    }

    /// When VM `vm` (of Envoy `envoy`) runs again, if it does not run at `at`.
    pub fn halted_until(&self, envoy: usize, vm: usize, at: u64) -> Option<u64> {
        let stalled = self.stalls.get(vm).and_then(|s| s.iter().find(|(a, b)| *a <= at && at < *b)).map(|(_, b)| *b);
        self.paused_until(envoy, at).max(stalled)
    }

    /// The time VM `vm` did not run in all (its Envoy's pauses and its own stalls).
    pub fn halted_total(&self, envoy: usize, vm: usize) -> u64 {
        let sum = |w: Option<&Vec<(u64, u64)>>| w.map_or(0, |w| w.iter().map(|(a, b)| b - a).sum::<u64>());
        sum(self.pauses.get(envoy)) + sum(self.stalls.get(vm))
    }

    /// When VM `vm` of Envoy `envoy` could not land a write on etcd cluster `cluster` (shared
    /// data: `None`), as intervals: the VM did not run, its clock was stepped back (its timer
    /// waits for it), the cluster was in trouble, or a call of the VM to it was lost (its answer
    /// waited out for a timeout) or refused at dispatch.
    pub fn impaired(&self, envoy: usize, vm: usize, cluster: Option<usize>) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        out.extend(self.pauses.get(envoy).into_iter().flatten().copied());
        out.extend(self.stalls.get(vm).into_iter().flatten().copied());
        for (at, by) in self.steps.get(envoy).into_iter().flatten() {
            if *by < 0 {
                out.push((*at, at + by.unsigned_abs()));
            }
        }
        if let Some(c) = cluster {
            out.extend(self.etcd.get(c).into_iter().flatten().map(|w| (w.from, w.to)));
            let timeout = self.etcd_timeout_ms;
            out.extend(self.lost.iter().filter(|(v, lc, _)| *v == vm && *lc == c).map(|(_, _, t)| (*t, t + timeout)));
            out.extend(self.refused.iter().filter(|(v, _)| *v == vm).map(|(_, t)| (*t, *t)));
        }
        out
    }
}

/// The longest stretch of `from..to` that none of `busy` covers.
pub fn longest_clear(mut busy: Vec<(u64, u64)>, from: u64, to: u64) -> u64 {
    busy.sort_unstable();
    let (mut longest, mut at) = (0, from);
    for (a, b) in busy {
        if b <= at {
            continue;
        }
        if a >= to {
            break;
        }
        longest = longest.max(a.saturating_sub(at));
        at = at.max(b);
    }
    longest.max(to.saturating_sub(at))
}

#[cfg(test)]
mod tests {
    use super::longest_clear;

    #[test]
    fn the_longest_clear_stretch_skips_what_is_covered() {
        assert_eq!(longest_clear(vec![], 100, 400), 300);
        assert_eq!(longest_clear(vec![(150, 200), (180, 350)], 100, 400), 50);
        assert_eq!(longest_clear(vec![(0, 120), (300, 500)], 100, 400), 180);
        assert_eq!(longest_clear(vec![(0, 500)], 100, 400), 0);
        assert_eq!(longest_clear(vec![(500, 600)], 100, 400), 300);
    }
}
