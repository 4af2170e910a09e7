"""One set of weights, every CPU parallel layout: same log-probs, same as transformers, bitwise HF
round trip, forward+backward runs (real gloo ranks)."""

import os

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import LAYOUTS, PACKED_LAYOUTS, load_hf_tensors

@pytest.fixture(scope="module")
def tokens(layout_tokens):
    return layout_tokens


@pytest.fixture(scope="module")
def layout_results(layout_runs):
    results = {}
    for name in LAYOUTS:
        run = layout_runs[name]
        per_rank = run["model"]
        logps = [r["logp"] for r in per_rank if r["logp"] is not None]
        results[name] = dict(per_rank=per_rank, logp=logps[0],
                             entropy=[r["entropy"] for r in per_rank
                                      if r["entropy"] is not None][0],
                             export=run["export"], all_logp=logps)
    return results


def transformers_logp(hf_dir, tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits.double()
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]


@pytest.fixture(scope="module")
def hf_logp(tiny_hf_checkpoint, tokens):
    return transformers_logp(tiny_hf_checkpoint, tokens)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_forward_backward_runs(layout_results, name):
    for r in layout_results[name]["per_rank"]:
        assert r["grads_finite"]
        assert r["params_with_grad"] == r["params"], "every parameter receives a gradient"
        assert r["grad_sq"] > 0


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "single"])
def test_logprobs_agree_across_layouts(layout_results, name):
    reference = layout_results["single"]["logp"]
    for logp in layout_results[name]["all_logp"]:
        assert logp.shape == reference.shape == (4, 16)
        assert (logp - reference).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_logprobs_match_transformers(layout_results, hf_logp, name):
    logp = layout_results[name]["logp"].double()
    diff = (logp - hf_logp).abs().max().item()
    assert diff <= 1e-4, f"{name}: max |logp - HF logp| = {diff:.2e}"
    assert (logp <= 0).all()
    ent = layout_results[name]["entropy"]
    assert (ent >= -1e-6).all() and (ent <= torch.log(torch.tensor(128.0)) + 1e-5).all()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hf_round_trip_is_bitwise(layout_results, tiny_hf_checkpoint, name):
    original = load_file(os.path.join(tiny_hf_checkpoint, "model.safetensors"))
    exported = load_hf_tensors(layout_results[name]["export"])
    assert sorted(exported) == sorted(original)
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype, key
        assert torch.equal(exported[key], tensor), key


def test_unnormalised_topk_and_all_moe_layers_match_transformers(layout_runs,
                                                                  unnormalised_checkpoint, tokens):
    """norm_topk_prob=False (Megatron's pre-softmax router) with no leading dense layer, EP=2."""
    reference = transformers_logp(unnormalised_checkpoint, tokens)
    for r in layout_runs["unnormalised"]["model"]:
        assert (r["logp"].double() - reference).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", PACKED_LAYOUTS)
def test_packed_sequences_match_separate_sequences(layout_runs, name):
    assert any(r is not None for r in layout_runs[name]["packed"])  # the last stage's ranks
    for r in layout_runs[name]["packed"]:
        if r is not None:
            packed, separate = r
            assert packed.shape == separate.shape == (21,)
            assert (packed - separate).abs().max().item() <= 1e-5
