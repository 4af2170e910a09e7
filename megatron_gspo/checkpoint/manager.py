"""Training checkpoints: Megatron dist_checkpointing (sharded) for the model and the optimizer, plus
the trainer's own state, written atomically and resumable exactly.

Layout of ``ROOT`` (the run directory's ``checkpoints/``)::

    latest                 name of the newest complete checkpoint (updated last)
    step_000010/           model + optimizer shards (dist_checkpointing, any layout can read them)
        trainer_state.json step, LR scheduler, data position, counters, layout, resolved config
        rng/rank_00000.pt  every RNG state of each rank (Python, numpy, torch, Megatron's tracker)
        MANIFEST.json      every file and its size, written last: its presence means complete
    .tmp-step_000012/      a checkpoint being written; renamed into place when complete

A checkpoint whose manifest is missing or does not match the files (a kill while writing, a
truncated copy) is skipped with a warning on resume; leftover ``.tmp-*`` directories are removed by
the next save. The optimizer's moments are saved ``dp_reshardable`` on GPUs (each rank writes its
own shard: no gather, bounded host memory; they load into another data-parallel size) and
``fully_reshardable`` on CPU or when asked (``trainer.checkpoint_format``: gathered onto each DP
group's rank 0 over gloo; they load into any TP / PP / EP / DP layout). Weights load into any
layout either way; when the new layout cannot take the saved moments (another model-parallel
layout of ``dp_reshardable`` moments, or an optimizer split into other expert-parallel groups) the
weights, schedule and data position load and the moments restart, with a warning.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_gspo.backends import backend_for
from megatron_gspo.distributed import comm
from megatron_gspo.distributed.parallel import ParallelContext
from megatron_gspo.trainer.optim import prefer_fused_adam, sub_optimizers, torch_optimizers


LATEST = "latest"
MANIFEST = "MANIFEST.json"
STATE = "trainer_state.json"
STEP_DIR = re.compile(r"^step_(\d{6,})$")


class CheckpointError(RuntimeError):
    """No loadable checkpoint where one was required; the message names the path and the reason."""


def _warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr, flush=True)


def optimizer_has_state(optimizer, device: torch.device) -> bool:
    """Whether any sub-optimizer has taken a step (has moments to save); the same on every rank
    (a collective over the world, on ``device``)."""
    local = any(len(getattr(o, "optimizer", o).state) for o in sub_optimizers(optimizer))
    return comm.any_rank(local, device=device)


def optimizer_signature(optimizer) -> list:
    """How the optimizer is split into sub-optimizers (dense / expert groups): checkpoints of
    optimizers with the same signature load into each other across layouts."""
    return [sorted({bool(g.get("is_expert_parallel", False)) for g in o.param_groups})
            for o in sub_optimizers(optimizer)]


OPTIMIZER_FORMATS = ("dp_reshardable", "fully_reshardable")


def optimizer_format(requested: str, device: torch.device) -> str:
    """The distributed optimizer's checkpoint format for ``trainer.checkpoint_format``: ``auto``
    is the device's backend's: ``dp_reshardable`` on GPUs (every rank writes its own shard of the
    moments from where it lives: no gather, nothing of the model's size on the host; loads into
    another data-parallel size only), ``fully_reshardable`` on CPU (loads into any layout)."""
    if requested == "auto":
        return backend_for(device).checkpoint_format
    if requested not in OPTIMIZER_FORMATS:
        raise ValueError(f"checkpoint format {requested!r}; valid: auto, "
                         f"{', '.join(OPTIMIZER_FORMATS)}")
    return requested


def _sharding_metadata(fmt: str) -> dict:
    meta = {"distrib_optim_sharding_type": fmt}
    if fmt == "fully_reshardable":
        # Gathered over the gloo data-parallel group onto DP rank 0 only (Megatron's default
        # all-gathers over NCCL onto every rank: each would hold its model-parallel shard's
        # whole fp32 state on the host).
        meta["distrib_optim_fully_reshardable_mem_efficient"] = True
    return meta


def _model_parallel(layout: Optional[dict]) -> tuple:
    return tuple((layout or {}).get(k) for k in ("tp", "pp", "ep", "etp", "cp"))


def _prepare_optimizer(optimizer, ctx: ParallelContext, loading: bool) -> None:
    """A data-parallel group that is a gloo group already (the CPU's) is what megatron's
    gloo-gather path reads as ``data_parallel_group_gloo`` when it has none. Loading into torch's Adam (no TE / apex) needs its state
    allocated first, which megatron does with a zero-gradient step. That step sets every Adam
    ``step`` to 1: only do it (``loading``) when the checkpoint's moments and steps will overwrite
    it, else a fresh optimizer would start one step ahead (smaller bias-corrected first update)."""
    for opt in sub_optimizers(optimizer):
        if not hasattr(opt, "data_parallel_group"):
            continue  # not a distributed optimizer
        if (getattr(opt, "data_parallel_group_gloo", None) is None
                and dist.get_backend(opt.data_parallel_group) == "gloo"):
            opt.data_parallel_group_gloo = opt.data_parallel_group
        if loading and len(opt.optimizer.state) == 0:
            opt._init_optimizer_states_with_dummy_values()


def _writer_results_queue() -> None:
    """dist_checkpointing's file writer hands the write results to the saving process through a
    queue that it creates, once per process, from a ``multiprocessing.Manager``: a server process
    that outlives a trainer killed with SIGKILL (holding its stdout and stderr open). Our saves
    are synchronous: the results are put and read in this process, which a thread-safe in-process
    queue does without any helper process."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _layout(ctx: ParallelContext) -> dict:
    return {k: getattr(ctx, k) for k in ("world_size", "tp", "pp", "ep", "cp", "etp", "dp")}


def _manifest(path: str) -> dict:
    files = {}
    for base, _, names in os.walk(path):
        for name in names:
            full = os.path.join(base, name)
            files[os.path.relpath(full, path)] = os.path.getsize(full)
    return files


def _fsync_write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def check_complete(path: str) -> Optional[str]:
    """None when ``path`` is a complete checkpoint, else the reason it is not."""
    manifest = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest):
        return "no manifest (incomplete write)"
    try:
        with open(manifest) as f:
            files = json.load(f)["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"corrupt manifest ({e})"
    for name, size in files.items():
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return f"missing file {name}"
        if os.path.getsize(full) != size:
            return f"file {name} has {os.path.getsize(full)} bytes, the manifest says {size}"
    return None


class CheckpointManager:
    """Saves and finds checkpoints under ``root``; every rank calls ``save`` and ``load``."""

    def __init__(self, root: str, ctx: ParallelContext, *, keep: int = 2, fmt: str = "auto"):
        self.root, self.ctx, self.keep = os.path.abspath(root), ctx, keep
        self.format = optimizer_format(fmt, ctx.device)

    # -- saving ------------------------------------------------------------------------------------
    def save(self, step: int, *, model, optimizer, state: dict,
             before_commit: Optional[Callable[[], None]] = None,
             rank_state: Optional[dict] = None) -> str:
        """Write checkpoint ``step``: shards, per-rank RNG, ``state`` (JSON), the manifest, then the
        rename and the ``latest`` pointer. ``before_commit`` runs on rank 0 after the shards are on
        disk and before anything is committed (fault injection in tests). ``rank_state``: this
        rank's own state (a rollout producer's), saved beside its RNG state."""
        from megatron.core import dist_checkpointing

        name = f"step_{step:06d}"
        final, tmp = os.path.join(self.root, name), os.path.join(self.root, f".tmp-{name}")
        rank0 = self.ctx.rank == 0
        if rank0:
            os.makedirs(self.root, exist_ok=True)
            for leftover in os.listdir(self.root):
                if leftover.startswith(".tmp-"):  # an interrupted save
                    shutil.rmtree(os.path.join(self.root, leftover), ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        _prepare_optimizer(optimizer, self.ctx, loading=False)
        _writer_results_queue()
        model_sd = model.sharded_state_dict()
        sharded = {"model": model_sd}
        # A fresh optimizer (step 0) has no state to save.
        has_optimizer = optimizer_has_state(optimizer, self.ctx.device)
        if has_optimizer:
            sharded["optimizer"] = optimizer.sharded_state_dict(
                model_sd, is_loading=False, metadata=_sharding_metadata(self.format))
        dist_checkpointing.save(sharded, tmp)
        if rank0:
            os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
        dist.barrier()
        torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{self.ctx.rank:05d}.pt"))
        if rank_state is not None:
            torch.save(rank_state, os.path.join(tmp, "rng", f"state_{self.ctx.rank:05d}.pt"))
        dist.barrier()
        if rank0:
            full_state = dict(state, step=step, layout=_layout(self.ctx), has_optimizer=has_optimizer,
                              optimizer_signature=optimizer_signature(optimizer),
                              optimizer_format=self.format)
            _fsync_write(os.path.join(tmp, STATE), json.dumps(full_state, indent=1))
            if before_commit is not None:
                before_commit()
            _fsync_write(os.path.join(tmp, MANIFEST),
                         json.dumps({"step": step, "files": _manifest(tmp)}, indent=1))
            if os.path.exists(final):  # a re-save of the same step (after a resume)
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_write(os.path.join(self.root, LATEST + ".tmp"), name)
            os.replace(os.path.join(self.root, LATEST + ".tmp"), os.path.join(self.root, LATEST))
            self._prune()
        dist.barrier()
        return final

    def _prune(self) -> None:
        steps = sorted(self._step_dirs(), reverse=True)
        for _, name in steps[self.keep:]:
            shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def _step_dirs(self) -> list:
        if not os.path.isdir(self.root):
            return []
        out = []
        for name in os.listdir(self.root):
            m = STEP_DIR.match(name)
            if m:
                out.append((int(m.group(1)), name))
        return out

    # -- finding and loading -------------------------------------------------------------------------
    def candidates(self) -> list[str]:
        """Complete checkpoints, newest first: ``latest`` first if valid; incomplete or corrupt
        ones are skipped with a warning (rank 0 decides, every rank gets the same list)."""
        holder = [None]
        if self.ctx.rank == 0:
            found, seen = [], set()
            pointer = os.path.join(self.root, LATEST)
            names = []
            if os.path.isfile(pointer):
                with open(pointer) as f:
                    names.append(f.read().strip())
            names += [n for _, n in sorted(self._step_dirs(), reverse=True)]
            for name in names:
                if name in seen or not name:
                    continue
                seen.add(name)
                path = os.path.join(self.root, name)
                problem = check_complete(path) if os.path.isdir(path) else "does not exist"
                if problem:
                    _warn(f"skipping checkpoint {path}: {problem}")
                    continue
                found.append(path)
            holder[0] = found
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def load(self, path: str, *, model, optimizer) -> dict:
        """Load ``path`` into ``model`` and ``optimizer`` (every rank); returns the trainer state.
        RNG states are restored when the layout is the one that saved them."""
        from megatron.core import dist_checkpointing

        with open(os.path.join(path, STATE)) as f:
            state = json.load(f)
        saved_optimizer = state.get("has_optimizer", True)
        fmt = state.get("optimizer_format", "fully_reshardable")
        same_optimizer = (saved_optimizer
                          and state.get("optimizer_signature") == optimizer_signature(optimizer))
        # dp_reshardable moments load into another data-parallel size only.
        resharded = (same_optimizer and fmt == "dp_reshardable"
                     and _model_parallel(state.get("layout")) != _model_parallel(_layout(self.ctx)))
        same_optimizer = same_optimizer and not resharded
        # Dummy states only when the checkpoint's optimizer state replaces them: a checkpoint
        # without one (step 0, or another split) must leave the optimizer fresh (no Adam step).
        _prepare_optimizer(optimizer, self.ctx, loading=same_optimizer)
        model_sd = model.sharded_state_dict()
        sharded = {"model": model_sd}
        if same_optimizer:
            sharded["optimizer"] = optimizer.sharded_state_dict(
                model_sd, is_loading=True, metadata=_sharding_metadata(fmt))
        loaded = dist_checkpointing.load(sharded, path)
        missing, _ = model.load_state_dict(loaded["model"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing:
            raise CheckpointError(f"{path}: checkpoint lacks {missing[0]} "
                                  f"(and {len(missing) - 1} more)")
        if same_optimizer:
            optimizer.load_state_dict(loaded["optimizer"])
            prefer_fused_adam(optimizer)  # param groups saved before it took the fused kernel
            _unshare_adam_steps(optimizer)
        else:
            # The model weights are loaded into the model; the fresh optimizer's fp32 main copy
            # must follow them.
            _reload_main_params(optimizer)
            if resharded and self.ctx.rank == 0:
                _warn(f"{path}: its optimizer moments were saved dp_reshardable from model-"
                      f"parallel layout {state.get('layout')}, which loads into another data-"
                      "parallel size only; its moments restart (save with "
                      "trainer.checkpoint_format=fully_reshardable before changing tp/pp/ep/cp)")
            elif saved_optimizer and self.ctx.rank == 0:
                _warn(f"{path}: the optimizer was split differently when saved "
                      f"({state.get('optimizer_signature')} vs {optimizer_signature(optimizer)}); "
                      "its moments restart")
        rng = os.path.join(path, "rng", f"rank_{self.ctx.rank:05d}.pt")
        if state.get("layout") == _layout(self.ctx) and os.path.isfile(rng):
            _set_rng_state(torch.load(rng, weights_only=False))
        elif self.ctx.rank == 0:
            _warn(f"{path}: saved from layout {state.get('layout')}, resuming on "
                  f"{_layout(self.ctx)}: RNG streams are reseeded")
        return state


    def load_rank_state(self, path: str) -> Optional[dict]:
        """This rank's own state saved in ``path`` (``save(rank_state=)``), or None; saved on
        another layout it belongs to other ranks: an error."""
        with open(os.path.join(path, STATE)) as f:
            layout = json.load(f).get("layout")
        file = os.path.join(path, "rng", f"state_{self.ctx.rank:05d}.pt")
        if not os.path.isfile(file):
            return None
        if layout != _layout(self.ctx):
            raise CheckpointError(f"{path}: its rollout producers' state was saved on layout "
                                  f"{layout}; resume an asynchronous run on that layout")
        return torch.load(file, weights_only=False)


def _unshare_adam_steps(optimizer) -> None:
    """Megatron restores torch Adam's per-parameter ``step`` (kept once in the param groups) as
    one tensor object shared by every parameter's state; torch's foreach Adam increments each
    parameter's step in place, so a shared one advances once per parameter per update and the
    bias correction after a resume is wrong. Each state gets its own copy, where torch keeps it:
    on the parameter's device for the fused kernel, else on the host."""
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state.get(p, {})
                if torch.is_tensor(state.get("step")):
                    device = p.device if group.get("fused") else torch.device("cpu")
                    state["step"] = state["step"].clone().to(device)


def _reload_main_params(optimizer) -> None:
    """Copy the model weights into the optimizer's fp32 main parameters (after a weights-only load)."""
    for opt in sub_optimizers(optimizer):
        reload = getattr(opt, "reload_model_params", None)
        if reload is not None:
            reload()


# -- a checkpoint as a source of weights (export, evaluation) -------------------------------------
