"""The cluster job as a user launches it, on this machine: the real launch/submit.sh,
train.sbatch, node.sh and sglang_server.sh under a fake SLURM (tests/fake_slurm.py), the real
torchrun and trainer on two "nodes" of 2 ranks over gloo, and SGLang stand-in servers
(tests/sglang_standin.py, started through launch/sglang_server.sh) on two more "nodes", every
node with its own loopback address. Also the plan tool on the Qwen3-30B-A3B recipe, the
one-line errors of a job whose trainer, servers and tokenizer disagree, and the package
installed as a user installs it.

Time is scaled down by ``SCALE`` = 0.02: every timeout the job sets is its shipped default times
SCALE (process groups 3 h -> 216 s, server start-up 30 min -> 36 s, one /generate 1 h -> 72 s, a
weight update 30 min -> 36 s, other calls 60 s -> 1.2 s), and so are the servers' behaviours: a
start-up of 20 min (a large checkpoint loading) -> 24 s, longer than the trainer takes to start
here and than the whole retry window of the client before this release (3.5 s of backoff) even
unscaled, and 150 s per /generate -> 3 s, longer than that client's 120 s timeout scaled (2.4 s).
"""

import json
import os
import socket
import subprocess
import sys

import pytest

from tests import fake_slurm
from tests.conftest import TINY_HF_CONFIG, make_hf_checkpoint
from tests.trainer_workers import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "launch")
VENV_BIN = os.path.dirname(sys.executable)
SCALE = 0.02
TIMEOUTS = {"parallel.timeout_s": 10800, "rollout.sglang_startup_timeout_s": 1800,
            "rollout.sglang_generate_timeout_s": 3600, "rollout.sglang_update_timeout_s": 1800,
            "rollout.sglang_control_timeout_s": 60}
SERVER_STARTUP_S, GENERATE_LATENCY_S = 1200 * SCALE, 150 * SCALE


def _free_ports(n: int) -> list[int]:
    """``n`` ports free now, all different (each held until all are picked: the system may
    hand a port just released out again)."""
    held = [socket.socket() for _ in range(n)]
    try:
        for s in held:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def model_overrides(hf: dict) -> list[str]:
    """The model section describing a HF config (the trainer checks it against config.json)."""
    return [f"model.vocab_size={hf['vocab_size']}", f"model.hidden_size={hf['hidden_size']}",
            f"model.num_layers={hf['num_hidden_layers']}",
            f"model.num_attention_heads={hf['num_attention_heads']}",
            f"model.num_query_groups={hf['num_key_value_heads']}", f"model.head_dim={hf['head_dim']}",
            f"model.ffn_hidden_size={hf['intermediate_size']}",
            f"model.moe_ffn_hidden_size={hf['moe_intermediate_size']}",
            f"model.num_experts={hf['num_experts']}", f"model.top_k={hf['num_experts_per_tok']}",
            f"model.first_k_dense={len(hf['mlp_only_layers'])}",
            f"model.rope_theta={hf['rope_theta']}", f"model.rms_norm_eps={hf['rms_norm_eps']}",
            f"model.max_position_embeddings={hf['max_position_embeddings']}"]


WORDS = ["<eos>", "<pad>", "what", "is", "plus", "equals"] + [str(i) for i in range(10)]


def save_tokenizer(path: str) -> None:
    """A word-level Hugging Face tokenizer of 16 ids (the model has 128)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<eos>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>",
                            pad_token="<pad>").save_pretrained(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny Qwen3-MoE as a HF checkpoint with its own tokenizer, and prompt files."""
    root = tmp_path_factory.mktemp("cluster_job")
    model = str(root / "model")
    make_hf_checkpoint(model)
    save_tokenizer(model)
    for name, pairs in (("train.jsonl", [(a, b) for a in range(5) for b in range(5)]),
                        ("eval.jsonl", [(1, 2), (3, 4), (2, 2), (4, 1)])):
        with open(root / name, "w") as f:
            for a, b in pairs:
                f.write(json.dumps({"prompt": f"what is {a} plus {b} equals",
                                    "answer": str(a + b)}) + "\n")
    return model, str(root / "train.jsonl"), str(root / "eval.jsonl")


