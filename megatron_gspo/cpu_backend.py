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
import re
from dataclasses import dataclass
from typing import Callable

import torch

# ---------------------------------------------------------------------------------------------
# torch as seen from an adapted module: "cuda" means the CPU.
# ---------------------------------------------------------------------------------------------

_DEVICE_FACTORIES = frozenset({
    "zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint", "zeros_like",
    "ones_like", "empty_like", "full_like", "as_tensor", "eye", "linspace",
})


def _cpu_if_cuda(fn: Callable, *args, **kwargs):
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cuda":
        kwargs["device"] = "cpu"
    return fn(*args, **kwargs)


class _CudaOnCpu:
    """``torch.cuda`` for an adapted module: the current device is the CPU, syncs are no-ops."""

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(*_args, **_kwargs) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _TorchOnCpu:
    """Stands in for the ``torch`` name inside one megatron module; everything else is torch."""

    def __init__(self) -> None:
        self.cuda = _CudaOnCpu()

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in _DEVICE_FACTORIES:
            return functools.partial(_cpu_if_cuda, attr)
        return attr


TORCH_ON_CPU = _TorchOnCpu()

# A module needs the redirect when it builds tensors on "cuda" or asks CUDA for the current device.
_CUDA_DEVICE_USE = re.compile(
    r"""device\s*=\s*['"]cuda['"]|torch\.cuda\.(current_device|synchronize)\(""")


# ---------------------------------------------------------------------------------------------
# RNG tracker on the CPU generator.
# ---------------------------------------------------------------------------------------------

def _cpu_tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's named RNG streams, kept as CPU generator states.

        Megatron forks named CUDA RNG streams around weight init and dropout; on a CPU-only torch
        every ``torch.cuda.*rng_state`` call raises. The streams keep their meaning (independent per
        TP/EP rank) but live on the CPU default generator.
        """

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            orig_name = self._current_state_name
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)
                self._current_state_name = orig_name

    return CpuRNGStatesTracker


def _rng_needed() -> bool:
    from megatron.core.tensor_parallel import random as mrandom

    try:
        mrandom.CudaRNGStatesTracker().add("probe", 1)
    except (RuntimeError, AssertionError, AttributeError):
        return True
    return False


def _rng_apply() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = _cpu_tracker_class()()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _rng_active() -> bool:
    from megatron.core.tensor_parallel import random as mrandom

    return type(mrandom._CUDA_RNG_STATE_TRACKER).__name__ == "CpuRNGStatesTracker"


def _no_cuda_rng_state(*_args, **_kwargs) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _ignore_cuda_rng_state(*_args, **_kwargs) -> None:
    return None


def _checkpoint_rng_needed() -> bool:
    from megatron.core.tensor_parallel import random as mrandom

    try:
        mrandom._get_cuda_rng_state()
    except (RuntimeError, AssertionError):
        return True
    return False


def _checkpoint_rng_apply() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = _no_cuda_rng_state
    mrandom._set_cuda_rng_state = _ignore_cuda_rng_state


def _checkpoint_rng_active() -> bool:
    from megatron.core.tensor_parallel import random as mrandom

    return mrandom._get_cuda_rng_state is _no_cuda_rng_state


def seed_rng_tracker(seed: int, *, tp_rank: int, ep_rank: int, etp_rank: int) -> None:
    """CPU twin of megatron's ``model_parallel_cuda_manual_seed`` (same per-rank seed offsets)."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = _cpu_tracker_class()()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


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


def _is_shard(shard: torch.Tensor, full: torch.Tensor, group) -> bool:
    """``shard`` is this rank's contiguous slice of ``full`` (as DDP's bucket views are)."""
    size = group.size()
    offset = group.rank() * shard.numel() * shard.element_size()
    return (shard.is_contiguous() and full.is_contiguous() and shard.dtype == full.dtype
            and shard.numel() * size == full.numel()
            and shard.data_ptr() == full.data_ptr() + offset)


