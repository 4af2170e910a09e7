"""Expert-drift report: one self-contained HTML page with embedded PNG plots.

Per-layer update drift over steps (heatmap per run), mean drift curves of all runs on one plot,
rollout/train mismatch when logged, the ratio noise (|log ratio| of tokens whose routes changed vs
the others, and by number of changed layers), expert-load heatmaps (last step), and a summary per
run.
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


def pooled_ratio_noise(rows: list):
    """Mean |log ratio| per number of changed layers over all steps (token-weighted), and the
    pooled quotient changed / unchanged; None without ratio-noise rows."""
    noise = [r for r in rows if r["kind"] == "ratio_noise"]
    if not noise:
        return None
    tokens = np.array([r["tokens"] for r in noise], dtype=float)
    sums = np.nan_to_num(np.array([r["by_changed_layers"] for r in noise], dtype=float)) * tokens
    count = tokens.sum(0)
    by_layers = np.where(count > 0, sums.sum(0) / np.maximum(count, 1), np.nan)
    changed = sums[:, 1:].sum() / count[1:].sum() if count[1:].sum() else float("nan")
    unchanged = sums[:, 0].sum() / count[0] if count[0] else float("nan")
    return {"by_layers": by_layers, "tokens": count, "quotient": changed / unchanged,
            "changed": changed, "unchanged": unchanged}


def summarize(name: str, rows: list) -> dict:
    upd = _mean_curve(rows, "update")[1]
    mis = _mean_curve(rows, "rollout_train")[1]
    loads = [r for r in rows if r["kind"] == "load"]
    max_share = max((max(r["share"]) for r in loads), default=float("nan"))
    noise = pooled_ratio_noise(rows)
    return {"run": name, "update_drift": float(np.mean(upd)) if upd else float("nan"),
            "rollout_train": float(np.mean(mis)) if mis else float("nan"),
            "max_expert_share": max_share, "steps": len(set(r["step"] for r in rows)),
            "ratio_noise_quotient": float(noise["quotient"]) if noise else float("nan")}


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
    if any(pooled_ratio_noise(rows) for rows in runs.values()):
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
        for name, rows in runs.items():
            pts = sorted((r["step"], r["changed"], r["unchanged"]) for r in rows
                         if r["kind"] == "ratio_noise")
            if not pts:
                continue
            line, = axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                                 label=f"{name}: routes changed")
            axes[0].plot([p[0] for p in pts], [p[2] for p in pts], "--", color=line.get_color(),
                         label=f"{name}: unchanged")
            pooled = pooled_ratio_noise(rows)
            axes[1].plot(range(len(pooled["by_layers"])), pooled["by_layers"], marker="o",
                         label=name)
        axes[0].set_title("ratio noise: mean |log ratio| after one update")
        axes[0].set_xlabel("step")
        axes[1].set_title("mean |log ratio| by number of MoE layers changed (all steps)")
        axes[1].set_xlabel("MoE layers whose top-k set changed")
        for ax in axes:
            ax.set_ylabel("|log ratio|")
            ax.legend(fontsize=7)
        images.append(("Ratio noise: token log-ratios where routes changed", _png(fig)))
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
        f"<td>{_fmt(s['rollout_train'])}</td><td>{_fmt(s['max_expert_share'])}</td>"
        f"<td>{_fmt(s['ratio_noise_quotient'])}</td></tr>"
        for s in summaries)
    body = "".join(f"<h2>{html.escape(t)}</h2><img alt='{html.escape(t)}' "
                   f"src='data:image/png;base64,{b64}'/>" for t, b64 in images)
    page = ("<!doctype html><html><head><meta charset='utf-8'><title>Expert drift report</title>"
            "<style>body{font-family:sans-serif;margin:2em}td,th{padding:4px 10px;"
            "border-bottom:1px solid #ddd}</style></head><body><h1>Expert drift report</h1>"
            "<table><tr><th>run</th><th>steps</th><th>mean update drift</th>"
            "<th>mean rollout/train mismatch</th><th>max expert share</th>"
            "<th>ratio-noise quotient (pooled)</th></tr>"
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
            f"{_fmt(s['rollout_train'])}, max expert share {_fmt(s['max_expert_share'])}, "
            f"ratio-noise quotient {_fmt(s['ratio_noise_quotient'])}")
