"""Layout-independent weights: a dist checkpoint saved from one layout loads into any other."""

import pytest
import torch

from tests.distributed import run_layouts, run_ranks
from tests.model_workers import load_weights_job, save_random_weights_job

MODEL = dict(vocab_size=64, hidden_size=64, num_layers=2, num_attention_heads=4,
             num_query_groups=2, head_dim=16, ffn_hidden_size=96, moe_ffn_hidden_size=32,
             num_experts=4, top_k=2, first_k_dense=0, init_method_std=0.1,
             shared_expert_ffn_hidden_size=32, norm_topk_prob=False)  # shared expert, pre-softmax


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(1))
    path = str(tmp_path_factory.mktemp("weights") / "ckpt")
    per_rank = run_ranks(save_random_weights_job, 4, MODEL, dict(pp=2, ep=2), tokens, path)
    logp = [r for r in per_rank if r is not None][0]
    return path, tokens, logp


LOADERS = [(1, {}), (2, dict(tp=2, sequence_parallel=True)), (2, dict(ep=2))]


@pytest.fixture(scope="module")
def loaded(saved):
    """Per loading layout, the per-rank log-probs (the 2-rank layouts in one spawn)."""
    path, tokens, _ = saved
    out = {}
    for world in (1, 2):
        layouts = [layout for w, layout in LOADERS if w == world]
        results = run_layouts(world, [(load_weights_job, (layout, tokens, path))
                                      for layout in layouts])
        out.update({(world, str(layout)): r for layout, r in zip(layouts, results)})
    return out


@pytest.mark.parametrize("world,layout", LOADERS)
def test_checkpoint_from_pp2_ep2_loads_into_other_layouts(saved, loaded, world, layout):
    _, _, reference = saved
    per_rank = loaded[(world, str(layout))]
    assert any(r is not None for r in per_rank)  # the last stage's ranks return log-probs
    for logp in (r for r in per_rank if r is not None):
        assert (logp - reference).abs().max().item() <= 1e-5


def test_missing_checkpoint_is_named(tmp_path):
    from megatron_gspo.checkpoint.weights import read_model_config

    with pytest.raises(FileNotFoundError, match="no model_config.json"):
        read_model_config(str(tmp_path))
