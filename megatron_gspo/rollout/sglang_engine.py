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
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from megatron_gspo.rollout.types import Sample, SamplingParams

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


@dataclass
class RetryPolicy:
    attempts: int = 4
    backoff_s: float = 0.5  # doubled after every failed attempt
    timeout_s: float = 120.0


class SGLangClient:
    """One SGLang server (or router) at ``url``."""

    def __init__(self, url: str, retry: Optional[RetryPolicy] = None):
        self.url = url.rstrip("/")
        self.retry = retry or RetryPolicy()

    def request(self, method: str, path: str, payload: Optional[dict] = None, *,
                expect_json: bool = True, timeout_s: Optional[float] = None):
        data = None if payload is None else json.dumps(payload).encode()
        last = "no attempt made"
        delay = self.retry.backoff_s
        for attempt in range(1, self.retry.attempts + 1):
            req = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=timeout_s or self.retry.timeout_s) as r:
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
            if attempt < self.retry.attempts:
                time.sleep(delay)
                delay *= 2
        raise SGLangError(f"{method} {self.url}{path} failed after {self.retry.attempts} attempts: "
                          f"{last}")

    # -- endpoints --------------------------------------------------------------------------------
    def healthy(self) -> bool:
        try:
            self.request("GET", "/health_generate", expect_json=False, timeout_s=30)
            return True
        except SGLangError:
            return False

    def wait_ready(self, timeout_s: float = 600.0, poll_s: float = 2.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.healthy():
                return
            time.sleep(poll_s)
        raise SGLangError(f"{self.url}: not healthy after {timeout_s:g} s")

    def generate(self, input_ids: Sequence[Sequence[int]], params: SamplingParams, *,
                 return_routed_experts: bool = False) -> list:
        sampling = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
                    "top_p": params.top_p, "top_k": params.top_k,
                    "stop_token_ids": list(params.stop_token_ids)}
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        payload = {"input_ids": [list(x) for x in input_ids], "sampling_params": sampling,
                   "return_logprob": True, "logprob_start_len": -1}
        if return_routed_experts:
            payload["return_routed_experts"] = True
        reply = self.request("POST", "/generate", payload)
        if not isinstance(reply, list) or len(reply) != len(input_ids):
            raise SGLangError(f"POST {self.url}/generate: expected a list of {len(input_ids)} "
                              f"results, got {type(reply).__name__}")
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
    return torch.from_numpy(flat.reshape(rows, num_layers, top_k)[:, list(moe_layers)].copy())


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


