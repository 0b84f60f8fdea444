"""`gpuresa config validate|example|show`."""

from __future__ import annotations

import argparse
import dataclasses
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

from gpuresa.config.capabilities import host_capabilities
from gpuresa.config.loading import example_text
from gpuresa.config.machine import machine_problems
from gpuresa.config.reading import load_config
from gpuresa.config.schema import PortRange, Share, Size, format_duration
from gpuresa.config.sections import Config
from gpuresa.errors import ConfigError


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("config", help="check or print the configuration")
    actions = parser.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    validate = actions.add_parser("validate", help="check the config file; exit 1 on problems")
    validate.set_defaults(handler=validate_command)
    example = actions.add_parser("example", help="print the documented example config")
    example.set_defaults(handler=example_command)
    show = actions.add_parser("show", help="print the effective config, defaults filled in")
    show.set_defaults(handler=show_command)


def validate_command(arguments: argparse.Namespace) -> int:
    config = load_config(arguments.config)
    # what the file names on this machine: secrets, folders, certificates (after the schema,
    # which needs no machine)
    problems = machine_problems(config)
    if problems:
        raise ConfigError(config.source, problems)
    print(
        f"{config.source}: OK ({len(config.calendars)} calendar(s), "
        f"{len(config.hosts)} host(s), this daemon manages {config.daemon.host!r})"
    )
    for host in config.hosts:
        # what separates two sessions (docs/outputs.md, "Isolation of outputs")
        print(f"host {host.name}: isolation: {host_capabilities(host).isolation}")
    # what is valid but will not work as meant on this machine (ports, the output disk)
    from gpuresa.backends.port_safety import port_warnings
    from gpuresa.config.pid_budget import pids_warnings
    from gpuresa.outputs.disk import disk_warnings

    for warning in [*port_warnings(config), *disk_warnings(config), *pids_warnings(config)]:
        print(f"warning: {warning}")
    for name, lines in _effective_limits(config).items():
        print(f"limits per session on {name}: " + "; ".join(f"{k}: {v}" for k, v in lines.items()))
    return 0


def _effective_limits(config: Config) -> dict[str, dict[str, str]]:
    """Per host, the limits of a session of 1 GPU and of all GPUs.

    Computed with this machine's CPUs and memory (each host's daemon computes
    its own from its engine), and the host's GPU list ("auto": nvidia-smi here).
    """
    from gpuresa.gpus.devices import HostGpus
    from gpuresa.sessions.limits import local_totals, session_limits

    effective = {}
    for host in config.hosts:
        gpus = len(HostGpus().indices(host))
        totals = local_totals(gpus)
        lines = {
            "host": f"{totals.cpus:g} CPUs, {totals.memory / (1 << 30):.1f} GiB, {gpus} GPUs",
            "1 GPU": session_limits(config.limits, totals, 1).describe(),
            f"all {gpus} GPUs": session_limits(config.limits, totals, gpus).describe(),
            "writable layer": str(config.limits.layer_size),
        }
        effective[host.name] = lines
    return effective


def example_command(arguments: argparse.Namespace) -> int:
    print(example_text(), end="")
    return 0


def show_command(arguments: argparse.Namespace) -> int:
    config = load_config(arguments.config)
    shown = _plain(config)
    shown["effective_limits"] = _effective_limits(config)
    print(json.dumps(shown, indent=2))
    return 0


def _plain(value: Any) -> Any:
    """A JSON-ready copy of a config value, durations and paths as the config spells them."""
    if isinstance(value, (Size, Share)):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)
        }
    if isinstance(value, timedelta):
        return format_duration(value)
    if isinstance(value, (Path, PortRange)):
        return str(value)
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    if hasattr(value, "items"):
        return {key: _plain(item) for key, item in value.items()}
    return value
