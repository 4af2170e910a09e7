"""Score samples in a bounded pool of worker processes. A reward function that raises or runs past
its timeout gives reward 0 with the reason counted; it never takes the trainer down."""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
from collections import Counter
from typing import Callable, Sequence

from megatron_gspo.rewards.registry import RewardInput, RewardResult


def _call(fn, sample):
    return fn(sample)


def as_result(value) -> RewardResult:
    """A reward's return value as a ``RewardResult``: one as it is, or a finite number as its
    score; anything else raises (the sample then scores 0, counted as raised)."""
    if isinstance(value, RewardResult):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value \
            and abs(value) != float("inf"):
        return RewardResult(float(value))
    raise TypeError(f"reward returned {type(value).__name__} {value!r:.40}, not a RewardResult "
                    "or a finite number")


class InlineScorer:
    """Scores in the calling process (cheap rewards: exact match, math): a reward that raises
    gives 0 with the reason counted, as in the pool; there is no timeout."""

    def __init__(self, fn: Callable[[RewardInput], RewardResult]):
        self.fn = fn

    def score(self, samples: Sequence[RewardInput]) -> tuple[list[RewardResult], Counter]:
        results, failures = [], Counter()
        for sample in samples:
            try:
                result = as_result(self.fn(sample))
            except Exception as e:
                result = RewardResult(0.0, {"reason": f"reward raised {type(e).__name__}: {e}"[:200]})
                failures["raised"] += 1
            results.append(result)
        return results, failures

    def close(self) -> None:
        return None


def make_scorer(fn: Callable[[RewardInput], RewardResult], *, workers: int, timeout_s: float):
    """``RewardPool`` with ``workers`` > 0 (sandboxed code, slow verifiers), else in-process."""
    return RewardPool(fn, workers=workers, timeout_s=timeout_s) if workers > 0 else InlineScorer(fn)


class RewardPool:
    """Bounded worker processes; a reward past ``timeout_s`` (counted from when the trainer
    starts waiting for it) scores 0, and the pool is replaced."""

    def __init__(self, fn: Callable[[RewardInput], RewardResult], *, workers: int = 2,
                 timeout_s: float = 30.0):
        self.fn, self.workers, self.timeout_s = fn, workers, timeout_s
        self._executor = None

    def _pool(self) -> cf.ProcessPoolExecutor:
        if self._executor is None:
            self._executor = cf.ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"))
        return self._executor

    def _kill(self) -> None:
        """A worker stuck past its timeout cannot be cancelled: end the whole pool."""
        if self._executor is not None:
            for proc in list(getattr(self._executor, "_processes", {}).values()):
                proc.kill()
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def score(self, samples: Sequence[RewardInput]) -> tuple[list[RewardResult], Counter]:
        """Results in input order, and counts of the reasons for failures (raised, timeout)."""
        futures = [self._pool().submit(_call, self.fn, s) for s in samples]
        results, failures, stuck = [], Counter(), False
        for future in futures:
            try:
                result = as_result(future.result(timeout=self.timeout_s if not stuck else 0.01))
            except cf.TimeoutError:
                stuck = True
                result = RewardResult(0.0, {"reason": f"reward timeout after {self.timeout_s:g} s"})
                failures["timeout"] += 1
            except Exception as e:  # the reward function's own error, or a dead worker
                result = RewardResult(0.0, {"reason": f"reward raised {type(e).__name__}: {e}"[:200]})
                failures["raised"] += 1
            results.append(result)
        if stuck:
            self._kill()
        return results, failures

    def close(self) -> None:
        self._kill()
