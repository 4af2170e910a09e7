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


def changed_layers(a_LNK: list, b_LNK: list) -> torch.Tensor:
    """[N] in how many of the given layers each token's top-k set differs between two passes."""
    k = a_LNK[0].shape[1]
    out = torch.zeros(a_LNK[0].shape[0], dtype=torch.int64, device=a_LNK[0].device)
    for a, b in zip(a_LNK, b_LNK):
        out += (_overlap(a.long(), b.long()) != k).long()
    return out


def ratio_noise_sums(abs_logratio_N: torch.Tensor, changed_layers_N: torch.Tensor,
                     num_layers: int) -> torch.Tensor:
    """[2, L + 1] per number of MoE layers whose routes changed (0 .. L): the sum of the tokens'
    |log ratio| and their count (reducible across ranks)."""
    out = torch.zeros(2, num_layers + 1, dtype=torch.float64, device=abs_logratio_N.device)
    idx = changed_layers_N.long().clamp(0, num_layers)
    out[0].index_add_(0, idx, abs_logratio_N.double())
    out[1].index_add_(0, idx, torch.ones_like(abs_logratio_N, dtype=torch.float64))
    return out


def ratio_noise_metrics(sums: torch.Tensor) -> dict:
    """The routing mechanism behind token-ratio noise, from (reduced) ``ratio_noise_sums``:
    ``changed`` mean |log ratio| of tokens whose routes changed in at least one layer,
    ``unchanged`` the same for the others, ``quotient`` changed / unchanged, ``by_layers`` [L + 1]
    mean |log ratio| per number of changed layers (nan where no token), ``tokens`` [L + 1] their
    counts, ``changed_tokens`` the fraction of tokens with a changed route."""
    total, count = sums[0], sums[1]
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=sums.device)
    changed = torch.where(count[1:].sum() > 0, total[1:].sum() / count[1:].sum().clamp_min(1), nan)
    unchanged = torch.where(count[0] > 0, total[0] / count[0].clamp_min(1), nan)
    return {"changed": changed, "unchanged": unchanged, "quotient": changed / unchanged,
            "by_layers": torch.where(count > 0, total / count.clamp_min(1), nan), "tokens": count,
            "changed_tokens": count[1:].sum() / count.sum().clamp_min(1)}