def test_two_node_job_with_separate_servers_trains_the_checkpoint(checkpoint, tmp_path):
    model, train, held = checkpoint
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_slurm.install(bin_dir)
    stats, run_dir = tmp_path / "server_stats", tmp_path / "run"
    stats.mkdir()
    log = tmp_path / "calls.log"
    rdzv_port, sglang_port = _free_ports(2)
    env = dict(os.environ, PATH=f"{bin_dir}:{VENV_BIN}:{os.environ['PATH']}", FAKE_LOG=str(log),
               FAKE_SBATCH_RUN="1", FAKE_HOSTS="127.0.0.1 127.0.0.2 127.0.0.3 127.0.0.4",
               MG_RDZV_PORT=str(rdzv_port), MG_SGLANG_PORT=str(sglang_port),
               MG_SGLANG_LAUNCHER=f"{sys.executable} -m tests.sglang_standin",
               MG_SGLANG_ARGS=(f"--latency-s {GENERATE_LATENCY_S} --startup-delay-s "
                               f"{SERVER_STARTUP_S} --refused-probes 2 --stats-dir {stats}"),
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    overrides = [
        "parallel.device=cpu",  # the emulated nodes have no GPUs: the same path over gloo
        *model_overrides(TINY_HF_CONFIG),
        "data=files", f"data.files=[{train}]", f"data.eval_files=[{held}]", "data.eval_size=4",
        "data.reward=exact_match", "data.reward_workers=0",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
        "rollout.weight_sync_port=0", "rollout.weight_sync_bucket_mb=0.05",
        "algo.minibatches=2", "trainer.steps=2", "trainer.sft_steps=0", "trainer.save_interval=0",
        "trainer.micro_batch_size=2", "logging.progress=false", "logging.drift=false",
        *[f"{key}={value * SCALE:g}" for key, value in TIMEOUTS.items()],
    ]
    out = subprocess.run(
        ["bash", os.path.join(LAUNCH, "submit.sh"), "--nodes", "4", "--gpus-per-node", "2",
         "--sglang", "separate", "--sglang-nodes", "2", "--sglang-tp", "1", "--model-path", model,
         "--partition", "cpu", "--run-dir", str(run_dir), "--", *overrides],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    logs = run_dir / "logs"
    trainer_log = (logs / "4242_restart0.log").read_text() if (logs / "4242_restart0.log").exists() else ""
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:], trainer_log[-5000:])
    assert "Submitted batch job 4242" in out.stdout

    sbatch = [c for c in log.read_text().splitlines() if c.startswith("sbatch")]
    assert len(sbatch) == 1 and "--gpus-per-node=2" in sbatch[0]  # the resources were asked for
    # Two training nodes of two ranks and one server per server node, each on its own address.
    srun = [c for c in log.read_text().splitlines() if c.startswith("srun")]
    assert any("--nodelist=127.0.0.1,127.0.0.2" in c and "node.sh" in c for c in srun), srun
    assert any("--nodelist=127.0.0.3,127.0.0.4" in c and "sglang_server.sh" in c for c in srun)

    rows = read_metrics(str(run_dir))
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2]
    for r in rows:
        if "train/loss" in r:
            assert r["rollout/response_length"] > 0
            # the servers generated with the weights the trainer pushed
            assert r["rollout/logprob_mismatch"] < 1e-4
    assert f"initial weights: {model}" in trainer_log
    # The trainer waited for the servers' start-up: every server was still loading when first
    # asked (its first two probes are refused whenever they come).
    ready = [line for line in trainer_log.splitlines() if "server(s) ready after" in line]
    assert ready and "sglang: 2 server(s) ready" in ready[0], trainer_log[-3000:]
    # Every server received requests (the replica leaders start at different servers) and
    # served the checkpoint the trainer started from.
    per_server = {f: json.loads((stats / f).read_text()) for f in sorted(os.listdir(stats))
                  if f.endswith(".json")}
    assert len(per_server) == 2, per_server
    for name, s in per_server.items():
        assert s["generate_requests"] >= 2 and s["model_path"] == model, (name, s)
    assert all(s["refused_loading"] >= 2 for s in per_server.values())  # asked while loading


