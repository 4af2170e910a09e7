"""Checkpoints, resume, requeue and the run's end."""

from __future__ import annotations

import os
import signal

from megatron_gspo.checkpoint.export import export_hf_dir, hf_config_at
from megatron_gspo.checkpoint.weights import load_weights, save_weights
from megatron_gspo.config.load import job_to_dict
from megatron_gspo.trainer.faults import REQUEUE_MARKER, StopRequested
from megatron_gspo.trainer.run import Run
from megatron_gspo.trainer.setup import build_rl_optimizer


def save(run: Run, step: int) -> str:
    """Checkpoint ``step``: the model, the optimizer, and what the trainer needs to resume."""
    policy = run.policy
    state = {"scheduler": policy.scheduler.state_dict(), "data": run.prompts.train.state_dict(),
             "guard": policy.guard.state_dict(), "updates": policy.updates,
             "history": run.history, "config": job_to_dict(run.job)}
    kill = _kill if run.job.trainer.kill_during_save == step else None
    mine = {"producer": run.producer.state_dict()} if run.producer is not None else None
    path = run.ckpt.save(step, model=policy.gpt, optimizer=policy.optimizer, state=state,
                         before_commit=kill, rank_state=mine)
    if step == 0 and policy.ref_model is not None:
        save_weights(policy.ref_model, os.path.join(run.job.run_dir, "reference"), run.job.model)
    return path


def _kill() -> None:
    """Fault injection (``trainer.kill_during_save``): die with the shards written, nothing
    committed."""
    os.kill(os.getpid(), signal.SIGKILL)


def resume(run: Run) -> bool:
    """Load the checkpoint ``setup`` chose (``run.resume_from``); False for a fresh run."""
    if run.resume_from is None:
        return False
    path, changes = run.resume_from.path, run.resume_from.changes
    policy = run.policy
    build_rl_optimizer(run.job, policy, run.ctx)
    state = run.ckpt.load(path, model=policy.gpt, optimizer=policy.optimizer)
    policy.scheduler.load_state_dict(state["scheduler"])
    run.prompts.train.load_state_dict(state["data"])
    policy.guard.load_state_dict(state["guard"])
    policy.updates, run.step = int(state["updates"]), int(state["step"])
    run.history = dict(state.get("history", {}))
    if run.producer is not None:  # the groups it admitted, generated in part or whole
        mine = run.ckpt.load_rank_state(path)
        run.producer.load_state_dict(mine["producer"] if mine else run.producer.fresh(run.step))
    if policy.ref_model is not None:
        load_weights(policy.ref_model, os.path.join(run.job.run_dir, "reference"))
    run.logger.truncate_after(run.step)
    _clear_requeue_marker(run)
    run.logger.say(f"resumed from {path} (step {run.step}, {policy.updates} updates)")
    if changes:
        shown = ", ".join(f"{k} {was!r} -> {now!r}" for k, was, now in changes[:6])
        more = f" and {len(changes) - 6} more" if len(changes) > 6 else ""
        run.logger.say(f"the configuration differs from the checkpoint's: {shown}{more}")
    return True


def export_policy(run: Run) -> str:
    """The trained policy as a Hugging Face directory, ``RUN_DIR/hf`` (bucket by bucket)."""
    job = run.job
    out = os.path.join(job.run_dir, "hf")
    export_hf_dir(run.policy.gpt, job.model, run.ctx, out, hf_config=hf_config_at(job.trainer.init_from),
                  tokenizer=job.data.tokenizer,
                  bucket_bytes=int(job.rollout.weight_sync_bucket_mb * 2**20))
    run.logger.say(f"exported the policy to {out}")
    return out


def stop_for_requeue(run: Run, signame: str, path: str) -> None:
    """The checkpoint for a stop signal is written: leave the requeue marker, give the signal to
    an earlier handler (a launcher's), else exit with the requeue code."""
    if run.ctx.rank == 0:
        with open(os.path.join(run.job.run_dir, REQUEUE_MARKER), "w") as f:
            f.write(f"{signame} {path}\n")
    run.logger.close()
    run.signals.chain()
    raise StopRequested(signame, path)


def _clear_requeue_marker(run: Run) -> None:
    marker = os.path.join(run.job.run_dir, REQUEUE_MARKER)
    if run.ctx.rank == 0 and os.path.exists(marker):
        os.remove(marker)


def report(run: Run) -> None:
    h = run.history
    run.logger.say(f"held-out accuracy: {h.get('accuracy_before_rl', float('nan')):.3f} before RL "
                   f"-> {h['accuracy_after_rl']:.3f} after {run.job.trainer.steps} RL steps")
    if run.drift is not None:
        run.drift.close(run.ctx)
