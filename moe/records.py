"""Routing records: the experts each token was routed to, per sample, and their per-rank slices.

Legend: ``T`` tokens of a sample (model input positions), ``L`` MoE layers of the whole model,
``K`` top-k, ``E`` experts, ``B`` rows of a micro-batch, ``S`` its sequence width, ``N`` tokens a
rank's router sees (Megatron's ``[s, b]`` order: index ``s * B + b``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch


class RoutingRecordError(ValueError):
    """A routing record that does not fit the model or the batch; the message says which."""


def index_dtype(num_experts: int) -> torch.dtype:
    """Smallest integer type that holds expert ids: uint8 up to 256 experts, int16 above."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    return torch.int32


@dataclass
class RoutingRecord:
    """Experts chosen for every input position of one sample, in every MoE layer: [T, L, K]."""

    experts_TLK: torch.Tensor
    num_experts: int

    @staticmethod
    def from_indices(indices_TLK: torch.Tensor, num_experts: int) -> "RoutingRecord":
        if indices_TLK.dim() != 3:
            raise RoutingRecordError(f"routing record must be [tokens, moe_layers, top_k], got "
                                     f"shape {tuple(indices_TLK.shape)}")
        if indices_TLK.numel() and (int(indices_TLK.min()) < 0
                                    or int(indices_TLK.max()) >= num_experts):
            raise RoutingRecordError(
                f"routing record has expert ids in [{int(indices_TLK.min())}, "
                f"{int(indices_TLK.max())}], outside [0, {num_experts - 1}]")
        return RoutingRecord(indices_TLK.to(index_dtype(num_experts)), num_experts)

    @property
    def num_tokens(self) -> int:
        return self.experts_TLK.shape[0]

    def indices(self) -> torch.Tensor:
        """[T, L, K] int64 expert ids."""
        return self.experts_TLK.long()

    def check(self, *, num_layers: int, top_k: int, num_experts: int, what: str = "record"):
        t, layers, k = self.experts_TLK.shape
        if layers != num_layers:
            raise RoutingRecordError(f"{what}: {layers} MoE layers, the model has {num_layers}")
        if k != top_k:
            raise RoutingRecordError(f"{what}: top-{k} routes, the model routes top-{top_k}")
        if self.num_experts != num_experts:
            raise RoutingRecordError(f"{what}: recorded for {self.num_experts} experts, the model "
                                     f"has {num_experts}")

    def encode(self) -> bytes:
        """Compact bytes: a JSON header line, then the raw index array."""
        header = {"shape": list(self.experts_TLK.shape), "num_experts": self.num_experts,
                  "dtype": str(self.experts_TLK.dtype).replace("torch.", "")}
        return json.dumps(header).encode() + b"\n" + self.experts_TLK.numpy().tobytes()

    @staticmethod
    def decode(blob: bytes) -> "RoutingRecord":
        try:
            head, data = blob.split(b"\n", 1)
            header = json.loads(head)
            array = np.frombuffer(data, dtype=np.dtype(header["dtype"])).reshape(header["shape"])
        except (ValueError, KeyError, TypeError) as e:
            raise RoutingRecordError(f"cannot decode routing record: {e}") from None
        return RoutingRecord(torch.from_numpy(array.copy()), int(header["num_experts"]))


def _fill(num_layers: int, top_k: int) -> torch.Tensor:
    """Routes for padding positions (their outputs are ignored; any valid distinct ids do)."""
    return torch.arange(top_k).expand(num_layers, top_k)


def padded_routes(records: Sequence[RoutingRecord], lengths: Sequence[int], width: int
                  ) -> torch.Tensor:
    """[B, S, L, K] routes of a right-padded micro-batch: row b holds the first ``lengths[b]``
    input positions of sample b."""
    layers, k = records[0].experts_TLK.shape[1:]
    out = _fill(layers, k).expand(len(records), width, layers, k).clone()
    for b, (rec, n) in enumerate(zip(records, lengths)):
        if rec.num_tokens < n:
            raise RoutingRecordError(f"record of sample {b} covers {rec.num_tokens} tokens, the "
                                     f"batch feeds {n}")
        out[b, :n] = rec.indices()[:n]
    return out


def packed_routes(records: Sequence[RoutingRecord], cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[1, N, L, K] routes of a packed (THD) row; a trailing padding segment gets fill routes."""
    layers, k = records[0].experts_TLK.shape[1:]
    total = int(cu_seqlens[-1])
    out = _fill(layers, k).expand(1, total, layers, k).clone()
    bounds = cu_seqlens.tolist()
    for i, rec in enumerate(records):
        start, end = bounds[i], bounds[i + 1]
        if rec.num_tokens < end - start:
            raise RoutingRecordError(f"record of sample {i} covers {rec.num_tokens} tokens, the "
                                     f"packed row feeds {end - start}")
        out[0, start:end] = rec.indices()[:end - start]
    return out


def local_moe_layers(moe_pattern: Sequence[int], pp: int, pp_rank: int) -> list[int]:
    """Indices (into the MoE-only numbering of the record) of the MoE layers on this stage."""
    per_stage = len(moe_pattern) // pp
    moe_index = np.cumsum(moe_pattern) - 1
    stage = range(pp_rank * per_stage, (pp_rank + 1) * per_stage)
    return [int(moe_index[i]) for i in stage if moe_pattern[i]]


def rank_targets(routes_BSLK: torch.Tensor, *, layers: Sequence[int], cp: int = 1, cp_rank: int = 0,
                 cp_index: Optional[torch.Tensor] = None, tp: int = 1, tp_rank: int = 0,
                 sequence_parallel: bool = False) -> list[torch.Tensor]:
    """What this rank's routers see: per local MoE layer, [N, K] int64 in Megatron's [s, b] order.

    Context parallelism keeps ``cp_index`` positions of the sequence dimension (Megatron's zigzag;
    per sequence for packed rows); sequence parallelism then keeps this TP rank's contiguous
    ``1/tp`` of it. Pipeline stages keep only their ``layers``.
    """
    x = routes_BSLK
    if cp > 1:
        x = x[:, cp_index]
    if sequence_parallel and tp > 1:
        s = x.shape[1]
        if s % tp:
            raise RoutingRecordError(f"sequence width {s} is not divisible by tp={tp}")
        x = x[:, tp_rank * s // tp:(tp_rank + 1) * s // tp]
    x_SBLK = x.transpose(0, 1)
    return [x_SBLK[:, :, layer].reshape(-1, x.shape[-1]).long() for layer in layers]


def routes_from_rank(per_layer_NK: Sequence[torch.Tensor], batch: int) -> torch.Tensor:
    """Inverse of ``rank_targets`` on one rank: [B, S, L_local, K] from the routers' [s*b, K]."""
    stacked = torch.stack(list(per_layer_NK), dim=1)  # [N, L, K]
    n = stacked.shape[0]
    return stacked.reshape(n // batch, batch, *stacked.shape[1:]).transpose(0, 1)
