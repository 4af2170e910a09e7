"""Training-step time of the tiny MoE with expert-drift instrumentation on vs off (one run each,
same seed and batches; goal: at most 5% more).

    python benchmarks/drift_overhead.py [--steps 12]

Runs the main job twice (``demo.drift=true`` / ``false``) and compares the median per-step
throughput it prints (first two steps excluded as warm-up).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tokens_per_s(drift: bool, steps: int) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        out = subprocess.run(
            [sys.executable, "-m", "megatron_gspo", f"demo.drift={str(drift).lower()}",
             f"demo.steps={steps}", "demo.batch_size=8", "demo.seq_length=64",
             f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, check=True,
            env=dict(os.environ, PYTHONWARNINGS="ignore"))
    rates = [float(m.replace(",", "")) for m in re.findall(r"([\d,]+) tokens/s", out.stdout)]
    return statistics.median(rates[2:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    offs, ons = [], []
    for _ in range(args.repeats):  # interleaved, so that machine noise hits both alike
        offs.append(tokens_per_s(False, args.steps))
        ons.append(tokens_per_s(True, args.steps))
    off, on = statistics.median(offs), statistics.median(ons)
    print(f"tiny MoE step (2 updates per batch, 8 x 64 tokens), CPU, median of {args.steps - 2} "
          f"steps, median of {args.repeats} interleaved runs each")
    print(f"{'drift':6s} {'tokens/s':>10s} {'step time x off':>16s}")
    print(f"{'off':6s} {off:10,.0f} {1.0:16.3f}")
    print(f"{'on':6s} {on:10,.0f} {off / on:16.3f}")


if __name__ == "__main__":
    main()
