"""Small collectives: flags, scalars and metric sums, reduced on the run's device.

Every process group of a GPU run is NCCL, which rejects host tensors ("No backend type associated
with device type cpu"). Code that reduces a few Python numbers (a flag, a count, a row width, a
metric's sums) goes through these helpers: they build the tensor on ``device``, reduce it and return
Python numbers at the edge. None of them skips the collective when the group has one rank, so a
one-GPU run goes through the same NCCL calls as a cluster run.

``group=None`` means the default (world) group, as in ``torch.distributed``; inside a distributed
run every call is a collective, whatever the group's size.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
import torch.distributed as dist


Number = Union[int, float, bool]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def reduce_tensor(values: torch.Tensor, *, group=None, op: str = "sum") -> torch.Tensor:
    """All-reduce ``values`` (already on the run's device) in place over ``group``; returns it.
    Outside a distributed run (no process group at all: a library call in one process) the
    values are already complete and are returned as they are."""
    if dist.is_initialized():
        dist.all_reduce(values, op=_OPS[op], group=group)
    return values


def reduce_values(values: Sequence[Union[Number, torch.Tensor]], *, device: torch.device,
                  group=None, op: str = "sum", dtype: torch.dtype = torch.float64) -> list:
    """All-reduce a few numbers (or 0-d tensors) over ``group``; returns Python numbers."""
    parts = [v.detach().reshape(()).to(device=device, dtype=dtype) if torch.is_tensor(v)
             else torch.tensor(float(v), dtype=dtype, device=device) for v in values]
    t = torch.stack(parts) if parts else torch.zeros(0, dtype=dtype, device=device)
    reduce_tensor(t, group=group, op=op)
    return t.tolist()


def reduce_sum(value: Union[Number, torch.Tensor], *, device: torch.device, group=None) -> float:
    return reduce_values([value], device=device, group=group)[0]


def reduce_max_int(value: int, *, device: torch.device, group=None) -> int:
    return int(reduce_values([value], device=device, group=group, op="max",
                             dtype=torch.int64)[0])


def any_rank(flag: bool, *, device: torch.device, group=None) -> bool:
    """True when ``flag`` is true on any rank of ``group``."""
    return reduce_max_int(int(bool(flag)), device=device, group=group) > 0


def all_ranks(flag: bool, *, device: torch.device, group=None) -> bool:
    """True when ``flag`` is true on every rank of ``group``."""
    return not any_rank(not flag, device=device, group=group)


def broadcast_tensor(t: torch.Tensor, *, src_in_group: int, group) -> torch.Tensor:
    """Broadcast a tensor that lives on the run's device from group rank ``src_in_group``."""
    dist.broadcast(t, group_src=src_in_group, group=group)
    return t


def gather_ints(value: int, *, device: torch.device, group=None) -> list:
    """Every rank's ``value``, in group rank order (an all-gather)."""
    if not dist.is_initialized():
        return [int(value)]
    size = dist.get_world_size(group)
    mine = torch.tensor([int(value)], dtype=torch.int64, device=device)
    out = torch.empty(size, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, mine, group=group)
    return [int(x) for x in out.tolist()]


def all_gather_vector(values: torch.Tensor, *, device: torch.device, group=None) -> list:
    """Every rank's 1-D integer ``values`` (lengths may differ), in group rank order, as lists
    (two all-gathers: the sizes, then the values padded to the longest)."""
    sizes = gather_ints(values.numel(), device=device, group=group)
    longest = max(sizes)
    mine = torch.zeros(longest, dtype=torch.int64, device=device)
    mine[:values.numel()] = values.reshape(-1).to(device=device, dtype=torch.int64)
    out = torch.empty(len(sizes) * longest, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, mine, group=group)
    flat = out.tolist()
    return [flat[r * longest:r * longest + n] for r, n in enumerate(sizes)]
