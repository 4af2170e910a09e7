"""What a device type changes (``Backend``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class Backend:
    """What a device type changes. ``norm``, ``attention``, ``experts``: module classes of the
    local layer spec; ``token_dispatcher``: Megatron's MoE dispatcher type; ``init_on_cpu``:
    Megatron's ``use_cpu_initialization``; ``activate()``: adapt the process once (idempotent),
    returning what is in force; ``seed(seed, tp_rank, ep_rank, etp_rank)``: Megatron's RNG
    tracker; ``decoder``: the direct decoding step (``unsupported(gpt, ctx)`` and
    ``decode_step(...)``), or None for the model's own forward; ``checkpoint_format``: the
    optimizer moments' format of ``trainer.checkpoint_format=auto``; ``exact_engine``: the
    in-process engine's log-probs in fp32 are the trainer's pass's to float rounding (so
    ``algo.old_logprobs=auto`` takes them); ``layers``: what runs, for the layout line;
    ``static_decode``: the local engine decodes through ``rollout.static_decode`` (no host
    synchronisation per step) where it applies; ``sort_dispatch``: MoE layers whose experts are
    all local take ``models.dispatch.SortTokenDispatcher`` (no host synchronisation)."""

    name: str
    norm: type
    attention: type
    experts: type
    token_dispatcher: str
    init_on_cpu: bool
    activate: Callable[[], list]
    seed: Callable[..., None]
    checkpoint_format: str
    exact_engine: bool
    layers: Callable[[], str]
    decoder: Optional[object] = None
    static_decode: bool = False
    sort_dispatch: bool = False
