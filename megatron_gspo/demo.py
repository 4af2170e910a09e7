"""The model smoke job behind ``python -m megatron_gspo``: build the configured Qwen3-MoE on the
configured layout, train it on a deterministic counting task (several optimizer steps per batch),
log expert drift between those steps, save the weights and write the drift report."""

from __future__ import annotations

import contextlib
import os
import time

import torch

from megatron_gspo.config import JobConfig


def counting_batch(batch: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    """[batch, seq + 1] sequences start, start+1, ... (mod vocab): learnable, deterministic."""
    start = torch.randint(0, vocab, (batch, 1), generator=torch.Generator().manual_seed(seed))
    return (start + torch.arange(seq + 1)) % vocab


def run(job: JobConfig) -> dict:
    from megatron_gspo import cpu_backend
    from megatron_gspo.forward import MicroBatch, forward_backward
    from megatron_gspo.logprobs import token_logprobs
    from megatron_gspo.model import build_model, count_parameters
    from megatron_gspo.optim import OptimConfig, wrap_and_build_optimizer, zero_grads
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.weights import save_weights

    t0 = time.perf_counter()
    ctx = init_parallel(job.parallel, job.model, seed=job.seed)
    say = print if ctx.rank == 0 else (lambda *a, **k: None)
    say(f"layout: {ctx.describe()}")
    adaptations = cpu_backend.activate(ctx.device)
    say(f"cpu adaptations in force: {len(adaptations)}" if adaptations else "no cpu adaptations")
    m, d = job.model, job.demo
    instrument = d.drift and m.is_moe
    gpt = build_model(m, ctx, moe_enable_routing_replay=instrument)
    say(f"model {m.name}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_experts} experts "
        f"top-{m.top_k}, vocab {m.vocab_size}; {count_parameters(gpt):,} parameters on rank 0")
    ddp, optimizer = wrap_and_build_optimizer(gpt, ctx, OptimConfig(lr=d.lr))
    run_dir = os.path.abspath(job.run_dir)
    drift = _DriftInstrument(gpt, m, ctx, run_dir) if instrument else None

    def loss_fn(mb, logits):
        logp, ent = token_logprobs(logits, mb.targets_BS, group=ctx.tp_group, with_entropy=True)
        return -logp.mean(), {"nll": -logp.detach().mean(), "entropy": ent.detach().mean()}

    history = []
    for step in range(d.steps):
        # Every data-parallel replica draws its own slice of the global batch.
        tokens = counting_batch(d.batch_size, d.seq_length, m.vocab_size,
                                seed=job.seed + 1000 * step + ctx.dp_rank)
        batch = [MicroBatch(tokens[:, :-1], tokens[:, 1:])]
        ts = time.perf_counter()
        routes, out = [], []
        for _ in range(d.updates_per_batch):
            zero_grads(ddp, optimizer)
            with (drift.replay.record() if drift else contextlib.nullcontext()) as recorded:
                out = forward_backward(ddp, batch, ctx, loss_fn)
            ok, grad_norm, _ = optimizer.step()
            if drift:
                routes.append(recorded.forwards)
        note = drift.log(step + 1, routes) if drift else ""
        dt = time.perf_counter() - ts
        if out:
            nll = float(torch.stack([o["nll"] for o in out]).mean())
            ent = float(torch.stack([o["entropy"] for o in out]).mean())
            history.append(nll)
            if ctx.tp_rank == 0 and ctx.dp_rank == 0 and ctx.is_last_stage:
                tokens_per_s = d.updates_per_batch * d.batch_size * d.seq_length / dt
                print(f"step {step + 1}/{d.steps}  nll {nll:.4f}  entropy {ent:.3f}  "
                      f"grad_norm {grad_norm:.3f}{note}  {tokens_per_s:,.0f} tokens/s per replica",
                      flush=True)
    weights_dir = os.path.join(run_dir, "weights")
    save_weights(gpt, weights_dir, m)
    say(f"weights saved to {weights_dir} (loads into any layout)")
    if drift:
        drift.close()
    say(f"done in {time.perf_counter() - t0:.1f} s")
    return {"nll": history}


class _DriftInstrument:
    """Routes of the updates on each batch -> update drift and expert load, logged and reported."""

    def __init__(self, gpt, model_cfg, ctx, run_dir):
        from moe.instrument import DriftLog, local_layers_of, maybe_writer, num_moe_layers
        from moe.replay import RoutingReplay

        self.replay = RoutingReplay(gpt)
        self.ctx, self.run_dir, self.num_experts = ctx, run_dir, model_cfg.num_experts
        self.layers = local_layers_of(model_cfg, ctx)
        self.num_layers = num_moe_layers(model_cfg)
        self.writer = maybe_writer(run_dir, ctx.rank)
        self.drift_log = DriftLog(run_dir, self.writer, enabled=ctx.rank == 0)

    def log(self, step: int, routes: list) -> str:
        from moe.instrument import drift_between, expert_load

        load = expert_load(routes[0], local_layers=self.layers, num_moe_layers=self.num_layers,
                           num_experts=self.num_experts)
        self.drift_log.load(step, load)
        if len(routes) < 2:
            return ""
        metrics = drift_between(routes[0], routes[1], local_layers=self.layers,
                                num_moe_layers=self.num_layers, pp_group=self.ctx.pp_group)
        self.drift_log.drift(step, "update", metrics)
        return (f"  routes changed {float(metrics['changed_fraction']):.3f} "
                f"(tokens {float(metrics['tokens_changed']):.3f})")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.ctx.rank == 0:
            from moe.report import summary_line, write_report

            path = os.path.join(self.run_dir, "drift_report.html")
            for s in write_report([self.run_dir], path):
                print(summary_line(s))
            print(f"drift report: {path}")
