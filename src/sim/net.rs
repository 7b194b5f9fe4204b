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
}

#[derive(Debug, Clone, Copy)]
pub struct Window {
    pub from: u64,
    pub to: u64,
    pub trouble: Trouble,
}

/// The faults one seed draws for its run.
pub struct Faults {
    /// Per etcd cluster.
    pub etcd: Vec<Vec<Window>>,
    /// Each direction of an etcd call takes up to this long.
    pub etcd_latency_max: u64,
    /// Per mille of etcd calls lost before etcd sees them, and after it applied them.
    pub lose_before: u64,
    pub lose_after: u64,
    /// Per Envoy: when it is paused (SIGSTOP), none of its VMs run.
    pub pauses: Vec<Vec<(u64, u64)>>,
    /// Per Envoy: clock steps (when, by how many ms; negative: back), as NTP steps a clock.
    pub steps: Vec<Vec<(u64, i64)>>,
}

/// The largest clock step drawn, either way.
pub const STEP_MAX_MS: u64 = 3_000;

impl Faults {
    pub fn draw(rng: &mut Rng, clusters: usize, envoys: usize, horizon: u64) -> Faults {
        let slow = rng.chance(300);
        let etcd_latency_max = if slow { rng.range(100, 200) } else { rng.range(1, 30) };
        let lossy = rng.chance(300);
        let (lose_before, lose_after) = if lossy { (rng.range(5, 40), rng.range(5, 40)) } else { (0, 0) };
        let mut etcd = Vec::new();
        for _ in 0..clusters {
            let mut windows = Vec::new();
            if rng.chance(400) {
                let kinds = [Trouble::Down, Trouble::Stalled, Trouble::NoSpace, Trouble::NoLeader];
                let trouble = rng.pick(&kinds).unwrap_or(Trouble::Down);
                let from = rng.range(500, horizon);
                let to = from + rng.range(200, 5_000);
                windows.push(Window { from, to, trouble });
            }
            etcd.push(windows);
        }
        let mut pauses = Vec::new();
        for _ in 0..envoys {
            let mut windows = Vec::new();
            if rng.chance(150) {
                let from = rng.range(500, horizon);
                windows.push((from, from + rng.range(200, 6_000)));
            }
            pauses.push(windows);
        }
        let mut steps = Vec::new();
        for _ in 0..envoys {
            let mut at = Vec::new();
            if rng.chance(150) {
                let by = rng.range(100, STEP_MAX_MS) as i64;
                at.push((rng.range(500, horizon), if rng.chance(500) { by } else { -by }));
            }
            steps.push(at);
        }
        Faults { etcd, etcd_latency_max, lose_before, lose_after, pauses, steps }
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

    /// Whether an owner's mark may have expired under it between `from` and `to`: the time its
    /// renewals could not land (the longest pause of its Envoy, the longest etcd stall, outage,
    /// election or refusal for space) plus how far the clocks were set apart by steps before
    /// `to` reaches half a lease. They add up: a renewal that cannot land for a second while
    /// another Envoy's clock runs a second and a half ahead loses a three-second mark. Each
    /// Envoy judges a mark's deadline by its own clock: one Envoy's step forward expires its
    /// marks early; in a fleet, a step either way sets one Envoy's clock apart from the one
    /// that wrote the deadline.
    /// `lost_ms`: the time the owner's VM spent waiting out calls the network lost.
    pub fn may_lose_lease(&self, envoy: usize, from: u64, to: u64, lease_ms: u64, lost_ms: u64) -> bool {
        let within = |a: u64, b: u64| b.min(to).saturating_sub(a.max(from));
        let paused = self.pauses.get(envoy).map_or(0, |p| p.iter().map(|(a, b)| within(*a, *b)).max().unwrap_or(0));
        let etcd = self.etcd.iter().flatten().map(|w| within(w.from, w.to)).max().unwrap_or(0);
        let fleet = self.steps.len() > 1;
        let apart = |by: i64| if fleet { by.unsigned_abs() } else { by.max(0) as u64 };
        let stepped: u64 = self.steps.iter().flatten().filter(|(at, _)| *at <= to).map(|(_, by)| apart(*by)).sum();
        (paused + etcd + stepped + lost_ms) * 2 >= lease_ms
    }

    /// Whether any etcd trouble, loss or pause touched `from..to`, or a clock stepped before
    /// `to` so that a mark lives longer by the step: back, or in a fleet either way (a writer
    /// stepped forward writes deadlines ahead of the other Envoys' clocks).
    pub fn any_between(&self, from: u64, to: u64) -> bool {
        let overlaps = |a: u64, b: u64| a < to && from < b;
        let fleet = self.steps.len() > 1;
        self.lose_before > 0
            || self.lose_after > 0
            || self.etcd.iter().flatten().any(|w| overlaps(w.from, w.to))
            || self.pauses.iter().flatten().any(|(a, b)| overlaps(*a, *b))
            || self.steps.iter().flatten().any(|(at, by)| *at < to && (*by < 0 || fleet))
    }
}
