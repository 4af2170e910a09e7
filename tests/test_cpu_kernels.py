"""cpu_kernels: the experts' SwiGLU kernel (whole experts per OpenMP thread) builds here, gives
the PyTorch loop's results (forward, every gradient, main_grad accumulation), keeps the calling
thread's OpenMP count, raises errors instead of crashing, a failed build falls back, and a build
killed half-way does not block the next."""

import json
import logging
import os
import subprocess
import sys
import threading

import pytest
import torch

from megatron_gspo.backends.cpu import kernels as cpu_kernels
from megatron_gspo.backends.cpu.experts import _ExpertsSwiGLU

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _experts(seed=0, counts=(40, 0, 97, 13, 64, 1, 120, 33), H=32, F=48):
    g = torch.Generator().manual_seed(seed)
    ends = torch.tensor(counts).cumsum(0).tolist()
    bounds = list(zip([0] + ends[:-1], ends))
    n = len(counts)
    w = ([(torch.randn(2 * F, H, generator=g) * 0.1).requires_grad_() for _ in range(n)]
         + [(torch.randn(H, F, generator=g) * 0.1).requires_grad_() for _ in range(n)])
    for i, t in enumerate(w):  # every other weight has a main_grad (DDP's), already holding a sum
        if i % 2:
            t.main_grad = torch.randn(t.shape, generator=g)
    x = torch.randn(ends[-1], H, generator=g).requires_grad_()
    probs = torch.rand(ends[-1], generator=g).requires_grad_()
    grad = torch.randn(ends[-1], H, generator=g)
    return x, probs, bounds, n, w, grad


def _run(kernel, x, probs, bounds, n, w, grad):
    for t in (x, probs, *w):
        t.grad = None
    kept = [t.main_grad.clone() for t in w if hasattr(t, "main_grad")]
    out = _ExpertsSwiGLU.apply(x, probs, bounds, n, kernel, *w)
    out.backward(grad)
    result = {"out": out.detach().clone(), "dx": x.grad.clone(), "dprobs": probs.grad.clone()}
    for i, t in enumerate(w):
        result[f"w{i}"] = (t.main_grad if hasattr(t, "main_grad") else t.grad).clone()
    for t, m in zip((t for t in w if hasattr(t, "main_grad")), kept):
        t.main_grad.copy_(m)
    return result


def test_kernel_builds_and_gives_the_loops_results():
    kernel = cpu_kernels.experts_swiglu()
    assert kernel is not None, "the C++ kernel did not build on this machine (see the log)"
    x, probs, bounds, n, w, grad = _experts()
    loop, fast = _run(None, x, probs, bounds, n, w, grad), _run(kernel, x, probs, bounds, n, w, grad)
    for name in loop:
        torch.testing.assert_close(fast[name], loop[name], rtol=1e-6, atol=1e-6, msg=name)
    # the weights with a main_grad got their gradient added to it, the others a tensor of their own
    for i, t in enumerate(w):
        assert getattr(t, "grad_added_to_main_grad", False) is bool(i % 2)
    # the empty expert (index 1): nothing added to its fc1's and fc2's main_grad
    fresh = _experts()[4]
    for i in (1, n + 1):
        assert torch.equal(fast[f"w{i}"], fresh[i].main_grad)


def test_kernel_errors_raise_and_name_the_kernel():
    kernel = cpu_kernels.experts_swiglu()
    x, probs, bounds, n, w, _ = _experts()
    fc1, fc2 = [t.detach() for t in w[:n]], [t.detach() for t in w[n:]]
    fc1[2] = fc1[2][:, :-1]  # one expert's fc1 weight one column short: its product fails
    T, f = x.shape[0], fc1[0].shape[0] // 2
    bufs = [torch.empty(T, 2 * f)] + [torch.empty(T, f) for _ in range(3)] + [torch.empty_like(x)]
    with pytest.raises(RuntimeError, match="mat1 and mat2|size mismatch|shapes cannot"):
        kernel.forward(x.detach(), probs.detach(), [b[0] for b in bounds], [b[1] for b in bounds],
                       fc1, fc2, *bufs)
    with pytest.raises(RuntimeError, match="experts_swiglu: x must be a CPU float32 tensor"):
        kernel.forward(x.detach().double(), probs.detach(), [b[0] for b in bounds],
                       [b[1] for b in bounds], fc1, fc2, *bufs)


