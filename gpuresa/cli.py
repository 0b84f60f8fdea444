"""The `gpuresa` command: argument parsing, logging, and the one place errors become advice."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence

from gpuresa import __version__
from gpuresa.errors import UserError
from gpuresa.logs import setup_logging

log = logging.getLogger(__name__)

# Each module adds its own subcommands through `register(subparsers)`, so a new
# command is a new module and one line here.
COMMAND_MODULES = (
    "gpuresa.commands.config_commands",
    "gpuresa.commands.reservation_commands",
    "gpuresa.commands.template_commands",
    "gpuresa.commands.session_commands",
    "gpuresa.commands.daemon_commands",
    "gpuresa.commands.bench_commands",
    "gpuresa.commands.output_commands",
    "gpuresa.commands.home_commands",
    "gpuresa.commands.trust_commands",
    "gpuresa.commands.host_commands",
    "gpuresa.commands.report_commands",
)

Handler = Callable[[argparse.Namespace], int | None]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuresa",
        description="Calendar-driven GPU reservations: bookings become SSH-ready sessions.",
    )
    parser.add_argument("--version", action="version", version=f"gpuresa {__version__}")
    _add_common_options(parser, top=True)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name != module_name:
                raise
            continue
        module.register(subparsers)
    _add_common_options_below(parser)
    return parser


def _add_common_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """--config, -v and -q, accepted before and after the subcommand.

    Below the top they default to "not given" (SUPPRESS), so the top's value
    stands unless the option follows the subcommand (`gpuresa config validate --config X`).
    """
    config_default: object = None if top else argparse.SUPPRESS
    count_default: object = 0 if top else argparse.SUPPRESS
    parser.add_argument(
        "--config",
        metavar="PATH",
        default=config_default,
        help="config file (default: $GPURESA_CONFIG, else /etc/gpuresa/config.toml)",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=count_default, help="more logging"
    )
    parser.add_argument("-q", "--quiet", action="count", default=count_default, help="less logging")


def _add_common_options_below(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in set(action.choices.values()):
                _add_common_options(subparser, top=False)
                _add_common_options_below(subparser)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    arguments = parser.parse_args(argv)
    setup_logging(arguments.verbose - arguments.quiet)
    handler: Handler = arguments.handler
    try:
        return handler(arguments) or 0
    except UserError as error:
        print(f"gpuresa: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print("gpuresa: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
