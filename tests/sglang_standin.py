"""A stand-in SGLang server for tests: the same HTTP endpoints and payload shapes as sglang 0.5.x
(/generate with log-probs and routed experts, weight updates from disk and over a process group,
pause / continue / flush, memory release / resume, health), generating with the local engine on a
tiny model, plus fault injection (POST /_fault {"mode": "500"|"hang"|"drop"|"malformed",
"count": n}). Runs in its own process: ``start(hf_dir)`` returns (url, process)."""

from __future__ import annotations

import base64
import json
import multiprocessing as mp
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids",
                 "sampling_seed", "n", "stop", "min_p", "ignore_eos"}


def _serve(hf_dir, ready):
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.hf_qwen3moe import TensorSource, load_hf_weights
    from megatron_gspo.model import build_model
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.rollout.local_engine import LocalEngine
    from megatron_gspo.rollout.types import SamplingParams
    from moe.replay import RoutingReplay
    from tests.model_workers import tiny_model_config

    cfg = tiny_model_config(hf_dir)
    ctx = init_parallel(ParallelConfig(), cfg, seed=0)
    gpt = build_model(cfg, ctx, moe_enable_routing_replay=True)
    load_hf_weights(gpt, hf_dir, cfg, ctx)
    engine = LocalEngine(gpt, ctx, replay=RoutingReplay(gpt))
    lock = threading.Lock()
    state = {"fault": None, "count": 0, "paused": False, "version": "default", "group": None,
             "released": set(), "calls": []}
    moe_layers = [i for i, x in enumerate(cfg.moe_layer_pattern) if x]

    def generate(body):
        unknown = set(body.get("sampling_params", {})) - SAMPLING_KEYS
        if unknown:
            return 500, {"error": {"message": f"unexpected keyword {sorted(unknown)[0]}"}}
        sp = body.get("sampling_params", {})
        params = SamplingParams(max_new_tokens=sp.get("max_new_tokens", 128),
                                temperature=sp.get("temperature", 1.0), top_p=sp.get("top_p", 1.0),
                                top_k=sp.get("top_k", -1),
                                stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
                                seed=sp.get("sampling_seed"))
        with lock:
            samples = engine.generate(body["input_ids"], 1, params)
        out = []
        for s in samples:
            meta = {"id": f"req-{len(out)}", "prompt_tokens": len(s.prompt_ids),
                    "completion_tokens": len(s.response_ids), "weight_version": state["version"],
                    "finish_reason": ({"type": "stop", "matched": s.response_ids[-1]}
                                      if s.finish_reason == "stop"
                                      else {"type": "length", "length": len(s.response_ids)})}
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = [[float(lp), int(t), None] for lp, t in
                                                 zip(s.logprobs_R, s.response_ids)]
            if body.get("return_routed_experts"):
                rows = torch.zeros(s.routes_TLK.shape[0], cfg.num_layers, cfg.top_k,
                                   dtype=torch.int32)  # dense layers stay zero, as in sglang
                rows[:, moe_layers] = s.routes_TLK.int()
                meta["routed_experts"] = base64.b64encode(rows.numpy().tobytes()).decode()
            out.append({"output_ids": s.response_ids, "meta_info": meta})
        return 200, out

    def update_from_tensors(tensors, version):
        with lock:
            load_hf_weights(gpt, TensorSource(tensors, path="broadcast"), cfg, ctx)
        state["version"] = version

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _reply(self, code, body, raw=False):
            data = body.encode() if raw else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _fault(self):
            if state["fault"] and state["count"] > 0 and self.path != "/_fault":
                state["count"] -= 1
                mode = state["fault"]
                if mode == "500":
                    self._reply(500, {"error": {"message": "injected failure"}})
                elif mode == "hang":
                    time.sleep(3)
                    self._reply(200, {"late": True})
                elif mode == "drop":
                    self.close_connection = True
                    self.connection.shutdown(2)
                elif mode == "malformed":
                    self._reply(200, "{not json", raw=True)
                return True
            return False

        def do_GET(self):
            if self._fault():
                return
            if self.path in ("/health", "/health_generate"):
                return self._reply(503 if state["paused"] else 200, {})
            if self.path == "/model_info":
                return self._reply(200, {"model_path": hf_dir, "weight_version": state["version"]})
            if self.path == "/flush_cache":
                return self._reply(200, {})
            self._reply(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            length = int(self.headers.get("Content-Length", 0))
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except json.JSONDecodeError as e:
                return self._reply(400, {"object": "error", "message": str(e), "code": 400})
            state["calls"].append(self.path)
            if self.path == "/_fault":
                state["fault"], state["count"] = body["mode"], body.get("count", 1)
                return self._reply(200, {"success": True})
            if self._fault():
                return
            if self.path == "/generate":
                if "input_ids" not in body:
                    return self._reply(400, {"error": {"message": "input_ids required"}})
                return self._reply(*generate(body))
            if self.path == "/pause_generation":
                state["paused"] = True
                return self._reply(200, {"success": True})
            if self.path == "/continue_generation":
                state["paused"] = False
                return self._reply(200, {"success": True})
            if self.path == "/update_weights_from_disk":
                try:
                    with lock:
                        load_hf_weights(gpt, body["model_path"], cfg, ctx)
                except Exception as e:  # sglang reports failure and keeps the old weights
                    return self._reply(400, {"success": False, "message": str(e)})
                state["version"] = body.get("weight_version", state["version"])
                return self._reply(200, {"success": True, "message": "ok",
                                         "num_paused_requests": 0})
            if self.path == "/init_weights_update_group":
                from datetime import timedelta

                import torch.distributed as dist
                from torch.distributed.distributed_c10d import _new_process_group_helper

                store = dist.TCPStore(body["master_address"], body["master_port"],
                                      body["world_size"], is_master=False,
                                      timeout=timedelta(seconds=60))
                prefix = dist.PrefixStore(body["group_name"], store)
                state["group"], _ = _new_process_group_helper(
                    body["world_size"], body["rank_offset"], [], body["backend"], prefix,
                    group_name=body["group_name"], timeout=timedelta(seconds=60))
                return self._reply(200, {"success": True, "message": "joined"})
            if self.path == "/update_weights_from_distributed":
                import torch.distributed as dist

                tensors = {}
                for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
                    t = torch.empty(shape, dtype=getattr(torch, dtype))
                    dist.broadcast(t, group_src=0, group=state["group"])
                    tensors[name] = t
                update_from_tensors(tensors, body.get("weight_version", state["version"]))
                return self._reply(200, {"success": True, "message": "updated"})
            if self.path in ("/release_memory_occupation", "/resume_memory_occupation"):
                tags = set(body.get("tags") or ["weights", "kv_cache", "cuda_graph"])
                if self.path.startswith("/release"):
                    state["released"] |= tags
                else:
                    state["released"] -= tags
                return self._reply(200, {"success": True})
            self._reply(404, {"error": {"message": f"no route {self.path}"}})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    ready.put(server.server_address[1])
    server.serve_forever()


def start(hf_dir: str, timeout_s: float = 120.0):
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(hf_dir, ready), daemon=True)
    proc.start()
    port = ready.get(timeout=timeout_s)
    return f"http://127.0.0.1:{port}", proc