def _allreduce_now(tensor: torch.Tensor, group) -> None:
    """A synchronous SUM all-reduce on ``group`` issued at once, also inside a coalescing manager
    (which would otherwise batch it into gloo's flattening allreduce_coalesced)."""
    import torch.distributed as dist

    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    group.allreduce([tensor], opts).wait()


def _gloo_reduce_scatter(output, input, op=None, group=None, async_op=False):
    """DDP's bucket reduce-scatter over gloo as one all-reduce of the bucket: this rank's shard
    (``output``, a view of ``input``) then holds the sum, like a reduce-scatter's; the other shards
    hold it too, where a reduce-scatter leaves local gradients that nothing reads."""
    import torch.distributed as dist

    group = group or dist.group.WORLD
    if (async_op or op not in (None, dist.ReduceOp.SUM) or dist.get_backend(group) != "gloo"
            or not _is_shard(output, input, group)):
        return dist.reduce_scatter_tensor(output, input, op=op or dist.ReduceOp.SUM, group=group,
                                          async_op=async_op)
    _allreduce_now(input, group)
    return None


def _gloo_all_gather(output, input, group=None, async_op=False):
    """DDP's parameter all-gather over gloo as one all-reduce of the bucket whose other ranks'
    shards are zeroed first: x + 0 is x, so every shard arrives exactly (with more than one rank a
    -0.0 arrives as +0.0)."""
    import torch.distributed as dist

    group = group or dist.group.WORLD
    if async_op or dist.get_backend(group) != "gloo" or not _is_shard(input, output, group):
        return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)
    shards = output.view(group.size(), -1)
    for r in range(group.size()):
        if r != group.rank():
            shards[r].zero_()
    _allreduce_now(output, group)
    return None


def _gloo_collectives_needed() -> bool:
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as pgb

    return (pgb.dist_reduce_scatter_func in (dist.reduce_scatter_tensor, dist._reduce_scatter_base)
            and pgb.dist_all_gather_func in (dist.all_gather_into_tensor, dist._all_gather_base))


