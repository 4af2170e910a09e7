"""Megatron's RNG tracker on the CPU generator."""

from __future__ import annotations

import contextlib

import torch

from megatron_gspo.backends.cpu.adaptation import Adaptation


def _cpu_tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's named RNG streams, kept as CPU generator states.

        Megatron forks named CUDA RNG streams around weight init and dropout; on a CPU-only torch
        every ``torch.cuda.*rng_state`` call raises. The streams keep their meaning (independent per
        TP/EP rank) but live on the CPU default generator.
        """

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            orig_name = self._current_state_name
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)
                self._current_state_name = orig_name

    return CpuRNGStatesTracker


def _rng_needed() -> bool:
    from megatron.core.tensor_parallel import random as mrandom

    try:
        mrandom.CudaRNGStatesTracker().add("probe", 1)
    except (RuntimeError, AssertionError, AttributeError):
        return True
    return False


def _rng_apply() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = _cpu_tracker_class()()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _rng_active() -> bool:
    from megatron.core.tensor_parallel import random as mrandom

    return type(mrandom._CUDA_RNG_STATE_TRACKER).__name__ == "CpuRNGStatesTracker"


def _no_cuda_rng_state(*_args, **_kwargs) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _ignore_cuda_rng_state(*_args, **_kwargs) -> None:
    return None


def _checkpoint_rng_needed() -> bool:
    from megatron.core.tensor_parallel import random as mrandom

    try:
        mrandom._get_cuda_rng_state()
    except (RuntimeError, AssertionError):
        return True
    return False


def _checkpoint_rng_apply() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = _no_cuda_rng_state
    mrandom._set_cuda_rng_state = _ignore_cuda_rng_state


def _checkpoint_rng_active() -> bool:
    from megatron.core.tensor_parallel import random as mrandom

    return mrandom._get_cuda_rng_state is _no_cuda_rng_state


def seed_rng_tracker(seed: int, *, tp_rank: int, ep_rank: int, etp_rank: int) -> None:
    """CPU twin of megatron's ``model_parallel_cuda_manual_seed`` (same per-rank seed offsets)."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = _cpu_tracker_class()()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


RNG_TRACKER = Adaptation(
    "rng_tracker", "Megatron's RNG tracker keeps CUDA generator states; a CPU-only torch raises "
    "on every torch.cuda RNG call", _rng_needed, _rng_apply, _rng_active)
CHECKPOINT_RNG = Adaptation(
    "checkpoint_rng", "activation recomputation saves and restores the CUDA generator state; on "
    "CPU the CPU generator and the tracker's (CPU) states, which it also saves, are the whole RNG "
    "state", _checkpoint_rng_needed, _checkpoint_rng_apply, _checkpoint_rng_active)
