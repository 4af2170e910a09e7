"""The GPU backend: megatron-core as it is, the generic local layers (Transformer Engine's when it
imports: ``models.te``), the all-to-all dispatcher, checkpoints each rank writes on its own."""

from __future__ import annotations

import dataclasses

from megatron.core import tensor_parallel

from megatron_gspo.backends.backend import Backend
from megatron_gspo.models import te
from megatron_gspo.models.grouped_experts import GroupedSequentialMLP
from megatron_gspo.models.layers import RMSNorm, SDPAttention


def _seed(seed: int, *, tp_rank: int, ep_rank: int, etp_rank: int) -> None:
    tensor_parallel.model_parallel_cuda_manual_seed(seed)  # reads the ranks itself


def _layers() -> str:
    if te.use_te_spec("cuda"):
        return "Transformer Engine layers"
    return "megatron-core local layers (no Transformer Engine), torch optimizer"


# GPU kernels decode and run the full forward with other roundings (at times by more than GSPO's
# clip range): the behaviour log-probs are recomputed by the trainer's pass.
GPU = Backend(name="gpu", norm=RMSNorm, attention=SDPAttention, experts=GroupedSequentialMLP,
              token_dispatcher="alltoall", init_on_cpu=False, activate=lambda: [], seed=_seed,
              checkpoint_format="dp_reshardable", exact_engine=False, layers=_layers,
              static_decode=True, sort_dispatch=True)

# The GPU backend's layers built on the host, to check them off a GPU (``build_model(...,
# backend=GPU_ON_HOST)``): parameters made on the host, and the all-gather dispatcher where the
# all-to-all one would make a CUDA stream when built (at ep=1 the sort dispatcher replaces either).
GPU_ON_HOST = dataclasses.replace(GPU, init_on_cpu=True, token_dispatcher="allgather")
