"""The optimizer's adaptations of megatron-core without Apex / Transformer Engine
(megatron_gspo/trainer/optim.py): the gradient norm's foreach kernel against the written-out formula,
alone and inside Megatron's optimizer step."""

import pytest
import torch

from megatron_gspo.trainer.optim import foreach_l2_norm
from tests.distributed import run_layouts
from tests.optim_workers import grad_norm_job


def test_foreach_l2_norm_is_the_norm_of_all_tensors():
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (7,), (2, 3, 4), (1,), (64, 32)]
    tensors = [torch.randn(s, generator=g) * (10.0 ** i) for i, s in enumerate(shapes)]
    norm, extra = foreach_l2_norm(2048 * 32, torch.zeros(1, dtype=torch.int), [tensors], False)
    expected = sum(float((t.double() ** 2).sum()) for t in tensors) ** 0.5
    assert extra is None and norm.shape == (1,) and norm.dtype == torch.float32
    assert norm.device == tensors[0].device
    assert abs(float(norm) - expected) <= 1e-6 * expected
    # two lists are one set of tensors
    split, _ = foreach_l2_norm(0, None, [tensors[:2], tensors[2:]], False)
    assert abs(float(split) - expected) <= 1e-6 * expected
    with pytest.raises(ValueError, match="per-tensor"):
        foreach_l2_norm(0, None, [tensors], True)


def test_megatron_step_reports_the_gradient_norm_through_it():
    (one,) = run_layouts(1, [(grad_norm_job, ({},))])[0]
    assert one["kernel"] == "foreach_l2_norm"  # no Apex / TE here: Megatron's fallback replaced
    assert one["reference"] > 0
    assert abs(one["grad_norm"] - one["reference"]) <= 1e-6 * one["reference"], one
