"""Rewards: the sandbox contains hostile programs (as root, in CI), code and math checkers, the
bounded reward pool."""

import os
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_gspo.rewards import RewardInput, get_reward
from megatron_gspo.rewards.code import score_program
from megatron_gspo.rewards.math import equivalent, extract_answer
from megatron_gspo.rewards.pool import RewardPool
from megatron_gspo.rewards.sandbox import UID_BASE, UID_RANGE, run
from tests.reward_fixtures import flaky_reward, length_reward

DOUBLE = [("21\n", "42"), ("5\n", "10")]
CORRECT = "print(int(input()) * 2)"


def hostile(port: int) -> dict:
    return {
        "fork bomb": "import os\nwhile True:\n    os.fork()",
        "memory bomb": "x = bytearray(4 << 30)",
        "infinite loop": "while True:\n    pass",
        "output flood": "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n"
                        "    sys.stdout.write(chunk)",
        "write outside": "open('/tmp/sandbox_escape_probe', 'w').write('x')\nprint(42)",
        "network": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 1)\nprint(42)",
        "environment": "import os\nprint(os.environ['SANDBOX_SECRET'])",
        "kill parent": f"import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
                       f"os.kill({os.getpid()}, signal.SIGKILL)\nprint(42)",
    }


def _sandbox_processes() -> list:
    out = subprocess.run(["ps", "-eo", "uid=,pid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines()
            if line.split() and UID_BASE <= int(line.split()[0]) < UID_BASE + UID_RANGE]


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.2)
    yield server
    server.close()


def verdict(program: str) -> tuple:
    result = score_program(program, DOUBLE[:1], timeout_s=2.0)
    return result.score, result.details.get("reason")


def test_hostile_programs_are_contained(listener, monkeypatch):
    monkeypatch.setenv("SANDBOX_SECRET", "leaked-value")
    port = listener.getsockname()[1]
    for name, program in hostile(port).items():
        score, reason = verdict(program)
        assert score == 0.0, name
        assert reason, name
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing reached the listener
    assert not os.path.exists("/tmp/sandbox_escape_probe")
    assert _sandbox_processes() == []
    assert verdict(CORRECT) == (1.0, None)  # and the parent is alive to say so


def test_result_fields():
    r = run("import sys\nprint(sys.stdin.read().upper(), end='')\nsys.exit(3)", "abc")
    assert (r.stdout, r.exit_code, r.timed_out) == ("ABC", 3, False)
    assert r.error.startswith("exit code 3")
    r = run("while True: pass", timeout_s=0.5)
    assert r.timed_out and r.exit_code is None and r.error == "timeout after 0.5 s"
    r = run(CORRECT, "4\n")
    assert (r.stdout, r.exit_code, r.error) == ("8\n", 0, None)


def test_concurrent_runs_give_the_same_verdicts(listener):
    port = listener.getsockname()[1]
    programs = list(hostile(port).values()) + [CORRECT] * 8
    programs = (programs * 2)[:32]
    sequential = [verdict(p)[0] for p in programs]
    with ThreadPoolExecutor(32) as pool:
        concurrent = list(pool.map(lambda p: verdict(p)[0], programs))
    assert concurrent == sequential
    assert _sandbox_processes() == []


def test_code_reward_fraction_and_all_or_nothing():
    half = "n = int(input())\nprint(42 if n == 21 else 0)"
    assert score_program(half, DOUBLE).score == 0.5
    assert score_program(half, DOUBLE, all_or_nothing=True).score == 0.0
    reward = get_reward("code")
    text = f"Here is my solution:\n```python\n{CORRECT}\n```"
    assert reward(RewardInput(text, tests=DOUBLE)).score == 1.0


@pytest.mark.parametrize("response", ["1/2", "0.5", "\\frac{1}{2}", "so \\boxed{\\frac12}",
                                      "The answer is \\boxed{0.50}."])
def test_math_accepts_equivalent_forms(response):
    assert get_reward("math")(RewardInput(response, answer="1/2")).score == 1.0


