//! A request's header map in the form the host hands it over (proxy-wasm's serialized map),
//! read in place. The SDK's reader makes a `String` and a `Vec` of every header, two
//! allocations each in the VM; a covered request reads five or six of its ten headers once.
//!
//! The form: the pair count (u32 LE), then each pair's name and value lengths (u32 LE each),
//! then each name and each value followed by a NUL.

/// Hop-by-hop headers (RFC 9110 §7.6.1) and those Envoy recomputes for a local reply: never
/// stored or replayed.
pub fn is_hop_by_hop(name: &str) -> bool {
    matches!(
        name,
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "content-length"
    ) || name.starts_with(':')
}

/// A serialized header map, checked once when it is made.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HeaderMap {
    bytes: Vec<u8>,
}

impl HeaderMap {
    /// The host's bytes; a map whose sizes do not add up reads as empty.
    pub fn parse(bytes: Vec<u8>) -> HeaderMap {
        let map = HeaderMap { bytes };
        if map.well_formed() {
            map
        } else {
            HeaderMap::default()
        }
    }

    /// The serialized form of `pairs` (tests, and the headers of a local reply).
    pub fn from_pairs<N: AsRef<[u8]>, V: AsRef<[u8]>>(pairs: &[(N, V)]) -> HeaderMap {
        let size = 4 + pairs.iter().map(|(n, v)| 10 + n.as_ref().len() + v.as_ref().len()).sum::<usize>();
        let mut bytes = Vec::with_capacity(size);
        bytes.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
        for (n, v) in pairs {
            bytes.extend_from_slice(&(n.as_ref().len() as u32).to_le_bytes());
            bytes.extend_from_slice(&(v.as_ref().len() as u32).to_le_bytes());
        }
        for (n, v) in pairs {
            bytes.extend_from_slice(n.as_ref());
            bytes.push(0);
            bytes.extend_from_slice(v.as_ref());
            bytes.push(0);
        }
        HeaderMap { bytes }
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// This map without any `name`, then `name: value` at its end when given.
    pub fn replaced(&self, name: &str, value: Option<&str>) -> HeaderMap {
        let mut pairs: Vec<(&[u8], &[u8])> = self.iter().filter(|(n, _)| *n != name.as_bytes()).collect();
        pairs.extend(value.map(|v| (name.as_bytes(), v.as_bytes())));
        HeaderMap::from_pairs(&pairs)
    }

    /// Every pair as text, when every name and value is UTF-8 (what `dispatch_http_call` takes).
    pub fn as_text(&self) -> Option<Vec<(&str, &str)>> {
        let text = |bytes| std::str::from_utf8(bytes).ok();
        self.iter().map(|(n, v)| Some((text(n)?, text(v)?))).collect()
    }

    /// Whether every name and value is UTF-8, checked without building `as_text`'s list.
    pub fn is_text(&self) -> bool {
        let text = |bytes| std::str::from_utf8(bytes).is_ok();
        self.iter().all(|(n, v)| text(n) && text(v))
    }

    /// Every pair, in order, repeats kept.
    pub fn iter(&self) -> Pairs<'_> {
        let count = self.bytes.get(..4).map_or(0, read_u32);
        let table_end = count.saturating_mul(8).saturating_add(4);
        Pairs {
            sizes: self.bytes.get(4..table_end).unwrap_or_default(),
            data: self.bytes.get(table_end..).unwrap_or_default(),
        }
    }

    /// The first value of `name` (names are lower-case, as Envoy hands them over).
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.values(name).next()
    }

    /// Every value of `name`, in request order.
    pub fn values<'a, 'n>(&'a self, name: &'n str) -> impl Iterator<Item = &'a [u8]> + use<'a, 'n> {
        self.iter().filter(move |(n, _)| crate::bytes::equal(n, name.as_bytes())).map(|(_, v)| v)
    }

    fn well_formed(&self) -> bool {
        let Some(count) = self.bytes.get(..4).map(read_u32) else {
            return self.bytes.is_empty();
        };
        let Some(table_end) = count.checked_mul(8).and_then(|t| t.checked_add(4)) else {
            return false;
        };
        let Some(sizes) = self.bytes.get(4..table_end) else {
            return false;
        };
        let data: usize = sizes.chunks_exact(4).map(|s| read_u32(s) + 1).sum();
        table_end.checked_add(data) == Some(self.bytes.len())
    }
}

/// The pairs of a map, as byte slices of it.
pub struct Pairs<'a> {
    sizes: &'a [u8],
    data: &'a [u8],
}

