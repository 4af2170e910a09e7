"""From Hydra's composed config to a validated ``JobConfig``: the schema registered in Hydra's
ConfigStore, the config groups' directory, and the one function every entry point calls,
``job_from_dict`` (each section's checks, their combinations, then ``config.checks``)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from megatron_gspo.config import checks
from megatron_gspo.config.algo import AlgoConfig, ReplayConfig
from megatron_gspo.config.errors import ConfigError, invalid
from megatron_gspo.config.job import JobConfig
from megatron_gspo.config.model import ModelConfig, ParallelConfig
from megatron_gspo.config.rollout import RolloutConfig
from megatron_gspo.config.run import (BackendConfig, ClusterConfig, DataConfig, LoggingConfig,
                                      TrainerConfig)


SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "algo": AlgoConfig,
            "rollout": RolloutConfig, "replay": ReplayConfig, "data": DataConfig,
            "trainer": TrainerConfig, "logging": LoggingConfig, "cluster": ClusterConfig,
            "backend": BackendConfig}


def conf_dir() -> str:
    """The config groups: ``conf/`` shipped inside the installed package, else the checkout's."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shipped = os.path.join(package, "conf")
    return shipped if os.path.isdir(shipped) else os.path.join(os.path.dirname(package), "conf")


def register_configs() -> None:
    """Register the schema with Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="job_schema", node=JobConfig)
    for group, cls in SECTIONS.items():
        cs.store(group=group, name=f"{group}_schema", node=cls)


def to_dataclass(cls, node) -> Any:
    """Build the flat dataclass ``cls`` from an OmegaConf node or dict; unknown keys are errors."""
    data = (OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig)
            else dict(node))
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise invalid(unknown[0], data[unknown[0]], f"is not a field of {cls.__name__}",
                      f"use one of {', '.join(names)}")
    return cls(**data)


def job_from_dict(data: dict) -> JobConfig:
    """A validated JobConfig from plain data; unknown sections and keys are errors."""
    known = set(SECTIONS) | {"seed", "run_dir"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise invalid(unknown[0], data[unknown[0]], "is not a config section",
                      f"use one of {', '.join(sorted(known))}")
    parts = {}
    for name, cls in SECTIONS.items():
        try:
            parts[name] = to_dataclass(cls, data.get(name) or {})
        except ConfigError as e:
            raise ConfigError(f"{name}.{e}") from None
        except TypeError as e:
            raise ConfigError(f"{name}: {e}") from None
    job = JobConfig(**parts, seed=int(data.get("seed", 1234)),
                    run_dir=str(data.get("run_dir", ".")))
    if job.model.name == checks.FROM_CHECKPOINT:
        job.model = checks.model_from_checkpoint(job)
    job.validate()
    checks.check_job(job)
    return job


def compose_job(overrides: list) -> JobConfig:
    """The job ``python -m megatron_gspo OVERRIDES`` would run (without starting anything)."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, "run_dir=."])
    data = OmegaConf.to_container(cfg, resolve=False)
    data.pop("hydra", None)
    return job_from_dict(data)


def job_from_omegaconf(node) -> JobConfig:
    return job_from_dict(OmegaConf.to_container(node, resolve=True))


def job_to_dict(job: JobConfig) -> dict:
    return dataclasses.asdict(job)
