"""Tokenizers: Hugging Face tokenizers from a local path, and a small built-in character tokenizer
for the synthetic tasks (no download, fits the tiny model's vocabulary)."""

from __future__ import annotations

import os
import string
from typing import Optional, Protocol, Sequence

from megatron_gspo.config.errors import first_line


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def render_prompt(self, prompt: Optional[str], messages: Optional[list]) -> list[int]: ...


class CharTokenizer:
    """One id per printable ASCII character and newline, after <pad>, <bos>, <eos>."""

    SPECIALS = ("<pad>", "<bos>", "<eos>")

    def __init__(self):
        self.chars = string.printable[:95] + "\n"  # digits, letters, punctuation, space, newline
        self._ids = {c: i + len(self.SPECIALS) for i, c in enumerate(self.chars)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.vocab_size = len(self.SPECIALS) + len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the built-in tokenizer") from None

    def decode(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            if i == self.eos_id:
                break
            if i >= len(self.SPECIALS):
                # ids past the tokenizer (a model vocabulary padded beyond it) decode to U+FFFD
                out.append(self.chars[i - len(self.SPECIALS)] if i < self.vocab_size else "\ufffd")
        return "".join(out)

    def render_prompt(self, prompt: Optional[str], messages: Optional[list]) -> list[int]:
        if messages is not None:  # no chat template: the turns' contents, one per line
            prompt = "\n".join(m["content"] for m in messages)
        return [self.bos_id] + self.encode(prompt)


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded; one line naming the directory."""


class HFTokenizer:
    """A Hugging Face tokenizer from a local directory; applies its chat template to messages
    (and to plain prompts as one user turn) when it has one."""

    def __init__(self, path: str):
        try:
            from transformers import AutoTokenizer
        except ImportError as e:  # an install without dependencies, an image that lacks it
            raise TokenizerError(f"cannot load a tokenizer from {path!r}: transformers does not "
                                 f"import ({e}); fix: pip install 'transformers>=4.51'") from None
        if not os.path.isdir(path):
            raise TokenizerError(f"cannot load a tokenizer from {path!r}: no such directory "
                                 "(use builtin or a local Hugging Face tokenizer directory)")
        try:
            self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            raise TokenizerError(f"cannot load a tokenizer from {path!r}: {first_line(e)}"
                                 ) from None
        self.vocab_size = len(self.tok)
        self.eos_id = self.tok.eos_token_id
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def render_prompt(self, prompt: Optional[str], messages: Optional[list]) -> list[int]:
        if getattr(self.tok, "chat_template", None):
            turns = messages if messages is not None else [{"role": "user", "content": prompt}]
            return list(self.tok.apply_chat_template(turns, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False))
        if messages is not None:
            prompt = "\n".join(m["content"] for m in messages)
        return self.tok.encode(prompt)


def load_tokenizer(spec: str) -> Tokenizer:
    """``builtin`` for the character tokenizer, otherwise a local HF tokenizer directory."""
    return CharTokenizer() if spec == "builtin" else HFTokenizer(spec)
