"""`gpuresa run|status|history|plan|demo`: the service and what admins ask of it."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from gpuresa.backends.factory import open_backend
from gpuresa.config.capabilities import host_capabilities
from gpuresa.config.reading import load_config
from gpuresa.config.schema import Invalid, format_duration, parse_duration
from gpuresa.config.sections import Config
from gpuresa.errors import UserError
from gpuresa.inert import echo
from gpuresa.journal.store import Journal
from gpuresa.observe.free import free_report
from gpuresa.outputs.disk import disk_report
from gpuresa.writeback.standing import write_back_status


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = subparsers.add_parser("run", help="run the daemon in the foreground (systemd runs this)")
    run.set_defaults(handler=run_command)

    status = subparsers.add_parser(
        "status", help="running sessions, upcoming and rejected reservations, calendar freshness"
    )
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(handler=status_command)

    history = subparsers.add_parser(
        "history", help="what happened to reservations, from the journal"
    )
    history.add_argument("--user", help="only this login's reservations")
    history.add_argument("--limit", type=int, default=200, help="newest N entries (default 200)")
    history.set_defaults(handler=history_command)

    plan = subparsers.add_parser(
        "plan", help="what the daemon would do now (or --at), doing nothing"
    )
    plan.add_argument("--at", metavar="ISO", help="plan for this instant instead of now")
    plan.set_defaults(handler=plan_command)

    demo = subparsers.add_parser(
        "demo", help="run the service on built-in demo defaults (a booking ~30 s from now)"
    )
    demo.add_argument("--dir", default=".demo", help="where the demo keeps its files")
    demo.add_argument("--start-in", default="30s", help="when the demo booking starts")
    demo.add_argument("--length", default="5m", help="how long the demo booking lasts")
    demo.set_defaults(handler=demo_command)


def run_command(arguments: argparse.Namespace) -> int:
    from gpuresa.daemon import Daemon

    Daemon(load_config(arguments.config)).run()
    # Actions still under way (a Docker call that hangs, say) run on threads the
    # interpreter would wait for at exit; the next start finishes what they began.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)


def parse_instant(text: str, option: str) -> datetime:
    """An ISO 8601 instant; a naive one is read as UTC."""
    try:
        instant = datetime.fromisoformat(text)
    except ValueError:
        raise UserError(
            f"{option}: expected an ISO 8601 time such as 2026-12-01T09:00, got {text!r}"
        ) from None
    return instant if instant.tzinfo else instant.replace(tzinfo=UTC)


def _iso(instant: datetime | None) -> str | None:
    return instant.astimezone(UTC).isoformat() if instant is not None else None


def _open_journal(config: Config) -> Journal:
    from gpuresa.daemon import journal_path

    path = journal_path(config)
    if not path.exists():
        raise UserError(not_run_yet(config, path))
    return Journal(path, read_only=True)


def not_run_yet(config: Config, path: Path) -> str:
    """What `status` and `history` say before the daemon ever ran: what it will do, how to start."""
    calendars = ", ".join(calendar.name for calendar in config.calendars) or "none configured"
    return (
        f"{path}: no journal yet: the daemon has not run with this config "
        f"({config.source}), or ran with another daemon.state_dir. Once started it polls "
        f"the calendars ({calendars}) every {format_duration(config.daemon.poll_interval)} "
        f"and runs the sessions booked on host {config.daemon.host!r}. Start it with "
        "`systemctl enable --now gpuresa` (the unit in systemd/gpuresa.service), or in a "
        f"terminal with `gpuresa --config {config.source} run`; check the file first with "
        "`gpuresa config validate`."
    )


def status_report(config: Config, now: datetime) -> dict[str, Any]:
    """What `gpuresa status --json` prints: sessions from Docker, the rest from the journal."""
    from gpuresa.sessions.errors import RuntimeUnavailable

    host = next((host for host in config.hosts if host.name == config.daemon.host), None)
    report: dict[str, Any] = {
        "host": config.daemon.host,
        "now": _iso(now),
        "engine": host.engine if host else "docker",
    }
    # before any run there is nothing to show, and no engine to ask
    journal = _open_journal(config)
    try:
        sessions = open_backend(config).list_sessions()
        report["docker"] = "ok"
    except RuntimeUnavailable as error:
        sessions = []
        report["docker"] = f"unavailable: {error}"
    except BaseException:
        journal.close()
        raise
    report["sessions"] = [
        {
            "key": session.key,
            "user": session.user,
            "host": session.host,
            "template": session.template,
            "cuda": session.cuda,
            "gpus": list(session.gpu_indices),
            "state": session.state,
            "ssh_port": session.ssh_port,
            "ftp_port": session.ftp_port,
            "since": _iso(session.start),
            "until": _iso(session.end),
            "output": str(session.output_dir),
            # the host uids its user namespace maps 0-65535 onto (one range per
            # session on Podman, the same for all on Docker)
            "host_ids": str(session.id_range) if session.id_range else None,
            # where a scheduler runs it (a Slurm node) and what holds it there
            # (its reservation and job); containers on an engine
            "place": session.place or None,
            "units": list(session.containers),
        }
        for session in sorted(sessions, key=lambda item: (item.start, item.key))
    ]
    try:
        _add_gpu_use(config, report["sessions"])
        running_keys = {session.key for session in sessions}
        report["upcoming"] = [
            {
                "key": reservation.key,
                "user": reservation.user,
                "host": reservation.host,
                "template": reservation.template,
                "cuda": reservation.cuda,
                "gpus": reservation.gpus,
                "start": _iso(reservation.start),
                "end": _iso(reservation.end),
                "state": (state := journal.states.get(reservation.key)),
                # why it failed, as the journal recorded it (the start's error)
                "reason": journal.states.detail(reservation.key) if state == "failed" else None,
            }
            for reservation in journal.reservations.all(ending_after=now)
            if reservation.key not in running_keys and reservation.host == config.daemon.host
        ]
        rejections = journal.reservations.rejections(ending_after=now)
        report["free"] = free_report(
            config, host, sessions, journal, [item.rejection.key for item in rejections], now
        )
        report["rejected"] = [
            {
                "key": record.rejection.key,
                "calendar": record.rejection.calendar,
                "user": record.rejection.user,
                "reason": record.rejection.reason,
            }
            for record in rejections
        ]
        report["calendars"] = {
            name: {
                "last_success": _iso(calendar.last_success),
                "last_error": calendar.last_error,
                "stale_seconds": (
                    round((now - calendar.last_success).total_seconds())
                    if calendar.last_success
                    else None
                ),
            }
            for name, calendar in journal.calendars.all().items()
        }
        # each calendar whose states are written back, and how that stands
        report["write_back"] = write_back_status(journal, config)
        report["outbox"] = outbox_report(journal)
        pid = journal.facts.get("daemon_pid")
        report["daemon_pid"] = int(pid) if pid else None
        report["output_disk"] = disk_report(config)
    finally:
        journal.close()
    return report


def outbox_report(journal: Journal, shown: int = 10) -> dict[str, Any]:
    """The e-mails waiting to be sent: how many, and the oldest `shown` with their last error."""
    waiting = journal.outbox.unsent()
    return {
        "backlog": len(waiting),
        "oldest": [
            {
                "key": message.key,
                "kind": message.kind,
                "address": message.address,
                "subject": message.subject,
                "queued": _iso(message.queued_at),
                "attempts": message.attempts,
                "last_error": message.last_error,
                "next_try": _iso(message.next_try),
            }
            for message in waiting[:shown]
        ],
    }


def _add_gpu_use(config: Config, sessions: list[dict[str, Any]]) -> None:
    """Each session's current and average GPU use (percent), from the telemetry's store."""
    from gpuresa.gpus.usage_store import open_usage

    store = open_usage(config.daemon.state_dir)
    uses = store.uses() if store else {}
    if store:
        store.close()
    for item in sessions:
        use = uses.get(item["key"])
        item["gpu_use_now"] = use.current_utilization if use else None
        item["gpu_use_average"] = use.average_utilization if use else None


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}%"


def status_command(arguments: argparse.Namespace) -> int:
    config = load_config(arguments.config)
    report = status_report(config, datetime.now(UTC))
    if arguments.json:
        print(json.dumps(report, indent=2))
        return 0
    echo(f"host {report['host']}  ({report['engine']}: {report['docker']})")
    host = next((host for host in config.hosts if host.name == config.daemon.host), None)
    # a cluster's sessions run on its nodes: say which, and the jobs there
    on_nodes = host_capabilities(host).remote_nodes
    echo(f"\nrunning sessions ({len(report['sessions'])}):")
    for item in report["sessions"]:
        echo(
            f"  {item['key']:<40} {item['user']:<12} GPUs {item['gpus']!s:<10} "
            f"ssh {item['ssh_port']} ftp {item['ftp_port']}  {item['since']} → {item['until']}"
            f"  [{item['state']}]  GPU use {_percent(item['gpu_use_now'])} now,"
            f" {_percent(item['gpu_use_average'])} average"
            f"  host ids {item['host_ids'] or 'none'}"
            + (f"  node {item['place']}: {', '.join(item['units']) or '-'}" if on_nodes else "")
        )
    echo(f"\nupcoming reservations ({len(report['upcoming'])}):")
    for item in report["upcoming"]:
        echo(
            f"  {item['key']:<40} {item['user']:<12} {item['gpus']} GPU(s) {item['template']}"
            f"  {item['start']} → {item['end']}  [{item['state'] or 'booked'}]"
        )
        _echo_reason(item["reason"])
    # per GPU by index, or intervals of a count where a scheduler places the GPUs
    free = report.get("free", {})
    echo("\nfree from now (what a walk-in booking can get):")
    for item in free.get("gpus", []):
        echo(f"  GPU {item['index']}: {item['text']}")
    for item in free.get("intervals", []):
        echo(f"  {item['text']}")
    disk = report["output_disk"]
    echo(f"\noutput disk: {disk['summary']}  [{disk['level']}]")
    if disk["refusal"]:
        echo(f"  new sessions are refused: {disk['refusal']}")
    echo(f"\nrejected ({len(report['rejected'])}):")
    for item in report["rejected"]:
        echo(f"  {item['key']:<40} {item['reason']}")
    echo("\ncalendars:")
    for name, item in report["calendars"].items():
        freshness = (
            f"last read {item['stale_seconds']} s ago"
            if item["stale_seconds"] is not None
            else "never read"
        )
        error = f"; last error: {item['last_error']}" if item["last_error"] else ""
        written = report.get("write_back", {}).get(name)
        echo(f"  {name}: {freshness}{error}" + (f"; write-back {written}" if written else ""))
    outbox = report["outbox"]
    echo(f"\noutbox: {outbox['backlog']} e-mail(s) waiting")
    for item in outbox["oldest"]:
        error = f"; last error: {item['last_error']}" if item["last_error"] else ""
        echo(
            f"  {item['key']:<40} {item['kind'] or '-':<12} to {item['address']}  queued "
            f"{item['queued']}, {item['attempts']} attempt(s), next {item['next_try']}{error}"
        )
    return 0


def _echo_reason(reason: str | None, shown: int = 15) -> None:
    """A failure's reason under its row, its line breaks kept: every line after the first
    starts with "|", so none (a container's output, say) can read as a row of its own."""
    if not reason:
        return
    lines = reason.split("\n")
    echo(f"      reason: {lines[0]}")
    for line in lines[1:shown]:
        echo(f"      | {line}")
    if len(lines) > shown:
        echo(f"      | ({len(lines) - shown} more line(s): `gpuresa history`)")


def history_command(arguments: argparse.Namespace) -> int:
    config = load_config(arguments.config)
    journal = _open_journal(config)
    try:
        entries = journal.history.entries(user=arguments.user, limit=arguments.limit)
    finally:
        journal.close()
    for entry in entries:
        detail = f"  {entry.detail}" if entry.detail else ""
        echo(
            f"{entry.at.astimezone(UTC):%Y-%m-%d %H:%M:%S}  {entry.key:<40} "
            f"{entry.user or '-':<12} {entry.kind:<6} {entry.what}{detail}"
        )
    if not entries:
        echo("no history" + (f" for {arguments.user}" if arguments.user else ""))
    from gpuresa.gpus.usage_store import open_usage

    store = open_usage(config.daemon.state_dir)
    if store is not None:
        try:
            ended = store.uses(running=False)
        finally:
            store.close()
        shown = [use for use in ended.values() if arguments.user in (None, use.user)]
        if shown:
            echo("\nGPU use of ended sessions:")
        for use in sorted(shown, key=lambda item: item.first):
            echo(
                f"  {use.key:<40} {use.user:<12} average {_percent(use.average_utilization)}"
                f" over {use.samples} sample(s), {use.first:%Y-%m-%d %H:%M} → "
                f"{use.last:%Y-%m-%d %H:%M}"
            )
    return 0


def plan_command(arguments: argparse.Namespace) -> int:
    from gpuresa.backends.factory import open_backend
    from gpuresa.daemon import journal_path
    from gpuresa.fairshare.check import is_rule_refusal
    from gpuresa.fairshare.history import RuleHistory, rule_history
    from gpuresa.journal.store import Journal
    from gpuresa.planning.facts import Inventory, Memory
    from gpuresa.planning.planner import plan
    from gpuresa.reservations.calendars import Calendars

    config = load_config(arguments.config)
    now = parse_instant(arguments.at, "--at") if arguments.at else datetime.now(UTC)
    known: frozenset[str] = frozenset()
    history = RuleHistory()
    if journal_path(config).exists():
        journal = Journal(journal_path(config), read_only=True)
        try:
            known = frozenset(journal.states.all())
            if config.rules.active:
                # the fair-share rules weigh bookings as the daemon does: by first sight
                history = rule_history(journal, config, now)
        finally:
            journal.close()
    report = Calendars(config, persist=False).poll(
        now, first_seen=history.first_seen, holding=history.holding, used=history.used
    )
    runtime = open_backend(config)
    sessions = runtime.list_sessions()
    inventory = Inventory(config.host(), runtime.host_gpus())
    mine = [item for item in report.reservations.reservations if item.host == config.daemon.host]
    actions = plan(mine, sessions, inventory, now, config, Memory(known=known))
    echo(f"at {now.isoformat()} on {config.daemon.host}: {len(actions)} action(s)")
    for action in actions:
        echo(f"  {action.describe()}")
    for rejection in report.reservations.rejected:
        if is_rule_refusal(rejection):
            echo(f"  refuse {rejection.key} ({rejection.user}): {rejection.reason}")
    # sessions of this host name that another installation made: shown, never acted on
    others = getattr(runtime, "foreign_sessions", None)
    for session in others() if callable(others) else []:
        echo(f"  leave {session.key}: another installation's session (never stopped here)")
    return 0


def demo_command(arguments: argparse.Namespace) -> int:
    from gpuresa.commands.demo import run_demo

    try:
        start_in = parse_duration(arguments.start_in)
        length = parse_duration(arguments.length)
    except Invalid as error:
        raise UserError(f"--start-in/--length: {error}") from None
    if length < timedelta(minutes=1):
        raise UserError("--length: the demo booking must last at least 1m")
    run_demo(Path(arguments.dir), start_in, length)
    return 0
