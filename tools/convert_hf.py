"""Convert Hugging Face Qwen3-MoE checkpoints to and from layout-independent Megatron weights.

    python -m tools.convert_hf import HF_DIR OUT_DIR          # HF -> Megatron dist checkpoint
    python -m tools.convert_hf export CKPT OUT_HF_DIR         # a checkpoint -> HF

``CKPT`` is a training checkpoint (``RUN_DIR/checkpoints/step_N``, or ``RUN_DIR`` for its newest
complete one) or a weights checkpoint, saved from any layout. Runs as one process, or under
torchrun with a layout (``--tp 2 --ep 2 --sequence-parallel``) to convert without holding the
whole model in one process. Export writes sharded safetensors with an index, config.json (the HF
config the weights came from when known, else one made from the model) and, when the run used a
HF tokenizer directory, its tokenizer files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from tools import run_guarded

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.convert_hf", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, src, dst in (("import", "hf_dir", "out_dir"), ("export", "ckpt_dir", "out_dir")):
        s = sub.add_parser(name)
        s.add_argument(src)
        s.add_argument(dst)
        s.add_argument("--tp", type=int, default=1)
        s.add_argument("--pp", type=int, default=1)
        s.add_argument("--ep", type=int, default=1)
        s.add_argument("--etp", type=int, default=None)
        s.add_argument("--sequence-parallel", action="store_true")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    from megatron_gspo.checkpoint.manager import CheckpointError
    from megatron_gspo.config import ConfigError, ParallelConfig
    from megatron_gspo.models.hf_io import HFCheckpoint
    from megatron_gspo.models.hf_config import HFCheckpointError, model_config_from_hf
    from megatron_gspo.models.hf_mapping import load_hf_weights
    from megatron_gspo.models.model import build_model
    from megatron_gspo.distributed.parallel import init_parallel
    from megatron_gspo.checkpoint.export import (HF_CONFIG_FILE, export_hf_dir, load_source,
                                                 open_source)
    from megatron_gspo.checkpoint.weights import save_weights

    layout = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp,
                            sequence_parallel=args.sequence_parallel)
    def body() -> None:
        if args.command == "import":
            hf_config = HFCheckpoint(args.hf_dir).config
            model = model_config_from_hf(hf_config, name=os.path.basename(args.hf_dir.rstrip("/")))
        else:
            src = open_source(args.ckpt_dir)
            if src.kind == "hf":
                raise CheckpointError(f"{args.ckpt_dir}: already a Hugging Face directory")
            model = src.model
        ctx = init_parallel(layout, model, seed=0)
        gpt = build_model(model, ctx)
        if args.command == "import":
            count = load_hf_weights(gpt, args.hf_dir, model, ctx)
            save_weights(gpt, args.out_dir, model)
            if ctx.rank == 0:
                with open(os.path.join(args.out_dir, HF_CONFIG_FILE), "w") as f:
                    json.dump(hf_config, f, indent=2)
                print(f"imported {args.hf_dir} ({count} tensors on rank 0) -> {args.out_dir}")
        else:
            load_source(gpt, src, ctx)
            export_hf_dir(gpt, model, ctx, args.out_dir, hf_config=src.hf_config,
                          tokenizer=src.tokenizer)
            if ctx.rank == 0:
                print(f"exported {src.describe()} -> {args.out_dir}")

    return run_guarded("convert_hf", body, (ConfigError, HFCheckpointError, CheckpointError,
                                            FileNotFoundError, KeyError))


if __name__ == "__main__":
    sys.exit(main())
