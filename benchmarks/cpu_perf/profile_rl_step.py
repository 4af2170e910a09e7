"""Where one GSPO RL step spends its time, per phase and per module (torch profiler, CPU).

Runs our trainer in this process (one rank, the shapes of ``rl_step_vs_trl.py``), drops a warm-up
step, then profiles ``--steps`` RL steps. Each phase (rollout, old log-probs, update, ...) is a
profiler range of the trainer's own timers; module forward hooks open a range per module kind:

- attention (``SelfAttention``: QKV, q/k norms, RoPE, SDPA, output projection),
- router (``TopKRouter``), dispatch (the token dispatcher's permute / unpermute steps),
- experts (the expert MLPs), embedding, output layer, layer rest (norms, residual adds),
- loss (log-probs and the policy loss), optimizer (the optimizer's step, gradient clipping),
  grad sync (DDP's gradient reduction and zeroing).

Forward time of a kind: the operators run under its ranges. Backward time: the autograd nodes whose
forward operator ran under its ranges (matched by the profiler's sequence numbers). Operators under
no range count as "other ops" (sampling, batch building, host copies). What remains of a phase's
wall time outside any operator is Python and framework overhead. The profiler itself adds a few
microseconds per operator, so the overhead line is an upper bound; the unprofiled phase times of the
same steps are printed next to it.

    python benchmarks/profile_rl_step.py --shape tiny
    python benchmarks/profile_rl_step.py --shape compute --steps 2
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from rl_step_vs_trl import SHAPE_FIELDS, SHAPES, VOCAB, active_params, model_fields  # noqa: E402

KINDS = ("attention", "router", "dispatch", "experts", "embedding", "output layer", "layer rest",
         "loss", "optimizer", "grad sync", "other ops")
PHASES = ("rollout", "reward", "old_logprobs", "update", "weight_sync")


def job_dict(args, run_dir: str) -> dict:
    return {
        "model": {"vocab_size": VOCAB, **model_fields(args)},
        "rollout": {"prompts_per_step": args.prompts, "group_size": args.group_size,
                    "max_new_tokens": args.max_new_tokens},
        "algo": {"minibatches": args.minibatches},
        "data": {"task": "reverse", "eval_size": 0},
        "trainer": {"steps": args.steps + 1, "sft_steps": 0, "save_interval": 0,
                    "eval_interval": 0, "micro_batch_size": args.micro_batch_size},
        "logging": {"progress": False, "drift": False, "tensorboard": False},
        "seed": args.seed, "run_dir": run_dir,
    }


class Ranges:
    """Profiler ranges opened and closed by module hooks and method wrappers."""

    def __init__(self):
        import torch

        self.rf = torch.profiler.record_function
        self.open = []

    def enter(self, kind):
        r = self.rf(f"module:{kind}")
        r.__enter__()
        self.open.append(r)

    def exit(self):
        self.open.pop().__exit__(None, None, None)

    def hook_module(self, module, kind):
        module.register_forward_pre_hook(lambda *_: self.enter(kind))
        module.register_forward_hook(lambda *_: self.exit())

    def wrap(self, obj, name, kind):
        method = getattr(obj, name)

        @functools.wraps(method)
        def wrapped(*a, **kw):
            self.enter(kind)
            try:
                return method(*a, **kw)
            finally:
                self.exit()
        setattr(obj, name, wrapped)


def instrument(run) -> None:
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding)
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_layer import TransformerLayer

    ranges = Ranges()
    for module in run.policy.gpt.modules():
        if isinstance(module, SelfAttention):
            ranges.hook_module(module, "attention")
        elif isinstance(module, TopKRouter):
            ranges.hook_module(module, "router")
        elif isinstance(module, LanguageModelEmbedding):
            ranges.hook_module(module, "embedding")
        elif isinstance(module, TransformerLayer):
            ranges.hook_module(module, "layer rest")
        elif isinstance(module, MoELayer):
            ranges.hook_module(module.experts, "experts")
            for name in ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess",
                         "combine_preprocess", "token_combine", "combine_postprocess"):
                ranges.wrap(module.token_dispatcher, name, "dispatch")
    ranges.hook_module(run.policy.gpt.output_layer, "output layer")
    ranges.wrap(run.policy.optimizer, "step", "optimizer")
    for name in ("zero_grad_buffer", "finish_grad_sync", "start_grad_sync"):
        if hasattr(run.policy.ddp, name):
            ranges.wrap(run.policy.ddp, name, "grad sync")
    # The policy loss (log-probs of the targets and the objective) is a range of forward.py.


def nearest_range(e, prefix="module:"):
    """The kind of the innermost ``prefix`` range around event ``e`` (None outside any)."""
    p = e.cpu_parent
    while p is not None and not p.name.startswith(prefix):
        p = p.cpu_parent
    return p.name[len(prefix):] if p is not None else None


def forward_kinds(events) -> dict:
    """Autograd sequence number -> the module kind its forward operator ran under, by which
    the backward operators of that node are attributed."""
    kinds = {}
    for e in events:
        if e.sequence_nr >= 0 and not e.name.startswith("autograd::engine"):
            kinds.setdefault(e.sequence_nr, nearest_range(e) or "other ops")
    return kinds


def attribute(events) -> tuple[dict, dict, dict]:
    """(kind -> phase -> seconds of operators, phase -> seconds of its ranges, phase -> seconds
    of operators): forward operators by their nearest module range, autograd nodes by the range
    their forward operator ran under."""
    def is_range(e):
        return e.name.startswith(("module:", "phase:"))

    seq_kind = forward_kinds(events)
    ops = collections.defaultdict(lambda: collections.defaultdict(float))
    phase_wall, phase_ops = collections.defaultdict(float), collections.defaultdict(float)
    for e in events:
        if e.name.startswith("phase:"):
            phase_wall[e.name[6:]] += e.cpu_time_total / 1e6
            continue
        if is_range(e) or (e.cpu_parent is not None and not is_range(e.cpu_parent)):
            continue  # only outermost operators (directly under a range, or under none)
        phase = nearest_range(e, "phase:") or "outside phases"
        if e.name.startswith("autograd::engine::evaluate_function"):
            kind = seq_kind.get(e.sequence_nr, "other ops")
            if "AccumulateGrad" in e.name:
                kind = "grad sync"
        else:
            kind = nearest_range(e, "module:") or "other ops"
        ops[kind][phase] += e.cpu_time_total / 1e6
        phase_ops[phase] += e.cpu_time_total / 1e6
    return ops, phase_wall, phase_ops


def add_run_args(p: argparse.ArgumentParser, *, shape: str, steps: int, steps_help: str) -> None:
    """The options of one in-process trainer run (``job_dict``): shape, steps, batch, threads."""
    p.add_argument("--shape", choices=sorted(SHAPES), default=shape)
    for field in SHAPE_FIELDS:
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=None)
    p.add_argument("--steps", type=int, default=steps, help=steps_help)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--minibatches", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)


def fill_shape(args) -> None:
    """The chosen shape's fields where no option set them."""
    for field, value in SHAPES[args.shape].items():
        if getattr(args, field) is None:
            setattr(args, field, value)


