"""The real entry points as a user runs them: the Hydra app (run, overrides, sweep, torchrun) and
tools.convert_hf."""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import load_hf_tensors
from tests.trainer_workers import SHORT, merge, to_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, timeout=300, module="megatron_gspo", launcher=None):
    cmd = (launcher or [sys.executable, "-m"]) + [module, *args]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def test_cfg_job_prints_resolved_config_with_overrides():
    out = run("--cfg", "job", "model=qwen3_30b_a3b", "parallel.ep=8")
    assert out.returncode == 0, out.stderr
    assert "num_experts: 128" in out.stdout and "ep: 8" in out.stdout
    assert "vocab_size: 151936" in out.stdout


def test_unknown_override_key_fails_naming_it():
    out = run("--cfg", "job", "model.num_expertz=4")
    assert out.returncode != 0
    assert "num_expertz" in out.stderr


def test_invalid_layout_fails_with_one_line(tmp_path):
    out = run("parallel.tp=2", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 2
    lines = [l for l in out.stderr.splitlines() if l.startswith("config error")]
    assert lines == ["config error: parallel.tp*pp*cp=2: does not divide the world size 1; fix: "
                     "launch a multiple of tp*pp*cp ranks or shrink the layout"]


def test_bad_data_ends_the_job_before_any_work_with_one_line(tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": 7, "answer": "3"}\n')
    out = run("data=files", f"data.files=[{bad}]", f"hydra.run.dir={tmp_path / 'a'}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == f"data error: {bad}:2: field 'prompt': must be a string"
    assert "Traceback" not in out.stderr
    assert not os.path.exists(tmp_path / "a" / "checkpoints")
    # A bad tokenizer directory is the same kind of error (TokenizerError), caught the same way.
    from megatron_gspo.data.tokenizer import TokenizerError, load_tokenizer

    with pytest.raises(TokenizerError) as info:
        load_tokenizer(str(tmp_path / "no_tokenizer"))
    assert str(info.value).startswith(f"cannot load a tokenizer from '{tmp_path / 'no_tokenizer'}'"
                                      ": no such directory") and "\n" not in str(info.value)


SHORT_RUN = to_overrides(merge(SHORT, {"trainer": {"steps": 2}, "logging": {"progress": True}}))


def test_main_job_trains_and_checkpoints(tmp_path):
    out = run(*SHORT_RUN, f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "held-out accuracy before RL" in out.stdout and "after 2 RL steps" in out.stdout
    assert "] 2/2 reward" in out.stdout  # the progress line
    assert os.path.isfile(tmp_path / "checkpoints" / "step_000002" / "MANIFEST.json")
    assert os.path.isfile(tmp_path / ".hydra" / "config.yaml")
    assert os.path.isfile(tmp_path / "resolved_config.json")


def test_multirun_sweep_gives_each_run_its_own_directory(tmp_path):
    short = to_overrides(merge(SHORT, {"trainer": {"steps": 1, "sft_steps": 0},
                                       "logging": {"drift": False}}))
    out = run("-m", *short, "seed=1,2", f"hydra.sweep.dir={tmp_path}", timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    for sub in ("0-gspo-none-seed1", "1-gspo-none-seed2"):
        assert os.path.isfile(tmp_path / sub / "checkpoints" / "step_000001" / "MANIFEST.json")


def test_torchrun_expert_parallel(tmp_path):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "-m"]
    out = run("parallel=ep2", *SHORT_RUN, f"hydra.run.dir={tmp_path}", launcher=launcher)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "world=2 tp=1 pp=1 ep=2" in out.stdout
    assert "] 2/2 reward" in out.stdout


def test_convert_hf_round_trip_through_dist_checkpoint(tiny_hf_checkpoint, tmp_path):
    ckpt, back = tmp_path / "megatron", tmp_path / "hf_back"
    out = run("import", tiny_hf_checkpoint, str(ckpt), module="tools.convert_hf")
    assert out.returncode == 0, out.stderr[-3000:]
    out = run("export", str(ckpt), str(back), module="tools.convert_hf")
    assert out.returncode == 0, out.stderr[-3000:]
    original = load_file(os.path.join(tiny_hf_checkpoint, "model.safetensors"))
    exported = load_hf_tensors(back)
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)


def test_convert_hf_reports_bad_input(tmp_path):
    out = run("import", str(tmp_path), str(tmp_path / "out"), module="tools.convert_hf")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == f"convert_hf: {tmp_path}: no config.json"


def test_rl_step_script_runs_on_cpu_with_the_tiny_model():
    """scripts/rl_step_1b.py (the one-GPU check's RL step) on CPU with the tiny model: every phase
    runs and the update throughput is printed."""
    out = subprocess.run([sys.executable, "scripts/rl_step_1b.py", "--model", "tiny", "--device",
                          "cpu", "--prompts", "2", "--group", "2", "--response", "6",
                          "--micro-batch", "2"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "phases: rollout" in out.stdout and "old_logprobs" in out.stdout
    assert "model TFLOP/s" in out.stdout and "2 updates over" in out.stdout


EXIT_TEARDOWN = """
import atexit, json
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron_gspo.config import ModelConfig, ParallelConfig
from megatron_gspo.distributed.parallel import destroy_parallel, init_parallel
init_parallel(ParallelConfig(), ModelConfig(vocab_size=128))
destroy_parallel()
init_parallel(ParallelConfig(), ModelConfig(vocab_size=128))  # the world made again
atexit._run_exitfuncs()  # what interpreter exit runs first
print(json.dumps({"world": dist.is_initialized(), "megatron": ps.model_parallel_is_initialized()}))
"""


def test_a_process_that_exits_with_its_world_up_tears_it_down_first():
    """Scripts and tools that end without destroy_parallel (rl_step_1b.py, convert_hf, evaluate)
    have it run at exit, before interpreter finalization, where gloo's threads could abort the
    process after its work was done (here after the world was made a second time)."""
    out = subprocess.run([sys.executable, "-c", EXIT_TEARDOWN], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert out.returncode == 0, out.stderr[-3000:]
    r = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert r == {"world": False, "megatron": False}


PROBE_MAIN = """
sys.argv = ["perf_probe.py"] + sys.argv[1:]
from scripts import perf_probe
perf_probe.main()
"""
SMALL_PROBE = ("--batch", "2", "--new-tokens", "3", "--prompt-tokens", "4", "--update-batch", "1",
               "--update-seq", "8")


def run_probe(*args, planted: str = ""):
    """scripts/perf_probe.py on CPU with the tiny model and ``args``, after ``planted`` (code run
    first in its process): the finished process and its JSON lines, in order."""
    import json

    code = "import sys\n" + planted + PROBE_MAIN
    out = subprocess.run([sys.executable, "-c", code, "--device", "cpu", "--model", "tiny", *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    return out, [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]


def test_the_perf_probe_runs_every_section_on_cpu():
    """scripts/perf_probe.py (the one-GPU probe) on CPU with the tiny model: one JSON line per
    section (launch, parity with transformers, update (the experts compiled too), rollout (the
    static decoder compiled too), profile, memory), then the summary line."""
    out, lines = run_probe("--batch", "3", "--new-tokens", "5", "--prompt-tokens", "4",
                           "--update-batch", "2", "--update-seq", "8", "--compile-decode",
                           "--compile-experts")
    assert out.returncode == 0, out.stderr[-3000:]
    assert [x["section"] for x in lines] == ["launch", "parity", "update", "rollout", "profile",
                                             "memory"]
    assert lines[1]["max_abs_logit_diff"] < 1e-4  # the same weights in transformers
    assert {"ours_as_is_tokens_per_s", "ours_static_tokens_per_s", "hf_dynamic_cache_tokens_per_s",
            "hf_static_cache_tokens_per_s", "ours_compiled_tokens_per_s"} <= set(lines[3])
    assert {"ours_tflops", "hf_tflops", "ours_compiled_tflops"} <= set(lines[2])
    assert lines[2]["tokens"] == 2 * 8 and lines[2]["out_of_memory_at_tokens"] == []
    assert {"update_step_kernels", "update_busy_share", "decode_5_steps_kernels",
            "decode_busy_share"} <= set(lines[4])
    assert out.stdout.strip().splitlines()[-1].startswith("ours vs HF: rollout ")


PLANTED_PROBE = """
from megatron_gspo.rollout import static_decode

def planted(self, *args, **kwargs):
    raise RuntimeError("planted: the capture failed\\nsecond line")

static_decode.StaticGenerator.generate = planted  # every static decoder, the profile's too
"""


def test_a_path_that_fails_in_the_perf_probe_leaves_the_others_figures():
    """On a GPU a path may fail where the CPU never goes (a CUDA graph's capture, a compilation):
    with every static decoder failing (planted), the probe lists the failure in one line under
    the sections that ran it, measures the other engines, prints its summary, and exits with
    status 1 (a step of ``device_check.sh`` that failed)."""
    out, records = run_probe(*SMALL_PROBE, planted=PLANTED_PROBE)
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == \
        "perf_probe: 2 failed: rollout ours_static, profile"
    lines = {x["section"]: x for x in records}
    planted = "RuntimeError: planted: the capture failed"
    rollout = lines["rollout"]
    assert rollout["failed"] == {"ours_static": planted}
    assert {"ours_as_is_tokens_per_s", "hf_dynamic_cache_tokens_per_s",
            "hf_static_cache_tokens_per_s"} <= set(rollout)
    assert "ours_static_tokens_per_s" not in rollout
    assert lines["profile"]["failed"] == {"profile": planted}
    assert "failed" not in lines["update"] and lines["update"]["ours_s"] > 0
    assert "rollout ours_static failed: " + planted in out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("ours vs HF: rollout ")


def test_a_perf_probe_out_of_time_still_prints_every_section_and_its_summary():
    """With no time left (``--budget-s 0``) every path is skipped, each listed under its
    section; the sections and the summary line print and the probe exits with status 1."""
    out, records = run_probe(*SMALL_PROBE, "--budget-s", "0")
    assert out.returncode == 1, out.stderr[-3000:]
    lines = {x["section"]: x for x in records}
    assert list(lines) == ["launch", "parity", "update", "rollout", "profile", "memory"]
    skipped = "skipped: the time budget of 0 s ran out before it"
    assert lines["parity"]["failed"] == {"load": skipped, "parity": skipped}
    assert lines["update"]["failed"] == {"ours": skipped, "hf": skipped}
    assert lines["rollout"]["failed"] == dict.fromkeys(
        ["ours_static", "hf_dynamic_cache", "hf_static_cache", "ours_as_is"], skipped)
    assert lines["profile"]["failed"] == {"profile": skipped}
    assert out.stdout.strip().splitlines()[-1] == "ours vs HF: rollout n/a, update n/a"
    assert out.stderr.strip().splitlines()[-1].startswith(
        "perf_probe: 9 failed: parity load, parity, update ours, ")


PLANTED_HF = """
import transformers

def planted(*args, **kwargs):
    raise OSError("planted: this transformers cannot read the export\\nsecond line")

transformers.AutoModelForCausalLM.from_pretrained = planted
"""


def test_a_transformers_that_cannot_load_the_model_leaves_our_figures():
    """Where the GPU's transformers cannot load our export (planted: another version's), its
    paths fail in one line each, ours are measured, and the summary says n/a."""
    out, records = run_probe(*SMALL_PROBE, planted=PLANTED_HF)
    assert out.returncode == 1, out.stderr[-3000:]
    lines = {x["section"]: x for x in records}
    not_loaded = "RuntimeError: transformers' model did not load (the parity section says why)"
    assert lines["parity"]["failed"] == {
        "load": "OSError: planted: this transformers cannot read the export", "parity": not_loaded}
    assert lines["update"]["failed"] == {"hf": not_loaded} and lines["update"]["ours_s"] > 0
    assert lines["rollout"]["failed"] == {"hf_dynamic_cache": not_loaded,
                                          "hf_static_cache": not_loaded}
    assert {"ours_static_tokens_per_s", "ours_as_is_tokens_per_s"} <= set(lines["rollout"])
    assert "failed" not in lines["profile"]
    assert out.stdout.strip().splitlines()[-1] == "ours vs HF: rollout n/a, update n/a"


def test_the_perf_probes_attempt_records_a_failure_and_lets_memory_through():
    """``attempt``: the value, or None with the failure's first line recorded; the kinds it is
    told to keep (the update's out-of-memory, which halves the rows) and interrupts go through."""
    from scripts import perf_probe

    paths = perf_probe.Paths()
    assert paths.attempt("rollout a", lambda: 3.0) == 3.0 and paths.failed == {}

    def two_lines():
        raise ValueError("the first line\nthe second")

    assert paths.attempt("rollout b", two_lines) is None
    assert paths.failed == {"rollout b": "ValueError: the first line"}
    assert paths.section("rollout") == {"failed": {"b": paths.failed["rollout b"]}}
    assert paths.section("update") == {}

    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        paths.attempt("update ours", out_of_memory, keep=(torch.OutOfMemoryError,))
    assert paths.attempt("update hf", out_of_memory) is None
    assert paths.failed["update hf"] == "OutOfMemoryError: CUDA out of memory"

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        paths.attempt("profile", interrupted)
    assert perf_probe.times(6.0, 4.0) == "1.50x" and perf_probe.times(None, 4.0) == "n/a"


def test_the_perf_probes_budget_stops_the_path_running_and_skips_the_later_ones():
    """A path still running when the probe's time budget runs out is stopped (it would never
    end here) and recorded; the paths after it are not run; the alarm's handler is put back."""
    import signal
    import time

    from scripts import perf_probe

    before = signal.getsignal(signal.SIGALRM)
    paths = perf_probe.Paths(budget_s=0.5)
    assert paths.attempt("update ours", lambda: 2.0) == 2.0  # (within the budget)
    assert signal.getsignal(signal.SIGALRM) is before

    def forever():
        while True:
            time.sleep(0.01)

    ran = []
    assert paths.attempt("rollout ours_static", forever) is None
    assert paths.attempt("rollout hf_dynamic_cache", lambda: ran.append(1)) is None
    assert ran == [] and signal.getsignal(signal.SIGALRM) is before
    assert paths.failed == {
        "rollout ours_static": "OverBudget: the time budget of 0.5 s ran out",
        "rollout hf_dynamic_cache": "skipped: the time budget of 0.5 s ran out before it"}


def test_the_perf_probes_update_is_a_gpu_micro_batch_or_the_largest_that_fits():
    """By default the probe's update is one micro-batch of ``trainer=gpu`` (what the trainer feeds
    a GPU at a time); where the device's memory runs out (CUDA raises ``torch.OutOfMemoryError``)
    it measures again with half as many rows, both sides on the same tokens, and lists the sizes
    that did not fit."""
    from megatron_gspo.config.load import compose_job
    from scripts import perf_probe

    assert perf_probe.gpu_micro_batch_tokens() == \
        compose_job(["trainer=gpu"]).trainer.max_tokens_per_micro_batch == 32768
    tried = []

    def measure(rows):
        tried.append(rows)
        if rows > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        return {"rows": rows}

    assert perf_probe.largest_that_fits(measure, 32) == (8, {"rows": 8}, [32, 16])
    assert tried == [32, 16, 8]
    assert perf_probe.largest_that_fits(measure, 5) == (5, {"rows": 5}, [])
    with pytest.raises(SystemExit, match="not one row fits"):
        perf_probe.largest_that_fits(lambda rows: measure(99), 3)
    with pytest.raises(ValueError):  # other faults are not retried
        perf_probe.largest_that_fits(lambda rows: int("x"), 4)