def _gloo_collectives_apply() -> None:
    """gloo has no native reduce-scatter / all-gather into one tensor: torch emulates them through
    per-rank tensor lists, and inside DDP's coalescing manager through flattening copies. On one
    rank and a 76 MB bucket (the 19M-parameter benchmark model) that is 46 ms per reduce-scatter
    and 104 ms per all-gather, against 0.1 ms for an eager all-reduce: every update paid both.
    Over gloo groups with DDP's layout (this rank's shard a view of the bucket) they become one
    all-reduce of the bucket, issued at once; anything else (NCCL, async, other ops) goes to
    torch's ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` as before. The collective
    still runs on a group of one rank."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    pgb.dist_reduce_scatter_func = _gloo_reduce_scatter
    pgb.dist_all_gather_func = _gloo_all_gather


def _gloo_collectives_active() -> bool:
    from megatron.core.distributed import param_and_grad_buffer as pgb

    return (pgb.dist_reduce_scatter_func is _gloo_reduce_scatter
            and pgb.dist_all_gather_func is _gloo_all_gather)


# ---------------------------------------------------------------------------------------------
# The registry.
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Adaptation:
    name: str
    why: str
    needed: Callable[[], bool]
    apply: Callable[[], None]
    active: Callable[[], bool]


def _redirect(module_name: str, why: str) -> Adaptation:
    def module():
        return importlib.import_module(module_name)

    def needed() -> bool:
        return bool(_CUDA_DEVICE_USE.search(inspect.getsource(module())))

    def apply() -> None:
        module().torch = TORCH_ON_CPU

    def active() -> bool:
        return module().__dict__.get("torch") is TORCH_ON_CPU

    return Adaptation(f"cuda_device:{module_name}", why, needed, apply, active)


ADAPTATIONS: tuple[Adaptation, ...] = (
    Adaptation("rng_tracker", "Megatron's RNG tracker keeps CUDA generator states; a CPU-only torch "
               "raises on every torch.cuda RNG call", _rng_needed, _rng_apply, _rng_active),
    Adaptation("checkpoint_rng", "activation recomputation saves and restores the CUDA generator "
               "state; on CPU the CPU generator and the tracker's (CPU) states, which it also saves, "
               "are the whole RNG state", _checkpoint_rng_needed, _checkpoint_rng_apply,
               _checkpoint_rng_active),
    _redirect("megatron.core.models.common.embeddings.rotary_pos_embedding",
              "RoPE moves inv_freq to torch.cuda.current_device()"),
    _redirect("megatron.core.utils", "GlobalMemoryBuffer and the local L2-norm kernel allocate on "
              "torch.cuda.current_device() / device='cuda'"),
    _redirect("megatron.core.transformer.utils", "the default causal mask is built on 'cuda'"),
    _redirect("megatron.core.transformer.moe.router", "router buffers go to current_device()"),
    _redirect("megatron.core.pipeline_parallel.schedules",
              "schedules count tokens in a 'cuda' tensor"),
    _redirect("megatron.core.pipeline_parallel.p2p_communication",
              "p2p shape exchange allocates on current_device() and calls torch.cuda.synchronize()"),
    _redirect("megatron.core.optimizer.optimizer", "found_inf / loss-scale tensors on 'cuda'"),
    _redirect("megatron.core.optimizer.clip_grads", "grad-norm reduction buffers on 'cuda'"),
    _redirect("megatron.core.optimizer.distrib_optimizer",
              "shard buffers are allocated on current_device()"),
    _redirect("megatron.core.tensor_parallel.mappings",
              "sequence-parallel gather / reduce-scatter outputs go to current_device()"),
    _redirect("megatron.core.tensor_parallel.layers", "TP linear buffers on current_device()"),
    _redirect("megatron.core.tensor_parallel.utils", "split / gather helpers on current_device()"),
    _redirect("megatron.core.transformer.moe.moe_utils", "routing-map helpers on current_device()"),
    _redirect("megatron.core.transformer.moe.experts", "expert buffers on current_device()"),
    _redirect("megatron.core.transformer.attention", "inference KV buffers on current_device()"),
    _redirect("megatron.core.dist_checkpointing.strategies.filesystem_async",
              "the checkpoint writer calls torch.cuda.synchronize() before copying tensors"),
    _redirect("megatron.core.dist_checkpointing.strategies.state_dict_saver",
              "the save-finalize failure flag is all-reduced from current_device()"),
    _redirect("megatron.core.dist_checkpointing.strategies.fully_parallel",
              "fully-parallel load/save exchanges shards through current_device()"),
    _redirect("megatron.core.dist_checkpointing.exchange_utils",
              "shard exchange buffers on current_device()"),
    _redirect("megatron.core.distributed.param_and_grad_buffer",
              "DDP grad buffers are allocated on current_device()"),
    _redirect("megatron.core.distributed.distributed_data_parallel",
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
    Adaptation("gloo_bucket_collectives", "gloo emulates DDP's bucket reduce-scatter and "
               "all-gather with copies (46 + 104 ms per update for 19M parameters on one rank): "
               "one all-reduce of the bucket instead", _gloo_collectives_needed,
               _gloo_collectives_apply, _gloo_collectives_active),
)


def activate(device: torch.device) -> list[str]:
    """Apply every needed adaptation when ``device`` is the CPU; do nothing on GPU.

    Returns the names of adaptations in force afterwards (empty on GPU).
    """
    if torch.device(device).type != "cpu":
        return []
    for adaptation in ADAPTATIONS:
        if not adaptation.active() and adaptation.needed():
            adaptation.apply()
    return [a.name for a in ADAPTATIONS if a.active()]


def moe_dispatcher(device: torch.device) -> str:
    """Token dispatcher for ``device``.

    The all-to-all dispatcher creates a ``torch.cuda.Stream`` and its uneven all_to_all splits are
    rejected by gloo; the all-gather dispatcher is exact and runs over gloo. GPUs keep all-to-all.
    """
    return "allgather" if torch.device(device).type == "cpu" else "alltoall"


def model_init_on_cpu(device: torch.device) -> bool:
    """Megatron's GPU weight init forks CUDA RNG streams per partition; on CPU it initialises the
    full master weight and slices it, which is also identical across TP layouts."""
    return torch.device(device).type == "cpu"
