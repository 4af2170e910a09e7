"""BufferPool (megatron_gspo/buffers.py): what it hands out and what it refuses."""

import pytest
import torch

from megatron_gspo.buffers import BufferPool


def test_pool_hands_out_the_smallest_fitting_buffer_of_the_dtype_and_refuses_a_double_give():
    pool = BufferPool()
    like = torch.zeros(1)
    small, big = pool.take((4, 5), like), pool.take((10, 10), like)
    assert small.shape == (4, 5) and small.is_contiguous() and big.numel() == 100
    assert small.data_ptr() != big.data_ptr()
    pool.give(small, big)
    again = pool.take((3, 6), like)  # 18 elements: the 20-element buffer (grown to 26) fits best
    assert again.data_ptr() == small.data_ptr() and again.shape == (3, 6)
    assert pool.take((2,), torch.zeros(1, dtype=torch.float64)).dtype == torch.float64  # not big
    assert [b.data_ptr() for b in pool.free] == [big.data_ptr()]
    grown = pool.take((200,), like)  # larger than any kept buffer: a new one
    assert grown.data_ptr() not in (small.data_ptr(), big.data_ptr())
    pool.give(again, grown)
    with pytest.raises(RuntimeError, match="given back twice"):
        pool.give(again)
    pool.give(torch.empty_strided((4, 5), (1, 4)))  # an allocation not laid out contiguously
    assert len(pool.free) == 3
