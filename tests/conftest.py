import json
import os

import pytest

from tests.distributed import run_ranks

# The tiny Qwen3-MoE every reference test uses: a leading dense layer, GQA, QK-norm, 4 experts top-2.
TINY_HF_CONFIG = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
    tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6, initializer_range=0.1,
    max_position_embeddings=256,
)


@pytest.fixture
def dist_run():
    """Run a function on N real gloo ranks: ``dist_run(fn, world_size, *args)``."""
    return run_ranks


def make_hf_checkpoint(path, **overrides):
    """Save a randomly initialised transformers Qwen3MoeForCausalLM (fp32) as a HF checkpoint."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**TINY_HF_CONFIG, **overrides})).float()
    with torch.no_grad():  # non-trivial norm weights so that a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["model_type"] == "qwen3_moe"
    return path


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory):
    return make_hf_checkpoint(str(tmp_path_factory.mktemp("hf_tiny")))


@pytest.fixture(scope="session")
def perturbed_checkpoint(tiny_hf_checkpoint, tmp_path_factory):
    """The tiny checkpoint with every tensor moved by 0.2 N(0, 1): (directory, tensors)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("hf_perturbed")
    for f in os.listdir(tiny_hf_checkpoint):
        shutil.copy(os.path.join(tiny_hf_checkpoint, f), path)
    tensors = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    tensors = {k: v + 0.2 * torch.randn(v.shape, generator=g) for k, v in tensors.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path), tensors
