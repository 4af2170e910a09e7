"""A stand-in SGLang server for tests: the same HTTP endpoints and payload shapes as sglang 0.5.x
(batched /generate with per-row sampling params, log-probs and routed experts; weight updates from
disk, over a process group and from serialized tensors (full HF tensors per TP rank, or each
rank's own shards in SGLang's parameter layout with ``load_format: "direct"``), in buckets;
pause / continue / flush, memory release / resume, health), generating with the local engine on
a tiny model.

Behaves like SGLang where it matters: sampling is random (its own RNG, seeded from the OS) unless
the server was started ``deterministic`` and a row carries a ``sampling_seed`` (then the noise is
keyed by seed and position, as SGLang's deterministic inference does); it has ``tp`` tensor-
parallel ranks, TP rank i reading entry i of ``serialized_named_tensors``; requests waiting
together decode as one batch (continuous batching); requests take ``latency_s`` before any work;
with ``logprob_shifts`` it reports perturbed log-probs (a response's all shifted by
``logprob_shifts[sum(response ids) % len]``), as an engine that disagrees with the trainer by a
known amount per sequence. Test hooks: POST /_fault {"mode": "500"|"hang"|"drop"|"malformed",
"count": n} fails the next n requests; GET /_stats reports requests in flight (now and at most),
/generate requests and rows served, the rows of each decoding batch (one per sampling-params
group of a batch), the tensor payloads read, the bytes each TP rank received per tensor name and
the POSTs received per path (faulted ones too). ``startup_delay_s``: like a server loading its
checkpoint, nothing listens for the first half, then everything but /model_info answers 503.
Runs in its own process: ``start(hf_dir, ...)`` returns (url, process)."""

from __future__ import annotations

import base64
import io
import json
import multiprocessing as mp
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PROCESS_START = time.monotonic()  # a server's start-up delay counts from its start
SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids",
                 "sampling_seed", "n", "stop", "min_p", "ignore_eos"}


