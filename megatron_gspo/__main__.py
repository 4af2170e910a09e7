"""``python -m megatron_gspo``: the Hydra application (config in conf/); exit codes in
``megatron_gspo.faults``."""

import logging
import os
import sys
import warnings

import hydra
from omegaconf import DictConfig

from megatron_gspo.config import ConfigError, job_from_omegaconf, register_configs

register_configs()
CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def check_group_choices(argv: list[str], conf_dir: str = CONF_DIR) -> None:
    """One line naming an unknown group option and the valid ones (before Hydra's longer error).
    Sweeps (``algo=gspo,grpo``) check every choice."""
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        group_dir = os.path.join(conf_dir, key)
        if not sep or "." in key or "/" in key or not os.path.isdir(group_dir):
            continue
        valid = sorted(f[:-5] for f in os.listdir(group_dir) if f.endswith(".yaml"))
        for choice in value.split(","):
            if choice and choice not in valid:
                raise ConfigError(f"{key}={choice!r}: no such option in conf/{key}/; fix: use one "
                                  f"of {', '.join(valid)}")


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from megatron_gspo import faults, trainer
    from megatron_gspo.data.prompts import PromptDataError
    from megatron_gspo.data.tokenizer import TokenizerError
    from megatron_gspo.parallel import destroy_parallel

    # Megatron logs every parameter group at INFO and warns about each missing optional kernel.
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    try:
        job = job_from_omegaconf(cfg)
        trainer.train(job)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(faults.CONFIG_EXIT_CODE)
    except (PromptDataError, TokenizerError) as e:  # before any work: data and tokenizer first
        print(f"data error: {e}", file=sys.stderr)
        sys.exit(faults.CONFIG_EXIT_CODE)
    except faults.StopRequested as e:
        print(f"stopped by {e.signame}: checkpoint {e.checkpoint}; exit {faults.REQUEUE_EXIT_CODE} "
              "(requeue to resume)", file=sys.stderr, flush=True)
        sys.exit(faults.REQUEUE_EXIT_CODE)
    except faults.NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(faults.NONFINITE_EXIT_CODE)
    finally:
        try:
            destroy_parallel()
        except Exception:
            pass


def entry() -> None:
    try:
        check_group_choices(sys.argv[1:])
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    main()


if __name__ == "__main__":
    entry()
