"""Each CPU adaptation: megatron-core fails without it, works with it, and none applies on GPU."""

import math

import pytest
import torch

from megatron_gspo.backends import backend_for
from megatron_gspo.backends.cpu import megatron as cpu_backend
from megatron_gspo.backends.cpu.adaptation import TORCH_ON_CPU
from megatron_gspo.models import te
from tests.distributed import run_ranks
from tests.backend_workers import (backend_before_and_after, gloo_bucket_collectives,
                                   redirect_probe_on_clean_module)


@pytest.fixture(scope="module")
def probe():
    return run_ranks(backend_before_and_after, 1)[0]


def test_each_check_fails_without_the_backend(probe):
    # On megatron-core 0.16.1 without CUDA every one of these raises.
    assert probe["before"] == {"rope": "AssertionError", "memory_buffer": "AssertionError",
                               "rng_tracker": "AssertionError", "clip": "AssertionError",
                               "router_gemm": "NameError"}


def test_every_adaptation_is_needed_on_this_megatron(probe):
    assert all(probe["needed"].values()), [k for k, v in probe["needed"].items() if not v]


def test_nothing_is_applied_for_a_cuda_device(probe):
    assert probe["cuda_activation"] == []
    assert probe["active_after_cuda"] == []


def test_cpu_activation_is_complete_and_idempotent(probe):
    names = [a.name for a in cpu_backend.ADAPTATIONS]
    assert probe["cpu_activation"] == names
    assert probe["cpu_activation_again"] == names


def test_checks_pass_with_the_backend(probe):
    assert probe["after"] == {k: "" for k in probe["before"]}
    assert probe["forks_advance"]
    assert probe["rope_freqs"].shape == (6, 1, 1, 8)


def test_te_symbol_is_defined_once_and_only_when_missing(probe):
    assert probe["te_symbol_defined"] is True
    assert probe["te_symbol_again"] is False


def test_clip_matches_formula(probe):
    # grads of 3.0, total norm 6.0, max norm 1.0: scaled by 1 / (6 + 1e-6)
    expected = torch.full((4,), 3.0) * (1.0 / (6.0 + 1e-6))
    assert torch.allclose(probe["clipped_grad"], expected, rtol=0, atol=1e-7)


def test_clip_is_noop_under_the_limit():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 0.1)
    cpu_backend.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=math.sqrt(0.03))
    assert torch.equal(p.grad, torch.full((3,), 0.1))


def test_gloo_bucket_collectives_equal_torchs():
    """The bucket reduce-scatter / all-gather as one all-reduce give this rank's shard (and the
    gathered bucket) exactly as torch's gloo functions do, on 3 ranks and on one-rank groups."""
    for seen in run_ranks(gloo_bucket_collectives, 3):
        assert seen == {"world": {"reduce_scatter_equal": True, "all_gather_equal": True},
                        "one": {"reduce_scatter_equal": True, "all_gather_equal": True},
                        "separate_output_equal": True}


def test_redirect_switches_off_for_a_module_without_cuda_use():
    assert run_ranks(redirect_probe_on_clean_module, 1) == [False]


def test_dispatcher_and_init_choices():
    cpu, gpu = backend_for(torch.device("cpu")), backend_for(torch.device("cuda", 0))
    assert (cpu.name, gpu.name) == ("cpu", "gpu")
    assert cpu.token_dispatcher == "allgather" and gpu.token_dispatcher == "alltoall"
    assert cpu.init_on_cpu and not gpu.init_on_cpu
    assert cpu.decoder is not None and gpu.decoder is None
    assert issubclass(cpu.norm, gpu.norm) and issubclass(cpu.attention, gpu.attention)
    assert issubclass(cpu.experts, gpu.experts)


def test_torch_proxy_maps_only_cuda_devices():
    t = TORCH_ON_CPU.zeros(2, device="cuda")
    assert t.device.type == "cpu"
    assert TORCH_ON_CPU.cuda.current_device() == "cpu"
    assert TORCH_ON_CPU.cuda.synchronize() is None
    assert TORCH_ON_CPU.float32 is torch.float32


def test_te_facade_fallback():
    assert te.HAVE_TE is False  # transformer_engine cannot be installed on these machines
    assert not te.use_te_spec("cuda") and not te.use_te_spec("cpu")
    with pytest.raises(ImportError, match=r"pip install -e \.\[gpu\]"):
        te.require_te("fp8 training")
