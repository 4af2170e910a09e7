"""Side-by-side report of the runs of a sweep: one self-contained HTML page with embedded plots.

    python -m tools.compare_runs SWEEP_DIR [SWEEP_DIR ...] -o report.html [--png-dir DIR]

Finds every run directory below SWEEP_DIR (a directory holding ``metrics.jsonl``), labels each run
by its algorithm and replay mode (from ``resolved_config.json``) and plots, per run: rollout reward
and held-out accuracy over steps, clip fraction, ratio statistics (mean, min, max), update drift
(experts changed by one gradient update), the rollout/train mismatch (routes and log-probs) and
the ratio noise (|log ratio| of tokens whose routes changed vs the others), then a summary table. ``--png-dir`` also writes the plots as PNG files (for a README).
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import os
import sys
from typing import Optional

import numpy as np

PANELS = [  # (title, [(metric, style)], y label)
    ("rollout reward (mean over the step's responses)", [("rollout/reward_mean", "-")], "reward"),
    ("held-out accuracy (greedy)", [("eval/accuracy", "o-")], "accuracy"),
    ("clip fraction", [("train/clip_fraction", "-")], "fraction"),
    ("importance ratio: mean (solid), min / max (dotted)",
     [("train/ratio_mean", "-"), ("train/ratio_min", ":"), ("train/ratio_max", ":")], "ratio"),
    ("update drift: routed experts changed by one update", [("moe/drift/update/mean", "-")],
     "changed fraction"),
    ("rollout/train mismatch: routes (solid), log-prob |diff| (dashed)",
     [("moe/drift/rollout_train/mean", "-"), ("rollout/logprob_mismatch", "--")], "mismatch"),
    ("ratio noise: mean |log ratio| after one update, routes changed (solid) / not (dashed)",
     [("moe/drift/ratio_noise/changed", "-"), ("moe/drift/ratio_noise/unchanged", "--")],
     "|log ratio|"),
    ("ratio-noise quotient: changed / unchanged routes", [("moe/drift/ratio_noise/quotient", "-")],
     "quotient"),
]


def find_runs(roots: list[str]) -> list[str]:
    runs = []
    for root in roots:
        if not os.path.isdir(root):
            raise FileNotFoundError(f"{root}: not a directory")
        for base, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("checkpoints", "tb"))
            if "metrics.jsonl" in files:
                runs.append(base)
    if not runs:
        raise FileNotFoundError(f"no run directories (with metrics.jsonl) under {', '.join(roots)}")
    return runs


def read_run(path: str) -> dict:
    rows = []
    with open(os.path.join(path, "metrics.jsonl")) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as e:
                    raise ValueError(f"{path}/metrics.jsonl:{n}: corrupt row ({e})") from None
    cfg = {}
    cfg_path = os.path.join(path, "resolved_config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            cfg = json.load(f)
    return {"path": path, "rows": rows, "config": cfg, "label": label_of(path, cfg)}


def label_of(path: str, cfg: dict) -> str:
    """The run's arm (algorithm and replay mode); runs of one arm with other seeds share it."""
    if not cfg:
        return os.path.basename(path)
    algo, replay = cfg["algo"]["name"], cfg["replay"]["mode"]
    return f"{algo} + {replay.upper()}" if replay != "none" else f"{algo} (no replay)"


def collapsed(evals: list, final: float) -> bool:
    """Held-out accuracy fell by at least half of its gain (peak over the start) and did not
    recover: the final accuracy is below start + gain / 2."""
    if not evals:
        return False
    start, peak = evals[0], max(evals + [final])
    return peak > start and final < start + (peak - start) / 2


def series(rows: list, key: str, smooth: int = 1):
    pts = [(r["step"], r[key]) for r in rows if key in r and not isinstance(r[key], list)
           and not r.get("final")]
    if not pts:
        return [], []
    steps, vals = zip(*pts)
    vals = np.asarray(vals, dtype=float)
    if smooth > 1 and len(vals) >= smooth:
        kernel = np.ones(smooth) / smooth
        vals = np.convolve(vals, kernel, mode="valid")
        steps = steps[smooth - 1:]
    return list(steps), list(vals)


def _mean(rows: list, key: str, last_fraction: float = 1.0) -> float:
    _, vals = series(rows, key)
    if not vals:
        return float("nan")
    k = max(1, int(round(len(vals) * last_fraction)))
    tail = np.asarray(vals[-k:], dtype=float)
    return float(np.mean(tail[~np.isnan(tail)])) if (~np.isnan(tail)).any() else float("nan")


def summary(run: dict) -> dict:
    rows = run["rows"]
    evals = series(rows, "eval/accuracy")[1]
    final = [r["eval/accuracy"] for r in rows if r.get("final") and "eval/accuracy" in r]
    acc_final = final[-1] if final else (evals[-1] if evals else float("nan"))
    return {
        "run": run["label"], "dir": os.path.basename(run["path"]),
        "seed": run["config"].get("seed", ""),
        "collapsed": collapsed(list(evals), acc_final),
        "steps": max((r["step"] for r in rows), default=0),
        "accuracy_start": evals[0] if evals else float("nan"),
        "accuracy_final": acc_final,
        "reward_last10": _mean(rows, "rollout/reward_mean", 0.1),
        "clip_fraction": _mean(rows, "train/clip_fraction"),
        "update_drift": _mean(rows, "moe/drift/update/mean"),
        "rollout_train": _mean(rows, "moe/drift/rollout_train/mean"),
        "ratio_noise_quotient": _mean(rows, "moe/drift/ratio_noise/quotient"),
        "step_time_s": _mean(rows, "perf/step_time_s"),
    }


