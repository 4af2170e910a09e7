"""RL step time of the tiny MoE with expert-drift instrumentation on vs off (same seed and
batches; goal: at most 5% more).

    python benchmarks/drift_overhead.py [--steps 12]

Runs the main job (no SFT, no evaluation) with ``logging.drift=true`` / ``false`` and compares the
median ``perf/tokens_per_s`` of its metrics.jsonl (first two steps excluded as warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tokens_per_s(drift: bool, steps: int) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        subprocess.run(
            [sys.executable, "-m", "megatron_gspo", f"logging.drift={str(drift).lower()}",
             f"trainer.steps={steps}", "trainer.sft_steps=0", "trainer.save_interval=0",
             "data.eval_size=0", "logging.progress=false", f"hydra.run.dir={run_dir}"],
            cwd=ROOT, capture_output=True, text=True, check=True,
            env=dict(os.environ, PYTHONWARNINGS="ignore"))
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    rates = [r["perf/tokens_per_s"] for r in rows if "perf/tokens_per_s" in r]
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
    print(f"tiny MoE RL step (default rollout and 4 updates per batch), CPU, median of {args.steps - 2} "
          f"steps, median of {args.repeats} interleaved runs each")
    print(f"{'drift':6s} {'tokens/s':>10s} {'step time x off':>16s}")
    print(f"{'off':6s} {off:10,.0f} {1.0:16.3f}")
    print(f"{'on':6s} {on:10,.0f} {off / on:16.3f}")


if __name__ == "__main__":
    main()
