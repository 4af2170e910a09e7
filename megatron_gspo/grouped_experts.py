"""Megatron's SequentialMLP with every local expert of a layer run as two grouped matmuls.

Adaptation of megatron-core 0.16's ``SequentialMLP`` (the local layer spec's experts when
Transformer Engine is absent): same parameters, names, sharded checkpoint layout, expert- and
expert-tensor-parallel sharding (its submodules are untouched); only ``forward`` changes, from a
Python loop over the local experts (one MLP call each: two linears, their autograd functions and
the activation) to ``torch.nn.functional.grouped_mm`` over the experts' stacked weights with the
tokens grouped by expert (which the token dispatcher already does). The gated activation and the
routing probabilities are applied as in Megatron's unfused MLP path (``mlp.py``: GLU, then
``per_token_scale``), so the result equals SequentialMLP's up to matmul rounding.

The grouped path needs what ``grouped_mm`` takes: rows of 16-byte multiples (hidden and expert
widths a multiple of 4 in fp32, 8 in bf16), no expert bias, no fp8, the unfused activation;
otherwise the parent's loop runs.

On CPU, where ``grouped_mm`` is itself one matmul per expert, fp32 SwiGLU experts (Qwen3-MoE's:
no GLU offset or clamp) run as one autograd function instead (``_ExpertsSwiGLU``): the same
per-expert matmuls, written into slices of preallocated outputs from the experts' own weights, so
no stacked copy of the weights per forward, and a backward that writes the GLU's two gradient
halves into one buffer (no chunk and cat) and reuses the forward's ``silu(a)`` (kept: one more
``[tokens, F]`` per layer) instead of computing it again. The same products and sums in the same
order: bitwise the grouped path's. It runs through a C++ kernel (``cpu_kernels.experts_swiglu``,
built at first use; ``model.cpu_experts_kernel``) that gives each OpenMP thread whole experts,
taken largest first, on single-threaded products (within 1e-6 of the Python loop; bitwise at
the benchmark shapes measured, while at others single-threaded products can round a sum
differently in the last bit): no barrier per product, each expert's rows, weights and gradients on one
core. In generation too, and for experts of any size. Where the kernel is off or did not build,
the function's Python loop runs (MKL splitting each product over the threads) for experts of at
least ``swiglu_cpu_min_weight`` fc1 weight elements outside generation, and grouped_mm otherwise
(generation over its cached weight stacks). Measured (docs/performance.md): the compute benchmark
shape's update phase 1.107x and its rollout 1.205x against the loop and grouped_mm.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from megatron_gspo import cpu_kernels


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (grouped_mm's backward refuses the
    zero-stride gradients that a sum or an expand produces)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_linear(x_TH: torch.Tensor, weights_EHO: torch.Tensor, offsets_E: torch.Tensor):
    """Rows of ``x`` grouped by expert (``offsets``: cumulative row counts, int32) times each
    expert's ``[in, out]`` weight (its linear's weight transposed): ``[T, out]``."""
    out_TO = F.grouped_mm(x_TH, weights_EHO, offs=offsets_E)
    return _ContiguousGrad.apply(out_TO) if out_TO.requires_grad else out_TO


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


class GroupedSequentialMLP(SequentialMLP):
    """``SequentialMLP`` whose forward runs the local experts as grouped matmuls."""

    # Inside ``cached_expert_weights``: a dict holding this layer's stacked weights.
    weight_cache = None
    # Without the C++ kernel, ``_ExpertsSwiGLU``'s loop from this many fc1 weight elements per
    # expert: below it, stacking the weights costs less than the loop's per-expert calls (64
    # experts of 32 x 64, forward + backward: 105.9 ms against 97.7 through grouped_mm; 512 x
    # 256: a compute step 5% faster). The kernel runs every size (89.6 ms there), generation too.
    swiglu_cpu_min_weight = 16384
    # ``_ExpertsSwiGLU`` through the C++ kernel (whole experts per OpenMP thread) where it builds
    # (``model.cpu_experts_kernel``; build_model sets it per layer).
    cpu_kernel = True
    # Rows per expert group are padded to a multiple of this on CUDA (``pad_groups``).
    cuda_group_rows = 16

    def _stacked_weights(self):
        """[E, in, out] stacks of the experts' fc1 and fc2 weights, transposed: made in every
        forward that autograd records (their gradients flow back to each expert's parameters; a
        transposed view), and once per ``cached_expert_weights`` block otherwise, contiguous
        (grouped_mm of decoding's few rows per expert: 688 against 766 us for 512 rows, fc1 of
        256 x 512; the same bits)."""
        cache = None if torch.is_grad_enabled() else self.weight_cache
        if cache is None:
            return tuple(torch.stack([getattr(e, name).weight for e in self.local_experts])
                         .transpose(1, 2) for name in ("linear_fc1", "linear_fc2"))
        if "w" not in cache:  # one copy: the stack of transposed views is [E, in, out] in order
            cache["w"] = tuple(torch.stack([getattr(e, name).weight.t()
                                            for e in self.local_experts])
                               for name in ("linear_fc1", "linear_fc2"))
        return cache["w"]

    def _grouped_ok(self, x: torch.Tensor) -> bool:
        c = self.config
        first = self.local_experts[0]
        align = 16 // x.element_size()
        widths = (x.shape[-1], first.linear_fc1.weight.shape[0], first.linear_fc2.weight.shape[1])
        # grouped_mm on CUDA takes bf16 (Hopper); on CPU any float type
        dtype_ok = x.device.type == "cpu" or x.dtype == torch.bfloat16
        return (dtype_ok and not c.moe_apply_probs_on_input and not c.fp8
                and not getattr(c, "fp4", None)
                and not c.add_bias_linear and not c.bias_activation_fusion
                and not c.use_te_activation_func and hasattr(F, "grouped_mm")
                and all(w % align == 0 for w in widths))

    def experts_large_enough(self) -> bool:
        """Whether this layer's experts are large enough for ``_ExpertsSwiGLU``."""
        return self.local_experts[0].linear_fc1.weight.numel() >= self.swiglu_cpu_min_weight

    def _swiglu_fp32_cpu(self, x: torch.Tensor, probs: torch.Tensor) -> bool:
        """CPU, fp32, SwiGLU without offset or clamp."""
        c = self.config
        return (x.device.type == "cpu" and x.dtype == probs.dtype == torch.float32
                and c.gated_linear_unit
                and c.activation_func is F.silu and c.activation_func_clamp_value is None
                and not c.glu_linear_offset)

    def _kernel(self):
        """The C++ kernel for this layer's fp32 SwiGLU experts on CPU, or None (switched off,
        or it did not build)."""
        return cpu_kernels.experts_swiglu() if self.cpu_kernel else None

    def _swiglu_cpu_ok(self, x: torch.Tensor, probs: torch.Tensor) -> bool:
        """``_ExpertsSwiGLU`` runs: CPU, fp32, SwiGLU without offset or clamp, and either its
        C++ kernel is at hand (any size; generation too) or, for its Python loop, the experts
        are large enough and not generating (generation's cached stacks go to grouped_mm)."""
        if not self._swiglu_fp32_cpu(x, probs):
            return False
        if self._kernel() is not None:
            return True
        return self.weight_cache is None and self.experts_large_enough()

    def path(self, x: torch.Tensor, probs: torch.Tensor) -> str:
        """Which forward runs for these inputs: "swiglu_cpu_kernel" (the CPU function through
        its C++ kernel), "swiglu_cpu" (through its loop), "grouped" or "sequential"."""
        if not self._grouped_ok(x):
            return "sequential"
        if not self._swiglu_cpu_ok(x, probs):
            return "grouped"
        return "swiglu_cpu_kernel" if self._kernel() is not None else "swiglu_cpu"

    def forward(self, permuted_local_hidden_states: torch.Tensor,
                tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor):
        x = permuted_local_hidden_states
        path = self.path(x, permuted_probs)
        if path == "sequential":
            return super().forward(x, tokens_per_expert, permuted_probs)
        if path.startswith("swiglu_cpu"):
            ends = torch.as_tensor(tokens_per_expert).cumsum(0).tolist()
            bounds = list(zip([0] + ends[:-1], ends))
            weights = ([e.linear_fc1.weight for e in self.local_experts]
                       + [e.linear_fc2.weight for e in self.local_experts])
            kernel = self._kernel() if path == "swiglu_cpu_kernel" else None
            return _ExpertsSwiGLU.apply(x, permuted_probs, bounds, len(self.local_experts),
                                        kernel, *weights), None
        counts = torch.as_tensor(tokens_per_expert, device=x.device)
        multiple = self.cuda_group_rows if x.device.type == "cuda" else 1
        rows_T = None
        if multiple > 1:
            x, permuted_probs, offsets, rows_T = pad_groups(x, permuted_probs, counts, multiple)
        else:
            offsets = counts.cumsum(0).to(torch.int32)
        w1, w2 = self._stacked_weights()
        h = grouped_linear(x, w1, offsets)
        c = self.config
        if c.gated_linear_unit:  # as mlp.MLP's unfused path
            h_glu, h_lin = torch.chunk(h, 2, dim=-1)
            if (val := c.activation_func_clamp_value) is not None:
                h_glu = h_glu.clamp(min=None, max=val)
                h_lin = h_lin.clamp(min=-val, max=val)
            if c.glu_linear_offset:  # (adding 0.0 costs a full pass over h for nothing)
                h_lin = h_lin + c.glu_linear_offset
            h = c.activation_func(h_glu) * h_lin
        else:
            h = c.activation_func(h)
        h = (h * permuted_probs.unsqueeze(-1)).to(x.dtype)
        out = grouped_linear(h, w2, offsets)
        return (out if rows_T is None else out.index_select(0, rows_T)), None


