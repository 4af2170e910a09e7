"""Forward + backward of a fine-grained MoE with the local experts as grouped matmuls vs Megatron's
SequentialMLP loop (same weights, same tokens), one rank, CPU: through ``grouped_mm`` over the
stacked weights and through the CPU function (``_ExpertsSwiGLU``, its PyTorch loop and its C++
kernel), each forced; the default takes the function through its kernel where that builds, else
its loop from ``CPUGroupedExperts.swiglu_cpu_min_weight`` fc1 weight elements per expert.

    python benchmarks/cpu_perf/grouped_experts.py [--experts 64] [--top-k 8] [--tokens 2048] [--repeats 7]

The default shape is ``conf/experiment/paper_small.yaml``'s model (hidden 64, 4 layers, 64
experts of width 16, top-8). Prints the median time of each and, last, the default path's ratio to the loop.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megatron_gspo.backends.cpu import kernels as cpu_kernels  # noqa: E402
from megatron_gspo.backends.cpu.experts import CPUGroupedExperts  # noqa: E402
from megatron_gspo.config import BackendConfig, ModelConfig, ParallelConfig  # noqa: E402
from megatron_gspo.distributed.parallel import destroy_parallel, init_parallel  # noqa: E402
from megatron_gspo.models.model import build_model  # noqa: E402


def measure(grouped: bool, args, *, path: str = "") -> tuple:
    """(median seconds of a forward + backward, whether these experts are large enough for the
    CPU function's loop); ``path`` ("grouped_mm", "function" through its C++ kernel, or
    "function_loop" through its PyTorch loop) forces the grouped experts' path."""
    cfg = ModelConfig(vocab_size=128, hidden_size=args.hidden, num_layers=4, num_attention_heads=4,
                      num_query_groups=2, head_dim=16, ffn_hidden_size=128,
                      moe_ffn_hidden_size=args.expert_width, num_experts=args.experts,
                      top_k=args.top_k)
    ctx = init_parallel(ParallelConfig(), cfg, seed=0)
    try:
        gpt = build_model(cfg, ctx, kernels=BackendConfig(grouped_experts=grouped))
        experts = [m for m in gpt.modules() if isinstance(m, CPUGroupedExperts)]
        large_enough = all(m.experts_large_enough() for m in experts)
        for m in experts:
            m.swiglu_cpu_min_weight = 0 if path.startswith("function") else float("inf")
            m.cpu_kernel = path == "function"
        g = torch.Generator().manual_seed(0)
        rows = args.tokens // 64
        tokens = torch.randint(0, 128, (rows, 64), generator=g)
        pos = torch.arange(64).expand(rows, 64)
        times = []
        for i in range(args.repeats + 1):
            t0 = time.perf_counter()
            gpt(tokens, pos, attention_mask=None).float().square().mean().backward()
            if i:
                times.append(time.perf_counter() - t0)
        return statistics.median(times), large_enough
    finally:
        destroy_parallel(keep_process_group=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--expert-width", type=int, default=16)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    (loop, _), (stacked, _) = measure(False, args), measure(True, args, path="grouped_mm")
    function, large_enough = measure(True, args, path="function")
    function_loop, _ = measure(True, args, path="function_loop")
    if cpu_kernels.experts_swiglu() is not None:
        default = "function, kernel"
    else:
        default = "function, loop" if large_enough else "grouped_mm"
    print(f"MoE of 4 layers, hidden {args.hidden}, {args.experts} experts of width "
          f"{args.expert_width}, top-{args.top_k}; {args.tokens} tokens; forward + backward, "
          f"median of {args.repeats}, {torch.get_num_threads()} threads")
    print(f"SequentialMLP loop   {loop * 1e3:8.1f} ms")
    print(f"grouped_mm, stacked  {stacked * 1e3:8.1f} ms")
    print(f"CPU function, loop   {function_loop * 1e3:8.1f} ms")
    print(f"CPU function, kernel {function * 1e3:8.1f} ms")
    chosen = {"function, kernel": function, "function, loop": function_loop}.get(default, stacked)
    print(f"grouped ({default}, the default here) vs loop: {loop / chosen:.2f}x")


if __name__ == "__main__":
    main()
