"""One change to the update phase measured inside one trainer run: its two variants alternate
update by update, and each update is compared with its neighbour of the other variant.

On the 2-core machines this project is measured on, the speed drifts by 10-30% within minutes
(the 1024^3 matmul has measured anywhere from 54 to 190 GFLOP/s in one hour), so two separate
runs cannot resolve a change of a few percent. Here both variants run in one process on the same
batches: within each RL step the updates alternate ``A B A B`` (``B A B A`` in every other step,
so that neither variant always takes the step's first, on-policy update), and each pair of
neighbouring updates gives one ratio of their times per fed token. The median ratio and its
quartiles are printed with each variant's median time per token and page faults per update.
Only the updates alternate: the rest of each step runs as the code is now. What one process
cannot show (a change to how much memory the process holds between phases, say) needs whole
runs as well.

Changes (``--change``), each the code it replaced (before) against the code now (after):

- ``experts_function``: every expert layer through ``grouped_mm`` over its stacked weights
  (``swiglu_cpu_min_weight`` out of reach, the C++ kernel off) against the CPU SwiGLU function;
- ``short_buckets``: every packed-attention bucket through SDPA's kernel (``matmul_max_keys``
  0) against short buckets as batched matmuls (``layers._MatmulBuckets``);
- ``experts_kernel``: the CPU SwiGLU function's Python loop over the experts (MKL splitting each
  product over the threads) against its C++ kernel (whole experts per OpenMP thread).

    python benchmarks/update_ab.py --change experts_function --shape compute --steps 12
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from profile_rl_step import add_run_args, fill_shape, start_run  # noqa: E402


def experts_function(run):
    """(before, after) setters: the expert layers through grouped_mm, or the CPU function."""
    from megatron_gspo.backends.cpu.experts import CPUGroupedExperts

    layers = [m for m in run.policy.gpt.modules() if isinstance(m, CPUGroupedExperts)]

    def before():
        for m in layers:
            m.swiglu_cpu_min_weight, m.cpu_kernel = float("inf"), False

    def after():
        for m in layers:
            m.__dict__.pop("swiglu_cpu_min_weight", None)  # the class's threshold
            m.cpu_kernel = run.job.backend.cpu_experts_kernel

    return before, after


def short_buckets(run):
    """(before, after) setters: every packed-attention bucket through SDPA, or the default."""
    from megatron_gspo.backends.cpu import attention

    now = attention.cpu_packed_attention
    sdpa_only = functools.partial(now, matmul_max_keys=0)

    def before():
        attention.cpu_packed_attention = sdpa_only

    def after():
        attention.cpu_packed_attention = now

    return before, after


def experts_kernel(run):
    """(before, after) setters: the CPU SwiGLU function's loop (MKL splitting each product over
    the threads), or its C++ kernel (whole experts per thread)."""
    from megatron_gspo.backends.cpu import kernels as cpu_kernels
    from megatron_gspo.backends.cpu.experts import CPUGroupedExperts

    if cpu_kernels.experts_swiglu() is None:
        raise SystemExit("experts_kernel: the C++ kernel did not build (see the log line above)")
    layers = [m for m in run.policy.gpt.modules() if isinstance(m, CPUGroupedExperts)]

    def before():
        for m in layers:
            m.cpu_kernel = False

    def after():
        for m in layers:
            m.cpu_kernel = True

    return before, after


CHANGES = {"experts_function": experts_function, "short_buckets": short_buckets,
           "experts_kernel": experts_kernel}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--change", choices=sorted(CHANGES), required=True)
    add_run_args(p, shape="compute", steps=12, steps_help="measured RL steps (after one warm-up)")
    args = p.parse_args()
    fill_shape(args)
    if args.minibatches % 2:
        p.error("--minibatches must be even (the updates of a step are compared in pairs)")

    from megatron_gspo.trainer import updates
    from megatron_gspo.trainer.loop import rl_step

    run = start_run(args, "update_ab_")
    setters = CHANGES[args.change](run)
    rl_step(run, 1)  # warm-up, with the change
    timed = {0: [], 1: []}  # variant -> (seconds per fed token, page faults) per update
    order = []
    policy_update = updates.policy_update  # looked up there by update()

    def alternating(ddp, optimizer, mbs, *a, **k):
        variant = order.pop(0)
        setters[variant]()
        tokens = sum(int(mb.tokens_BS.numel()) for mb in mbs)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        result = policy_update(ddp, optimizer, mbs, *a, **k)
        seconds = time.perf_counter() - t0
        setters[1]()  # the rest of the step (rollout included) as the code is now
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        timed[variant].append((seconds / tokens, faults))
        return result

    updates.policy_update = alternating
    try:
        for step in range(2, args.steps + 2):
            first = step % 2
            order[:] = [first, 1 - first] * (args.minibatches // 2)
            rl_step(run, step)
    finally:
        updates.policy_update = policy_update
        setters[1]()
    ratios = [a / b for (a, _), (b, _) in zip(timed[0], timed[1])]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    print(f"update phase, shape {args.shape}, {args.prompts} x {args.group_size}, "
          f"{args.minibatches} updates per step, {args.threads} threads, {args.steps} RL steps: "
          f"{len(ratios)} pairs of neighbouring updates")
    for variant, name in ((0, "before"), (1, "after")):
        per_token = statistics.median(s for s, _ in timed[variant])
        faults = statistics.median(f for _, f in timed[variant])
        print(f"  {name:7s} {1e6 * per_token:7.1f} us per fed token   page faults per update "
              f"{faults:8.0f}")
    print(f"{args.change}: after over before, time per token: speed-up {statistics.median(ratios):.3f}x "
          f"(median of the pairs; quartiles {q1:.3f}-{q3:.3f}x)")
    run.logger.close()


if __name__ == "__main__":
    main()
