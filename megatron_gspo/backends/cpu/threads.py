"""torch's intra-op (OpenMP) threads: the training thread keeps its count, every other thread runs
its kernels on one.

Adaptation of torch's OpenMP threading (libgomp, and MKL's per-thread count) to a process whose
collectives run in gloo's work threads. torch gives each thread, when it first runs an ATen
kernel, the process-wide intra-op count of ``torch.set_num_threads`` (or the core count). A gloo
work thread that copies a large tensor (``all_gather_object`` of a checkpoint's metadata, a list
all-gather's flattening) therefore starts an OpenMP team of its own: one more libgomp worker,
kept for as long as the process group lives. Once libgomp manages more threads than the process
has CPUs it throttles the spin-waiting of every team (with ``OMP_WAIT_POLICY=active`` 1,000 spins
instead of 30 billion; by default 100 instead of 300,000), so the training thread's team sleeps
in the kernel and is woken between parallel regions, for the rest of the run. On 2 cores one
checkpoint save (Megatron's ``all_gather_object`` of the sharding metadata) made every later RL
step of the benchmark's compute shape about 30% slower with ``OMP_WAIT_POLICY=active``
(docs/performance.md, "The release after 78b3229"), and a rollout 84% slower with the default
policy.

``pin_to_this_thread()`` keeps the calling thread's count and makes one the count that every
other thread takes: torch's process-wide count is set to 1 and the calling thread's own OpenMP
(and MKL) counts are set back. Threads that ran a kernel before keep what they took, so the
trainer pins before it creates any process group. Where torch does not run on OpenMP or the
libraries' setters are not found, nothing is changed.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Callable, Optional

import torch


def _loaded_library(*fragments: str) -> list:
    """ctypes handles of the shared libraries this process has loaded whose file names contain one
    of ``fragments`` (Linux: ``/proc/self/maps``); loading an already loaded library returns it."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps
                            if "/" in line and any(f in os.path.basename(line.split()[-1])
                                                   for f in fragments)})
    except OSError:
        return []
    handles = []
    for path in paths:
        try:
            handles.append(ctypes.CDLL(path))
        except OSError:
            continue
    return handles


def _symbol(handles: list, name: str) -> Optional[Callable]:
    for handle in handles:
        fn = getattr(handle, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            return fn
    return None


def _setters() -> Optional[tuple]:
    """(OpenMP's ``omp_set_num_threads``, MKL's per-thread count setter or None when torch
    has no MKL) of the libraries torch runs with; None when torch does not use OpenMP or either
    setter it needs is not found."""
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    omp = _symbol(_loaded_library("libgomp", "libiomp", "libomp"), "omp_set_num_threads")
    if omp is None:
        return None
    if not torch.backends.mkl.is_available():
        return omp, None
    # MKL's C entry point (by value); the lower-case ``mkl_set_num_threads_local`` that the
    # libraries export is its Fortran interface, which takes a pointer.
    mkl = _symbol(_loaded_library("libtorch_cpu", "libmkl"), "MKL_Set_Num_Threads_Local")
    return None if mkl is None else (omp, mkl)


def count_in_a_new_thread() -> int:
    """The intra-op thread count a thread gets when it first runs torch work."""
    seen = []
    probe = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    probe.start()
    probe.join()
    return seen[0]


def pin_to_this_thread() -> bool:
    """Keep this thread's intra-op count and give every other thread one (see the module's
    docstring). Idempotent; returns whether it is in force."""
    setters = _setters()
    if setters is None:
        return False
    omp, mkl = setters
    n = torch.get_num_threads()  # also settles this thread's own count before the global changes
    torch.set_num_threads(1)  # what any thread takes when it first runs torch work
    omp(n)
    if mkl is not None:
        mkl(n)
    return torch.get_num_threads() == n and count_in_a_new_thread() == 1
