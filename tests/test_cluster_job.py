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


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    env = dict(os.environ, PATH=f"{bin_dir}:{VENV_BIN}:{os.environ['PATH']}", FAKE_LOG=str(log),
               FAKE_SBATCH_RUN="1", FAKE_HOSTS="127.0.0.1 127.0.0.2 127.0.0.3 127.0.0.4",
               MG_RDZV_PORT=str(_free_port()), MG_SGLANG_PORT=str(_free_port()),
               MG_SGLANG_LAUNCHER=f"{sys.executable} -m tests.sglang_standin",
               MG_SGLANG_ARGS=(f"--latency-s {GENERATE_LATENCY_S} --startup-delay-s "
                               f"{SERVER_STARTUP_S} --stats-dir {stats}"),
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    overrides = [
        "parallel.device=cpu",  # the emulated nodes have no GPUs: the same path over gloo
        *model_overrides(TINY_HF_CONFIG),
        "data=files", f"data.files=[{train}]", f"data.eval_files=[{held}]", "data.eval_size=4",
        "data.reward=exact_match", "data.reward_workers=0",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
        f"rollout.weight_sync_port={_free_port()}", "rollout.weight_sync_bucket_mb=0.05",
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
    # The trainer waited for the servers' start-up (longer than the old client's retry window).
    ready = [line for line in trainer_log.splitlines() if "server(s) ready after" in line]
    assert ready and "sglang: 2 server(s) ready" in ready[0], trainer_log[-3000:]
    assert float(ready[0].split("ready after ")[1].split(" s")[0]) > 2.0
    # Every server received requests (the replica leaders start at different servers) and
    # served the checkpoint the trainer started from.
    per_server = {f: json.loads((stats / f).read_text()) for f in sorted(os.listdir(stats))
                  if f.endswith(".json")}
    assert len(per_server) == 2, per_server
    for name, s in per_server.items():
        assert s["generate_requests"] >= 2 and s["model_path"] == model, (name, s)
    assert sum(s["refused_loading"] for s in per_server.values()) > 0  # asked while loading