def plan(*args):
    """``python -m tools.plan_layout ARGS`` as a user runs it."""
    return subprocess.run([sys.executable, "-m", "tools.plan_layout", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))


def plan_here(capsys, *args):
    """The plan tool's ``main`` in this process (no interpreter start): (exit code, out, err)."""
    from tools import plan_layout

    capsys.readouterr()
    code = plan_layout.main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "train.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    return str(path)


def test_plan_of_the_qwen3_30b_recipe_on_4_nodes(qwen3_30b_dir, prompts_file, capsys):
    """Validates with the checkpoint's config.json (no weights) and prints the memory per GPU;
    its parameter count is transformers' Qwen3MoeForCausalLM's, built on the meta device."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.conftest import QWEN3_30B_A3B_CONFIG

    out = plan_here(capsys, "--nodes", "4", "--gpus-per-node", "8", "--model-path",
                    qwen3_30b_dir, "--", "+experiment=qwen3_30b_a3b", "+arm=gspo",
                    f"data.files=[{prompts_file}]")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "placement: 4 node(s) x 8 GPUs: trainer on 4 node(s) (32 ranks); rollout engine sglang"
    assert "world 32 = tp 2 x pp 1 x cp 1 x dp 16" in lines[1]
    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN3_30B_A3B_CONFIG))
    named = dict(hf.named_parameters())
    total = sum(p.numel() for p in named.values())
    assert f"({total / 1e9:.2f} B parameters)" in lines[1]
    # this rank's parameters: experts over ep 8, the rest (embeddings too) over tp 2; bf16
    experts = sum(p.numel() for n, p in named.items() if ".experts." in n)
    per_rank = experts / 8 + (total - experts) / 2
    memory = [line for line in lines if line.startswith("memory per GPU")][0]
    assert f"parameters {2 * per_rank / 2**30:.1f} GiB (bfloat16)" in memory
    assert f"gradients {4 * per_rank / 2**30:.1f}," in memory  # fp32 main_grad
    # Adam's 12 bytes per parameter, dense over dp 16 and experts over 32 / 8 = 4 replicas
    dense = (total - experts) / 2
    assert f"optimizer {12 * (dense / 16 + experts / 8 / 4) / 2**30:.1f} " in memory
    assert "recompute full" in memory and float(memory.split("total ")[1].split(" GiB")[0]) < 80
    assert any(line.startswith("host memory per rank at a checkpoint (estimate): ")
               and "dp_reshardable" in line for line in lines)
    assert f"weight sync: {2 * total / 1e9:.2f} GB per step (distributed" in out.stdout
    assert ("timeouts: process groups 10800 s; SGLang start-up 1800 s, /generate 3600 s (retried), "
            "weight update 1800 s (never retried), other calls 60 s (retried)") in out.stdout


def test_plan_refuses_a_layout_that_cannot_fit(qwen3_30b_dir, prompts_file):
    """The recipe on one node of 40 GiB GPUs: the experts' Adam state alone is 43 GiB."""
    out = plan("--nodes", "1", "--gpus-per-node", "8", "--gpu-memory-gb", "40", "--model-path",
               qwen3_30b_dir, "--", "+experiment=qwen3_30b_a3b", "+arm=gspo",
               f"data.files=[{prompts_file}]")
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith("config error: the job does not fit: about ")
    assert "optimizer 42.7" in out.stderr and "> 40 GiB; fix: more tp/ep/pp" in out.stderr


def _tokenizer_dir(path, words):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=words[0]).save_pretrained(str(path))
    return str(path)


