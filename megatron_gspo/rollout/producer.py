"""Asynchronous rollouts: a producer that admits prompt groups ahead of the trainer, within a
staleness bound, generates them (across weight syncs, in segments, for partial rollouts) and
hands the trainer each step's batch.

The schedule is logical, not the clock, so that a run does not depend on how fast anything was:

- Versions: the engine holds policy version ``v`` after the trainer's step ``v`` (0: the
  weights RL starts from). Step ``t`` trains policy version ``t - 1``.
- Admission: a prompt group is reserved for the step it will train in when it is admitted,
  steps in order, and is admitted once ``t - 1 - v <= eta`` (``eta``: ``max_staleness``):
  in flight plus waiting is at most ``eta + 1`` steps' batches. Every token is sampled by a
  version no older than the one at admission, so the staleness of a trained sample (the
  version trained minus the oldest version of its tokens, queue time included) is at most
  ``eta``. Nothing is dropped: every admitted group trains exactly once, at its step.
- Rounds: in a round every unfinished row of every admitted group asks the engine for one
  segment, ``segment`` new tokens at most (0: up to its limit), resuming from the tokens it
  has (the engine prefills them again, under the weights it holds now). Under version ``v``
  the producer runs rounds until the batch of step ``v + 1`` is complete (the trainer waits
  for it), then one more round while the trainer trains (``abort_at_sync``: rounds until the
  trainer syncs, which aborts the requests in flight); a weight sync happens between rounds.
  The versions of every token therefore follow from the schedule alone (``abort_at_sync``
  aside, where they follow the clock).

Each row records, per token, its id, the behaviour log-prob, the version that sampled it and
(for R3) the routed experts of the position that sampled it, spliced segment by segment.

The producer runs in a thread on a replica's leader (SGLang), or inline on every rank (the local
engine, which shares the trainer's device: no overlap, only the schedule). Its thread speaks
HTTP only and never joins a collective: the trainer's thread alone runs the training collectives
and the weight sync, and ``quiesce`` (the round over, under the producer's one lock) orders every
sync after the round it follows. Every wait has a deadline (``wait_s``; each request its own
timeout); a producer that fails hands its error to the trainer, which ends the run with one line.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatron_gspo.rollout.types import RolloutError, RowRequest, Sample, SamplingParams


@dataclass
class Row:
    """One response being generated: its index in its step's global batch and seed, and per
    token so far its id, behaviour log-prob, version; routes of the positions fed so far."""

    index: int
    seed: Optional[int]
    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    routes: Optional[torch.Tensor] = None
    finish: Optional[str] = None  # "stop" | "length" once done


@dataclass
class Group:
    """A prompt's group of rows, reserved for the step it trains in."""

    step: int
    order: int  # its place among this rank's prompts of the step
    record: object  # the prompt record (answer, tests, metadata)
    prompt: list
    rows: list


@dataclass(frozen=True)
class Schedule:
    staleness: int  # eta
    segment: int  # new tokens per row per round; 0: a row's whole response (or until aborted)
    abort_at_sync: bool  # rounds go on until the trainer syncs, which aborts the one in flight
    last_step: int  # nothing is admitted for later steps


def admissible(step: int, version: int, staleness: int) -> bool:
    """Whether a group for ``step`` may be admitted while the engine holds ``version``."""
    return step - 1 - version <= staleness


def staleness_of(step: int, sample: Sample) -> int:
    """The version step ``step`` trains minus the oldest version of the sample's tokens."""
    if sample.versions_R is None or sample.versions_R.numel() == 0:
        return 0
    return step - 1 - int(sample.versions_R.min())


