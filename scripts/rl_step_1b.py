"""One GSPO RL step of a ~1B-parameter MoE (0.31B active) on one GPU, with the local engine:

    python scripts/rl_step_1b.py [--prompts 8] [--group 4] [--response 512] [--micro-batch 4]

Random weights (seeded), the built-in task's prompts; responses run to ``--response`` tokens
(an untrained model rarely stops early). Prints the time of each phase, and tokens/s and model
TFLOP/s of the update phase (forward + backward of every update: 6 x active parameters x fed
tokens, plus causal attention).
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import os
import shutil
import sys
import tempfile
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import torch  # noqa: E402

from gpu_check import MODEL_1B, param_counts  # noqa: E402
from megatron_gspo.config import ModelConfig  # noqa: E402
from megatron_gspo.config.load import job_from_dict  # noqa: E402
from megatron_gspo.trainer.batching import make_batch  # noqa: E402
from megatron_gspo.trainer.behaviour import behaviour_logprobs, step_plan  # noqa: E402
from megatron_gspo.trainer.generation import sample_batch  # noqa: E402
from megatron_gspo.trainer.run import Timers  # noqa: E402
from megatron_gspo.trainer.setup import build_rl_optimizer, setup  # noqa: E402
from megatron_gspo.trainer.updates import update  # noqa: E402
from megatron_gspo.trainer.warmup import init_weights  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--response", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--minibatches", type=int, default=2)
    p.add_argument("--model", choices=("1b", "tiny"), default="1b")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("rl_step_1b: no CUDA device")
    scratch = tempfile.mkdtemp(prefix="rl_step_1b_")  # the run directory, removed at exit
    atexit.register(shutil.rmtree, scratch, True)
    m = MODEL_1B if args.model == "1b" else ModelConfig(vocab_size=128)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    job = job_from_dict({
        "model": dataclasses.asdict(m), "parallel": {"device": args.device},
        "algo": {"name": "gspo", "minibatches": args.minibatches},
        "rollout": {"prompts_per_step": args.prompts, "group_size": args.group,
                    "max_new_tokens": args.response},
        "data": {"task": "reverse", "train_size": 256, "eval_size": 0},
        "trainer": {"steps": 1, "sft_steps": 0, "micro_batch_size": args.micro_batch,
                    "lr": 1e-6, "save_interval": 0},
        "logging": {"drift": False, "tensorboard": False, "progress": False},
        "run_dir": scratch, "seed": 1})
    run = setup(job)
    init_weights(run.policy.gpt, job, run.ctx, "")
    build_rl_optimizer(job, run.policy, run.ctx)
    total, active = param_counts(m)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"device {name}; {total / 1e9:.2f} B parameters, "
          f"{active / 1e9:.2f} B active; {args.prompts} prompts x {args.group} responses of up "
          f"to {args.response} tokens; {m.params_dtype}")
    timers = Timers()

    def timed(name, fn, *a):
        sync()
        with timers(name):
            out = fn(*a)
            sync()
        return out

    sync()
    samples, rewards, _ = sample_batch(run, 1, timers)  # the rollout and reward phases
    batch, _ = make_batch(job, run.ctx, samples, rewards, pad_id=run.prompts.tokenizer.pad_id)
    plan = step_plan(run, batch)
    routes = timed("old_logprobs", behaviour_logprobs, run, batch, plan)
    results, _ = timed("update", update, run, batch, plan, routes)
    fed = int(batch.lengths_B.sum())
    width = batch.width
    attn = 6 * m.num_layers * m.num_attention_heads * m.head_dim * width * fed // 2  # causal
    flops = 6 * active * fed + attn
    t = timers.seconds
    generated = sum(len(s.response_ids) for s in samples)
    print("phases: " + ", ".join(f"{k} {v:.2f} s" for k, v in t.items()))
    print(f"rollout: {generated} tokens generated, {generated / t['rollout']:,.0f} tokens/s")
    print(f"update: {len(results)} updates over {fed} fed tokens (rows of {width}): "
          f"{fed / t['update']:,.0f} tokens/s, {flops / t['update'] / 1e12:.1f} model TFLOP/s, "
          f"grad norm {results[0].grad_norm:.3f}" + (
              f"; peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if cuda else ""))
    run.signals.uninstall()
    run.logger.close()


if __name__ == "__main__":
    main()