impl<'a> Iterator for Pairs<'a> {
    type Item = (&'a [u8], &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        let (lengths, sizes) = self.sizes.split_first_chunk::<8>()?;
        let (name_len, value_len) = lengths.split_at(4);
        let name = take(&mut self.data, read_u32(name_len))?;
        let value = take(&mut self.data, read_u32(value_len))?;
        self.sizes = sizes;
        Some((name, value))
    }
}

/// The next `len` bytes and the NUL after them.
fn take<'a>(data: &mut &'a [u8], len: usize) -> Option<&'a [u8]> {
    let (field, rest) = data.split_at_checked(len)?;
    *data = rest.get(1..)?;
    Some(field)
}

/// A little-endian u32 from the first 4 of `bytes` (callers pass 4); 0 when shorter.
fn read_u32(bytes: &[u8]) -> usize {
    bytes.first_chunk::<4>().map_or(0, |w| u32::from_le_bytes(*w) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(map: &HeaderMap) -> Vec<(String, Vec<u8>)> {
        map.iter().map(|(n, v)| (String::from_utf8_lossy(n).into_owned(), v.to_vec())).collect()
    }

    #[test]
    fn reads_what_it_wrote_in_order_with_repeats_and_any_bytes() {
        let given: Vec<(&str, &[u8])> =
            vec![(":method", b"POST"), ("x-a", b"1"), ("x-a", b""), ("bin", b"\xff\x00z"), ("", b"v")];
        let map = HeaderMap::parse(HeaderMap::from_pairs(&given).as_bytes().to_vec());
        let want: Vec<(String, Vec<u8>)> = given.iter().map(|(n, v)| (n.to_string(), v.to_vec())).collect();
        assert_eq!(pairs(&map), want);
        assert_eq!(map.get("x-a"), Some(&b"1"[..]));
        assert_eq!(map.values("x-a").collect::<Vec<_>>(), vec![&b"1"[..], &b""[..]]);
        assert_eq!(map.get("bin"), Some(&b"\xff\x00z"[..]));
        assert_eq!(map.get("x-b"), None);
        assert_eq!(map.as_text(), None, "a value is not UTF-8");
        assert!(!map.is_text());
        let name = HeaderMap::from_pairs(&[(&b"x-\xff"[..], &b"v"[..])]);
        assert!(!name.is_text() && name.as_text().is_none(), "a name is not UTF-8");
        assert!(HeaderMap::from_pairs(&given[..3]).is_text());
    }

    #[test]
    fn replaced_drops_every_value_of_the_name_and_appends_the_new_one() {
        let map = HeaderMap::from_pairs(&[("a", "1"), ("x-f", "forged"), ("b", "2"), ("x-f", "again")]);
        let token = map.replaced("x-f", Some("7"));
        assert_eq!(token.as_text().unwrap(), vec![("a", "1"), ("b", "2"), ("x-f", "7")]);
        let none = map.replaced("x-f", None);
        assert_eq!(none.as_text().unwrap(), vec![("a", "1"), ("b", "2")]);
        assert_eq!(map.replaced("x-g", None), map);
    }

    #[test]
    fn an_empty_map_and_no_bytes_read_as_empty() {
        let none: [(&str, &str); 0] = [];
        assert_eq!(HeaderMap::parse(HeaderMap::from_pairs(&none).as_bytes().to_vec()).iter().count(), 0);
        assert_eq!(HeaderMap::parse(Vec::new()).iter().count(), 0);
    }

    #[test]
    fn a_map_whose_sizes_do_not_add_up_reads_as_empty() {
        let good = HeaderMap::from_pairs(&[("a", "1"), ("b", "22")]).as_bytes().to_vec();
        for cut in 1..good.len() {
            let short = good.get(..cut).unwrap().to_vec();
            assert_eq!(HeaderMap::parse(short).iter().count(), 0, "cut at {cut}");
        }
        let mut long = good.clone();
        long.push(0);
        assert_eq!(HeaderMap::parse(long).iter().count(), 0);
        let mut huge = good.clone();
        huge.splice(0..4, u32::MAX.to_le_bytes());
        assert_eq!(HeaderMap::parse(huge).iter().count(), 0);
        let mut lying = good;
        lying.splice(4..8, 2u32.to_le_bytes()); // name "a" said to be 2 bytes long
        assert_eq!(HeaderMap::parse(lying).iter().count(), 0);
        assert_eq!(HeaderMap::parse(vec![1, 0]).iter().count(), 0);
    }
}