def start_run(args, prefix: str):
    """Our trainer in this process on ``args``' shape and threads (``job_dict``), Megatron's
    logging and warnings quieted, warmed up (no RL step taken yet)."""
    import logging
    import warnings

    import torch

    torch.set_num_threads(args.threads)
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=UserWarning)
    from megatron_gspo.config.load import job_from_dict
    from megatron_gspo.trainer.setup import setup
    from megatron_gspo.trainer.warmup import warm_up

    run = setup(job_from_dict(job_dict(args, tempfile.mkdtemp(prefix=prefix))))
    warm_up(run)
    return run


def main() -> None:
    p = argparse.ArgumentParser()
    add_run_args(p, shape="tiny", steps=3, steps_help="profiled RL steps (after one warm-up)")
    p.add_argument("--top", type=int, default=12, help="also list the N costliest operators")
    p.add_argument("--detail", default=None, choices=KINDS,
                   help="also list the operators run under one kind of module")
    p.add_argument("--detail-phase", default=None, choices=PHASES,
                   help="with --detail: only in this phase")
    args = p.parse_args()
    fill_shape(args)

    from torch.profiler import ProfilerActivity, profile

    from megatron_gspo.trainer import loop as trainer

    run = start_run(args, "profile_")
    trainer.rl_step(run, 1)  # warm-up
    instrument(run)
    plain = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(2, args.steps + 2):
            t0 = time.perf_counter()
            m = trainer.rl_step(run, step)
            plain.append((time.perf_counter() - t0, m))
    ops, wall, phase_ops = attribute(prof.events())
    steps = args.steps
    step_s = statistics.median(s for s, _ in plain)
    print(f"profile of our RL step, shape {args.shape} ({active_params(args) / 1e6:.2f}M active "
          f"parameters), {args.prompts} x {args.group_size}, <= {args.max_new_tokens} new tokens, "
          f"{args.minibatches} updates, {args.threads} threads; {steps} profiled steps, ms per step "
          f"(median step under the profiler {step_s:.3f} s)")
    shown = [ph for ph in PHASES if wall.get(ph, 0) > 0]
    print(f"{'':14s}" + "".join(f"{ph:>14s}" for ph in shown))
    for kind in KINDS:
        if kind in ops:
            print(f"{kind:14s}" + "".join(f"{1e3 * ops[kind].get(ph, 0) / steps:14.1f}"
                                          for ph in shown))
    print(f"{'all operators':14s}" + "".join(f"{1e3 * phase_ops[ph] / steps:14.1f}"
                                           for ph in shown))
    print(f"{'Python, other':14s}" + "".join(
        f"{1e3 * (wall[ph] - phase_ops[ph]) / steps:14.1f}" for ph in shown))
    print(f"{'phase wall':14s}" + "".join(f"{1e3 * wall[ph] / steps:14.1f}" for ph in shown))
    print(f"{'unprofiled':14s}" + "".join(
        f"{1e3 * statistics.median(m.get(f'perf/time/{ph}_s', 0) for _, m in plain):14.1f}"
        for ph in shown) + "   (the same steps' own timers, profiler overhead included)")
    print(f"\nthe {args.top} costliest operators (self time, ms per step):")
    table = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:args.top]
    for a in table:
        print(f"  {a.key[:60]:60s} {a.self_cpu_time_total / 1e3 / steps:9.1f}  x{a.count // steps}")
    if args.detail:
        print(f"\noperators under '{args.detail}' (self time, ms per step; backward operators "
              f"as 'name (backward)', by the module their autograd node's forward ran under):")
        by_name = collections.defaultdict(lambda: [0.0, 0])
        events = prof.events()
        seq_kind = forward_kinds(events)
        for e in events:
            if e.name.startswith("autograd::engine"):
                continue  # (its operators are counted under it)
            node = e.cpu_parent
            while node is not None and not node.name.startswith("autograd::engine"):
                node = node.cpu_parent
            if node is not None:  # run by the autograd engine: the backward of that node
                kind, name = seq_kind.get(node.sequence_nr, "other ops"), f"{e.name} (backward)"
            else:
                kind, name = nearest_range(e) or "other ops", e.name
            phase_ok = args.detail_phase is None or nearest_range(e, "phase:") == args.detail_phase
            if not e.name.startswith(("module:", "phase:")) and kind == args.detail and phase_ok:
                by_name[name][0] += e.self_cpu_time_total / 1e3 / steps
                by_name[name][1] += 1
        for name, (ms, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"  {name[:60]:60s} {ms:9.1f}  x{count // steps}")
    run.logger.close()


if __name__ == "__main__":
    main()
