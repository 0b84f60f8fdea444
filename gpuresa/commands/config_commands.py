"""`gpuresa config validate|example|show`."""

from __future__ import annotations

import argparse
import dataclasses
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

from gpuresa.config import example_text, load_config
from gpuresa.schema import PortRange, format_duration


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
    print(
        f"{config.source}: OK ({len(config.calendars)} calendar(s), "
        f"{len(config.hosts)} host(s), this daemon manages {config.daemon.host!r})"
    )
    # what is valid but will not work as meant on this machine (ports, the output disk)
    from gpuresa.outputs.disk import disk_warnings
    from gpuresa.runtime.port_safety import port_warnings

    for warning in [*port_warnings(config), *disk_warnings(config)]:
        print(f"warning: {warning}")
    return 0


def example_command(arguments: argparse.Namespace) -> int:
    print(example_text(), end="")
    return 0


def show_command(arguments: argparse.Namespace) -> int:
    config = load_config(arguments.config)
    print(json.dumps(_plain(config), indent=2))
    return 0


def _plain(value: Any) -> Any:
    """A JSON-ready copy of a config value, durations and paths as the config spells them."""
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
