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
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (grouped_mm's backward refuses the
    zero-stride gradients that a sum or an expand produces)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_linear(x_TH: torch.Tensor, weights_EOH: torch.Tensor, offsets_E: torch.Tensor):
    """Rows of ``x`` grouped by expert (``offsets``: cumulative row counts, int32) times each
    expert's ``[out, in]`` weight transposed: ``[T, out]``."""
    return _ContiguousGrad.apply(F.grouped_mm(x_TH, weights_EOH.transpose(1, 2), offs=offsets_E))


class GroupedSequentialMLP(SequentialMLP):
    """``SequentialMLP`` whose forward runs the local experts as grouped matmuls."""

    # Inside ``cached_expert_weights``: a dict holding this layer's stacked weights.
    weight_cache = None

    def _stacked_weights(self):
        """[E, out, in] stacks of the experts' fc1 and fc2 weights: made in every forward that
        autograd records (their gradients flow back to each expert's parameters), and once per
        ``cached_expert_weights`` block otherwise."""
        cache = None if torch.is_grad_enabled() else self.weight_cache
        if cache is not None and "w" in cache:
            return cache["w"]
        w = (torch.stack([e.linear_fc1.weight for e in self.local_experts]),
             torch.stack([e.linear_fc2.weight for e in self.local_experts]))
        if cache is not None:
            cache["w"] = w
        return w

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

    def forward(self, permuted_local_hidden_states: torch.Tensor,
                tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor):
        x = permuted_local_hidden_states
        if not self._grouped_ok(x):
            return super().forward(x, tokens_per_expert, permuted_probs)
        counts = torch.as_tensor(tokens_per_expert, device=x.device)
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
        return grouped_linear(h, w2, offsets), None


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
