"""Host synchronisations, counted on any device.

On a GPU an operation whose result the host must read before it goes on (a scalar read, an output
whose size depends on the data, a copy to host memory) makes the CPU wait for every kernel queued
before it: a decode step or an MoE layer with a few of them cannot run ahead of the GPU, nor be
captured as a CUDA graph. ``count_host_syncs`` counts, inside its block, the operations that force
such a wait on CUDA, whatever device the tensors are on, so that a CPU test can hold code to zero:

- at the dispatcher (``TorchDispatchMode``): ``aten._local_scalar_dense`` (``.item()``, ``int()``,
  ``float()``, ``bool()`` of a tensor, a tensor used as an index), ``nonzero``, ``masked_select``,
  ``bincount``, ``unique`` (every form), ``repeat_interleave`` with a tensor of repeats and no
  ``output_size``, indexing or index assignment with a boolean mask (``x[mask]``,
  ``x[mask] = v``: a ``nonzero`` inside), ``masked_scatter``, ``isin`` where it sorts (test
  elements not fewer than ``10 * elements ** 0.145``, torch's threshold, and not
  ``assume_unique``: a ``unique`` inside), ``equal`` and ``allclose`` (a Python bool of the
  data), ``histc`` without a range (its CUDA kernel reads the minimum and maximum back);
- at the Python API (``TorchFunctionMode``): ``Tensor.tolist``, ``Tensor.numpy`` and
  ``Tensor.cpu`` (copies to the host), and ``Tensor.to`` / ``copy_`` from a non-CPU device to the
  CPU.

It sees the operators called; of what an operator does inside it knows only the cases named
above (``isin``, ``histc``), not, for instance, an input check of some CUDA implementation that
reads a value back: a GPU profile is the final word.

Usage::

    with count_host_syncs() as syncs:
        step(...)
    assert syncs.total == 0, syncs.by_op
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_DATA_DEPENDENT = {"_local_scalar_dense", "nonzero", "masked_select", "bincount", "_unique",
                   "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
                   "masked_scatter", "masked_scatter_", "equal", "allclose"}
_MASK_INDEXED = {"index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index"}
_HOST_COPIES = {"tolist", "numpy", "cpu"}
_HOST = torch.device("cpu").type  # host memory: a copy there from a device waits for it


class HostSyncs:
    """What ``count_host_syncs`` saw: ``total`` and ``by_op`` (op name -> count)."""

    def __init__(self):
        self.by_op: Counter = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def add(self, name: str) -> None:
        self.by_op[name] += 1

    def reset(self) -> None:
        self.by_op.clear()


def _is_bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in (indices or ()) if i is not None)


def _isin_sorts(args, kwargs) -> bool:
    """Whether ``isin`` takes its sorting path, which calls ``unique`` on the elements (torch's
    heuristic, numpy's: sort when the test elements are not fewer than 10 * n ** 0.145; a
    scalar of elements is a tensor of one, a scalar to test against a comparison)."""
    elements = args[0] if args else kwargs.get("elements")
    test = args[1] if len(args) > 1 else kwargs.get("test_elements")
    if not isinstance(test, torch.Tensor):
        return False
    n = elements.numel() if isinstance(elements, torch.Tensor) else 1
    unique = kwargs.get("assume_unique", args[2] if len(args) > 2 else False)
    return not unique and n > 0 and test.numel() >= int(10.0 * n ** 0.145)


def _histc_of_the_datas_range(args, kwargs) -> bool:
    """Whether ``histc`` takes the data's own range: ``min == max`` (0 and 0 by default)."""
    low = args[2] if len(args) > 2 else kwargs.get("min", 0)
    high = args[3] if len(args) > 3 else kwargs.get("max", 0)
    return low == high


class _AtDispatch(TorchDispatchMode):
    def __init__(self, seen: HostSyncs):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _DATA_DEPENDENT:
            self.seen.add(name)
        elif (name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor")
              and kwargs.get("output_size") is None):
            self.seen.add("repeat_interleave without output_size")
        elif name in _MASK_INDEXED and len(args) > 1 and _is_bool_index(args[1]):
            self.seen.add(f"{name} with a boolean mask")
        elif name == "histc" and _histc_of_the_datas_range(args, kwargs):
            self.seen.add("histc without a range")
        elif name == "isin" and _isin_sorts(args, kwargs):
            self.seen.add("isin (sorting: a unique inside)")
        return func(*args, **kwargs)


class _AtPython(TorchFunctionMode):
    def __init__(self, seen: HostSyncs):
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _HOST_COPIES:
            self.seen.add(f"Tensor.{name}")
        elif name in ("to", "copy_") and args and isinstance(args[0], torch.Tensor):
            if name == "to":
                target = kwargs.get("device", next((a for a in args[1:] if isinstance(
                    a, (str, torch.device))), None))
                source = args[0].device
            else:
                target, source = args[0].device, getattr(args[1], "device", None)
            if (target is not None and source is not None and source.type != _HOST
                    and torch.device(target).type == _HOST):
                self.seen.add(f"Tensor.{name} to the host")
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host_syncs():
    """Count, inside the block, the operations that would make the host wait for a GPU."""
    seen = HostSyncs()
    with _AtPython(seen), _AtDispatch(seen):
        yield seen
