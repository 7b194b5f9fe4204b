//! The effective retention (docs/behaviour.md §3.7): how old the youngest entry evicted in the last minute
//! was, that is the replay window the traffic really gets when room runs out. Every worker
//! evicts, so the figure is kept for the whole process in one shared-data key, as two windows
//! of a minute (the current one and the one before); each worker adds what it evicted about
//! once a second and shows the result as a gauge.

use crate::encoding::Corrupt;

const WINDOW_MS: u64 = 60_000;
const ENCODED_BYTES: usize = 24;
const NONE: u64 = u64::MAX;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EvictionWindow {
    /// When the current window started.
    pub start_ms: u64,
    /// The youngest evicted age in the current window, and in the one before.
    pub current: Option<u64>,
    pub previous: Option<u64>,
}

impl EvictionWindow {
    /// The window at `now`, with an eviction of age `youngest_ms` added if there was one.
    pub fn with(self, now_ms: u64, youngest_ms: Option<u64>) -> EvictionWindow {
        let mut w = self.rolled(now_ms);
        if let Some(age) = youngest_ms {
            w.current = Some(w.current.map_or(age, |c| c.min(age)));
        }
        w
    }

    fn rolled(self, now_ms: u64) -> EvictionWindow {
        let end = self.start_ms.saturating_add(WINDOW_MS);
        if now_ms < end {
            self
        } else if now_ms < end.saturating_add(WINDOW_MS) {
            EvictionWindow { start_ms: end, current: None, previous: self.current }
        } else {
            EvictionWindow { start_ms: now_ms, current: None, previous: None }
        }
    }

    /// The youngest evicted age of the last one to two minutes; 0 when nothing was evicted
    /// (every entry gets its full `retention_s`).
    pub fn effective_retention_ms(&self) -> u64 {
        match (self.current, self.previous) {
            (Some(a), Some(b)) => a.min(b),
            (Some(a), None) | (None, Some(a)) => a,
            (None, None) => 0,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(ENCODED_BYTES);
        for n in [self.start_ms, self.current.unwrap_or(NONE), self.previous.unwrap_or(NONE)] {
            out.extend_from_slice(&n.to_le_bytes());
        }
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<EvictionWindow, Corrupt> {
        if bytes.is_empty() {
            return Ok(EvictionWindow::default());
        }
        if bytes.len() != ENCODED_BYTES {
            return Err(Corrupt("evictions: wrong size"));
        }
        let word = |i: usize| crate::bytes::u64_at(bytes, i * 8);
        let some = |n: u64| (n != NONE).then_some(n);
        Ok(EvictionWindow { start_ms: word(0), current: some(word(1)), previous: some(word(2)) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_youngest_eviction_of_the_last_minute_is_shown() {
        let w = EvictionWindow::default().with(1_000_000, Some(5_000));
        assert_eq!(w.effective_retention_ms(), 5_000);
        let w = w.with(1_010_000, Some(9_000)).with(1_020_000, Some(4_000));
        assert_eq!(w.effective_retention_ms(), 4_000);
        // Next window: the previous one still counts.
        let w = w.with(1_070_000, Some(8_000));
        assert_eq!(w.effective_retention_ms(), 4_000);
        // Two windows later it is forgotten.
        let w = w.with(1_125_000, None);
        assert_eq!(w.effective_retention_ms(), 8_000);
        let w = w.with(1_300_000, None);
        assert_eq!(w.effective_retention_ms(), 0, "nothing evicted lately");
    }

    #[test]
    fn encoding_round_trips_and_refuses_foreign_values() {
        let w = EvictionWindow { start_ms: 7, current: Some(3), previous: None };
        assert_eq!(EvictionWindow::decode(&w.encode()).unwrap(), w);
        assert_eq!(EvictionWindow::decode(b"").unwrap(), EvictionWindow::default());
        assert!(EvictionWindow::decode(b"foreign").is_err());
    }
}
