"""GSPO through the Megatron model on every foundation layout: the same loss, gradient norm and
updated policy on 1 rank and on N ranks (real gloo ranks, fp32)."""

import pytest
import torch

from tests.distributed import run_ranks
from tests.model_workers import gspo_step_job
from tests.test_model_layouts import LAYOUTS


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(21)
    tokens = torch.randint(0, 128, (4, 17), generator=g)
    delta = 2e-4 * torch.randn(4, 16, generator=g)  # old policy slightly off: some clipping
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    mask = torch.zeros(4, 16)
    for i, n in enumerate([16, 7, 1, 10]):
        mask[i, 16 - n:] = 1
    return tokens, delta, adv, mask


@pytest.fixture(scope="module")
def results(tiny_hf_checkpoint, inputs):
    out = {}
    for name, (world, kwargs) in LAYOUTS.items():
        per_rank = run_ranks(gspo_step_job, world, tiny_hf_checkpoint, kwargs, *inputs, "gspo")
        out[name] = per_rank
    return out


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "single"])
def test_gspo_step_is_layout_invariant(results, name):
    ref = results["single"][0]
    assert 0 < ref["metrics"]["clip_fraction"] < 1  # both clipped and unclipped sequences
    for r in results[name]:
        assert abs(r["metrics"]["loss"] - ref["metrics"]["loss"]) <= 1e-6
        assert r["metrics"]["clip_fraction"] == ref["metrics"]["clip_fraction"]
        assert abs(r["grad_norm"] - ref["grad_norm"]) <= 1e-5 * ref["grad_norm"]
        if r["after"] is not None:
            assert (r["after"] - ref["after"]).abs().max().item() <= 1e-5


def test_step_changes_the_policy(results, tiny_hf_checkpoint, inputs):
    ref = results["single"][0]
    assert ref["grad_norm"] > 0
    before = run_ranks(gspo_step_job, 1, tiny_hf_checkpoint, {}, *inputs, "gspo")[0]
    assert before["after"].shape == (4, 16)