def pad_groups(x_TH: torch.Tensor, probs_T: torch.Tensor, counts_E: torch.Tensor, multiple: int):
    """Rows grouped by expert (``counts``) spread so that every group starts at, and spans, a
    multiple of ``multiple`` rows, zero rows between: grouped_mm's bf16 backward on Hopper
    contracts each group's rows for the weight gradient and needs them aligned (torchtitan pads
    to 8 rows for bf16). The padded length is fixed by the shapes, ``round_up(T + E (multiple -
    1), multiple)`` (the last group takes the rest), so nothing waits for the counts on the host.
    Returns the padded rows and probabilities, the int32 group ends, and where each row went
    (``out_padded.index_select(0, rows)`` gives the rows back in order). Zero rows add nothing
    to any gradient."""
    T, E = x_TH.shape[0], counts_E.shape[0]
    total = -(-(T + E * (multiple - 1)) // multiple) * multiple
    padded_E = (counts_E + multiple - 1) // multiple * multiple
    ends_E = padded_E.cumsum(0)
    starts_E = ends_E - padded_E
    first_E = counts_E.cumsum(0) - counts_E
    expert_T = torch.repeat_interleave(torch.arange(E, device=x_TH.device), counts_E,
                                       output_size=T)
    rows_T = starts_E[expert_T] + torch.arange(T, device=x_TH.device) - first_E[expert_T]
    x_pad = x_TH.new_zeros(total, x_TH.shape[1]).index_copy(0, rows_T, x_TH)
    probs_pad = probs_T.new_zeros(total).index_copy(0, rows_T, probs_T)
    ends_E = torch.cat([ends_E[:-1], ends_E.new_full((1,), total)]).to(torch.int32)
    return x_pad, probs_pad, ends_E, rows_T


@contextlib.contextmanager
def cached_expert_weights(model):
    """Within the block, forwards without autograd stack each layer's expert weights once and
    reuse them (generation: tens of forwards with unchanged weights; stacking copies all of a
    layer's experts each time). Costs one copy of the local expert weights while it lasts; the
    copies are dropped on exit, so a later weight update is never missed."""
    layers = [m for m in model.modules() if isinstance(m, GroupedSequentialMLP)]
    for m in layers:
        m.weight_cache = {}
    try:
        yield
    finally:
        for m in layers:
            m.weight_cache = None
