"""The one error type of a bad configuration, and its one-line form."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the key and the fix."""


def invalid(key: str, value: Any, problem: str, fix: str) -> ConfigError:
    """``key=value: problem; fix: fix``, one line."""
    return ConfigError(f"{key}={value!r}: {problem}; fix: {fix}")
