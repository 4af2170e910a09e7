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

On CUDA each expert's rows are padded to a multiple of ``group_rows`` (``pad_groups``) for
grouped_mm's bf16 backward on Hopper. The CPU backend's subclass (``backends.cpu.experts``) runs
fp32 SwiGLU experts through its own autograd function and C++ kernel.

The math is one pure function (``grouped_experts``), which ``compile_grouped_experts``
(``backend.compile_experts``) puts under ``torch.compile`` as one graph with the token count
dynamic: a compilation with autograd and one without serve every micro-batch length.
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


def grouped_linear(x_TH: torch.Tensor, weights_EHO: torch.Tensor, offsets_E: torch.Tensor):
    """Rows of ``x`` grouped by expert (``offsets``: cumulative row counts, int32) times each
    expert's ``[in, out]`` weight (its linear's weight transposed): ``[T, out]``."""
    out_TO = F.grouped_mm(x_TH, weights_EHO, offs=offsets_E)
    return _ContiguousGrad.apply(out_TO) if out_TO.requires_grad else out_TO


class GroupedSequentialMLP(SequentialMLP):
    """``SequentialMLP`` whose forward runs the local experts as grouped matmuls."""

    # Inside ``cached_expert_weights``: a dict holding this layer's stacked weights.
    weight_cache = None
    # Rows per expert group are padded to a multiple of this (``pad_groups``): grouped_mm's bf16
    # backward on Hopper needs aligned groups. 1: no padding (the CPU backend).
    group_rows = 16
    # The dtypes grouped_mm takes on this backend's device (None: every float type).
    grouped_dtypes = (torch.bfloat16,)
    # ``compile_grouped_experts``: the compiled ``grouped_experts`` (None: eager).
    compiled = None

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
        dtype_ok = self.grouped_dtypes is None or x.dtype in self.grouped_dtypes
        return (dtype_ok and not c.moe_apply_probs_on_input and not c.fp8
                and not getattr(c, "fp4", None)
                and not c.add_bias_linear and not c.bias_activation_fusion
                and not c.use_te_activation_func
                and all(w % align == 0 for w in widths))

    def path(self, x: torch.Tensor, probs: torch.Tensor) -> str:
        """Which forward runs for these inputs: "grouped" or "sequential" (Megatron's loop)."""
        return "grouped" if self._grouped_ok(x) else "sequential"

    def forward(self, permuted_local_hidden_states: torch.Tensor,
                tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor):
        x = permuted_local_hidden_states
        if self.path(x, permuted_probs) == "sequential":
            return super().forward(x, tokens_per_expert, permuted_probs)
        return self.grouped_forward(x, tokens_per_expert, permuted_probs)

    def grouped_forward(self, x, tokens_per_expert, permuted_probs):
        """The local experts as two grouped matmuls (fc1, the activation, fc2), compiled where
        ``compile_grouped_experts`` asked for it."""
        counts = torch.as_tensor(tokens_per_expert, device=x.device)
        w1, w2 = self._stacked_weights()
        run = grouped_experts
        if self.compiled is not None:
            run = self.compiled
            for t in (x, permuted_probs):  # one compilation for every token count
                torch._dynamo.maybe_mark_dynamic(t, 0)
        return run(x, permuted_probs, counts, w1, w2, group_rows=self.group_rows,
                   config=self.config), None


def grouped_experts(x_TH, probs_T, counts_E, w1_EHF, w2_EFH, *, group_rows: int, config,
                    offsets_E=None):
    """Rows grouped by expert (``counts``) through each expert's MLP as two grouped matmuls, the
    gated activation and the routing probabilities as in Megatron's unfused MLP path (``mlp.py``:
    GLU, then ``per_token_scale``); rows padded per group to ``group_rows`` when it is over 1
    (``pad_groups``). Unpadded, the groups' ends (``offsets_E``, int32) may be given instead of
    the counts. A pure function of tensors (and the config's activation), so that
    ``torch.compile`` takes it whole."""
    x, probs, rows_T = x_TH, probs_T, None
    if group_rows > 1:
        x, probs, offsets, rows_T = pad_groups(x, probs, counts_E, group_rows)
    elif offsets_E is not None:
        offsets = offsets_E
    else:
        offsets = counts_E.cumsum(0).to(torch.int32)
    h = grouped_linear(x, w1_EHF, offsets)
    c = config
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
    h = (h * probs.unsqueeze(-1)).to(x.dtype)
    out = grouped_linear(h, w2_EFH, offsets)
    return out if rows_T is None else out.index_select(0, rows_T)


def compile_grouped_experts(model, backend: str = "inductor") -> int:
    """``torch.compile`` the grouped experts of every layer of ``model`` that runs them
    (``backend.compile_experts``): the group padding, both grouped matmuls, the activation and
    the routing weights as one graph (``fullgraph``: a break is an error, not a slow path), the
    token count dynamic, so one compilation serves every micro-batch length. Returns how many
    layers take it (0: none runs ``GroupedSequentialMLP``'s grouped forward, e.g. Transformer
    Engine's layers, or ``backend.grouped_experts=false``)."""
    layers = [m for m in model.modules() if isinstance(m, GroupedSequentialMLP)]
    if layers:
        compiled = torch.compile(grouped_experts, fullgraph=True, backend=backend)
        for m in layers:
            m.compiled = compiled
    return len(layers)


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
