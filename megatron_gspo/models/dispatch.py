"""A token dispatcher for an MoE layer whose experts are all on this rank (expert parallel 1,
tensor parallel 1), that never makes the host wait for the device.

megatron-core 0.16's dispatchers read the tokens per expert on the host (``.cpu()`` of the
counts, ``masked_select`` of the routing map and the probabilities; a ``masked_scatter`` in the
backward): three host synchronisations in the forward of every MoE layer and one in its backward
(the all-gather dispatcher, measured), each stalling a GPU's host until the device catches up. This one groups the tokens by expert with a stable
sort of their top-k expert ids, keeps the counts on the device (``scatter_add_``) and combines
with ``index_add_``: the same permutation as megatron's (expert by expert, tokens in order within
each), the same expert inputs, no host synchronisation (``megatron_gspo.debug.count_host_syncs``).

It takes megatron's dispatcher interface (``dispatch_preprocess`` .. ``combine_postprocess``), so
``MoELayer`` runs it as it runs its own; ``use_sort_dispatch(gpt)`` installs it in every MoE layer
that qualifies (no token dropping, every expert local).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher


def route_top_k(x_NH: torch.Tensor, router_EH: torch.Tensor, k: int, *, pre_softmax: bool,
                scale) -> tuple:
    """megatron's top-k router on rows ``x``: fp32 logits, softmax then top-k
    (``moe_router_pre_softmax``) or top-k then softmax over the k, times
    ``moe_router_topk_scaling_factor`` when set. Returns the probabilities and expert ids
    ``[N, K]``."""
    logits = F.linear(x_NH.float(), router_EH.float())
    if pre_softmax:
        probs_NK, ids_NK = torch.softmax(logits, -1).topk(k, -1)
    else:
        top, ids_NK = logits.topk(k, -1)
        probs_NK = torch.softmax(top, -1)
    return (probs_NK * scale if scale else probs_NK), ids_NK


def group_by_expert(ids_NK: torch.Tensor, num_experts: int) -> tuple:
    """The (token, expert) pairs grouped expert by expert, tokens in order within each (megatron's
    permutation), without reading the host: ``order`` (pair ids, token-major, sorted), ``rows``
    (each sorted pair's token) and the tokens per expert ``[E]`` on the device."""
    flat, _, order, rows = _sorted_pairs(ids_NK)
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    return order, rows, counts_E


def group_by_expert_offsets(ids_NK: torch.Tensor, experts_E: torch.Tensor) -> tuple:
    """``group_by_expert`` with each expert's end among the sorted pairs (``grouped_mm``'s
    offsets, int32) in place of the counts: one ``searchsorted`` of the sorted ids (the sort
    gives them with the order) for a count and its cumulative sum. ``experts_E``: ``arange(E)``
    on the ids' device."""
    _, sorted_ids, order, rows = _sorted_pairs(ids_NK)
    offsets_E = torch.searchsorted(sorted_ids, experts_E, right=True, out_int32=True)
    return order, rows, offsets_E


def _sorted_pairs(ids_NK: torch.Tensor) -> tuple:
    """The (token, expert) pairs' expert ids token-major, the same sorted (stable), the sort's
    order and each sorted pair's token."""
    flat = ids_NK.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    return flat, sorted_ids, order, torch.div(order, ids_NK.shape[1], rounding_mode="floor")


class SortTokenDispatcher(MoETokenDispatcher):
    """Tokens grouped by expert by a sort of their expert ids, on the device."""

    def __init__(self, config, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        self.num_experts, self.top_k = config.num_moe_experts, config.moe_router_topk

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """The top-k expert ids of every token from its row of the routing map (each has exactly
        top-k experts), the sort that groups the (token, expert) pairs by expert, the counts."""
        self.hidden_shape = hidden_states.shape
        hidden = hidden_states.view(-1, self.hidden_shape[-1])
        k = self.top_k
        ids_NK = torch.sort(routing_map.to(torch.uint8), dim=1, descending=True,
                            stable=True).indices[:, :k]
        self.order, self.rows, self.tokens_per_expert = group_by_expert(ids_NK, self.num_experts)
        self.permuted_probs = probs.gather(1, ids_NK).reshape(-1).index_select(0, self.order)
        return hidden, probs

    def token_dispatch(self, hidden_states, probs):
        return hidden_states, probs  # every expert is on this rank

    def dispatch_postprocess(self, hidden_states, probs):
        return (hidden_states.index_select(0, self.rows), self.tokens_per_expert,
                self.permuted_probs)

    def combine_preprocess(self, hidden_states):
        """Each token's experts' outputs (already weighed by the routing probabilities) summed
        back into its row."""
        out = hidden_states.new_zeros(self.hidden_shape.numel() // self.hidden_shape[-1],
                                      hidden_states.shape[-1])
        return out.index_add_(0, self.rows, hidden_states)

    def token_combine(self, hidden_states):
        return hidden_states

    def combine_postprocess(self, hidden_states):
        return hidden_states.view(self.hidden_shape)


def sort_dispatch_applies(config, ctx) -> bool:
    """Every expert on this rank, no token dropped, and the layer computing its shared experts
    itself (with ``moe_shared_expert_overlap`` megatron's dispatchers run them)."""
    return (ctx.ep == 1 and ctx.tp == 1 and ctx.etp == 1
            and config.moe_expert_capacity_factor is None
            and not config.moe_pad_expert_input_to_capacity
            and not config.moe_shared_expert_overlap)


def use_sort_dispatch(gpt, ctx) -> int:
    """Install ``SortTokenDispatcher`` in every MoE layer of ``gpt`` where it applies; returns
    how many."""
    layers = [m for m in gpt.modules() if isinstance(m, MoELayer)]
    if not layers or not sort_dispatch_applies(layers[0].config, ctx):
        return 0
    for m in layers:
        m.token_dispatcher = SortTokenDispatcher(m.config, pg_collection=ctx.pg)
    return len(layers)
