"""`gpuresa templates list|build`: the session templates and their images."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from gpuresa.backends.engines import Runtime
from gpuresa.config.reading import load_config
from gpuresa.errors import UserError
from gpuresa.sessions.errors import RuntimeUnavailable
from gpuresa.sessions.templates import (
    available_templates,
    resolve_template,
    templates_directory,
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("templates", help="list or build the session templates")
    actions = parser.add_subparsers(dest="templates_command", metavar="ACTION", required=True)
    listing = actions.add_parser(
        "list", help="the templates, their CUDA variants and whether bookings may use them"
    )
    listing.set_defaults(handler=list_command)
    build = actions.add_parser(
        "build",
        help="build template images now (default: every variant of every allowed template)",
    )
    build.add_argument("name", nargs="?", metavar="NAME", help="one template")
    build.add_argument("--cuda", metavar="VERSION", help="one CUDA variant of NAME")
    build.set_defaults(handler=build_command)


@contextlib.contextmanager
def docker_errors() -> Iterator[None]:
    """Turn an absent Docker engine into one line of advice."""
    try:
        yield
    except RuntimeUnavailable as error:
        raise UserError(
            f"{error}; is the Docker engine running (systemctl status docker)?"
        ) from None


def list_command(arguments: argparse.Namespace) -> int:
    config = load_config(arguments.config)
    templates = available_templates(config.templates)
    directory = templates_directory(config.templates)
    if not templates:
        print(f"no templates in {directory}")
        return 0
    rows = [("TEMPLATE", "ALLOWED", "CUDA (preferred first)", "DESCRIPTION")]
    for template in templates:
        allowed = "yes" if template.name in config.templates.allowed else "no"
        variants = ", ".join(variant.name for variant in template.variants)
        rows.append((template.name, allowed, variants, template.description))
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)), end=""
        )
        print(f"  {row[3]}".rstrip())
    if config.templates.base_image:
        print(f"\nimages build on {config.templates.base_image} (templates.base_image)")
    print(f"templates folder: {directory}")
    return 0


def build_command(arguments: argparse.Namespace) -> int:
    config = load_config(arguments.config)
    if arguments.cuda and not arguments.name:
        raise UserError("--cuda needs a template NAME (gpuresa templates build NAME --cuda V)")
    if arguments.name:
        template, variant = resolve_template(config.templates, arguments.name, arguments.cuda)
        wanted = (
            [(template.name, variant.name)]
            if arguments.cuda
            else [(template.name, each.name) for each in template.variants]
        )
    else:
        present = {template.name: template for template in available_templates(config.templates)}
        wanted = [
            (name, variant.name)
            for name in config.templates.allowed
            if name in present
            for variant in present[name].variants
        ]
    if not wanted:
        raise UserError("no allowed template to build (templates.allowed)")
    runtime = Runtime(config)
    with docker_errors():
        for name, cuda in wanted:
            print(f"{name} (CUDA {cuda}): {runtime.ensure_image(name, cuda)}", flush=True)
        print(f"FTP sidecar: {runtime.ensure_ftp_image()}")
    return 0
