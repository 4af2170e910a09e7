import json
import os

import pytest

from tests.distributed import run_ranks

# The tiny Qwen3-MoE every reference test uses: a leading dense layer, GQA, QK-norm, 4 experts top-2.
TINY_HF_CONFIG = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
    tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6, initializer_range=0.1,
    max_position_embeddings=256,
)


def load_hf_tensors(path) -> dict:
    """Every tensor of a HF checkpoint directory (one file or sharded with an index)."""
    from megatron_gspo.models.hf_io import HFCheckpoint

    ckpt = HFCheckpoint(str(path))
    return {name: ckpt.get(name) for name in ckpt.weight_map}


def pytest_sessionstart(session):
    """Every temporary file of the session (this process's, its workers' and subprocesses':
    ``tempfile`` and ``TMPDIR``, torchrun's too) goes under one directory, removed at the end.
    Compiled kernels keep their usual cache (the next session finds them) and pytest's own
    ``tmp_path`` directories their usual place (the last three sessions' are kept)."""
    import getpass
    import multiprocessing.util
    import tempfile

    multiprocessing.util.get_temp_dir()  # (this process's own: multiprocessing removes it at exit)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
        tempfile.gettempdir(), "torchinductor_" + getpass.getuser()))
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    scratch = tempfile.mkdtemp(prefix="megatron-gspo-tests-")
    os.chmod(scratch, 0o1777)  # as /tmp: the reward sandbox's other user makes files there too
    session.config.stash[SCRATCH] = scratch
    os.environ["TMPDIR"] = tempfile.tempdir = scratch


def pytest_sessionfinish(session):
    import shutil

    scratch = session.config.stash.get(SCRATCH, None)
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)


SCRATCH = pytest.StashKey[str]()


@pytest.fixture
def dist_run():
    """Run a function on N real gloo ranks: ``dist_run(fn, world_size, *args)``."""
    return run_ranks


def make_hf_checkpoint(path, **overrides):
    """Save a randomly initialised transformers Qwen3MoeForCausalLM (fp32) as a HF checkpoint."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**TINY_HF_CONFIG, **overrides})).float()
    with torch.no_grad():  # non-trivial norm weights so that a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["model_type"] == "qwen3_moe"
    return path


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory):
    return make_hf_checkpoint(str(tmp_path_factory.mktemp("hf_tiny")))


@pytest.fixture(scope="session")
def perturbed_checkpoint(tiny_hf_checkpoint, tmp_path_factory):
    """The tiny checkpoint with every tensor moved by 0.2 N(0, 1): (directory, tensors)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("hf_perturbed")
    for f in os.listdir(tiny_hf_checkpoint):
        shutil.copy(os.path.join(tiny_hf_checkpoint, f), path)
    tensors = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    tensors = {k: v + 0.2 * torch.randn(v.shape, generator=g) for k, v in tensors.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path), tensors


# Parallel layouts of the tiny model (world size, ParallelConfig kwargs).
LAYOUTS = {
    "single": (1, {}),
    "tp2_sp": (2, dict(tp=2, sequence_parallel=True)),
    "ep2": (2, dict(ep=2)),
    "pp2": (2, dict(pp=2)),
    "tp2_ep2": (4, dict(tp=2, ep=2, sequence_parallel=True)),
    "pp2_ep2": (4, dict(pp=2, ep=2)),
}


@pytest.fixture(scope="session")
def layout_tokens():
    import torch

    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 128, (4, 17), generator=g)


@pytest.fixture(scope="session")
def gspo_inputs():
    """A batch for one GSPO step: tokens, old-policy offsets (some clipping), advantages, and
    response masks of 16, 7, 1 and 10 tokens."""
    import torch

    g = torch.Generator().manual_seed(21)
    tokens = torch.randint(0, 128, (4, 17), generator=g)
    delta = 2e-4 * torch.randn(4, 16, generator=g)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    mask = torch.zeros(4, 16)
    for i, n in enumerate([16, 7, 1, 10]):
        mask[i, 16 - n:] = 1
    return tokens, delta, adv, mask


PACKED_LAYOUTS = ("single", "tp2_sp", "pp2")


def packed_sequences():
    import torch

    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (n,), generator=g) for n in (7, 10, 2, 6)]


@pytest.fixture(scope="session")
def unnormalised_checkpoint(tmp_path_factory):
    """norm_topk_prob=False (Megatron's pre-softmax router) with no leading dense layer."""
    return make_hf_checkpoint(str(tmp_path_factory.mktemp("hf_unnormalised")),
                              norm_topk_prob=False, mlp_only_layers=[])


@pytest.fixture(scope="session")
def layout_runs(tiny_hf_checkpoint, unnormalised_checkpoint, layout_tokens, gspo_inputs,
                tmp_path_factory):
    """Every model-level job of the tiny model's layouts, all layouts of one world size in one
    spawn: per layout, {"model": forward/backward + HF export results, "gspo": one GSPO step,
    "packed": packed vs padded log-probs (PACKED_LAYOUTS), "export": dir}; and under
    "unnormalised", the EP=2 forward of ``unnormalised_checkpoint``."""
    from tests.distributed import run_layouts
    from tests.model_workers import gspo_step_job, layout_job, packed_vs_padded_job

    out = {}
    for world in sorted({w for w, _ in LAYOUTS.values()}):
        cases, slots = [], []
        for n in [n for n, (w, _) in LAYOUTS.items() if w == world]:
            out[n] = {"export": str(tmp_path_factory.mktemp(f"export_{n}"))}
            kwargs = LAYOUTS[n][1]
            cases.append((layout_job, (tiny_hf_checkpoint, kwargs, layout_tokens, out[n]["export"])))
            cases.append((gspo_step_job, (tiny_hf_checkpoint, kwargs, *gspo_inputs, "gspo")))
            slots += [(n, "model"), (n, "gspo")]
            if n in PACKED_LAYOUTS:
                cases.append((packed_vs_padded_job, (tiny_hf_checkpoint, kwargs,
                                                     packed_sequences())))
                slots.append((n, "packed"))
        if world == 2:
            cases.append((layout_job, (unnormalised_checkpoint, dict(ep=2), layout_tokens)))
            slots.append(("unnormalised", "model"))
        for (n, key), per_rank in zip(slots, run_layouts(world, cases)):
            out.setdefault(n, {})[key] = per_rank
    return out


# Qwen/Qwen3-30B-A3B's config.json as published (the values the model reads; no weights).
QWEN3_30B_A3B_CONFIG = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
    tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645,
)


@pytest.fixture(scope="session")
def qwen3_30b_dir(tmp_path_factory):
    """A directory holding Qwen3-30B-A3B's config.json alone: enough to plan and validate."""
    path = tmp_path_factory.mktemp("qwen3_30b_a3b")
    (path / "config.json").write_text(json.dumps(QWEN3_30B_A3B_CONFIG))
    return str(path)
