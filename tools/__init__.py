"""Command-line tools, run from the repository root as ``python -m tools.<name>``."""
