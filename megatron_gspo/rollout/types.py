"""Typed records between the rollout engine and the trainer.

Legend: ``P`` prompt tokens, ``R`` response tokens, ``L`` MoE layers, ``K`` top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import torch


class RolloutError(RuntimeError):
    """Generation failed for good (a server, a timeout, a broken schedule); the message says
    which and why, in one line."""


@dataclass(frozen=True)
class RowRequest:
    """One response row's next request: what the engine reads (a prompt, or a prompt and the
    tokens a partial rollout has so far), how many new tokens at most, the row's seed."""

    input_ids: list
    max_new_tokens: int
    seed: Optional[int] = None


def row_seed(seed: int, row: int) -> int:
    """The sampling seed of response row ``row`` (its index in the step's global batch) of a
    request seeded ``seed`` (the trainer's: a function of the run seed and the step): the same
    on every engine, rank and batch split, different for every row of a step (up to 7919 rows)."""
    return seed * 7_919 + row


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: all
    stop_token_ids: tuple = ()
    seed: Optional[int] = None

    def validate(self) -> "SamplingParams":
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 (all) or >= 1")
        return self


@dataclass
class Sample:
    """One generated response. ``logprobs_R`` are the sampling policy's log-probs of the response
    tokens (softmax of logits / temperature, before top-k / top-p truncation; temperature 1 when
    greedy). ``routes_TLK``, when returned, covers every position fed to the model: the prompt and
    all response tokens but the last. ``versions_R``: the policy version (weight syncs done) that
    sampled each response token, when the engine reports it (asynchronous rollouts; a partial
    rollout's segments can differ)."""

    prompt_ids: list
    response_ids: list
    logprobs_R: torch.Tensor
    finish_reason: str  # "stop" | "length"
    routes_TLK: Optional[torch.Tensor] = None
    prompt_index: int = 0  # which prompt of the request this sample answers
    meta: dict = field(default_factory=dict)
    versions_R: Optional[torch.Tensor] = None


class Engine(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], samples_per_prompt: int,
                 params: SamplingParams) -> list[Sample]: ...

    def update_weights(self, source) -> None: ...

    def health(self) -> bool: ...

    def shutdown(self) -> None: ...
