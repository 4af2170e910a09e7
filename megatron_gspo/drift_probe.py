"""Expert drift measured inside the RL step (``moe.instrument`` does the math and the logging).

- update drift: the routes of the same tokens (the step's first micro-batch) on the old policy and
  after the first optimizer update: the paper's "experts that change after one gradient update";
- rollout/train drift: the routes the engine used when generating vs the trainer's forward of the
  same tokens with the same weights (numerical mismatch between the two stacks);
- expert load of the step's first micro-batch.

Under R2 / R3 the training forwards replay routes, so the natural routes come from extra
forward-only passes of one micro-batch (a small fraction of a step's compute).
"""

from __future__ import annotations

import os

import torch

from megatron_gspo.policy import logprob_pass
from megatron_gspo.rl_batch import engine_route_targets, router_view
from moe.instrument import (DriftLog, drift_between, expert_load, local_layers_of,
                            num_moe_layers)
from moe.report import summary_line, write_report


class DriftProbe:
    def __init__(self, job, ctx, run_dir: str, writer):
        self.job, self.ctx, self.run_dir = job, ctx, os.path.abspath(run_dir)
        self.layers = local_layers_of(job.model, ctx)
        self.num_layers = num_moe_layers(job.model)
        self.log = DriftLog(run_dir, writer, enabled=ctx.rank == 0)
        self._before = None

    def _natural_routes(self, run, mbs) -> list:
        _, routes = logprob_pass(run.ddp, mbs, self.ctx, temperature=self.job.rollout.temperature,
                                 replay=run.replay, record=True)
        return routes

    def _between(self, a, b) -> dict:
        return drift_between(a, b, local_layers=self.layers, num_moe_layers=self.num_layers,
                             pp_group=self.ctx.pp_group, device=self.ctx.device,
                             counted=self._counted)

    @property
    def _counted(self) -> bool:
        """Only data-parallel rank 0's first micro-batch is measured (its tensor, pipeline and
        context-parallel ranks together hold all of it): the same tokens on every layout."""
        return self.ctx.dp_rank == 0

    def before_updates(self, run, batch, mbs0, rows0, routes, step: int) -> dict:
        """Routes of the first micro-batch on the old policy; rollout/train drift and load.
        Padding positions are left out of every measure."""
        if self.job.replay.mode == "none" or (self.job.replay.mode == "r2" and routes):
            before = routes[:1]
        else:  # R3 replayed the engine's routes: record the trainer's own
            before = self._natural_routes(run, mbs0)
        self._valid = _router_mask(batch, rows0, self.ctx)
        before = _keep(before, self._valid, self.ctx.device)
        self._before = before
        out = {}
        load = expert_load(before, local_layers=self.layers, num_moe_layers=self.num_layers,
                           num_experts=self.job.model.num_experts, device=self.ctx.device,
                           counted=self._counted)
        self.log.load(step, load)
        out["moe/load/max_share"] = float(load["share"].max())
        if batch.routes is not None:
            engine = _keep(run_targets(run, batch, rows0), self._valid, self.ctx.device)
            m = self._between(engine, before)
            self.log.drift(step, "rollout_train", m)
            out["moe/drift/rollout_train/mean"] = float(m["changed_fraction"])
            out["moe/drift/rollout_train/tokens_changed"] = float(m["tokens_changed"])
        return out

    def after_first_update(self, run, mbs0, step: int) -> dict:
        after = _keep(self._natural_routes(run, mbs0), self._valid, self.ctx.device)
        m = self._between(self._before, after)
        self.log.drift(step, "update", m)
        return {"moe/drift/update/mean": float(m["changed_fraction"]),
                "moe/drift/update/jaccard_mean": float(m["jaccard"]),
                "moe/drift/update/tokens_changed": float(m["tokens_changed"])}

    def close(self, ctx) -> None:
        if ctx.rank != 0:
            return
        path = os.path.join(self.run_dir, "drift_report.html")
        for s in write_report([self.run_dir], path):
            print(summary_line(s))
        print(f"drift report: {path}")


def run_targets(run, batch, rows: list) -> list:
    """The engine's routes of ``rows`` (one micro-batch), as this rank's routers see them."""
    return engine_route_targets(batch, rows, len(rows), layers=run.drift.layers, ctx=run.ctx)


def _router_mask(batch, rows: list, ctx):
    """[N] True for the real (not padding) tokens of ``rows``, in the order this rank's routers
    see them."""
    valid_BS = torch.arange(batch.width)[None] < batch.lengths_B[torch.tensor(rows), None]
    return router_view(valid_BS[:, :, None, None].long(), [0], ctx)[0][:, 0].bool()


def _keep(routes: list, valid_N, device) -> list:
    """The routes of one forward (per local layer [N, K]) restricted to the valid tokens, on the
    run's device."""
    return [[layer.to(device)[valid_N.to(device)] for layer in forward] for forward in routes]
