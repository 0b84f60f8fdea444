"""The session templates a booking may choose, and their CUDA variants.

Each template is a folder `<directory>/<name>/` with a `template.toml`:

    description = "PyTorch with Jupyter and the usual scientific Python"
    command = ["python3", "-m", "jupyter", "lab"]      # optional

    [variants."12.4"]                                   # one table per CUDA variant,
    base_image = "pytorch/pytorch:2.4.0-cuda12.4-cudnn9-runtime"   # first = default

    [variants."11.8"]
    base_image = "pytorch/pytorch:2.1.2-cuda11.8-cudnn8-runtime"

    [[tools]]                                           # optional: browser tools reached
    name = "jupyter"                                    # through SSH, see
    ...                                                 # `gpuresa.reservations.template_tools`

Keys this module does not know are left for others (the image builder adds
its own); the ones it knows are checked, with the same rules as
`gpuresa.sessions.templates` (which builds the images, and needs a Dockerfile
next to the file). Only templates named in `[templates] allowed` exist for
bookings (fail closed). This module does not import the runtime, so reading
reservations never loads the Docker SDK.
"""

from __future__ import annotations

import logging
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuresa.config.sections import Config
from gpuresa.errors import UserError
from gpuresa.reservations.template_tools import Tool, read_tools

log = logging.getLogger(__name__)

TEMPLATE_FILE = "template.toml"
# the same spellings as gpuresa.sessions.templates, which builds the images
TEMPLATE_NAME = r"[a-z0-9][a-z0-9_.-]{0,62}"
VARIANT_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,30}"


class TemplateError(UserError):
    """A template folder or its template.toml cannot be used; the message says why."""


@dataclass(frozen=True)
class Variant:
    """One CUDA variant of a template: its name (such as "12.4") and upstream image."""

    name: str
    base_image: str


@dataclass(frozen=True)
class Template:
    """A session template as its template.toml describes it."""

    name: str
    directory: Path
    description: str
    command: tuple[str, ...] | None
    variants: tuple[Variant, ...]
    # browser tools reached through SSH (`gpuresa.reservations.template_tools`)
    tools: tuple[Tool, ...] = ()

    @property
    def default_variant(self) -> Variant:
        """The preferred variant: the first in the file."""
        return self.variants[0]

    def variant(self, name: str | None) -> Variant:
        """The variant called `name`, or the default for None; raises `TemplateError`."""
        if name is None:
            return self.default_variant
        for variant in self.variants:
            if variant.name == name:
                return variant
        known = ", ".join(variant.name for variant in self.variants)
        raise TemplateError(f"template {self.name!r} has no CUDA variant {name!r} (has: {known})")


# The templates shipped with gpuresa: in a checkout, a link to the top-level
# templates/ folder; in an installed package, a copy of it.
SHIPPED_TEMPLATES = Path(__file__).parents[1] / "templates"


def templates_directory(config: Config) -> Path:
    """Where templates live: `[templates] directory`, else the ones shipped with gpuresa."""
    if config.templates.directory is not None:
        return config.templates.directory
    return SHIPPED_TEMPLATES


def read_template(directory: Path) -> Template:
    """Read `<directory>/template.toml`; raises `TemplateError` naming what is wrong."""
    file = directory / TEMPLATE_FILE
    try:
        data = tomllib.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TemplateError(f"{file}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise TemplateError(f"{file}: cannot be read ({error})") from None
    except tomllib.TOMLDecodeError as error:
        raise TemplateError(f"{file}: TOML syntax error: {error}") from None
    if not (directory / "Dockerfile").is_file():
        # the runtime cannot build it, so no booking may choose it
        raise TemplateError(f"{directory / 'Dockerfile'}: no such file")
    return _template_from(directory.name, directory, data, file)


def _template_from(name: str, directory: Path, data: Mapping[str, Any], file: Path) -> Template:
    problems: list[str] = []
    description = data.get("description", "")
    if not isinstance(description, str):
        problems.append("description: expected a string")
        description = ""
    command = data.get("command")
    if command is not None and not (
        isinstance(command, list) and command and all(isinstance(part, str) for part in command)
    ):
        problems.append("command: expected a non-empty list of strings")
        command = None
    variants: list[Variant] = []
    table = data.get("variants")
    if not isinstance(table, dict) or not table:
        problems.append('variants: expected at least one [variants."CUDA"] table')
        table = {}
    for variant_name, values in table.items():
        where = f"variants.{variant_name!r}"
        if not re.fullmatch(VARIANT_NAME, variant_name):
            problems.append(f"{where}: a variant name is letters, digits, '.', '_' or '-'")
            continue
        if not isinstance(values, dict):
            problems.append(f"{where}: expected a table")
            continue
        image = values.get("base_image")
        if not isinstance(image, str) or not re.fullmatch(r"[^\s]+", image):
            problems.append(f"{where}.base_image: expected an image name such as 'repo/name:tag'")
            continue
        variants.append(Variant(variant_name, image))
    tools, tool_problems = read_tools(data)
    problems += tool_problems
    if problems:
        raise TemplateError(f"{file}: " + "; ".join(problems))
    return Template(
        name=name,
        directory=directory,
        description=description,
        command=tuple(command) if command is not None else None,
        variants=tuple(variants),
        tools=tools,
    )


def load_templates(config: Config) -> dict[str, Template]:
    """The usable templates: allowed by the config, present, and with a valid template.toml.

    A template that is allowed but missing or broken is left out and logged
    (bookings naming it are rejected as unknown); nothing is raised.
    """
    directory = templates_directory(config)
    found: dict[str, Template] = {}
    for name in config.templates.allowed:
        if not re.fullmatch(TEMPLATE_NAME, name):
            log.warning("templates.allowed: %r is not a template name; ignored", name)
            continue
        try:
            found[name] = _read_cached(directory / name)
        except TemplateError as error:
            log.warning("template %s is not usable: %s", name, error)
    return found


def template_variants(config: Config) -> Mapping[str, tuple[str, ...]]:
    """Template name -> its CUDA variant names (first = default), for validating bookings.

    Reads `<templates directory>/<name>/template.toml` of every allowed
    template (a file is read again only when it changed); templates that are
    missing or broken are left out.
    """
    return {
        name: tuple(variant.name for variant in template.variants)
        for name, template in load_templates(config).items()
    }


_cache: dict[Path, tuple[tuple[int, int], Template]] = {}


def _read_cached(directory: Path) -> Template:
    """`read_template`, skipped when the file's modification time and size are unchanged."""
    file = directory / TEMPLATE_FILE
    try:
        status = file.stat()
    except OSError:
        _cache.pop(directory, None)
        return read_template(directory)  # raises with the reason
    signature = (status.st_mtime_ns, status.st_size)
    cached = _cache.get(directory)
    if cached is not None and cached[0] == signature:
        return cached[1]
    template = read_template(directory)
    _cache[directory] = (signature, template)
    return template
