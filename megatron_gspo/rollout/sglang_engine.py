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

import base64
import contextlib
import functools
import io
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from megatron_gspo import comm
from megatron_gspo.rollout.sglang_layout import ServerLayout, param_of
from megatron_gspo.rollout.types import Sample, SamplingParams, row_seed

try:  # pragma: no cover - sglang is a GPU-only dependency
    import sglang  # noqa: F401

    HAVE_SGLANG = True
except Exception:
    HAVE_SGLANG = False

INSTALL_HINT = "install it with `pip install -e .[rollout]` on a CUDA machine"
# The SGLang release this client is written and checked against (its HTTP API: /generate with
# return_routed_experts, the weight-update endpoints, pause / continue); the GPU image pins it
# (tests/test_image_pins.py).
SGLANG_VERSION = "0.5.15.post1"


class SGLangError(RuntimeError):
    """A request to an SGLang server failed for good; the message says which and why."""


def require_sglang(what: str) -> None:
    if not HAVE_SGLANG:
        raise ImportError(f"{what} needs sglang, which is not installed: {INSTALL_HINT}")


@dataclass(frozen=True)
class RetryPolicy:
    """Retries and timeouts of one server's calls, per kind of endpoint. ``timeout_s`` bounds one
    attempt of a control call (health, pause, continue, flush, model info, memory), which is
    retried; ``generate_timeout_s`` one batched ``/generate`` (minutes for long responses),
    also retried; ``update_timeout_s`` one weight-update call, which is sent once: a repeated
    ``/update_weights_from_distributed`` would wait for a broadcast that never comes, and a
    repeated group join or reload is no safer."""

    attempts: int = 4
    backoff_s: float = 0.5  # doubled after every failed attempt
    timeout_s: float = 60.0
    generate_timeout_s: float = 3600.0
    update_timeout_s: float = 1800.0


# Calls that change a server's weights (or its weight-update group): sent once, never retried.
UPDATE_ENDPOINTS = ("/update_weights_from_disk", "/update_weights_from_distributed",
                    "/update_weights_from_tensor", "/init_weights_update_group")


