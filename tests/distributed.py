"""Start real gloo ranks for a test: each rank is a fresh process with a torchrun-like environment.

``run_ranks(fn, world_size, *args)`` runs ``fn(*args)`` on every rank and returns the per-rank
return values (anything ``torch.save`` can serialise). A failure on any rank raises with that rank's
traceback; a hang past ``timeout`` kills every rank.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import sys
import traceback
import warnings

import torch


# Ranks start from a fork server that has imported these once (torch and megatron-core take
# about 8 s to import on a 2-core machine, per process): each rank is still a fresh process,
# forked before any thread pool, process group or model exists.
PRELOAD = ["megatron_gspo.trainer.loop", "megatron_gspo.models.hf_mapping", "tests.trainer_workers"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # used when the server starts (on first use)
    return ctx


def _inherit(parent) -> None:
    """What a spawned rank would inherit from the parent now (the fork server holds its own):
    environment, working directory, import path, and stdout / stderr (wherever the parent's point
    now, e.g. pytest's capture files; opened for appending)."""
    pid, environ, cwd, path = parent
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = path
    for fd in (1, 2):
        try:
            target = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:  # not reopenable (a socket): keep the server's
            continue
        os.dup2(target, fd)
        os.close(target)


def _entry(rank, world_size, port, fn, args, results, parent):
    _inherit(parent)
    # As under torchrun: the launcher holds the store (listening before any rank starts, on a
    # port the system picked) and every rank joins it as a client; subprocesses inherit that,
    # as torchrun's do. (A rank keeps its world: a second world on the same store would read
    # the first one's keys.)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), TORCHELASTIC_USE_AGENT_STORE="True")
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
                from megatron_gspo.distributed.parallel import destroy_parallel

                destroy_parallel()
            elif torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        except Exception:
            pass


def run_ranks(fn, world_size: int, *args, timeout: float = 300.0) -> list:
    ctx = _context()
    results = ctx.Queue()
    store = torch.distributed.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                                       wait_for_workers=False)
    port = store.port
    parent = (os.getpid(), dict(os.environ), os.getcwd(), list(sys.path))
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, results, parent),
                         daemon=False)
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


def _each_layout(cases):
    """In one rank: ``fn(*args)`` for every ``(fn, args)`` case, Megatron's groups torn down in
    between (each case builds its own layout on the same world)."""
    from megatron_gspo.distributed.parallel import destroy_parallel

    out = []
    for fn, args in cases:
        out.append(fn(*args))
        destroy_parallel(keep_process_group=True)
    return out


def run_layouts(world_size: int, cases: list, timeout: float = 600.0) -> list:
    """``fn(*args)`` for each ``(fn, args)`` case, one after another in the same ``world_size``
    ranks (one spawn for several layouts); returns, per case, the per-rank return values."""
    per_rank = run_ranks(_each_layout, world_size, cases, timeout=timeout)
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(cases))]
