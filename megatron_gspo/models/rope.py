"""Unfused RoPE with cos / sin computed once per table, not per layer and tensor."""

from __future__ import annotations

import torch


def _kept(owner: torch.Tensor, key: tuple, make):
    """``make()``, kept on ``owner`` (a tensor living as long as the value is valid: RoPE's table,
    or a micro-batch's ``cu_seqlens``) under ``key``; at most 8 values per owner."""
    cache = getattr(owner, "_rope_kept", None)
    if cache is None:
        cache = owner._rope_kept = {}
    value = cache.get(key)
    if value is None:
        while len(cache) >= 8:
            cache.pop(next(iter(cache)))
        value = cache[key] = make()
    return value


def cos_sin(freqs: torch.Tensor, dtype) -> tuple:
    """Megatron's ``(cos(freqs) * mscale).to(dtype)`` and likewise sin (mscale 1), the sin with
    its first ``rot // 2`` entries negated (``rotate`` multiplies it with the halves swapped).
    For a view of a contiguous table that keeps its last dim whole (decoding slices it per step)
    they are views of the whole table's, made once per table, version and dtype and kept on it
    (the same values as computed on the slice: elementwise but for the sign, which goes by the
    place in the last dim)."""
    def of(t):
        sin = (torch.sin(t) * 1.0).to(dtype)
        half = sin.shape[-1] // 2
        return (torch.cos(t) * 1.0).to(dtype), torch.cat((-sin[..., :half], sin[..., half:]), -1)

    owner = freqs if freqs._base is None else freqs._base
    if (not owner.is_contiguous() or owner.dtype != freqs.dtype
            or freqs.shape[-1] != owner.shape[-1] or freqs.stride(-1) != 1):
        return of(freqs)
    cos, sin = _kept(owner, ("table", owner.dtype, owner._version, dtype), lambda: of(owner))
    if freqs is owner:
        return cos, sin
    at = freqs.storage_offset() - owner.storage_offset()
    return (cos.as_strided(freqs.shape, freqs.stride(), at),
            sin.as_strided(freqs.shape, freqs.stride(), at))


def _packed_cos_sin(freqs: torch.Tensor, cu_seqlens: torch.Tensor, dtype) -> tuple:
    """cos / sin of Megatron's packed (THD) table without context parallelism: each sequence's
    positions from 0 (continuing its shared prefix's, when ``cu_seqlens`` carries
    ``packed_positions``), or, when the table covers every packed token, their place in the pack;
    the bounds from ``cu_seqlens.packed_bounds`` (host ints: no read of the device) when set;
    made once per micro-batch (its ``cu_seqlens`` keeps them, with the table, so that no other
    table can take its memory and its key while they are kept)."""
    positions = getattr(cu_seqlens, "packed_positions", None)  # shared prompts (PackedRows)

    def make():
        # the bounds as host ints (PackedRows puts them on its cu_seqlens), else read once
        bounds = getattr(cu_seqlens, "packed_bounds", None) or tuple(cu_seqlens.tolist())
        total = bounds[-1]
        if positions is not None:
            packed = freqs[positions.to(freqs.device)]
        elif freqs.size(0) == total:
            packed = freqs[:total]
        else:
            lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
            index = torch.cat([torch.arange(n) for n in lengths]).to(freqs.device)
            packed = freqs[index]
        return (freqs,) + cos_sin(packed, dtype)

    key = ("packed", freqs.data_ptr(), freqs.dtype, tuple(freqs.shape), tuple(freqs.stride()),
           freqs._version, cu_seqlens._version, dtype)
    return _kept(cu_seqlens, key, make)[1:]


def rotate(t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Megatron's unfused, non-interleaved rotation ``t * cos + rotate_half(t) * sin`` with
    ``rotate_half(t) = cat(-x2, x1)`` (``x1, x2 = chunk(t, 2)``), as ``t * cos + roll(t) *
    signed_sin`` (rolling by ``rot // 2`` gives ``cat(x2, x1)``, odd widths too; the signed sin
    negates the entries that meet ``x2``): the same products up to the sign, which is exact,
    summed in the same order, so the same values and gradients in two elementwise operations
    fewer; dims past the table's passed through."""
    rot = cos.shape[-1]
    if t.shape[-1] != rot:
        return torch.cat((rotate(t[..., :rot], cos, signed_sin), t[..., rot:]), dim=-1)
    return (t * cos) + (torch.roll(t, rot // 2, dims=-1) * signed_sin)


def cache_rope_tables() -> None:
    """megatron-core's unfused RoPE (``apply_rope_fusion`` off, as this project's layer spec
    sets it) computes cos and sin of the table, and under packing builds the packed table
    sequence by sequence, in every layer for q and for k. Attention's ``apply_rotary_pos_emb``
    now takes them from a cache kept on the table (and on the micro-batch's ``cu_seqlens`` when
    packed). Everything else goes to megatron's function: fusion, interleaving, MLA, an mscale,
    context parallelism under packing, inference-mode tensors (no version counter), a table
    wider than the heads. The cache trusts in-place changes of a table to bump its version
    counter (writes through ``.data`` or by a collective do not; megatron never changes a table
    in place). Idempotent."""
    from megatron.core.transformer import attention

    if getattr(attention.apply_rotary_pos_emb, "_tables_cached", False):
        return
    original = attention.apply_rotary_pos_emb

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        if (config.apply_rope_fusion or config.rotary_interleaved or config.multi_latent_attention
                or mscale != 1.0 or freqs.requires_grad or freqs.shape[-1] > t.shape[-1]
                or torch.is_inference_mode_enabled() or freqs.is_inference()
                or (cu_seqlens is not None and (cp_group is None or cp_group.size() > 1
                                                or cu_seqlens.is_inference()))):
            if getattr(cu_seqlens, "packed_positions", None) is not None:
                raise ValueError("shared prompts (trainer.share_prompts) need the unfused RoPE "
                                 "without context parallelism; set trainer.share_prompts=false")
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale,
                            cp_group=cp_group)
        if cu_seqlens is None:
            return rotate(t, *cos_sin(freqs, t.dtype))
        return rotate(t.unsqueeze(1), *_packed_cos_sin(freqs, cu_seqlens, t.dtype)).squeeze(1)

    apply_rotary_pos_emb._tables_cached = True
    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
