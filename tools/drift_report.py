"""Expert-drift report: one self-contained HTML file with embedded PNG plots, and a text summary.

    python -m tools.drift_report RUN_DIR [RUN_DIR ...] -o report.html

Reads each run's ``drift.jsonl``: per-layer update drift over steps (heatmap per run), mean drift
curves of all runs on one plot, rollout/train mismatch when logged, expert-load heatmaps (last step).
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    from moe.report import summary_line, write_report

    p = argparse.ArgumentParser(prog="python -m tools.drift_report", description=__doc__.split("\n")[0])
    p.add_argument("run_dirs", nargs="+")
    p.add_argument("-o", "--output", default="drift_report.html")
    args = p.parse_args(argv)
    try:
        summaries = write_report(args.run_dirs, args.output)
    except (FileNotFoundError, ValueError) as e:
        print(f"drift_report: {e}", file=sys.stderr)
        return 2
    for s in summaries:
        print(summary_line(s))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
