"""Where the update phase's time goes outside the model, timed without a profiler.

Runs our trainer in this process (one rank, the shapes of ``rl_step_vs_trl.py``), drops a warm-up
step, then times ``--steps`` RL steps with wall-clock timers around the calls that make up the
update phase: the micro-batches' forward + backward (``forward.forward_backward``), zeroing the
gradient buffers, the non-finite check, the loss metrics, and the optimizer's step with its own
parts (torch's fused Adam, the gradient norm, and megatron-core's distributed optimizer copying
gradients and parameters between the model's buffers and its fp32 shards, which alias them when
the model is fp32). ``profile_rl_step.py`` attributes operators to modules, but adds a few
microseconds per operator; these timers add one Python call per timed call, so the small parts
(hundreds of calls per step) are seen at their own size. Prints, per RL step (median over the
steps), each part's milliseconds and share of the update phase; nested parts are indented under
the call they run in.

    python benchmarks/update_parts.py --shape compute --steps 6
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from profile_rl_step import add_run_args, fill_shape, start_run  # noqa: E402


class Timers:
    """Seconds per named part, summed over the calls made since the last ``reset``."""

    def __init__(self):
        self.seconds = collections.defaultdict(float)

    def reset(self) -> None:
        self.seconds.clear()

    def wrap(self, owner, name: str, part: str) -> None:
        """Time every call of ``owner.name`` (a module function or an instance's method) as
        ``part``."""
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - t0

        setattr(owner, name, timed)


# (part, the part it runs in): printed in this order, indented by depth.
PARTS = (("update phase", None), ("micro-batches", "update phase"),
         ("normalizer", "update phase"), ("policy update", "update phase"),
         ("zero gradients", "policy update"), ("forward + backward", "policy update"),
         ("metrics", "policy update"), ("non-finite check", "policy update"),
         ("optimizer step", "policy update"), ("fp32 grads to shards", "optimizer step"),
         ("gradient norm", "optimizer step"), ("Adam", "optimizer step"),
         ("shards to params", "optimizer step"))


def depth(part: str) -> int:
    parent = dict(PARTS)[part]
    return 0 if parent is None else 1 + depth(parent)


def instrument(run, timers: Timers) -> None:
    from megatron_gspo.trainer import loop, optim, passes as policy, updates

    # Each function wrapped where its caller looks it up (the importing module's namespace).
    timers.wrap(loop, "update", "update phase")
    timers.wrap(updates, "micro_batches_of", "micro-batches")
    timers.wrap(updates, "normalizer_for", "normalizer")
    timers.wrap(updates, "policy_update", "policy update")
    timers.wrap(policy, "zero_grads", "zero gradients")
    timers.wrap(policy, "forward_backward", "forward + backward")
    timers.wrap(policy, "last_stage_metrics", "metrics")
    timers.wrap(policy, "combine_over_data_parallel", "metrics")
    timers.wrap(policy, "all_finite", "non-finite check")
    timers.wrap(run.policy.optimizer, "step", "optimizer step")
    for sub in optim.sub_optimizers(run.policy.optimizer):
        for name, part in (("_copy_model_grads_to_main_grads", "fp32 grads to shards"),
                           ("_copy_main_params_to_model_params", "shards to params"),
                           ("get_grad_norm", "gradient norm")):
            if hasattr(sub, name):
                timers.wrap(sub, name, part)
        if getattr(sub, "optimizer", None) is not None:
            timers.wrap(sub.optimizer, "step", "Adam")


def main() -> None:
    p = argparse.ArgumentParser()
    add_run_args(p, shape="compute", steps=6, steps_help="timed RL steps (after one warm-up)")
    args = p.parse_args()
    fill_shape(args)

    from megatron_gspo.trainer.loop import rl_step

    run = start_run(args, "update_parts_")
    rl_step(run, 1)  # warm-up
    timers = Timers()
    instrument(run, timers)
    per_step = []
    for step in range(2, args.steps + 2):
        timers.reset()
        rl_step(run, step)
        per_step.append(dict(timers.seconds))
    ms = {part: 1e3 * statistics.median(s.get(part, 0.0) for s in per_step) for part, _ in PARTS}
    update = ms["update phase"]
    print(f"update phase, shape {args.shape}, {args.prompts} x {args.group_size}, "
          f"{args.minibatches} updates per step, {args.threads} threads: ms per RL step, median "
          f"of {args.steps} steps")
    for part, _ in PARTS:
        indent = "  " * depth(part)
        print(f"  {indent}{part:{32 - len(indent)}s} {ms[part]:8.1f}  "
              f"{100 * ms[part] / update:5.1f}%")
    for whole in ("optimizer step", "policy update", "update phase"):
        rest = ms[whole] - sum(ms[part] for part, parent in PARTS if parent == whole)
        print(f"  in {whole}, outside the parts above: {rest:.1f} ms")
    run.logger.close()


if __name__ == "__main__":
    main()
