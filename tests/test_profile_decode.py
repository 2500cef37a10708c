"""bench/profile_decode.py's attribution of a decode step to its kernels, on made-up timelines (the GPU run is in
bench/results): overlapping kernels (programmatic launches) are not counted twice, gaps are idle time, and the parts
add up to each replay's span."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.profile_decode import critical_path  # noqa: E402


def test_overlapping_kernels_share_the_span_without_double_counting():
    # a runs 0-10; b starts at 4 (scheduled early, waiting on a) and ends at 16; a gap; c runs 18-20.
    totals, span = critical_path([("b", 4, 16), ("a", 0, 10), ("c", 18, 20)])
    assert span == 20
    assert totals["a"] == [1, 10, 10, 0]
    assert totals["b"] == [1, 12, 6, 0]  # only 10-16 is its own
    assert totals["c"] == [1, 2, 2, 2]  # 16-18 idle before it
    assert sum(t[2] + t[3] for t in totals.values()) == span


def test_a_kernel_inside_another_adds_nothing_and_replays_are_told_apart():
    one = [("a", 0, 10), ("b", 2, 8)]
    two = [(name, start + 100, end + 100) for name, start, end in one]
    totals, span = critical_path(one + two + [("a", 200, 230), ("b", 202, 203)])
    assert totals["a"] == [3, 50, 50, 0] and totals["b"] == [3, 13, 0, 0]
    assert span == pytest.approx(10)  # the median of 10, 10 and 30
