"""The perf probe's paths: the measurements that may fail on their own on a GPU (a CUDA graph's
capture, a compilation, memory), each run within the probe's time budget, a failure recorded in
one line and the other paths still measured; progress lines on stderr as each ends."""

from __future__ import annotations

import contextlib
import gc
import signal
import sys
import threading
import time

import torch

from megatron_gspo.config.errors import first_line

START = time.perf_counter()


def note(what: str) -> None:
    """One progress line on stderr as each measurement ends (a run stopped by a time limit
    still shows what it measured)."""
    print(f"perf_probe [{time.perf_counter() - START:.0f} s]: {what}", file=sys.stderr, flush=True)


def failure(e: BaseException) -> str:
    """An exception in one line: its type and its message's first line."""
    return f"{type(e).__name__}: {first_line(e, default='')}"[:300]


class OverBudget(Exception):
    """The probe's time budget ran out inside a path."""


class Paths:
    """What became of the probe's paths (the measurements that may fail on their own: a CUDA
    graph's capture, a compilation, memory) within its time budget (seconds from its making;
    None: none). ``failed``: path ("section name") -> "Error: first line"."""

    def __init__(self, budget_s: float | None = None):
        self.failed: dict = {}
        self.budget_s = budget_s
        self.deadline = None if budget_s is None else time.perf_counter() + budget_s

    def attempt(self, name: str, fn, keep=()):
        """``fn()``; where it raises (but for ``keep``), None, with the failure in
        ``failed[name]`` and on the progress lines: one path failing on a GPU leaves the other
        paths' figures. Past the budget ``fn`` is not run; a run that reaches it is stopped
        (``OverBudget``, raised in the main thread by an alarm)."""
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            self.failed[name] = f"skipped: the time budget of {self.budget_s:g} s ran out before it"
            note(f"{name} {self.failed[name]}")
            return None
        try:
            with self._alarm():
                return fn()
        except keep:
            raise
        except Exception as e:  # (recorded, not hidden)
            self.failed[name] = failure(e)
            note(f"{name} failed: {self.failed[name]}")
            release_memory()
            return None

    def section(self, section: str) -> dict:
        """``{"failed": {path: failure}}`` of one section's paths (none: nothing)."""
        mine = {k.split(" ", 1)[-1]: v for k, v in self.failed.items()
                if k == section or k.startswith(section + " ")}
        return {"failed": mine} if mine else {}

    @contextlib.contextmanager
    def _alarm(self):
        """``OverBudget`` raised in the block when the budget runs out (SIGALRM; the main
        thread only), the previous handler back after it."""
        if self.deadline is None or threading.current_thread() is not threading.main_thread():
            yield
            return

        def expire(signum, frame):
            raise OverBudget(f"the time budget of {self.budget_s:g} s ran out")

        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, max(self.deadline - time.perf_counter(), 1e-3))
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def release_memory() -> None:
    """What a failed step left goes back to the device."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
