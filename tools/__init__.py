"""Command-line tools, run from the repository root as ``python -m tools.<name>``."""

from __future__ import annotations

import sys
from typing import Callable


def run_guarded(name: str, body: Callable[[], None], errors: tuple) -> int:
    """Run a tool's ``body``: an expected error (one of ``errors``) ends it with one line
    ``NAME: message`` and exit code 2; Megatron's groups are torn down either way."""
    from megatron_gspo.distributed.parallel import destroy_parallel

    try:
        body()
    except errors as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    finally:
        try:
            destroy_parallel()
        except Exception:
            pass
    return 0
