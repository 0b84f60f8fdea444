"""Reading the configuration: TOML into `Config`, every problem reported with its key.

`parse_config` builds the sections (`sections`), then runs the checks that
involve more than one key (`checks`); `load_config` finds and reads the file.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from typing import Any

from gpuresa.config.checks import cross_checks
from gpuresa.config.key_paths import name_calendars, raw_calendar_names
from gpuresa.config.loading import CONFIG_ENVIRONMENT_VARIABLE, config_path
from gpuresa.config.schema import Loader
from gpuresa.config.sections import Config
from gpuresa.errors import ConfigError, UserError


def parse_config(data: Mapping[str, Any], source: str = "<config>") -> Config:
    """Build a `Config` from parsed TOML; raises `ConfigError` listing every problem."""
    loader = Loader()
    if "source" in data:
        loader.problem("source", "unknown key")
    document = dict(data)
    document["source"] = source
    config = loader.load(Config, document)
    if config is not None:
        loader.problems.extend(cross_checks(config))
    if loader.problems or config is None:
        raise ConfigError(source, name_calendars(loader.problems, raw_calendar_names(data)))
    return config


def load_config(path: str | os.PathLike[str] | None = None) -> Config:
    """Read and check the config file; raises `UserError`/`ConfigError` with advice."""
    file = config_path(path)
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        raise UserError(
            f"{file}: no such config file; copy one from `gpuresa config example` "
            f"or pass --config PATH (or set {CONFIG_ENVIRONMENT_VARIABLE})"
        ) from None
    except OSError as error:
        raise UserError(f"{file}: cannot read the config file: {error.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ConfigError(str(file), [f"not UTF-8 text ({error.reason})"]) from None
    except tomllib.TOMLDecodeError as error:
        # tomllib's message already names the line and column
        raise ConfigError(str(file), [f"TOML syntax error: {error}"]) from None
    return parse_config(data, str(file))
