"""Run as a fresh process with two intra-op threads (``python -m tests.intra_op_workers MODE``):
whether a gloo work thread that gathers a large object starts an OpenMP team of its own. Prints
one JSON line."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _mkl_threads() -> int:
    """MKL's count for this thread (2, the expected count, when torch has no MKL)."""
    from megatron_gspo.backends.cpu import threads as intra_op

    getter = intra_op._symbol(intra_op._loaded_library("libtorch_cpu", "libmkl"),
                              "MKL_Get_Max_Threads")
    if getter is None:  # torch without MKL
        assert not torch.backends.mkl.is_available()
        return 2
    getter.argtypes = []
    return getter()


def main(mode: str) -> dict:
    """``mode``: nopin (torch as it is), pin (``pin_to_this_thread``), init_parallel (the
    trainer's process-group setup, which pins)."""
    from megatron_gspo.backends.cpu import threads as intra_op

    out = {"before": {"this": torch.get_num_threads(), "new": intra_op.count_in_a_new_thread()}}
    out["pinned"] = intra_op.pin_to_this_thread() if mode == "pin" else False
    if mode == "init_parallel":
        from megatron_gspo.config import ModelConfig, ParallelConfig
        from megatron_gspo.distributed.parallel import init_parallel

        init_parallel(ParallelConfig(), ModelConfig())
    else:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    out["after"] = {"this": torch.get_num_threads(), "new": intra_op.count_in_a_new_thread(),
                    "mkl": _mkl_threads()}
    torch.ones(1 << 22).mul_(2.0).sum()  # this thread's own OpenMP team exists from here on
    small = [None]
    dist.all_gather_object(small, 1)  # the group's work threads and buffers exist from here on
    threads = _threads()
    big = [None]
    dist.all_gather_object(big, list(range(200_000)))  # ~1.2 MB pickled: a parallel copy
    out["gathered"] = big[0] == list(range(200_000))
    out["new_os_threads"] = _threads() - threads
    x = torch.randn(256, 256)
    out["matmul_ok"] = bool(torch.allclose(x @ x, (x.double() @ x.double()).float(), atol=1e-3))
    if mode == "init_parallel":
        from megatron_gspo.distributed.parallel import destroy_parallel

        destroy_parallel()
    else:
        dist.destroy_process_group()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
