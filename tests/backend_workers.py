"""Run in a fresh spawned process: megatron-core's CUDA assumptions fail on CPU before the CPU
backend is activated and work after it; nothing is applied for a CUDA device."""

from __future__ import annotations

import torch


def _fails(fn) -> str:
    try:
        fn()
    except (AssertionError, RuntimeError, NameError, TypeError) as e:
        return type(e).__name__
    return ""


def backend_before_and_after():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.optimizer import clip_grads
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.utils import GlobalMemoryBuffer

    from megatron_gspo import cpu_backend, te

    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    grads_param = torch.nn.Parameter(torch.ones(4))
    grads_param.grad = torch.full((4,), 3.0)

    checks = {
        "rope": lambda: rope(6),
        "memory_buffer": lambda: GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "t"),
        "rng_tracker": lambda: mrandom.get_cuda_rng_tracker().add("x", 5),
        "clip": lambda: clip_grads.clip_grad_by_total_norm_fp32([grads_param], 1.0, 6.0),
        "router_gemm": lambda: moe_utils.router_gating_linear(
            torch.randn(3, 4), torch.randn(2, 4), None, torch.float32),
    }
    result = {"before": {k: _fails(f) for k, f in checks.items()}}
    result["needed"] = {a.name: a.needed() for a in cpu_backend.ADAPTATIONS}
    result["cuda_activation"] = cpu_backend.activate(torch.device("cuda"))
    result["active_after_cuda"] = [a.name for a in cpu_backend.ADAPTATIONS if a.active()]
    result["cpu_activation"] = cpu_backend.activate(torch.device("cpu"))
    result["cpu_activation_again"] = cpu_backend.activate(torch.device("cpu"))
    result["te_symbol_defined"] = te.ensure_router_gemm_symbol()
    result["te_symbol_again"] = te.ensure_router_gemm_symbol()
    grads_param.grad = torch.full((4,), 3.0)
    result["after"] = {k: _fails(f) for k, f in checks.items()}
    result["clipped_grad"] = grads_param.grad.clone()
    with mrandom.get_cuda_rng_tracker().fork("x"):
        a = torch.rand(3)
    with mrandom.get_cuda_rng_tracker().fork("x"):
        b = torch.rand(3)
    result["forks_advance"] = not torch.equal(a, b)
    result["rope_freqs"] = rope(6)
    return result


def redirect_probe_on_clean_module():
    """A module without CUDA device use does not get the redirect (the switch-off path)."""
    from megatron_gspo import cpu_backend

    adaptation = cpu_backend._redirect("megatron.core.transformer.enums", "probe")
    return adaptation.needed()
