//! Defects the simulator must catch, planted one at a time in a test build (docs/simulator.md,
//! "Defects it must catch"). Each names a rule of docs/behaviour.md that the product code
//! breaks where [`planted`] says so. Outside tests `planted` is a constant `false`: the
//! checks compile away and the plugin carries none of this.

/// A rule broken on purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Defect {
    /// A duplicate of a key in progress goes upstream unclaimed instead of its 409 (§3.3).
    DuplicateForwarded,
    /// A detached call goes although its pre-send renewal found its mark lost (§3.5).
    SentAfterMarkLost,
    /// A failed call does not release its key: its mark stays until it expires (§3.4).
    NoRelease,
    /// A claim is written without its compare: two claims of one key both win (§3.2).
    ClaimWithoutCompare,
    /// A held duplicate goes upstream unclaimed when its poll meets a failing store (§3.8).
    HeldForwardedOnFailure,
    /// The store key ignores the caller's scope: one caller replays another's answer (§3.1).
    ScopeIgnored,
    /// A key reused with another request replays the first request's answer, not 422 (§3.6).
    MismatchReplayed,
    /// The stored answer differs from the one the client got (§3.4).
    StoredAnswerDiffers,
    /// The fencing token sent upstream is not the claim's (§3.9).
    FenceNotTheClaims,
    /// A live owner's mark is never renewed: it expires under a long call (§3.5).
    RenewalSkipped,
    /// A release removes the key whoever holds it now (§3.8).
    ReleaseWithoutCompare,
    /// A live in-progress mark is taken as expired (§3.5).
    LiveMarkTakenOver,
    /// The client's own fencing header passes on (§3.9).
    ForgedFencePasses,
    /// An owner's write stuck in an etcd without a leader is never tried again beside it, and
    /// an owner's write stops being urgent once its own clock says its deadline passed (the
    /// leader-loss duplicate, docs/fleet.md).
    WriteNotHedged,
}

impl Defect {
    pub const ALL: [Defect; 14] = [
        Defect::DuplicateForwarded,
        Defect::SentAfterMarkLost,
        Defect::NoRelease,
        Defect::ClaimWithoutCompare,
        Defect::HeldForwardedOnFailure,
        Defect::ScopeIgnored,
        Defect::MismatchReplayed,
        Defect::StoredAnswerDiffers,
        Defect::FenceNotTheClaims,
        Defect::RenewalSkipped,
        Defect::ReleaseWithoutCompare,
        Defect::LiveMarkTakenOver,
        Defect::ForgedFencePasses,
        Defect::WriteNotHedged,
    ];
}

#[cfg(test)]
thread_local! {
    static PLANTED: std::cell::Cell<Option<Defect>> = const { std::cell::Cell::new(None) };
}

/// Whether `defect` is planted (in this thread, tests only).
#[cfg(test)]
pub fn planted(defect: Defect) -> bool {
    PLANTED.with(|p| p.get() == Some(defect))
}

#[cfg(not(test))]
#[inline(always)]
pub const fn planted(_: Defect) -> bool {
    false
}

/// Plants `defect` in this thread until the guard is dropped.
#[cfg(test)]
pub fn plant(defect: Defect) -> Planted {
    PLANTED.with(|p| p.set(Some(defect)));
    Planted
}

#[cfg(test)]
pub struct Planted;

#[cfg(test)]
impl Drop for Planted {
    fn drop(&mut self) {
        PLANTED.with(|p| p.set(None));
    }
}
