"""Generation without host synchronisations per step: a batch-major static KV cache, positions
on the device, sampling on the device, the finished flags read back every few steps.

``StaticGenerator`` drives ``rollout.static_model.forward_tokens``: the prompts' prefill, then
decoding steps sampling on the device (``sampling.sample_next`` with ``row_uniform`` of a device
step counter, hashed for ``UNIFORM_STEPS`` steps at once; unseeded rows get random seeds), each
row's tokens, log-probs and routes written into device buffers; the host reads only the finished
flags, every ``readback_steps`` steps, to stop early or to move the rows still decoding into a
smaller batch bucket (a power of two: rows that finish inside a bucket only stop being written).
The cache holds a multiple of ``POSITION_MULTIPLE`` positions (a power of two when compiled), so
that a compiled step is reused across calls; past ``COMPILED_SHAPES`` compilations the step runs
uncompiled (one log line). CUDA graphs are captured per bucket over one call's cache and
dropped at its end. Where ``unsupported`` names a reason, the engine takes the model's forward.

Legend: ``B`` rows, ``S`` cache positions, ``L`` MoE layers, ``K`` top-k, ``R`` new tokens.
"""

from __future__ import annotations

import logging

import torch

from megatron_gspo.config.errors import first_line, invalid
from megatron_gspo.rollout.sampling import row_uniform, sample_next
from megatron_gspo.rollout.static_model import (StaticModel, forward_tokens, new_cache,
                                                 rope_tables, unsupported)
from megatron_gspo.rollout.types import Sample, SamplingParams, row_seed

__all__ = ["StaticGenerator", "unsupported"]

log = logging.getLogger(__name__)

POSITION_MULTIPLE = 128  # the cache's positions are a multiple of this (shapes reused)
COMPILED_SHAPES = 128  # compilations of the step at most (batch buckets x cache lengths)
UNIFORM_STEPS = 64  # decoding steps whose sampling numbers are hashed together


