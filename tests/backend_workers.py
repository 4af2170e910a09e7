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

    from megatron_gspo.backends import backend_for
    from megatron_gspo.backends.cpu import megatron as cpu_backend
    from megatron_gspo.models import te

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
    result["cuda_activation"] = backend_for(torch.device("cuda")).activate()
    result["active_after_cuda"] = [a.name for a in cpu_backend.ADAPTATIONS if a.active()]
    result["cpu_activation"] = cpu_backend.activate()
    result["cpu_activation_again"] = cpu_backend.activate()
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
    from megatron_gspo.backends.cpu.adaptation import redirect

    adaptation = redirect("megatron.core.transformer.enums", "probe")
    return adaptation.needed()


def gloo_bucket_collectives():
    """DDP's bucket reduce-scatter and all-gather as the gloo adaptation runs them (inside a
    coalescing manager, as DDP calls them) against torch's own functions, on this run's ranks and
    on a one-rank group; returns what each rank saw."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager

    from megatron_gspo.backends.cpu import gloo

    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    one = [dist.new_group([r]) for r in range(world)][rank]
    out = {}
    for name, group in (("world", dist.group.WORLD), ("one", one)):
        size = group.size()
        g = torch.Generator().manual_seed(10 + rank)
        grads = [torch.randn(size * 5, generator=g), torch.randn(size * 3, generator=g)]
        params = [torch.randn(size * 4, generator=g), torch.randn(size * 2, generator=g)]
        ref_g, ref_p = [t.clone() for t in grads], [t.clone() for t in params]

        def buckets(collective, tensors, shard_out):
            """``collective`` on each bucket and its shard view, as DDP calls it."""
            with _coalescing_manager(group):
                for t in tensors:
                    mine = t.view(size, -1)[group.rank()]
                    collective(*((mine, t) if shard_out else (t, mine)), group=group)

        buckets(dist.reduce_scatter_tensor, ref_g, True)
        buckets(dist.all_gather_into_tensor, ref_p, False)
        buckets(gloo._gloo_reduce_scatter, grads, True)
        buckets(gloo._gloo_all_gather, params, False)
        shard = [t.view(size, -1)[group.rank()] for t in grads]
        out[name] = {
            "reduce_scatter_equal": all(torch.equal(a, b.view(size, -1)[group.rank()])
                                        for a, b in zip(shard, ref_g)),
            "all_gather_equal": all(torch.equal(a, b) for a, b in zip(params, ref_p)),
        }
    # Not this rank's shard of the bucket (a separate output): torch's own function runs.
    full = torch.arange(world * 2, dtype=torch.float32) + rank
    separate = torch.empty(2)
    gloo._gloo_reduce_scatter(separate, full.clone())
    expected = torch.empty(2)
    dist.reduce_scatter_tensor(expected, full.clone())
    out["separate_output_equal"] = torch.equal(separate, expected)
    dist.destroy_process_group()
    return out
