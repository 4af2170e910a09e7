"""Buffers kept between passes, so that large temporaries do not come back as fresh pages.

A tensor of a few MB that is freed and made again on CPU usually comes back as memory the kernel
maps anew, and each 4 KB page then faults on its first write: on the 2-core KVM machines this
project is measured on, about 5 us a page (a 2.2 MB zero fill of a fresh KV cache took 2.65 ms;
the compute RL step's update took some 12,000 faults, its rollout 9,600). A ``BufferPool`` keeps
the buffers of one user (a layer's experts function, the local engine's KV cache) once they are
given back and hands them out again, so their pages stay mapped. It never frees a buffer: it
holds at most what its user had in use at once, plus a quarter for growth.
"""

from __future__ import annotations

import math

import torch


class BufferPool:
    """Free flat buffers, handed out as views of the shape asked for."""

    def __init__(self):
        self.free: list[torch.Tensor] = []  # 1-D views of whole allocations

    def take(self, shape: tuple, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape`` with ``like``'s dtype and device: the
        smallest free buffer that holds it, or a new one a quarter larger than asked."""
        need = math.prod(shape)
        best = None
        for i, buf in enumerate(self.free):
            if (buf.dtype == like.dtype and buf.device == like.device and buf.numel() >= need
                    and (best is None or buf.numel() < self.free[best].numel())):
                best = i
        buf = self.free.pop(best) if best is not None else like.new_empty(need + need // 4 + 1)
        return buf[:need].view(shape)

    def give(self, *tensors: torch.Tensor) -> None:
        """Hand back buffers (views of what ``take`` returned, or any contiguous tensor whose
        memory nothing else will read): from now on they may be handed out again."""
        for t in tensors:
            root = t if t._base is None else t._base
            if not root.is_contiguous():
                continue  # (not a buffer this pool can hand out as a view)
            if any(b.data_ptr() == root.data_ptr() for b in self.free):
                raise RuntimeError("BufferPool: a buffer was given back twice")
            self.free.append(root.view(-1))
