//! Byte strings: equality eight bytes at a time, and a little-endian word read in place.
//!
//! `==` on slices calls the C library's `memcmp`, which wasi-libc runs one byte per loop turn
//! (about 20 Wasm instructions a byte). A retry's store-key message, body and fingerprint
//! message are compared in full at every request (the digest memo), and header names at every
//! lookup: through `memcmp` that was a fifth of a replay's Wasm work (`bench/fuel_profile.py`).

/// Whether `a` and `b` hold the same bytes.
pub fn equal(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let (mut x, mut y) = (a.chunks_exact(8), b.chunks_exact(8));
    if !(&mut x).zip(&mut y).all(|(p, q)| word(p) == word(q)) {
        return false;
    }
    x.remainder().iter().zip(y.remainder()).all(|(p, q)| p == q)
}

/// The little-endian `u64` at `at` in `bytes`; 0 when fewer than 8 bytes are there.
pub fn u64_at(bytes: &[u8], at: usize) -> u64 {
    bytes.get(at..at.saturating_add(8)).and_then(|b| <[u8; 8]>::try_from(b).ok()).map_or(0, u64::from_le_bytes)
}

/// The little-endian `u32` at `at` in `bytes`; 0 when fewer than 4 bytes are there.
pub fn u32_at(bytes: &[u8], at: usize) -> u32 {
    bytes.get(at..at.saturating_add(4)).and_then(|b| <[u8; 4]>::try_from(b).ok()).map_or(0, u32::from_le_bytes)
}

/// An 8-byte chunk as one word (`chunks_exact(8)` yields only those).
fn word(chunk: &[u8]) -> u64 {
    u64_at(chunk, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_word_is_read_little_endian_and_is_zero_past_the_end() {
        let bytes: Vec<u8> = (1..=10).collect();
        assert_eq!(u64_at(&bytes, 0), 0x0807_0605_0403_0201);
        assert_eq!(u64_at(&bytes, 2), 0x0a09_0807_0605_0403);
        assert_eq!(u64_at(&bytes, 3), 0, "only 7 bytes left");
        assert_eq!(u64_at(&bytes, usize::MAX), 0);
    }

    #[test]
    fn agrees_with_slice_equality_at_every_length_and_position() {
        for len in 0..40 {
            let a: Vec<u8> = (0..len as u8).map(|i| i.wrapping_mul(37)).collect();
            assert!(equal(&a, &a.clone()), "len {len}");
            for at in 0..len {
                let mut b = a.clone();
                b[at] ^= 0x80;
                assert!(!equal(&a, &b), "len {len}, byte {at} differs");
            }
            let mut longer = a.clone();
            longer.push(0);
            assert!(!equal(&a, &longer) && !equal(&longer, &a), "len {len} against one more");
        }
    }
}