def build(runs: list[dict], png_dir: Optional[str] = None) -> tuple[str, list]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moe.report import _png

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    arms = list(dict.fromkeys(run["label"] for run in runs))  # one color per arm (all seeds)
    fig, axes = plt.subplots(4, 2, figsize=(12, 14.5))
    for ax, (title, metrics, ylabel) in zip(axes.flat, PANELS):
        labelled = set()
        for run in runs:
            arm = arms.index(run["label"])
            for j, (key, style) in enumerate(metrics):
                smooth = 5 if key == "rollout/reward_mean" else 1
                xs, ys = series(run["rows"], key, smooth)
                if xs:
                    first = j == 0 and run["label"] not in labelled
                    ax.plot(xs, ys, style, color=colors[arm % len(colors)], markersize=3,
                            alpha=0.8, label=run["label"] if first else None)
                    if j == 0:
                        labelled.add(run["label"])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    curves = _png(fig)
    sums = [summary(r) for r in runs]
    if png_dir:
        os.makedirs(png_dir, exist_ok=True)
        with open(os.path.join(png_dir, "compare_runs.png"), "wb") as f:
            f.write(base64.b64decode(curves))
    head = ["run", "dir", "seed", "collapsed", "steps", "accuracy_start", "accuracy_final",
            "reward_last10",
            "clip_fraction", "update_drift", "rollout_train", "ratio_noise_quotient", "step_time_s"]
    cells = "".join(f"<th>{h}</th>" for h in head)
    body = ""
    for s in sums:
        body += "<tr>" + "".join(
            f"<td>{html.escape(str(s[h])) if isinstance(s[h], (str, int, bool)) else f'{s[h]:.4f}'}</td>"
            for h in head) + "</tr>"
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>megatron-gspo runs</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}</style></head><body>
<h1>Runs compared ({len(runs)})</h1>
<p>accuracy: held-out greedy accuracy at the start of RL and at the end; reward_last10: mean rollout
reward over the last 10% of steps; clip_fraction, update_drift (fraction of (token, layer) routes
changed by one update), rollout_train (routes differing between the engine and the trainer),
ratio_noise_quotient (mean |log ratio| of tokens whose routes changed over that of the others):
means over all steps.</p>
<table><tr>{cells}</tr>{body}</table>
<h2>Curves</h2><img src="data:image/png;base64,{curves}">
</body></html>"""
    return page, sums


def table_markdown(sums: list) -> str:
    """The summary as a Markdown table (for README)."""
    out = ["| run | seed | held-out acc. start -> end | reward (last 10%) | clip fraction "
           "| update drift | rollout/train drift | ratio-noise quotient | s/step | collapsed |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for s in sums:
        out.append(f"| {s['run']} | {s['seed']} | {s['accuracy_start']:.3f} -> {s['accuracy_final']:.3f} | "
                   f"{s['reward_last10']:.3f} | {s['clip_fraction']:.4f} | {s['update_drift']:.4f} "
                   f"| {s['rollout_train']:.4f} | {s['ratio_noise_quotient']:.2f} "
                   f"| {s['step_time_s']:.2f} | {'yes' if s['collapsed'] else 'no'} |")
    return "\n".join(out)


def table_by_arm(sums: list) -> str:
    """Per arm over its seeds: mean (min .. max) of the accuracy gain, the last rewards, clip
    fraction, update drift and ratio-noise quotient; collapsed runs counted."""
    def stat(vals, fmt):
        vals = [v for v in vals if v == v]
        if not vals:
            return "n/a"
        return f"{fmt.format(np.mean(vals))} ({fmt.format(min(vals))} .. {fmt.format(max(vals))})"

    out = ["| arm | seeds | held-out acc. gain | reward (last 10%) | clip fraction | update drift "
           "| ratio-noise quotient | collapsed |", "|---|---|---|---|---|---|---|---|"]
    for arm in dict.fromkeys(s["run"] for s in sums):
        mine = [s for s in sums if s["run"] == arm]
        out.append(
            f"| {arm} | {len(mine)} | "
            f"{stat([s['accuracy_final'] - s['accuracy_start'] for s in mine], '{:+.3f}')} | "
            f"{stat([s['reward_last10'] for s in mine], '{:.3f}')} | "
            f"{stat([s['clip_fraction'] for s in mine], '{:.4f}')} | "
            f"{stat([s['update_drift'] for s in mine], '{:.4f}')} | "
            f"{stat([s['ratio_noise_quotient'] for s in mine], '{:.2f}')} | "
            f"{sum(s['collapsed'] for s in mine)} of {len(mine)} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.compare_runs", description=__doc__.split("\n")[0])
    p.add_argument("sweep_dirs", nargs="+")
    p.add_argument("-o", "--output", default="compare_runs.html")
    p.add_argument("--png-dir", default=None)
    args = p.parse_args(argv)
    try:
        runs = [read_run(d) for d in find_runs(args.sweep_dirs)]
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"compare_runs: {e}", file=sys.stderr)
        return 2
    page, sums = build(runs, args.png_dir)
    with open(args.output, "w") as f:
        f.write(page)
    print(table_markdown(sums))
    if len({s["run"] for s in sums}) < len(sums):  # several seeds of an arm
        print()
        print(table_by_arm(sums))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
