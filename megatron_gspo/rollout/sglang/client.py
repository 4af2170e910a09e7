"""One SGLang server's HTTP API (sglang 0.5.x)."""

from __future__ import annotations

import base64
import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from megatron_gspo.rollout.types import RolloutError, Sample, SamplingParams


class SGLangError(RolloutError):
    """A request to an SGLang server failed for good; the message says which and why."""


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
        sampling = sampling_of(params)
        if seeds is not None:
            if len(seeds) != len(input_ids):
                raise ValueError(f"{len(seeds)} seeds for {len(input_ids)} rows")
            sampling = [dict(sampling, sampling_seed=int(seed)) for seed in seeds]
        elif params.seed is not None:
            sampling["sampling_seed"] = params.seed
        return self.generate_rows(input_ids, sampling, return_routed_experts=return_routed_experts)

    def generate_rows(self, input_ids: Sequence[Sequence[int]], sampling, *,
                      return_routed_experts: bool = False) -> list:
        """One batched ``/generate`` request with ``sampling`` params for all rows (a dict) or
        per row (a list of dicts)."""
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

    def weight_version(self) -> str:
        """The server's weight version: ``/get_weight_version`` where it exists (stock 0.5.15
        answers 404 there), else ``/model_info``'s."""
        try:
            reply = self.request("GET", "/get_weight_version")
        except SGLangError as e:
            if "HTTP 404" not in str(e):
                raise
            reply = self.request("GET", "/model_info")
        if not isinstance(reply, dict) or "weight_version" not in reply:
            raise SGLangError(f"{self.url}: the reply names no weight_version")
        return str(reply["weight_version"])

    def post(self, path: str, payload: Optional[dict] = None) -> dict:
        reply = self.request("POST", path, payload or {})
        if isinstance(reply, dict) and reply.get("success") is False:
            raise SGLangError(f"POST {self.url}{path}: {reply.get('message', 'failed')}")
        return reply


def sampling_of(params: SamplingParams) -> dict:
    """SGLang's sampling params of ``params`` (the seed aside)."""
    return {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
            "top_p": params.top_p, "top_k": params.top_k,
            "stop_token_ids": list(params.stop_token_ids)}


def decode_routes(blob: str, rows: int, num_layers: int, top_k: int,
                  moe_layers: Sequence[int]) -> torch.Tensor:
    """``meta_info.routed_experts`` (base64 int32 [rows, HF layers, K]) -> [rows, L_moe, K]."""
    flat = np.frombuffer(base64.b64decode(blob), dtype=np.int32)
    if flat.size != rows * num_layers * top_k:
        raise SGLangError(f"routed_experts holds {flat.size} ids, expected {rows} x {num_layers} x "
                          f"{top_k}")
    return torch.from_numpy(flat.reshape(rows, num_layers, top_k)[:, list(moe_layers)].copy()).long()


def parse_result(item: dict, prompt: Sequence[int], *, routes_shape=None,
                 aborted_ok: bool = False) -> Sample:
    """One /generate result -> Sample (tokens, log-probs, finish reason, routes; the server's
    ``weight_version`` in ``meta``). An aborted request (finish reason ``abort``: the server
    was paused) is an error unless ``aborted_ok`` (a partial rollout keeps its tokens)."""
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
    if reason == "abort" and not aborted_ok:
        raise SGLangError(f"/generate aborted: {meta['finish_reason'].get('message', '')}")
    routes = None
    if routes_shape is not None and len(prompt) + len(output_ids) > 1:
        blob = meta.get("routed_experts")
        if blob is None:
            raise SGLangError("/generate returned no routed_experts: start the server with "
                              "--enable-return-routed-experts (sglang drops the request field "
                              "silently without it)")
        num_layers, top_k, moe_layers = routes_shape
        routes = decode_routes(blob, len(prompt) + len(output_ids) - 1, num_layers, top_k,
                               moe_layers)
    return Sample(prompt_ids=list(prompt), response_ids=output_ids,
                  logprobs_R=torch.tensor(logprobs, dtype=torch.float32), finish_reason=reason,
                  routes_TLK=routes, meta={"weight_version": str(meta.get("weight_version", ""))})
