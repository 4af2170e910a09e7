"""In-process generation with the Megatron model itself: batched, with a static KV cache.

Prompts are left-padded to a common length; a key mask hides the padding in the prefill and in
every decoding step (RoPE is relative, so the shift of padded rows does not change attention).
The prefill runs each prompt once, whatever its number of samples; the rows of its samples then
start from copies of its KV cache and last logits.
Each step feeds one token per row and reads only the last position's logits (the prefill too:
the static inference context materialises the last position's logits only). Rows that have finished
leave the decoding batch (the KV cache keeps the rows still decoding). Routed experts are recorded
with megatron's RouterReplay (RECORD) in every forward, when a ``RoutingReplay`` is given.

Legend: ``B`` rows (prompts x samples), ``P`` padded prompt length, ``S`` P + max new tokens,
``V`` vocab, ``K`` top-k, ``L`` MoE layers.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.transformer.moe.moe_layer import BaseMoELayer
from megatron.core.transformer.utils import set_model_to_sequence_parallel

from megatron_gspo import comm
from megatron_gspo.rollout import decode_step
from megatron_gspo.grouped_experts import cached_expert_weights
from megatron_gspo.layers import context_parallel_disabled
from megatron_gspo.parallel import ParallelContext
from megatron_gspo.rollout.types import Sample, SamplingParams, row_seed


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for int64 tensors x < 2^32 without overflowing int64 (c split in halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash with full avalanche (C. Wellons' "lowbias32")."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_uniform(row_seeds: torch.Tensor, step: int) -> torch.Tensor:
    """[B] uniform numbers in (0, 1) with 53 random bits (float64), a pure function of each row's
    seed and the decoding step (a counter-based hash, for the whole batch at once on the seeds'
    device): a row samples the same tokens whichever rank, batch or position in the batch
    generates it."""
    seeds = row_seeds.to(torch.int64)
    key = _mix32((seeds & _MASK32) ^ _mix32(((seeds >> 32) & _MASK32) ^ 0x9E3779B9))
    key = _mix32(key ^ _mix32(torch.full_like(key, (step * 0x632BE5AB + 1) & _MASK32)))
    high = _mix32(key ^ 0x85EBCA6B) >> 5  # 27 bits
    low = _mix32(key ^ 0xC2B2AE35) >> 6  # 26 bits
    return ((high * 2 ** 26 + low).double() + 0.5) * (1.0 / 2 ** 53)


def sample_next(logits_BV: torch.Tensor, params: SamplingParams, generator=None, uniform_B=None):
    """(token [B], log-prob [B]) from last-position logits: greedy at temperature 0, else sampled
    from softmax(logits / T) restricted to top-k / top-p (with ``uniform_B``, by inverting each
    row's cumulative distribution, in float64, at its given uniform number: one random number per
    row, not per vocabulary entry). The log-prob is of the untruncated tempered distribution
    (T = 1 when greedy), which is what the trainer recomputes."""
    logits = logits_BV.float()
    if params.temperature == 0:
        token = logits.argmax(-1)
        logq = torch.log_softmax(logits, -1)
        return token, logq.gather(-1, token[:, None])[:, 0]
    logq = torch.log_softmax(logits / params.temperature, -1)
    truncated = 0 < params.top_k < logq.shape[-1] or params.top_p < 1.0
    filtered = logq.clone() if truncated else logq
    if params.top_k > 0 and params.top_k < filtered.shape[-1]:
        kth = filtered.topk(params.top_k, -1).values[:, -1:]
        filtered[filtered < kth] = -float("inf")
    if params.top_p < 1.0:
        sorted_lq, order = filtered.sort(-1, descending=True)
        cum = sorted_lq.exp().cumsum(-1)
        drop = cum - sorted_lq.exp() > params.top_p  # keep the smallest prefix reaching top_p
        sorted_lq[drop] = -float("inf")
        filtered = torch.full_like(filtered, -float("inf")).scatter(-1, order, sorted_lq)
    if uniform_B is not None:
        cdf = torch.softmax(filtered.double(), -1).cumsum(-1)
        # The first entry whose cumulative probability reaches u (scaled to the row's total, which
        # rounding keeps a hair from 1): never an entry of probability 0.
        point = uniform_B.to(cdf.device)[:, None] * cdf[:, -1:]
        token = torch.searchsorted(cdf, point)[:, 0].clamp_(max=cdf.shape[-1] - 1)
    else:
        token = torch.multinomial(torch.softmax(filtered, -1), 1, generator=generator)[:, 0]
    return token, logq.gather(-1, token[:, None])[:, 0]


def _cache_rows(icx, index: torch.Tensor) -> None:
    """The static KV cache's batch rows ``index`` (of the current ones, repeats allowed), in that
    order: the positions written so far are copied, the rest of each buffer is zeros."""
    written = icx.sequence_len_offset
    for layer, memory in list(icx.key_value_memory_dict.items()):
        picked = []
        for m in memory:  # key, value: [S, rows, ...]
            out = m.new_zeros(m.shape[0], len(index), *m.shape[2:])
            out[:written] = m[:written].index_select(1, index.to(m.device))
            picked.append(out)
        icx.key_value_memory_dict[layer] = tuple(picked)


class LocalEngine:
    """Generates with ``gpt`` in this process; weight updates are the trainer's own, in place."""

    def __init__(self, gpt, ctx: ParallelContext, *, replay=None, pad_id: int = 0,
                 lockstep_group=None):
        """``lockstep_group``: ranks that generate different prompts but share collectives inside
        the model (expert parallelism across data-parallel ranks): they pad to one prompt length
        and decode until every one of them has finished."""
        self.gpt, self.ctx, self.replay, self.pad_id = gpt, ctx, replay, pad_id
        self.lockstep = lockstep_group
        # The prefill and the decoding steps through ``decode_step`` where it mirrors the model
        # (a whole model on one CPU rank), else through the model's forward.
        self.direct_decode = decode_step.unsupported(gpt, ctx) is None

    def health(self) -> bool:
        return True

    def shutdown(self) -> None:
        return None

    def update_weights(self, source=None) -> None:
        """The engine shares the trainer's parameters: nothing to copy. A state dict, if given,
        is loaded in place."""
        if source is not None:
            self.gpt.load_state_dict(source, strict=True)

    def _forward(self, tokens_BS, positions_BS, mask, icx, recorded=None):
        """One forward through every pipeline stage: hidden states go stage to stage, the last
        stage returns logits (None elsewhere). With ``direct_decode``, ``decode_step`` on this
        rank's whole model instead (the positions follow the cache's), its routes appended to
        ``recorded`` (the model's routers record their own otherwise)."""
        ctx, device = self.ctx, self.ctx.device
        if self.direct_decode:
            logits, routes = decode_step.decode_step(
                self.gpt, icx, tokens_BS.to(device), icx.sequence_len_offset, mask.to(device),
                self.gpt.rotary_pos_emb(icx.max_sequence_length))
            if recorded is not None:
                recorded.forwards.append(routes)
            return logits
        if ctx.pp > 1 and not ctx.is_first_stage:
            hidden = torch.empty(tokens_BS.shape[1], tokens_BS.shape[0], self.gpt.config.hidden_size,
                                 dtype=self.gpt.config.params_dtype, device=device)
            dist.recv(hidden, group_src=ctx.pp_rank - 1, group=ctx.pp_group)
            self.gpt.set_input_tensor([hidden])
        out = self.gpt(tokens_BS.to(device), positions_BS.to(device), attention_mask=mask.to(device),
                       inference_context=icx, runtime_gather_output=True)
        if ctx.pp > 1 and not ctx.is_last_stage:
            dist.send(out.contiguous(), group_dst=ctx.pp_rank + 1, group=ctx.pp_group)
            return None
        return out

    def _from_last_stage(self, token, logp):
        """The last stage's sampled tokens and log-probs on every stage, in one broadcast (ids
        are exact in fp64), as host tensors: the step's one device-to-host copy."""
        both = torch.stack([token.to(torch.float64), logp.to(torch.float64)])
        comm.broadcast_tensor(both, src_in_group=self.ctx.pp - 1, group=self.ctx.pp_group)
        both = both.cpu()
        return both[0].long(), both[1].float()

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], samples_per_prompt: int,
                 params: SamplingParams, *, first_row: int = 0,
                 row_seeds: Optional[Sequence[int]] = None) -> list[Sample]:
        """``samples_per_prompt`` responses per prompt. With ``params.seed``, response r of the
        request (counting from ``first_row``) samples with a uniform number keyed by
        (``row_seed(seed, first_row + r)``, position): the same tokens whichever data-parallel
        rank or batch generates it. ``row_seeds`` gives each row's seed explicitly instead.

        Rows that have finished leave the decoding batch: when the rows still decoding fall to
        3/4 of the batch, the batch and its KV cache keep only them (ranks in lockstep keep the
        same number of rows, the most any of them still decodes)."""
        params.validate()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        rows = [(i, list(p)) for i, p in enumerate(prompts) for _ in range(samples_per_prompt)]
        b, n_prompts = len(rows), len(prompts)
        p_len = self._agree(max(len(p) for _, p in rows), b)
        s_len = p_len + params.max_new_tokens
        # The prefill runs each prompt once; its KV cache and last logits then go to the rows
        # of its samples (``of_row``: the prompt of each row).
        tokens_UP = torch.full((n_prompts, p_len), self.pad_id, dtype=torch.long)
        valid_BS = torch.zeros(b, s_len, dtype=torch.bool)
        for i, p in enumerate(prompts):
            tokens_UP[i, p_len - len(p):] = torch.tensor(list(p))
        for r, (_, p) in enumerate(rows):
            valid_BS[r, p_len - len(p):] = True
        of_row = torch.arange(n_prompts).repeat_interleave(samples_per_prompt)
        if row_seeds is not None:
            if len(row_seeds) != b:
                raise ValueError(f"{len(row_seeds)} row seeds for {b} rows")
        elif params.seed is not None:
            row_seeds = [row_seed(params.seed, first_row + r) for r in range(b)]
        seeds_B = None
        if row_seeds is not None and params.temperature > 0:
            seeds_B = torch.tensor(list(row_seeds), dtype=torch.int64, device=self.ctx.device)

        icx = StaticInferenceContext(max_batch_size=b, max_sequence_length=s_len)
        was_training = self.gpt.training
        self.gpt.eval()
        # Decoding feeds one token per row, which sequence parallelism cannot split: as megatron's
        # own generation controller does, non-MoE layers run without it while generating. Context
        # parallelism is off likewise: every CP rank decodes the whole rows.
        sp = self.ctx.sequence_parallel
        if sp:
            set_model_to_sequence_parallel(self.gpt, False, exclude_modules=[BaseMoELayer])
        recording = self.replay.record() if self.replay is not None else contextlib.nullcontext()
        tokens_BR = torch.full((b, params.max_new_tokens), self.pad_id, dtype=torch.long)
        logp_BR = torch.zeros(b, params.max_new_tokens)
        finished = torch.zeros(b, dtype=torch.bool)
        lengths = torch.zeros(b, dtype=torch.long)  # response tokens per row
        stop = torch.tensor(list(params.stop_token_ids), dtype=torch.long)
        batch = torch.arange(b)  # the rows in the decoding batch, in its order
        fed = []  # the rows of each decoding forward
        try:
            with recording as recorded, context_parallel_disabled(self.gpt), \
                    cached_expert_weights(self.gpt):
                causal = torch.ones(p_len, p_len, dtype=torch.bool).tril()
                attend = causal[None] & valid_BS[::samples_per_prompt, None, :p_len]
                logits = self._forward(tokens_UP, torch.arange(p_len).expand(n_prompts, p_len),
                                       (~attend)[:, None], icx, recorded)
                icx.sequence_len_offset += p_len
                logits = self._to_rows(icx, logits, of_row, samples_per_prompt)
                for step in range(params.max_new_tokens):
                    token, logp = self._sample(logits, params, seeds_B, batch, step)
                    live = ~finished[batch]
                    token = torch.where(live, token, self.pad_id)
                    tokens_BR[batch, step] = token
                    logp_BR[batch, step] = torch.where(live, logp, 0.0)
                    lengths[batch] += live.long()
                    if len(stop):
                        finished[batch] |= torch.isin(token, stop)
                    decoding = self._still_decoding(int((~finished[batch]).sum()))
                    if decoding == 0 or step == params.max_new_tokens - 1:
                        break
                    if decoding <= 3 * len(batch) // 4:
                        keep = self._compact(icx, batch, finished, decoding)
                        batch, token = batch[keep], token[keep]
                    offset = icx.sequence_len_offset
                    icx.enable_decode_mode()
                    mask = ~valid_BS[batch][:, None, None, :offset + 1]
                    logits = self._forward(token[:, None], torch.full((len(batch), 1), offset),
                                           mask, icx, recorded)
                    fed.append(batch)
                    icx.sequence_len_offset += 1
                    valid_BS[:, offset] = True
        finally:
            if sp:
                set_model_to_sequence_parallel(self.gpt, True, exclude_modules=[BaseMoELayer])
            if was_training:
                self.gpt.train()
        self.decode_rows = [len(f) for f in fed]  # rows fed per decoding forward (for tests)
        routes = (self._routes(recorded.forwards, of_row, p_len) if self.replay is not None
                  else None)
        if routes is not None and self.ctx.pp > 1:  # every stage holds its own layers' routes
            stages = [None] * self.ctx.pp
            dist.all_gather_object(stages, routes, group=self.ctx.pp_group)
            routes = [torch.cat([stage[i] for stage in stages], dim=-2) for i in range(len(routes))]
        position = []  # each decoding forward: row -> its place in that forward's batch
        for rows_fed in fed:
            where = torch.full((b,), -1, dtype=torch.long)
            where[rows_fed] = torch.arange(len(rows_fed))
            position.append(where.tolist())
        stop_ids = set(stop.tolist())
        samples = []
        for r, (i, prompt) in enumerate(rows):
            n = int(lengths[r])
            response = tokens_BR[r, :n].tolist()
            reason = "stop" if n and response[-1] in stop_ids else "length"
            sample_routes = None
            if routes is not None:  # prompt positions, then every response token fed back
                prompt_part = routes[0][r, p_len - len(prompt):]
                fed_back = [routes[1 + t][position[t][r]] for t in range(max(0, n - 1))]
                sample_routes = torch.cat([prompt_part, *[f[None] for f in fed_back]])
            samples.append(Sample(prompt_ids=prompt, response_ids=response,
                                  logprobs_R=logp_BR[r, :n].clone(), finish_reason=reason,
                                  routes_TLK=sample_routes, prompt_index=i))
        return samples

    def _sample(self, logits, params, seeds_B, batch, step):
        """The batch's next tokens and their log-probs (host tensors), sampled on the last stage."""
        if logits is not None:
            uniform = None
            if seeds_B is not None:
                uniform = row_uniform(seeds_B[batch.to(seeds_B.device)], step)
            token, logp = sample_next(logits[:, -1], params, uniform_B=uniform)
        else:
            token = torch.zeros(len(batch), dtype=torch.long, device=self.ctx.device)
            logp = torch.zeros(len(batch), device=self.ctx.device)
        return self._from_last_stage(token, logp)

    def _still_decoding(self, count: int) -> int:
        """Rows still decoding: this rank's, or the most of any rank in lockstep."""
        if self.lockstep is None:
            return count
        return int(comm.reduce_values([count], device=self.ctx.device, group=self.lockstep,
                                      op="max", dtype=torch.int64)[0])

    @staticmethod
    def _compact(icx, batch, finished, size: int) -> torch.Tensor:
        """Shrink the decoding batch to ``size`` rows: the unfinished ones first (in order), then
        finished ones if ``size`` asks for more (lockstep); the KV cache keeps their entries.
        Returns the kept places of the current batch."""
        done = finished[batch]
        keep = torch.cat([(~done).nonzero()[:, 0], done.nonzero()[:, 0]])[:size]
        keep = keep.sort().values
        _cache_rows(icx, keep)
        return keep

    def _agree(self, p_len: int, b: int) -> int:
        """The padded prompt length of the lockstep group (whose row counts must be equal)."""
        if self.lockstep is None:
            return p_len
        longest, most, fewest = comm.reduce_values([p_len, b, -b], device=self.ctx.device,
                                                   group=self.lockstep, op="max",
                                                   dtype=torch.int64)
        if most != -fewest:
            raise ValueError(f"ranks generating in lockstep must have equal row counts; this rank "
                             f"has {b}, another {most if most != b else -fewest}")
        return int(longest)

    @staticmethod
    def _to_rows(icx, logits, of_row: torch.Tensor, samples_per_prompt: int):
        """After the prefill of each prompt once: its KV cache entries and last logits copied to
        the rows of its samples."""
        if samples_per_prompt == 1:
            return logits
        _cache_rows(icx, of_row)
        return None if logits is None else logits.index_select(0, of_row.to(logits.device))

    @staticmethod
    def _routes(forwards: list, of_row: torch.Tensor, p_len: int) -> list:
        """Recorded routes per forward as [B, positions, L, K]: the prefill (Megatron's [s, b]
        order, one per prompt: each row gets its prompt's) and one position per decoding
        step."""
        out = []
        for i, per_layer in enumerate(forwards):
            stacked = torch.stack(per_layer, 1)  # [N, L, K]
            if i == 0:
                per_prompt = stacked.reshape(p_len, -1, *stacked.shape[1:]).transpose(0, 1)
                out.append(per_prompt[of_row])
            else:  # the rows of that forward's (possibly compacted) batch
                out.append(stacked)
        return out
