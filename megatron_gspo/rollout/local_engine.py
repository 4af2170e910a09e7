"""In-process generation with the Megatron model itself: batched, with a static KV cache.

Prompts are left-padded to a common length; a key mask hides the padding in the prefill and in
every decoding step (RoPE is relative, so the shift of padded rows does not change attention).
Each step feeds one token per row and reads only the last position's logits. Routed experts are
recorded with megatron's RouterReplay (RECORD) in every forward, when a ``RoutingReplay`` is given.

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
from megatron_gspo.layers import context_parallel_disabled
from megatron_gspo.parallel import ParallelContext
from megatron_gspo.rollout.types import Sample, SamplingParams, row_seed


def row_noise(row_seeds: list, step: int, vocab: int) -> torch.Tensor:
    """[B, V] Gumbel noise, a pure function of each row's seed and the decoding step: a row samples
    the same tokens whichever rank, batch or position in the batch generates it."""
    out = torch.empty(len(row_seeds), vocab)
    for r, seed in enumerate(row_seeds):
        g = torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63 - 1))
        out[r] = torch.rand(vocab, generator=g)
    return -torch.log(-torch.log(out.clamp(1e-20, 1.0 - 1e-7)))


def sample_next(logits_BV: torch.Tensor, params: SamplingParams, generator=None, noise_BV=None):
    """(token [B], log-prob [B]) from last-position logits: greedy at temperature 0, else sampled
    from softmax(logits / T) restricted to top-k / top-p (with ``noise_BV``, by Gumbel-max on the
    given noise). The log-prob is of the untruncated tempered distribution (T = 1 when greedy),
    which is what the trainer recomputes."""
    logits = logits_BV.float()
    if params.temperature == 0:
        token = logits.argmax(-1)
        logq = torch.log_softmax(logits, -1)
        return token, logq.gather(-1, token[:, None])[:, 0]
    logq = torch.log_softmax(logits / params.temperature, -1)
    filtered = logq.clone()
    if params.top_k > 0 and params.top_k < filtered.shape[-1]:
        kth = filtered.topk(params.top_k, -1).values[:, -1:]
        filtered[filtered < kth] = -float("inf")
    if params.top_p < 1.0:
        sorted_lq, order = filtered.sort(-1, descending=True)
        cum = sorted_lq.exp().cumsum(-1)
        drop = cum - sorted_lq.exp() > params.top_p  # keep the smallest prefix reaching top_p
        sorted_lq[drop] = -float("inf")
        filtered = torch.full_like(filtered, -float("inf")).scatter(-1, order, sorted_lq)
    if noise_BV is not None:
        token = (filtered + noise_BV.to(filtered.device)).argmax(-1)
    else:
        token = torch.multinomial(torch.softmax(filtered, -1), 1, generator=generator)[:, 0]
    return token, logq.gather(-1, token[:, None])[:, 0]


class LocalEngine:
    """Generates with ``gpt`` in this process; weight updates are the trainer's own, in place."""

    def __init__(self, gpt, ctx: ParallelContext, *, replay=None, pad_id: int = 0,
                 lockstep_group=None):
        """``lockstep_group``: ranks that generate different prompts but share collectives inside
        the model (expert parallelism across data-parallel ranks): they pad to one prompt length
        and decode until every one of them has finished."""
        self.gpt, self.ctx, self.replay, self.pad_id = gpt, ctx, replay, pad_id
        self.lockstep = lockstep_group

    def health(self) -> bool:
        return True

    def shutdown(self) -> None:
        return None

    def update_weights(self, source=None) -> None:
        """The engine shares the trainer's parameters: nothing to copy. A state dict, if given,
        is loaded in place."""
        if source is not None:
            self.gpt.load_state_dict(source, strict=True)

    def _forward(self, tokens_BS, positions_BS, mask, icx):
        """One forward through every pipeline stage: hidden states go stage to stage, the last
        stage returns logits (None elsewhere)."""
        ctx, device = self.ctx, self.ctx.device
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

    def _from_last_stage(self, *tensors):
        """The last stage's sampled tokens and log-probs (on the run's device), on every stage,
        as host tensors."""
        for t in tensors:
            comm.broadcast_tensor(t, src_in_group=self.ctx.pp - 1, group=self.ctx.pp_group)
        return tuple(t.cpu() for t in tensors)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], samples_per_prompt: int,
                 params: SamplingParams, *, first_row: int = 0,
                 row_seeds: Optional[Sequence[int]] = None) -> list[Sample]:
        """``samples_per_prompt`` responses per prompt. With ``params.seed``, response r of the
        request (counting from ``first_row``) samples from noise keyed by
        (``row_seed(seed, first_row + r)``, position): the same tokens whichever data-parallel
        rank or batch generates it. ``row_seeds`` gives each row's seed explicitly instead."""
        params.validate()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        rows = [(i, list(p)) for i, p in enumerate(prompts) for _ in range(samples_per_prompt)]
        b = len(rows)
        p_len = self._agree(max(len(p) for _, p in rows), b)
        s_len = p_len + params.max_new_tokens
        tokens_BP = torch.full((b, p_len), self.pad_id, dtype=torch.long)
        valid_BS = torch.zeros(b, s_len, dtype=torch.bool)
        for r, (_, p) in enumerate(rows):
            tokens_BP[r, p_len - len(p):] = torch.tensor(p)
            valid_BS[r, p_len - len(p):] = True
        if row_seeds is not None:
            if len(row_seeds) != b:
                raise ValueError(f"{len(row_seeds)} row seeds for {b} rows")
            row_seeds = list(row_seeds)
        elif params.seed is not None:
            row_seeds = [row_seed(params.seed, first_row + r) for r in range(b)]

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
        out_tokens, out_logp = [], []
        finished = torch.zeros(b, dtype=torch.bool)
        lengths = torch.zeros(b, dtype=torch.long)  # response tokens per row
        stop = torch.tensor(list(params.stop_token_ids), dtype=torch.long)
        try:
            with recording as recorded, context_parallel_disabled(self.gpt):
                causal = torch.ones(p_len, p_len, dtype=torch.bool).tril()
                attend = causal[None] & valid_BS[:, None, :p_len]
                logits = self._forward(tokens_BP, torch.arange(p_len).expand(b, p_len),
                                       (~attend)[:, None], icx)
                icx.sequence_len_offset += p_len
                for step in range(params.max_new_tokens):
                    if logits is not None:
                        noise = None
                        if row_seeds is not None and params.temperature > 0:
                            noise = row_noise(row_seeds, step, logits.shape[-1])
                        token, logp = sample_next(logits[:, -1], params, noise_BV=noise)
                        logp = logp.float()
                    else:
                        token = torch.zeros(b, dtype=torch.long, device=self.ctx.device)
                        logp = torch.zeros(b, device=self.ctx.device)
                    token, logp = self._from_last_stage(token, logp)
                    token = torch.where(finished, self.pad_id, token)
                    out_tokens.append(token)
                    out_logp.append(logp)
                    lengths += (~finished).long()
                    if len(stop):
                        finished |= torch.isin(token, stop)
                    if self._all_finished(finished) or step == params.max_new_tokens - 1:
                        break
                    offset = icx.sequence_len_offset
                    icx.enable_decode_mode()
                    mask = ~valid_BS[:, None, None, :offset + 1]
                    logits = self._forward(token[:, None], torch.full((b, 1), offset), mask, icx)
                    icx.sequence_len_offset += 1
                    valid_BS[:, offset] = True
        finally:
            if sp:
                set_model_to_sequence_parallel(self.gpt, True, exclude_modules=[BaseMoELayer])
            if was_training:
                self.gpt.train()
        tokens_BR = torch.stack(out_tokens, 1)
        logp_BR = torch.stack(out_logp, 1)
        routes = self._routes(recorded.forwards, b, p_len) if self.replay is not None else None
        if routes is not None and self.ctx.pp > 1:  # every stage holds its own layers' routes
            stages = [None] * self.ctx.pp
            dist.all_gather_object(stages, routes, group=self.ctx.pp_group)
            routes = [torch.cat([stage[i] for stage in stages], dim=-2) for i in range(len(routes))]
        samples = []
        for r, (i, prompt) in enumerate(rows):
            n = int(lengths[r])
            response = tokens_BR[r, :n].tolist()
            reason = "stop" if n and len(stop) and response[-1] in stop.tolist() else "length"
            sample_routes = None
            if routes is not None:  # prompt positions, then every response token fed back
                prompt_part = routes[0][r, p_len - len(prompt):]
                fed = [routes[1 + t][r] for t in range(max(0, n - 1))]
                sample_routes = torch.cat([prompt_part, *[f[None] for f in fed]])
            samples.append(Sample(prompt_ids=prompt, response_ids=response,
                                  logprobs_R=logp_BR[r, :n].clone(), finish_reason=reason,
                                  routes_TLK=sample_routes, prompt_index=i))
        return samples

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

    def _all_finished(self, finished: torch.Tensor) -> bool:
        done = bool(finished.all())
        if self.lockstep is None:
            return done
        return comm.all_ranks(done, device=self.ctx.device, group=self.lockstep)

    @staticmethod
    def _routes(forwards: list, b: int, p_len: int) -> list:
        """Recorded routes per forward as [B, positions, L, K]: the prefill (Megatron's [s, b]
        order) and one position per decoding step."""
        out = []
        for i, per_layer in enumerate(forwards):
            stacked = torch.stack(per_layer, 1)  # [N, L, K]
            if i == 0:
                out.append(stacked.reshape(p_len, b, *stacked.shape[1:]).transpose(0, 1))
            else:
                out.append(stacked.reshape(b, *stacked.shape[1:]))
        return out
