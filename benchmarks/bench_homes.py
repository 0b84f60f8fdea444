"""What a lasting home costs a session, step by step (`gpuresa.homes.store`).

Real images, loop mounts and idmapped views in a folder of its own, removed at
the end; no engine. Each step runs `--runs` times, interleaved; prints the
median and the slowest, in milliseconds:

- first use: the image made (sparse, `mkfs.ext4`), mounted, the view mapped;
- next use: the image mounted again, the view mapped (a user's next booking);
- a second session at once: its view alone (the home is mounted already);
- a prepared session started again: the view checked, nothing mounted
  (what a prepared start pays: the rest is done ahead, at prepare);
- end of a session while another runs: its view unmounted;
- end of the last session: the view and the home unmounted.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gpuresa.config.reading import parse_config
from gpuresa.config.sections import Config
from gpuresa.homes.paths import image_path
from gpuresa.homes.store import attach, detach, home_maps, reserve_view
from gpuresa.model import IdRange

MAPS = home_maps(IdRange(100000, 100000, 65536))
UID = 1000


def timed(step: Callable[[], object]) -> float:
    started = time.perf_counter()
    step()
    return (time.perf_counter() - started) * 1000


def show(config: Config, key: str) -> None:
    view = reserve_view(config, "alice", key)
    assert view is not None
    attach(config, "alice", key, UID, MAPS, view)


def one_round(config: Config, times: dict[str, list[float]]) -> None:
    image_path(config, "alice").unlink(missing_ok=True)
    times["first use (image made)"].append(timed(lambda: show(config, "a")))
    times["end of the last session"].append(timed(lambda: detach(config, "a")))
    times["next use"].append(timed(lambda: show(config, "a")))
    times["a second session at once"].append(timed(lambda: show(config, "b")))
    times["a prepared session started"].append(timed(lambda: show(config, "b")))
    times["end while another runs"].append(timed(lambda: detach(config, "b")))
    detach(config, "a")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--quota", default="50G", help="each home's cap (default 50G)")
    arguments = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gpuresa-bench-homes-", dir="/var/tmp"))
    config = parse_config(
        {
            "daemon": {"state_dir": str(root / "state")},
            "storage": {"output_root": str(root / "output"), "home_quota": arguments.quota},
        },
        "bench.toml",
    )
    names = (
        "first use (image made)", "next use", "a second session at once",
        "a prepared session started", "end while another runs", "end of the last session",
    )  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in names}
    try:
        for _ in range(arguments.runs):
            one_round(config, times)
        used = image_path(config, "alice").stat().st_blocks * 512
    finally:
        detach(config, "a")
        detach(config, "b")
        shutil.rmtree(root, ignore_errors=True)
    print(f"homes ({arguments.quota} images, {arguments.runs} runs): milliseconds")
    print(f"{'step':<30} {'median':>8} {'slowest':>8}")
    for name in names:
        print(f"{name:<30} {statistics.median(times[name]):>8.1f} {max(times[name]):>8.1f}")
    print(f"a new home takes {used / 2**20:.1f} MiB on disk")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
