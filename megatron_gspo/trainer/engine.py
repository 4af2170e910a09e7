"""The run's rollout engine: built from the job, connected to its SGLang servers, and given the
trainer's weights after every step."""

from __future__ import annotations

import os
import socket
import time
import urllib.parse
from typing import Callable, Optional

import torch

from megatron_gspo.config import ConfigError, JobConfig
from megatron_gspo.distributed import comm
from megatron_gspo.distributed.parallel import ParallelContext
from megatron_gspo.backends import backend_for
from megatron_gspo.rollout.local_engine import LocalEngine
from megatron_gspo.rollout.static_decode import StaticGenerator
from megatron_gspo.rollout.sglang.client import RetryPolicy, SGLangError
from megatron_gspo.rollout.sglang.engine import SGLangEngine
from megatron_gspo.rollout.sglang.layout import ServerLayout
from megatron_gspo.rollout.sglang.weight_sync import (destroy_weights_update_group,
                                                      init_weights_update_group)
from megatron_gspo.rollout.types import RolloutError
from megatron_gspo.trainer.asynchronous import overlap_metrics
from megatron_gspo.trainer.run import Engine, Run
from moe.replay import RoutingReplay


def make_engine(job: JobConfig, gpt, ctx: ParallelContext, replay: Optional[RoutingReplay],
                pad_id: int) -> Engine:
    """The local engine (the trainer's own model; it records routes for R3 and drift), or the
    SGLang client of this rank's replica (its requests start at server ``dp_rank``)."""
    if job.rollout.engine == "local":
        record = replay if (job.replay.mode == "r3" or job.logging.drift) else None
        # Expert parallelism spans data-parallel ranks, which generate different prompts: the
        # whole world decodes in lockstep then.
        lockstep = torch.distributed.group.WORLD if ctx.ep > 1 and ctx.dp > 1 else None
        r = job.rollout
        static = (StaticGenerator(gpt, pad_id=pad_id, readback_steps=r.decode_readback_steps,
                                  compile=r.compile_decode, cuda_graphs=r.cuda_graphs)
                  if backend_for(ctx.device).static_decode else None)
        return LocalEngine(gpt, ctx, replay=record, pad_id=pad_id, lockstep_group=lockstep,
                           static=static)
    r, m = job.rollout, job.model
    moe_layers = [i for i, x in enumerate(m.moe_layer_pattern) if x]
    direct = (ServerLayout(m, tp=r.sglang_gpus_per_server, ep=r.sglang_ep_per_server)
              if r.weight_sync == "tensor" and r.tensor_sync_format == "direct" else None)
    retry = RetryPolicy(timeout_s=r.sglang_control_timeout_s,
                        generate_timeout_s=r.sglang_generate_timeout_s,
                        update_timeout_s=r.sglang_update_timeout_s)
    return SGLangEngine(r.sglang_urls, num_hidden_layers=m.num_layers,
                        top_k=m.top_k, moe_layers=moe_layers, return_routes=r.return_routes,
                        router_url=r.sglang_router_url, rows_per_request=r.sglang_rows_per_request,
                        max_in_flight=r.sglang_max_in_flight, retry=retry,
                        server_tp=r.sglang_gpus_per_server, direct=direct,
                        first_server=ctx.dp_rank)


