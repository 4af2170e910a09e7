"""The trained policy, out: a training checkpoint of an EP=2 run exported to Hugging Face (from 1
process and from 2 ranks: identical files; and by the run itself at its end), loaded by
transformers with the trainer's log-probs; ``tools.evaluate`` reproducing the run's held-out
accuracy; pass@k against its closed form; bad input as one line."""

import filecmp
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from megatron_gspo.trainer.evaluation import pass_at_k
from tests.distributed import run_ranks
from tests.trainer_workers import SHORT, merge, train_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tool(*args, nproc=1, timeout=300):
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", str(nproc), "-m"] if nproc > 1 else [sys.executable, "-m"])
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.run(launcher + list(args), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("ep2_run"))
    # A task the tiny model learns in a few warm-up steps: held-out accuracy is not zero, so
    # reproducing it means something.
    cfg = merge(SHORT, {"parallel": {"ep": 2}, "run_dir": run_dir, "seed": 3,
                        "data": {"task": "add", "max_value": 2, "eval_size": 16},
                        "trainer": {"steps": 2, "save_interval": 0, "export_hf_at_end": True,
                                    "sft_steps": 120, "sft_lr": 0.02, "sft_batch_size": 16,
                                    "sft_target_accuracy": 0.5}})
    result = run_ranks(train_job, 2, cfg)[0]
    return run_dir, result


def checkpoint_logprobs_job(path, tokens_BS):
    """The trainer's per-token log-probs of ``tokens_BS`` with the weights of ``path``."""
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.models.model import build_model
    from megatron_gspo.distributed.parallel import init_parallel
    from megatron_gspo.checkpoint.export import load_source, open_source
    from tests.model_workers import logprob_pass

    src = open_source(path)
    ctx = init_parallel(ParallelConfig(), src.model, seed=0)
    gpt = build_model(src.model, ctx)
    load_source(gpt, src, ctx)
    gpt.eval()
    logp, _ = logprob_pass(gpt, ctx, tokens_BS, backward=False)
    return logp


def same_files(a, b) -> bool:
    names = sorted(os.listdir(a))
    return names == sorted(os.listdir(b)) and all(
        filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False) for n in names)


def test_export_of_an_ep2_training_checkpoint(ep2_run, tmp_path):
    run_dir, _ = ep2_run
    step = os.path.join(run_dir, "checkpoints", "step_000002")
    one, two = tmp_path / "one", tmp_path / "two"
    out = tool("tools.convert_hf", "export", step, str(one))
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"exported training checkpoint {step}" in out.stdout
    out = tool("tools.convert_hf", "export", run_dir, str(two), "--ep", "2", nproc=2)
    assert out.returncode == 0, out.stderr[-3000:]
    # One process, two EP ranks, and the run's own export at its end: the same bytes.
    assert same_files(one, two)
    assert same_files(one, os.path.join(run_dir, "hf"))
    index = json.load(open(one / "model.safetensors.index.json"))
    assert set(index["weight_map"].values()) <= set(os.listdir(one))

    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (3, 12), generator=g)
    hf = AutoModelForCausalLM.from_pretrained(str(one), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(tokens[:, :-1]).logits.double()
    reference = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    ours = run_ranks(checkpoint_logprobs_job, 1, step, tokens)[0].double()
    assert (ours - reference).abs().max().item() <= 1e-5


def test_evaluate_reproduces_the_runs_held_out_accuracy(ep2_run, tmp_path):
    run_dir, result = ep2_run
    out_file = tmp_path / "responses.jsonl"
    out = tool("tools.evaluate", run_dir, "--ep", "2", "--out", str(out_file), nproc=2)
    assert out.returncode == 0, out.stderr[-3000:]
    accuracy = float(next(line.split()[1] for line in out.stdout.splitlines()
                          if line.startswith("accuracy ")))
    assert result["history"]["accuracy_after_rl"] > 0
    assert accuracy == pytest.approx(result["history"]["accuracy_after_rl"], abs=5e-5)
    rows = [json.loads(line) for line in open(out_file)]
    assert len(rows) == 16 and all(len(r["responses"]) == 1 for r in rows)
    assert sum(r["rewards"][0] for r in rows) / len(rows) == pytest.approx(accuracy, abs=5e-5)


def test_evaluate_samples_and_pass_at_k(ep2_run, tmp_path):
    run_dir, _ = ep2_run
    out = tool("tools.evaluate", run_dir, "--task", "add", "--size", "6", "--samples", "4",
               "--out", str(tmp_path / "r.jsonl"))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "r.jsonl")]
    assert len(rows) == 6 and all(len(r["responses"]) == 4 for r in rows)
    printed = {line.split()[0]: float(line.split()[1]) for line in out.stdout.splitlines()
               if line.startswith("pass@")}
    assert sorted(printed) == ["pass@1", "pass@2", "pass@4"]
    for k in (1, 2, 4):  # the printed estimate from the responses it wrote
        expected = sum(pass_at_k(4, sum(x >= 1.0 for x in r["rewards"]), k) for r in rows) / 6
        assert printed[f"pass@{k}"] == pytest.approx(expected, abs=5e-5)


@pytest.mark.parametrize("n,c,k", [(5, 0, 1), (5, 5, 3), (5, 2, 1), (4, 1, 2), (10, 3, 5),
                                   (16, 1, 16), (8, 7, 1)])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    closed_form = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(closed_form, abs=1e-12)


def test_pass_at_k_hand_made_cases():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # c / n
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(3, 0, 3) == 0.0 and pass_at_k(3, 1, 3) == 1.0
    with pytest.raises(ValueError, match="0 < k <= n"):
        pass_at_k(2, 1, 3)


def test_bad_checkpoint_and_data_are_one_line(ep2_run, tmp_path, capsys):
    """Both tools check their input before any process group or model (in process here)."""
    from tools import convert_hf, evaluate

    run_dir, _ = ep2_run
    assert evaluate.main([str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.strip() == f"evaluate: {tmp_path / 'nowhere'}: no such directory"
    assert evaluate.main([run_dir, "--data", str(tmp_path / "missing.jsonl")]) == 2
    assert capsys.readouterr().err.strip() == \
        f"evaluate: --data {tmp_path / 'missing.jsonl'}: no such file"
    assert convert_hf.main(["export", str(tmp_path), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "not a training checkpoint, run directory, weights checkpoint" in err


def test_tokenizer_files_travel_with_the_export(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from megatron_gspo.checkpoint.export import copy_tokenizer_files

    raw = Tokenizer(models.WordLevel({"<eos>": 0, "hi": 1}, unk_token="<eos>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>").save_pretrained(
        str(tmp_path / "tok"))
    (tmp_path / "out").mkdir()
    copied = copy_tokenizer_files(str(tmp_path / "tok"), str(tmp_path / "out"))
    assert "tokenizer.json" in copied and "tokenizer_config.json" in copied
    assert AutoTokenizer.from_pretrained(str(tmp_path / "out")).encode("hi") == [1]
    assert copy_tokenizer_files("builtin", str(tmp_path / "out")) == []