@pytest.mark.parametrize("response", ["0.25", "\\boxed{2}", "the answer is 3", "", "\\boxed{",
                                      "\\boxed{\\frac{1}{", "}}}{{{", None])
def test_math_rejects_wrong_and_malformed(response):
    result = get_reward("math")(RewardInput(response, answer="1/2"))
    assert result.score == 0.0 and result.details["reason"]


def test_math_helpers():
    assert extract_answer("first 3 then \\boxed{x^2} and 7") == "x^2"
    assert extract_answer("no boxes, numbers 1, 2.5 and 7/8") == "7/8"
    assert equivalent("2/4", "0.5") and not equivalent("nonsense(", "0.5")
    with pytest.raises(ValueError, match="unknown reward .nope.; valid: char_match, code, exact_match, math"):
        get_reward("nope")


def test_pool_turns_errors_and_timeouts_into_zero():
    pool = RewardPool(flaky_reward, workers=2, timeout_s=2.0)
    try:
        samples = [RewardInput("ok"), RewardInput("raise"), RewardInput("hang"), RewardInput("ok")]
        results, failures = pool.score(samples)
        assert [r.score for r in results[:2]] == [1.0, 0.0]
        assert "RuntimeError: bad input" in results[1].details["reason"]
        assert results[2].score == 0.0 and "timeout" in results[2].details["reason"]
        assert failures["raised"] == 1 and failures["timeout"] == 1
        again, failures = pool.score([RewardInput("ok")] * 3)  # a fresh pool after the kill
        assert [r.score for r in again] == [1.0] * 3 and not failures
    finally:
        pool.close()


def test_pool_keeps_order():
    pool = RewardPool(length_reward, workers=2, timeout_s=10.0)
    try:
        results, _ = pool.score([RewardInput("x" * n) for n in range(12)])
        assert [r.score for r in results] == [float(n) for n in range(12)]
    finally:
        pool.close()


@pytest.mark.parametrize("workers", [0, 1])
def test_a_reward_by_module_and_function_name_may_return_a_number(workers):
    from megatron_gspo.rewards.pool import make_scorer

    fn = get_reward("tests.reward_fixtures:number_reward")
    scorer = make_scorer(fn, workers=workers, timeout_s=60)
    try:
        results, failures = scorer.score([RewardInput("abc"), RewardInput("text"),
                                          RewardInput("nan"), RewardInput("")])
    finally:
        scorer.close()
    assert [r.score for r in results] == [0.3, 0.0, 0.0, 0.0]
    assert failures == {"raised": 2}
    assert "not a RewardResult or a finite number" in results[1].details["reason"]


@pytest.mark.parametrize("name, message", [
    ("bleu", "data.reward='bleu': is unknown; fix: use one of char_match, code, exact_match, "
             "math, ... or MODULE:FUNCTION for a reward of your own"),
    ("tests.reward_fixtures:nope", "data.reward='tests.reward_fixtures:nope': "
                                   "'tests.reward_fixtures' has no 'nope'; fix: name an "
                                   "importable module (on PYTHONPATH or in the working "
                                   "directory) and a function in it"),
    ("no_such_module:f", "data.reward='no_such_module:f': cannot import 'no_such_module' (No "
                         "module named 'no_such_module'); fix: name an importable module (on "
                         "PYTHONPATH or in the working directory) and a function in it"),
    ("tests.reward_fixtures:PROGRAMS", "data.reward='tests.reward_fixtures:PROGRAMS': 'PROGRAMS' "
                                       "is not callable; fix: name an importable module (on "
                                       "PYTHONPATH or in the working directory) and a function "
                                       "in it")])
def test_a_reward_that_does_not_resolve_is_one_config_error(name, message):
    from megatron_gspo.config import ConfigError
    from megatron_gspo.config.load import job_from_dict

    with pytest.raises(ConfigError) as info:
        job_from_dict({"data": {"reward": name}})
    head, _, tail = message.partition(" ... ")  # (other rewards the tests registered)
    assert str(info.value).startswith(head) and str(info.value).endswith(tail), str(info.value)
    job_from_dict({"data": {"reward": "tests.reward_fixtures:number_reward"}})  # resolves
