"""Expert-drift report: one self-contained HTML page with embedded PNG plots.

Per-layer update drift over steps (heatmap per run), mean drift curves of all runs on one plot,
rollout/train mismatch when logged, expert-load heatmaps (last step), and a summary per run.
"""

from __future__ import annotations

import base64
import html
import io

import numpy as np
def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _layer_matrix(rows: list, kind: str):
    steps = sorted({r["step"] for r in rows if r["kind"] == kind and r["layer"] != "mean"})
    layers = sorted({r["layer"] for r in rows if r["kind"] == kind and r["layer"] != "mean"})
    if not steps:
        return None, [], []
    m = np.full((len(layers), len(steps)), np.nan)
    for r in rows:
        if r["kind"] == kind and r["layer"] != "mean":
            m[layers.index(r["layer"]), steps.index(r["step"])] = r["changed_fraction"]
    return m, steps, layers


def _mean_curve(rows: list, kind: str):
    pts = sorted((r["step"], r["changed_fraction"]) for r in rows
                 if r["kind"] == kind and r["layer"] == "mean")
    return [p[0] for p in pts], [p[1] for p in pts]


def summarize(name: str, rows: list) -> dict:
    upd = _mean_curve(rows, "update")[1]
    mis = _mean_curve(rows, "rollout_train")[1]
    loads = [r for r in rows if r["kind"] == "load"]
    max_share = max((max(r["share"]) for r in loads), default=float("nan"))
    return {"run": name, "update_drift": float(np.mean(upd)) if upd else float("nan"),
            "rollout_train": float(np.mean(mis)) if mis else float("nan"),
            "max_expert_share": max_share, "steps": len(set(r["step"] for r in rows))}


def build_report(runs: dict) -> tuple[str, list]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images, summaries = [], []
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for name, rows in runs.items():
        for ax, kind in zip(axes, ("update", "rollout_train")):
            x, y = _mean_curve(rows, kind)
            if x:
                ax.plot(x, y, marker="o", label=name)
    for ax, title in zip(axes, ("update drift (mean over layers)", "rollout/train mismatch")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel("fraction of top-k sets changed")
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    images.append(("Mean drift of every run", _png(fig)))
    for name, rows in runs.items():
        summaries.append(summarize(name, rows))
        m, steps, layers = _layer_matrix(rows, "update")
        if m is not None:
            fig, ax = plt.subplots(figsize=(max(4, 0.5 * len(steps) + 2), 0.35 * len(layers) + 1.5))
            im = ax.imshow(m, aspect="auto", cmap="magma", vmin=0, origin="lower")
            ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=7)
            ax.set_yticks(range(len(layers)), [str(x) for x in layers], fontsize=7)
            ax.set_xlabel("step")
            ax.set_ylabel("MoE layer")
            fig.colorbar(im, ax=ax, label="changed fraction")
            images.append((f"{name}: update drift per layer", _png(fig)))
        loads = [r for r in rows if r["kind"] == "load"]
        if loads:
            last = max(r["step"] for r in loads)
            share = np.array([r["share"] for r in sorted(loads, key=lambda r: r["layer"])
                              if r["step"] == last])
            fig, ax = plt.subplots(figsize=(max(4, 0.3 * share.shape[1] + 2),
                                            0.35 * share.shape[0] + 1.5))
            im = ax.imshow(share, aspect="auto", cmap="viridis", vmin=0, origin="lower")
            ax.set_xlabel("expert")
            ax.set_ylabel("MoE layer")
            fig.colorbar(im, ax=ax, label="token share")
            images.append((f"{name}: expert load at step {last}", _png(fig)))
    table = "".join(
        f"<tr><td>{html.escape(s['run'])}</td><td>{s['steps']}</td><td>{_fmt(s['update_drift'])}</td>"
        f"<td>{_fmt(s['rollout_train'])}</td><td>{_fmt(s['max_expert_share'])}</td></tr>"
        for s in summaries)
    body = "".join(f"<h2>{html.escape(t)}</h2><img alt='{html.escape(t)}' "
                   f"src='data:image/png;base64,{b64}'/>" for t, b64 in images)
    page = ("<!doctype html><html><head><meta charset='utf-8'><title>Expert drift report</title>"
            "<style>body{font-family:sans-serif;margin:2em}td,th{padding:4px 10px;"
            "border-bottom:1px solid #ddd}</style></head><body><h1>Expert drift report</h1>"
            "<table><tr><th>run</th><th>steps</th><th>mean update drift</th>"
            "<th>mean rollout/train mismatch</th><th>max expert share</th></tr>"
            f"{table}</table>{body}</body></html>")
    return page, summaries




def write_report(run_dirs: list, output: str) -> list:
    """Read each run's drift log and write the HTML report; returns the per-run summaries."""
    import os

    from moe.instrument import read_drift_log

    runs = {os.path.basename(os.path.normpath(d)) or d: read_drift_log(d) for d in run_dirs}
    page, summaries = build_report(runs)
    with open(output, "w") as f:
        f.write(page)
    return summaries


def _fmt(x: float) -> str:
    return "n/a" if x != x else f"{x:.4f}"


def summary_line(s: dict) -> str:
    return (f"{s['run']}: mean update drift {_fmt(s['update_drift'])}, mean rollout/train mismatch "
            f"{_fmt(s['rollout_train'])}, max expert share {_fmt(s['max_expert_share'])}")
