"""Expert drift measured inside the RL step (``moe.instrument`` does the math and the logging).

- update drift: the routes of the same tokens on the old policy and after the first optimizer
  update: the paper's "experts that change after one gradient update". The tokens are those of
  the rows of data-parallel rank 0's first padded micro-batch (the first ``micro_batch_size`` rows
  of mini-batch 0), on every layout: with packing, each rank probes those of them it holds,
  packed (a rank holding none feeds one padding segment);
- rollout/train drift: the routes the engine used when generating vs the trainer's forward of the
  same tokens with the same weights (numerical mismatch between the two stacks);
- expert load of the probed tokens;
- ratio noise (the mechanism behind GRPO's noisy token ratios on MoE models): the probed response
  tokens' |log ratio| after the first update, by whether (and in how many layers) their routes
  changed; the log-probs come from the same passes as the routes.

Under R2 / R3 the training forwards replay routes, so the natural routes come from extra
forward-only passes of one micro-batch (a small fraction of a step's compute).
"""

from __future__ import annotations

import math
import os

import torch

from megatron_gspo.batch.layout import Layout
from megatron_gspo.batch.micro_batch import micro_batch, route_targets, router_view
from megatron_gspo.batch.packing import minibatch_rows
from megatron_gspo.batch.rollout_batch import width_multiple
from megatron_gspo.distributed import comm
from megatron_gspo.trainer.passes import logprob_pass
from moe.drift import changed_layers, ratio_noise_metrics, ratio_noise_sums
from moe.instrument import (DriftLog, drift_between, expert_load, local_layers_of,
                            num_moe_layers)
from moe.report import summary_line, write_report


