"""Fault handling: stop signals agreed on by every rank, and the non-finite update guard.

Exit codes of ``python -m megatron_gspo`` (the SLURM scripts in ``launch/`` read them):

- ``0``  finished;
- ``75`` (``REQUEUE_EXIT_CODE``, EX_TEMPFAIL) stopped by SIGTERM or SIGUSR2 after writing a
  checkpoint at the step boundary: requeue the job and it resumes from that checkpoint. The
  trainer also writes ``RUN_DIR/REQUEUE`` (the checkpoint's path), since launchers such as
  torchrun report a worker's failure with their own exit code;
- ``2``  bad configuration (nothing ran);
- ``3``  too many consecutive non-finite updates (the last good checkpoint is intact);
- ``4``  the rollout failed for good (a server that stopped answering or refused an update, a
  timeout): the last checkpoint is intact, rerun to resume;
- anything else: a crash.
"""

from __future__ import annotations

import signal
from typing import Optional

import torch

from megatron_gspo.distributed import comm


REQUEUE_EXIT_CODE = 75
CONFIG_EXIT_CODE = 2
NONFINITE_EXIT_CODE = 3
ROLLOUT_EXIT_CODE = 4
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)
REQUEUE_MARKER = "REQUEUE"


class NonFiniteError(RuntimeError):
    """Too many non-finite updates in a row."""


class StopRequested(SystemExit):
    """Raised by the trainer after the checkpoint for a stop signal is written."""

    def __init__(self, signame: str, checkpoint: str):
        super().__init__(REQUEUE_EXIT_CODE)
        self.signame, self.checkpoint = signame, checkpoint


class StopSignals:
    """Records SIGTERM / SIGUSR2 in a handler (nothing else happens in it); ``agreed`` tells every
    rank, at a step boundary, whether any rank received one."""

    def __init__(self):
        self.received: Optional[int] = None
        self._previous = {}

    def install(self) -> "StopSignals":
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, _frame) -> None:
        self.received = signum

    def chain(self) -> None:
        """After the checkpoint: hand the signal to the handler that was installed before ours,
        if it is a Python function (submitit's, which requeues the job itself)."""
        previous = self._previous.get(self.received)
        if callable(previous):
            previous(self.received, None)

    def agreed(self, device: torch.device) -> Optional[str]:
        """The signal's name if any rank has received one (a collective over the world: every
        rank calls)."""
        signum = comm.reduce_max_int(self.received or 0, device=device)
        return signal.Signals(signum).name if signum else None


class NonFiniteGuard:
    """Counts skipped updates; raises ``NonFiniteError`` after ``max_consecutive`` in a row."""

    def __init__(self, max_consecutive: int):
        self.max_consecutive = max_consecutive
        self.skipped = 0
        self.consecutive = 0

    def check(self, finite: bool, where: str) -> bool:
        """Record one update; True when it may be applied."""
        if finite:
            self.consecutive = 0
            return True
        self.skipped += 1
        self.consecutive += 1
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteError(f"{self.consecutive} consecutive non-finite updates (last at {where})"
                                 f"; stopping with the last good checkpoint intact")
        return False

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.skipped, self.consecutive = int(state["skipped"]), int(state["consecutive"])


def all_finite(loss: Optional[torch.Tensor], grad_buffers: list, *, device: torch.device) -> bool:
    """True when the loss and every local gradient are finite on every rank (a collective over
    the world)."""
    tensors = ([loss] if loss is not None else []) + list(grad_buffers)
    # A tensor's sum is finite exactly when all its values are (a NaN or an infinity reaches
    # the sum; finite gradients do not add up to 3e38): one read of each buffer instead of the
    # several passes of isfinite, and one host sync for all of them.
    sums = [t.sum(dtype=torch.float32) if t.dtype != torch.float64 else t.sum() for t in tensors]
    local = bool(torch.isfinite(torch.stack(sums)).all()) if tensors else True
    return comm.all_ranks(local, device=device)
