"""Checkpoints: training checkpoints written atomically and resumed exactly (``manager``), what a
path holds as a source of weights (``sources``), layout-free weights checkpoints (``weights``)
and Hugging Face exports (``export``)."""
