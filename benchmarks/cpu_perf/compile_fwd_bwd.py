"""What compiling buys: one micro-batch's forward + backward, eager and under ``torch.compile``,
ours against transformers' Qwen3-MoE with the same weights.

The update phase of an RL step is mostly the model's forward + backward over packed micro-batches
(``profile_rl_step.py``), and what is left between it and the machine's matmul rate is thousands
of small operators. A compiler that fuses them is the obvious lever, so this script measures it on
the same micro-batch for four paths:

- ours: the trainer's model (megatron-core GPTModel in Megatron's DDP, as ``trainer.setup``
  builds it), eager;
- ours compiled: the same with each ``TransformerLayer.forward`` under ``torch.compile``
  (inductor);
- hf: transformers' ``Qwen3MoeForCausalLM`` with our weights (``hf_qwen3moe.export_hf``),
  eager (SDPA attention, its default experts);
- hf compiled: the same model under ``torch.compile``.

The input is fixed (``--rows`` x ``--seq`` tokens, unpacked) and no weight changes between
repeats, so the routes stay the same and a compiled path never recompiles: the best case for the
compiler. The loss is the mean log-prob of the next tokens; every path's loss must equal ours
within 1e-4 (relative), and each path's time is the median of ``--repeats`` after two warm-up
calls. The first call's time is printed apart (for a compiled path, the compile: shorter when
inductor's on-disk cache already holds the graphs). Model FLOP/s: 6 x active parameters x tokens,
also as a share of the machine's fp32 matmul rate. Ratios are against ours, eager.

    python benchmarks/compile_fwd_bwd.py --shape compute
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

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from profile_rl_step import job_dict  # noqa: E402
from rl_step_vs_trl import SHAPE_FIELDS, SHAPES, VOCAB, active_params, matmul_gflops  # noqa: E402

PATHS = ("ours", "ours compiled", "hf", "hf compiled")


def mean_logp(logits_BSV, targets_BS):
    """Mean log-prob of the targets (fp32): the loss every path runs."""
    logp = logits_BSV.float().log_softmax(-1)
    return logp.gather(-1, targets_BS.unsqueeze(-1)).mean()


def time_path(fn, repeats: int) -> tuple:
    """(first call's seconds, median seconds of ``repeats`` after two warm-up calls, loss)."""
    t0 = time.perf_counter()
    loss = fn()
    first = time.perf_counter() - t0
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times), loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=sorted(SHAPES), default="compute")
    for field in SHAPE_FIELDS:
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=None)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--seq", type=int, default=32, help="tokens per row")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    args = p.parse_args()
    for field, value in SHAPES[args.shape].items():
        if getattr(args, field, None) is None:
            setattr(args, field, value)

    import logging
    import warnings

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=UserWarning)
    from megatron_gspo.config.load import job_from_dict
    from megatron_gspo.models.hf_mapping import export_hf
    from megatron_gspo.trainer.setup import setup

    args.prompts, args.group_size, args.minibatches = 16, 8, 4
    args.micro_batch_size, args.steps = args.rows, 1
    run_dir = tempfile.mkdtemp(prefix="compile_")  # removed at exit
    atexit.register(shutil.rmtree, run_dir, True)
    run = setup(job_from_dict(job_dict(args, run_dir)))
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(3, VOCAB, (args.rows, args.seq + 1), generator=g)
    ids, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(args.seq).expand(args.rows, args.seq)

    def ours():
        run.policy.ddp.zero_grad_buffer()
        loss = mean_logp(run.policy.ddp(ids, positions, attention_mask=None), targets)
        loss.backward()
        return loss.item()

    with tempfile.TemporaryDirectory(prefix="compile_hf_") as hf_dir:  # (loaded, then removed)
        export_hf(run.policy.gpt, run.job.model, run.ctx, hf_dir)  # our weights, HF's layout
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    hf_model = [hf]

    def hf_step():
        hf_model[0].zero_grad(set_to_none=True)
        loss = mean_logp(hf_model[0](input_ids=ids).logits, targets)
        loss.backward()
        return loss.item()

    def compile_ours():
        for m in run.policy.gpt.modules():
            if type(m).__name__ == "TransformerLayer":
                m.forward = torch.compile(m.forward)

    def compile_hf():
        hf_model[0] = torch.compile(hf)

    steps = {"ours": (None, ours), "ours compiled": (compile_ours, ours),
             "hf": (None, hf_step), "hf compiled": (compile_hf, hf_step)}
    flops = 6 * active_params(args) * args.rows * args.seq
    print(f"one micro-batch of {args.rows} x {args.seq} tokens, forward + backward, shape "
          f"{args.shape} ({active_params(args) / 1e6:.2f}M active parameters), {args.threads} "
          f"threads, median of {args.repeats}")
    peak = matmul_gflops(args.threads)
    print(f"fp32 matmul on this machine: {peak:.0f} GFLOP/s")
    print(f"{'path':14s} {'first call s':>13s} {'s':>8s} {'GFLOP/s':>8s} {'share':>6s} "
          f"{'x ours':>7s}  loss")
    base = None
    reference = None
    # in PATHS' order, whatever --paths says: compiling ours changes ours' modules for good
    for name in (n for n in PATHS if n in args.paths):
        prepare, fn = steps[name]
        if prepare is not None:
            prepare()
        first, median, loss = time_path(fn, args.repeats)
        reference = loss if reference is None else reference
        if abs(loss - reference) > 1e-4 * abs(reference):
            raise SystemExit(f"{name}: loss {loss:.6f} differs from {reference:.6f}")
        base = median if name == "ours" else base
        ratio = f"{base / median:7.2f}" if base else f"{'':7s}"
        rate = flops / median / 1e9
        print(f"{name:14s} {first:13.2f} {median:8.3f} {rate:8.1f} {rate / peak:6.0%} {ratio}  "
              f"{loss:.6f}")
    run.logger.close()


if __name__ == "__main__":
    main()