class SGLangClient:
    """One SGLang server (or router) at ``url``."""

    def __init__(self, url: str, retry: Optional[RetryPolicy] = None):
        self.url = url.rstrip("/")
        self.retry = retry or RetryPolicy()

    def _policy(self, path: str) -> tuple[int, float]:
        """(attempts, seconds per attempt) of a call to ``path``."""
        if path in UPDATE_ENDPOINTS:
            return 1, self.retry.update_timeout_s
        if path == "/generate":
            return self.retry.attempts, self.retry.generate_timeout_s
        return self.retry.attempts, self.retry.timeout_s

    def request(self, method: str, path: str, payload: Optional[dict] = None, *,
                expect_json: bool = True, timeout_s: Optional[float] = None):
        data = None if payload is None else json.dumps(payload).encode()
        last = "no attempt made"
        delay = self.retry.backoff_s
        attempts, default_timeout = self._policy(path)
        for attempt in range(1, attempts + 1):
            req = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=timeout_s or default_timeout) as r:
                    body = r.read()
                if not expect_json:
                    return body.decode(errors="replace")
                try:
                    return json.loads(body)
                except json.JSONDecodeError as e:
                    last = f"malformed JSON reply ({e.msg} at {e.pos})"
            except urllib.error.HTTPError as e:
                detail = e.read()[:300].decode(errors="replace")
                if e.code < 500:  # the request itself is wrong: retrying cannot help
                    raise SGLangError(f"{method} {self.url}{path}: HTTP {e.code}: {detail}") from None
                last = f"HTTP {e.code}: {detail}"
            except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError) as e:
                reason = getattr(e, "reason", e)
                last = f"{type(reason).__name__}: {reason}"
            except OSError as e:  # e.g. connection reset while reading the body
                last = f"{type(e).__name__}: {e}"
            if attempt < attempts:
                time.sleep(delay)
                delay *= 2
        if attempts == 1:
            raise SGLangError(f"{method} {self.url}{path} failed (a weight update is sent once, "
                              f"never retried): {last}")
        raise SGLangError(f"{method} {self.url}{path} failed after {attempts} attempts: {last}")

    # -- endpoints --------------------------------------------------------------------------------
    def healthy(self) -> bool:
        """One probe of ``/health_generate`` (200 once the server generates), not retried."""
        req = urllib.request.Request(self.url + "/health_generate", method="GET")
        try:
            with urllib.request.urlopen(req, timeout=self.retry.timeout_s) as r:
                r.read()
            return True
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError, OSError):
            return False

    def wait_ready(self, timeout_s: float = 1800.0, poll_s: float = 2.0, *,
                   deadline: Optional[float] = None) -> None:
        """Poll ``/health_generate`` until the server generates (it answers 503, or nothing,
        while it loads), at most ``timeout_s`` (or until the ``time.monotonic`` deadline)."""
        deadline = time.monotonic() + timeout_s if deadline is None else deadline
        while True:
            if self.healthy():
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise SGLangError(f"{self.url}: not ready after {timeout_s:g} s (GET "
                                  "/health_generate never answered 200; is the server up, and "
                                  "is its log free of errors?)")
            time.sleep(min(poll_s, left))

    def model_path(self) -> str:
        """The checkpoint the server was started from (``/model_info``'s ``model_path``)."""
        info = self.request("GET", "/model_info")
        if not isinstance(info, dict) or "model_path" not in info:
            raise SGLangError(f"GET {self.url}/model_info: no model_path in the reply")
        return str(info["model_path"])

    def generate(self, input_ids: Sequence[Sequence[int]], params: SamplingParams, *,
                 seeds: Optional[Sequence[int]] = None,
                 return_routed_experts: bool = False) -> list:
        """One batched ``/generate`` request: one result per row of ``input_ids``; ``seeds`` (one
        per row) become each row's ``sampling_seed``."""
        sampling = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
                    "top_p": params.top_p, "top_k": params.top_k,
                    "stop_token_ids": list(params.stop_token_ids)}
        if seeds is not None:
            if len(seeds) != len(input_ids):
                raise ValueError(f"{len(seeds)} seeds for {len(input_ids)} rows")
            sampling = [dict(sampling, sampling_seed=int(seed)) for seed in seeds]
        elif params.seed is not None:
            sampling["sampling_seed"] = params.seed
        payload = {"input_ids": [list(x) for x in input_ids], "sampling_params": sampling,
                   "return_logprob": True, "logprob_start_len": -1}
        if return_routed_experts:
            payload["return_routed_experts"] = True
        reply = self.request("POST", "/generate", payload)
        if not isinstance(reply, list) or len(reply) != len(input_ids):
            got = f"{len(reply)} results" if isinstance(reply, list) else type(reply).__name__
            raise SGLangError(f"POST {self.url}/generate: expected a list of {len(input_ids)} "
                              f"results, got {got}")
        return reply

    def post(self, path: str, payload: Optional[dict] = None) -> dict:
        reply = self.request("POST", path, payload or {})
        if isinstance(reply, dict) and reply.get("success") is False:
            raise SGLangError(f"POST {self.url}{path}: {reply.get('message', 'failed')}")
        return reply


def decode_routes(blob: str, rows: int, num_layers: int, top_k: int,
                  moe_layers: Sequence[int]) -> torch.Tensor:
    """``meta_info.routed_experts`` (base64 int32 [rows, HF layers, K]) -> [rows, L_moe, K]."""
    flat = np.frombuffer(base64.b64decode(blob), dtype=np.int32)
    if flat.size != rows * num_layers * top_k:
        raise SGLangError(f"routed_experts holds {flat.size} ids, expected {rows} x {num_layers} x "
                          f"{top_k}")
    return torch.from_numpy(flat.reshape(rows, num_layers, top_k)[:, list(moe_layers)].copy()).long()


def parse_result(item: dict, prompt: Sequence[int], *, routes_shape=None) -> Sample:
    """One /generate result -> Sample (tokens, log-probs, finish reason, routes)."""
    try:
        meta = item["meta_info"]
        output_ids = list(item["output_ids"])
        logprobs = [float(x[0]) for x in meta["output_token_logprobs"]]
        reason = meta["finish_reason"]["type"]
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise SGLangError(f"/generate result lacks {e} (keys: {sorted(item)})") from None
    if len(logprobs) != len(output_ids):
        raise SGLangError(f"/generate result has {len(output_ids)} tokens but {len(logprobs)} "
                          "log-probs")
    if reason == "abort":
        raise SGLangError(f"/generate aborted: {meta['finish_reason'].get('message', '')}")
    routes = None
    if routes_shape is not None:
        blob = meta.get("routed_experts")
        if blob is None:
            raise SGLangError("/generate returned no routed_experts: start the server with "
                              "--enable-return-routed-experts (sglang drops the request field "
                              "silently without it)")
        num_layers, top_k, moe_layers = routes_shape
        routes = decode_routes(blob, len(prompt) + len(output_ids) - 1, num_layers, top_k,
                               moe_layers)
    return Sample(prompt_ids=list(prompt), response_ids=output_ids,
                  logprobs_R=torch.tensor(logprobs), finish_reason=reason, routes_TLK=routes)