class StaticGenerator:
    """Generation through ``forward_tokens`` (the module's docstring). ``readback_steps``: the
    host reads the finished flags every so many steps; ``compile``: the decoding step under
    ``torch.compile`` (one graph, a recompilation per batch bucket); ``cuda_graphs``: each
    bucket's decoding step captured as a CUDA graph and replayed."""

    def __init__(self, gpt, *, pad_id: int, readback_steps: int = 8, compile: bool = False,
                 cuda_graphs: bool = False):
        self.gpt, self.pad_id, self.readback = gpt, pad_id, max(1, readback_steps)
        self.compile, self.cuda_graphs = compile, cuda_graphs
        self.graphs = {}  # bucket -> (graph, static inputs, outputs) when cuda_graphs
        self.steps_run = self.readbacks_run = 0  # decoding steps and host reads, for tests

    @torch.no_grad()
    def generate(self, prompts, samples_per_prompt: int, params: SamplingParams, *,
                 first_row: int = 0, row_seeds=None, routes: bool = False) -> list[Sample]:
        params.validate()
        try:
            return self._generate(prompts, samples_per_prompt, params, first_row, row_seeds,
                                  routes)
        finally:
            self.graphs = {}  # the captured graphs' memory pools go with them

    def _generate(self, prompts, samples_per_prompt, params, first_row, row_seeds, routes):
        model = StaticModel(self.gpt)
        device, dtype = model.embedding.device, model.embedding.dtype
        n_u = len(prompts)
        b = n_u * samples_per_prompt
        lengths_U = torch.tensor([len(p) for p in prompts], device=device)
        p_len, new = max(len(p) for p in prompts), params.max_new_tokens
        s = _cache_positions(p_len + new, self.compile)
        cos, sin = rope_tables(self.gpt, s, dtype)
        # the prefill: each prompt once, from position 0, right-padded
        tokens_UP = torch.full((n_u, p_len), self.pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens_UP[i, :len(p)] = torch.tensor(list(p))
        cache = new_cache(model, n_u, s, device, dtype)
        logits, prefill_routes = forward_tokens(
            model, cache, tokens_UP.to(device), torch.arange(p_len, device=device).expand(n_u, -1),
            cos, sin, last_B=lengths_U - 1)
        cache["valid"] &= torch.arange(s, device=device)[None] < lengths_U[:, None]
        of_row = torch.arange(n_u, device=device).repeat_interleave(samples_per_prompt,
                                                                    output_size=b)
        cache = {k: ([c.index_select(0, of_row) for c in v] if isinstance(v, list)
                     else v.index_select(0, of_row)) for k, v in cache.items()}
        logits = logits.index_select(0, of_row)
        pos_B = lengths_U.index_select(0, of_row)
        if row_seeds is None and params.seed is not None:
            row_seeds = [row_seed(params.seed, first_row + r) for r in range(b)]
        elif row_seeds is None:  # unseeded: random seeds, still sampled on the device
            row_seeds = torch.randint(0, 2 ** 62, (b,)).tolist()
        seeds_B = (torch.tensor(list(row_seeds), dtype=torch.int64, device=device)
                   if row_seeds is not None and params.temperature > 0 else None)
        routes_BSLK = None
        if routes and model.moe_layers:
            per = torch.stack(prefill_routes, 2)  # [U, P, L, K]
            routes_BSLK = torch.zeros(b, s, model.moe_layers, model.top_k, dtype=torch.long,
                                      device=device)
            routes_BSLK[:, :p_len] = per.index_select(0, of_row)
        out = self._decode(model, cache, logits, pos_B, seeds_B, params, routes_BSLK, cos, sin)
        tokens_BR, logp_BR, count_B = (x.cpu() for x in out[:3])  # the one read of the results
        routes_host = out[3].cpu() if out[3] is not None else None
        stop_ids = set(params.stop_token_ids)
        samples = []
        for r in range(b):
            i = r // samples_per_prompt
            prompt, n = list(prompts[i]), int(count_B[r])
            response = tokens_BR[r, :n].tolist()
            sample_routes = None
            if routes_host is not None:
                sample_routes = routes_host[r, :max(len(prompt) + n - 1, 0)]
            samples.append(Sample(
                prompt_ids=prompt, response_ids=response, logprobs_R=logp_BR[r, :n].clone(),
                finish_reason="stop" if n and response[-1] in stop_ids else "length",
                routes_TLK=sample_routes, prompt_index=i))
        return samples

    def _decode(self, model, cache, logits, pos_B, seeds_B, params, routes_BSLK, cos, sin):
        """Sample, feed back, repeat: every row's tokens, log-probs and count in device
        buffers; the finished flags read every ``readback`` steps (and the rows still
        decoding moved into a smaller bucket when they fit one half as large)."""
        b, new, device = pos_B.shape[0], params.max_new_tokens, pos_B.device
        tokens_BR = torch.full((b, new), self.pad_id, dtype=torch.long, device=device)
        logp_BR = torch.zeros(b, new, device=device)
        count_B = torch.zeros(b, dtype=torch.long, device=device)
        finished_B = torch.zeros(b, dtype=torch.bool, device=device)
        stop = torch.tensor(list(params.stop_token_ids), dtype=torch.long, device=device)
        rows = torch.arange(b, device=device)  # the batch's rows, in its order
        step_t = torch.zeros((), dtype=torch.long, device=device)
        uniform_BW = None  # the rows' sampling numbers of the next steps
        for step in range(new):
            if seeds_B is not None and step % UNIFORM_STEPS == 0:  # (a hash is ~120 kernels)
                steps_W = step_t + torch.arange(min(UNIFORM_STEPS, new - step), device=device)
                uniform_BW = row_uniform(seeds_B.index_select(0, rows), steps_W)
            uniform = None if uniform_BW is None else uniform_BW[:, step % UNIFORM_STEPS]
            token, logp = sample_next(logits, params, uniform_B=uniform)
            live = ~finished_B.index_select(0, rows)
            token = torch.where(live, token, self.pad_id)
            tokens_BR.index_put_((rows, step_t.expand_as(rows)), token)
            logp_BR.index_put_((rows, step_t.expand_as(rows)), torch.where(live, logp, 0.0))
            count_B.index_add_(0, rows, live.long())
            if stop.numel():
                finished_B.index_put_((rows,), finished_B.index_select(0, rows)
                                      | (token[:, None] == stop).any(-1))  # (isin may sort)
            step_t += 1
            if step == new - 1:
                break
            if (step + 1) % self.readback == 0:
                left = int((~finished_B).sum())  # the host's read, every few steps
                self.readbacks_run += 1
                if left == 0:
                    break
                bucket = _bucket(left)
                if bucket <= len(rows) // 2:
                    keep = torch.argsort(finished_B.index_select(0, rows).to(torch.uint8),
                                         stable=True)[:bucket]
                    rows, token, pos_B = rows[keep], token[keep], pos_B[keep]
                    uniform_BW = None if uniform_BW is None else uniform_BW[keep]
                    cache = {k: ([c.index_select(0, keep) for c in v] if isinstance(v, list)
                                 else v.index_select(0, keep)) for k, v in cache.items()}
            logits, step_routes = self._step(model, cache, token, pos_B, cos, sin)
            self.steps_run += 1
            if routes_BSLK is not None:  # the routes of the position fed
                routes_BSLK.index_put_((rows, pos_B), torch.stack(step_routes, 2)[:, 0])
            pos_B = torch.where(finished_B.index_select(0, rows), pos_B,
                                (pos_B + 1).clamp(max=cache["valid"].shape[1] - 1))
        return tokens_BR, logp_BR, count_B, routes_BSLK

    def _step(self, model, cache, token_B, pos_B, cos, sin):
        if not self.cuda_graphs:
            return self._call(lambda fn: fn(model, cache, token_B[:, None], pos_B[:, None],
                                            cos, sin))
        key = (len(token_B), id(cache["valid"]))
        if key not in self.graphs:
            self.graphs = {k: v for k, v in self.graphs.items() if k[1] == key[1]}
            try:
                self.graphs[key] = self._call(
                    lambda fn: _capture(fn, model, cache, token_B, pos_B, cos, sin))
            except RuntimeError as e:  # (CUDA's and torch.compile's errors)
                raise invalid("rollout.cuda_graphs", True, "capturing the decoding step as a "
                              f"CUDA graph failed ({first_line(e)})",
                              "set rollout.cuda_graphs=false") from e
        graph, static_token, static_pos, out = self.graphs[key]
        static_token.copy_(token_B)
        static_pos.copy_(pos_B)
        graph.replay()
        return out

    def _call(self, run):
        """``run(step)`` with the compiled step where asked; once dynamo has compiled it for
        ``COMPILED_SHAPES`` shapes, with the eager step from then on."""
        if not self.compile:
            return run(forward_tokens)
        try:
            with _compile_limit():
                return run(self._compiled())
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            log.warning("rollout.compile_decode: the decoding step was compiled for %d shapes; "
                        "it runs uncompiled from here", COMPILED_SHAPES)
            self.compile = False
            return run(forward_tokens)

    def _compiled(self):
        if not hasattr(self, "_compiled_step"):
            self._compiled_step = torch.compile(forward_tokens, fullgraph=True, dynamic=False)
        return self._compiled_step


def _cache_positions(n: int, compiled: bool) -> int:
    """Cache positions for ``n``: a multiple of ``POSITION_MULTIPLE``, a power of two when
    the step is compiled (each length is a compilation)."""
    if compiled:
        return max(POSITION_MULTIPLE, 1 << (n - 1).bit_length())
    return -(-n // POSITION_MULTIPLE) * POSITION_MULTIPLE


def _compile_limit():
    """Room for a compiled step per batch bucket and cache length (dynamo's default of 8
    compilations of a function is a hard error under ``fullgraph``)."""
    return torch._dynamo.config.patch(recompile_limit=COMPILED_SHAPES)


def _capture(fn, model, cache, token_B, pos_B, cos, sin):
    """The decoding step of this bucket as a CUDA graph over static inputs (torch.cuda.graphs:
    warm-up on a side stream, then capture); its replay writes the cache in place and refills
    the returned logits and routes. The warm-up's cache writes are the step's own (the same
    token at the same position)."""
    static_token, static_pos = token_B.clone(), pos_B.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(model, cache, static_token[:, None], static_pos[:, None], cos, sin)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(model, cache, static_token[:, None], static_pos[:, None], cos, sin)
    return graph, static_token, static_pos, out


def _bucket(rows: int) -> int:
    """The smallest power of two holding ``rows``."""
    return 1 << max(0, (rows - 1).bit_length())
