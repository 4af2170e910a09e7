"""Group-normalised advantages (GRPO / GSPO): one advantage per response, relative to its group.

Legend: ``N`` responses, ``G`` group size (responses per prompt), ``P = N / G`` prompts. Responses of
one prompt are consecutive.
"""

from __future__ import annotations

import torch


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.reshape(-1, group_size)


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean_group r) / (std_group r + eps), or without the division when ``scale`` is
    False. std is the sample std (as in GRPO implementations); a group of one response or of equal
    rewards carries no signal and gets advantage 0, never NaN."""
    r_PG = _groups(rewards, group_size).to(torch.promote_types(rewards.dtype, torch.float32))
    centered = r_PG - r_PG.mean(dim=1, keepdim=True)
    if scale and group_size > 1:
        centered = centered / (r_PG.std(dim=1, keepdim=True) + eps)
    if group_size == 1:
        centered = torch.zeros_like(centered)
    return centered.reshape(-1)


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N] bool: True for responses whose group's rewards are not all equal (for dropping
    zero-variance groups, as DAPO's dynamic sampling does)."""
    r_PG = _groups(rewards, group_size)
    varied = (r_PG != r_PG[:, :1]).any(dim=1, keepdim=True)
    return varied.expand_as(r_PG).reshape(-1)


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int) -> torch.Tensor:
    """DAPO's soft overlong punishment per response of ``lengths`` tokens (limit ``max_len``):
    0 up to ``max_len - buffer`` tokens, then a linear ramp to -1 at ``max_len`` (and -1 past it)."""
    if buffer < 1 or buffer > max_len:
        raise ValueError(f"overlong buffer {buffer} must be in [1, {max_len}]")
    start = max_len - buffer
    over = (lengths.to(torch.float64) - start) / buffer
    return -torch.clamp(over, min=0.0, max=1.0)


def select_groups(informative: torch.Tensor, group_size: int, wanted: int) -> tuple[list, list]:
    """Dynamic sampling over one round's responses: (indices of the groups to keep, in order, at
    most ``wanted``; indices of the informative groups left over or uninformative ones dropped).
    ``informative`` is ``informative_groups``' [N] mask."""
    per_group = informative.reshape(-1, group_size)[:, 0].tolist()
    keep = [g for g, ok in enumerate(per_group) if ok][:wanted]
    drop = [g for g in range(len(per_group)) if g not in keep]
    return keep, drop
