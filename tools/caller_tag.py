#!/usr/bin/env python3
"""The caller tag the plugin logs for a scope (docs/operations.md, "A flooding caller").

    python3 tools/caller_tag.py 'Bearer alice'            # one scope value
    python3 tools/caller_tag.py 'tenant-7' 'Bearer alice' # several, in scope order
    python3 tools/caller_tag.py --absent 'Bearer alice'   # an absent first value

Each argument is one scope value in the order the plugin reads them: `scope_headers` in order,
then the peer identity (`scope_peer`), then the JWT claim (`scope_jwt_claim`). The tag is 20
bits of FNV-1a over the length-prefixed values, as src/caller.rs computes it.
"""
import struct
import sys

MASK = (1 << 20) - 1


def caller_tag(scopes):
    if all(s is None for s in scopes):
        return 0
    h = 0xCBF29CE484222325
    def eat(data):
        nonlocal h
        for b in data:
            h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    for s in scopes:
        if s is None:
            eat(b"\xff" * 8)
        else:
            eat(struct.pack("<Q", len(s)))
            eat(s)
    folded = (h ^ (h >> 20) ^ (h >> 40)) & MASK
    return folded or 1


def main(argv):
    scopes = []
    for arg in argv:
        if arg == "--absent":
            scopes.append(None)
        else:
            scopes.append(arg.encode())
    print(f"{caller_tag(scopes):05x}")


if __name__ == "__main__":
    main(sys.argv[1:])
