"""A stand-in SGLang server for asynchronous rollouts: SGLang 0.5.x's HTTP API where the
asynchronous trainer uses it, with time spent in sleeps (so that two CPU cores are never what
limits a benchmark or a test) and outputs that are known functions:

- the token at absolute position ``p`` of a row seeded ``s`` is ``synthetic_token(s, p)`` (as
  SGLang's deterministic sampling keys its noise by seed and position), so a request resumed
  with the same seed continues exactly; a row's response ends after ``row_length(s)`` tokens
  (with the stop token, when one is asked for), counted from the first input the server saw
  for that seed; a heavy tail: one seed in ``tail_every`` answers ``tail_factor`` times longer;
- the log-prob of a token is ``synthetic_logprob(token, p, version)`` and its routed experts
  ``synthetic_routes(token, p, version, ...)``: both change with the weight version, as a
  policy's do;
- decoding takes ``token_latency_s`` per step of a request's batch (times a jitter factor drawn
  from ``jitter_seed``), and a pause with mode ``abort`` ends every running request at its next
  token (``finish_reason`` ``abort``, the tokens so far returned); ``/generate`` calls arriving
  while paused wait for ``/continue_generation``, as SGLang's do;
- weight updates (from disk, or over a process group joined with ``/init_weights_update_group``,
  whose broadcasts it receives) set the weight version; ``/get_weight_version`` and
  ``/model_info`` report it.

Test hooks: ``GET /_events`` (every pause, update, continue and emitted token with its time and
version), ``POST /_fault {"mode": "update_500" | "hang_generate", "version": V}``: weight
updates labelled V fail with HTTP 500, or /generate calls hang while the server holds V.
Runs in its own process: ``start(hf_dir, ...)`` returns (url, process).
"""

from __future__ import annotations

import base64
import json
import multiprocessing as mp
import os
import random
import threading
import time
from http.server import ThreadingHTTPServer

import numpy as np

from tests.sglang_standin import JSONHandler

FIRST_TOKEN = 3  # ids below are left to special tokens


def _num(version: str) -> int:
    """A weight version label as a number (the servers' initial ``default``: 0)."""
    return 0 if version == "default" else int(version)


