"""The experts of an MoE layer on CPU: fp32 SwiGLU experts (Qwen3-MoE's: no GLU offset or
clamp) as one autograd function, ``_ExpertsSwiGLU``, instead of grouped_mm (itself one matmul per
expert on CPU): the same per-expert matmuls, written into slices of preallocated outputs from the
experts' own weights, so no stacked copy of the weights per forward, and a backward that writes
the GLU's two gradient halves into one buffer (no chunk and cat) and reuses the forward's
``silu(a)`` (kept: one more ``[tokens, F]`` per layer) instead of computing it again. The same
products and sums in the same order: bitwise the grouped path's.

It runs through a C++ kernel (``backends.cpu.kernels.experts_swiglu``, built at first use;
``backend.cpu_experts_kernel``) that gives each OpenMP thread whole experts, taken largest first,
on single-threaded products (within 1e-6 of the Python loop; bitwise at the benchmark shapes
measured, while at others single-threaded products can round a sum differently in the last bit):
no barrier per product, each expert's rows, weights and gradients on one core. In generation
too, and for experts of any size. Where the kernel is off or did not build, the function's
Python loop runs (MKL splitting each product over the threads) for experts of at least
``swiglu_cpu_min_weight`` fc1 weight elements outside generation, and grouped_mm otherwise
(generation over its cached weight stacks). Measured (benchmarks/results/): the compute
benchmark shape's update phase 1.107x and its rollout 1.205x against the loop and grouped_mm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_gspo.backends.cpu import kernels
from megatron_gspo.models.grouped_experts import GroupedSequentialMLP


class _ExpertsSwiGLU(torch.autograd.Function):
    """fp32 rows grouped by expert (``bounds``: each expert's [start, end) rows) through each
    expert's ``fc2(silu(a) * b * prob)``, ``[a, b] = fc1(x)``; ``weights``: the ``n`` fc1 weights
    ``[2F, H]`` then the ``n`` fc2 weights ``[H, F]``. ``kernel``: the C++ kernel
    (``cpu_kernels.experts_swiglu``), which runs the same steps with whole experts per OpenMP
    thread, or None for the loop below (each product split over the threads by MKL)."""

    @staticmethod
    def forward(ctx, x_TH, probs_T, bounds, n, kernel, *weights):
        fc1, fc2 = weights[:n], weights[n:]
        T, f = x_TH.shape[0], fc1[0].shape[0] // 2
        h_TF2 = x_TH.new_empty(T, 2 * f)
        out_TH = x_TH.new_empty(T, fc2[0].shape[0])
        if kernel is not None:
            sa_TF, sb_TF, g_TF = (x_TH.new_empty(T, f) for _ in range(3))
            kernel.forward(x_TH, probs_T, [b[0] for b in bounds], [b[1] for b in bounds],
                           list(fc1), list(fc2), h_TF2, sa_TF, sb_TF, g_TF, out_TH)
        else:
            for (r0, r1), w in zip(bounds, fc1):
                torch.mm(x_TH[r0:r1], w.t(), out=h_TF2[r0:r1])
            sa_TF = F.silu(h_TF2[:, :f])  # kept for the backward: no second silu there
            sb_TF = sa_TF * h_TF2[:, f:]
            g_TF = sb_TF * probs_T.unsqueeze(-1)
            for (r0, r1), w in zip(bounds, fc2):
                torch.mm(g_TF[r0:r1], w.t(), out=out_TH[r0:r1])
        ctx.save_for_backward(x_TH, probs_T, h_TF2, sa_TF, sb_TF, g_TF, *weights)
        ctx.bounds, ctx.n, ctx.kernel = bounds, n, kernel
        return out_TH

    @staticmethod
    def backward(ctx, grad_TH):
        x_TH, probs_T, h_TF2, sa_TF, sb_TF, g_TF, *weights = ctx.saved_tensors
        fc1, fc2, bounds = weights[:ctx.n], weights[ctx.n:], ctx.bounds
        grad_TH = grad_TH.contiguous()
        dg_TF = torch.empty_like(g_TF)
        dh_TF2 = torch.empty_like(h_TF2)
        dx_TH = torch.empty_like(x_TH)
        if ctx.kernel is not None:
            d_probs = torch.empty_like(probs_T) if ctx.needs_input_grad[1] else None
            (wg1, acc1, d_fc1), (wg2, acc2, d_fc2) = _grad_targets(fc1), _grad_targets(fc2)
            ctx.kernel.backward(grad_TH, x_TH, probs_T, h_TF2, sa_TF, sb_TF, g_TF,
                                [b[0] for b in bounds], [b[1] for b in bounds], list(fc1),
                                list(fc2), wg1, wg2, acc1, acc2, dg_TF, dh_TF2, dx_TH, d_probs)
            return (dx_TH, d_probs, None, None, None, *d_fc1, *d_fc2)
        d_fc2 = []
        for (r0, r1), w in zip(bounds, fc2):
            torch.mm(grad_TH[r0:r1], w, out=dg_TF[r0:r1])
            d_fc2.append(_weight_grad(w, grad_TH[r0:r1].t(), g_TF[r0:r1]))
        d_probs = torch.linalg.vecdot(dg_TF, sb_TF) if ctx.needs_input_grad[1] else None
        dsb_TF = dg_TF.mul_(probs_T.unsqueeze(-1))
        f = h_TF2.shape[1] // 2
        a_TF, b_TF = h_TF2[:, :f], h_TF2[:, f:]
        torch.mul(dsb_TF, sa_TF, out=dh_TF2[:, f:])
        torch.ops.aten.silu_backward.grad_input(dsb_TF.mul_(b_TF), a_TF,
                                                grad_input=dh_TF2[:, :f])
        d_fc1 = []
        for (r0, r1), w in zip(bounds, fc1):
            torch.mm(dh_TF2[r0:r1], w, out=dx_TH[r0:r1])
            d_fc1.append(_weight_grad(w, dh_TF2[r0:r1].t(), x_TH[r0:r1]))
        return (dx_TH, d_probs, None, None, None, *d_fc1, *d_fc2)


def _grad_target(weight):
    """Where ``weight``'s gradient goes and what goes back to autograd for it: its ``main_grad``
    where Megatron's DDP gave it one of the weight's dtype, added to by the matmul (``addmm_``),
    as its fused linear layers do, so no gradient tensor is written and then read again for the
    backward hook's addition; then an unfilled placeholder goes back to autograd with
    ``grad_added_to_main_grad`` set (DDP's hook still runs for the weight: with
    ``overlap_grad_reduce`` it marks the weight's bucket ready, and adds nothing). Otherwise a
    new tensor, written and returned. (target, added, returned)."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is not None and main_grad.dtype == weight.dtype:
        weight.grad_added_to_main_grad = True
        return main_grad, True, torch.empty_like(weight)
    grad = torch.empty_like(weight)
    return grad, False, grad


def _grad_targets(weights):
    """``_grad_target`` of each weight, as three lists (for the kernel)."""
    targets, added, returned = zip(*map(_grad_target, weights))
    return list(targets), list(added), list(returned)


def _weight_grad(weight, a, b):
    """The gradient ``a @ b`` of ``weight`` into its ``_grad_target``."""
    target, added, returned = _grad_target(weight)
    if added:
        target.addmm_(a, b)
    else:
        torch.mm(a, b, out=target)
    return returned


class CPUGroupedExperts(GroupedSequentialMLP):
    """``GroupedSequentialMLP`` on CPU: grouped_mm takes every float type and needs no padded
    groups; fp32 SwiGLU experts run as ``_ExpertsSwiGLU`` (through the C++ kernel where it
    builds)."""

    group_rows = 1
    grouped_dtypes = None
    # Without the C++ kernel, ``_ExpertsSwiGLU``'s loop from this many fc1 weight elements per
    # expert: below it, stacking the weights costs less than the loop's per-expert calls (64
    # experts of 32 x 64, forward + backward: 105.9 ms against 97.7 through grouped_mm; 512 x
    # 256: a compute step 5% faster). The kernel runs every size (89.6 ms there), generation too.
    swiglu_cpu_min_weight = 16384
    # ``_ExpertsSwiGLU`` through the C++ kernel (whole experts per OpenMP thread) where it builds
    # (``backend.cpu_experts_kernel``; build_model sets it per layer).
    cpu_kernel = True

    def experts_large_enough(self) -> bool:
        """Whether this layer's experts are large enough for ``_ExpertsSwiGLU``'s loop."""
        return self.local_experts[0].linear_fc1.weight.numel() >= self.swiglu_cpu_min_weight

    def _swiglu_fp32(self, x: torch.Tensor, probs: torch.Tensor) -> bool:
        """fp32, SwiGLU without offset or clamp."""
        c = self.config
        return (x.dtype == probs.dtype == torch.float32 and c.gated_linear_unit
                and c.activation_func is F.silu and c.activation_func_clamp_value is None
                and not c.glu_linear_offset)

    def _kernel(self):
        """The C++ kernel for this layer's fp32 SwiGLU experts, or None (switched off, or it did
        not build)."""
        return kernels.experts_swiglu() if self.cpu_kernel else None

    def _swiglu_ok(self, x: torch.Tensor, probs: torch.Tensor) -> bool:
        """``_ExpertsSwiGLU`` runs: fp32 SwiGLU without offset or clamp, and either its C++
        kernel is at hand (any size; generation too) or, for its Python loop, the experts are
        large enough and not generating (generation's cached stacks go to grouped_mm)."""
        if not self._swiglu_fp32(x, probs):
            return False
        if self._kernel() is not None:
            return True
        return self.weight_cache is None and self.experts_large_enough()

    def path(self, x: torch.Tensor, probs: torch.Tensor) -> str:
        """Which forward runs for these inputs: "swiglu_cpu_kernel" (``_ExpertsSwiGLU`` through
        its C++ kernel), "swiglu_cpu" (through its loop), "grouped" or "sequential"."""
        path = super().path(x, probs)
        if path != "grouped" or not self._swiglu_ok(x, probs):
            return path
        return "swiglu_cpu_kernel" if self._kernel() is not None else "swiglu_cpu"

    def forward(self, permuted_local_hidden_states: torch.Tensor,
                tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor):
        x = permuted_local_hidden_states
        path = self.path(x, permuted_probs)
        if not path.startswith("swiglu_cpu"):
            return super().forward(x, tokens_per_expert, permuted_probs)
        ends = torch.as_tensor(tokens_per_expert).cumsum(0).tolist()
        bounds = list(zip([0] + ends[:-1], ends))
        weights = ([e.linear_fc1.weight for e in self.local_experts]
                   + [e.linear_fc2.weight for e in self.local_experts])
        kernel = self._kernel() if path == "swiglu_cpu_kernel" else None
        return _ExpertsSwiGLU.apply(x, permuted_probs, bounds, len(self.local_experts), kernel,
                                    *weights), None