class DriftProbe:
    """Measures expert drift on the probed rows of every step (the module's docstring), through
    forwards of ``model`` (the trainer's DDP-wrapped policy) whose routes ``replay`` records."""

    def __init__(self, job, ctx, run_dir: str, writer, *, model, replay, pad_id: int):
        self.job, self.ctx, self.run_dir = job, ctx, os.path.abspath(run_dir)
        self.model, self.replay, self.pad_id = model, replay, pad_id
        self.layers = local_layers_of(job.model, ctx)
        self.num_layers = num_moe_layers(job.model)
        self.log = DriftLog(run_dir, writer, enabled=ctx.rank == 0)
        self._before = None
        self._counted = True  # whether this rank's probed tokens count (set per step)

    def _natural(self, mbs):
        """Log-probs ([rows, S] or packed [1, N], on the host) and routes of one forward."""
        logp, routes = logprob_pass(self.model, mbs, self.ctx,
                                    temperature=self.job.rollout.temperature, replay=self.replay,
                                    record=True)
        return logp[0], routes

    def _between(self, a, b) -> dict:
        return drift_between(a, b, local_layers=self.layers, num_moe_layers=self.num_layers,
                             pp_group=self.ctx.pp_group, device=self.ctx.device,
                             counted=self._counted)

    def _probe(self, batch) -> Layout:
        """The probed rows' micro-batch layout on this rank (see the module's docstring)."""
        size, k = self.job.trainer.micro_batch_size, self.job.algo.minibatches
        group_size = self.job.rollout.group_size if self.job.algo.minibatch_split == "groups" else 0
        # the first ``size`` rows of a rank's first mini-batch (rows past the batch: none)
        first = [j for j in minibatch_rows(size * k * max(group_size, 1), k, group_size)[0][:size]
                 if j < batch.rows or batch.layouts is not None]
        if batch.layouts is None:  # padded: rank 0's first micro-batch, counted there only
            self._counted = self.ctx.dp_rank == 0
            return Layout(tuple(first))
        self._counted = True
        probed = {(0, j) for j in first}
        rows = [i for i, origin in enumerate(batch.origin) if origin in probed]
        shape = dict(seq_multiple=2 * self.ctx.cp if self.ctx.cp > 1 else 1,
                     row_multiple=width_multiple(self.ctx))
        layout = Layout.packed_rows(rows, [int(batch.lengths_B[i]) for i in rows], **shape)
        # one length on every data-parallel rank (expert parallelism exchanges equal counts)
        longest = comm.reduce_max_int(int(layout.cu_seqlens[-1]), device=self.ctx.device,
                                      group=self.ctx.dp_group)
        return Layout.packed_rows(rows, [int(batch.lengths_B[i]) for i in rows], length=longest,
                                  **shape)

    def reads_old_pass(self, batch) -> bool:
        """Whether the probe takes the old-policy pass's first forward (padded rows, natural
        routes: its rows are the probed ones) rather than a forward of its own."""
        return batch.layouts is None and self.job.replay.mode in ("none", "r2")

    def before_updates(self, batch, routes, step: int, reads_pass: bool) -> dict:
        """Routes of the probed rows on the old policy; rollout/train drift and load. Padding
        positions are left out of every measure. ``reads_pass``: the behaviour pass's first
        forward (whose routes ``routes`` starts with) fed the probed rows."""
        layout = self._probe(batch)
        self._mbs = [micro_batch(batch, layout, self.pad_id)]
        if routes and reads_pass:
            before, self._logp = routes[:1], layout.gather(batch.trainer_logp_BS)
        else:
            self._logp, before = self._natural(self._mbs)
        valid = layout.valid(batch.lengths_B, batch.width)
        view = (lambda x: router_view(x[:, :, None, None], [0], self.ctx, layout=layout)[0][:, 0])
        self._valid = view(valid.long()).bool()
        # the position (in the micro-batch) of each token this rank's routers see
        self._pos = view(torch.arange(valid.numel()).reshape(valid.shape))[self._valid]
        before = _keep(before, self._valid, self.ctx.device)
        self._before = before
        out = {}
        load = expert_load(before, local_layers=self.layers, num_moe_layers=self.num_layers,
                           num_experts=self.job.model.num_experts, device=self.ctx.device,
                           counted=self._counted)
        self.log.load(step, load)
        out["moe/load/max_share"] = float(load["share"].max())
        if batch.routes is not None:
            engine = _keep([route_targets(batch, layout, layers=self.layers, ctx=self.ctx)],
                           self._valid, self.ctx.device)
            m = self._between(engine, before)
            self.log.drift(step, "rollout_train", m)
            out["moe/drift/rollout_train/mean"] = float(m["changed_fraction"])
            out["moe/drift/rollout_train/tokens_changed"] = float(m["tokens_changed"])
        return out

    def after_first_update(self, step: int) -> dict:
        logp, routes = self._natural(self._mbs)
        after = _keep(routes, self._valid, self.ctx.device)
        m = self._between(self._before, after)
        self.log.drift(step, "update", m)
        noise = self._ratio_noise(logp, after)
        self.log.ratio_noise(step, noise)
        return {"moe/drift/update/mean": float(m["changed_fraction"]),
                "moe/drift/update/jaccard_mean": float(m["jaccard"]),
                "moe/drift/update/tokens_changed": float(m["tokens_changed"]),
                # undefined on a step where no probed route changed (or none stayed): left out
                **{f"moe/drift/ratio_noise/{k}": float(noise[k])
                   for k in ("changed", "unchanged", "quotient", "changed_tokens")
                   if not math.isnan(float(noise[k]))}}

    def _ratio_noise(self, logp_after, after) -> dict:
        """|log ratio| of the probed response tokens (new policy over old) by how many MoE layers
        changed their routes: the layers' counts completed over the stages (each holds its
        layers) and over the tensor- and context-parallel ranks (each holds some tokens), then
        the sums over the data-parallel ranks."""
        ctx, device = self.ctx, self.ctx.device
        mb = self._mbs[0]
        counts = torch.zeros(mb.tokens_BS.numel(), dtype=torch.int64, device=device)
        counts[self._pos.to(device)] = changed_layers(self._before[0], after[0])
        comm.reduce_tensor(counts, group=ctx.tp_group, op="max")
        comm.reduce_tensor(counts, group=ctx.cp_group, op="max")
        comm.reduce_tensor(counts, group=ctx.pp_group)
        response = (mb.loss_mask_BS > 0).reshape(-1).to(device)
        abs_lr = (logp_after - self._logp).abs().reshape(-1).to(device)
        sums = ratio_noise_sums(abs_lr[response], counts[response], self.num_layers)
        sums = comm.reduce_tensor(sums * (1.0 if self._counted else 0.0), group=ctx.dp_group)
        return {k: v.cpu() for k, v in ratio_noise_metrics(sums).items()}

    def close(self, ctx) -> None:
        if ctx.rank != 0:
            return
        path = os.path.join(self.run_dir, "drift_report.html")
        for s in write_report([self.run_dir], path):
            print(summary_line(s))
        print(f"drift report: {path}")


def _keep(routes: list, valid_N, device) -> list:
    """The routes of one forward (per local layer [N, K]) restricted to the valid tokens, on the
    run's device."""
    return [[layer.to(device)[valid_N.to(device)] for layer in forward] for forward in routes]
