#!/usr/bin/env python3
"""The caller tag the plugin logs for a scope (docs/operations.md, "A flooding caller").

    python3 tools/caller_tag.py --key KEY 'Bearer alice'            # one scope value
    python3 tools/caller_tag.py --key KEY 'tenant-7' 'Bearer alice' # several, in scope order
    python3 tools/caller_tag.py --key KEY --absent 'Bearer alice'   # an absent first value

KEY is the Envoy's secret for callers' tags: 32 hex digits, logged once at info level when the
Envoy made it ("callers' tags are keyed with this Envoy's secret …"). Each Envoy has its own, so
a tag names a caller on one Envoy only, and no client can compute one.

Each other argument is one scope value in the order the plugin reads them: `scope_headers` in
order, then the peer identity (`scope_peer`), then the JWT claim (`scope_jwt_claim`). The tag
is SipHash-2-4, keyed with KEY, over the length-prefixed values (an absent one as eight 0xff
bytes), folded to 20 bits, as src/caller.rs computes it.
"""
import struct
import sys

MASK = (1 << 20) - 1
M64 = (1 << 64) - 1


def _rotl(x, b):
    return ((x << b) | (x >> (64 - b))) & M64


def siphash24(key, data):
    """SipHash-2-4 of `data` under the 16-byte `key` (Aumasson and Bernstein, 2012)."""
    k0, k1 = struct.unpack("<QQ", key)
    v0, v1 = k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D
    v2, v3 = k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573

    def rounds(n):
        nonlocal v0, v1, v2, v3
        for _ in range(n):
            v0 = (v0 + v1) & M64
            v1 = _rotl(v1, 13) ^ v0
            v0 = _rotl(v0, 32)
            v2 = (v2 + v3) & M64
            v3 = _rotl(v3, 16) ^ v2
            v0 = (v0 + v3) & M64
            v3 = _rotl(v3, 21) ^ v0
            v2 = (v2 + v1) & M64
            v1 = _rotl(v1, 17) ^ v2
            v2 = _rotl(v2, 32)

    whole = len(data) - len(data) % 8
    for at in range(0, whole, 8):
        m = struct.unpack_from("<Q", data, at)[0]
        v3 ^= m
        rounds(2)
        v0 ^= m
    tail = data[whole:] + bytes(7 - len(data) % 8)
    m = ((len(data) & 0xFF) << 56) | int.from_bytes(tail, "little")
    v3 ^= m
    rounds(2)
    v0 ^= m
    v2 ^= 0xFF
    rounds(4)
    return v0 ^ v1 ^ v2 ^ v3


def caller_tag(key, scopes):
    if all(s is None for s in scopes):
        return 0
    data = b"".join(b"\xff" * 8 if s is None else struct.pack("<Q", len(s)) + s for s in scopes)
    h = siphash24(key, data)
    folded = (h ^ (h >> 20) ^ (h >> 40)) & MASK
    return folded or 1


def main(argv):
    key, scopes = None, []
    args = iter(argv)
    for arg in args:
        if arg == "--key":
            key = bytes.fromhex(next(args, ""))
        elif arg == "--absent":
            scopes.append(None)
        else:
            scopes.append(arg.encode())
    if key is None or len(key) != 16:
        sys.exit("usage: caller_tag.py --key KEY (32 hex digits, logged by the Envoy) [--absent] SCOPE...")
    print(f"{caller_tag(key, scopes):05x}")


if __name__ == "__main__":
    main(sys.argv[1:])
