"""The update phase of one RL step, packed vs padded, on a batch with long-tailed response lengths.

    python benchmarks/packing.py [--repeats 5] [--budget 2048] [--micro-batch 8]

16 prompts x 8 responses (the same batch in both modes): prompts of 8-16 tokens, response lengths
lognormal (median 24 tokens) capped at 256, as RL on reasoning gives (most short, a few at the
limit). The tiny MoE on one rank, GSPO with 4 mini-batches; padded: micro-batches of
``--micro-batch`` rows padded to the widest row; packed: micro-batches of at most ``--budget``
tokens. Times the old-policy log-prob pass and the 4 updates (median of ``--repeats`` after one
warm-up) and prints trained (real, not padding) tokens per second of the update phase.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megatron_gspo.config.load import job_from_dict  # noqa: E402
from megatron_gspo.distributed.parallel import destroy_parallel  # noqa: E402
from megatron_gspo.trainer.batching import make_batch  # noqa: E402
from megatron_gspo.trainer.behaviour import behaviour_logprobs, step_plan  # noqa: E402
from megatron_gspo.trainer.setup import build_rl_optimizer, setup  # noqa: E402
from megatron_gspo.trainer.updates import update  # noqa: E402
from megatron_gspo.trainer.warmup import init_weights  # noqa: E402
from megatron_gspo.rollout.types import Sample  # noqa: E402

PROMPTS, GROUP, CAP = 16, 8, 256


def long_tailed_batch(vocab: int, seed: int = 0):
    """The step's samples and rewards: random tokens, long-tailed lengths, rewards in {0, 1}."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(PROMPTS * GROUP):
        p = int(torch.randint(8, 17, (), generator=g))
        r = int(min(CAP, max(1, torch.empty(()).log_normal_(3.2, 0.9, generator=g))))
        ids = torch.randint(3, vocab, (p + r,), generator=g).tolist()
        samples.append(Sample(prompt_ids=ids[:p], response_ids=ids[p:],
                              logprobs_R=-torch.rand(r, generator=g),
                              finish_reason="length" if r == CAP else "stop",
                              prompt_index=i // GROUP))
    return samples, (torch.rand(len(samples), generator=g) < 0.5).float()


def scratch_dir(prefix: str) -> str:
    """A run directory removed when the benchmark exits."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, True)
    return path


def measure(packing: bool, args) -> dict:
    job = job_from_dict({
        "rollout": {"prompts_per_step": PROMPTS, "group_size": GROUP, "max_new_tokens": CAP},
        # the trainer's old-policy pass (timed below): these responses' log-probs are random
        "algo": {"name": "gspo", "minibatches": 4, "old_logprobs": "recompute"},
        "trainer": {"steps": 1, "sft_steps": 0, "micro_batch_size": args.micro_batch,
                    "packing": packing, "max_tokens_per_micro_batch": args.budget,
                    "save_interval": 0},
        "data": {"eval_size": 0},
        "logging": {"drift": False, "tensorboard": False, "progress": False},
        "run_dir": scratch_dir("bench_packing_"), "seed": 1})
    run = setup(job)
    try:
        init_weights(run.policy.gpt, job, run.ctx, "")
        build_rl_optimizer(job, run.policy, run.ctx)
        samples, rewards = long_tailed_batch(job.model.vocab_size)
        old, upd = [], []
        for i in range(args.repeats + 1):
            batch, _ = make_batch(job, run.ctx, samples, rewards,
                                  pad_id=run.prompts.tokenizer.pad_id)
            plan = step_plan(run, batch)
            t0 = time.perf_counter()
            routes = behaviour_logprobs(run, batch, plan)
            t1 = time.perf_counter()
            update(run, batch, plan, routes)
            t2 = time.perf_counter()
            if i:  # the first is a warm-up
                old.append(t1 - t0)
                upd.append(t2 - t1)
        fed = sum(len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples)
        micro = (sum(len(k) for k in batch.layouts) if batch.layouts
                 else PROMPTS * GROUP // args.micro_batch)
        computed = (sum(int(x.cu_seqlens[-1]) for k in batch.layouts for x in k) if batch.layouts
                    else batch.rows * batch.width)
        return {"old": statistics.median(old), "update": statistics.median(upd), "fed": fed,
                "computed": computed, "micro": micro}
    finally:
        run.signals.uninstall()
        run.prompts.scorer.close()
        run.logger.close()
        destroy_parallel(keep_process_group=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=8)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(os.cpu_count() or 1)
    padded, packed = measure(False, args), measure(True, args)
    lengths = [len(s.response_ids) for s in long_tailed_batch(128)[0]]
    print(f"tiny MoE, 1 rank, CPU; {PROMPTS} prompts x {GROUP} responses, response lengths "
          f"median {statistics.median(lengths):.0f}, mean {statistics.mean(lengths):.1f}, max "
          f"{max(lengths)} (cap {CAP}); GSPO, 4 mini-batches; median of {args.repeats}")
    print(f"{'mode':8s} {'micro-batches':>13s} {'tokens fed':>10s} {'computed':>9s} "
          f"{'old logp s':>10s} {'update s':>9s} {'update tokens/s':>15s}")
    for name, m in (("padded", padded), ("packed", packed)):
        print(f"{name:8s} {m['micro']:13d} {m['fed']:10d} {m['computed']:9d} {m['old']:10.3f} "
              f"{m['update']:9.3f} {m['fed'] / m['update']:15,.0f}")
    print(f"old-policy pass: packed {padded['old'] / packed['old']:.2f}x faster")
    print(f"packed vs padded: {padded['update'] / packed['update']:.2f}x tokens/s")


if __name__ == "__main__":
    main()
