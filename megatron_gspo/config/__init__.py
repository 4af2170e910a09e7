"""The job's configuration: one dataclass per section, validated where defined (the schema
imports nothing of the project), the start-up checks that need other modules
(``config.checks``), and loading from Hydra (``config.load``)."""

from megatron_gspo.config.algo import ALGOS, AlgoConfig, ReplayConfig
from megatron_gspo.config.errors import ConfigError, invalid
from megatron_gspo.config.job import JobConfig
from megatron_gspo.config.model import ModelConfig, ParallelConfig
from megatron_gspo.config.rollout import RolloutConfig
from megatron_gspo.config.run import (BackendConfig, ClusterConfig, DataConfig, LoggingConfig,
                                      TrainerConfig)

__all__ = ["ALGOS", "AlgoConfig", "BackendConfig", "ClusterConfig", "ConfigError", "DataConfig",
           "JobConfig", "LoggingConfig", "ModelConfig", "ParallelConfig", "ReplayConfig",
           "RolloutConfig", "TrainerConfig", "invalid"]
