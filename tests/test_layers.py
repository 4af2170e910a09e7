"""Local layer spec pieces: SDPA core attention (dense, packed per sequence, decoding)."""

from tests.distributed import run_ranks
from tests.model_workers import attention_vs_megatron_job


def test_sdpa_attention_matches_megatron_unfused_attention():
    dense, packed, decode = run_ranks(attention_vs_megatron_job, 1)[0]
    assert dense <= 1e-6
    assert packed <= 1e-6
    assert decode <= 1e-6
