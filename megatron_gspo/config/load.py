"""From Hydra's composed config to a validated ``JobConfig``: the schema registered in Hydra's
ConfigStore, the config groups' directory, and the one function every entry point calls,
``job_from_dict`` (each section's checks, their combinations, then ``config.checks``)."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_gspo.config import checks
from megatron_gspo.config.algo import AlgoConfig, ReplayConfig
from megatron_gspo.config.errors import ConfigError, first_line, invalid
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
    data = OmegaConf.to_container(compose(overrides + ["run_dir=."]), resolve=False)
    data.pop("hydra", None)
    return job_from_dict(data)


def compose(overrides: list) -> DictConfig:
    """Hydra's composition of the config groups with ``overrides``; an override it refuses (a
    key the schema lacks, a value of the wrong type, bad syntax) is a one-line ``ConfigError``
    naming it, where Hydra writes several lines."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    register_configs()
    held = GlobalHydra.instance().hydra  # a Hydra already running (an app, a caller's compose)
    GlobalHydra.instance().clear()  # (Hydra composes under one global instance at a time)
    try:
        with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
            return hydra_compose("config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_override_error(e, overrides)) from None
    finally:
        if held is not None:
            GlobalHydra.instance().initialize(held)


def check_overrides(argv: list) -> None:
    """The command line's overrides composed once before Hydra runs, so that one it refuses is
    one line (``compose``). Each value of a sweep (``--multirun``) is checked: a config group's
    by a composition, a key's by setting it on the composed config as Hydra does. Hydra's own
    options (``hydra.*``, ``--config-name`` and the like) are left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException

    try:  # (Hydra's own reading of its command line; another Hydra: left to Hydra)
        from hydra._internal.utils import get_args_parser
    except ImportError:
        return
    args, _ = get_args_parser().parse_known_args(argv)
    multirun = args.multirun or any(a.replace(" ", "").lower() == "hydra.mode=multirun"
                                    for a in args.overrides)
    modes = [m for m, on in (("--run", args.run),
                             ("--multirun" if args.multirun else "hydra.mode=MULTIRUN", multirun),
                             ("--cfg", args.cfg), ("--info", args.info),
                             ("--shell-completion", args.shell_completion)) if on]
    if len(modes) > 1:
        raise ConfigError(f"{' and '.join(modes)}: Hydra takes one of these at a time; fix: "
                          "drop all but one")
    if any((args.help, args.hydra_help, args.info, args.shell_completion, args.config_path,
            args.config_name, args.config_dir, args.experimental_rerun)):
        return
    parsed = []
    for line in args.overrides:
        if line.lstrip("+~").startswith(("hydra.", "hydra/", "hydra=")):
            continue
        try:
            parsed.extend(OverridesParser.create().parse_overrides([line]))
        except HydraException as e:
            raise ConfigError(f"{line}: Hydra cannot parse this override ({first_line(e)}); "
                              "fix: see https://hydra.cc/docs/advanced/override_grammar/basic/"
                              ) from None
    base = [o.input_line for o in parsed if not o.is_sweep_override()]
    cfg = compose(base)
    for o in (o for o in parsed if o.is_sweep_override()):
        if not multirun:
            raise ConfigError(f"{o.input_line}: several values without --multirun; fix: add "
                              f"--multirun (-m) to sweep them, or quote one string "
                              f"({o.get_key_element()}='...') or write a list ([...])")
        if o.value_type not in (ValueType.SIMPLE_CHOICE_SWEEP, ValueType.CHOICE_SWEEP,
                                ValueType.RANGE_SWEEP):
            continue  # (glob and interval sweeps: Hydra expands them against what exists)
        try:
            values = list(zip(o.sweep_string_iterator(), o.sweep_iterator()))
        except Exception as e:  # (e.g. a range of step 0)
            raise ConfigError(f"{o.input_line}: this sweep has no values Hydra can list "
                              f"({first_line(e)}); fix: see "
                              "https://hydra.cc/docs/advanced/override_grammar/extended/"
                              ) from None
        group = os.path.isdir(os.path.join(conf_dir(), o.key_or_group.split("@")[0]))
        for text, value in values:
            line = f"{o.get_key_element()}={text}"
            if group or o.get_key_element() != o.key_or_group:  # (a group, +, ++ or ~)
                compose(base + [line])
                continue
            try:  # as Hydra applies a plain override to the composed config
                OmegaConf.update(cfg.copy(), o.key_or_group, value, merge=True)
            except OmegaConfBaseException as e:
                raise ConfigError(_override_error(e, [line])) from None


def _override_error(e: Exception, overrides: list) -> str:
    """One line for Hydra's refusal ``e`` of one of ``overrides``: the override, the reason
    (OmegaConf's, the exception's cause, or Hydra's own first line) and a fix (the nearest keys
    where a key is unknown; Hydra's advice where it gives some)."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause = e.__cause__ if e.__cause__ is not None else e
    key = getattr(cause, "full_key", None) or ""
    text = str(e)
    merging = re.search(r"Error merging override (\S+)", text)
    named = [o for o in overrides if key and o.lstrip("+~").partition("=")[0] == key] or [
        o for o in overrides if f"'{o.lstrip('+~').partition('=')[0]}'" in text]
    where = merging.group(1) if merging else (named[-1] if named else key or "an override")
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and key:
        parent, _, name = key.rpartition(".")
        known = _keys(parent)
        near = difflib.get_close_matches(name, known, n=3)
        fix = (f"did you mean {', '.join(f'{parent}.{k}' if parent else k for k in near)}?"
               if near else f"{parent or 'the config'} has {', '.join(sorted(known))}")
        return f"{where}: no such key; fix: {fix}"
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    if not isinstance(cause, OmegaConfBaseException) and len(lines) > 1:  # Hydra's, advised
        return f"{where}: {lines[0]}; fix: {' '.join(lines[1:])}"
    return (f"{where}: {first_line(cause)}; fix: python -m megatron_gspo --cfg job shows every "
            "key and its value")


def _keys(path: str) -> list:
    """The keys of the config node at ``path`` ("" for the top), from the schema's sections."""
    if not path:
        return sorted(SECTIONS) + ["seed", "run_dir"]
    cls = SECTIONS.get(path)
    return [f.name for f in dataclasses.fields(cls)] if cls else []


def job_from_omegaconf(node) -> JobConfig:
    return job_from_dict(OmegaConf.to_container(node, resolve=True))


def job_to_dict(job: JobConfig) -> dict:
    return dataclasses.asdict(job)
