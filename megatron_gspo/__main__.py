"""``python -m megatron_gspo``: the Hydra application (config in conf/)."""

import logging
import sys
import warnings

import hydra
from omegaconf import DictConfig

from megatron_gspo.config import ConfigError, job_from_omegaconf, register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from megatron_gspo import demo
    from megatron_gspo.parallel import destroy_parallel

    # Megatron logs every parameter group at INFO and warns about each missing optional kernel.
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    try:
        job = job_from_omegaconf(cfg)
        demo.run(job)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        try:
            destroy_parallel()
        except Exception:
            pass


if __name__ == "__main__":
    main()
