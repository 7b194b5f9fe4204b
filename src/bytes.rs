//! Byte-string equality eight bytes at a time. `==` on slices calls the C library's `memcmp`,
//! which wasi-libc runs one byte per loop turn (about 20 Wasm instructions a byte). A retry's
//! store-key message, body and fingerprint message are compared in full at every request (the
//! digest memo), and header names at every lookup: through `memcmp` that was a fifth of a
//! replay's Wasm work (`bench/fuel_profile.py`).

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

/// An 8-byte chunk as one word (`chunks_exact(8)` yields only those).
fn word(chunk: &[u8]) -> u64 {
    <[u8; 8]>::try_from(chunk).map_or(0, u64::from_le_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

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
