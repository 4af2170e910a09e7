"""Expert-drift instrumentation: metrics from routes that passes record anyway, reduced over the
ranks, written to TensorBoard and to ``drift.jsonl`` in the run directory (one row per step and
layer), which ``tools.drift_report`` reads.

TensorBoard tags (``KIND`` is ``update`` or ``rollout_train``):
- ``moe/drift/KIND/layer_XX``: fraction of tokens whose top-k set changed in MoE layer XX
- ``moe/drift/KIND/mean``: the same over all (token, layer) pairs
- ``moe/drift/KIND/jaccard_mean``: mean Jaccard overlap of the top-k sets
- ``moe/drift/KIND/tokens_changed``: fraction of tokens with any layer changed
- ``moe/drift/ratio_noise/{changed,unchanged,quotient,changed_tokens}``: mean |log ratio| (new
  policy over old, the same tokens before and after the first update) of response tokens whose
  top-k set changed in at least one MoE layer, of the others, their quotient, and the fraction of
  tokens changed; ``moe/drift/ratio_noise/by_changed_layers_XX``: mean |log ratio| of the tokens
  whose routes changed in exactly XX layers
- ``moe/load/entropy/layer_XX``, ``moe/load/imbalance/layer_XX`` (max / mean expert share),
  ``moe/load/max_share``: expert load of the step's routes

Legend: ``N`` tokens on this rank, ``K`` top-k, ``L`` MoE layers of the model, ``E`` experts.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_gspo.distributed import comm
from moe.drift import drift_metrics, expert_counts, layer_drift_sums, load_metrics
from moe.records import local_moe_layers

DRIFT_LOG = "drift.jsonl"
KINDS = ("update", "rollout_train")


def drift_between(a: Sequence[Sequence[torch.Tensor]], b: Sequence[Sequence[torch.Tensor]], *,
                  local_layers: Sequence[int], num_moe_layers: int, pp_group=None,
                  device: torch.device = torch.device("cpu"), counted: bool = True) -> dict:
    """Drift between two passes over the same tokens (per forward, per local layer, [N, K]),
    complete over all ranks: layer sums over every rank (each holds distinct tokens or distinct
    layers), the any-layer flag of each token over the pipeline stages. Ranks with ``counted``
    False join the collectives but add nothing (so that every layout measures the same tokens).
    Collectives run on ``device``, over the world and ``pp_group`` (None: no pipeline stages)."""
    per_layer = torch.zeros(num_moe_layers, 3, dtype=torch.float64, device=device)
    weight = 1.0 if counted else 0.0
    changed = torch.zeros((), dtype=torch.float64, device=device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for fa, fb in zip(a, b):
        sums, _ = layer_drift_sums(list(fa), list(fb))
        per_layer[list(local_layers)] += sums.to(device) * weight
        k = fa[0].shape[1]
        flags = torch.zeros(fa[0].shape[0], dtype=torch.float64, device=device)
        for x, y in zip(fa, fb):
            same = (x[:, :, None] == y[:, None, :]).any(-1).sum(-1) != k
            flags = torch.maximum(flags, same.double().to(device))
        if pp_group is not None:  # the stages hold different layers of the same tokens
            comm.reduce_tensor(flags, group=pp_group, op="max")
        changed += flags.sum() * weight
        total += flags.numel() * weight
    pp = dist.get_world_size(pp_group) if pp_group is not None else 1
    tokens = comm.reduce_tensor(torch.stack([total, changed]) / pp)
    return drift_metrics(comm.reduce_tensor(per_layer).cpu(), tokens.cpu())


def expert_load(routes: Sequence[Sequence[torch.Tensor]], *, local_layers: Sequence[int],
                num_moe_layers: int, num_experts: int, device: torch.device = torch.device("cpu"),
                counted: bool = True) -> dict:
    """Expert load of one pass (per forward, per local layer, [N, K]) over all ranks (those with
    ``counted`` False add nothing)."""
    counts = torch.zeros(num_moe_layers, num_experts, dtype=torch.float64, device=device)
    for forward in routes:
        for layer, r in zip(local_layers, forward):
            counts[layer] += expert_counts(r, num_experts).to(device) * (1.0 if counted else 0.0)
    return load_metrics(comm.reduce_tensor(counts).cpu())


class DriftLog:
    """Writes drift and load metrics to TensorBoard and ``RUN_DIR/drift.jsonl`` (rank 0 only)."""

    def __init__(self, run_dir: str, writer=None, enabled: bool = True):
        self.path = os.path.join(run_dir, DRIFT_LOG)
        self.writer = writer
        self.enabled = enabled
        if enabled:
            os.makedirs(run_dir, exist_ok=True)

    def _rows(self, rows: list) -> None:
        with open(self.path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")

    def drift(self, step: int, kind: str, metrics: dict) -> None:
        if kind not in KINDS:
            raise ValueError(f"drift kind {kind!r}; valid: {', '.join(KINDS)}")
        if not self.enabled:
            return
        layers = metrics["layers"].tolist()
        jacc = metrics["layers_jaccard"].tolist()
        rows = [{"step": step, "kind": kind, "layer": i, "changed_fraction": c, "jaccard": j}
                for i, (c, j) in enumerate(zip(layers, jacc))]
        rows.append({"step": step, "kind": kind, "layer": "mean",
                     "changed_fraction": float(metrics["changed_fraction"]),
                     "jaccard": float(metrics["jaccard"]),
                     "tokens_changed": float(metrics["tokens_changed"])})
        self._rows(rows)
        if self.writer is not None:
            for i, c in enumerate(layers):
                self.writer.add_scalar(f"moe/drift/{kind}/layer_{i:02d}", c, step)
            self.writer.add_scalar(f"moe/drift/{kind}/mean", float(metrics["changed_fraction"]), step)
            self.writer.add_scalar(f"moe/drift/{kind}/jaccard_mean", float(metrics["jaccard"]), step)
            self.writer.add_scalar(f"moe/drift/{kind}/tokens_changed",
                                   float(metrics["tokens_changed"]), step)

    def ratio_noise(self, step: int, metrics: dict) -> None:
        """One ``kind: ratio_noise`` row (see ``moe.drift.ratio_noise_metrics``)."""
        if not self.enabled:
            return
        scalars = {k: float(metrics[k]) for k in ("changed", "unchanged", "quotient",
                                                   "changed_tokens")}
        by_layers = metrics["by_layers"].tolist()
        self._rows([{"step": step, "kind": "ratio_noise", "layer": "mean", **scalars,
                     "by_changed_layers": by_layers, "tokens": metrics["tokens"].tolist()}])
        if self.writer is not None:
            for k, v in scalars.items():
                if v == v:  # undefined (no token changed or none stayed): not logged
                    self.writer.add_scalar(f"moe/drift/ratio_noise/{k}", v, step)
            for n, v in enumerate(by_layers):
                if v == v:  # no token with n changed layers: nothing to log
                    self.writer.add_scalar(f"moe/drift/ratio_noise/by_changed_layers_{n:02d}",
                                           v, step)

    def load(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        share = metrics["share"]
        rows = [{"step": step, "kind": "load", "layer": i, "share": share[i].tolist(),
                 "entropy": float(metrics["entropy"][i]), "imbalance": float(metrics["imbalance"][i])}
                for i in range(share.shape[0])]
        self._rows(rows)
        if self.writer is not None:
            for i in range(share.shape[0]):
                self.writer.add_scalar(f"moe/load/entropy/layer_{i:02d}", float(metrics["entropy"][i]),
                                       step)
                self.writer.add_scalar(f"moe/load/imbalance/layer_{i:02d}",
                                       float(metrics["imbalance"][i]), step)
            self.writer.add_scalar("moe/load/max_share", float(share.max()), step)


def read_drift_log(run_dir: str) -> list[dict]:
    """Rows of ``RUN_DIR/drift.jsonl``; a missing or corrupt log raises naming file and line."""
    path = os.path.join(run_dir, DRIFT_LOG)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{run_dir}: no {DRIFT_LOG} (was drift instrumentation on?)")
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict) or "step" not in row or "kind" not in row:
                    raise ValueError("missing step or kind")
            except ValueError as e:
                raise ValueError(f"{path}:{n}: corrupt drift log row ({e})") from None
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: empty drift log")
    return rows


def local_layers_of(model_cfg, ctx) -> list[int]:
    return local_moe_layers(model_cfg.moe_layer_pattern, ctx.pp, ctx.pp_rank)


def num_moe_layers(model_cfg) -> int:
    return int(sum(model_cfg.moe_layer_pattern))


def maybe_writer(run_dir: str, rank: int) -> Optional[object]:
    """TensorBoard writer on rank 0."""
    if rank != 0:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=os.path.join(run_dir, "tb"))
