"""The model smoke job behind ``python -m megatron_gspo``: build the configured Qwen3-MoE on the
configured layout, train it for a few steps on a deterministic counting task, save its weights."""

from __future__ import annotations

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
    gpt = build_model(job.model, ctx)
    m = job.model
    say(f"model {m.name}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_experts} experts "
        f"top-{m.top_k}, vocab {m.vocab_size}; {count_parameters(gpt):,} parameters on rank 0")
    ddp, optimizer = wrap_and_build_optimizer(gpt, ctx, OptimConfig(lr=job.demo.lr))

    def loss_fn(mb, logits):
        logp, ent = token_logprobs(logits, mb.targets_BS, group=ctx.tp_group, with_entropy=True)
        return -logp.mean(), {"nll": -logp.detach().mean(), "entropy": ent.detach().mean()}

    d = job.demo
    history = []
    for step in range(d.steps):
        # Every data-parallel replica draws its own slice of the global batch.
        tokens = counting_batch(d.batch_size, d.seq_length, m.vocab_size,
                                seed=job.seed + 1000 * step + ctx.dp_rank)
        ts = time.perf_counter()
        zero_grads(ddp, optimizer)
        out = forward_backward(ddp, [MicroBatch(tokens[:, :-1], tokens[:, 1:])], ctx, loss_fn)
        ok, grad_norm, _ = optimizer.step()
        dt = time.perf_counter() - ts
        if out:
            nll = float(torch.stack([o["nll"] for o in out]).mean())
            ent = float(torch.stack([o["entropy"] for o in out]).mean())
            history.append(nll)
            if ctx.tp_rank == 0 and ctx.dp_rank == 0 and ctx.is_last_stage:
                print(f"step {step + 1}/{d.steps}  nll {nll:.4f}  entropy {ent:.3f}  "
                      f"grad_norm {grad_norm:.3f}  {d.batch_size * d.seq_length / dt:,.0f} tokens/s "
                      f"per replica", flush=True)
    weights_dir = os.path.join(os.path.abspath(job.run_dir), "weights")
    save_weights(gpt, weights_dir, m)
    say(f"weights saved to {weights_dir} (loads into any layout)")
    say(f"done in {time.perf_counter() - t0:.1f} s")
    return {"nll": history}