class SGLangEngine:
    """``Engine`` over SGLang servers at ``urls``: generation requests go to ``router_url`` when
    given (sglang-router balances them), else round-robin per prompt group; control calls
    (pause, weight updates, memory) always go to every server, which the router does not relay."""

    def __init__(self, urls: Sequence[str], *, num_hidden_layers: int, top_k: int,
                 moe_layers: Sequence[int], return_routes: bool = False,
                 retry: Optional[RetryPolicy] = None, router_url: Optional[str] = None):
        if not urls:
            raise ValueError("SGLangEngine needs at least one server URL")
        self.clients = [SGLangClient(u, retry) for u in urls]
        self.router = SGLangClient(router_url, retry) if router_url else None
        self.routes_shape = (num_hidden_layers, top_k, list(moe_layers)) if return_routes else None
        self.weight_version = 0
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

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        for c in self.clients:
            c.wait_ready(timeout_s)

    def generate(self, prompts: Sequence[Sequence[int]], samples_per_prompt: int,
                 params: SamplingParams) -> list[Sample]:
        params.validate()
        out = []
        for i, prompt in enumerate(prompts):  # one batched request per prompt group
            client = self.router or self.clients[i % len(self.clients)]
            reply = client.generate([prompt] * samples_per_prompt, params,
                                    return_routed_experts=self.routes_shape is not None)
            for item in reply:
                sample = parse_result(item, prompt, routes_shape=self.routes_shape)
                sample.prompt_index = i
                out.append(sample)
        return out

    # -- weights ----------------------------------------------------------------------------------
    def _each(self, path: str, payload: Optional[dict] = None) -> None:
        for c in self.clients:
            c.post(path, payload)

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

    def update_weights_from_distributed(self, named_tensors: Sequence[tuple], group,
                                        group_name: str = "weight_update_group") -> None:
        """Broadcast full HF-named tensors from trainer rank 0 over ``group`` (see
        ``init_weights_update_group``) while each server receives them in the same order."""
        import threading

        import torch.distributed as dist

        self.weight_version += 1
        payload = {"names": [n for n, _ in named_tensors],
                   "dtypes": [str(t.dtype).replace("torch.", "") for _, t in named_tensors],
                   "shapes": [list(t.shape) for _, t in named_tensors],
                   "group_name": group_name, "flush_cache": True,
                   "weight_version": str(self.weight_version)}
        errors = []

        def call(client):
            try:
                client.post("/update_weights_from_distributed", payload)
            except Exception as e:  # reported after the broadcasts
                errors.append(e)

        self._each("/pause_generation", {})
        try:
            threads = [threading.Thread(target=call, args=(c,)) for c in self.clients]
            for t in threads:
                t.start()
            for _, tensor in named_tensors:
                dist.broadcast(tensor.contiguous(), group_src=0, group=group)
            for t in threads:
                t.join()
        finally:
            self._each("/continue_generation", {})
        if errors:
            raise errors[0]

    def update_weights_from_tensor(self, named_tensors: Sequence[tuple]) -> None:
        """Colocated servers read the tensors through CUDA IPC (one payload per engine TP rank)."""
        require_sglang("update_weights_from_tensor")
        from sglang.srt.utils import MultiprocessingSerializer  # pragma: no cover

        blob = base64.b64encode(MultiprocessingSerializer.serialize(list(named_tensors))).decode()
        self.weight_version += 1
        self._each("/update_weights_from_tensor", {"serialized_named_tensors": [blob],
                                                   "flush_cache": True,
                                                   "weight_version": str(self.weight_version)})

    def sync_from_model(self, gpt, model_cfg, ctx, *, mode: str = "disk",
                        disk_dir: Optional[str] = None, group=None) -> None:
        """Push the trainer's weights: every rank calls; rank 0 gathers the whole model under HF
        names (``hf_qwen3moe.gather_hf_state``) and sends it ``mode="disk"`` (a checkpoint in
        ``disk_dir``, which the servers must be able to read) or ``"distributed"`` (broadcast over
        ``group`` from ``init_weights_update_group``) or ``"tensor"`` (colocated servers)."""
        import torch.distributed as dist

        from megatron_gspo.hf_qwen3moe import gather_hf_state, hf_config_from_model, write_hf_checkpoint

        if mode not in ("disk", "distributed", "tensor"):
            raise ValueError(f"weight sync mode {mode!r}; valid: disk, distributed, tensor")
        state = gather_hf_state(gpt, model_cfg, ctx)
        if ctx.rank == 0:
            if mode == "disk":
                if disk_dir is None:
                    raise ValueError("weight sync from disk needs disk_dir")
                write_hf_checkpoint(state, hf_config_from_model(model_cfg), disk_dir)
                self.update_weights_from_disk(disk_dir)
            elif mode == "distributed":
                self.update_weights_from_distributed(sorted(state.items()), group)
            else:
                self.update_weights_from_tensor(sorted(state.items()))
        dist.barrier()

    def release_memory(self, tags: Optional[list] = None) -> None:
        self._each("/release_memory_occupation", {"tags": tags})

    def resume_memory(self, tags: Optional[list] = None) -> None:
        self._each("/resume_memory_occupation", {"tags": tags})

    def shutdown(self) -> None:
        return None


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
    from torch.distributed.distributed_c10d import _new_process_group_helper

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

    offsets = [1 + sum(engine_gpus[:i]) for i in range(len(engine_gpus))]
    threads = [threading.Thread(target=join, args=(c, o)) for c, o in zip(engine.clients, offsets)]
    for t in threads:
        t.start()
    store = dist.TCPStore(master_address, master_port, world, is_master=True,
                          timeout=timedelta(seconds=timeout_s))
    prefix = dist.PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(world, 0, [], backend, prefix, group_name=group_name,
                                         timeout=timedelta(seconds=timeout_s))
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return group


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
