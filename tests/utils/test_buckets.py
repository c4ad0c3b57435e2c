"""`cut_by_bytes`: the bucket rule of weight-sync chunks and sglang weight shards."""

from __future__ import annotations

from miles.utils.buckets import cut_by_bytes


def test_cut_keeps_order_caps_bytes_and_lets_a_large_item_stand_alone() -> None:
    sizes = [("a", 4), ("b", 4), ("c", 10), ("d", 1), ("e", 7)]
    assert cut_by_bytes(sizes, 8) == [["a", "b"], ["c"], ["d", "e"]]
    assert cut_by_bytes(sizes, 1) == [["a"], ["b"], ["c"], ["d"], ["e"]]
    assert cut_by_bytes(sizes, None) == [["a", "b", "c", "d", "e"]]
    assert cut_by_bytes([], 8) == [] and cut_by_bytes([], None) == []