SCRIPT = """
import json, torch
from megatron_gspo.backends.cpu import kernels as cpu_kernels, threads as intra_op
from tests.test_cpu_kernels import _experts, _run
pinned = intra_op.pin_to_this_thread()
x, probs, bounds, n, w, grad = _experts()
_run(cpu_kernels.experts_swiglu(), x, probs, bounds, n, w, grad)
print(json.dumps({"pinned": pinned, "this": torch.get_num_threads(),
                  "new": intra_op.count_in_a_new_thread()}))
"""


def test_kernel_keeps_the_calling_threads_openmp_count():
    # A pinned trainer: torch's process-wide count is 1, the training thread's 2. A kernel that
    # went through at::parallel_for would reset the training thread's count to 1 on first use.
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if not r["pinned"]:
        pytest.skip("torch here does not run on OpenMP with MKL: nothing to pin")
    assert r == {"pinned": True, "this": 2, "new": 1}


def test_a_failed_build_logs_one_line_and_returns_none(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="megatron_gspo.backends.cpu.kernels"):
        mod = cpu_kernels.build("megatron_gspo_test_no_compiler", "experts_swiglu.cpp",
                                str(tmp_path / "build"))
    assert mod is None
    [record] = [r for r in caplog.records if r.name == "megatron_gspo.backends.cpu.kernels"]
    message = record.getMessage()
    assert "\n" not in message
    assert "megatron_gspo_test_no_compiler" in message and "using the PyTorch path" in message


def test_a_build_killed_half_way_does_not_block_the_next(tmp_path, monkeypatch):
    # torch's lock file, left behind by a build that was killed, would make torch wait for ever;
    # the next build (here one that fails fast, with no compiler) clears it and returns
    directory = tmp_path / "build"
    directory.mkdir()
    (directory / "lock").write_text("")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    done = []
    worker = threading.Thread(target=lambda: done.append(cpu_kernels.build(
        "megatron_gspo_test_stale_lock", "experts_swiglu.cpp", str(directory))), daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert done == [None], "the build waited on the stale lock file"
    assert not (directory / "lock").exists()


def test_copies_of_the_package_share_one_build_of_the_same_source(monkeypatch, tmp_path):
    # torch's build file names the source by its absolute path: the build compiles a copy kept
    # in a directory named by the source's content, so that a checkout and an installed package
    # share it instead of rebuilding whenever the other has run
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    here = cpu_kernels.build_directory("megatron_gspo_experts_swiglu", "experts_swiglu.cpp")
    assert here.startswith(str(tmp_path / "ext")) and "megatron_gspo_experts_swiglu-" in here
    text = open(os.path.join(cpu_kernels.CSRC, "experts_swiglu.cpp")).read()
    installed = tmp_path / "site-packages" / "csrc"
    installed.mkdir(parents=True)
    (installed / "experts_swiglu.cpp").write_text(text)
    monkeypatch.setattr(cpu_kernels, "CSRC", str(installed))
    assert cpu_kernels.build_directory("megatron_gspo_experts_swiglu",
                                       "experts_swiglu.cpp") == here
    (installed / "experts_swiglu.cpp").write_text(text + "\n// changed\n")
    changed = cpu_kernels.build_directory("megatron_gspo_experts_swiglu", "experts_swiglu.cpp")
    assert changed != here and os.path.dirname(changed) == os.path.dirname(here)
