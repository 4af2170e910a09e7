"""Prompt files (jsonl, parquet), schema errors naming file/row/field, resumable shuffling,
tokenizers, synthetic tasks."""

import json
import random
import sys

import pytest

from megatron_gspo.data.prompts import PromptDataError, PromptDataset, read_prompt_file
from megatron_gspo.data.synthetic import make_task
from megatron_gspo.data.tokenizer import CharTokenizer, TokenizerError, load_tokenizer
from megatron_gspo.rewards import RewardInput, get_reward

GOOD = [
    {"prompt": "1+1=", "answer": "2"},
    {"messages": [{"role": "user", "content": "hi"}], "answer": 3, "metadata": {"k": 1}},
    {"prompt": "double it", "tests": [["2\n", "4"], ["3\n", "6"]]},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_and_parquet_read_the_same(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    a = read_prompt_file(write_jsonl(tmp_path / "p.jsonl", GOOD))
    rows = [{"prompt": r.get("prompt"), "messages": r.get("messages"),
             "answer": None if "answer" not in r else str(r["answer"]), "tests": r.get("tests")}
            for r in GOOD]
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "p.parquet"))
    b = read_prompt_file(str(tmp_path / "p.parquet"))
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert [r.messages for r in a] == [r.messages for r in b]
    assert a[2].tests == b[2].tests == [("2\n", "4"), ("3\n", "6")]
    assert a[0].source.endswith("p.jsonl:1")


@pytest.mark.parametrize("row,field", [
    ({"answer": "2"}, "prompt"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"prompt": "x", "tests": [["1"]]}, "tests"),
    ({"prompt": "x", "metadata": [1]}, "metadata"),
    ({"prompt": "x", "anwser": 1}, "anwser"),
])
def test_bad_rows_name_file_row_and_field(tmp_path, row, field):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD[0], row])
    with pytest.raises(PromptDataError) as info:
        read_prompt_file(path)
    assert str(info.value).startswith(f"{path}:2: field {field!r}")


def test_bad_files(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(PromptDataError, match=r"x.jsonl:2: not valid JSON"):
        read_prompt_file(str(tmp_path / "x.jsonl"))
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(PromptDataError, match="unknown format"):
        read_prompt_file(str(tmp_path / "x.csv"))
    with pytest.raises(PromptDataError, match="no such file"):
        read_prompt_file(str(tmp_path / "missing.jsonl"))


def test_shuffling_is_deterministic_per_epoch_and_resumable(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": str(i)} for i in range(10)])
    a = PromptDataset([path], seed=3)
    first = [r.prompt for r in a.next_batch(4) + a.next_batch(4)]
    state = a.state_dict()
    rest = [r.prompt for r in a.next_batch(4) + a.next_batch(6)]  # crosses into epoch 1
    b = PromptDataset([path], seed=3)
    b.load_state_dict(state)
    assert [r.prompt for r in b.next_batch(4) + b.next_batch(6)] == rest
    epoch0 = first + rest[:2]
    assert sorted(epoch0, key=int) == [str(i) for i in range(10)]  # each record once per epoch
    assert rest[2:] != [r.prompt for r in PromptDataset([path], seed=3).next_batch(8)]
    with pytest.raises(PromptDataError, match="saved for 10 records with seed 3"):
        PromptDataset([path], seed=4).load_state_dict(state)


def test_epoch_order_is_the_seeded_shuffle(tmp_path):
    """Each epoch's order is random.Random(seed * 1_000_003 + epoch).shuffle of the record
    indices (what a saved data position refers to), however the epoch's batches are cut."""
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": str(i)} for i in range(10)])
    expected = []
    for epoch in range(3):
        order = list(range(10))
        random.Random(3 * 1_000_003 + epoch).shuffle(order)
        expected += [str(i) for i in order]
    data = PromptDataset([path], seed=3)
    got = [r.prompt for size in (3, 1, 7, 10, 5, 4) for r in data.next_batch(size)]
    assert got == expected
    assert (data.epoch, data.position) == (3, 0)


def test_char_tokenizer_round_trip_and_prompt_rendering():
    tok = load_tokenizer("builtin")
    assert isinstance(tok, CharTokenizer) and tok.vocab_size <= 128
    text = "rev:abc=cba 12+7=19"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode("ab") + [tok.eos_id] + tok.encode("cd")) == "ab"
    assert tok.render_prompt("1+1=", None)[0] == tok.bos_id
    assert tok.render_prompt(None, [{"role": "user", "content": "a"},
                                    {"role": "user", "content": "b"}])[1:] == tok.encode("a\nb")
    with pytest.raises(ValueError, match="not in the built-in tokenizer"):
        tok.encode("é")


def test_hf_tokenizer_applies_its_chat_template(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<eos>", "user", "assistant", "hi", "there"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>")
    fast.chat_template = ("{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}"
                          "{% if add_generation_prompt %}assistant{% endif %}")
    fast.save_pretrained(str(tmp_path))
    tok = load_tokenizer(str(tmp_path))
    assert tok.render_prompt("hi there", None) == [1, 3, 4, 2]
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_tokenizer(str(tmp_path / "nothing"))


def test_a_tokenizer_without_transformers_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # what an import finds missing
    with pytest.raises(TokenizerError) as e:
        load_tokenizer(str(tmp_path))
    message = str(e.value)
    assert message.startswith(f"cannot load a tokenizer from '{tmp_path}': transformers does not "
                              "import (") and "\n" not in message
    assert message.endswith("fix: pip install 'transformers>=4.51'")


def test_synthetic_tasks_are_seeded_and_scored():
    a = make_task("add", 5, seed=1)
    assert [r.prompt for r in a] == [r.prompt for r in make_task("add", 5, seed=1)]
    assert [r.prompt for r in a] != [r.prompt for r in make_task("add", 5, seed=2)]
    for r in a:
        x, y = r.prompt[:-1].split("+")
        assert r.answer == str(int(x) + int(y))
    rev = make_task("reverse", 3, seed=0)
    assert all(r.answer == r.prompt[4:-1][::-1] for r in rev)
    reward = get_reward("exact_match")
    assert reward(RewardInput(" " + a[0].answer + " ", answer=a[0].answer)).score == 1.0
    assert reward(RewardInput("nope", answer=a[0].answer)).details["reason"] == "wrong answer"
    digits = make_task("sort", 4, seed=0, min_len=24, max_len=28)
    assert all(24 <= len(r.answer) <= 28 and r.answer == "".join(sorted(r.prompt[5:-1]))
               for r in digits)
    partial = get_reward("char_match")
    assert partial(RewardInput(digits[0].answer, answer=digits[0].answer)).score == 1.0
    assert partial(RewardInput("0123", answer="0124")).score == 0.75  # 3 of 4 positions
    assert partial(RewardInput("012", answer="0124")).score == 0.75  # a missing position
    assert partial(RewardInput("01245", answer="0124")).score == 0.8  # an extra position
    assert partial(RewardInput("", answer="0124")).score == 0.0
    with pytest.raises(ValueError, match="valid: add, reverse, sort"):
        make_task("multiply", 1, seed=0)