@dataclass(frozen=True)
class SyncStats:
    """One weight sync: what was sent and how long it took."""

    mode: str
    tensors: int  # HF tensors
    # Bytes the trainer sent: the HF tensors for disk, distributed (one broadcast reaches every
    # server rank) and tensor with hf payloads (one payload repeated per TP rank); for tensor with
    # direct payloads, the shards of all TP ranks of one server.
    bytes: int
    buckets: int
    seconds: float

    def describe(self) -> str:
        return (f"weight sync ({self.mode}): {self.tensors} tensors, {self.bytes / 2**20:.1f} MiB "
                f"in {self.buckets} buckets, {self.seconds:.2f} s")


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
        seeds = (None if params.seed is None
                 else [row_seed(params.seed, first_row + r) for r in range(len(rows))])
        size = self.rows_per_request
        chunks = [range(a, min(a + size, len(rows))) for a in range(0, len(rows), size)]
        want_routes = self.routes_shape is not None
        servers = [(self._next_server + j) % len(self.clients) for j in range(len(chunks))]
        self._next_server = (self._next_server + len(chunks)) % len(self.clients)

        def request(j: int) -> list:
            client = self.router or self.clients[servers[j]]
            part = chunks[j]
            return client.generate([rows[r][1] for r in part], params,
                                   seeds=None if seeds is None else [seeds[r] for r in part],
                                   return_routed_experts=want_routes)

        if len(chunks) <= 1 or self.max_in_flight == 1:
            replies = [request(j) for j in range(len(chunks))]
        else:
            with ThreadPoolExecutor(max_workers=min(self.max_in_flight, len(chunks))) as pool:
                futures = [pool.submit(request, j) for j in range(len(chunks))]
                replies = [f.result() for f in futures]  # the first failure, after all finished
        out = []
        for part, reply in zip(chunks, replies):
            for r, item in zip(part, reply):
                index, prompt = rows[r]
                sample = parse_result(item, prompt, routes_shape=self.routes_shape)
                sample.prompt_index = index
                out.append(sample)
        return out

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
        self._each("/pause_generation", {})
        try:
            yield
            self._flush()
        finally:
            self._each("/continue_generation", {})

    def update_weights_from_disk(self, hf_dir: str) -> None:
        """Servers reload HF weights from ``hf_dir`` (a path they can read)."""
        self.weight_version += 1
        self._each("/pause_generation", {})
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
                        bucket_bytes: int = 512 << 20) -> Optional[SyncStats]:
        """Push the trainer's weights; every rank calls. The model goes out under HF names one
        bucket of about ``bucket_bytes`` at a time (``hf_qwen3moe.iter_hf_buckets``: shards
        come to rank 0 straight from their device), sent ``mode="distributed"`` (broadcast over
        ``group`` from ``init_weights_update_group``), ``"tensor"`` (colocated servers) or
        ``"disk"`` (a checkpoint in ``disk_dir``, one shard per bucket, that the servers must be
        able to read; for debugging). With a ``direct`` layout a bucket holds at least one whole
        SGLang parameter (a layer's q/k/v, or its experts' gate and up weights), so where one is
        larger than ``bucket_bytes`` (a Qwen3-30B-A3B layer's experts: 805 MB in bf16) the extra
        memory is about twice that parameter instead of two buckets. Rank 0 returns what was
        sent, the others None."""
        from megatron_gspo.hf_qwen3moe import ShardWriter, hf_config_from_model, iter_hf_buckets

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
                self.weight_version += 1
                self._each("/pause_generation", {})
        # Every rank drives the buckets to the end (they are collectives), even after the
        # leader failed to send one; the failure is raised on every rank afterwards.
        error = None
        try:
            for bucket in iter_hf_buckets(gpt, model_cfg, ctx, bucket_bytes, group_of=group_of):
                if leader and error is None:
                    try:
                        _count(sent, bucket, send(bucket))
                    except Exception as e:
                        error = e
                del bucket  # before the next one is gathered: two buckets at most
            if leader and error is None:
                if mode == "disk":
                    writer.close(hf_config_from_model(model_cfg))
                    self.update_weights_from_disk(disk_dir)
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


def _count(sent: list, bucket: Sequence[tuple], nbytes: Optional[int]) -> None:
    """Add a bucket to ``sent`` (tensors, bytes, buckets): ``nbytes`` sent for it, or (None)
    the bytes of its HF tensors."""
    sent[0] += len(bucket)
    sent[1] += sum(t.numel() * t.element_size() for _, t in bucket) if nbytes is None else nbytes
    sent[2] += 1


