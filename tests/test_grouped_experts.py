"""Grouped-GEMM experts (megatron_gspo/grouped_experts.py) against Megatron's SequentialMLP: the
same outputs, input gradients (of the tokens and of their routing probabilities) and weight
gradients (fp32, <= 1e-6 of the largest value) on 1 rank, EP=2 and expert TP=2, with an expert
that gets no token, and with Megatron's GLU offset and clamp, through the CPU function and
through grouped_mm, also under Megatron's DDP (gradients in its main_grad buffers,
accumulating over backwards); and the layer spec uses them unless told not to."""

from tests.distributed import run_layouts
from tests.grouped_workers import experts_equal_job, spec_job


def test_grouped_experts_equal_sequential_mlp_and_are_in_the_spec():
    one, glu, small, spec = run_layouts(1, [
        (experts_equal_job, ()), (experts_equal_job, (1, 1, 0, "float32", 0.5, 0.1)),
        (experts_equal_job, (1, 1, 0, "float32", 0.0, None, 16)), (spec_job, ())])
    ep2, etp2 = run_layouts(2, [(experts_equal_job, (2, 1)), (experts_equal_job, (1, 2))])
    # under Megatron's DDP: the CPU function adds its weight gradients into main_grad itself
    ddp, ddp_small = run_layouts(1, [(experts_equal_job, (1, 1, 0, "float32", 0.0, None, 256, True)),
                                     (experts_equal_job, (1, 1, 0, "float32", 0.0, None, 16, True))])
    (ddp_ep2,) = run_layouts(2, [(experts_equal_job, (2, 1, 0, "float32", 0.0, None, 256, True))])
    # fp32 SwiGLU on CPU runs as one autograd function; Megatron's GLU variants and experts below
    # swiglu_cpu_min_weight (32 x 64 here) take grouped_mm over stacked weights
    for per_rank, path in ((one, "swiglu_cpu"), (glu, "grouped"), (small, "grouped"),
                           (ep2, "swiglu_cpu"), (etp2, "swiglu_cpu"), (ddp, "swiglu_cpu"),
                           (ddp_small, "grouped"), (ddp_ep2, "swiglu_cpu")):
        for r in per_rank:
            assert r["paths"] == [path], r
            assert r["out"] <= 1e-6 and r["dx"] <= 1e-6 and r["dw"] <= 1e-6, r
            assert r["dprobs"] <= 1e-6, r
            assert r.get("accum", 0.0) <= 1e-6, r
    assert spec[0] == {"default": "GroupedSequentialMLP", "off": "SequentialMLP"}


def _swiglu_reference(x, probs, counts, fc1, fc2):
    """Each expert's ``fc2(silu(a) * b * prob)``, ``[a, b] = fc1(x)``, by plain autograd."""
    import torch
    import torch.nn.functional as F

    outs, start = [], 0
    for n, w1, w2 in zip(counts, fc1, fc2):
        a, b = (x[start:start + n] @ w1.t()).chunk(2, dim=-1)
        outs.append((F.silu(a) * b * probs[start:start + n, None]) @ w2.t())
        start += n
    return torch.cat(outs)


def test_experts_function_workspace_reuses_buffers_without_sharing_live_ones():
    """The CPU experts function takes its activations and temporaries from the layer's
    ``BufferPool`` and gives them back after its backward: two passes in flight at once (as
    pipeline schedules keep them) never share a buffer, each gives the reference's outputs and
    gradients, the next pass reuses the given-back memory, a pass without autograd gives its
    buffers back at once, longer inputs get new buffers, and a second backward through the same
    graph is refused instead of reading reused memory."""
    import pytest
    import torch

    from megatron_gspo.buffers import BufferPool
    from megatron_gspo.grouped_experts import experts_swiglu

    g = torch.Generator().manual_seed(0)
    h, f, n = 32, 24, 4
    fc1 = [(torch.randn(2 * f, h, generator=g) / 6).requires_grad_() for _ in range(n)]
    fc2 = [(torch.randn(h, f, generator=g) / 5).requires_grad_() for _ in range(n)]
    ws = BufferPool()

    def batch(counts):
        t = sum(counts)
        return (torch.randn(t, h, generator=g).requires_grad_(),
                torch.rand(t, generator=g).requires_grad_(), torch.randn(t, h, generator=g))

    def bounds(counts):
        ends = torch.tensor(counts).cumsum(0).tolist()
        return list(zip([0] + ends[:-1], ends))

    def grads(out, dy, x, p):
        return torch.autograd.grad(out, [x, p, *fc1, *fc2], dy)

    passes = []
    for counts in ([5, 0, 7, 3], [2, 6, 1, 4]):  # two forwards before either backward
        x, p, dy = batch(counts)
        out = experts_swiglu(x, p, bounds(counts), ws, fc1, fc2)
        ref = _swiglu_reference(x, p, counts, fc1, fc2)
        passes.append((out, ref, dy, x, p))
    assert ws.free == []  # both passes hold their buffers
    for out, ref, dy, x, p in reversed(passes):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        for a, b in zip(grads(out, dy, x, p), grads(ref, dy, x, p)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    given = {b.data_ptr() for b in ws.free}
    # each pass's 4 activations; the later backward took the 3 temporaries the first gave back
    assert len(given) == len(ws.free) == 11

    counts = [3, 3, 3, 3]
    x, p, dy = batch(counts)
    out = experts_swiglu(x, p, bounds(counts), ws, fc1, fc2)
    assert len(ws.free) == 7 and {b.data_ptr() for b in ws.free} < given  # 4 taken again
    torch.autograd.grad(out, [x], dy, retain_graph=True)
    assert {b.data_ptr() for b in ws.free} == given
    with pytest.raises(RuntimeError, match="twice"):
        torch.autograd.grad(out, [x], dy)
    with torch.no_grad():
        out = experts_swiglu(x, p, bounds(counts), ws, fc1, fc2)
    assert {b.data_ptr() for b in ws.free} == given  # taken and given back at once
    torch.testing.assert_close(out, _swiglu_reference(x, p, counts, fc1, fc2).detach(),
                               rtol=1e-5, atol=1e-6)

    counts = [40, 9, 30, 11]  # more rows than any buffer holds
    x, p, dy = batch(counts)
    out = experts_swiglu(x, p, bounds(counts), ws, fc1, fc2)
    ref = _swiglu_reference(x, p, counts, fc1, fc2)
    for a, b in zip(grads(out, dy, x, p), grads(ref, dy, x, p)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert max(b.numel() for b in ws.free) >= sum(counts) * 2 * f
