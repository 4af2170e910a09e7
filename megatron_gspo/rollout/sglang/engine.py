"""SGLang rollout engine: the only module that speaks to SGLang (HTTP API of sglang 0.5.x).

- ``SGLangClient``: one server's HTTP API with timeouts and bounded retries with backoff
  (connection errors, timeouts, HTTP 5xx and malformed replies are retried; the error after the
  last attempt names the endpoint, the attempts and the last failure).
- ``SGLangEngine``: the ``Engine`` interface over one or more servers (or a router): generation
  with log-probs and routed experts, health, weight sync (from disk; over NCCL with
  ``update_weights_from_distributed``; colocated with ``update_weights_from_tensor``), memory
  release / resume for colocated runs.
- ``launch_server``: ``python -m sglang.launch_server`` with the flags this stack needs.

Legend: ``T`` positions fed to the model, ``L`` MoE layers, ``K`` top-k.
"""

from __future__ import annotations

import contextlib
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

from megatron_gspo.distributed import comm
from megatron_gspo.rollout.sglang.client import (RetryPolicy, SGLangClient, SGLangError,
                                                 parse_result, sampling_of)
from megatron_gspo.rollout.sglang.facade import serialize_named_tensors
from megatron_gspo.rollout.sglang.layout import ServerLayout, param_of
from megatron_gspo.rollout.sglang.weight_sync import SyncStats, count_sent
from megatron_gspo.rollout.types import RowRequest, Sample, SamplingParams, row_seed


