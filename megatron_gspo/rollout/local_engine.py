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
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.transformer.moe.moe_layer import BaseMoELayer
from megatron.core.transformer.utils import set_model_to_sequence_parallel

from megatron_gspo.backends import backend_for
from megatron_gspo.rollout.static_decode import StaticGenerator
from megatron_gspo.rollout.static_decode import unsupported as static_unsupported
from megatron_gspo.distributed import comm
from megatron_gspo.distributed.parallel import ParallelContext
from megatron_gspo.models.grouped_experts import cached_expert_weights
from megatron_gspo.models.layers import context_parallel_disabled
from megatron_gspo.rollout.sampling import row_uniform, sample_next
from megatron_gspo.rollout.types import Sample, SamplingParams, row_seed


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

    runs_on_every_rank = True  # every rank of a replica holds its part of the model

    def __init__(self, gpt, ctx: ParallelContext, *, replay=None, pad_id: int = 0,
                 lockstep_group=None, static: Optional[StaticGenerator] = None):
        """``lockstep_group``: ranks that generate different prompts but share collectives inside
        the model (expert parallelism across data-parallel ranks): they pad to one prompt length
        and decode until every one of them has finished. ``static``: generate through it (no
        host synchronisation per decoding step) where it covers the model."""
        self.gpt, self.ctx, self.replay, self.pad_id = gpt, ctx, replay, pad_id
        self.lockstep = lockstep_group
        self.static = (static if static is not None and lockstep_group is None
                       and static_unsupported(gpt, ctx) is None else None)
        # The prefill and the decoding steps through ``decode_step`` where it mirrors the model
        # (a whole model on one CPU rank), else through the model's forward.
        self.decoder = backend_for(ctx.device).decoder
        self.direct_decode = self.decoder is not None and self.decoder.unsupported(gpt, ctx) is None

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
            logits, routes = self.decoder.decode_step(
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
        if self.static is not None:
            return self.static.generate(prompts, samples_per_prompt, params, first_row=first_row,
                                        row_seeds=row_seeds, routes=self.replay is not None)
        g = self._start(prompts, samples_per_prompt, params, first_row, row_seeds)
        with self._generation_mode() as recorded:
            self._prefill(g, recorded)
            self._decode(g, params, recorded)
        self.decode_rows = [len(f) for f in g.fed]  # rows fed per decoding forward (for tests)
        routes = self._routes(recorded.forwards, g) if self.replay is not None else None
        return self._samples(g, params, routes)

    def _start(self, prompts, samples_per_prompt: int, params: SamplingParams, first_row: int,
               row_seeds) -> "_Generation":
        """The rows (``samples_per_prompt`` per prompt), left-padded to one prompt length (the
        lockstep group's), and their seeds."""
        rows = [(i, list(p)) for i, p in enumerate(prompts) for _ in range(samples_per_prompt)]
        b = len(rows)
        p_len = self._agree(max(len(p) for _, p in rows), b)
        s_len = p_len + params.max_new_tokens
        # The prefill runs each prompt once; its KV cache and last logits then go to the rows
        # of its samples (``of_row``: the prompt of each row).
        tokens_UP = torch.full((len(prompts), p_len), self.pad_id, dtype=torch.long)
        valid_BS = torch.zeros(b, s_len, dtype=torch.bool)
        for i, p in enumerate(prompts):
            tokens_UP[i, p_len - len(p):] = torch.tensor(list(p))
        for r, (_, p) in enumerate(rows):
            valid_BS[r, p_len - len(p):] = True
        if row_seeds is not None:
            if len(row_seeds) != b:
                raise ValueError(f"{len(row_seeds)} row seeds for {b} rows")
        elif params.seed is not None:
            row_seeds = [row_seed(params.seed, first_row + r) for r in range(b)]
        seeds_B = None
        if row_seeds is not None and params.temperature > 0:
            seeds_B = torch.tensor(list(row_seeds), dtype=torch.int64, device=self.ctx.device)
        n = params.max_new_tokens
        return _Generation(
            rows=rows, samples_per_prompt=samples_per_prompt, p_len=p_len, tokens_UP=tokens_UP,
            valid_BS=valid_BS,
            of_row=torch.arange(len(prompts)).repeat_interleave(samples_per_prompt),
            seeds_B=seeds_B,
            icx=StaticInferenceContext(max_batch_size=b, max_sequence_length=s_len),
            tokens_BR=torch.full((b, n), self.pad_id, dtype=torch.long),
            logp_BR=torch.zeros(b, n), finished=torch.zeros(b, dtype=torch.bool),
            lengths=torch.zeros(b, dtype=torch.long), batch=torch.arange(b),
            stop=torch.tensor(list(params.stop_token_ids), dtype=torch.long))

    @contextlib.contextmanager
    def _generation_mode(self):
        """The model in eval mode for generation: decoding feeds one token per row, which
        sequence parallelism cannot split, so non-MoE layers run without it (as megatron's own
        generation controller does); context parallelism is off likewise (every CP rank decodes
        whole rows); expert weights stacked once; routes recorded when asked. Yields the
        recording (or None)."""
        was_training = self.gpt.training
        self.gpt.eval()
        sp = self.ctx.sequence_parallel
        if sp:
            set_model_to_sequence_parallel(self.gpt, False, exclude_modules=[BaseMoELayer])
        recording = self.replay.record() if self.replay is not None else contextlib.nullcontext()
        try:
            with recording as recorded, context_parallel_disabled(self.gpt), \
                    cached_expert_weights(self.gpt):
                yield recorded
        finally:
            if sp:
                set_model_to_sequence_parallel(self.gpt, True, exclude_modules=[BaseMoELayer])
            if was_training:
                self.gpt.train()

    def _prefill(self, g: "_Generation", recorded) -> None:
        """Each prompt once, causal with the left padding hidden; its KV cache and last logits
        then go to the rows of its samples."""
        n_prompts, p_len = g.tokens_UP.shape
        causal = torch.ones(p_len, p_len, dtype=torch.bool).tril()
        attend = causal[None] & g.valid_BS[::g.samples_per_prompt, None, :p_len]
        logits = self._forward(g.tokens_UP, torch.arange(p_len).expand(n_prompts, p_len),
                               (~attend)[:, None], g.icx, recorded)
        g.icx.sequence_len_offset += p_len
        g.logits = self._to_rows(g.icx, logits, g.of_row, g.samples_per_prompt)

    def _decode(self, g: "_Generation", params: SamplingParams, recorded) -> None:
        """Sample a token for every row still in the batch, then feed them back, until every row
        (of the lockstep group) has finished or the length limit; finished rows leave the batch
        (and its KV cache) when the rows still decoding fall to 3/4 of it."""
        for step in range(params.max_new_tokens):
            token, logp = self._sample(g.logits, params, g.seeds_B, g.batch, step)
            live = ~g.finished[g.batch]
            token = torch.where(live, token, self.pad_id)
            g.tokens_BR[g.batch, step] = token
            g.logp_BR[g.batch, step] = torch.where(live, logp, 0.0)
            g.lengths[g.batch] += live.long()
            if len(g.stop):
                g.finished[g.batch] |= torch.isin(token, g.stop)
            decoding = self._still_decoding(int((~g.finished[g.batch]).sum()))
            if decoding == 0 or step == params.max_new_tokens - 1:
                return
            if decoding <= 3 * len(g.batch) // 4:
                keep = self._compact(g.icx, g.batch, g.finished, decoding)
                g.batch, token = g.batch[keep], token[keep]
            offset = g.icx.sequence_len_offset
            g.icx.enable_decode_mode()
            mask = ~g.valid_BS[g.batch][:, None, None, :offset + 1]
            g.logits = self._forward(token[:, None], torch.full((len(g.batch), 1), offset), mask,
                                     g.icx, recorded)
            g.fed.append(g.batch)
            g.icx.sequence_len_offset += 1
            g.valid_BS[:, offset] = True

    def _samples(self, g: "_Generation", params: SamplingParams, routes) -> list[Sample]:
        """Each row's response (through its stop token), log-probs, finish reason and routes (the
        prompt's positions, then every response token fed back)."""
        position = []  # each decoding forward: row -> its place in that forward's batch
        for rows_fed in g.fed:
            where = torch.full((len(g.rows),), -1, dtype=torch.long)
            where[rows_fed] = torch.arange(len(rows_fed))
            position.append(where.tolist())
        stop_ids = set(g.stop.tolist())
        samples = []
        for r, (i, prompt) in enumerate(g.rows):
            n = int(g.lengths[r])
            response = g.tokens_BR[r, :n].tolist()
            reason = "stop" if n and response[-1] in stop_ids else "length"
            sample_routes = None
            if routes is not None:
                prompt_part = routes[0][r, g.p_len - len(prompt):]
                fed_back = [routes[1 + t][position[t][r]] for t in range(max(0, n - 1))]
                sample_routes = torch.cat([prompt_part, *[f[None] for f in fed_back]])
            samples.append(Sample(prompt_ids=prompt, response_ids=response,
                                  logprobs_R=g.logp_BR[r, :n].clone(), finish_reason=reason,
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

    def _routes(self, forwards: list, g: "_Generation") -> list:
        """Recorded routes per forward as [B, positions, L, K]: the prefill (Megatron's [s, b]
        order, one per prompt: each row gets its prompt's) and one position per decoding
        step; with pipeline stages, every stage's layers (each stage holds its own)."""
        out = []
        for i, per_layer in enumerate(forwards):
            stacked = torch.stack(per_layer, 1)  # [N, L, K]
            if i == 0:
                per_prompt = stacked.reshape(g.p_len, -1, *stacked.shape[1:]).transpose(0, 1)
                out.append(per_prompt[g.of_row])
            else:  # the rows of that forward's (possibly compacted) batch
                out.append(stacked)
        if self.ctx.pp > 1:
            stages = [None] * self.ctx.pp
            dist.all_gather_object(stages, out, group=self.ctx.pp_group)
            out = [torch.cat([stage[i] for stage in stages], dim=-2) for i in range(len(out))]
        return out


@dataclass
class _Generation:
    """One ``generate`` call's state: the rows (prompt index, prompt ids), the padded prompts
    ``[prompts, P]``, which positions each row attends to, its seed, the static KV cache, what
    was sampled so far, and the decoding batch (the rows still in it, in its order)."""

    rows: list
    samples_per_prompt: int
    p_len: int
    tokens_UP: torch.Tensor
    valid_BS: torch.Tensor
    of_row: torch.Tensor  # each row's prompt
    seeds_B: Optional[torch.Tensor]
    icx: StaticInferenceContext
    tokens_BR: torch.Tensor
    logp_BR: torch.Tensor
    finished: torch.Tensor
    lengths: torch.Tensor  # response tokens per row
    batch: torch.Tensor  # the rows in the decoding batch, in its order
    stop: torch.Tensor
    logits: Optional[torch.Tensor] = None  # the last forward's (last stage)
    fed: list = field(default_factory=list)  # the rows of each decoding forward
