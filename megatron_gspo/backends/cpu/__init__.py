"""The CPU backend: every CPU-only adaptation and speed path in one place.

- ``megatron`` (with ``adaptation``, ``rng``, ``gloo``): megatron-core's CUDA assumptions adapted
  to a CPU-only torch, each with a probe that switches it off once upstream no longer needs it;
- ``threads``: torch's OpenMP threads pinned before any process group exists;
- ``norm``, ``attention``, ``experts``: the layers' CPU paths (RMSNorm's backward, short packed
  buckets and decoding steps as batched matmuls, fp32 SwiGLU experts through ``kernels``'s C++
  kernel, built at first use from ``csrc/``);
- ``decode``: the in-process engine's direct decoding step for a whole model on one rank.
"""

from __future__ import annotations

from megatron_gspo.backends.backend import Backend
from megatron_gspo.backends.cpu import decode, megatron, rng, threads
from megatron_gspo.backends.cpu.attention import CPUAttention
from megatron_gspo.backends.cpu.experts import CPUGroupedExperts
from megatron_gspo.backends.cpu.norm import CPURMSNorm


def activate() -> list:
    """megatron-core adapted to the CPU, then this thread's OpenMP count kept and every other
    thread's set to one (before any process group: ``threads``' docstring). Idempotent."""
    names = megatron.activate()
    threads.pin_to_this_thread()
    return names


# The all-gather dispatcher: the all-to-all one creates a ``torch.cuda.Stream`` and its uneven
# splits are rejected by gloo; the all-gather one is exact and runs over gloo. Weights are
# initialised on the host in full and sliced, which is also identical across TP layouts.
# Checkpoints keep the moments reshardable into any layout (gathered over gloo). The local
# engine's fp32 log-probs are the trainer's pass's to float rounding (2e-7 on average).
CPU = Backend(name="cpu", norm=CPURMSNorm, attention=CPUAttention, experts=CPUGroupedExperts,
              token_dispatcher="allgather", init_on_cpu=True, activate=activate,
              seed=rng.seed_rng_tracker, checkpoint_format="fully_reshardable",
              exact_engine=True,
              layers=lambda: "megatron-core local layers (CPU), torch optimizer", decoder=decode)