class SGLangEngine:
    """``Engine`` over SGLang servers at ``urls``. A batch of responses goes out as requests of
    at most ``rows_per_request`` rows (SGLang's batched ``/generate``: lists of input ids and of
    sampling params), at most ``max_in_flight`` at a time, to ``router_url`` when given
    (sglang-router balances them), else round-robin over the servers; each request has its own
    retries, so a failed one is resent alone. Control calls (pause, weight updates, memory) go to
    every server, which the router does not relay. ``server_tp``: each server's tensor-parallel
    size (``update_weights_from_tensor`` sends one payload per TP rank). ``direct``: the
    servers' parameter layout (``sglang_layout.ServerLayout``, its ``tp`` equal to
    ``server_tp``); given, each TP rank's payload holds only its own shards in SGLang's names
    (``load_format: "direct"``), else every rank gets the full HF tensors and cuts its slice."""

    runs_on_every_rank = False  # a replica's leader talks to the servers

    def __init__(self, urls: Sequence[str], *, num_hidden_layers: int, top_k: int,
                 moe_layers: Sequence[int], return_routes: bool = False,
                 retry: Optional[RetryPolicy] = None, router_url: Optional[str] = None,
                 rows_per_request: int = 64, max_in_flight: int = 32, server_tp: int = 1,
                 direct: Optional[ServerLayout] = None, first_server: int = 0):
        if not urls:
            raise ValueError("SGLangEngine needs at least one server URL")
        if rows_per_request < 1 or max_in_flight < 1 or server_tp < 1:
            raise ValueError(f"rows_per_request={rows_per_request}, max_in_flight={max_in_flight}"
                             f", server_tp={server_tp}: each must be >= 1")
        self.clients = [SGLangClient(u, retry) for u in urls]
        self.router = SGLangClient(router_url, retry) if router_url else None
        self.routes_shape = (num_hidden_layers, top_k, list(moe_layers)) if return_routes else None
        self.rows_per_request, self.max_in_flight = rows_per_request, max_in_flight
        if direct is not None and direct.tp != server_tp:
            raise ValueError(f"direct layout for tp={direct.tp}, servers have tp={server_tp}")
        self.server_tp, self.direct = server_tp, direct
        self.weight_version = 0
        # Round-robin over the servers across calls, each replica's leader from its own
        # starting server: leaders' requests spread over every server from the first call on.
        self._next_server = first_server % len(self.clients)
        if self.router is not None:
            self.register_workers()

    def register_workers(self) -> None:
        """Add every server to the router (sglang-router 0.3: POST /workers, 202 = queued)."""
        known = {w.get("url") for w in self.router.request("GET", "/workers").get("workers", [])}
        for c in self.clients:
            if c.url not in known:
                self.router.request("POST", "/workers", {"url": c.url, "worker_type": "regular"})

    def health(self) -> bool:
        return all(c.healthy() for c in self.clients)

    def wait_ready(self, timeout_s: float = 1800.0) -> None:
        """Every server generates, within ``timeout_s`` in all (servers load in parallel)."""
        deadline = time.monotonic() + timeout_s
        for c in self.clients:
            c.wait_ready(timeout_s, deadline=deadline)

    def model_paths(self) -> dict:
        """server URL -> the checkpoint it was started from."""
        return {c.url: c.model_path() for c in self.clients}

    def generate(self, prompts: Sequence[Sequence[int]], samples_per_prompt: int,
                 params: SamplingParams, *, first_row: int = 0) -> list[Sample]:
        """``samples_per_prompt`` responses per prompt, in prompt order. With ``params.seed``,
        row r (counting from ``first_row`` in the step's global batch) is sent with
        ``sampling_seed = row_seed(seed, first_row + r)``: the rows of a group differ, and a
        server in deterministic-inference mode repeats them."""
        params.validate()
        rows = [(i, list(p)) for i, p in enumerate(prompts) for _ in range(samples_per_prompt)]
        requests = [RowRequest(prompt, params.max_new_tokens,
                               None if params.seed is None else row_seed(params.seed, first_row + r))
                    for r, (_, prompt) in enumerate(rows)]
        out = self.generate_rows(requests, params)
        for (index, _), sample in zip(rows, out):
            sample.prompt_index = index
        return out

    def generate_rows(self, requests: Sequence[RowRequest], params: SamplingParams, *,
                      aborted_ok: bool = False) -> list[Sample]:
        """One result per ``RowRequest`` (its own input, new-token limit and seed; the rest of
        ``params`` for all), in order. The rows go out as batched requests of
        ``rows_per_request``, ``max_in_flight`` at a time, to the router or round-robin over the
        servers. ``aborted_ok``: a row the servers aborted (a pause) returns the tokens it has,
        finish reason ``abort``, instead of failing the call."""
        base = sampling_of(params)
        sampling = [dict(base, max_new_tokens=int(r.max_new_tokens),
                         **({} if r.seed is None else {"sampling_seed": int(r.seed)}))
                    for r in requests]
        size = self.rows_per_request
        chunks = [range(a, min(a + size, len(requests))) for a in range(0, len(requests), size)]
        servers = [(self._next_server + j) % len(self.clients) for j in range(len(chunks))]
        self._next_server = (self._next_server + len(chunks)) % len(self.clients)

        def request(j: int) -> list:
            client = self.router or self.clients[servers[j]]
            part = chunks[j]
            return client.generate_rows([requests[r].input_ids for r in part],
                                        [sampling[r] for r in part],
                                        return_routed_experts=self.routes_shape is not None)

        if len(chunks) <= 1 or self.max_in_flight == 1:
            replies = [request(j) for j in range(len(chunks))]
        else:
            with ThreadPoolExecutor(max_workers=min(self.max_in_flight, len(chunks))) as pool:
                futures = [pool.submit(request, j) for j in range(len(chunks))]
                replies = [f.result() for f in futures]  # the first failure, after all finished
        return [parse_result(item, requests[r].input_ids, routes_shape=self.routes_shape,
                             aborted_ok=aborted_ok)
                for part, reply in zip(chunks, replies) for r, item in zip(part, reply)]

    # -- pausing and versions --------------------------------------------------------------------
    def pause(self, mode: str = "abort") -> None:
        """Every server stops generating: ``abort`` ends the requests in flight, which return
        the tokens they have (finish reason ``abort``); new requests wait until ``resume``."""
        self._each("/pause_generation", {"mode": mode})

    def resume(self) -> None:
        self._each("/continue_generation", {})

    def abort_all(self) -> None:
        """Every request in flight on every server ends now and returns the tokens it has
        (finish reason ``abort``); later requests are served as usual (SGLang answers an empty
        200)."""
        for c in self.clients:
            c.request("POST", "/abort_request", {"abort_all": True}, expect_json=False)

    def check_version(self, version) -> None:
        """Every server reports weight version ``version`` (after an update)."""
        for c in self.clients:
            got = c.weight_version()
            if got != str(version):
                raise SGLangError(f"{c.url}: weight version {got!r} after the update to "
                                  f"{version!r}")

    # -- weights ----------------------------------------------------------------------------------
    def _each(self, path: str, payload: Optional[dict] = None) -> None:
        for c in self.clients:
            c.post(path, payload)

    def _flush(self) -> None:
        for c in self.clients:
            c.request("GET", "/flush_cache", expect_json=False)

    @contextlib.contextmanager
    def _paused(self):
        """Generation paused on every server for a weight update; the cache is flushed after it
        and generation continues whatever happens."""
        self.pause("abort")
        try:
            yield
            self._flush()
        finally:
            self._each("/continue_generation", {})

    def update_weights_from_disk(self, hf_dir: str, version=None) -> None:
        """Servers reload HF weights from ``hf_dir`` (a path they can read), labelled
        ``version`` (default: the next)."""
        self.weight_version = self.weight_version + 1 if version is None else version
        self.pause("abort")
        try:
            self._each("/update_weights_from_disk",
                       {"model_path": hf_dir, "weight_version": str(self.weight_version),
                        "flush_cache": True})
        finally:
            self._each("/continue_generation", {})

    def update_weights(self, source) -> None:
        """``source``: a directory of an HF checkpoint the servers can read."""
        self.update_weights_from_disk(source)

    def _distributed_bucket(self, named_tensors: Sequence[tuple], group,
                            group_name: str = "weight_update_group") -> None:
        """One bucket over ``group`` (see ``init_weights_update_group``): each server's
        ``/update_weights_from_distributed`` call is pending while rank 0 broadcasts the tensors,
        from the device they live on, in the same order."""
        import threading

        import torch.distributed as dist

        payload = {"names": [n for n, _ in named_tensors],
                   "dtypes": [str(t.dtype).replace("torch.", "") for _, t in named_tensors],
                   "shapes": [list(t.shape) for _, t in named_tensors],
                   "group_name": group_name, "flush_cache": False,
                   "weight_version": str(self.weight_version)}
        errors = []

        def call(client):
            try:
                client.post("/update_weights_from_distributed", payload)
            except Exception as e:  # reported after the broadcasts
                errors.append(e)

        threads = [threading.Thread(target=call, args=(c,)) for c in self.clients]
        for t in threads:
            t.start()
        for _, tensor in named_tensors:
            dist.broadcast(tensor.contiguous(), group_src=0, group=group)
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def update_weights_from_distributed(self, named_tensors: Sequence[tuple], group,
                                        group_name: str = "weight_update_group") -> None:
        """Broadcast HF-named tensors (one bucket) from trainer rank 0 over ``group``."""
        self.weight_version += 1
        with self._paused():
            self._distributed_bucket(named_tensors, group, group_name)

    def _tensor_bucket(self, named_tensors: Sequence[tuple]) -> int:
        """Colocated servers: one serialized payload per server TP rank (TP rank i reads entry
        i). With a ``direct`` layout, rank i's holds only its own shards, made from the bucket
        one rank at a time (CUDA tensors travel as IPC handles and stay alive until the call
        returns); else each holds the bucket's full HF tensors, which the rank shards as it
        loads them. Returns the bytes of the tensors serialized for one server (``hf``: the
        bucket once, the same payload going to every rank)."""
        if self.direct is None:
            blob = serialize_named_tensors(named_tensors)
            entries, load_format = [blob] * self.server_tp, None
            sent = sum(t.numel() * t.element_size() for _, t in named_tensors)
        else:
            hf, entries, alive, sent = dict(named_tensors), [], [], 0
            for rank in range(self.server_tp):
                shards = self.direct.rank_shards(hf, rank)
                entries.append(serialize_named_tensors(shards))
                sent += sum(t.numel() * t.element_size() for _, t in shards)
                if any(t.is_cuda for _, t in shards):
                    alive.append(shards)
                del shards
            load_format = "direct"
        self._each("/update_weights_from_tensor",
                   {"serialized_named_tensors": entries, "load_format": load_format,
                    "flush_cache": False, "weight_version": str(self.weight_version)})
        return sent

    def update_weights_from_tensor(self, named_tensors: Sequence[tuple]) -> None:
        self.weight_version += 1
        with self._paused():
            self._tensor_bucket(named_tensors)

    def sync_from_model(self, gpt, model_cfg, ctx, *, mode: str = "disk",
                        disk_dir: Optional[str] = None, group=None,
                        bucket_bytes: int = 512 << 20, version=None) -> Optional[SyncStats]:
        """Push the trainer's weights; every rank calls. The model goes out under HF names one
        bucket of about ``bucket_bytes`` at a time (``hf_qwen3moe.iter_hf_buckets``: shards
        come to rank 0 straight from their device), sent ``mode="distributed"`` (broadcast over
        ``group`` from ``init_weights_update_group``), ``"tensor"`` (colocated servers) or
        ``"disk"`` (a checkpoint in ``disk_dir``, one shard per bucket, that the servers must be
        able to read; for debugging). With a ``direct`` layout a bucket holds at least one whole
        SGLang parameter (a layer's q/k/v, or its experts' gate and up weights), so where one is
        larger than ``bucket_bytes`` (a Qwen3-30B-A3B layer's experts: 805 MB in bf16) the extra
        memory is about twice that parameter instead of two buckets. ``version`` labels the
        weights (``weight_version``; default: the next). Rank 0 returns what was sent, the
        others None."""
        from megatron_gspo.models.hf_io import ShardWriter
        from megatron_gspo.models.hf_config import hf_config_from_model
        from megatron_gspo.models.hf_mapping import iter_hf_buckets

        if mode not in ("disk", "distributed", "tensor"):
            raise ValueError(f"weight sync mode {mode!r}; valid: disk, distributed, tensor")
        if mode == "disk" and disk_dir is None:
            raise ValueError("weight sync from disk needs disk_dir")
        t0 = time.perf_counter()
        leader = ctx.rank == 0
        sent = [0, 0, 0]  # tensors, bytes, buckets
        group_of = param_of if mode == "tensor" and self.direct is not None else None
        if mode == "disk":
            writer = ShardWriter(disk_dir) if leader else None
            send = writer.write if leader else None
        else:
            send = (functools.partial(self._distributed_bucket, group=group)
                    if mode == "distributed" else self._tensor_bucket)
            if leader:
                self.weight_version = self.weight_version + 1 if version is None else version
                self.pause("abort")
        # Every rank drives the buckets to the end (they are collectives), even after the
        # leader failed to send one; the failure is raised on every rank afterwards.
        error = None
        try:
            for bucket in iter_hf_buckets(gpt, model_cfg, ctx, bucket_bytes, group_of=group_of):
                if leader and error is None:
                    try:
                        count_sent(sent, bucket, send(bucket))
                    except Exception as e:
                        error = e
                del bucket  # before the next one is gathered: two buckets at most
            if leader and error is None:
                if mode == "disk":
                    writer.close(hf_config_from_model(model_cfg))
                    self.update_weights_from_disk(disk_dir, version)
                else:
                    self._flush()
        except Exception as e:
            error = error or e
        finally:
            if leader and mode != "disk":
                self._each("/continue_generation", {})
        if comm.any_rank(error is not None, device=ctx.device):
            raise error if error is not None else SGLangError(
                "weight sync failed on rank 0 (its error is in rank 0's log)")
        if not leader:
            return None
        return SyncStats(mode, sent[0], sent[1], sent[2], time.perf_counter() - t0)

    def release_memory(self, tags: Optional[list] = None) -> None:
        self._each("/release_memory_occupation", {"tags": tags})

    def resume_memory(self, tags: Optional[list] = None) -> None:
        self._each("/resume_memory_occupation", {"tags": tags})

    def shutdown(self) -> None:
        return None