class Producer:
    """``draw(step)`` gives this rank's prompt groups of ``step``: a list of (record, prompt
    ids, first global row). ``seed_of(step)`` is the step's sampling seed (each row's:
    ``row_seed``); ``params`` the sampling (its ``max_new_tokens``: a response's limit).
    ``threaded``: rounds run in a thread beside the trainer (an external engine), else inline.
    ``wait_s``: the longest the trainer waits for a batch or a round."""

    def __init__(self, engine, *, draw: Callable[[int], list], seed_of: Callable[[int], int],
                 params: SamplingParams, group_size: int, schedule: Schedule,
                 threaded: bool, wait_s: float):
        self.engine, self.draw, self.seed_of = engine, draw, seed_of
        self.params, self.group_size, self.schedule = params, group_size, schedule
        self.threaded, self.wait_s = threaded, wait_s
        self.version, self.next_step = 0, 1
        self.groups: list[Group] = []
        self.busy: list = []  # (start, end) of every round, for the overlap metric
        self._cv = threading.Condition()
        self._want: Optional[int] = None  # the step whose batch the trainer waits for
        self._running = False
        self._quiescing = False  # segment 0: the trainer syncs, no new round
        self._stop = False
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None

    # -- the trainer's side ------------------------------------------------------------------------
    def batch(self, step: int) -> tuple[list, list[Sample]]:
        """The records and samples of ``step`` (this rank's groups in order, their rows in
        order), once complete; the producer goes on with the next round meanwhile."""
        if not self.threaded:
            self._work(step)
        else:
            with self._cv:
                self._raise()
                self._want, self._running, self._quiescing = step, True, False
                self._cv.notify_all()
            self._ensure_thread()
            self._wait(lambda: self._complete(step) or self._error is not None, "the batch of "
                       f"step {step}")
        with self._cv:
            self._raise()
            mine = [g for g in self.groups if g.step == step]
            self.groups = [g for g in self.groups if g.step != step]
        mine.sort(key=lambda g: g.order)
        records = [g.record for g in mine for _ in g.rows]
        return records, [self._sample(g, row) for g in mine for row in g.rows]

    def quiesce(self) -> None:
        """Wait for the round in progress to end (``abort_at_sync``: abort it), before a weight
        sync or a checkpoint; the producer then waits for the next ``batch``."""
        if not self.threaded:
            return
        with self._cv:
            self._quiescing = True
        if self.schedule.abort_at_sync:
            # The requests in flight end and return what they have; a request sent just before
            # the flag was seen is aborted by the next call.
            deadline = time.monotonic() + self.wait_s
            while self._running_now() and time.monotonic() < deadline:
                self.engine.abort_all()
                with self._cv:
                    self._cv.wait_for(lambda: not self._running, timeout=0.2)
        self._wait(lambda: not self._running or self._error is not None, "the round in progress")
        with self._cv:
            self._raise()

    def _running_now(self) -> bool:
        with self._cv:
            return self._running and self._error is None

    def set_version(self, version: int) -> None:
        """The engine holds ``version`` (after a weight sync; the producer is quiesced)."""
        with self._cv:
            self.version = int(version)

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=self.wait_s)
            self._thread = None

    def busy_within(self, start: float, end: float) -> float:
        """Seconds of rounds inside [start, end]."""
        with self._cv:
            spans = list(self.busy)
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        with self._cv:
            return {"version": self.version, "next_step": self.next_step,
                    "groups": [{"step": g.step, "order": g.order, "record": g.record,
                                "prompt": list(g.prompt),
                                "rows": [dict(vars(r)) for r in g.rows]} for g in self.groups]}

    @staticmethod
    def fresh(step: int) -> dict:
        """The state of a producer that starts after ``step`` (nothing admitted ahead)."""
        return {"version": step, "next_step": step + 1, "groups": []}

    def load_state_dict(self, state: dict) -> None:
        with self._cv:
            self.version, self.next_step = int(state["version"]), int(state["next_step"])
            self.groups = [Group(step=g["step"], order=g["order"], record=g["record"],
                                 prompt=list(g["prompt"]), rows=[Row(**r) for r in g["rows"]])
                           for g in state["groups"]]

    # -- the producer's side ------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="rollout-producer",
                                            daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._want is None and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                want = self._want
            try:
                self._work(want)
            except BaseException as e:  # handed to the trainer, which ends the run
                with self._cv:
                    self._error = e
            with self._cv:
                self._want, self._running = None, False
                self._cv.notify_all()
            if self._error is not None:
                return

    def _work(self, step: int) -> None:
        """Rounds until ``step``'s batch is complete, then the rounds beside the trainer."""
        while not self._complete(step):
            if not self._round():
                raise RolloutError(f"the batch of step {step} is incomplete and nothing is left "
                                   "to generate (the schedule is broken)")
        with self._cv:
            self._cv.notify_all()  # the batch is ready
        if self.schedule.abort_at_sync and self.threaded:
            while not self._stopping() and self._round():
                pass  # until the trainer syncs (it aborts the round in flight)
        else:
            self._round()

    def _stopping(self) -> bool:
        with self._cv:
            return self._stop or self._quiescing

    def _complete(self, step: int) -> bool:
        with self._cv:
            mine = [g for g in self.groups if g.step == step]
        if not mine and self.next_step <= step:
            return False  # not admitted yet
        return all(r.finish is not None for g in mine for r in g.rows)

    def _admit(self) -> None:
        s = self.schedule
        while self.next_step <= s.last_step and admissible(self.next_step, self.version,
                                                           s.staleness):
            step, seed = self.next_step, self.seed_of(self.next_step)
            groups = []
            for order, (record, prompt, first_row) in enumerate(self.draw(step)):
                rows = [Row(index=first_row + j,
                            seed=None if seed is None else seed * 7_919 + first_row + j)
                        for j in range(self.group_size)]
                groups.append(Group(step=step, order=order, record=record, prompt=list(prompt),
                                    rows=rows))
            with self._cv:
                self.groups += groups
                self.next_step += 1

    def _round(self) -> bool:
        """One round; False when there was nothing to generate."""
        self._admit()
        with self._cv:
            active = [(g, r) for g in self.groups for r in g.rows if r.finish is None]
            version = self.version
        if not active:
            return False
        start = time.monotonic()
        if hasattr(self.engine, "generate_rows"):
            self._row_round(active, version)
        else:
            self._group_round(active, version)
        with self._cv:
            self.busy.append((start, time.monotonic()))
        return True

    def _row_round(self, active: list, version: int) -> None:
        """Every active row's next segment, as one batch of row requests."""
        limit, segment = self.params.max_new_tokens, self.schedule.segment
        requests = [RowRequest(g.prompt + r.tokens,
                               min(segment, limit - len(r.tokens)) if segment else
                               limit - len(r.tokens), r.seed) for g, r in active]
        results = self.engine.generate_rows(requests, self.params, aborted_ok=True)
        for (_, r), req, res in zip(active, requests, results):
            self._extend(r, req, res, version)

    def _group_round(self, active: list, version: int) -> None:
        """An engine that generates whole groups (the local engine): each step's active groups
        in one call, as the synchronous loop makes it (the same prompts, seed and rows)."""
        groups = list({id(g): g for g, _ in active}.values())
        for step in sorted({g.step for g in groups}):
            mine = sorted((g for g in groups if g.step == step), key=lambda g: g.order)
            if any(r.tokens for g in mine for r in g.rows):
                raise RolloutError("this engine generates whole responses, not segments")
            seed = self.seed_of(step)
            params = dataclasses.replace(self.params, seed=seed)
            samples = self.engine.generate([g.prompt for g in mine], self.group_size, params,
                                           first_row=mine[0].rows[0].index)
            rows = [(g, r) for g in mine for r in g.rows]
            for (g, r), res in zip(rows, samples):
                self._extend(r, RowRequest(g.prompt, self.params.max_new_tokens, r.seed), res,
                             version)

    def _extend(self, row: Row, req: RowRequest, res: Sample, version: int) -> None:
        if res.response_ids and res.meta.get("weight_version") not in (None, "", str(version)):
            raise RolloutError(f"a response was generated by weight version "
                               f"{res.meta['weight_version']!r} while the producer expected "
                               f"{version} (a weight sync during a round?)")
        fed = len(req.input_ids) - 1  # the positions before this segment's first sampled token
        if res.routes_TLK is not None:
            row.routes = (res.routes_TLK.clone() if row.routes is None
                          else torch.cat([row.routes[:fed], res.routes_TLK[fed:]]))
        row.tokens += list(res.response_ids)
        row.logprobs += [float(x) for x in res.logprobs_R.reshape(-1)]
        row.versions += [version] * len(res.response_ids)
        if res.finish_reason == "stop":
            row.finish = "stop"
        elif len(row.tokens) >= self.params.max_new_tokens:
            row.finish = "length"

    def _sample(self, group: Group, row: Row) -> Sample:
        return Sample(prompt_ids=list(group.prompt), response_ids=list(row.tokens),
                      logprobs_R=torch.tensor(row.logprobs, dtype=torch.float32),
                      finish_reason=row.finish, routes_TLK=row.routes, prompt_index=group.order,
                      versions_R=torch.tensor(row.versions, dtype=torch.int64))

    # -- waiting -------------------------------------------------------------------------------------
    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.wait_s
        with self._cv:
            while not ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RolloutError(f"waited {self.wait_s:g} s for {what} (the producer "
                                       "made no progress: a server that stopped answering?)")
                self._cv.wait(timeout=min(left, 1.0))

    def _raise(self) -> None:
        if self._error is not None:
            e = self._error
            raise e if isinstance(e, RolloutError) else RolloutError(
                f"the rollout producer failed: {type(e).__name__}: {e}") from e
