"""The run's progress line: redrawn in place on a terminal, every twentieth of the run in a log."""

import re

from megatron_gspo.trainer.logger import RunLogger


LONG = "  reward 0.250  loss +0.0002  clip 0.094"


def _logger(tmp_path, tty, total=40):
    lg = RunLogger(str(tmp_path), enabled=True, tensorboard=False, total_steps=total)
    lg.tty = tty
    return lg


def test_a_log_gets_the_first_and_last_steps_and_every_twentieth(tmp_path, capsys):
    lg = _logger(tmp_path, tty=False, total=40)
    for step in range(1, 41):
        lg.bar(step, f"reward {step / 40:.3f}", keep=step in (7, 30))  # (an evaluation at 7)
    lines = capsys.readouterr().out.splitlines()
    assert [int(re.search(r"\] (\d+)/40 ", x).group(1)) for x in lines] == [
        1, 2, 4, 6, 7, *range(8, 41, 2)]
    assert lines[0].endswith("ETA --:--")  # (one step: no rate yet)
    assert re.search(r"ETA \d\d:\d\d$", lines[1]) and lines[-1].startswith("[" + "#" * 20 + "]")


def test_a_terminal_redraws_one_line_and_keeps_what_is_said_below_it(tmp_path, capsys,
                                                                     monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")  # a line redrawn in place fits the terminal's width
    lg = _logger(tmp_path, tty=True, total=5)
    lg.bar(1, "a" + LONG)
    lg.bar(2, "b" + LONG)
    lg.say("checkpoint saved")
    lg.bar(3, "c" + LONG, keep=True)  # an evaluation's line stays
    lg.bar(4, "d" + LONG)
    lg.close()  # a run that stops at step 4 of 5
    out = capsys.readouterr().out
    assert out.count("\r") == 4 and out.count("\x1b[K") == 4
    shown = [x.split("\r")[-1].replace("\x1b[K", "") for x in out.split("\n")]  # per row
    assert " 2/5 b " in shown[0] and shown[1] == "checkpoint saved" and " 3/5 c " in shown[2]
    assert " 4/5 d " in shown[3] and shown[4:] == [""]  # (close ended the open line)
    assert len(shown[0]) == len(shown[3]) == 59 and shown[2].endswith("ETA 00:00")  # (kept whole)
    assert len(shown[2]) > 59
    lg2 = _logger(tmp_path, tty=True, total=2)
    lg2.bar(1, "a")
    lg2.bar(2, "b")  # the last step ends its line
    out = capsys.readouterr().out
    assert out.endswith("\n") and out.count("\n") == 1
