"""`gpuresa bench`: does a session container cost GPU speed? The same workload on both sides.

Nothing is booked: the bench refuses GPUs that a session holds or that the
planner would give to a booking starting within `--window`. The result goes
to the journal under the key `@bench:<host>` (an internal key), so `gpuresa history` shows when
this host was last checked and what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from gpuresa.access import LOWEST_HOST_UID, Account, host_account
from gpuresa.backends.engines import Runtime
from gpuresa.backends.engines.oneshot import OneShot
from gpuresa.backends.factory import open_backend
from gpuresa.backends.udocker import UdockerBackend
from gpuresa.backends.udocker.tools import as_user
from gpuresa.bench.holders import gpu_holders
from gpuresa.bench.report import Comparison, Sample, compare, render, run_line, summary
from gpuresa.bench.runner import ContainerSide, HostSide, check_framework, run_bench
from gpuresa.bench.udocker_side import UdockerSide
from gpuresa.bench.workloads import (
    SCRIPTS,
    WORKLOAD_NAMES,
    Workload,
    builtin,
    framework_of,
    gpu_counts,
    shell_command,
)
from gpuresa.commands.session_commands import parse_gpu_list
from gpuresa.commands.template_commands import docker_errors
from gpuresa.config.reading import load_config
from gpuresa.config.schema import Invalid, parse_duration
from gpuresa.config.sections import Config
from gpuresa.errors import UserError
from gpuresa.model import Reservation, bench_key
from gpuresa.planning.facts import Inventory
from gpuresa.sessions.templates import resolve_template

DEFAULT_RUNS = 3
DEFAULT_WINDOW = "30m"
DEFAULT_TIMEOUT = 900.0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="the same workload on the host and in a session container: does the container "
        "cost speed?",
        description="Run a workload on the host and in a container of a session template, "
        "interleaved, and compare: images/s of ResNet-50 training on 1, 2 and all the GPUs "
        "(PyTorch or TensorFlow, as the template has), pure-Python matrix products without "
        "GPUs, or your own --command (its last 'result: N unit' line, else its last number, "
        "is the measurement). Nothing is booked.",
    )
    parser.add_argument("--template", help="the session template (default: pytorch if allowed)")
    parser.add_argument("--cuda", metavar="VERSION", help="its CUDA variant (default: preferred)")
    parser.add_argument(
        "--gpus", metavar="0,1", help="these GPU indices (default: every GPU of the host)"
    )
    parser.add_argument(
        "--runs", type=int, default=DEFAULT_RUNS, help=f"runs per side (default {DEFAULT_RUNS})"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    parser.add_argument(
        "--command",
        metavar="CMD",
        help="measure this shell command instead (run with /bin/sh -c on both sides; "
        "$GPURESA_BENCH_GPUS holds its GPU count)",
    )
    parser.add_argument(
        "--workload",
        choices=WORKLOAD_NAMES,
        default="auto",
        help="auto: the template's framework with GPUs, cpu without",
    )
    parser.add_argument(
        "--workload-args",
        metavar="ARGS",
        default="",
        help='more arguments for the shipped workload, such as "--batch-size 128 --precision amp"',
    )
    parser.add_argument(
        "--host-python",
        metavar="PATH",
        default="python3",
        help="the host's Python for the shipped workloads (default: python3)",
    )
    parser.add_argument(
        "--window",
        default=DEFAULT_WINDOW,
        help=f"refuse GPUs of bookings that start within this time (default {DEFAULT_WINDOW})",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"seconds one run may take (default {DEFAULT_TIMEOUT:.0f})",
    )
    parser.add_argument(
        "--user",
        metavar="LOGIN",
        help="on a udocker host: the login both sides run as (udocker sessions run as theirs)",
    )
    parser.set_defaults(handler=bench_command)


def choose_gpus(text: str | None, available: Sequence[int], config: Config) -> tuple[int, ...]:
    """The GPUs to measure: `--gpus`, else every GPU of the host; raises `UserError`."""
    host = config.host()
    if text is None:
        return tuple(available)
    chosen = parse_gpu_list(text)
    if chosen and host.gpu_mode == "none":
        raise UserError(f"--gpus {text}: host {host.name} has gpu_mode 'none' (no GPUs to give)")
    if len(set(chosen)) != len(chosen):
        raise UserError(f"--gpus {text}: an index repeats")
    unknown = sorted(set(chosen) - set(available))
    if unknown:
        raise UserError(
            f"--gpus {text}: host {host.name} has no GPU {', '.join(map(str, unknown))} "
            f"(it has {', '.join(map(str, available)) or 'none'})"
        )
    return chosen


def choose_workload(arguments: argparse.Namespace, template: str, gpus: Sequence[int]) -> Workload:
    """The workload the options ask for (auto: the template's framework with GPUs, else cpu)."""
    if arguments.command is not None:
        if arguments.workload != "auto" or arguments.workload_args:
            raise UserError("--command replaces the shipped workloads: drop --workload(-args)")
        return shell_command(arguments.command)
    name = arguments.workload
    if name == "auto":
        name = framework_of(template) if gpus else "cpu"
    try:
        extra = shlex.split(arguments.workload_args)
    except ValueError as error:
        raise UserError(f"--workload-args: {error}") from None
    return builtin(name, extra)


def refuse_held(
    gpus: Sequence[int], holders: dict[int, str], available: Sequence[int], window: str
) -> None:
    """Raise `UserError` naming who holds any of `gpus` (and which GPUs are free)."""
    held = [index for index in gpus if index in holders]
    if not held:
        return
    who = "; ".join(f"GPU {index}: {holders[index]}" for index in held)
    free = [index for index in available if index not in holders]
    advice = (
        f"choose free ones with --gpus {','.join(map(str, free))}"
        if free
        else "wait until they are free"
    )
    raise UserError(
        f"GPU(s) {','.join(map(str, held))} are held now or within {window} ({who}); "
        f"a bench never shares GPUs with a session: {advice}"
    )


def _reservations(config: Config) -> list[Reservation]:
    """The bookings the daemon last read from the calendars (none when it never ran)."""
    from gpuresa.daemon import journal_path
    from gpuresa.journal.store import Journal

    path = journal_path(config)
    if not path.exists():
        return []
    journal = Journal(path, read_only=True)
    try:
        return journal.reservations.all(ending_after=datetime.now(UTC))
    finally:
        journal.close()


def record(config: Config, action: str, result: str, detail: str, stream: TextIO) -> None:
    """Journal the bench under `@bench:<host>`; a journal that cannot be written is warned of."""
    from gpuresa.daemon import journal_path
    from gpuresa.journal.store import Journal

    try:
        journal = Journal(journal_path(config))
        try:
            key = bench_key(config.daemon.host)
            journal.history.record_action(key, action, datetime.now(UTC), result, detail)
        finally:
            journal.close()
    except UserError as error:
        print(f"gpuresa: warning: the result was not journaled: {error}", file=stream)


@contextlib.contextmanager
def shipped_scripts() -> Iterator[Path]:
    """A copy of the workload scripts that a container's remapped root can read.

    The package may sit where only the host's root can read (a home folder);
    the copy is world-readable (0755 folder, 0644 files) and removed after.
    """
    folder = Path(tempfile.mkdtemp(prefix="gpuresa-bench-"))
    try:
        folder.chmod(0o755)
        for script in SCRIPTS.glob("*.py"):
            target = folder / script.name
            shutil.copyfile(script, target)
            target.chmod(0o644)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def bench_command(arguments: argparse.Namespace) -> int:
    config = load_config(arguments.config)
    if arguments.runs < 1:
        raise UserError("--runs must be at least 1")
    if arguments.timeout <= 0:
        raise UserError("--timeout must be positive")
    try:
        window = parse_duration(arguments.window)
    except Invalid as error:
        raise UserError(f"--window: {error}") from None
    # with --json, stdout carries the JSON alone: progress goes to stderr
    out = sys.stderr if arguments.json else sys.stdout
    backend = open_backend(config)
    if not isinstance(backend, Runtime | UdockerBackend):
        raise UserError("gpuresa bench runs on one host: on a cluster, run it on a node")
    runtime = backend
    template = arguments.template or (
        "pytorch" if "pytorch" in config.templates.allowed else config.templates.allowed[0]
    )
    _, variant = resolve_template(config.templates, template, arguments.cuda)
    with docker_errors():
        available = runtime.host_gpus()
        gpus = choose_gpus(arguments.gpus, available, config)
        now = datetime.now(UTC)
        sessions = runtime.list_sessions()
        holders = gpu_holders(
            sessions,
            _reservations(config),
            Inventory(config.host(), tuple(available)),
            now,
            now + window,
            config,
        )
        refuse_held(gpus, holders, available, arguments.window)
        workload = choose_workload(arguments, template, gpus)
        if sessions:
            print(
                f"note: {len(sessions)} session(s) run on {config.daemon.host}; "
                "they may slow both sides alike",
                file=out,
            )
        action = (
            f"bench {workload.name} on {template} {variant.name}, "
            f"GPUs {','.join(map(str, gpus)) or 'none'}"
        )
        print(
            f"{action}: {workload.describe()}, {arguments.runs} run(s) per side and GPU count",
            file=out,
        )
        started = datetime.now(UTC)
        try:
            samples, info, image = _run(arguments, config, runtime, template, workload, gpus, out)
        except UserError as error:
            record(config, action, "failed", str(error).splitlines()[0], out)
            raise
    comparisons = compare(samples, info)
    record(config, action, "ok", summary(comparisons), out)
    if arguments.json:
        report = _json_report(config, arguments, template, variant.name, image, workload, gpus)
        report.update(_json_results(samples, comparisons, info, started))
        print(json.dumps(report, indent=2))
    else:
        print("what ran:")
        for line in info:
            print(f"  {line}")
        print(render(comparisons))
    return 0


def _run(
    arguments: argparse.Namespace,
    config: Config,
    runtime: Runtime | UdockerBackend,
    template: str,
    workload: Workload,
    gpus: tuple[int, ...],
    out: TextIO,
) -> tuple[list[Sample], list[str], str]:
    """Check the host's framework, build the image if missing, and run the bench."""
    account = bench_account(arguments.user) if isinstance(runtime, UdockerBackend) else None
    with shipped_scripts() as scripts:
        prefix = as_user(account, []) if account is not None else []
        host = HostSide(scripts, arguments.host_python, arguments.timeout, prefix)
        # before any image is built: a host without the framework is told at once
        check_framework(host, workload, workload.check_argv(scripts, arguments.host_python))
        image = runtime.ensure_image(template, arguments.cuda)
        container: ContainerSide | UdockerSide
        if isinstance(runtime, UdockerBackend):
            assert account is not None
            container = UdockerSide(runtime, account, scripts, arguments.timeout)
            image = container.make(template, arguments.cuda)
        else:
            oneshot = OneShot(config, runtime.engine)
            for name in oneshot.remove_leftovers():
                print(f"removed the container {name} of an earlier bench", file=out)
            container = ContainerSide(oneshot, image, scripts, arguments.timeout)

        def progress(sample: Sample) -> None:
            print(run_line(sample), file=out, flush=True)

        print("runs:", file=out)
        try:
            samples, info = run_bench(
                workload, gpus, gpu_counts(gpus), arguments.runs, [host, container], progress
            )
        finally:
            if isinstance(container, UdockerSide):
                container.remove()
    return samples, info, image


def bench_account(login: str | None) -> Account:
    """The host account a udocker bench runs as (`--user`); `UserError` naming what is wrong."""
    if not login:
        raise UserError("on a udocker host, name the login both sides run as: --user LOGIN")
    account = host_account(login)
    if account is None or account.uid < LOWEST_HOST_UID:
        raise UserError(f"--user {login}: no host account of a user by that name")
    return account


def _json_report(
    config: Config,
    arguments: argparse.Namespace,
    template: str,
    cuda: str,
    image: str,
    workload: Workload,
    gpus: Sequence[int],
) -> dict[str, Any]:
    return {
        "host": config.daemon.host,
        "template": template,
        "cuda": cuda,
        "image": image,
        "workload": workload.name,
        "command": workload.shell,
        "gpus": list(gpus),
        "runs": arguments.runs,
    }


def _json_results(
    samples: Sequence[Sample],
    comparisons: Sequence[Comparison],
    info: Sequence[str],
    started: datetime,
) -> dict[str, Any]:
    return {
        "started": started.isoformat(),
        "finished": datetime.now(UTC).isoformat(),
        "info": list(info),
        "samples": [
            {
                "side": sample.side,
                "gpus": list(sample.gpus),
                "run": sample.index + 1,
                "value": sample.value,
                "unit": sample.unit,
                "seconds": round(sample.seconds, 3),
            }
            for sample in samples
        ],
        "comparisons": [comparison.as_dict() for comparison in comparisons],
        "within_spread": all(comparison.within_spread for comparison in comparisons),
    }