def test_trainer_servers_and_tokenizer_must_start_from_one_checkpoint(qwen3_30b_dir, prompts_file,
                                                                      tmp_path, capsys):
    """Each disagreement is one line and exit 2, before anything is queued or built."""
    import shutil

    served = tmp_path / "served"
    shutil.copytree(qwen3_30b_dir, served)
    _tokenizer_dir(served, ["<eos>", "a", "b"])
    other = tmp_path / "other"
    shutil.copytree(served, other)
    _tokenizer_dir(tmp_path / "other_tok", ["<eos>", "c"])
    recipe = ["+experiment=qwen3_30b_a3b", "+arm=gspo", f"data.files=[{prompts_file}]",
              "rollout.sglang_urls=[http://h:30000]", f"rollout.sglang_model_path={served}"]
    cases = [
        ([f"trainer.init_from={other}", f"data.tokenizer={served}"],
         f"trainer.init_from='{other}': the trainer and the SGLang servers "
         f"(rollout.sglang_model_path={served}) would start from different weights"),
        ([f"trainer.init_from={served}"],  # the character tokenizer with a pretrained model
         f"data.tokenizer='builtin': trainer.init_from={served} has its own tokenizer"),
        ([f"trainer.init_from={served}", f"data.tokenizer={tmp_path / 'other_tok'}"],
         f"data.tokenizer='{tmp_path / 'other_tok'}': its tokenizer.json differs"),
        ([f"data.tokenizer={served}"],  # random weights against pretrained servers
         f"trainer.init_from='': the SGLang servers serve {served}, and the trainer would "
         "start from random weights"),
    ]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    for i, (extra, message) in enumerate(cases):
        outs = [plan_here(capsys, "--nodes", "4", "--gpus-per-node", "8", "--", *recipe, *extra)]
        if i == 0:  # the trainer's own entry point, as a user starts it
            outs.append(subprocess.run([sys.executable, "-m", "megatron_gspo", *recipe, *extra],
                                       cwd=ROOT, env=env, capture_output=True, text=True,
                                       timeout=120))
        for out in outs:
            assert out.returncode == 2, (extra, out.stderr)
            assert out.stderr.splitlines() == [out.stderr.strip()], out.stderr
            assert out.stderr.startswith(f"config error: {message}"), (out.stderr, message)


