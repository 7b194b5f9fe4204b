"""The Python copies of the plugin's encodings (tests/chaos.py: the store key, an etcd entry's
header) against vectors the Rust code asserts too (src/key.rs `store_key_vector`,
src/encoding.rs `etcd_entry_vector`): when one side changes, both tests fail."""

import chaos

KEY_VECTOR = "2cf6ad973cc0d74141c28f40258ea4426f5731fa10da47ab86dc3dd54cbdd879"
ENTRY_VECTOR = ("450201080706050403020107070707070707070707070707070707090909090909090909090909090909"
                "097b505c18a30100006b295c18a301000000000000")


def test_store_key_matches_the_plugin():
    assert chaos.store_key("vector-key", authority="localhost").hex() == KEY_VECTOR


def test_etcd_entry_header_matches_the_plugin():
    state, gen, deadline = chaos.decode_way(bytes.fromhex(ENTRY_VECTOR))
    assert (state, gen, deadline) == ("in_progress", 0x0102030405060708, 1_800_000_000_123)