class JSONHandler(BaseHTTPRequestHandler):
    """A stand-in's request handler: quiet, and ``_reply(code, body)`` sends ``body`` as JSON
    (an object to encode, or bytes as they are)."""

    def log_message(self, *args):
        pass

    def _reply(self, code, body):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def sglang_param_shapes(cfg, tp: int, ep: int = 1) -> dict:
    """The parameters of one TP rank of SGLang 0.5.15's Qwen3-MoE (``load_format: "direct"``
    reads payloads into these, by name, sizes asserted), name -> shape, for ``--tp-size tp
    --ep-size ep``. Dense layers take Qwen2MoeMLP's fused ``gate_up_proj`` / ``down_proj``."""
    h, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    vp = -(-cfg.vocab_size // 64) * 64
    kv = max(1, cfg.num_query_groups // tp)
    out = {"model.embed_tokens.weight": (vp // tp, h), "lm_head.weight": (vp // tp, h),
           "model.norm.weight": (h,)}
    for i in range(layers):
        p = f"model.layers.{i}"
        out.update({f"{p}.input_layernorm.weight": (h,),
                    f"{p}.post_attention_layernorm.weight": (h,),
                    f"{p}.self_attn.q_norm.weight": (d,), f"{p}.self_attn.k_norm.weight": (d,),
                    f"{p}.self_attn.qkv_proj.weight": ((cfg.num_attention_heads // tp + 2 * kv) * d, h),
                    f"{p}.self_attn.o_proj.weight": (h, cfg.num_attention_heads * d // tp)})
        if cfg.moe_layer_pattern[i]:
            e, w = cfg.num_experts // ep, cfg.moe_ffn_hidden_size * ep // tp
            out.update({f"{p}.mlp.gate.weight": (cfg.num_experts, h),
                        f"{p}.mlp.experts.w13_weight": (e, 2 * w, h),
                        f"{p}.mlp.experts.w2_weight": (e, h, w)})
        else:
            w = cfg.ffn_hidden_size // tp
            out.update({f"{p}.mlp.gate_up_proj.weight": (2 * w, h),
                        f"{p}.mlp.down_proj.weight": (h, w)})
    return out


def hf_slots(name: str, shape: tuple, cfg, tp: int, ep: int = 1) -> list:
    """Where SGLang's weight loaders put the HF tensor ``name`` on each TP rank, as its
    ``weight_loader(param, loaded, shard_id)`` calls do: (rank, parameter, index into the
    parameter, index into the HF tensor) for every rank that holds part of it (an expert: the
    ranks of its expert-parallel group, ``moe_tp = tp / ep`` of them)."""
    import re

    d, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_query_groups
    all_ = (slice(None),)
    out = []
    for r in range(tp):
        def rows(n, k):
            return (slice(k * n, (k + 1) * n),)

        def cols(n, k):
            return (slice(None), slice(k * n, (k + 1) * n))

        m = re.match(r"(model\.layers\.\d+)\.(self_attn|mlp)\.(.+)$", name)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            per = (-(-cfg.vocab_size // 64) * 64) // tp
            n = max(0, min(per, shape[0] - r * per))
            out.append((r, name, (slice(0, n),), (slice(r * per, r * per + n),)))
            continue
        if not m:
            out.append((r, name, all_, all_))
            continue
        p, part, rest = m.groups()
        qn, kvn = nq // tp * d, max(1, nkv // tp) * d
        kv_rank = r // (tp // nkv) if tp >= nkv else r
        em = re.match(r"experts\.(\d+)\.(gate|up|down)_proj\.weight$", rest)
        if rest == "q_proj.weight":
            out.append((r, f"{p}.self_attn.qkv_proj.weight", (slice(0, qn),), rows(qn, r)))
        elif rest in ("k_proj.weight", "v_proj.weight"):
            at = qn if rest[0] == "k" else qn + kvn
            out.append((r, f"{p}.self_attn.qkv_proj.weight", (slice(at, at + kvn),),
                        rows(kvn, kv_rank)))
        elif rest == "o_proj.weight":
            out.append((r, f"{p}.self_attn.o_proj.weight", all_, cols(nq * d // tp, r)))
        elif em:
            moe_tp, local = tp // ep, cfg.num_experts // ep
            e, w, k = int(em.group(1)), cfg.moe_ffn_hidden_size // moe_tp, r % moe_tp
            if e // local != r // moe_tp:
                continue  # another expert-parallel group holds this expert
            if em.group(2) == "down":
                out.append((r, f"{p}.mlp.experts.w2_weight", (e % local,), cols(w, k)))
            else:
                at = 0 if em.group(2) == "gate" else w
                out.append((r, f"{p}.mlp.experts.w13_weight", (e % local, slice(at, at + w)),
                            rows(w, k)))
        elif rest in ("gate_proj.weight", "up_proj.weight"):
            w = cfg.ffn_hidden_size // tp
            at = 0 if rest.startswith("gate") else w
            out.append((r, f"{p}.mlp.gate_up_proj.weight", (slice(at, at + w),), rows(w, r)))
        elif rest == "down_proj.weight":
            out.append((r, f"{p}.mlp.down_proj.weight", all_,
                        cols(cfg.ffn_hidden_size // tp, r)))
        else:
            out.append((r, f"{p}.{part}.{rest}", all_, all_))
    return out


def to_ranks(hf: dict, cfg, tp: int, ep: int = 1) -> list:
    """Every TP rank's SGLang parameters holding the HF weights ``hf`` (padding rows zero)."""
    import torch

    ranks = [{k: torch.zeros(v) for k, v in sglang_param_shapes(cfg, tp, ep).items()}
             for _ in range(tp)]
    for name, t in hf.items():
        for r, param, at, src in hf_slots(name, tuple(t.shape), cfg, tp, ep):
            ranks[r][param][at] = t[src]
    return ranks


def from_ranks(ranks: list, like: dict, cfg, tp: int, ep: int = 1) -> dict:
    """The HF weights (names and shapes of ``like``) that the TP ranks' parameters hold: what
    the server computes with."""
    import torch

    hf = {}
    for name, t in like.items():
        full = torch.empty_like(t)
        for r, param, at, src in hf_slots(name, tuple(t.shape), cfg, tp, ep):
            full[src] = ranks[r][param][at]
        hf[name] = full
    return hf


def _serve(hf_dir, ready, tp, deterministic, latency_s, logprob_shifts, host="127.0.0.1", port=0,
           startup_delay_s=0.0, stats_file=None, refused_probes=0):
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.models.hf_io import TensorSource
    from megatron_gspo.models.hf_mapping import gather_hf_state, load_hf_weights
    from megatron_gspo.models.model import build_model
    from megatron_gspo.distributed.parallel import init_parallel
    from megatron_gspo.rollout.local_engine import LocalEngine
    from megatron_gspo.rollout.types import SamplingParams
    from moe.replay import RoutingReplay
    from tests.model_workers import tiny_model_config

    started = PROCESS_START
    cfg = tiny_model_config(hf_dir)
    ctx = init_parallel(ParallelConfig(), cfg, seed=0)
    torch.manual_seed(int.from_bytes(os.urandom(8), "little") % (2**63))  # random sampling
    gpt = build_model(cfg, ctx, moe_enable_routing_replay=True)
    load_hf_weights(gpt, hf_dir, cfg, ctx)
    weights = gather_hf_state(gpt, cfg, ctx)  # the server's HF-named weights, updated per bucket
    engine = LocalEngine(gpt, ctx, replay=RoutingReplay(gpt))
    lock = threading.Lock()  # the model: decoding and weight updates
    counters = threading.Lock()  # request counters and injected faults
    state = {"fault": None, "count": 0, "paused": False, "version": "default", "group": None,
             "released": set(), "calls": [], "in_flight": 0, "max_in_flight": 0,
             "generate_requests": 0, "rows": 0, "tensor_payloads": [], "rank_tensors": {},
             "batches": [], "refused_loading": 0}
    moe_layers = [i for i, x in enumerate(cfg.moe_layer_pattern) if x]

    def params_of(sp):
        return SamplingParams(max_new_tokens=sp.get("max_new_tokens", 128),
                              temperature=sp.get("temperature", 1.0), top_p=sp.get("top_p", 1.0),
                              top_k=sp.get("top_k", -1),
                              stop_token_ids=tuple(sp.get("stop_token_ids") or ()))

    def result(s):
        meta = {"id": f"req-{state['rows']}", "prompt_tokens": len(s.prompt_ids),
                "completion_tokens": len(s.response_ids), "weight_version": state["version"],
                "finish_reason": ({"type": "stop", "matched": s.response_ids[-1]}
                                  if s.finish_reason == "stop"
                                  else {"type": "length", "length": len(s.response_ids)})}
        # A perturbed engine: every log-prob of a response shifted by
        # logprob_shifts[sum(response ids) % len(logprob_shifts)].
        shift = (logprob_shifts[sum(s.response_ids) % len(logprob_shifts)]
                 if logprob_shifts else 0.0)
        meta["output_token_logprobs"] = [[float(lp) + shift, int(t), None] for lp, t in
                                         zip(s.logprobs_R, s.response_ids)]
        rows = torch.zeros(s.routes_TLK.shape[0], cfg.num_layers, cfg.top_k,
                           dtype=torch.int32)  # dense layers stay zero, as in sglang
        rows[:, moe_layers] = s.routes_TLK.int()
        meta["routed_experts"] = base64.b64encode(rows.numpy().tobytes()).decode()
        return {"output_ids": s.response_ids, "meta_info": meta}

    def generate(body):
        ids = body["input_ids"]
        single = bool(ids) and isinstance(ids[0], int)
        ids = [ids] if single else ids
        sps = body.get("sampling_params", {})
        sps = sps if isinstance(sps, list) else [sps] * len(ids)
        if len(sps) != len(ids):
            return 400, {"error": {"message": f"{len(sps)} sampling_params for {len(ids)} "
                                              "inputs"}}
        for sp in sps:
            if not isinstance(sp, dict):
                return 400, {"error": {"message": f"sampling_params entry {sp!r} is not an "
                                                  "object"}}
            unknown = set(sp) - SAMPLING_KEYS
            if unknown:
                return 500, {"error": {"message": f"unexpected keyword {sorted(unknown)[0]}"}}
        job = {"rows": list(zip(ids, sps)), "samples": None, "error": None,
               "done": threading.Event()}
        with queued:
            pending.append(job)
            queued.notify()
        job["done"].wait()
        if job["error"] is not None:
            return 500, {"error": {"message": job["error"]}}
        outs = []
        for s in job["samples"]:
            item = result(s)
            if not body.get("return_logprob"):
                del item["meta_info"]["output_token_logprobs"]
            if not body.get("return_routed_experts"):
                del item["meta_info"]["routed_experts"]
            outs.append(item)
        return 200, outs[0] if single else outs

    # Continuous batching, as SGLang's scheduler does it (coarser: new requests join at the next
    # batch, not at the next decoding step): every request waiting when a batch starts decodes in
    # it, rows with the same sampling params (but their seeds) together. A deterministic server
    # decodes each request alone: SGLang's deterministic inference is batch-invariant, the local
    # engine is only up to rounding, which could flip a sampled token.
    pending, queued = [], threading.Condition()

    def batcher():
        while True:
            with queued:
                while not pending:
                    queued.wait()
                jobs = pending[:]
                pending.clear()
            try:
                groups = {}
                for j, job in enumerate(jobs):
                    job["samples"] = [None] * len(job["rows"])
                    for r, (_, sp) in enumerate(job["rows"]):
                        key = json.dumps({k: v for k, v in sp.items() if k != "sampling_seed"},
                                         sort_keys=True)
                        groups.setdefault((j if deterministic else 0, key), []).append((j, r))
                for members in groups.values():
                    sps = [jobs[j]["rows"][r][1] for j, r in members]
                    seeds = [sp.get("sampling_seed") for sp in sps]
                    with lock:
                        samples = engine.generate(
                            [jobs[j]["rows"][r][0] for j, r in members], 1, params_of(sps[0]),
                            row_seeds=seeds if deterministic and None not in seeds else None)
                        state["rows"] += len(members)
                        state["batches"].append(len(members))
                    for (j, r), sample in zip(members, samples):
                        jobs[j]["samples"][r] = sample
            except Exception as e:  # the batch's requests fail, the server goes on
                for job in jobs:
                    job["error"] = f"{type(e).__name__}: {e}"
            for job in jobs:
                job["done"].set()

    threading.Thread(target=batcher, daemon=True).start()

    def load_bucket(tensors, version):
        with lock:
            unknown = set(tensors) - set(weights)
            if unknown:  # sglang skips unknown names (a warning at most)
                tensors = {k: v for k, v in tensors.items() if k in weights}
            weights.update(tensors)
            load_hf_weights(gpt, TensorSource(weights, path="update"), cfg, ctx)
        if version is not None:
            state["version"] = version

    shapes = sglang_param_shapes(cfg, tp)

    def direct_update(per_rank, version):
        """``load_format: "direct"``: each rank copies its payload into its own parameters by
        SGLang name (``default_weight_loader``: a KeyError for an unknown name, an assertion
        for a size that differs)."""
        with lock:
            ranks = to_ranks(weights, cfg, tp)
        for r, named in enumerate(per_rank):
            for name, t in named.items():
                if name not in shapes:
                    return 500, {"error": {"message": f"tp rank {r}: KeyError: {name!r}"}}
                if tuple(t.shape) != shapes[name]:
                    return 500, {"error": {"message": (
                        f"tp rank {r}: AssertionError: Attempted to load weight "
                        f"({tuple(t.shape)}) into parameter {name} ({shapes[name]})")}}
                ranks[r][name].copy_(t)
        load_bucket(from_ranks(ranks, weights, cfg, tp), version)
        return 200, {"success": True, "message": "updated"}

    def tensor_update(body):
        entries = body["serialized_named_tensors"]
        per_rank = []
        for tp_rank in range(tp):  # each TP rank reads its own entry, as sglang's tp_worker does
            if tp_rank >= len(entries):
                return 500, {"error": {"message": f"tp rank {tp_rank}: list index out of range "
                                                  f"(serialized_named_tensors has {len(entries)})"}}
            named = torch.load(io.BytesIO(base64.b64decode(entries[tp_rank])), weights_only=True)
            per_rank.append(dict(named))
        state["tensor_payloads"].append(len(entries))
        for r, named in enumerate(per_rank):
            got = state["rank_tensors"].setdefault(str(r), {})
            for name, t in named.items():
                got[name] = got.get(name, 0) + t.numel() * t.element_size()
        load_format = body.get("load_format")
        if load_format == "direct":
            return direct_update(per_rank, body.get("weight_version"))
        if load_format is not None:
            return 500, {"error": {"message": f"unknown load_format {load_format!r}"}}
        for other in per_rank[1:]:  # every rank loads the full tensors and keeps its shard
            if {k: v.shape for k, v in other.items()} != {k: v.shape for k, v in per_rank[0].items()}:
                return 500, {"error": {"message": "TP ranks received different tensors"}}
        load_bucket(per_rank[0], body.get("weight_version"))
        return 200, {"success": True, "message": "updated"}

    class Handler(JSONHandler):
        def _fault(self):
            if self.path.startswith("/_"):
                return False
            with counters:
                mode = state["fault"] if state["count"] > 0 else None
                if mode:
                    state["count"] -= 1
            if mode == "500":
                self._reply(500, {"error": {"message": "injected failure"}})
            elif mode == "hang":
                time.sleep(3)
                self._reply(200, {"late": True})
            elif mode == "drop":
                self.close_connection = True
                self.connection.shutdown(2)
            elif mode == "malformed":
                self._reply(200, b"{not json")
            return mode is not None

        def _loading(self):
            """Like a server still loading its checkpoint: 503 to everything but /model_info,
            for ``startup_delay_s`` from its start and its first ``refused_probes`` probes."""
            if self.path == "/model_info":
                return False
            with counters:
                loading = (time.monotonic() - started < startup_delay_s
                           or state["refused_loading"] < refused_probes)
                if not loading:
                    return False
                state["refused_loading"] += 1
            self._reply(503, {"error": {"message": "the server is starting"}})
            return True

        def do_GET(self):
            if self._loading():
                return
            if self.path == "/_stats":
                keys = ("in_flight", "max_in_flight", "generate_requests", "rows",
                        "tensor_payloads", "rank_tensors", "batches", "version")
                posts = {}
                for path in state["calls"]:
                    posts[path] = posts.get(path, 0) + 1
                return self._reply(200, {**{k: state[k] for k in keys},
                                         "generate_posts": state["calls"].count("/generate"),
                                         "posts": posts})
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
            if self._loading():
                return
            state["calls"].append(self.path)
            if self.path == "/_fault":
                with counters:
                    state["fault"], state["count"] = body["mode"], body.get("count", 1)
                return self._reply(200, {"success": True})
            if self.path == "/_reset_stats":
                for k in ("max_in_flight", "generate_requests", "rows"):
                    state[k] = 0
                state["tensor_payloads"], state["calls"], state["rank_tensors"] = [], [], {}
                state["batches"] = []
                return self._reply(200, {"success": True})
            if self._fault():
                return
            if self.path == "/generate":
                if "input_ids" not in body:
                    return self._reply(400, {"error": {"message": "input_ids required"}})
                with counters:
                    state["in_flight"] += 1
                    state["generate_requests"] += 1
                    state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
                try:
                    time.sleep(latency_s)
                    return self._reply(*generate(body))
                finally:
                    with counters:
                        state["in_flight"] -= 1
                        if stats_file:
                            write_stats()
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
                        weights.update(gather_hf_state(gpt, cfg, ctx))
                except Exception as e:  # sglang reports failure and keeps the old weights
                    with lock:
                        load_hf_weights(gpt, TensorSource(weights, path="kept"), cfg, ctx)
                    return self._reply(400, {"success": False, "message": str(e)})
                state["version"] = body.get("weight_version", state["version"])
                return self._reply(200, {"success": True, "message": "ok",
                                         "num_paused_requests": 0})
            if self.path == "/init_weights_update_group":
                from datetime import timedelta

                import torch.distributed as dist
                from torch.distributed.distributed_c10d import _new_process_group_helper, _world

                if state["group"] is not None:  # as sglang: torch refuses a second group
                    return self._reply(200, {"success": False, "message": (
                        "Failed to initialize custom process group: the group name "
                        f"{body['group_name']!r} has already been created")})
                store = dist.TCPStore(body["master_address"], body["master_port"],
                                      body["world_size"], is_master=False,
                                      timeout=timedelta(seconds=60))
                prefix = dist.PrefixStore(body["group_name"], store)
                state["group"], _ = _new_process_group_helper(
                    body["world_size"], body["rank_offset"], [], body["backend"], prefix,
                    group_name=body["group_name"], timeout=timedelta(seconds=60))
                _world.pg_group_ranks[state["group"]] = {i: i for i in range(body["world_size"])}
                return self._reply(200, {"success": True, "message": "joined"})
            if self.path == "/destroy_weights_update_group":
                import torch.distributed as dist

                if state["group"] is None:
                    return self._reply(200, {"success": False, "message": "no such group"})
                dist.destroy_process_group(state["group"])
                state["group"] = None
                return self._reply(200, {"success": True, "message": "destroyed"})
            if self.path == "/update_weights_from_distributed":
                import torch.distributed as dist

                tensors = {}
                for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
                    t = torch.empty(shape, dtype=getattr(torch, dtype))
                    dist.broadcast(t, group_src=0, group=state["group"])
                    tensors[name] = t
                load_bucket(tensors, body.get("weight_version"))
                return self._reply(200, {"success": True, "message": "updated"})
            if self.path == "/update_weights_from_tensor":
                return self._reply(*tensor_update(body))
            if self.path in ("/release_memory_occupation", "/resume_memory_occupation"):
                tags = set(body.get("tags") or ["weights", "kv_cache", "cuda_graph"])
                if self.path.startswith("/release"):
                    state["released"] |= tags
                else:
                    state["released"] -= tags
                return self._reply(200, {"success": True})
            self._reply(404, {"error": {"message": f"no route {self.path}"}})

    def write_stats():
        tmp = f"{stats_file}.tmp"
        with open(tmp, "w") as f:
            json.dump({"generate_requests": state["generate_requests"], "rows": state["rows"],
                       "version": state["version"], "model_path": hf_dir,
                       "refused_loading": state["refused_loading"]}, f)
        os.replace(tmp, stats_file)

    # Half the start-up delay with nothing listening (connections refused), then answering 503.
    time.sleep(max(0.0, startup_delay_s / 2 - (time.monotonic() - started)))
    server = ThreadingHTTPServer((host, port), Handler)
    if ready is not None:
        ready.put(server.server_address[1])
    server.serve_forever()


def main(argv=None) -> None:
    """``python -m tests.sglang_standin`` with ``sglang.launch_server``'s flags (the ones
    launch/sglang_server.sh passes), so that the launch scripts start it as they start SGLang;
    and the stand-in's own: ``--latency-s`` per /generate, ``--startup-delay-s`` before it
    generates, ``--refused-probes`` (answered 503 however late they come: a client that did
    not wait fails), ``--deterministic``, ``--stats-dir`` (a JSON file of its counters per
    server, written after every /generate)."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--ep-size", type=int, default=1)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--skip-tokenizer-init", action="store_true")
    ap.add_argument("--enable-return-routed-experts", action="store_true")
    ap.add_argument("--latency-s", type=float, default=0.0)
    ap.add_argument("--startup-delay-s", type=float, default=0.0)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--stats-dir", default=None)
    ap.add_argument("--refused-probes", type=int, default=0)
    a = ap.parse_args(argv)
    stats = (os.path.join(a.stats_dir, f"{a.host}_{a.port}.json") if a.stats_dir else None)
    _serve(a.model_path, None, a.tp_size, a.deterministic, a.latency_s, (), host=a.host,
           port=a.port, startup_delay_s=a.startup_delay_s, stats_file=stats,
           refused_probes=a.refused_probes)


def start(hf_dir: str, *, tp: int = 1, deterministic: bool = False, latency_s: float = 0.0,
          logprob_shifts: tuple = (), timeout_s: float = 120.0):
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(hf_dir, ready, tp, deterministic, latency_s,
                                            tuple(logprob_shifts)), daemon=True)
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

    class Handler(JSONHandler):
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


def peak_allocated(fn):
    """(fn(), peak bytes allocated above the start while it ran), from the allocation and free
    events of torch's CPU allocator (torch.profiler with profile_memory)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        value = fn()
    changes = sorted((e.time_range.start, e.cpu_memory_usage if e.name == "[memory]"
                      else e.self_cpu_memory_usage) for e in prof.events())
    live = peak = 0
    for _, delta in changes:
        live += delta
        peak = max(peak, live)
    return value, peak


def trainer_sync_job(hf_dir, cases, prompts):
    """Trainer ranks: for each case (server URL, parallel layout, sync mode, server TP size,
    bucket bytes, "direct": per-rank shards in SGLang's layout, "reset_stats": the server's
    counters reset first),
    import (perturbed) HF weights into the layout, push them to the server through the HF
    mapping, and return the server's greedy outputs afterwards, what was sent and the peak
    memory allocated during the sync on each rank."""
    import warnings

    warnings.filterwarnings("ignore")
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.models.hf_mapping import load_hf_weights
    from megatron_gspo.models.model import build_model
    from megatron_gspo.distributed.parallel import destroy_parallel, init_parallel
    from megatron_gspo.rollout.sglang.engine import SGLangEngine
    from megatron_gspo.rollout.sglang.weight_sync import init_weights_update_group
    from megatron_gspo.rollout.sglang.layout import ServerLayout
    from megatron_gspo.rollout.types import SamplingParams
    from tests.model_workers import tiny_model_config

    cfg = tiny_model_config(hf_dir)
    out = []
    for case in cases:
        ctx = init_parallel(ParallelConfig(**case["parallel"]), cfg, seed=0)
        gpt = build_model(cfg, ctx)
        load_hf_weights(gpt, hf_dir, cfg, ctx)
        server_tp = case.get("server_tp", 1)
        engine = SGLangEngine([case["url"]], num_hidden_layers=4, top_k=2, moe_layers=[1, 2, 3],
                              server_tp=server_tp,
                              direct=ServerLayout(cfg, tp=server_tp) if case.get("direct") else None)
        if case.get("reset_stats") and ctx.rank == 0:
            engine.clients[0].post("/_reset_stats")
        group = None
        if case["mode"] == "distributed" and ctx.rank == 0:
            group = init_weights_update_group(engine, master_address="127.0.0.1",
                                              master_port=0, engine_gpus=[1], backend="gloo",
                                              timeout_s=60)
        error = None
        try:
            stats, peak = peak_allocated(lambda: engine.sync_from_model(
                gpt, cfg, ctx, mode=case["mode"], disk_dir=case.get("disk_dir"), group=group,
                bucket_bytes=case.get("bucket_bytes", 512 << 20)))
        except Exception as e:  # reported to the test, which expects it for some cases
            error, stats, peak = str(e), None, None
        outputs = None
        if ctx.rank == 0 and error is None:
            outputs = [s.response_ids for s in engine.generate(
                prompts, 1, SamplingParams(max_new_tokens=5, temperature=0))]
        out.append({"outputs": outputs, "stats": stats, "peak": peak, "error": error,
                    "model_bytes": sum(p.numel() * p.element_size() for p in gpt.parameters())})
        destroy_parallel(keep_process_group=True)
    return out


if __name__ == "__main__":
    main()
