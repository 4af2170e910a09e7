"""Local layer spec pieces: SDPA core attention and the packed-sequence mask."""

import torch

from megatron_gspo.layers import packed_causal_mask
from tests.distributed import run_ranks
from tests.model_workers import attention_vs_megatron_job


def test_packed_causal_mask_is_block_diagonal_causal():
    mask = packed_causal_mask(torch.tensor([0, 2, 5]), 5)
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_sdpa_attention_matches_megatron_unfused_attention():
    dense, packed, decode = run_ranks(attention_vs_megatron_job, 1)[0]
    assert dense <= 1e-6
    assert packed <= 1e-6
    assert decode <= 1e-6
