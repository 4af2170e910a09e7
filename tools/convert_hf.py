"""Convert Hugging Face Qwen3-MoE checkpoints to and from layout-independent Megatron weights.

    python -m tools.convert_hf import HF_DIR OUT_DIR          # HF -> Megatron dist checkpoint
    python -m tools.convert_hf export CKPT_DIR OUT_HF_DIR     # Megatron dist checkpoint -> HF

Runs as one process, or under torchrun with a layout (``--tp 2 --ep 2 --sequence-parallel``) to
convert without holding the whole model in one process. The Megatron checkpoint loads into any
layout; the HF config is kept beside it so that export writes the original config.json back.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

HF_CONFIG_FILE = "hf_config.json"


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
    from megatron_gspo.config import ConfigError, ParallelConfig
    from megatron_gspo.hf_qwen3moe import (HFCheckpoint, HFCheckpointError, export_hf,
                                           load_hf_weights, model_config_from_hf)
    from megatron_gspo.model import build_model
    from megatron_gspo.parallel import destroy_parallel, init_parallel
    from megatron_gspo.weights import load_weights, read_model_config, save_weights

    layout = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp,
                            sequence_parallel=args.sequence_parallel)
    try:
        if args.command == "import":
            hf_config = HFCheckpoint(args.hf_dir).config
            model = model_config_from_hf(hf_config, name=os.path.basename(args.hf_dir.rstrip("/")))
        else:
            model = read_model_config(args.ckpt_dir)
            cfg_path = os.path.join(args.ckpt_dir, HF_CONFIG_FILE)
            hf_config = json.load(open(cfg_path)) if os.path.isfile(cfg_path) else None
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
            load_weights(gpt, args.ckpt_dir)
            export_hf(gpt, model, ctx, args.out_dir, hf_config=hf_config)
            if ctx.rank == 0:
                print(f"exported {args.ckpt_dir} -> {args.out_dir}")
    except (ConfigError, HFCheckpointError, FileNotFoundError, KeyError) as e:
        print(f"convert_hf: {e}", file=sys.stderr)
        return 2
    finally:
        try:
            destroy_parallel()
        except Exception:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