def _mix(*values: int) -> int:
    h = 1469598103934665603
    for v in values:
        h = ((h ^ (int(v) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 61)
    return h


def synthetic_token(seed: int, position: int, vocab: int, stop: int) -> int:
    token = FIRST_TOKEN + _mix(seed, position) % (vocab - FIRST_TOKEN)
    return token + 1 if token == stop else token if token < vocab else FIRST_TOKEN


def synthetic_logprob(token: int, position: int, version: int) -> float:
    return -0.5 - 0.001 * ((token * 31 + position) % 97) - 0.01 * version


def synthetic_routes(token: int, position: int, version: int, experts: int, top_k: int) -> list:
    first = _mix(token, position, version) % experts
    return [(first + i) % experts for i in range(top_k)]


def row_length(seed: int, base: int, tail_every: int, tail_factor: int) -> int:
    return base * tail_factor if tail_every and _mix(seed, 7) % tail_every == 0 else base


def _serve(hf_dir, ready, host, port, *, base_tokens, tail_every, tail_factor, token_latency_s,
           jitter, jitter_seed):
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    vocab, layers = hf["vocab_size"], hf["num_hidden_layers"]
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    top_k = hf["num_experts_per_tok"]
    jitter_rng = random.Random(jitter_seed)
    lock = threading.Condition()
    state = {"version": "default", "paused": False, "group": None, "fault": {}, "events": [],
             "first_len": {}, "aborts": 0}

    def event(kind, **fields):
        with lock:
            state["events"].append(dict(kind=kind, t=time.monotonic(), **fields))

    def generate(body):
        ids = body["input_ids"]
        single = bool(ids) and isinstance(ids[0], int)
        rows = [ids] if single else ids
        sps = body.get("sampling_params", {})
        sps = sps if isinstance(sps, list) else [sps] * len(rows)
        with lock:
            while state["paused"]:  # requests arriving while paused wait, as SGLang's do
                lock.wait()
            version, aborts = state["version"], state["aborts"]
            hang = state["fault"] == {"mode": "hang_generate", "version": version}
        if hang:
            event("fault", mode="hang_generate", version=version)
            time.sleep(3600)
        outs = []
        for row, sp in zip(rows, sps):
            seed = int(sp.get("sampling_seed", 0))
            with lock:
                first = state["first_len"].setdefault(seed, len(row))
            end = first + row_length(seed, base_tokens, tail_every, tail_factor)
            stop = (sp.get("stop_token_ids") or [None])[0]
            outs.append({"input": list(row), "seed": seed, "left": int(sp.get("max_new_tokens", 16)),
                         "end": end, "stop": stop, "out": [], "reason": None})
        while any(o["reason"] is None for o in outs):
            with lock:
                factor = 1.0 + jitter * jitter_rng.random()
            time.sleep(token_latency_s * factor)
            with lock:
                paused, version = state["paused"], state["version"]
                aborted = state["aborts"] != aborts
            for o in outs:
                if o["reason"] is not None:
                    continue
                if paused or aborted:
                    o["reason"] = {"type": "abort", "message": "aborted"}
                    continue
                p = len(o["input"]) + len(o["out"])
                last = p + 1 >= o["end"]
                stop = o["stop"]
                token = stop if last and stop is not None else synthetic_token(
                    o["seed"], p, vocab, stop if stop is not None else -1)
                o["out"].append((token, version))
                event("token", version=version, seed=o["seed"], position=p)
                o["left"] -= 1
                if last and stop is not None:
                    o["reason"] = {"type": "stop", "matched": stop}
                elif o["left"] == 0 or last:
                    o["reason"] = {"type": "length", "length": len(o["out"])}
        results = []
        for o in outs:
            tokens = [t for t, _ in o["out"]]
            start = len(o["input"])
            meta = {"id": f"req-{o['seed']}-{start}", "prompt_tokens": start,
                    "completion_tokens": len(tokens), "finish_reason": o["reason"],
                    "weight_version": o["out"][0][1] if o["out"] else version}
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = [[synthetic_logprob(t, start + i, _num(v)), t, None]
                                                 for i, (t, v) in enumerate(o["out"])]
            if body.get("return_routed_experts"):
                # Every position fed: the input's recomputed under the version the request began
                # with (a resumed request is prefilled again), each output token's under the
                # version that sampled it (position q feeds seq[q] and samples seq[q + 1]).
                seq, began = o["input"] + tokens, _num(o["out"][0][1] if o["out"] else version)
                rows = []
                for q in range(len(seq) - 1):
                    v = _num(o["out"][q - start + 1][1]) if q >= start - 1 else began
                    rows.append([synthetic_routes(seq[q], q, v, experts, top_k)] * layers)
                meta["routed_experts"] = base64.b64encode(
                    np.asarray(rows, dtype=np.int32).reshape(-1).tobytes()).decode()
            results.append({"output_ids": tokens, "meta_info": meta})
        return results[0] if single else results

    def join_group(body):
        from datetime import timedelta

        import torch.distributed as dist

        if not dist.is_initialized():  # a world of its own, as SGLang's scheduler has
            dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", 0, 1, True),
                                    rank=0, world_size=1)
        from torch.distributed.distributed_c10d import _new_process_group_helper, _world

        store = dist.TCPStore(body["master_address"], body["master_port"], body["world_size"],
                              is_master=False, timeout=timedelta(seconds=60))
        prefix = dist.PrefixStore(body["group_name"], store)
        state["group"], _ = _new_process_group_helper(
            body["world_size"], body["rank_offset"], [], body["backend"], prefix,
            group_name=body["group_name"], timeout=timedelta(seconds=60))
        _world.pg_group_ranks[state["group"]] = {i: i for i in range(body["world_size"])}

    def receive(body):
        import torch
        import torch.distributed as dist

        for dtype, shape in zip(body["dtypes"], body["shapes"]):
            dist.broadcast(torch.empty(shape, dtype=getattr(torch, dtype)), group_src=0,
                           group=state["group"])

    class Handler(JSONHandler):
        def do_GET(self):
            if self.path == "/_events":
                with lock:
                    return self._reply(200, list(state["events"]))
            if self.path in ("/health", "/health_generate"):
                return self._reply(503 if state["paused"] else 200, {})
            if self.path == "/model_info":
                return self._reply(200, {"model_path": hf_dir, "weight_version": state["version"]})
            if self.path == "/get_weight_version":
                return self._reply(200, {"weight_version": state["version"]})
            if self.path == "/flush_cache":
                return self._reply(200, {})
            self._reply(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path == "/_fault":
                with lock:
                    state["fault"] = {"mode": body["mode"], "version": str(body["version"])}
                return self._reply(200, {"success": True})
            if self.path == "/generate":
                return self._reply(200, generate(body))
            if self.path == "/pause_generation":
                mode = body.get("mode", "abort")
                if mode != "abort":
                    return self._reply(400, {"success": False, "message": f"mode {mode!r}: this "
                                             "stand-in pauses with abort only"})
                with lock:
                    state["paused"] = True
                event("pause", mode=mode)
                return self._reply(200, {"success": True})
            if self.path == "/abort_request":
                if not body.get("abort_all"):
                    return self._reply(400, {"error": {"message": "this stand-in aborts all"}})
                with lock:
                    state["aborts"] += 1
                event("abort_all")
                return self._reply(200, {})
            if self.path == "/continue_generation":
                with lock:
                    state["paused"] = False
                    lock.notify_all()
                event("continue")
                return self._reply(200, {"success": True})
            if self.path.startswith("/update_weights_from"):
                with lock:
                    failing = state["fault"] == {"mode": "update_500",
                                                 "version": str(body.get("weight_version"))}
                if self.path == "/update_weights_from_distributed":
                    receive(body)  # (a server takes part in the broadcast, then fails to load)
                if failing:
                    event("fault", mode="update_500", version=body.get("weight_version"))
                    return self._reply(500, {"success": False, "message": "injected failure"})
                version = body.get("weight_version")
                if version is not None:
                    with lock:
                        state["version"] = version
                    event("update", version=version, paused=state["paused"])
                return self._reply(200, {"success": True, "message": "updated",
                                         "num_paused_requests": 0})
            if self.path == "/init_weights_update_group":
                join_group(body)
                return self._reply(200, {"success": True, "message": "joined"})
            if self.path == "/destroy_weights_update_group":
                import torch.distributed as dist

                if state["group"] is not None:
                    dist.destroy_process_group(state["group"])
                    state["group"] = None
                return self._reply(200, {"success": True, "message": "destroyed"})
            self._reply(404, {"error": {"message": f"no route {self.path}"}})

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    ready.put(server.server_address[1])
    server.serve_forever()


def start(hf_dir: str, *, base_tokens: int = 8, tail_every: int = 0, tail_factor: int = 8,
          token_latency_s: float = 0.001, jitter: float = 0.0, jitter_seed: int = 0,
          timeout_s: float = 60.0):
    """A server in its own process; returns (url, process)."""
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(hf_dir, ready, "127.0.0.1", 0), kwargs=dict(
        base_tokens=base_tokens, tail_every=tail_every, tail_factor=tail_factor,
        token_latency_s=token_latency_s, jitter=jitter, jitter_seed=jitter_seed), daemon=True)
    proc.start()
    return f"http://127.0.0.1:{ready.get(timeout=timeout_s)}", proc