def test_a_server_serving_another_checkpoint_ends_the_job_with_one_line(tiny_hf_checkpoint,
                                                                         tmp_path):
    """The config agrees with itself, but the server (asked at start-up, /model_info) serves
    another checkpoint: one line, exit 2, before the first weight sync."""
    import shutil

    from tests.sglang_standin import start
    from tests.sglang_workers import SGLANG_JOB
    from tests.trainer_workers import merge, to_overrides

    copy = tmp_path / "copy"
    shutil.copytree(tiny_hf_checkpoint, copy)
    url, proc = start(tiny_hf_checkpoint)
    try:
        cfg = merge(SGLANG_JOB, {"rollout": {"sglang_urls": [url], "sglang_model_path": str(copy)},
                                 "trainer": {"init_from": str(copy)}})
        out = subprocess.run([sys.executable, "-m", "megatron_gspo", *to_overrides(cfg),
                              f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True,
                             text=True, timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    finally:
        proc.kill()
        proc.join()
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.splitlines() == [
        f"config error: rollout.sglang_model_path='{copy}': the server at {url} serves "
        f"'{tiny_hf_checkpoint}'; fix: start every server from the trainer's checkpoint, or name "
        "the one they serve"], out.stderr


def test_a_gpu_job_without_a_gpu_is_one_line():
    out = subprocess.run([sys.executable, "-m", "megatron_gspo", "parallel.device=cuda"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES=""))
    assert out.returncode == 2
    assert out.stderr.splitlines() == [out.stderr.strip()] and out.stderr.startswith(
        "config error: parallel.device='cuda': no CUDA GPU is visible to this process"), out.stderr


def group_timeouts_job(timeout_s: float) -> dict:
    """Seconds of the process groups' timeouts after ``init_parallel``: the world, this rank's
    replica group, and Megatron's data-parallel and tensor-parallel groups."""
    import torch

    from megatron_gspo.config import ModelConfig, ParallelConfig
    from megatron_gspo.distributed.parallel import destroy_parallel, init_parallel

    def seconds(group):
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    import torch.distributed as dist

    ctx = init_parallel(ParallelConfig(timeout_s=timeout_s), ModelConfig(), seed=0)
    out = {"world": seconds(dist.group.WORLD), "replica": seconds(ctx.replica_group),
           "dp": seconds(ctx.dp_group), "tp": seconds(ctx.tp_group)}
    destroy_parallel(keep_process_group=True)
    return out


def test_process_groups_take_the_configured_timeout():
    from tests.distributed import run_ranks

    out = run_ranks(group_timeouts_job, 2, 7250.0)
    for per_rank in out:
        assert per_rank["world"] == per_rank["replica"] == 7250.0
        assert per_rank["dp"] == per_rank["tp"] == 121 * 60  # Megatron's groups: whole minutes


def test_the_installed_package_runs_from_any_directory(tmp_path):
    """``pip install .`` (not editable) of a clean copy of the checkout into a fresh virtual
    environment, then ``megatron-gspo`` from a directory outside it: the config groups ship in
    the package. The environment borrows this one's installed dependencies (no download) but
    not its editable install of the project."""
    import sysconfig

    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
                           ).stdout.decode().split("\0")
    for name in filter(None, files):
        if os.path.isfile(os.path.join(ROOT, name)):
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes(open(os.path.join(ROOT, name), "rb").read())
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip()
    deps = sysconfig.get_paths()["purelib"]
    with open(os.path.join(purelib, "borrowed_dependencies.pth"), "w") as f:
        f.write(deps + "\n")  # a path line: the editable install's own .pth there is not read
    # What `pip install .` does: build the wheel (with this environment's setuptools, offline),
    # then install it.
    wheel = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                            "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                           capture_output=True, text=True, timeout=300)
    assert wheel.returncode == 0, wheel.stderr[-3000:]
    [built] = os.listdir(tmp_path / "dist")
    install = subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--no-deps",
                              str(tmp_path / "dist" / built)], capture_output=True, text=True,
                             timeout=300)
    assert install.returncode == 0, install.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    where = subprocess.run([str(py), "-c", "import megatron_gspo, megatron_gspo.config.load as c; "
                            "print(megatron_gspo.__file__); print(c.conf_dir())"], cwd=elsewhere,
                           capture_output=True, text=True, env=env, timeout=120)
    package, conf = where.stdout.split()
    assert package.startswith(purelib) and conf == os.path.join(purelib, "megatron_gspo", "conf")
    out = subprocess.run([str(venv / "bin" / "megatron-gspo"), "trainer.steps=1",
                          "trainer.sft_steps=1", "data.eval_size=4", "rollout.prompts_per_step=4",
                          "rollout.group_size=2", "algo.minibatches=1", "trainer.micro_batch_size=8",
                          "logging.drift=false",
                          "hydra.run.dir=run"], cwd=elsewhere, capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "held-out accuracy: " in out.stdout and (elsewhere / "run" / "metrics.jsonl").is_file()


def recompute_job(hf_dir, tokens_BS) -> dict:
    """Log-probs and parameter gradients of one forward + backward, without and with full
    activation recompute, from the same weights."""
    import dataclasses

    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.models.hf_mapping import load_hf_weights
    from megatron_gspo.models.model import build_model, transformer_config
    from megatron_gspo.distributed.parallel import init_parallel
    from tests.model_workers import logprob_pass, tiny_model_config

    cfg = tiny_model_config(hf_dir)
    ctx = init_parallel(ParallelConfig(), cfg, seed=0)
    out = {}
    for mode in ("none", "full"):
        m = dataclasses.replace(cfg, activation_recompute=mode)
        c = transformer_config(m, ctx)
        gpt = build_model(m, ctx)
        load_hf_weights(gpt, hf_dir, m, ctx)
        logp, _ = logprob_pass(gpt, ctx, tokens_BS)
        out[mode] = {"recompute": c.recompute_granularity, "logp": logp,
                     "grads": [p.grad.clone() for p in gpt.parameters() if p.grad is not None]}
    return out


def test_full_activation_recompute_changes_no_number(tiny_hf_checkpoint, layout_tokens):
    """model.activation_recompute=full (the 30B recipe's) reruns each layer's forward in the
    backward: the same log-probs and gradients as without it."""
    import torch

    from tests.distributed import run_ranks

    out = run_ranks(recompute_job, 1, tiny_hf_checkpoint, layout_tokens)[0]
    assert (out["none"]["recompute"], out["full"]["recompute"]) == (None, "full")
    torch.testing.assert_close(out["full"]["logp"], out["none"]["logp"], rtol=0, atol=0)
    assert len(out["full"]["grads"]) == len(out["none"]["grads"]) > 0
    for a, b in zip(out["none"]["grads"], out["full"]["grads"]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
