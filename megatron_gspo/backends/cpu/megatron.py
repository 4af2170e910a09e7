"""The one place that adapts megatron-core's CUDA assumptions to a CPU-only machine.

megatron-core 0.16 hard-codes CUDA in a handful of places (RNG tracker, ``torch.cuda.current_device()``
as a device, ``device="cuda"`` tensors in pipeline schedules and the optimizer, a CUDA tensor-type
assert in gradient clipping, CUDA type names in the distributed optimizer). Each adaptation below
says why it exists, carries a probe that tells whether the installed megatron-core still needs it (so
it switches itself off once upstream is fixed), and is applied only when the device is the CPU.

``activate(device)`` is idempotent and returns the names of the adaptations that are in force.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect

import torch

from megatron_gspo.backends.cpu import gloo, rng
from megatron_gspo.backends.cpu.adaptation import Adaptation, redirect


# ---------------------------------------------------------------------------------------------
# torch as seen from an adapted module: "cuda" means the CPU.
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# RNG tracker on the CPU generator.
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Gradient clipping and the distributed optimizer.
# ---------------------------------------------------------------------------------------------

def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """CPU version of megatron's function of the same name: scale every grad by max_norm/total_norm.

    Megatron's version asserts ``grad.type() == 'torch.cuda.FloatTensor'`` and uses apex/TE
    multi-tensor kernels; on CPU a foreach multiply does the same arithmetic.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if grads and clip_coeff < 1.0:
        torch._foreach_mul_([g.detach() for g in grads], clip_coeff)


def _clip_needed() -> bool:
    from megatron.core.optimizer import clip_grads

    return "torch.cuda.FloatTensor" in inspect.getsource(clip_grads.clip_grad_by_total_norm_fp32)


def _clip_apply() -> None:
    for name in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
        module = importlib.import_module(name)
        module.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


def _clip_active() -> bool:
    from megatron.core.optimizer import optimizer

    return optimizer.clip_grad_by_total_norm_fp32 is clip_grad_by_total_norm_fp32


_CPU_TO_CUDA_TYPE = {"torch.FloatTensor": "torch.cuda.FloatTensor",
                     "torch.HalfTensor": "torch.cuda.HalfTensor",
                     "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


@contextlib.contextmanager
def _cuda_type_names():
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            return _CPU_TO_CUDA_TYPE.get(name, name)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _distopt_needed() -> bool:
    from megatron.core.optimizer import distrib_optimizer

    return "'torch.cuda.FloatTensor'" in inspect.getsource(distrib_optimizer)


def _distopt_apply() -> None:
    """DistributedOptimizer sorts params by CUDA tensor-type strings and rejects CPU ones.

    CPU tensors are reported under their CUDA type names only while its constructor runs.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    init = DistributedOptimizer.__init__
    if getattr(init, "_cpu_adapted", False):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        with _cuda_type_names():
            init(self, *args, **kwargs)

    __init__._cpu_adapted = True
    DistributedOptimizer.__init__ = __init__


def _distopt_active() -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return getattr(DistributedOptimizer.__init__, "_cpu_adapted", False)


def _adam_step_needed() -> bool:
    from megatron.core.optimizer import distrib_optimizer

    return "dst_tensors[key].copy_(tensors[key])" in inspect.getsource(
        distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states)


def _adam_step_apply() -> None:
    """Loading a reshardable distributed-optimizer checkpoint into torch's Adam (the optimizer
    without TE / apex) copies every state key of the live optimizer from the checkpoint, including
    Adam's per-param ``step``, which the checkpoint keeps in the param groups instead: KeyError.
    The states the checkpoint has are copied; ``step`` is restored from the param groups as before.
    The copies run without autograd: fp32 main parameters are views of the model's parameters
    (which require grad), and the ``dp_reshardable`` loader, unlike the others, calls this outside
    ``torch.no_grad``.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    @torch.no_grad()
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        for key, dst in {"param": main_param, **self.optimizer.state[main_param]}.items():
            if key in tensors:
                dst.copy_(tensors[key])

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    _set_main_param_and_optimizer_states._cpu_adapted = True
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states


def _adam_step_active() -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return getattr(DistributedOptimizer._set_main_param_and_optimizer_states, "_cpu_adapted", False)


def _rope_cp_needed() -> bool:
    from megatron.core.models.common.embeddings import rope_utils

    return ".cuda(" in inspect.getsource(rope_utils.get_pos_emb_on_this_cp_rank)


