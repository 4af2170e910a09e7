"""Spawn real gloo ranks for a test: each rank is a fresh process with a torchrun-like environment.

``run_ranks(fn, world_size, *args)`` runs ``fn(*args)`` on every rank and returns the per-rank
return values (anything ``torch.save`` can serialise). A failure on any rank raises with that rank's
traceback; a hang past ``timeout`` kills every rank.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import sys
import traceback
import warnings

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)  # megatron's "apex/TE not installed"
    try:
        value = fn(*args)
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # report everything, including SystemExit, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            if "megatron.core.parallel_state" in sys.modules:  # only tear down what was set up
                from megatron_gspo.parallel import destroy_parallel

                destroy_parallel()
            elif torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        except Exception:
            pass


def run_ranks(fn, world_size: int, *args, timeout: float = 300.0) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, results), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out, errors = {}, []
    try:
        for _ in range(world_size):
            rank, ok, payload = results.get(timeout=timeout)
            if ok:
                out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    except queue.Empty:
        errors.append(f"ranks did not finish within {timeout:.0f} s")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [out[r] for r in range(world_size)]
