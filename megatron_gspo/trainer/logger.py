"""Run logging on rank 0: TensorBoard scalars, ``metrics.jsonl`` (one row per step) and a console
progress bar with ETA. The tags and what they mean: ``trainer.metric_tags`` (and
docs/reference/metrics.md, generated from it).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from typing import Optional


METRICS_FILE = "metrics.jsonl"


def _fmt_time(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


LOG_LINES = 20  # progress lines of a run in a log (not a terminal)


class RunLogger:
    """All ranks construct it; only ``enabled`` (rank 0) writes."""

    def __init__(self, run_dir: str, *, enabled: bool, tensorboard: bool = True,
                 progress: bool = True, total_steps: int = 0):
        self.enabled, self.progress, self.total = enabled, progress, total_steps
        self.path = os.path.join(run_dir, METRICS_FILE)
        self.writer = None
        self._t0: Optional[float] = None
        self._first_step = 0
        self.tty = sys.stdout.isatty()
        self._open = False  # a progress line drawn on the terminal without its newline
        if enabled:
            os.makedirs(run_dir, exist_ok=True)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(log_dir=os.path.join(run_dir, "tb"))

    def truncate_after(self, step: int) -> None:
        """Drop rows of steps after ``step`` (written by a run that was killed after its last
        checkpoint) and final rows of an earlier end, so that a resumed run's log is the
        uninterrupted run's."""
        if not self.enabled or not os.path.isfile(self.path):
            return
        with open(self.path) as f:
            rows = [line for line in f if line.strip()]
        kept = []
        for line in rows:
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a row cut by the kill
            if row.get("step", 0) <= step and not row.get("final"):
                kept.append(line if line.endswith("\n") else line + "\n")
        with open(self.path, "w") as f:
            f.writelines(kept)

    def log(self, step: int, scalars: dict, extra: Optional[dict] = None) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: v if isinstance(v, list) else float(v)
                                for k, v in scalars.items()}, **(extra or {})}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for k, v in scalars.items():
                if not isinstance(v, list) and math.isfinite(float(v)):
                    self.writer.add_scalar(k, float(v), step)
            self.writer.flush()

    def scalar(self, tag: str, value: float, step: int) -> None:
        if self.enabled and self.writer is not None:
            self.writer.add_scalar(tag, float(value), step)

    def bar(self, step: int, summary: str, keep: bool = False) -> None:
        """The progress line: step, a bar, the key numbers, elapsed time and ETA. A terminal
        redraws it in place; a log (not a terminal) gets the first and last steps' and every
        ``total / LOG_LINES``-th, the metrics of every step being in ``metrics.jsonl``. Both
        keep a step's line where ``keep`` (an evaluation)."""
        if not (self.enabled and self.progress):
            return
        now = time.perf_counter()
        if self._t0 is None:
            self._t0, self._first_step = now, step - 1
        done = step - self._first_step
        rate = (now - self._t0) / max(done - 1, 1)  # (the clock starts at the first step's end)
        eta = _fmt_time(rate * (self.total - step)) if done > 1 else "--:--"
        filled = int(20 * step / max(self.total, 1))
        line = (f"[{'#' * filled}{'.' * (20 - filled)}] {step}/{self.total} {summary} "
                f"| {_fmt_time(now - self._t0)} elapsed, ETA {eta}")
        if self.tty:  # (cut to the terminal's width: a wrapped line would not redraw)
            self._open = step < self.total and not keep
            line = line if not self._open else line[:shutil.get_terminal_size().columns - 1]
            print(f"\r{line}\x1b[K", end="" if self._open else "\n", flush=True)
        elif (keep or done == 1 or step >= self.total
              or step % max(1, self.total // LOG_LINES) == 0):
            print(line, flush=True)

    def say(self, text: str) -> None:
        if self.enabled:
            if self._open:  # below the progress line, which stays as it was last drawn
                print(flush=True)
                self._open = False
            print(text, flush=True)

    def close(self) -> None:
        if self._open:  # a run that ended before its last step: the line keeps its newline
            print(flush=True)
            self._open = False
        if self.writer is not None:
            self.writer.close()
            self.writer = None
