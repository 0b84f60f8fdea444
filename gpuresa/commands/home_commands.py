"""`gpuresa homes list`: each user's lasting home on this host (see docs/homes.md)."""

from __future__ import annotations

import argparse
import json

from gpuresa.commands.output_commands import human_size
from gpuresa.config.reading import load_config
from gpuresa.homes.listing import homes
from gpuresa.homes.paths import enabled, home_root
from gpuresa.inert import echo
from gpuresa.mail.wording import format_time


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("homes", help="each user's lasting home on this host")
    actions = parser.add_subparsers(dest="homes_command", metavar="ACTION", required=True)
    listing = actions.add_parser("list", help="every home, its use and when it is removed")
    listing.add_argument("--json", action="store_true", help="JSON instead of a table")
    listing.set_defaults(handler=list_command)


def list_command(arguments: argparse.Namespace) -> int:
    config = load_config(arguments.config)
    found = homes(config)
    if arguments.json:
        print(json.dumps([home.as_json() for home in found], indent=2))
        return 0
    if not enabled(config):
        print('lasting homes are off ([storage] home_quota = "off")')
        return 0
    timezone = config.reservations.timezone
    print(f"homes in {home_root(config)}: {len(found)}")
    if not found:
        return 0
    print(f"{'login':<16} {'used':>10} {'cap':>10}  {'last use':<22} removal")
    for home in found:
        if home.sessions:
            removal = f"in use by {home.sessions} session(s)"
        elif home.removal is None:
            removal = "kept"
        else:
            told = ", user told" if home.noticed else ""
            removal = format_time(home.removal, timezone) + told
        echo(
            f"{home.login:<16} {human_size(home.used):>10} {human_size(home.cap):>10}  "
            f"{format_time(home.last_use, timezone):<22} {removal}"
        )
    return 0
