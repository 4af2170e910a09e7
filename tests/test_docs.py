"""The user's guide stays true: the generated references are current and cover every key, the
README is short and its runnable commands run as written, every link resolves, and a bad input
reaches the user as one line."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from megatron_gspo.config.load import SECTIONS
from megatron_gspo.trainer.metric_tags import TAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
CONFIG_MD = os.path.join(ROOT, "docs", "reference", "config.md")
METRICS_MD = os.path.join(ROOT, "docs", "reference", "metrics.md")
RUNNABLE = re.compile(r"<!-- runnable(?::[^>]*)? -->\s*\n```bash\n(.*?)```", re.S)


def user_env(**extra) -> dict:
    """The environment of a user who installed the project: its virtual environment's
    executables first on PATH, nothing set to quiet warnings."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.update(extra)
    return env


def test_reference_docs_are_current():
    out = subprocess.run([sys.executable, "-m", "tools.reference_docs", "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


def test_every_config_key_and_metric_tag_is_documented():
    config_md, metrics_md = open(CONFIG_MD).read(), open(METRICS_MD).read()
    keys = [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    assert len(keys) > 100  # the walk saw the schema
    missing = [k for k in keys if f"| `{k}` |" not in config_md]
    assert not missing, missing
    undocumented = [k for k in keys if re.search(rf"\| `{re.escape(k)}` \| [^|]* \| [^|]* \|\s*\|$",
                                                  config_md, re.M)]
    assert not undocumented, f"keys without a meaning: {undocumented}"
    assert all(f"| `{tag}` |" in metrics_md for tag, _ in TAGS)


def test_readme_is_a_short_guide():
    lines = open(README).read().splitlines()
    assert len(lines) <= 300, len(lines)
    headings = [l for l in lines if l.startswith("## ")]
    for wanted in ("## Status", "## Quickstart", "## Install", "## Run on GPUs",
                   "## Configuration at a glance", "## Outputs and exit codes", "## Architecture",
                   "## Documentation", "## Development"):
        assert any(h.startswith(wanted) for h in headings), wanted


def test_every_relative_link_resolves():
    pages = [README, os.path.join(ROOT, "CHANGELOG.md")]
    for base, _, files in os.walk(os.path.join(ROOT, "docs")):
        pages += [os.path.join(base, f) for f in files if f.endswith(".md")]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", open(page).read()):
            if "://" in target:
                continue
            if not os.path.exists(os.path.join(os.path.dirname(page), target)):
                broken.append(f"{os.path.relpath(page, ROOT)}: {target}")
    assert len(pages) >= 15 and not broken, broken


def runnable_commands() -> list[str]:
    """The commands of README's fenced bash blocks marked ``<!-- runnable -->``, one per
    (backslash-continued) line, comments dropped."""
    commands = []
    for block in RUNNABLE.findall(open(README).read()):
        for command in block.replace("\\\n", " ").splitlines():
            command = command.split("  #")[0].strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def test_readme_marks_its_runnable_commands():
    commands = runnable_commands()
    assert len(commands) >= 3, commands
    assert any("launch/submit.sh" in c for c in commands)


@pytest.mark.parametrize("command", runnable_commands())
def test_readme_command_runs_as_written(command, tmp_path, qwen3_30b_dir):
    """Each runnable command, as written, from a fresh directory that has the checkout's launch
    scripts and its virtual environment (``.venv``: this interpreter's); ``$HF`` is a
    Qwen3-30B-A3B config directory and ``$PROMPTS`` a prompt file."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                               for i in range(8)))
    os.symlink(os.path.join(ROOT, "launch"), tmp_path / "launch")
    os.symlink(os.path.dirname(os.path.dirname(sys.executable)), tmp_path / ".venv")
    env = user_env(HF=qwen3_30b_dir, PROMPTS=str(prompts), OMP_NUM_THREADS="1")
    out = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, f"{command}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    words = shlex.split(command)
    if words[1:3] == ["-m", "megatron_gspo"] and "--cfg" not in words:
        assert "held-out accuracy:" in out.stdout  # it ran to its end
        assert out.stderr == "", out.stderr  # a clean console


def test_a_malformed_prompt_file_is_exactly_one_line_on_stderr(tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n')
    out = subprocess.run([sys.executable, "-m", "megatron_gspo", "data=files",
                          f"data.files=[{bad}]", f"hydra.run.dir={tmp_path / 'run'}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=user_env())
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        f"data error: {bad}:2: not valid JSON (Expecting value)"], out.stderr
    assert not os.path.exists(tmp_path / "run" / "checkpoints")