def serialize_named_tensors(named_tensors: Sequence[tuple]) -> str:
    """One ``serialized_named_tensors`` entry: CUDA tensors as SGLang's
    ``MultiprocessingSerializer`` makes them (CUDA IPC handles; keep the tensors alive until the
    call returns); host tensors, which only the test stand-in receives since SGLang serves on
    GPUs, as a ``torch.save`` of the same (name, tensor) list. Base64 text either way."""
    named = list(named_tensors)
    if any(t.is_cuda for _, t in named):
        require_sglang("update_weights_from_tensor")
        from sglang.srt.utils import MultiprocessingSerializer  # pragma: no cover

        return base64.b64encode(MultiprocessingSerializer.serialize(named)).decode()
    buf = io.BytesIO()
    torch.save(named, buf)
    return base64.b64encode(buf.getvalue()).decode()


def init_weights_update_group(engine: SGLangEngine, *, master_address: str, master_port: int,
                              engine_gpus: Sequence[int], group_name: str = "weight_update_group",
                              backend: str = "nccl", timeout_s: float = 600.0):
    """The trainer's side of SGLang's weight-update group: rank 0 is the trainer, server i joins
    at rank 1 + sum of the GPUs of servers before it. The trainer group is built the way SGLang
    builds its side (TCP store under a PrefixStore named ``group_name``); a plain
    ``init_process_group`` uses other store keys and hangs."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world

    world = 1 + sum(engine_gpus)
    errors = []

    def join(client, offset):
        try:
            client.post("/init_weights_update_group",
                        {"master_address": master_address, "master_port": master_port,
                         "rank_offset": offset, "world_size": world, "group_name": group_name,
                         "backend": backend})
        except Exception as e:
            errors.append(e)

    for client in engine.clients:  # a group left by an earlier run under this name refuses joins
        try:
            client.post("/destroy_weights_update_group", {"group_name": group_name})
        except SGLangError:
            pass  # none there
    offsets = [1 + sum(engine_gpus[:i]) for i in range(len(engine_gpus))]
    threads = [threading.Thread(target=join, args=(c, o)) for c, o in zip(engine.clients, offsets)]
    for t in threads:
        t.start()
    built = {}

    def build():
        try:
            store = dist.TCPStore(master_address, master_port, world, is_master=True,
                                  timeout=timedelta(seconds=timeout_s))
            prefix = dist.PrefixStore(group_name, store)
            built["group"], _ = _new_process_group_helper(
                world, 0, [], backend, prefix, group_name=group_name,
                timeout=timedelta(seconds=timeout_s))
        except Exception as e:
            built["error"] = e

    # The rendezvous waits for every server; a server that refuses to join ends the wait.
    builder = threading.Thread(target=build, daemon=True)
    builder.start()
    while builder.is_alive():
        if errors:
            raise SGLangError(f"weight-update group {group_name!r}: a server did not join: "
                              f"{errors[0]}")
        builder.join(0.1)
    for t in threads:
        t.join()
    if errors or "error" in built:
        raise errors[0] if errors else built["error"]
    group = built["group"]
    # The group is outside the trainer's world: its ranks are its own (as SGLang registers them),
    # which collectives need to translate group ranks.
    _world.pg_group_ranks[group] = {i: i for i in range(world)}
    return group


def destroy_weights_update_group(engine: SGLangEngine, group,
                                 group_name: str = "weight_update_group") -> None:
    """Leave the weight-update group on both sides (the servers refuse a new group under a name
    they hold, and so does this process): at the end of a run, best effort."""
    import torch.distributed as dist

    for client in engine.clients:
        try:
            client.post("/destroy_weights_update_group", {"group_name": group_name})
        except SGLangError:
            pass  # a server that is gone holds no group
    dist.destroy_process_group(group)


def launch_server(model_path: str, *, port: int, host: str = "127.0.0.1", tp: int = 1,
                  ep: int = 1, routed_experts: bool = True, memory_saver: bool = False,
                  extra: Sequence[str] = ()) -> subprocess.Popen:
    """Start ``python -m sglang.launch_server`` (token ids in and out, no tokenizer)."""
    require_sglang("launching an SGLang server")
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host",
           host, "--port", str(port), "--tp-size", str(tp), "--ep-size", str(ep),
           "--skip-tokenizer-init", "--disable-radix-cache"]
    if routed_experts:
        cmd.append("--enable-return-routed-experts")
    if memory_saver:
        cmd += ["--enable-memory-saver", "--enable-weights-cpu-backup"]
    return subprocess.Popen(cmd + list(extra))
