"""``python -m megatron_gspo``: the Hydra application (config in conf/); exit codes in
``megatron_gspo.faults``."""

import logging
import os
import sys
import warnings

import hydra
import torch
from omegaconf import DictConfig
from packaging.version import Version

from megatron_gspo import TORCH_MIN
from megatron_gspo.config import ConfigError
from megatron_gspo.config.load import (check_overrides, conf_dir, job_from_omegaconf,
                                       register_configs)


register_configs()
CONF_DIR = conf_dir()  # shipped in the package when installed, the checkout's conf/ otherwise


def check_torch(version: str) -> None:
    """One line where the installed torch is older than ``TORCH_MIN`` (an install that skipped
    dependencies, a container's own torch), before a run fails halfway for want of an op."""
    if Version(version).release[:2] < Version(TORCH_MIN).release[:2]:
        raise ConfigError(f"torch {version} is older than the {TORCH_MIN} megatron-gspo needs "
                          f"(torch.nn.functional.grouped_mm); fix: pip install 'torch>={TORCH_MIN}'")


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


def _report(line: str) -> None:
    """One line on stderr in a single write: every rank of a multi-rank job reports the same
    error, and two ranks' lines must not interleave."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    # Megatron logs at INFO as its modules load (Hydra's logging shows INFO) and for every
    # parameter group: before the imports below.
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    # (torch's deprecation of the checkpoint API megatron-core calls on resume, attributed to
    # megatron-core's module: not the user's to act on)
    warnings.filterwarnings("ignore", category=FutureWarning,
                            module=r"megatron\.core\.dist_checkpointing")
    from megatron_gspo.trainer import faults, loop as trainer
    from megatron_gspo.data.prompts import PromptDataError
    from megatron_gspo.data.tokenizer import TokenizerError
    from megatron_gspo.distributed.parallel import destroy_parallel
    from megatron_gspo.rollout.types import RolloutError

    try:
        job = job_from_omegaconf(cfg)
        trainer.train(job)
    except ConfigError as e:
        _report(f"config error: {e}")
        sys.exit(faults.CONFIG_EXIT_CODE)
    except (PromptDataError, TokenizerError) as e:  # before any work: data and tokenizer first
        _report(f"data error: {e}")
        sys.exit(faults.CONFIG_EXIT_CODE)
    except faults.StopRequested as e:
        _report(f"stopped by {e.signame}: checkpoint {e.checkpoint}; exit "
                f"{faults.REQUEUE_EXIT_CODE} (requeue to resume)")
        sys.exit(faults.REQUEUE_EXIT_CODE)
    except faults.NonFiniteError as e:
        _report(f"error: {e}")
        sys.exit(faults.NONFINITE_EXIT_CODE)
    except RolloutError as e:
        _report(f"rollout error: {e}")
        sys.exit(faults.ROLLOUT_EXIT_CODE)
    finally:
        try:
            destroy_parallel()
        except Exception:
            pass


def entry() -> None:
    try:
        check_torch(torch.__version__)
        check_group_choices(sys.argv[1:])
        check_overrides(sys.argv[1:])
    except ConfigError as e:
        _report(f"config error: {e}")
        sys.exit(2)
    main()


if __name__ == "__main__":
    entry()
