"""Where one step's behaviour (old-policy) log-probs come from, decided once per step.

The ratios of every update are taken against the behaviour log-probs of the rows. They come
from the rollout engine (its log-probs of the sampled tokens: no pass at all) or from the
trainer's forward-only pass on the old policy; the first mini-batch's may come from its own
update's forward, which runs on the old policy too (bitwise what the pass would give, one forward
fewer); the pass records routes for R2 (and for the drift probe), or replays the engine's for
R3. ``plan_behaviour`` makes these choices from the job, the device and whether the drift probe
reads the pass; the trainer's behaviour phase and its updates follow the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gspo.backends import backend_for
from megatron_gspo.config import JobConfig


def behaviour_source(job: JobConfig, device_type: str) -> str:
    """``algo.old_logprobs`` resolved: "engine" or "recompute". ``auto`` takes the engine's
    where the engine is the trainer's own model in fp32 on CPU (the local engine shares its
    parameters and computes the same log-probs to float rounding: a pass would recompute them),
    the trainer's pass elsewhere: a separate engine (SGLang), GPU kernels or bf16 (decoding and
    the full forward round differently, at times by more than GSPO's clip range), R2 and R3
    (which record or replay routes in the pass), rollout correction (which weighs the engine's
    log-probs against the pass's)."""
    a = job.algo
    if a.old_logprobs != "auto":
        return a.old_logprobs
    same_model = (job.rollout.engine == "local" and backend_for(device_type).exact_engine
                  and job.model.params_dtype == "float32")
    return ("engine" if same_model and job.replay.mode == "none"
            and a.rollout_correction == "none" else "recompute")


@dataclass(frozen=True)
class BehaviourPlan:
    """How one step's behaviour log-probs are obtained.

    ``source``: "engine" (the rollout engine's, no pass) or "recompute" (the trainer's pass).
    ``first_from_update``: the first mini-batch's rows are pending until their update's forward
    on the old policy gives them (the pass, if any, skips those rows).
    ``record_routes``: the pass records each micro-batch's routes (R2 replays them in the
    updates; the drift probe reads the first).
    ``replay``: "none", "r2" (the updates replay the pass's routes) or "r3" (the pass and the
    updates replay the engine's).
    ``probe_reads_pass``: the drift probe takes the pass's first forward (its rows are the probed
    ones) instead of a forward of its own.
    """

    source: str
    first_from_update: bool
    record_routes: bool
    replay: str
    probe_reads_pass: bool

    @property
    def runs_pass(self) -> bool:
        return self.source == "recompute"

    @property
    def replays_routes(self) -> bool:
        return self.replay in ("r2", "r3")


def plan_behaviour(job: JobConfig, device_type: str, *, records_routes: bool,
                   probe_would_read_pass: bool) -> BehaviourPlan:
    """The step's plan. ``records_routes``: the model has a route recorder (replay or drift);
    ``probe_would_read_pass``: a drift probe runs and could read the pass's first forward
    (padded rows, natural routes).

    The first mini-batch's behaviour log-probs come from its update's forward unless something
    reads them before the updates (R2's recorded routes, rollout correction, a probe reading the
    pass) or the engine's are asked for on every row (``algo.old_logprobs=engine``)."""
    source = behaviour_source(job, device_type)
    probe_reads_pass = probe_would_read_pass and source == "recompute"
    first_from_update = (job.replay.mode != "r2" and job.algo.rollout_correction == "none"
                         and job.algo.old_logprobs != "engine" and not probe_reads_pass)
    record = (records_routes and source == "recompute" and job.replay.mode != "r3"
              and not first_from_update)
    return BehaviourPlan(source=source, first_from_update=first_from_update,
                         record_routes=record, replay=job.replay.mode,
                         probe_reads_pass=probe_reads_pass)
