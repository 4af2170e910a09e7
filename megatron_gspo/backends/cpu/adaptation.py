"""What one adaptation of megatron-core to the CPU is, and the commonest kind: a module whose ``torch`` sees the CPU where it asks for CUDA."""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Callable

import torch


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


@dataclass(frozen=True)
class Adaptation:
    name: str
    why: str
    needed: Callable[[], bool]
    apply: Callable[[], None]
    active: Callable[[], bool]


def redirect(module_name: str, why: str) -> Adaptation:
    def module():
        return importlib.import_module(module_name)

    def needed() -> bool:
        return bool(_CUDA_DEVICE_USE.search(inspect.getsource(module())))

    def apply() -> None:
        module().torch = TORCH_ON_CPU

    def active() -> bool:
        return module().__dict__.get("torch") is TORCH_ON_CPU

    return Adaptation(f"cuda_device:{module_name}", why, needed, apply, active)
