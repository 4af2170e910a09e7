"""Expert-drift metrics: how routing changes between two passes over the same tokens, and how
evenly experts are loaded. Pure functions of integer route tensors; results are tensors.

Legend: ``N`` tokens, ``L`` MoE layers, ``K`` top-k, ``E`` experts.
"""

from __future__ import annotations

import torch


def _overlap(a_NK: torch.Tensor, b_NK: torch.Tensor) -> torch.Tensor:
    """|a ∩ b| per row (rows are sets of distinct expert ids)."""
    return (a_NK[:, :, None] == b_NK[:, None, :]).any(-1).sum(-1)


def agreement_sums(a_NK: torch.Tensor, b_NK: torch.Tensor) -> torch.Tensor:
    """[3] sums over rows: rows, rows with equal sets, Jaccard overlaps (reducible across ranks)."""
    if a_NK.shape != b_NK.shape or a_NK.dim() != 2:
        raise ValueError(f"routes to compare must both be [tokens, k]; got {tuple(a_NK.shape)} "
                         f"and {tuple(b_NK.shape)}")
    k = a_NK.shape[1]
    inter = _overlap(a_NK.long(), b_NK.long()).double()
    jaccard = inter / (2 * k - inter)
    return torch.stack([torch.tensor(float(a_NK.shape[0]), dtype=torch.float64, device=inter.device),
                        (inter == k).double().sum(), jaccard.sum()])


def from_sums(sums: torch.Tensor) -> dict:
    rows = sums[0].clamp_min(1)
    exact = sums[1] / rows
    return {"exact_match": exact, "jaccard": sums[2] / rows, "changed_fraction": 1 - exact}


def topk_agreement(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Agreement of two [tokens, k] expert-index tensors (order within a row does not matter):
    ``exact_match`` (fraction of rows with equal sets), ``jaccard`` (mean |a∩b| / |a∪b|),
    ``changed_fraction`` (1 - exact_match)."""
    return from_sums(agreement_sums(a, b))


def layer_drift_sums(a_LNK: list, b_LNK: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer agreement sums [L, 3] and [2] (tokens, tokens with any layer changed)."""
    per_layer = torch.stack([agreement_sums(a, b) for a, b in zip(a_LNK, b_LNK)])
    changed_any = torch.zeros(a_LNK[0].shape[0], dtype=torch.bool, device=a_LNK[0].device)
    k = a_LNK[0].shape[1]
    for a, b in zip(a_LNK, b_LNK):
        changed_any |= _overlap(a.long(), b.long()) != k
    tokens = torch.stack([torch.tensor(float(changed_any.numel()), dtype=torch.float64,
                                       device=changed_any.device), changed_any.double().sum()])
    return per_layer, tokens


def drift_metrics(per_layer_sums: torch.Tensor, token_sums: torch.Tensor) -> dict:
    """Per-layer and overall drift from (possibly all-reduced) sums: ``layers`` [L] changed
    fraction, ``jaccard`` [L], overall ``changed_fraction`` and ``jaccard`` over (token, layer)
    pairs, and ``tokens_changed`` (fraction of tokens with any layer changed)."""
    rows = per_layer_sums[:, 0].clamp_min(1)
    overall = per_layer_sums.sum(0)
    return {
        "layers": 1 - per_layer_sums[:, 1] / rows,
        "layers_jaccard": per_layer_sums[:, 2] / rows,
        "changed_fraction": 1 - overall[1] / overall[0].clamp_min(1),
        "jaccard": overall[2] / overall[0].clamp_min(1),
        "tokens_changed": token_sums[1] / token_sums[0].clamp_min(1),
    }


def expert_counts(routes_NK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] how many tokens chose each expert (reducible across ranks)."""
    return torch.bincount(routes_NK.reshape(-1).long(), minlength=num_experts).double()


def load_metrics(counts_LE: torch.Tensor) -> dict:
    """Per layer: ``share`` [L, E] of routed tokens per expert, ``entropy`` [L] of that share
    (nats; log E when balanced), ``imbalance`` [L] = max share / mean share (1 when balanced).
    Experts that get no tokens have share 0 and add nothing to the entropy."""
    total = counts_LE.sum(-1, keepdim=True).clamp_min(1)
    share = counts_LE / total
    entropy = -(torch.where(share > 0, share * share.log(), 0.0)).sum(-1)
    imbalance = share.max(-1).values / share.mean(-1).clamp_min(1e-12)
    return {"share": share, "entropy": entropy, "imbalance": imbalance}