def connect_servers(job: JobConfig, engine: SGLangEngine, ctx: ParallelContext,
                    say: Callable[[str], None]) -> None:
    """SGLang: every replica's leader waits until each server generates (they load for minutes
    while the trainer starts) and checks that each serves ``rollout.sglang_model_path``; every
    rank agrees on the outcome before the first weight sync."""
    r = job.rollout
    problem, config_problem = None, None
    if ctx.is_replica_leader:
        t0 = time.perf_counter()
        try:
            engine.wait_ready(r.sglang_startup_timeout_s)
            for url, served in engine.model_paths().items():
                if os.path.normpath(served) != os.path.normpath(r.sglang_model_path):
                    config_problem = (f"rollout.sglang_model_path={r.sglang_model_path!r}: the "
                                      f"server at {url} serves {served!r}; fix: start every "
                                      "server from the trainer's checkpoint, or name the one "
                                      "they serve")
                    break
        except SGLangError as e:
            problem = str(e)
        if ctx.rank == 0 and problem is None and config_problem is None:
            say(f"sglang: {len(engine.clients)} server(s) ready after "
                f"{time.perf_counter() - t0:.1f} s, serving {r.sglang_model_path}")
    if comm.any_rank(config_problem is not None, device=ctx.device):
        raise ConfigError(config_problem or "rollout.sglang_model_path: a server serves another "
                          "checkpoint (named in its replica leader's log)")
    if comm.any_rank(problem is not None, device=ctx.device):
        raise SGLangError(problem or "an SGLang server is not ready (named in its replica "
                          "leader's log)")


def sync_address(job: JobConfig) -> str:
    """The address SGLang's servers reach trainer rank 0 at for the weight-update group:
    ``rollout.weight_sync_address``, else the address of this host's interface that routes to
    the first server (a connected UDP socket sends nothing; a host name can resolve to another
    interface, or not at all, on the servers' nodes)."""
    r = job.rollout
    if r.weight_sync_address:
        return r.weight_sync_address
    host = urllib.parse.urlparse(r.sglang_urls[0]).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def sync_weights(run: Run, version: int) -> dict:
    """Push the updated weights, labelled policy ``version``, to the rollout engine (the local
    engine shares them). With asynchronous rollouts the producer's round ends first (SGLang's
    protocol: pause, update, continue; every server then reports ``version``); returns the
    overlap metrics of the step."""
    job, ctx, engine, producer = run.job, run.ctx, run.engine, run.producer
    metrics = (overlap_metrics(producer, run.trained_from, time.monotonic())
               if producer is not None and run.trained_from else {})
    if job.rollout.mode != "sync":
        _on_every_rank(ctx, producer.quiesce if producer is not None else None)
    if job.rollout.engine == "local":
        engine.update_weights(None)
    else:
        r = job.rollout
        if r.weight_sync == "distributed" and run.sync_group is None and ctx.rank == 0:
            # SGLang's servers join rank 0 of the trainer in one group for the broadcasts (NCCL
            # on GPUs; gloo on CPU, where only the test stand-in serves).
            run.sync_group = init_weights_update_group(
                engine, master_address=sync_address(job), master_port=r.weight_sync_port,
                engine_gpus=[r.sglang_gpus_per_server] * len(engine.clients),
                backend="nccl" if ctx.device.type == "cuda" else "gloo",
                timeout_s=r.sglang_update_timeout_s)
        stats = engine.sync_from_model(
            run.policy.gpt, job.model, ctx, mode=r.weight_sync,
            disk_dir=os.path.join(job.run_dir, "weight_sync"), group=run.sync_group,
            bucket_bytes=int(r.weight_sync_bucket_mb * 2**20), version=version)
        if stats is not None:
            run.logger.say(stats.describe())
        if r.mode != "sync":
            _on_every_rank(ctx, (lambda: engine.check_version(version))
                           if ctx.is_replica_leader else None)
    if producer is not None:
        producer.set_version(version)
    return metrics


def _on_every_rank(ctx: ParallelContext, call: Optional[Callable[[], None]]) -> None:
    """``call`` where given (a replica leader's part of a sync); its failure ends the sync on
    every rank, so that none waits in a collective the failed one never joins."""
    error = None
    if call is not None:
        try:
            call()
        except RolloutError as e:
            error = e
    if comm.any_rank(error is not None, device=ctx.device):
        raise error if error is not None else RolloutError(
            "a replica leader's rollout failed at the weight sync (its error is in its log)")


def close_engine(run: Run) -> None:
    """The producer stopped, the weight-update group left on both sides (a later run in this
    process builds its own)."""
    if run.producer is not None:
        run.producer.close()
    if run.sync_group is not None:
        destroy_weights_update_group(run.engine, run.sync_group)
        run.sync_group = None