def _route(ready):
    """A stand-in sglang-router: /workers registration, /generate relayed round-robin (the stock
    router's retry of 5xx included)."""
    import itertools
    import urllib.error
    import urllib.request

    workers, counter = [], itertools.count()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _reply(self, code, data: bytes):
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/workers":
                body = {"workers": [{"id": str(i), "url": u} for i, u in enumerate(workers)]}
                return self._reply(200, json.dumps(body).encode())
            self._reply(404, b"{}")

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path == "/workers":
                workers.append(json.loads(body)["url"])
                return self._reply(202, b'{"status": "queued"}')
            if self.path == "/generate" and workers:
                for _ in range(len(workers)):
                    url = workers[next(counter) % len(workers)]
                    req = urllib.request.Request(url + "/generate", data=body, method="POST",
                                                 headers={"Content-Type": "application/json"})
                    try:
                        with urllib.request.urlopen(req, timeout=30) as r:
                            return self._reply(200, r.read())
                    except urllib.error.HTTPError as e:
                        if e.code < 500:
                            return self._reply(e.code, e.read())
                return self._reply(503, b'{"error": "no healthy worker"}')
            self._reply(404, b"{}")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    ready.put(server.server_address[1])
    server.serve_forever()


def start_router(timeout_s: float = 30.0):
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    proc = ctx.Process(target=_route, args=(ready,), daemon=True)
    proc.start()
    return f"http://127.0.0.1:{ready.get(timeout=timeout_s)}", proc


def trainer_sync_job(url, hf_dir, parallel_kwargs, disk_dir, prompts):
    """A trainer rank: import (perturbed) HF weights into a Megatron layout, push them to the
    server through the HF mapping, return the server's greedy outputs afterwards."""
    import warnings

    warnings.filterwarnings("ignore")
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.hf_qwen3moe import load_hf_weights
    from megatron_gspo.model import build_model
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.rollout.sglang_engine import SGLangEngine
    from megatron_gspo.rollout.types import SamplingParams
    from tests.model_workers import tiny_model_config

    cfg = tiny_model_config(hf_dir)
    ctx = init_parallel(ParallelConfig(**parallel_kwargs), cfg, seed=0)
    gpt = build_model(cfg, ctx)
    load_hf_weights(gpt, hf_dir, cfg, ctx)
    engine = SGLangEngine([url], num_hidden_layers=4, top_k=2, moe_layers=[1, 2, 3])
    engine.sync_from_model(gpt, cfg, ctx, mode="disk", disk_dir=disk_dir)
    if ctx.rank != 0:
        return None
    return [s.response_ids for s in engine.generate(prompts, 1,
                                                    SamplingParams(max_new_tokens=5, temperature=0))]