def get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """Megatron's slice of the RoPE table for this context-parallel rank (chunks r and 2cp-1-r of
    2cp), with the index on the table's device instead of a pinned host tensor sent to CUDA."""
    cp, rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([rank, 2 * cp - rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, index)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


_ROPE_CP_USERS = ("megatron.core.models.common.embeddings.rotary_pos_embedding",
                  "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding")


def _rope_cp_apply() -> None:
    """RoPE under context parallelism builds its chunk index with ``pin_memory=True`` and
    ``.cuda()``, which a CPU-only torch rejects; the modules that imported the function by name
    get the device-neutral twin above."""
    for name in _ROPE_CP_USERS:
        importlib.import_module(name).get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank


def _rope_cp_active() -> bool:
    return all(importlib.import_module(name).get_pos_emb_on_this_cp_rank
               is get_pos_emb_on_this_cp_rank for name in _ROPE_CP_USERS)


# ---------------------------------------------------------------------------------------------
# The registry.
# ---------------------------------------------------------------------------------------------


ADAPTATIONS: tuple[Adaptation, ...] = (
    rng.RNG_TRACKER,
    rng.CHECKPOINT_RNG,
    redirect("megatron.core.models.common.embeddings.rotary_pos_embedding",
             "RoPE moves inv_freq to torch.cuda.current_device()"),
    redirect("megatron.core.utils", "GlobalMemoryBuffer and the local L2-norm kernel allocate on "
             "torch.cuda.current_device() / device='cuda'"),
    redirect("megatron.core.transformer.utils", "the default causal mask is built on 'cuda'"),
    redirect("megatron.core.transformer.moe.router", "router buffers go to current_device()"),
    redirect("megatron.core.pipeline_parallel.schedules",
             "schedules count tokens in a 'cuda' tensor"),
    redirect("megatron.core.pipeline_parallel.p2p_communication",
             "p2p shape exchange allocates on current_device() and calls torch.cuda.synchronize()"),
    redirect("megatron.core.optimizer.optimizer", "found_inf / loss-scale tensors on 'cuda'"),
    redirect("megatron.core.optimizer.clip_grads", "grad-norm reduction buffers on 'cuda'"),
    redirect("megatron.core.optimizer.distrib_optimizer",
             "shard buffers are allocated on current_device()"),
    redirect("megatron.core.tensor_parallel.mappings",
             "sequence-parallel gather / reduce-scatter outputs go to current_device()"),
    redirect("megatron.core.tensor_parallel.layers", "TP linear buffers on current_device()"),
    redirect("megatron.core.tensor_parallel.utils", "split / gather helpers on current_device()"),
    redirect("megatron.core.transformer.moe.moe_utils", "routing-map helpers on current_device()"),
    redirect("megatron.core.transformer.moe.experts", "expert buffers on current_device()"),
    redirect("megatron.core.transformer.attention", "inference KV buffers on current_device()"),
    redirect("megatron.core.dist_checkpointing.strategies.filesystem_async",
             "the checkpoint writer calls torch.cuda.synchronize() before copying tensors"),
    redirect("megatron.core.dist_checkpointing.strategies.state_dict_saver",
             "the save-finalize failure flag is all-reduced from current_device()"),
    redirect("megatron.core.dist_checkpointing.strategies.fully_parallel",
             "fully-parallel load/save exchanges shards through current_device()"),
    redirect("megatron.core.dist_checkpointing.exchange_utils",
             "shard exchange buffers on current_device()"),
    redirect("megatron.core.distributed.param_and_grad_buffer",
             "DDP grad buffers are allocated on current_device()"),
    redirect("megatron.core.distributed.distributed_data_parallel",
             "DDP bookkeeping tensors on current_device()"),
    Adaptation("rope_context_parallel_slice", "RoPE's context-parallel slice sends a pinned host "
               "index to CUDA", _rope_cp_needed, _rope_cp_apply, _rope_cp_active),
    Adaptation("clip_grad_by_total_norm_fp32", "megatron asserts grads are torch.cuda.FloatTensor "
               "whenever clip_grad > 0", _clip_needed, _clip_apply, _clip_active),
    Adaptation("distributed_optimizer_param_types", "DistributedOptimizer groups params by CUDA "
               "tensor-type names and raises TypeError on CPU ones", _distopt_needed, _distopt_apply,
               _distopt_active),
    Adaptation("distributed_optimizer_torch_adam_load", "loading a reshardable optimizer "
               "checkpoint into torch's Adam copies a 'step' state the checkpoint does not hold",
               _adam_step_needed, _adam_step_apply, _adam_step_active),
    gloo.GLOO_BUCKET_COLLECTIVES,
)


def activate() -> list[str]:
    """Apply every needed adaptation (idempotent); returns the names of those in force."""
    for adaptation in ADAPTATIONS:
        if not adaptation.active() and adaptation.needed():
            adaptation.apply()
    return [a.name for a in ADAPTATIONS if a.active()]
