"""The one error type of a bad configuration, its one-line form, and an exception's first line."""

from __future__ import annotations

from typing import Any, Optional


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the key and the fix."""


def first_line(e: BaseException, default: Optional[str] = None) -> str:
    """An exception's message cut to its first line, for a one-line error (``default``, or the
    exception's type, where the message is empty)."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else (type(e).__name__ if default is None else default)


def invalid(key: str, value: Any, problem: str, fix: str) -> ConfigError:
    """``key=value: problem; fix: fix``, one line."""
    return ConfigError(f"{key}={value!r}: {problem}; fix: {fix}")
