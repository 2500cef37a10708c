"""How the GPU prompt path slices a weight larger than its dequantization scratch (capabilities.dequant_slice_rows):
whole where it fits, else slices of whole DEQUANT_SLICE_ROWS within the scratch, so each slice's output columns
start 16-byte aligned; the slices cover every row."""

import pytest

from engine import capabilities
from engine.capabilities import DEQUANT_SCRATCH_ELEMENTS, DEQUANT_SLICE_ROWS, dequant_slice_rows


@pytest.mark.parametrize("m,k", [(17408, 5120), (5120, 17408), (248320, 5120), (151936, 4096), (12289, 5461)])
def test_a_weight_larger_than_the_scratch_goes_in_aligned_slices_within_it(m, k):
    assert m * k > DEQUANT_SCRATCH_ELEMENTS
    rows = dequant_slice_rows(m, k)
    assert rows % DEQUANT_SLICE_ROWS == 0 and 0 < rows * k <= DEQUANT_SCRATCH_ELEMENTS
    assert rows + DEQUANT_SLICE_ROWS > DEQUANT_SCRATCH_ELEMENTS // k  # no smaller than it must be
    starts = range(0, m, rows)
    assert all(4 * lo % 16 == 0 for lo in starts) and len(starts) * rows >= m > (len(starts) - 1) * rows


@pytest.mark.parametrize("m,k", [(14336, 4096), (4096, 14336), (1, 8), (64, 2**20)])
def test_a_weight_the_scratch_holds_goes_whole(m, k):
    assert dequant_slice_rows(m, k) == m


def test_rows_too_long_for_whole_slices_go_as_many_as_fit(monkeypatch):
    monkeypatch.setattr(capabilities, "DEQUANT_SCRATCH_ELEMENTS", 100 * 1000)
    assert dequant_slice_rows(500, 1000) == 100
    assert dequant_slice_rows(500, 10**6) == 1
